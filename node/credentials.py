"""A node's key and certificate, kept in its state dir, and the TLS material they give its channels.

The key is made on the first start (`node.key`, 0600) and never leaves the state dir: each join sends a
signing request for it, and the coordinator answers with a certificate whose common name is the node id,
signed by the job CA (`node.pem`, with the CA as `job-ca.pem`). Until a node holds a certificate of this job,
it reaches the coordinator with a bootstrap certificate derived from the job token, which may only join.

Peer links use one `MutualTls` shared by the node's peer server and its channels to peers: verified against
the job CA both ways, without the job token.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from atoll.fsutil import atomic_write_bytes
from atoll.rpc import MutualTls, RpcOptions, TlsIdentity
from atoll.tls import (CA_COMMON_NAME, NODE_NAME, CertificateAuthority, CertificateError, bootstrap_client, cert_from_pem,
                       cert_to_pem, common_name, coordinator_name, key_from_pem, key_to_pem, make_csr, new_key,
                       public_key_id, self_signed)

log = logging.getLogger("atoll.node.credentials")

KEY_FILE = "node.key"
CERT_FILE = "node.pem"
JOB_CA_FILE = "job-ca.pem"


class NodeCredentials:
    """The node's key, its certificate once a join brought one, and the TLS options built on them."""

    def __init__(self, state_dir: Path, *, node_id: str, token: str, coordinator_ca_pem: bytes):
        self.state_dir = Path(state_dir)
        self.node_id = node_id
        self.token = token
        self.coordinator_ca_pem = coordinator_ca_pem
        cert_from_pem(coordinator_ca_pem, "--tls-ca")  # one clear line for a wrong file, before any dialling
        key_path = self.state_dir / KEY_FILE
        if key_path.is_file():
            self._key = key_from_pem(key_path.read_bytes(), str(key_path))
        else:
            self._key = new_key()
            atomic_write_bytes(key_path, key_to_pem(self._key), mode=0o600)
        self.key_pem = key_to_pem(self._key)
        self._cert_pem: bytes | None = None
        self._job_ca_pem: bytes | None = None
        self._load_certificate()
        # until the job CA is known, peers are verified against the coordinator's CA (the same CA unless the
        # coordinator serves a certificate of its own); the placeholder identity is trusted by nobody
        roots = self._job_ca_pem or coordinator_ca_pem
        identity = (TlsIdentity(self.key_pem, self._cert_pem) if self._cert_pem is not None
                    else TlsIdentity(self.key_pem, cert_to_pem(self_signed(self._key, f"{node_id} (not joined)"))))
        self.peer_tls = MutualTls(roots_pem=roots, identity=identity, client_roots_pem=roots, server_name=NODE_NAME,
                                  send_token=False)

    def _load_certificate(self) -> None:
        """Take the certificate of an earlier run if this coordinator's CA issued it for this id and key."""
        cert_path, ca_path = self.state_dir / CERT_FILE, self.state_dir / JOB_CA_FILE
        if not (cert_path.is_file() and ca_path.is_file()):
            return
        try:
            cert_pem, ca_pem = cert_path.read_bytes(), ca_path.read_bytes()
            self._check(cert_pem, ca_pem)
        except CertificateError as e:
            log.info("not using the certificate in %s (%s); the join brings a new one", cert_path, e)
            return
        if ca_pem != self.coordinator_ca_pem:
            return  # another coordinator's CA, or the operator's own: the join brings this job's
        self._cert_pem, self._job_ca_pem = cert_pem, ca_pem

    def _check(self, cert_pem: bytes, ca_pem: bytes) -> None:
        cert = cert_from_pem(cert_pem, "the node certificate")
        ca_cert = cert_from_pem(ca_pem, "the job CA")
        if not CertificateAuthority(self._key, ca_cert).issued(cert):
            raise CertificateError("the node certificate is not signed by the job CA")
        if common_name(cert) != self.node_id:
            raise CertificateError(f"the node certificate names {common_name(cert)!r}, not {self.node_id}")
        if public_key_id(cert.public_key()) != public_key_id(self._key.public_key()):  # type: ignore[arg-type]
            raise CertificateError("the node certificate is for another key")

    @property
    def has_certificate(self) -> bool:
        return self._cert_pem is not None

    def csr(self, challenge: str = "") -> bytes:
        """A signing request for this node's key, carrying the coordinator's join `challenge` ("": none)."""
        return make_csr(self._key, self.node_id, challenge)

    def coordinator_rpc(self, base: RpcOptions) -> RpcOptions:
        """Options of a channel to the coordinator: the node certificate once held, else a bootstrap one."""
        if self._cert_pem is not None:
            identity = TlsIdentity(self.key_pem, self._cert_pem)
        else:
            identity = TlsIdentity(*bootstrap_client(self.token))
        return replace(base, mtls=MutualTls(roots_pem=self.coordinator_ca_pem, identity=identity,
                                            server_name=coordinator_name(self.coordinator_ca_pem)))

    def peer_rpc(self, base: RpcOptions) -> RpcOptions:
        return replace(base, mtls=self.peer_tls)

    def accept(self, certificate_pem: bytes, ca_pem: bytes) -> None:
        """Keep the certificate a join brought (after checking it) and use it from now on."""
        if not certificate_pem or not ca_pem:
            raise CertificateError("the coordinator's join reply carries no certificate; it runs --insecure, so "
                                   "start this node with --insecure too (or the coordinator without it)")
        self._check(certificate_pem, ca_pem)
        if common_name(cert_from_pem(ca_pem, "the job CA")) != CA_COMMON_NAME:
            raise CertificateError("the join reply's CA is not an Atoll job CA")
        atomic_write_bytes(self.state_dir / CERT_FILE, certificate_pem)
        atomic_write_bytes(self.state_dir / JOB_CA_FILE, ca_pem)
        self._cert_pem, self._job_ca_pem = certificate_pem, ca_pem
        self.peer_tls.update(TlsIdentity(self.key_pem, certificate_pem), roots_pem=ca_pem)

