"""A node's stable id, kept in its state dir so a restarted node comes back as the same member."""

from __future__ import annotations

import re
import secrets
import socket
from pathlib import Path

from atoll.fsutil import atomic_write_text

NODE_ID_FILE = "node_id"
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def new_node_id(hostname: str | None = None) -> str:
    """`<short hostname>-<6 hex digits>`, a valid id whatever the hostname holds."""
    host = (hostname or socket.gethostname()).split(".")[0]
    stem = re.sub(r"[^A-Za-z0-9-]+", "-", host).strip("-")[:40] or "node"
    return f"{stem}-{secrets.token_hex(3)}"


def load_node_id(state_dir: Path) -> str | None:
    """The id kept in `state_dir`, or None on a first start. Raises ValueError for a damaged file."""
    path = Path(state_dir) / NODE_ID_FILE
    if not path.is_file():
        return None
    node_id = path.read_text(encoding="utf-8").strip()
    if not _ID_RE.match(node_id):
        raise ValueError(f"{path} holds {node_id[:80]!r}, not a node id; delete the file to get a new id")
    return node_id


def save_node_id(state_dir: Path, node_id: str) -> None:
    if not _ID_RE.match(node_id):
        raise ValueError(f"{node_id[:80]!r} is not a node id")
    atomic_write_text(Path(state_dir) / NODE_ID_FILE, node_id + "\n")


def load_or_create_node_id(state_dir: Path, hostname: str | None = None) -> str:
    """The node's id: the one kept in `state_dir`, or a new one that is kept there from now on."""
    node_id = load_node_id(state_dir)
    if node_id is None:
        node_id = new_node_id(hostname)
        save_node_id(state_dir, node_id)
    return node_id


LOCK_FILE = "lock"


class StateDirLocked(PermissionError):
    """Another live process holds the state dir, and with it the node id kept there."""


class StateDirLock:
    """An exclusive `flock` on `STATE_DIR/lock`, held while the node runs: one node id, one live process.

    The kernel drops the lock when the process dies, however it dies, so a crashed node never leaves a stale
    lock behind. The file holds the holder's pid, for the message a second process prints.
    """

    def __init__(self, state_dir: Path):
        import fcntl
        import os

        self.path = Path(state_dir) / LOCK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise StateDirLocked(f"state dir {state_dir} is in use by another atoll node (pid {holder}): each node "
                                 f"needs a state dir of its own (--state-dir), or two processes would be one "
                                 f"member") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode("ascii"))
        self._fd: int | None = fd

    def release(self) -> None:
        import os

        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> StateDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
