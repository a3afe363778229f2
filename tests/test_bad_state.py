"""Bad state and bad setup: a damaged coordinator state file is refused at start with a message naming the way out
(never a traceback, never a silent fresh start), and setup mistakes (busy ports, a state dir that is a file or
cannot be written) end in one line."""

from __future__ import annotations

import os
import shutil
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from atoll.coordinator.integrity import DamagedState
from atoll.coordinator.store import CheckpointRecord, JobRecord, MemberRecord, SqliteStore, StoreError
from atoll.plan import IslandInfo, PipelinePlan, Plan, StagePlan
from atoll.preflight import SetupError, check_listen, usable_state_dir
from atoll.types import LayerTiming, LinkMeasurement, NodeProfile

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(60)


def _healthy(path: Path) -> Path:
    """A state file with a job, members, links, islands, two plans and a checkpoint index: several pages."""
    s = SqliteStore(path)
    s.put_job(JobRecord(job_id="j", name="n", spec_toml="x"))
    for i in range(40):
        s.put_member(MemberRecord(node_id=f"n{i:02d}", peer_address=f"127.0.0.1:{5000 + i}", profile=NodeProfile(
            hostname=f"h{i}", device_kind="cpu", device_name="cpu-x", memory_total_bytes=8 << 30,
            layer_timings=[LayerTiming(layer_kind="block", micro_batch=2, seq_len=64, forward_seconds=0.01,
                                       backward_seconds=0.02)])))
    s.put_links([LinkMeasurement(src=f"n{i:02d}", dst=f"n{j:02d}", bandwidth_bytes_per_s=1e9, rtt_seconds=1e-3,
                                 measured_unix=1.0) for i in range(40) for j in range(40) if i != j])
    s.put_islands([IslandInfo(id="cpu0", device="cpu-x", nodes=["n00", "n01"], gpus=2, inner_bandwidth=1e9)])
    for epoch in (1, 2):
        s.add_plan(Plan(model="tiny", global_batch=8, seq_len=32, epoch=epoch, job_id="j", pipelines=[
            PipelinePlan(micro_batch=2, num_micro_batches=4, stages=[
                StagePlan(island="cpu0", layers=(0, 3), nodes=["n00"]),
                StagePlan(island="cpu0", layers=(3, 6), nodes=["n01"])])]), created_unix=1.0)
    for step in (10, 20):
        for node, layers in (("n00", (0, 3)), ("n01", (3, 6))):
            s.add_checkpoint(CheckpointRecord(step=step, plan_epoch=2, node_id=node, layer_start=layers[0],
                                              layer_end=layers[1], path=f"/ck/{step}"))
    s.close()
    assert not Path(f"{path}-wal").exists()  # checkpointed on close: the file alone holds the state
    return path


def _sql(*statements: str) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        db = sqlite3.connect(path)
        for sql in statements:
            db.execute(sql)
        db.commit()
        db.close()
    return damage


def _truncate(size: int | float) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        data = path.read_bytes()
        path.write_bytes(data[:int(len(data) * size) if isinstance(size, float) else size])
    return damage


