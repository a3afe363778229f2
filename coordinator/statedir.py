"""Whether a coordinator state dir can be read whole, before the coordinator runs on it.

The state dir holds the SQLite store (`coordinator.db`, its write-ahead log `-wal` and index `-shm`), the job CA
(`ca.key`, `ca.pem`), the server's certificate and `identities.db` (which key holds each node id). Losing any of
them silently is worse than stopping: a store without its log restarts with no members or an empty checkpoint
index, a new CA locks every node out, an empty identities file lets a token holder take over a live node's id.
So a state dir that is not whole is refused with `UnreadableState`, one line naming what is missing and the way
out: `--start-fresh` (the old state is moved aside, never deleted) or `--restore BACKUP`.

Telling a missing log after a clean stop (SQLite folds the log into the file and deletes it) from one deleted
after a crash takes a marker: `state.json`, written atomically, says whether a coordinator has the store open
(`open`), and what the dir holds (the job's id, the CA's fingerprint). After a crash (`open` still set) the log
must be there, and it must hold every frame SQLite had committed: the log index (`-shm`, a memory map that
survives the process) records the count of committed frames, and the log's own checksummed frames are counted
against it, so a log cut short or written over is found before SQLite would quietly drop its tail.
"""

from __future__ import annotations

import json
import os
import sqlite3
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from atoll.coordinator.integrity import SQLITE_HEADER
from atoll.coordinator.store import StoreError
from atoll.fsutil import atomic_write_text

MANIFEST = "state.json"
DB_NAME = "coordinator.db"
CA_KEY, CA_CERT, SERVER_CERT, IDENTITIES_DB = "ca.key", "ca.pem", "server.pem", "identities.db"
KEPT_IN_PLACE = ("token", "backups", "aside")
"""What `start_fresh` leaves where it is: the job token (the nodes hold it), the backups and earlier set-asides."""
WAY_OUT = ("start anew with --start-fresh (the old state is moved aside, not deleted), or bring a backup back with "
           "--restore BACKUP (see STATE_DIR/backups)")

_WAL_MAGIC = (0x377F0682, 0x377F0683)
_WAL_HEADER, _FRAME_HEADER = 32, 24


class UnreadableState(StoreError):
    """The state dir is not whole; the message names what is wrong and the options that start anew."""


def unreadable(state_dir: Path, what: str) -> UnreadableState:
    return UnreadableState(f"{state_dir}: {what}. The coordinator will not start over state it cannot read whole; "
                           f"{WAY_OUT}")


@dataclass(kw_only=True)
class Manifest:
    """What a state dir holds and whether a coordinator has it open (`state.json`)."""

    open: bool = False
    """A coordinator runs on the dir, or was killed while it did (a clean stop clears it)."""
    job_id: str = ""
    ca_fingerprint: str = ""
    """The job CA's fingerprint, once it has one (mutual TLS): a CA made anew in its place is refused."""
    pid: int = 0
    updated_unix: float = 0.0

    @classmethod
    def read(cls, state_dir: Path) -> Manifest | None:
        path = state_dir / MANIFEST
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(**{k: data[k] for k in ("open", "job_id", "ca_fingerprint", "pid", "updated_unix")
                          if k in data})
        except (OSError, ValueError, TypeError, UnicodeDecodeError) as e:
            raise unreadable(state_dir, f"{MANIFEST} is damaged ({type(e).__name__}: {str(e)[:120]})") from None

    def write(self, state_dir: Path) -> None:
        self.updated_unix = time.time()
        atomic_write_text(state_dir / MANIFEST, json.dumps(asdict(self), indent=1) + "\n")


def mark_open(state_dir: Path, *, job_id: str, ca_fingerprint: str = "") -> None:
    """Record that a coordinator has the store open (after it opened it: the log exists from then on)."""
    m = Manifest.read(state_dir) or Manifest()
    m.open, m.job_id, m.pid = True, job_id, os.getpid()
    if ca_fingerprint:
        m.ca_fingerprint = ca_fingerprint
    m.write(state_dir)


