"""Why a HOST:PORT does not answer: the path below gRPC, step by step, as one line saying what to check.

`diagnose` resolves the name and opens a TCP connection, so a message can tell a typo from a stopped coordinator, a
firewall or a TLS mismatch. The node says it while it retries its first contact (`atoll.node.first_contact`);
`atoll status` and `atoll job` say it when their call found no coordinator.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from atoll.preflight import dial_address_problem

T = TypeVar("T")


def diagnose(address: str, *, tls: bool, timeout: timedelta = timedelta(seconds=2), mtls=None) -> str:
    """A line saying why HOST:PORT may not answer as a coordinator, and what to check. With `mtls` (the
    `atoll.rpc.MutualTls` the call used), a TLS handshake of its own tells a wrong --tls-ca, a coordinator without
    TLS and a job token that is not the job's apart; without TLS (--insecure), one tells a coordinator that runs
    with TLS."""
    return diagnosis(address, tls=tls, timeout=timeout, mtls=mtls)[1]


def diagnosis(address: str, *, tls: bool, timeout: timedelta = timedelta(seconds=2), mtls=None) -> tuple[bool, str]:
    """(whether a TCP connection to `address` opened, `diagnose`'s line)."""
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")
    checks = (f"check the address and port (--coordinator {address}), that the coordinator runs there, that no "
              f"firewall between here and there drops that port, and TLS (--tls-ca exactly when the coordinator "
              f"runs with TLS)")
    problem = dial_address_problem(address)
    if problem is not None:
        return False, f"--coordinator {address!r} {problem}; give HOST:PORT, e.g. --coordinator 10.0.0.5:7070"
    try:
        infos = socket.getaddrinfo(host, int(port_text), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return False, f"the host name {host!r} {DOES_NOT_RESOLVE} ({e.strerror}); check the address (--coordinator)"
    try:
        family, kind, proto, _, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as s:
            s.settimeout(timeout.total_seconds())
            s.connect(sockaddr)
    except ConnectionRefusedError:
        return False, (f"{host} refuses connections on port {port_text}: {NOTHING_LISTENS}. Is the coordinator "
                f"running, and on that port (its --listen)?")
    except (socket.timeout, TimeoutError):
        return False, (f"no answer from {host}:{port_text} within {timeout.total_seconds():.0f}s: a firewall may drop the "
                f"packets, or the address is not the coordinator's; {checks}")
    except OSError as e:
        return False, f"cannot connect to {host}:{port_text} ({e.strerror or e}); {checks}"
    probed = _tls_probe(host, sockaddr, mtls, timeout) if tls and mtls is not None else (
        None if tls else _speaks_tls(sockaddr, timeout))
    if probed is not None:
        return True, f"{address} accepts connections, but {probed}"
    if tls:
        return True, (f"{address} accepts connections but the TLS handshake or the call failed: check that --tls-ca is "
                f"the coordinator's certificate authority, that the coordinator runs with TLS (not --insecure), and "
                f"the job token (with TLS it also vouches for this client's certificate)")
    return True, (f"{address} accepts connections but does not answer as an Atoll coordinator: if the coordinator runs "
            f"with TLS, pass --tls-ca; otherwise check that the port is the coordinator's")


def _tls_of(rpc) -> dict:
    """`diagnose`'s TLS arguments for the channel options `rpc` (`atoll.rpc.RpcOptions`; None: plaintext)."""
    return {"tls": rpc is not None and (rpc.mtls is not None or rpc.tls_root_ca is not None),
            "mtls": rpc.mtls if rpc is not None else None}


def call_coordinator(call: Callable[[float, bool], T], address: str, timeout: timedelta, rpc=None,
                     say: Callable[[str], None] | None = None) -> T:
    """`call(seconds, wait_for_ready)`: one call to the coordinator at `address`, first without waiting for the
    channel (a coordinator that answers answers at once). Where it cannot connect, `diagnose` says why. Said at
    once, as ConnectionError (PermissionError for a token that is not the job's): a server that accepts
    connections but refuses this client, speaks no TLS or is no coordinator, a host that refuses the connection
    (nothing listens on the port: the coordinator is not running there) and a name that does not resolve.
    Waiting mends none of them, and a person at a prompt should not wait out `timeout` to hear it (`--watch`
    asks again at each interval). Where the connection gets no answer at all (a coordinator host still booting,
    a firewall), `say` hears why and the call waits for the channel for the rest of `timeout`; what it raises is
    the caller's to handle, as before."""
    import grpc

    start = time.monotonic()
    try:
        return call(timeout.total_seconds(), False)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNAVAILABLE:
            raise
    reached, why = diagnosis(address, **_tls_of(rpc))
    if reached:
        raise (PermissionError if TOKEN_REFUSED in why else ConnectionError)(
            f"the coordinator at {address} did not take the call: {why}")
    if NOTHING_LISTENS in why or DOES_NOT_RESOLVE in why:
        raise ConnectionError(f"no coordinator at {address}: {why}")
    left = max(0.1, timeout.total_seconds() - (time.monotonic() - start))
    if say is not None:
        say(f"no answer from {address} yet ({why}); waiting up to {left:.3g}s more (--timeout)")
    return call(left, True)


def unanswered(address: str, code_name: str, timeout: timedelta, rpc=None) -> ConnectionError:
    """The error a command raises when its call to the coordinator at `address` got no answer (`code_name`:
    UNAVAILABLE or DEADLINE_EXCEEDED) within `timeout`, with `diagnose`'s line for the channel options `rpc`
    (`atoll.rpc.RpcOptions`; None: plaintext)."""
    why = diagnose(address, **_tls_of(rpc))
    return ConnectionError(f"no coordinator answered at {address} within {timeout.total_seconds():g}s "
                           f"({code_name}): {why}")


def _says(e: Exception, kinds: tuple[str, ...]) -> bool:
    """Whether an ssl error's text names one of `kinds` (OpenSSL's reason codes)."""
    return any(k in str(e).upper() for k in kinds)


NOTHING_LISTENS = "nothing listens there"
"""In `diagnose`'s line where the host refused the TCP connection."""
DOES_NOT_RESOLVE = "does not resolve"
"""In `diagnose`'s line where the host name has no address."""
TOKEN_REFUSED = "the token is not this job's"
"""In `diagnose`'s line where the coordinator refused the certificate the job token vouches for: a wrong token,
which retrying cannot mend."""
_REFUSED_CLIENT = ("UNKNOWN_CA", "CERTIFICATE_UNKNOWN", "BAD_CERTIFICATE", "CERTIFICATE_REQUIRED", "DECRYPT_ERROR",
                   "HANDSHAKE_FAILURE", "ACCESS_DENIED")
"""TLS alerts a server sends when it does not accept the client's certificate."""
_NOT_TLS = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "UNEXPECTED_EOF",
            "HTTP_REQUEST", "UNKNOWN_PROTOCOL")
"""How a handshake fails against a plaintext (HTTP/2 without TLS) server."""


def _context(roots_pem: bytes | None):
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if roots_pem is None:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx.load_verify_locations(cadata=roots_pem.decode("ascii", errors="replace"))
    ctx.set_alpn_protocols(["h2"])
    return ctx


def _handshake(ctx, sockaddr, server_name: str, timeout: timedelta, *, read: bool = False) -> bool:
    """One TLS handshake (and, with `read`, a short read: under TLS 1.3 a server refuses the client's
    certificate only after the client's side of the handshake is done, by an alert or by closing the connection
    where an HTTP/2 server would send its settings). False where the server closed it so; raises ssl.SSLError /
    OSError."""
    with socket.create_connection(sockaddr[:2], timeout=timeout.total_seconds()) as raw, \
            ctx.wrap_socket(raw, server_hostname=server_name) as tls:
        if read:
            try:
                return tls.recv(1) != b""
            except (socket.timeout, TimeoutError):
                pass  # accepted: the server waits for the client's first frame
        return True


def _tls_probe(host: str, sockaddr, mtls, timeout: timedelta) -> str | None:
    """What a handshake of its own says is wrong with the TLS set-up (None: nothing it can tell)."""
    import os
    import ssl
    import tempfile

    name = mtls.server_name or host
    try:
        _handshake(_context(mtls.roots_pem), sockaddr, name, timeout)
    except ssl.SSLCertVerificationError as e:
        if "mismatch" in str(e.verify_message).lower():
            return (f"its certificate does not name {name} ({e.verify_message}): dial the coordinator by a name its "
                    f"certificate holds")
        return (f"its certificate is not signed by the job CA this command trusts (--tls-ca, or the ca.pem beside "
                f"--token-file) ({e.verify_message}): give --tls-ca the copy of this coordinator's STATE_DIR/ca.pem "
                f"(its fingerprint is in the coordinator's log)")
    except ssl.SSLError as e:
        if _says(e, _NOT_TLS):
            return ("it does not speak TLS: the coordinator runs --insecure; pass --insecure too (in a closed lab "
                    "only), or run the coordinator with TLS")
        if not _says(e, _REFUSED_CLIENT):
            return None
    except OSError:
        return None
    identity = mtls.identity
    if identity is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:  # ssl loads a client identity from files only
        cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        with open(cert, "wb") as f:
            f.write(identity.cert_pem)
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(identity.key_pem)
        ctx = _context(mtls.roots_pem)
        ctx.load_cert_chain(cert, key)
        refused = (f"it refuses this client's certificate, which the job token vouches for: {TOKEN_REFUSED}; pass "
                   f"the coordinator's STATE_DIR/token (--token-file)")
        try:
            if not _handshake(ctx, sockaddr, name, timeout, read=True):
                return refused
        except ssl.SSLError as e:
            if _says(e, _REFUSED_CLIENT):
                return refused
        except OSError:
            return None
    return None


def _speaks_tls(sockaddr, timeout: timedelta) -> str | None:
    """Without TLS (--insecure): whether the port answers a TLS handshake, as a coordinator with TLS does."""
    import ssl

    try:
        _handshake(_context(None), sockaddr, "coordinator", timeout)
    except ssl.SSLError as e:
        if not _says(e, _REFUSED_CLIENT):
            return None
    except OSError:
        return None
    return ("it speaks TLS: the coordinator runs with TLS, so leave out --insecure (and give --tls-ca, the copy of "
            "its STATE_DIR/ca.pem, unless that file sits beside --token-file)")
