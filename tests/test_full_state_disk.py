"""A full coordinator state disk (`atoll.coordinator.spill`): the coordinator serves from memory, says so once,
queues its writes and writes them when space returns. The disk is filled at the store's transaction seam: every
SQLite write raises what SQLite raises on a full disk."""

from __future__ import annotations

import logging
import sqlite3
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from atoll.coordinator import handlers as h
from atoll.coordinator.spill import RETRY_S, SpillingStore
from atoll.coordinator.state import CoordinatorState
from atoll.coordinator.store import SqliteStore
from atoll.job import JobSpec
from atoll.v1 import atoll_pb2 as pb
from test_failure_replan import Clock

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret"


class Disk:
    """A SqliteStore whose disk can be made full: its transactions then raise as SQLite's do."""

    def __init__(self, path: Path):
        self.store = SqliteStore(path)
        self.full = False
        self.refused = 0
        real = self.store._tx

        @contextmanager
        def tx():
            if self.full:
                self.refused += 1
                raise sqlite3.OperationalError("database or disk is full")
            with real() as db:
                yield db
        self.store._tx = tx  # type: ignore[method-assign]


def _profile(host: str) -> pb.NodeProfile:
    return pb.NodeProfile(hostname=host, device_kind="cpu", device_name="cpu-x", device_count=1,
                          memory_total_bytes=16 << 30, memory_free_bytes=8 << 30, cpu_count=4,
                          layer_timings=[pb.LayerTiming(layer_kind="block", micro_batch=4, seq_len=64,
                                                        forward_seconds=0.01, backward_seconds=0.02)])


def test_a_full_state_disk_is_served_from_memory_and_written_when_space_returns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The finding: with a full state disk the coordinator logged 950 tracebacks in two minutes, lost every report,
    and its status stayed at step 71 while the nodes trained past step 320."""
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    job = replace(job, cluster=replace(job.cluster, expected_nodes=1, min_nodes=1))
    disk = Disk(tmp_path / "coordinator.db")
    clock = Clock()
    store = SpillingStore(disk.store, clock=clock)
    state = CoordinatorState(store=store, job=job, token=TOKEN, clock=clock)
    node = h.handle_join(pb.JoinRequest(token=TOKEN, node_id="n0", profile=_profile("h0"),
                                        peer_address="127.0.0.1:5000"), state).node_id
    for _ in range(20):
        clock.t += 1.0
        h.handle_heartbeat(pb.HeartbeatRequest(node_id=node), state)
        state.tick()
    assert state.epoch == 1

    def report(step: int) -> None:
        h.handle_report_step(pb.StepMetrics(job_id=job.id, node_id=node, plan_epoch=1, step=step, has_loss=True,
                                            loss=3.0 - step / 100, tokens=1024, step_seconds=0.1), state)

    for step in range(10):
        report(step)
    disk.full = True
    caplog.set_level(logging.INFO, logger="atoll")
    for step in range(10, 60):  # every call answers, the status follows the steps
        report(step)
        h.handle_heartbeat(pb.HeartbeatRequest(node_id=node), state)
        beat = clock.t
        clock.t += 0.5
        state.tick()
        assert h.handle_status(pb.StatusRequest(), state).step == step
    assert disk.refused > 1 and store.full_since is not None and store.queued >= 50
    said = [r for r in caplog.records if "state disk is full" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.ERROR and not said[0].exc_info  # once, one line
    assert not [r for r in caplog.records if r.exc_info]
    assert h.handle_status(pb.StatusRequest(), state).loss == pytest.approx(3.0 - 59 / 100)
    # space returns: the next try writes the queue, and the file serves again
    disk.full = False
    clock.t += RETRY_S
    state.tick()
    assert store.full_since is None and store.queued == 0
    assert any("space again" in r.getMessage() for r in caplog.records)
    report(60)
    store.close()
    again = SqliteStore(tmp_path / "coordinator.db")
    try:
        assert [s.step for s in again.recent_steps(1000)] == list(range(61))
        assert again.latest_epoch() == 1 and again.get_member("n0").last_heartbeat_unix == beat
        assert [p.last for p in again.history()][-1] == 60
    finally:
        again.close()
