"""Joining with the job CA's fingerprint instead of a copy of its file (as `kubeadm join --discovery-token-ca-cert-hash`).

The coordinator presents its certificate chain (its server certificate, then the job CA) in every TLS handshake
and prints a join command carrying the CA's fingerprint (`atoll.tls.fingerprint`: SHA-256 of its DER form). A
node started with `--ca-hash sha256:<hex>` opens one TLS connection to the coordinator without trusting it yet
(presenting the bootstrap certificate its job token gives, as the coordinator asks every client for one), takes
from the chain the certificate whose fingerprint is the one given, and keeps it only if it is a CA that signed
the server's certificate. From then on everything is verified against that CA, as with `--tls-ca`: someone who
sits between the node and the coordinator, even a token holder, cannot pass off a CA of their own, whose
fingerprint differs.
"""

from __future__ import annotations

import re
import socket
import ssl
import tempfile
from datetime import timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from atoll.tls import bootstrap_client, cert_to_pem, fingerprint

_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")


class CaHashError(ValueError):
    """The CA could not be fetched, or the coordinator's does not match the hash; the message says what to do."""


def parse_ca_hash(text: str) -> str:
    """`text` as `sha256:<64 hex digits>` (lower case; colons between byte pairs are allowed). Raises CaHashError."""
    value = text.strip().lower()
    if value.startswith("sha256:"):
        value = "sha256:" + value[len("sha256:"):].replace(":", "")
    if not _HASH.match(value):
        raise CaHashError(f"--ca-hash {text[:100]!r} is not sha256:<64 hex digits>; copy it from the join command "
                          f"`atoll coordinator` prints")
    return value


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise CaHashError(f"--coordinator {address[:100]!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _chain(sock: ssl.SSLSocket) -> list[bytes]:
    """The DER certificates the server presented, leaf first (not verified)."""
    public = getattr(sock, "get_unverified_chain", None)  # Python 3.13+
    if public is not None:
        certs = public() or []
    else:  # 3.10 to 3.12 have it on the underlying object only
        certs = sock._sslobj.get_unverified_chain() or []  # type: ignore[union-attr]
    return [c if isinstance(c, bytes) else c.public_bytes(ssl._ssl.ENCODING_DER)  # type: ignore[attr-defined]
            for c in certs]


def fetch_ca(address: str, *, token: str, ca_hash: str, timeout: timedelta = timedelta(seconds=10)) -> bytes:
    """The PEM job CA of the coordinator at `address`, checked against `ca_hash`. Raises CaHashError."""
    want = parse_ca_hash(ca_hash)
    host, port = _split(address)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # nothing is trusted from this connection but what matches the hash
    ctx.set_alpn_protocols(["h2"])
    key_pem, cert_pem = bootstrap_client(token)
    with tempfile.TemporaryDirectory(prefix="atoll-ca-hash-") as tmp:
        key_file, cert_file = Path(tmp) / "key.pem", Path(tmp) / "cert.pem"
        key_file.touch(mode=0o600)
        key_file.write_bytes(key_pem)
        cert_file.write_bytes(cert_pem)
        ctx.load_cert_chain(str(cert_file), str(key_file))
    try:
        with socket.create_connection((host, port), timeout=timeout.total_seconds()) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as sock:
            chain = _chain(sock)
    except (OSError, ssl.SSLError) as e:
        raise CaHashError(f"cannot fetch the job CA from the coordinator at {address} ({e}); check --coordinator "
                          f"and that the coordinator runs with TLS (an --insecure one has no CA)") from None
    certs = []
    for der in chain:
        try:
            certs.append(x509.load_der_x509_certificate(der))
        except ValueError:
            continue
    if not certs:
        raise CaHashError(f"the coordinator at {address} presented no certificate")
    leaf = certs[0]
    for cert in certs[1:]:
        if fingerprint(cert) != want:
            continue
        try:
            is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except x509.ExtensionNotFound:
            is_ca = False
        try:
            leaf.verify_directly_issued_by(cert)
        except (InvalidSignature, ValueError, TypeError):
            is_ca = False
        if not is_ca:
            raise CaHashError(f"the certificate with fingerprint {want} that the coordinator at {address} presents "
                              f"is not the CA of its server certificate; check the hash")
        return cert_to_pem(cert)
    seen = ", ".join(fingerprint(c) for c in certs[1:]) or "none besides its own"
    raise CaHashError(f"the coordinator at {address} presents no CA with fingerprint {want} (it presents {seen}): "
                      f"either the hash is not the one `atoll coordinator` printed for this job, or something between "
                      f"this machine and the coordinator answers in its place. Copy the hash from the coordinator's "
                      f"log, or pass --tls-ca <copy of its STATE_DIR/ca.pem>")