def mark_closed(state_dir: Path) -> None:
    """Record a clean stop (after the store closed: SQLite has folded its log into the file and deleted it)."""
    m = Manifest.read(state_dir) or Manifest()
    m.open, m.pid = False, 0
    m.write(state_dir)


def check(state_dir: Path, *, mutual_tls: bool) -> None:
    """Raise `UnreadableState` unless the coordinator can read `state_dir` whole (a fresh dir passes)."""
    state_dir = Path(state_dir)
    manifest = Manifest.read(state_dir)
    db = state_dir / DB_NAME
    wal, shm = Path(f"{db}-wal"), Path(f"{db}-shm")
    if not db.exists():
        held = [p.name for p in (wal, state_dir / CA_KEY, state_dir / CA_CERT, state_dir / IDENTITIES_DB)
                if p.exists()]
        if manifest is not None and manifest.job_id:
            held.insert(0, f"{MANIFEST} (job {manifest.job_id})")
        if held:
            raise unreadable(state_dir, f"the store {DB_NAME} is missing, while the dir holds {', '.join(held)} of a "
                                        f"job that ran here")
    elif manifest is not None and manifest.open:
        _check_log(state_dir, wal, shm)
    if mutual_tls:
        _check_authority(state_dir, manifest)


def _check_log(state_dir: Path, wal: Path, shm: Path) -> None:
    """After a coordinator that did not stop cleanly: the log holds every frame the index says was committed."""
    index = _read_index(shm)
    if not wal.exists():
        if index is not None and index[0] <= index[1]:
            return  # every committed frame was in the file already: the log held nothing more
        raise unreadable(state_dir, f"the write-ahead log {wal.name} is missing after a coordinator that did not stop "
                                    f"cleanly (it held the newest transactions: members, checkpoints)")
    committed = _committed_frames(wal)
    if index is None:
        return  # no index to count against (deleted with the process's memory map): SQLite reads what the log holds
    want, backfilled, salts = index
    have = committed[0] if committed is not None and committed[1] == salts else 0
    if have < want and want > backfilled:
        size = wal.stat().st_size
        raise unreadable(state_dir, f"the write-ahead log {wal.name} is damaged: it holds {have} of the {want} frames "
                                    f"committed ({size} bytes; cut short or written over)")


def _read_index(shm: Path) -> tuple[int, int, bytes] | None:
    """(committed frames, frames folded into the file, salts) from the log index, or None where it is absent or
    does not check. The index is in the machine's byte order: two copies of a 48-byte header, then the
    checkpoint's count of folded frames."""
    try:
        with open(shm, "rb") as f:
            head = f.read(100)
    except OSError:
        return None
    if len(head) < 100 or head[:48] != head[48:96]:
        return None
    _version, _unused, _change, is_init, _big_end, _page, mx_frame, _pages = struct.unpack("=3IBBHII", head[:24])
    salts = head[32:40]  # copied from the log's header as they lie there
    stored = struct.unpack("=2I", head[40:48])
    if not is_init or _checksum(head[:40], 0, 0, little=struct.pack("=I", 1) == struct.pack("<I", 1)) != stored:
        return None
    (backfilled,) = struct.unpack("=I", head[96:100])
    return mx_frame, backfilled, salts


def _committed_frames(wal: Path) -> tuple[int, bytes] | None:
    """(frames up to the log's last valid commit, the log's salts), as SQLite's recovery counts them; None for a
    log without a valid header."""
    with open(wal, "rb") as f:
        head = f.read(_WAL_HEADER)
        if len(head) < _WAL_HEADER:
            return None
        magic, _version, page_size, _seq, salt1, salt2, c1, c2 = struct.unpack(">8I", head)
        if magic not in _WAL_MAGIC or page_size < 512 or page_size & (page_size - 1):
            return None
        little = magic == _WAL_MAGIC[0]
        s = _checksum(head[:24], 0, 0, little=little)
        if s != (c1, c2):
            return None
        frames = last_commit = 0
        while True:
            frame = f.read(_FRAME_HEADER + page_size)
            if len(frame) < _FRAME_HEADER + page_size:
                break
            _page, commit_size, fs1, fs2, fc1, fc2 = struct.unpack(">6I", frame[:_FRAME_HEADER])
            if (fs1, fs2) != (salt1, salt2):
                break
            s = _checksum(frame[:8], *s, little=little)
            s = _checksum(frame[_FRAME_HEADER:], *s, little=little)
            if s != (fc1, fc2):
                break
            frames += 1
            if commit_size:
                last_commit = frames
    return last_commit, head[16:24]


