"""The coordinator's certificate authority: its files in the state dir, node certificates and who holds which id.

The CA key, the coordinator's server key and their certificates are made on the first start and kept in the
state dir (keys 0600, every file written atomically), so a restarted coordinator keeps its CA and the nodes'
certificates stay valid. Which public key each node id was issued to is kept in `identities.db` (SQLite), so a
different key cannot take over the id of a live node, before or after a restart.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from atoll.fsutil import atomic_write_bytes
from atoll.rpc import MutualTls, TlsIdentity
from atoll.tls import (BOOTSTRAP_CLIENT_NAME, CertificateAuthority, CertificateError, bootstrap_ca, cert_from_pem,
                       cert_to_pem, common_name, fingerprint, key_from_pem, key_to_pem, new_key, parse_csr,
                       public_key_id)

log = logging.getLogger("atoll.coordinator.ca")

CA_KEY, CA_CERT = "ca.key", "ca.pem"
SERVER_KEY, SERVER_CERT = "server.key", "server.pem"
IDENTITIES_DB = "identities.db"
_CALLER_CACHE = 65536
"""Certificates whose caller is remembered (one per live node; a miss parses and checks a signature, about 1 ms)."""


@dataclass(frozen=True)
class Caller:
    """Who a call comes from. `kind`: "node" (a node certificate of this job's CA: `node_id` is who),
    "bootstrap" (a certificate derived from the job token: may join and read the status), or "plaintext"
    (no TLS at all: the insecure mode, where nobody can be told apart)."""

    kind: str
    node_id: str = ""


PLAINTEXT = Caller("plaintext")


class KeyBindings:
    """node id -> the public key (SHA-256 of its DER form) its newest certificate was issued for."""

    def __init__(self, path: Path | None):
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path) if path else ":memory:", check_same_thread=False, isolation_level=None)
        try:
            self._db.execute("CREATE TABLE IF NOT EXISTS bindings (node_id TEXT PRIMARY KEY, key_sha256 TEXT NOT NULL, "
                             "issued_unix REAL NOT NULL)")
        except sqlite3.DatabaseError as e:
            raise CertificateError(f"{path} is not an identities database ({e}); it records which key holds each "
                                   f"node id: restore it from a backup, or delete it and restart every node") from None

    def get(self, node_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT key_sha256 FROM bindings WHERE node_id = ?", (node_id,)).fetchone()
        return row[0] if row else None

    def put(self, node_id: str, key_id: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO bindings VALUES (?, ?, ?)", (node_id, key_id, time.time()))

    def close(self) -> None:
        with self._lock:
            self._db.close()


class JobAuthority:
    """The job CA as the coordinator uses it: its server credentials, node certificates, callers' identities."""

    def __init__(self, ca: CertificateAuthority, server: TlsIdentity, bindings: KeyBindings,
                 ca_path: Path | None = None):
        self.ca = ca
        self.server = server
        self.bindings = bindings
        self.ca_path = ca_path
        """Where the CA certificate is kept (nodes need a copy), None for an in-memory authority."""
        self._callers: OrderedDict[bytes, Caller] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def in_memory(cls) -> JobAuthority:
        ca = CertificateAuthority.create()
        key = new_key()
        return cls(ca, TlsIdentity(key_to_pem(key), cert_to_pem(ca.server_certificate(key))), KeyBindings(None))

    @classmethod
    def load_or_create(cls, state_dir: Path) -> JobAuthority:
        """The CA kept in `state_dir`, made there on the first start."""
        state_dir = Path(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        ca_key, ca_cert = state_dir / CA_KEY, state_dir / CA_CERT
        if ca_key.exists() != ca_cert.exists():
            have, lost = (ca_key, ca_cert) if ca_key.exists() else (ca_cert, ca_key)
            raise CertificateError(f"{have} exists but {lost} does not: restore {lost.name} from a backup (or delete "
                                   f"{have.name} too, start a new CA and restart every node with its ca.pem)")
        if not ca_key.exists():
            ca = CertificateAuthority.create()
            _write_secret(ca_key, key_to_pem(ca.key))
            atomic_write_bytes(ca_cert, ca.cert_pem)
        else:
            ca = CertificateAuthority(key_from_pem(ca_key.read_bytes(), str(ca_key)),
                                      cert_from_pem(ca_cert.read_bytes(), str(ca_cert)))
            if public_key_id(ca.key.public_key()) != public_key_id(ca.cert.public_key()):  # type: ignore[arg-type]
                raise CertificateError(f"{ca_key} and {ca_cert} do not belong together; restore both from a backup")
        server_key, server_cert = state_dir / SERVER_KEY, state_dir / SERVER_CERT
        server = None
        if server_key.exists() and server_cert.exists():
            try:
                cert = cert_from_pem(server_cert.read_bytes(), str(server_cert))
                key = key_from_pem(server_key.read_bytes(), str(server_key))
            except CertificateError as e:  # the server's identity is the CA's to issue again: nothing is lost
                log.warning("%s; making a new server key and certificate under the job CA", e)
            else:
                if ca.issued(cert) and public_key_id(key.public_key()) == public_key_id(cert.public_key()):
                    server = TlsIdentity(server_key.read_bytes(), server_cert.read_bytes())
        if server is None:  # first start, a certificate of an earlier CA, or a damaged pair: make one under this CA
            key = new_key()
            _write_secret(server_key, key_to_pem(key))
            pem = cert_to_pem(ca.server_certificate(key))
            atomic_write_bytes(server_cert, pem)
            server = TlsIdentity(key_to_pem(key), pem)
        return cls(ca, server, KeyBindings(state_dir / IDENTITIES_DB), ca_path=ca_cert)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.ca.cert)

    def server_tls(self, token: str, server: TlsIdentity | None = None) -> MutualTls:
        """Server credentials: `server` (default: the CA-signed one) and client certificates required, signed by
        the job CA (nodes) or by the token's bootstrap CA (joining nodes, `atoll status`). The CA-signed one is
        presented with the CA after it, so a node given only the CA's fingerprint (`--ca-hash`) can take the CA
        from the handshake and check it."""
        if server is None:
            server = self.server
            if self.ca.cert_pem not in server.cert_pem:
                server = TlsIdentity(server.key_pem, server.cert_pem + self.ca.cert_pem)
        return MutualTls(roots_pem=self.ca.cert_pem, identity=server,
                         client_roots_pem=self.ca.cert_pem + bootstrap_ca(token).cert_pem)

    def caller(self, cert_pem: bytes | None) -> Caller:
        """Who presented `cert_pem` (TLS has verified it against the job CA or the bootstrap CA already)."""
        if cert_pem is None:
            raise CertificateError("the call carries no client certificate")
        with self._lock:
            known = self._callers.get(cert_pem)
            if known is not None:
                self._callers.move_to_end(cert_pem)
                return known
        cert = cert_from_pem(cert_pem, "the client certificate")
        # the issuer's signature is checked, not its name alone: a token holder signs with the bootstrap key
        who = Caller("node", common_name(cert)) if self.ca.issued(cert) else Caller("bootstrap", BOOTSTRAP_CLIENT_NAME)
        with self._lock:
            self._callers[cert_pem] = who
            while len(self._callers) > _CALLER_CACHE:
                self._callers.popitem(last=False)
        return who

    def csr_key_id(self, csr_pem: bytes) -> str:
        return public_key_id(parse_csr(csr_pem).public_key())  # type: ignore[arg-type]

    def cert_key_id(self, cert_pem: bytes) -> str:
        return public_key_id(cert_from_pem(cert_pem, "the client certificate").public_key())  # type: ignore[arg-type]

    def issue(self, node_id: str, csr_pem: bytes) -> bytes:
        """Sign a certificate for `node_id` on the key of `csr_pem`, and bind the id to that key."""
        cert: x509.Certificate = self.ca.sign_node(csr_pem, node_id)
        self.bindings.put(node_id, public_key_id(cert.public_key()))  # type: ignore[arg-type]
        return cert_to_pem(cert)

    def close(self) -> None:
        self.bindings.close()


def _write_secret(path: Path, data: bytes) -> None:
    """Write a private key atomically, readable by its owner only (from the first byte: umask while writing)."""
    atomic_write_bytes(path, data, mode=0o600)
