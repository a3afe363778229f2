"""X.509 material of a job: the coordinator's certificate authority, node certificates and bootstrap credentials.

Trust in one job, in three kinds of certificate (all ECDSA P-256):

- The **job CA** lives in the coordinator's state dir. It signs the coordinator's server certificate (DNS name
  `COORDINATOR_NAME`) and one certificate per node, whose common name is the node id and whose DNS name is
  `node_dns_name(node_id)` (and `NODE_NAME`). Every channel after a node's join is mutual TLS under this CA, so a certificate's
  common name is who speaks.
- The **bootstrap CA** is derived from the job token (HKDF-SHA256 of the token seeds its private key), so the
  coordinator and every token holder compute the same one without exchanging anything. A token holder signs a
  short-lived client certificate with it to reach the coordinator before it has a node certificate: such a
  certificate may join and read the status, nothing else. Peers never trust it.
- A node's own key never leaves its state dir: it sends a certificate signing request with its join.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import AttributeOID, ExtendedKeyUsageOID, NameOID

from atoll.rpc import MutualTls, RpcOptions, TlsIdentity

COORDINATOR_NAME = "coordinator.atoll"
"""DNS name in the coordinator's certificate; clients verify it whatever host they dial."""
NODE_DNS_SUFFIX = ".node.atoll"
NODE_NAME = "node.atoll"
"""DNS name every node certificate carries besides its own: what a peer channel expects when it does not name
the node it dials (the server then checks who calls; the client knows it reached a node of this job)."""
CA_COMMON_NAME = "Atoll job CA"
BOOTSTRAP_COMMON_NAME = "Atoll bootstrap CA"
BOOTSTRAP_CLIENT_NAME = "atoll-bootstrap"
NODE_CERT_LIFE = dt.timedelta(days=365)
CA_LIFE = dt.timedelta(days=3650)
BOOTSTRAP_CERT_LIFE = dt.timedelta(days=1)
CLOCK_SKEW = dt.timedelta(hours=1)
"""Certificates start this much before they are made, so a node whose clock runs behind accepts them."""


class CertificateError(ValueError):
    """A certificate, key or signing request that cannot be used; the message says which and why."""


def node_dns_name(node_id: str) -> str:
    """The DNS name a node's certificate carries: peers dial a node expecting exactly this name."""
    return f"{node_id}{NODE_DNS_SUFFIX}"


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_to_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def key_from_pem(pem: bytes, what: str) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as e:
        raise CertificateError(f"{what} is not a PEM private key ({e}); delete it to make a new one") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertificateError(f"{what} is not an EC private key; delete it to make a new one")
    return key


def cert_to_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def cert_from_pem(pem: bytes, what: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as e:
        raise CertificateError(f"{what} is not a PEM certificate ({e})") from None


def fingerprint(cert: x509.Certificate) -> str:
    """`sha256:<hex>` of the certificate's DER form, as printed for operators to compare."""
    return "sha256:" + cert.fingerprint(hashes.SHA256()).hex()


def public_key_id(key: ec.EllipticCurvePublicKey) -> str:
    """SHA-256 of the public key (DER SubjectPublicKeyInfo): what binds a node id to one key."""
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Atoll"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _ca_cert(key: ec.EllipticCurvePrivateKey, common_name: str, not_before: dt.datetime,
             not_after: dt.datetime, serial: int) -> x509.Certificate:
    name = _name(common_name)
    return (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(serial).not_valid_before(not_before).not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))


def _leaf(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, public_key: ec.EllipticCurvePublicKey,
          common_name: str, dns_names: list[str], life: dt.timedelta, *, server: bool,
          ips: list[str] = ()) -> x509.Certificate:
    now = dt.datetime.now(dt.timezone.utc)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
    san: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    san += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_cert.subject)
               .public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - CLOCK_SKEW).not_valid_after(min(now + life, ca_cert.not_valid_after_utc))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


@dataclass(frozen=True)
class CertificateAuthority:
    """A CA key and its self-signed certificate."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, common_name: str = CA_COMMON_NAME) -> CertificateAuthority:
        key = new_key()
        now = dt.datetime.now(dt.timezone.utc)
        return cls(key, _ca_cert(key, common_name, now - CLOCK_SKEW, now + CA_LIFE, x509.random_serial_number()))

    @property
    def cert_pem(self) -> bytes:
        return cert_to_pem(self.cert)

    def server_certificate(self, key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
        """The coordinator's server certificate for `key`."""
        return _leaf(self.key, self.cert, key.public_key(), "Atoll coordinator", [COORDINATOR_NAME, "localhost"],
                     CA_LIFE, server=True, ips=["127.0.0.1"])

    def sign_node(self, csr_pem: bytes, node_id: str) -> x509.Certificate:
        """A certificate for node `node_id` on the key of `csr_pem`, whatever names the request asks for."""
        csr = parse_csr(csr_pem)
        key = csr.public_key()
        assert isinstance(key, ec.EllipticCurvePublicKey)  # parse_csr checked it
        return _leaf(self.key, self.cert, key, node_id, [node_dns_name(node_id), NODE_NAME], NODE_CERT_LIFE,
                     server=True)

    def issued(self, cert: x509.Certificate) -> bool:
        """Whether this CA signed `cert` (its signature checks out, not only its issuer's name)."""
        if cert.issuer != self.cert.subject:
            return False
        try:
            cert.verify_directly_issued_by(self.cert)
        except (InvalidSignature, ValueError, TypeError):
            return False
        return True