def _scribble(path: Path) -> None:
    """Garbage over the pages in the middle of the file (its header intact)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle - 8192:middle + 8192] = os.urandom(16384)
    path.write_bytes(bytes(data))


def _folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "cut in half": (_truncate(0.5), "damaged"),
    "cut inside the header page": (_truncate(60), "cut short"),
    "empty": (_truncate(0), "empty"),
    "random bytes": (lambda p: p.write_bytes(os.urandom(64 * 1024)), "not a SQLite database"),
    "a text file": (lambda p: p.write_text("[job]\nname = 'tiny'\n" * 100), "not a SQLite database"),
    "scribbled pages": (_scribble, "damaged"),
    "a folder": (_folder, "folder"),
    "checkpoints table dropped": (_sql("DROP TABLE checkpoints"), "checkpoints table is missing"),
    "members table dropped": (_sql("DROP TABLE members"), "members table is missing"),
    "another program's database": (_sql(*[f"DROP TABLE {t}" for t in ("job", "members", "links", "islands", "plans",
                                                                       "checkpoints")]), "another program"),
    "a column missing": (_sql("ALTER TABLE members DROP COLUMN reason"), "lacks the column reason"),
    "schema from a newer atoll": (_sql("PRAGMA user_version=99"), "schema version 99"),
    "a member's profile is not JSON": (_sql("UPDATE members SET profile_json = '{oops' WHERE node_id = 'n03'"),
                                       "member 'n03'"),
    "a member in an unknown state": (_sql("UPDATE members SET state = 'zombie' WHERE node_id = 'n04'"),
                                     "unknown state 'zombie'"),
    "the newest plan is not JSON": (_sql("UPDATE plans SET plan_json = 'null' WHERE epoch = 2"), "newest plan"),
    "text in a checkpoint step": (_sql("UPDATE checkpoints SET step = 'ten' WHERE step = 10"), "checkpoints table"),
    "the job record deleted": (_sql("DELETE FROM job"), "job record is missing"),
    "islands not JSON": (_sql("UPDATE islands SET islands_json = '[{'"), "islands record"),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_state_file_is_refused_with_the_way_out(tmp_path: Path, kind: str) -> None:
    path = _healthy(tmp_path / "coordinator.db")
    damage, needle = DAMAGE[kind]
    damage(path)
    with pytest.raises(StoreError) as info:
        SqliteStore(path).close()
    message = str(info.value)
    assert needle in message, message
    assert str(path) in message
    if kind != "schema from a newer atoll":
        assert isinstance(info.value, DamagedState)
        assert "Move it aside" in message and "restore a backup" in message


def test_the_healthy_file_opens_with_its_state(tmp_path: Path) -> None:
    s = SqliteStore(_healthy(tmp_path / "coordinator.db"))
    assert len(s.list_members()) == 40 and s.latest_epoch() == 2 and len(s.list_checkpoints()) == 4
    s.close()


@pytest.mark.timeout(120)
def test_the_coordinator_command_prints_one_line_for_a_damaged_file(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "coordinator.db").write_bytes(os.urandom(4096))
    out = subprocess.run([sys.executable, "-m", "atoll", "coordinator", "--job", str(ROOT / "examples" / "tiny.toml"),
                          "--listen", "127.0.0.1:0", "--state-dir", str(state), "--insecure"],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "not a SQLite database" in out.stderr and "--state-dir NEW" in out.stderr


# --- setup mistakes --------------------------------------------------------------------------------------


def test_a_state_dir_that_is_a_file_or_under_one_is_refused(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(SetupError, match="is a file, not a folder"):
        usable_state_dir(afile)
    with pytest.raises(SetupError, match="a part of the path is a file"):
        usable_state_dir(afile / "sub")
    assert usable_state_dir(tmp_path / "new" / "dir").is_dir()


def test_a_state_dir_that_cannot_be_written_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SetupError, match="cannot create --state-dir|not writable"):
        usable_state_dir(Path("/proc/self/atoll-state"))  # a filesystem nobody may create folders in
    if os.geteuid() != 0:  # root writes through permissions
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            with pytest.raises(SetupError, match="not writable"):
                usable_state_dir(locked)
        finally:
            locked.chmod(0o700)


def test_a_busy_port_is_one_clear_error() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(SetupError, match=f"port {port} is in use"):
            check_listen(f"127.0.0.1:{port}", "--listen")
    check_listen("127.0.0.1:0", "--listen")
    with pytest.raises(SetupError, match="not HOST:PORT"):
        check_listen("127.0.0.1:http", "--listen")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag", ["--listen", "--metrics-port", "--state-dir", "--heartbeat-budget"])
def test_the_coordinator_command_prints_one_line_for_setup_mistakes(tmp_path: Path, flag: str) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        args = {"--listen": ["--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "s")],
                "--metrics-port": ["--listen", "127.0.0.1:0", "--metrics-port", str(port),
                                   "--state-dir", str(tmp_path / "s")],
                "--state-dir": ["--listen", "127.0.0.1:0", "--state-dir", str(afile)],
                "--heartbeat-budget": ["--listen", "127.0.0.1:0", "--heartbeat-budget", "-5",
                                       "--state-dir", str(tmp_path / "s")]}[flag]
        out = subprocess.run([sys.executable, "-m", "atoll", "coordinator", "--job",
                              str(ROOT / "examples" / "tiny.toml"), "--insecure", *args],
                             capture_output=True, text=True, timeout=100)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and flag in out.stderr, out.stderr[-2000:]
    shutil.rmtree(tmp_path / "s", ignore_errors=True)


@pytest.mark.timeout(120)
def test_the_node_command_prints_one_line_for_setup_mistakes(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        for args, needle in ((["--state-dir", str(afile)], "is a file, not a folder"),
                             (["--state-dir", str(tmp_path / "n"), "--listen", f"127.0.0.1:{port}"], "is in use")):
            out = subprocess.run([sys.executable, "-m", "atoll", "node", "--coordinator", "127.0.0.1:1", "--token", "t",
                                  "--insecure", *args], capture_output=True, text=True, timeout=100)
            assert out.returncode == 2, out.stderr[-2000:]
            assert "Traceback" not in out.stderr and needle in out.stderr, out.stderr[-2000:]
