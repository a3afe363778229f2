"""Online backups of the coordinator's store, and bringing one back.

A backup is SQLite's own online copy (`Connection.backup`) of the store as one consistent transaction sees it,
taken while the coordinator runs (WAL: the copy reads while the coordinator writes), written to a temporary file
and renamed into `STATE_DIR/backups/coordinator-<UTC time>.db`, so a backup there is always whole. The newest
`keep` are kept. `restore` checks a backup as the coordinator would open it, sets the damaged store aside and
puts the backup in its place.
"""

from __future__ import annotations

import calendar
import os
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from atoll.coordinator.statedir import DB_NAME, MANIFEST, Manifest, UnreadableState, set_aside

BACKUPS = "backups"
_NAME = re.compile(r"^coordinator-(\d{8}T\d{6})\.(\d{3})Z\.db$")


class RestoreError(RuntimeError):
    """The backup cannot be brought back; the message says why and what to do."""


@dataclass(frozen=True)
class Backup:
    path: Path
    taken_unix: float


def backup_folder(state_dir: Path) -> Path:
    return Path(state_dir) / BACKUPS


def take(db_path: Path, folder: Path, *, keep: int, now: float | None = None) -> Backup:
    """Copy the store at `db_path` into `folder` (atomically) and prune to the newest `keep` backups."""
    now = time.time() if now is None else now
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"
    path = folder / f"coordinator-{stamp}.db"
    tmp = folder / f".{path.name}.tmp"
    try:
        src = sqlite3.connect(db_path, timeout=10.0)
        try:
            dst = sqlite3.connect(tmp)
            try:
                src.backup(dst)
                dst.execute("PRAGMA journal_mode=DELETE")  # one self-contained file, no log beside it
            finally:
                dst.close()
        finally:
            src.close()
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    for old in listed(folder)[keep:]:
        old.path.unlink(missing_ok=True)
    return Backup(path, now)


def listed(folder: Path) -> list[Backup]:
    """The backups in `folder`, newest first."""
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = _NAME.match(p.name)
        if m:
            found.append(Backup(p, calendar.timegm(time.strptime(m.group(1), "%Y%m%dT%H%M%S")) + int(m.group(2)) / 1000))
    return sorted(found, key=lambda b: b.taken_unix, reverse=True)


def newest(folder: Path) -> Backup | None:
    found = listed(folder)
    return found[0] if found else None


def restore(backup: Path, state_dir: Path) -> Path | None:
    """Put `backup` in place of the store in `state_dir`; the old store (file, log, index) and `state.json` are
    moved into `aside/<time>/`, which is returned (None when there was no store). The CA and identities stay."""
    from atoll.coordinator.store import SqliteStore, StoreError

    backup, state_dir = Path(backup), Path(state_dir)
    if not backup.is_file():
        raise RestoreError(f"--restore {backup}: no such file; the backups are in {backup_folder(state_dir)}")
    state_dir.mkdir(parents=True, exist_ok=True)
    trial = state_dir / f".{DB_NAME}.restoring"
    for p in (trial, Path(f"{trial}-wal"), Path(f"{trial}-shm")):
        p.unlink(missing_ok=True)
    trial.write_bytes(backup.read_bytes())
    try:
        store = SqliteStore(trial)  # the checks the coordinator makes at start, on the copy
        job = store.get_job()
        store.close()  # folds its log in: the copy is one file again
    except StoreError as e:
        trial.unlink(missing_ok=True)
        raise RestoreError(f"--restore {backup}: {str(e).replace(str(trial), str(backup))}") from None
    if job is None:
        trial.unlink(missing_ok=True)
        raise RestoreError(f"--restore {backup}: it holds no job; choose another backup from {backup_folder(state_dir)}")
    db = state_dir / DB_NAME
    try:
        kept = Manifest.read(state_dir) or Manifest()  # the CA's fingerprint it records still holds
    except UnreadableState:
        kept = Manifest()
    aside = set_aside(state_dir, [p for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm"), state_dir / MANIFEST)
                                  if p.exists()])
    os.replace(trial, db)
    kept.open, kept.job_id, kept.pid = False, job.job_id, 0
    kept.write(state_dir)  # the restored file stands alone: no log is expected beside it
    return aside