def self_signed(key: ec.EllipticCurvePrivateKey, name: str) -> x509.Certificate:
    """A certificate for `key` that no one trusts: what a peer server presents before its node has joined."""
    now = dt.datetime.now(dt.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + BOOTSTRAP_CERT_LIFE)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))


def parse_csr(csr_pem: bytes) -> x509.CertificateSigningRequest:
    """A signing request with a valid self-signature on a P-256 key; raises CertificateError otherwise."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as e:
        raise CertificateError(f"the certificate signing request is not PEM ({e})") from None
    if not csr.is_signature_valid:
        raise CertificateError("the certificate signing request's signature does not check out")
    key = csr.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise CertificateError("the certificate signing request must be for an EC P-256 key")
    return csr


def make_csr(key: ec.EllipticCurvePrivateKey, node_id: str, challenge: str = "") -> bytes:
    """A signing request for `key`; `challenge` (the coordinator's `JoinChallenge`) goes in its PKCS#9
    challengePassword attribute, under the request's signature."""
    builder = x509.CertificateSigningRequestBuilder().subject_name(_name(node_id))
    if challenge:
        builder = builder.add_attribute(AttributeOID.CHALLENGE_PASSWORD, challenge.encode("ascii"))
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def csr_challenge(csr: x509.CertificateSigningRequest) -> str:
    """The challenge a signing request carries ("": none)."""
    try:
        value = csr.attributes.get_attribute_for_oid(AttributeOID.CHALLENGE_PASSWORD).value
    except x509.AttributeNotFound:
        return ""
    return value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)


def common_name(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    value = names[0].value if names else ""
    return value if isinstance(value, str) else value.decode("utf-8", "replace")


# --- the bootstrap CA, derived from the job token -------------------------------------------------------

_BOOTSTRAP_EPOCH = dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc)
_BOOTSTRAP_END = dt.datetime(2100, 1, 1, tzinfo=dt.timezone.utc)


def _bootstrap_key(token: str) -> ec.EllipticCurvePrivateKey:
    seed = HKDF(algorithm=hashes.SHA256(), length=48, salt=b"atoll bootstrap ca v1", info=b"p256 key").derive(
        token.encode("utf-8"))
    order = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551  # of P-256
    return ec.derive_private_key(int.from_bytes(seed, "big") % (order - 1) + 1, ec.SECP256R1())


@lru_cache(maxsize=8)
def bootstrap_ca(token: str) -> CertificateAuthority:
    """The CA every holder of `token` derives alike (same key, same name; its serial is fixed too)."""
    if not token:
        raise ValueError("the bootstrap CA needs a job token")
    key = _bootstrap_key(token)
    return CertificateAuthority(key, _ca_cert(key, BOOTSTRAP_COMMON_NAME, _BOOTSTRAP_EPOCH, _BOOTSTRAP_END, 1))


def bootstrap_client(token: str) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM) of a short-lived client certificate signed by the token's bootstrap CA."""
    ca = bootstrap_ca(token)
    key = new_key()
    cert = _leaf(ca.key, ca.cert, key.public_key(), BOOTSTRAP_CLIENT_NAME, [], BOOTSTRAP_CERT_LIFE, server=False)
    return key_to_pem(key), cert_to_pem(cert)


# --- what a client needs --------------------------------------------------------------------------------

CA_FILE = "ca.pem"
"""Name of the job CA's certificate in the coordinator's state dir (and, by default, beside a token file)."""


def find_ca(tls_ca: str | Path | None, token_file: str | Path | None, *, ca_hash_flag: bool = False) -> Path:
    """The job CA file a client verifies the coordinator with: `--tls-ca`, else `ca.pem` beside the token file.

    Raises FileNotFoundError with what to pass when there is none (`ca_hash_flag`: the command also takes
    --ca-hash, `atoll node`'s way to fetch the CA by its fingerprint).
    """
    if tls_ca:
        path = Path(tls_ca)
        if not path.is_file():
            raise FileNotFoundError(f"--tls-ca {path}: no such file; copy the coordinator's STATE_DIR/{CA_FILE} here")
        return path
    if token_file:
        beside = Path(token_file).parent / CA_FILE
        if beside.is_file():
            return beside
    by_hash = (" or --ca-hash with the fingerprint the coordinator logs (it fetches the CA and checks it),"
               if ca_hash_flag else "")
    raise FileNotFoundError(f"no job CA to verify the coordinator with: pass --tls-ca <copy of the coordinator's "
                            f"STATE_DIR/{CA_FILE}> (its fingerprint is in the coordinator's log), or put it beside "
                            f"--token-file,{by_hash} --insecure only if the coordinator runs --insecure")


def coordinator_name(ca_pem: bytes) -> str | None:
    """The name to expect in the coordinator's certificate: `COORDINATOR_NAME` under a job CA, else None (the
    operator's own certificate, checked against the host dialled)."""
    return COORDINATOR_NAME if common_name(cert_from_pem(ca_pem, "the CA file")) == CA_COMMON_NAME else None


def bootstrap_rpc(token: str, ca_pem: bytes, base: RpcOptions | None = None) -> RpcOptions:
    """Channel options that reach a mutual-TLS coordinator with the job token alone (join, status)."""
    key_pem, cert_pem = bootstrap_client(token)
    return replace(base or RpcOptions(), mtls=MutualTls(roots_pem=ca_pem, identity=TlsIdentity(key_pem, cert_pem),
                                                        server_name=coordinator_name(ca_pem)))
