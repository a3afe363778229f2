"""Files written atomically (a temporary file in the same folder, fsync, then rename over the target), and text files
a person named read with every failure said in one line."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def _umask() -> int:
    """This process's umask, read without changing it (Linux: /proc; elsewhere the common 022)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def atomic_write(path: Path, write: Callable[[BinaryIO], None], mode: int | None = None) -> None:
    """Write `path` through `write(fileobj)` so readers see the old file or the whole new one. `mode`: the file's
    permissions, set before the first byte (secrets: 0o600); None: as `open` would make it, 0o666 less the umask
    (the temporary file would otherwise leave it readable by its owner alone)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode if mode is not None else 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: Path, data: bytes, mode: int | None = None) -> None:
    atomic_write(path, lambda f: f.write(data), mode)


def atomic_write_text(path: Path, text: str, mode: int | None = None) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode)


def read_text_file(path: str | Path, what: str, hint: str, error: type[Exception] = ValueError,
                   listing: str | None = None) -> str:
    """The UTF-8 text of the file a person named at `path` (a byte-order mark dropped), every failure one line
    naming it: `what` says what the file is ("job spec", "cluster file") and `hint` what to pass instead. An empty
    name or something that is not a regular file raises `error`, a missing path FileNotFoundError, a folder
    IsADirectoryError (naming up to five files in it that match the glob `listing`), and bytes that are not UTF-8
    `error`, with the line and byte."""
    if not str(path).strip():
        raise error(f"{what}: the file name is empty; {hint}")
    p = Path(path)
    if p.is_dir():
        inside = sorted(x.name for x in p.glob(listing) if x.is_file()) if listing else []
        held = f" (it holds {', '.join(inside[:5])}{', ...' if len(inside) > 5 else ''})" if inside else ""
        raise IsADirectoryError(f"{what} {p} is a folder, not a file{held}; {hint}")
    if p.exists() and not p.is_file():
        raise error(f"{what} {p} is not a regular file; {hint}")
    if not p.is_file():
        raise FileNotFoundError(f"{what} {p}: no such file; {hint}")
    data = p.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise error(f"{what} {p} is not UTF-8 text ({e.reason} at byte {e.start}, line {line}: "
                    f"0x{data[e.start]:02x}); save it as UTF-8") from None


def shown_path(path: str | Path) -> str:
    """`path` for a message: a relative one with the folder it was read against, where a job spec's paths are
    read (the current folder of the process, not the spec's own folder)."""
    p = Path(path)
    return str(p) if p.is_absolute() else f"{p} (in {Path.cwd()})"
