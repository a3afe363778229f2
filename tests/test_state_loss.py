"""No silent state loss: a coordinator killed with SIGKILL whose state dir was then damaged (its write-ahead log
deleted, cut short or written over, its store deleted, its CA or identities file deleted or emptied) refuses to
start with one line naming --start-fresh, instead of starting a new job over it; --start-fresh moves the old state
aside; online backups are taken, and --restore brings one back with its members and checkpoint index."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from atoll.coordinator import backups, statedir
from atoll.coordinator.status import fetch_status, format_status
from atoll.coordinator.store import CheckpointRecord, MemberRecord, SqliteStore
from atoll.tls import bootstrap_rpc
from atoll.types import NodeProfile

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "state-loss-token"
MEMBERS, CHECKPOINTS = 3, 15
pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _coordinator(state: Path, *extra: str, log: Path) -> subprocess.Popen:
    addr = state.parent / "addr"
    addr.unlink(missing_ok=True)
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "atoll", "coordinator", "--job", str(ROOT / "examples" / "tiny.toml"),
             "--listen", "127.0.0.1:0", "--state-dir", str(state), "--token-file", str(state.parent / "token"),
             "--address-file", str(addr), *extra], stdout=out, stderr=subprocess.STDOUT)


def _started(proc: subprocess.Popen, addr: Path, timeout: float = 60.0) -> bool:
    """True once the coordinator listens, False when it exited first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if addr.exists():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    raise AssertionError("the coordinator neither listened nor exited")


def _seed(db: Path) -> None:
    """Members and a checkpoint index written while the coordinator runs, as its joins and reports would be: they
    sit in the write-ahead log until SQLite folds it into the file."""
    s = SqliteStore(db)
    for i in range(MEMBERS):
        s.put_member(MemberRecord(node_id=f"n{i}", peer_address=f"127.0.0.1:{5000 + i}", profile=NodeProfile(
            hostname=f"h{i}", device_kind="cpu", device_name="c", memory_total_bytes=1 << 30)))
    for step in range(CHECKPOINTS):
        s.add_checkpoint(CheckpointRecord(step=10 * (step + 1), plan_epoch=1, node_id="n0", layer_start=0, layer_end=2,
                                          path=f"/ck/{step}"))
    s.close()  # not the last connection: SQLite leaves the log as it is


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state dir (mutual TLS: CA and identities) of a coordinator killed with SIGKILL after members and 15
    checkpoints were committed to its log."""
    base = tmp_path_factory.mktemp("crashed")
    (base / "token").write_text(TOKEN + "\n")
    state = base / "state"
    proc = _coordinator(state, "--backup-every", "0", log=base / "first.log")
    try:
        assert _started(proc, base / "addr"), (base / "first.log").read_text()
        _seed(state / "coordinator.db")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert (state / "coordinator.db-wal").stat().st_size > 0
    return state


def _copy(crashed: Path, tmp_path: Path) -> Path:
    shutil.copytree(crashed.parent, tmp_path / "run")
    (tmp_path / "run" / "addr").unlink(missing_ok=True)
    return tmp_path / "run" / "state"


def _counts(db: Path) -> tuple[int, int]:
    s = SqliteStore(db)
    try:
        return len(s.list_members()), len(s.list_checkpoints())
    finally:
        s.close()


def _cut_half(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[:len(data) // 2])


def _scribble(p: Path) -> None:
    data = bytearray(p.read_bytes())
    middle = len(data) // 2
    data[middle - 4096:middle + 4096] = os.urandom(8192)
    p.write_bytes(bytes(data))


def _empty(p: Path) -> None:
    p.write_bytes(b"")


DAMAGE: dict[str, tuple[tuple[str, ...], Callable[[Path], None], str]] = {
    "the log deleted": (("coordinator.db-wal",), Path.unlink, "write-ahead log coordinator.db-wal is missing"),
    "the log and its index deleted": (("coordinator.db-wal", "coordinator.db-shm"), Path.unlink,
                                      "write-ahead log coordinator.db-wal is missing"),
    "the log cut in half": (("coordinator.db-wal",), _cut_half, "write-ahead log coordinator.db-wal is damaged"),
    "the log written over": (("coordinator.db-wal",), _scribble, "write-ahead log coordinator.db-wal is damaged"),
    "the store deleted": (("coordinator.db",), Path.unlink, "the store coordinator.db is missing"),
    "the CA deleted": (("ca.key", "ca.pem"), Path.unlink, "the job CA (ca.key, ca.pem) is missing"),
    "identities deleted": (("identities.db",), Path.unlink, "identities.db is missing"),
    "identities emptied": (("identities.db",), _empty, "identities.db is empty"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_state_after_a_crash_exits_2_with_one_line(crashed: Path, tmp_path: Path, kind: str) -> None:
    state = _copy(crashed, tmp_path)
    names, damage, needle = DAMAGE[kind]
    for name in names:
        damage(state / name)
    proc = _coordinator(state, log=tmp_path / "restart.log")
    try:
        started = _started(proc, tmp_path / "run" / "addr")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    out = (tmp_path / "restart.log").read_text()
    assert not started, f"the coordinator started over a damaged state dir ({kind}):\n{out[-2000:]}"
    assert proc.returncode == 2, out[-2000:]
    errors = [line for line in out.splitlines() if " E atoll" in line]
    assert "Traceback" not in out and len(errors) == 1, out[-2000:]
    assert needle in errors[0] and "--start-fresh" in errors[0] and "--restore" in errors[0], errors[0]


def test_a_crash_with_its_log_whole_restarts_with_everything(crashed: Path, tmp_path: Path) -> None:
    """The control: the same crashed dir, undamaged, starts, and SQLite's recovery keeps what the log held."""
    state = _copy(crashed, tmp_path)
    statedir.check(state, mutual_tls=True)
    assert _counts(state / "coordinator.db") == (MEMBERS, CHECKPOINTS)


