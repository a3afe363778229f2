"""Setup mistakes found before a process starts serving, each as one line saying what to change.

`atoll coordinator` and `atoll node` check their state dir and the ports they will listen on first, so a busy
port, a state dir that is a file or that this user cannot write ends in a `SetupError` (a ValueError, which the
command line prints as one line) rather than a traceback from deep inside gRPC, SQLite or the HTTP server.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import tempfile
from pathlib import Path


class SetupError(ValueError):
    """A mistake in how a process was started; the message says what to change."""


def usable_state_dir(path: Path, flag: str = "--state-dir") -> Path:
    """`path`, created when missing, once it is a folder this process can write; else SetupError."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise SetupError(f"{flag} {path} is a file, not a folder; give a folder (created when missing) or move "
                         f"the file away")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise SetupError(f"{flag} {path}: a part of the path is a file, not a folder; give another path") from None
    except NotADirectoryError:
        raise SetupError(f"{flag} {path}: a part of the path is a file, not a folder; give another path") from None
    except OSError as e:
        raise SetupError(f"cannot create {flag} {path}: {e.strerror}; give a folder this user ({_user()}) can "
                         f"write") from None
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".atoll-write-test-"):
            pass
    except OSError as e:
        raise SetupError(f"{flag} {path} is not writable ({e.strerror}); give a folder this user ({_user()}) can "
                         f"write, or fix its permissions") from None
    return path


def check_listen(address: str, flag: str) -> None:
    """SetupError when HOST:PORT cannot be listened on (the port is taken, or the host is not this machine's).

    Port 0 (any free port) checks the host alone. The check binds and closes a socket, so a port taken between
    the check and the real bind still fails there, with a less friendly message.
    """
    host, _, port_text = address.rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        raise SetupError(f"{flag} {address!r} is not HOST:PORT") from None
    if not 0 <= port < 65536:
        raise SetupError(f"{flag} {address}: the port must be in 0-65535")
    if not host:
        raise SetupError(f"{flag} {address!r} has no host: give HOST:PORT, e.g. 0.0.0.0:{port} for every interface "
                         f"or 127.0.0.1:{port} for this machine alone")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise SetupError(f"{flag} {address!r}: write an IPv6 host in brackets, e.g. [{host}]:{port}")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SetupError(f"{flag} {address}: cannot resolve {host!r} ({e.strerror}); give an address of this "
                         f"machine") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to a server
        try:
            s.bind(sockaddr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise SetupError(f"{flag} {address}: port {port} is in use by another process (another coordinator "
                                 f"or node?); stop it or pick another port (0 picks a free one)") from None
            if e.errno == errno.EACCES:
                raise SetupError(f"{flag} {address}: port {port} needs privileges this user lacks; pick a port "
                                 f"above 1023") from None
            raise SetupError(f"{flag} {address}: cannot listen there ({e.strerror}); give an address of this "
                             f"machine") from None


_HOST_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)$")
WILDCARDS = ("0.0.0.0", "::")


def dial_address_problem(address: str) -> str | None:
    """What keeps `address` from being HOST:PORT another machine can dial, as the end of a sentence that names it
    (None: nothing). A host name of letters, digits, '.', '_' or '-', or an IP address (IPv6 in brackets), not a
    wildcard; a port in 1-65535. Whether it resolves and answers is found out by dialling. The command line's
    flags (`check_dial_address`) and the coordinator's Join (`coordinator.validation.check_address`) share it."""
    host, _, port_text = address.rpartition(":")
    if not host or not port_text.isdigit() or len(port_text) > 5:
        return "is not HOST:PORT"
    if not 0 < int(port_text) < 65536:
        return "has a port outside 1-65535"
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        return f"has an IPv6 host without brackets: write [{host}]:{port_text}"
    if not _HOST_RE.match(host):
        return "has a host that is neither a name (letters, digits, '.', '_', '-') nor an IP address"
    if host.strip("[]") in WILDCARDS:
        return f"names {host}, a wildcard (every interface), not an address to dial"
    return None


def check_dial_address(address: str, flag: str) -> None:
    """SetupError unless `address` is HOST:PORT another machine can dial (`dial_address_problem`)."""
    problem = dial_address_problem(address)
    if problem is not None:
        raise SetupError(f"{flag} {address!r} {problem}; give HOST:PORT, e.g. {flag} 10.0.0.5:7070")


def check_output_file(path: Path | str, flag: str) -> None:
    """SetupError when a file cannot be written at `path` (it is a folder, a part of its folder path is a file, or
    the folder is not writable), so a command finds out before its work rather than after."""
    if not str(path).strip():
        raise SetupError(f"{flag}: the file name is empty; name a file, or leave {flag} out")
    path = Path(path).expanduser()
    if path.is_dir():
        raise SetupError(f"{flag} {path} is a folder; give a file name (e.g. {path / 'out'})")
    if path.exists() and not path.is_file():
        raise SetupError(f"{flag} {path} is not a regular file; name a file to write")
    for up in path.absolute().parents:  # the nearest folder that exists (the missing ones are made when writing)
        if up.exists():
            if not up.is_dir():
                raise SetupError(f"{flag} {path}: {up} is a file, not a folder; give another path")
            if not os.access(up, os.W_OK | os.X_OK):
                raise SetupError(f"{flag} {path}: this user ({_user()}) cannot write in {up}; give another path")
            return


def check_tls_pair(cert: Path, key: Path) -> None:
    """SetupError unless `cert` holds PEM certificates and `key` the PEM private key of the first of them."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    for path, flag in ((cert, "--tls-cert"), (key, "--tls-key")):
        if not Path(path).is_file():
            raise SetupError(f"{flag} {path}: no such file")
    try:
        chain = x509.load_pem_x509_certificates(Path(cert).read_bytes())
    except ValueError as e:
        raise SetupError(f"--tls-cert {cert} holds no PEM certificate ({e})") from None
    try:
        private = serialization.load_pem_private_key(Path(key).read_bytes(), password=None)
    except (ValueError, TypeError) as e:
        raise SetupError(f"--tls-key {key} is not an unencrypted PEM private key ({e})") from None
    pem = serialization.PublicFormat.SubjectPublicKeyInfo
    if private.public_key().public_bytes(serialization.Encoding.PEM, pem) != \
            chain[0].public_key().public_bytes(serialization.Encoding.PEM, pem):
        raise SetupError(f"--tls-key {key} is not the key of --tls-cert {cert} (its first certificate); give the pair "
                         "issued together")


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return str(os.getuid())
