"""Setup mistakes found before a process starts serving, each as one line saying what to change.

`atoll coordinator` and `atoll node` check their state dir and the ports they will listen on first, so a busy
port, a state dir that is a file or that this user cannot write ends in a `SetupError` (a ValueError, which the
command line prints as one line) rather than a traceback from deep inside gRPC, SQLite or the HTTP server.
"""

from __future__ import annotations

import errno
import os
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

    Port 0 (any free port) always passes. The check binds and closes a socket, so a port taken between the
    check and the real bind still fails there, with a less friendly message.
    """
    host, _, port_text = address.rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        raise SetupError(f"{flag} {address!r} is not HOST:PORT") from None
    if not 0 <= port < 65536:
        raise SetupError(f"{flag} {address}: the port must be in 0-65535")
    if port == 0:
        return
    host = host.strip("[]") or "0.0.0.0"
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


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return str(os.getuid())