def test_start_fresh_moves_the_damaged_state_aside(crashed: Path, tmp_path: Path) -> None:
    state = _copy(crashed, tmp_path)
    (state / "coordinator.db-wal").unlink()
    proc = _coordinator(state, "--start-fresh", "--backup-every", "0", log=tmp_path / "fresh.log")
    try:
        assert _started(proc, tmp_path / "run" / "addr"), (tmp_path / "fresh.log").read_text()[-2000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "fresh.log").read_text()
    (aside,) = (state / "aside").iterdir()
    assert "--start-fresh: the old state is in" in out and str(aside) in out
    assert {"coordinator.db", "ca.key", "ca.pem", "identities.db", "state.json"} <= {p.name for p in aside.iterdir()}
    assert _counts(state / "coordinator.db") == (0, 0)
    assert statedir.Manifest.read(state).open is False  # a clean stop is recorded: its log may go
    assert not (state / "coordinator.db-wal").exists()
    statedir.check(state, mutual_tls=True)


def test_a_clean_stop_leaves_no_log_and_restarts(tmp_path: Path) -> None:
    """A missing log after a clean stop is normal (SQLite folds it in and deletes it) and is not refused."""
    (tmp_path / "token").write_text(TOKEN + "\n")
    state = tmp_path / "state"
    for round_ in range(2):
        proc = _coordinator(state, "--backup-every", "0", log=tmp_path / f"run{round_}.log")
        try:
            assert _started(proc, tmp_path / "addr"), (tmp_path / f"run{round_}.log").read_text()[-2000:]
            if round_ == 0:
                _seed(state / "coordinator.db")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
        assert not (state / "coordinator.db-wal").exists()
    assert _counts(state / "coordinator.db") == (MEMBERS, CHECKPOINTS)


def test_backups_are_taken_online_and_restore_brings_one_back(tmp_path: Path) -> None:
    (tmp_path / "token").write_text(TOKEN + "\n")
    state = tmp_path / "state"
    proc = _coordinator(state, "--backup-every", "0.5", "--backups-kept", "2", log=tmp_path / "first.log")
    try:
        assert _started(proc, tmp_path / "addr"), (tmp_path / "first.log").read_text()[-2000:]
        _seed(state / "coordinator.db")
        seeded = time.time()
        folder = state / "backups"
        deadline = time.monotonic() + 30
        while not any(b.taken_unix > seeded for b in backups.listed(folder)):
            assert time.monotonic() < deadline, "no backup was taken after the members and checkpoints were written"
            time.sleep(0.1)
        time.sleep(1.5)  # a few more: only the newest two are kept
        listed = backups.listed(folder)
        assert len(listed) == 2
        # no temporary file left over by a finished backup (the next one, taken every 0.5 s, may be in flight: its
        # temporary name is newer than every finished backup's)
        newest = max(b.path.name for b in listed)
        assert not [p for p in folder.iterdir() if p.name.startswith(".") and p.name[1:].split(".db", 1)[0] + ".db"
                    <= newest]
        address = (tmp_path / "addr").read_text().strip()
        status = fetch_status(address, token=TOKEN, rpc=bootstrap_rpc(TOKEN, (state / "ca.pem").read_bytes()))
        assert Path(status.newest_backup_path).parent == folder and status.newest_backup_unix > seeded
        assert f"newest backup of the store: {status.newest_backup_path}" in format_status(status)
        assert Path(status.newest_backup_path).name.startswith("coordinator-")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    newest = backups.newest(state / "backups")
    assert newest is not None and _counts(newest.path) == (MEMBERS, CHECKPOINTS)
    kept = tmp_path / "kept.db"
    shutil.copy(newest.path, kept)
    (state / "coordinator.db").unlink()  # the store lost: refused, then brought back from the backup
    (state / "coordinator.db-wal").unlink()
    proc = _coordinator(state, "--restore", str(kept), "--backup-every", "0", log=tmp_path / "restored.log")
    try:
        assert _started(proc, tmp_path / "addr"), (tmp_path / "restored.log").read_text()[-2000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "restored.log").read_text()
    assert f"--restore: the store of {kept} is back" in out, out[-2000:]
    assert _counts(state / "coordinator.db") == (MEMBERS, CHECKPOINTS)


def test_restore_refuses_a_damaged_backup_in_one_line(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"SQLite format 3\x00" + os.urandom(8192))
    with pytest.raises(backups.RestoreError, match=f"--restore {bad}: .*not a SQLite|--restore {bad}: .*damaged"):
        backups.restore(bad, state)
    assert not list(state.iterdir())  # nothing was moved or left behind


def test_backup_is_consistent_while_the_store_is_written(tmp_path: Path) -> None:
    db = tmp_path / "coordinator.db"
    s = SqliteStore(db)
    for step in range(200):
        s.add_checkpoint(CheckpointRecord(step=step, plan_epoch=1, node_id="n0", layer_start=0, layer_end=1))
    taken = backups.take(db, tmp_path / "backups", keep=3)
    s.close()
    copy = sqlite3.connect(taken.path)
    assert copy.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert copy.execute("SELECT COUNT(*) FROM checkpoints").fetchone()[0] == 200
    assert copy.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    copy.close()
