"""A job's whole life: the step it ends at, `atoll job stop/extend`, finished in status, nodes that exit."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from pipeline_harness import tiny_job

from atoll.coordinator import handlers as h
from atoll.coordinator import job_control as jc
from atoll.coordinator.errors import FailedPrecondition, InvalidArgument
from atoll.coordinator.state import CoordinatorState
from atoll.coordinator.status import format_status
from atoll.coordinator.store import JobControlRecord, MemoryStore, SqliteStore
from atoll.job import JobSpec
from atoll.v1 import atoll_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret"


# --- decisions -----------------------------------------------------------------------------------------------


def test_stop_ends_a_few_steps_after_the_newest_and_never_later_than_the_target() -> None:
    c, how = jc.stop(JobControlRecord(), spec_steps=100, newest_step=10, now=5.0)
    assert c.target_steps == 11 + jc.STOP_MARGIN and c.stopped_unix == 5.0 and "checkpoint" in how
    c2, _ = jc.stop(JobControlRecord(), spec_steps=100, newest_step=98, now=5.0)
    assert c2.target_steps == 100
    with pytest.raises(jc.ControlRefused, match=r"already finished after step 99 \(100 steps\)"):
        jc.stop(JobControlRecord(finished_unix=1.0), spec_steps=100, newest_step=99, now=5.0)
    c3, how = jc.stop(JobControlRecord(), spec_steps=100, newest_step=None, now=5.0)  # before any step
    assert c3.target_steps == jc.STOP_MARGIN and "no step reported yet" in how
    assert f"with a checkpoint of its {jc.STOP_MARGIN} steps (step-{jc.STOP_MARGIN:08d})" in how


def test_extend_moves_the_end_unless_too_late_finished_or_stopping() -> None:
    c, how = jc.extend(JobControlRecord(), 50, spec_steps=100, newest_step=10)
    assert c.target_steps == 150 and "after step 149 instead of step 99" in how
    c, _ = jc.extend(c, 10, spec_steps=100, newest_step=120)
    assert jc.target_steps(100, c) == 160
    for control, newest, match in ((JobControlRecord(), 97, "within"), (JobControlRecord(finished_unix=1.0), 99,
                                                                         "finished"),
                                   (JobControlRecord(stopped_unix=1.0, target_steps=20), 10, "stopping")):
        with pytest.raises(jc.ControlRefused, match=match):
            jc.extend(control, 5, spec_steps=100, newest_step=newest)
    with pytest.raises(jc.ControlRefused, match="at least one"):
        jc.extend(JobControlRecord(), 0, spec_steps=100, newest_step=1)


def test_finished_once_the_last_step_is_reported() -> None:
    assert jc.finished(JobControlRecord(), complete=False, now=3.0) is None
    done = jc.finished(JobControlRecord(), complete=True, now=3.0)
    assert done is not None and done.finished_unix == 3.0 and jc.job_state(done) == "finished"
    assert jc.finished(done, complete=True, now=4.0) is None  # the first time counts
    assert jc.job_state(JobControlRecord(stopped_unix=1.0)) == "stopping"
    assert jc.job_state(JobControlRecord()) == "running"


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_the_control_record_survives_in_the_store(kind: str, tmp_path: Path) -> None:
    store = MemoryStore() if kind == "memory" else SqliteStore(tmp_path / "state.db")
    assert store.get_control() == JobControlRecord()
    store.put_control(JobControlRecord(target_steps=42, stopped_unix=1.5, finished_unix=2.5))
    if kind == "sqlite":
        store.close()
        store = SqliteStore(tmp_path / "state.db")
    assert store.get_control() == JobControlRecord(target_steps=42, stopped_unix=1.5, finished_unix=2.5)
    store.close()


# --- handlers ------------------------------------------------------------------------------------------------


@pytest.fixture
def state() -> CoordinatorState:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=20))
    return CoordinatorState(store=MemoryStore(), job=job, token=TOKEN, clock=lambda: 1000.0)


def _node(state: CoordinatorState) -> str:
    profile = pb.NodeProfile(hostname="h", device_kind="cpu", device_name="x", device_count=1,
                             memory_total_bytes=1 << 30, cpu_count=1)
    return h.handle_join(pb.JoinRequest(token=TOKEN, profile=profile, peer_address="127.0.0.1:1"), state).node_id


def _step(state: CoordinatorState, node: str, step: int) -> pb.StepAck:
    return h.handle_report_step(pb.StepMetrics(job_id=state.job.id, node_id=node, plan_epoch=0, step=step,
                                               has_loss=True, loss=1.0, tokens=10, step_seconds=0.1,
                                               unix_time=1000.0), state)


def test_extend_then_stop_through_the_handlers_and_the_acks(state: CoordinatorState) -> None:
    node = _node(state)
    assert _step(state, node, 3).target_steps == 20
    reply = h.handle_control_job(pb.JobControlRequest(action="extend", steps=10), state)
    assert reply.target_steps == 30 and reply.step == 3
    ack = _step(state, node, 4)
    assert (ack.target_steps, ack.stop) == (30, False)
    assert h.handle_status(pb.StatusRequest(), state).job_state == "running"
    stop = h.handle_control_job(pb.JobControlRequest(action="stop"), state)
    assert stop.target_steps == 5 + jc.STOP_MARGIN
    status = h.handle_status(pb.StatusRequest(), state)
    assert (status.job_state, status.target_steps) == ("stopping", 9)
    assert "stopping" in format_status(status)
    last = _step(state, node, 8)
    assert last.stop and last.target_steps == 9
    # trained, but not finished before its final checkpoint is held, or a bounded wait for it passed
    assert h.handle_status(pb.StatusRequest(), state).job_state == "stopping"
    bound = jc.FINAL_CHECKPOINT_LEASES * state.options.membership.lease.total_seconds()
    state.clock = lambda: 1000.0 + bound
    h.handle_heartbeat(pb.HeartbeatRequest(node_id=node), state)  # (alive: its lease is not what this is about)
    state.tick()
    status = h.handle_status(pb.StatusRequest(), state)
    assert status.job_state == "finished" and status.finished_unix == 1000.0 + bound
    text = format_status(status)
    assert "stopped (atoll job stop) after step 8: 9 steps trained" in text  # not "all"
    assert "WITHOUT ITS FINAL CHECKPOINT (step-00000009): the newest complete one held is none" in text
    beat = h.handle_heartbeat(pb.HeartbeatRequest(node_id=node), state)
    assert beat.job_finished and beat.target_steps == 9  # a run that starts later ends there too
    assert state.job_complete()
    with pytest.raises(FailedPrecondition, match="finished"):
        h.handle_control_job(pb.JobControlRequest(action="extend", steps=5), state)
    with pytest.raises(InvalidArgument, match="'stop', 'extend', 'quarantine', 'release' or 'viewer-token'"):
        h.handle_control_job(pb.JobControlRequest(action="pause"), state)
    with pytest.raises(FailedPrecondition, match="runs job"):
        h.handle_control_job(pb.JobControlRequest(job_id="other", action="stop"), state)


# --- processes -----------------------------------------------------------------------------------------------


def _wait(what: str, until, timeout: float, cluster) -> object:
    end = time.monotonic() + timeout
    while True:
        got = until()
        if got:
            return got
        assert time.monotonic() < end, f"timed out waiting for {what}; logs in {cluster.out}"
        time.sleep(0.5)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_extend_stop_finish_and_every_node_exits(tmp_path: Path) -> None:
    """Two nodes run a pinned two-stage plan and two are left idle, one of them started with --stay. `atoll job
    extend` and `atoll job stop` act through the coordinator; the job finishes at the stop's step with a
    checkpoint, `atoll status` says finished, every node but the --stay one (the idle one too) exits by itself
    and the coordinator keeps answering."""
    from atoll.launch.localcluster import LocalCluster
    from atoll.plan import PipelinePlan, Plan, StagePlan

    # (long enough that the stop, two command-line start-ups after step 3, lands well before the end under load)
    job = tiny_job(2000, interval=10000, nodes=4)
    job_path, plan_path, out = tmp_path / "job.toml", tmp_path / "plan.json", tmp_path / "cluster"
    job_path.write_text(job.to_toml())
    ids = {"node1": "first", "node2": "second", "node3": "spare", "node4": "keeper"}
    plan = Plan(model="tiny", global_batch=16, seq_len=64, pipelines=[PipelinePlan(
        micro_batch=4, num_micro_batches=4, stages=[StagePlan(island="a", layers=(0, 3), nodes=["first"]),
                                                   StagePlan(island="b", layers=(3, 6), nodes=["second"])])])
    plan.save(plan_path)
    with LocalCluster(job_path=job_path, out=out, profile_seconds=1.0) as cluster:
        cluster.start_coordinator(extra=["--plan", str(plan_path)])
        for name, node_id in ids.items():
            cluster.start_node(name, node_id=node_id, extra=["--stay"] if name == "node4" else [])
        _wait("step 3", lambda: cluster.status().step >= 3, 200, cluster)
        base = [sys.executable, "-m", "atoll", "job"]
        auth = ["--coordinator", cluster.address, "--token-file", str(cluster.token_file),
                *(["--insecure"] if cluster.insecure else ["--tls-ca", str(cluster.ca_file)])]
        ext = subprocess.run(base + ["extend", "--steps", "20"] + auth, capture_output=True, text=True, timeout=60)
        assert ext.returncode == 0, ext.stderr
        assert "the job now ends after step 2019 instead of step 1999" in ext.stdout, ext.stdout
        stop = subprocess.run(base + ["stop"] + auth, capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0, stop.stderr
        # one line, one numbering (the logs' step numbers): the last step, and the newest reported once
        assert stop.stdout.count("\n") == 1 and stop.stdout.count("newest reported") == 1, stop.stdout
        target = int(re.search(r"after step (\d+)", stop.stdout)[1]) + 1
        assert target < 1000
        status = _wait("finished", lambda: (lambda s: s if s.job_state == "finished" else None)(cluster.status()),
                       150, cluster)
        assert status.target_steps == target and status.finished_unix > 0
        assert max(cluster.losses()) == target - 1
        for name in ("node1", "node2", "node3"):  # every node leaves and exits by itself, the idle one too
            assert cluster.procs[name].wait(90) == 0, f"{name} did not exit cleanly; logs in {out}"
        assert cluster.procs["node4"].poll() is None, "a node started with --stay should keep running"
        after = cluster.status()  # the coordinator still answers
        assert after.job_state == "finished" and after.last_checkpoint_step == target
        assert sorted((m.node_id, m.state) for m in after.members) == [
            ("first", "left"), ("keeper", "alive"), ("second", "left"), ("spare", "left")]


_SCRIPT = """
import sys, time
from atoll.launch.localcluster import LocalCluster
with LocalCluster(job_path=sys.argv[1], out=sys.argv[2], insecure=True) as cluster:
    cluster.start_coordinator()
    print(cluster.procs["coordinator"].pid, flush=True)
    time.sleep(120)
"""


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_sigterm_of_a_script_running_a_local_cluster_stops_what_it_started(tmp_path: Path) -> None:
    import os
    import signal

    script = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(ROOT / "examples" / "tiny.toml"),
                               str(tmp_path / "cluster")], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(script.stdout.readline())  # type: ignore[union-attr]
        os.kill(pid, 0)  # the coordinator runs
        script.send_signal(signal.SIGTERM)
        assert script.wait(60) == 128 + signal.SIGTERM
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        script.kill()
        script.wait(10)