def _checksum(data: bytes, s0: int, s1: int, *, little: bool) -> tuple[int, int]:
    """SQLite's log checksum over 32-bit words (in the byte order the log's magic names)."""
    words = struct.unpack(f"{'<' if little else '>'}{len(data) // 4}I", data)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & 0xFFFFFFFF
        s1 = (s1 + words[i + 1] + s0) & 0xFFFFFFFF
    return s0, s1


def _check_authority(state_dir: Path, manifest: Manifest | None) -> None:
    from atoll.tls import CertificateError, cert_from_pem, fingerprint

    key, cert, ids = state_dir / CA_KEY, state_dir / CA_CERT, state_dir / IDENTITIES_DB
    had_ca = bool(manifest and manifest.ca_fingerprint) or ids.exists() or (state_dir / SERVER_CERT).exists()
    if not key.exists() and not cert.exists():
        if had_ca:
            raise unreadable(state_dir, f"the job CA ({CA_KEY}, {CA_CERT}) is missing, while the dir shows one was "
                                        f"made here: a new CA would lock out every node holding the old {CA_CERT}")
        return
    if manifest is not None and manifest.ca_fingerprint and cert.exists():
        try:
            now = fingerprint(cert_from_pem(cert.read_bytes(), str(cert)))
        except CertificateError:
            now = ""  # a damaged certificate is the CA loader's to say
        if now and now != manifest.ca_fingerprint:
            raise unreadable(state_dir, f"{CA_CERT} ({now}) is not the job CA this dir recorded "
                                        f"({manifest.ca_fingerprint}): its nodes hold the other")
    if not ids.exists():
        raise unreadable(state_dir, f"{IDENTITIES_DB} is missing: it records which key holds each node id, and "
                                    f"without it a token holder could take over a live node's id")
    what = _identities_problem(ids)
    if what:
        raise unreadable(state_dir, f"{IDENTITIES_DB} {what}: it records which key holds each node id, and "
                                    f"without it a token holder could take over a live node's id")


def _identities_problem(path: Path) -> str:
    size = path.stat().st_size
    if size == 0:
        return "is empty (0 bytes)"
    with open(path, "rb") as f:
        if f.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
            return "is not a SQLite database"
    try:
        db = sqlite3.connect(path)
        try:
            tables = {n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            db.close()
    except sqlite3.DatabaseError as e:
        return f"cannot be read ({e})"
    return "" if "bindings" in tables else "holds no bindings table"


def start_fresh(state_dir: Path) -> Path | None:
    """Move the state in `state_dir` aside (into `aside/<time>/` inside it, the token and backups kept in place), so
    the coordinator starts a new job there; the folder it went to, None when there was nothing to move."""
    state_dir = Path(state_dir)
    moving = [p for p in sorted(state_dir.iterdir()) if p.name not in KEPT_IN_PLACE] if state_dir.is_dir() else []
    return set_aside(state_dir, moving)


def set_aside(state_dir: Path, paths: list[Path]) -> Path | None:
    """Move `paths` (in `state_dir`) into a new `state_dir/aside/<time>/`; that folder, None for no paths."""
    if not paths:
        return None
    dest = state_dir / "aside" / time.strftime("%Y%m%d-%H%M%S")
    n = 1
    while dest.exists():
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
        n += 1
    dest.mkdir(parents=True)
    for p in paths:
        os.replace(p, dest / p.name)  # renames within one filesystem: nothing copied, nothing half-moved
    return dest
