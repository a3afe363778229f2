"""A bounded `bench.chaos`: the tiny job on three node processes and a coordinator process, with a coordinator
SIGKILLed and restarted on its state dir and a node SIGKILLed and restarted, through the benchmark's own driver
(`bench.faults`). The job completes, the coordinator's outage costs no step (training between neighbours goes on
while it is away, and the restarted coordinator keeps the plan), and the node's death is detected within its
lease and a tick. A job that ends while the coordinator is away is recorded complete once it is back: its nodes
wait for it with their last reports."""

from __future__ import annotations

import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from atoll.node.agent import AgentConfig, NodeAgent  # noqa: E402
from atoll.v1 import atoll_pb2 as pb  # noqa: E402
from bench.faults import (DriverConfig, Event, FaultDriver, FaultSchedule, RunRecord, detected_at,  # noqa: E402
                          rolled_back, write_job)


def test_rolled_back_counts_the_deepest_fall_below_the_steps_trained() -> None:
    steps = [(1.0, 10, 1, 0.0), (2.0, 11, 1, 0.0), (3.0, 12, 1, 0.0), (5.0, 10, 2, 0.0), (6.0, 11, 2, 0.0),
             (7.0, 12, 2, 0.0), (8.0, 13, 2, 0.0)]
    assert rolled_back(steps, 4.0, 9.0) == 3  # 12 was trained, the job went on from 10
    assert rolled_back(steps, 2.5, 4.5) == 0
    assert rolled_back([(1.0, 5, 1, 0.0), (2.0, 6, 1, 0.0), (3.0, 7, 1, 0.0)], 1.5, 9.0) == 0


def test_every_last_stage_replicas_loss_report_counts_the_step_once() -> None:
    """Each replica of a last stage reports the step's loss, stamped by its own clock: replica b's report of step 5
    after replica a's of step 6 is not step 5 trained again (the coordinator-kill test read it as a 1-step rollback)."""
    rec = RunRecord(steps={("a", 1, 5): (1.0, 5, 2.0, 1), ("a", 1, 6): (2.0, 6, 2.0, 1), ("b", 1, 5): (2.5, 5, 2.0, 1),
                           ("b", 1, 6): (3.0, 6, 2.0, 1), ("a", 2, 6): (5.0, 6, 2.1, 2)})
    assert [(t, s, e) for t, s, e, _ in rec.whole_steps()] == [(1.0, 5, 1), (2.0, 6, 1), (5.0, 6, 2)]
    assert rolled_back(rec.whole_steps(), 0.0, 4.0) == 0
    assert rolled_back(rec.whole_steps(), 4.0, 9.0) == 1  # epoch 2 trained step 6 again


def test_a_kill_is_detected_by_the_store_marking_the_node_gone_or_a_plan_without_the_node() -> None:
    from atoll.plan import PipelinePlan, Plan, StagePlan

    plan = Plan(model="tiny", global_batch=16, seq_len=64, epoch=2, job_id="j",
                pipelines=[PipelinePlan(micro_batch=4, num_micro_batches=4,
                                        stages=[StagePlan(island="cpu0", layers=(0, 6), nodes=["b"])])])
    ran = Event(index=1, kind="node-kill", at=10.0, node_id="a", role="pipeline 0 stage 0 of 1 (layers 0-6)")
    idle = Event(index=1, kind="node-kill", at=10.0, node_id="a", role="idle in the plan")
    rec = RunRecord(plans=[(12.0, plan, "gone")], gone_times={"a": [5.0, 14.0]})
    assert detected_at(ran, rec) == 12.0  # planned out before it was marked gone
    assert detected_at(idle, rec) == 14.0  # a plan that never named it says nothing; the store does
    assert detected_at(idle, rec, until=13.0) is None
    assert detected_at(ran, RunRecord(gone_times={"a": [5.0]})) is None  # an old death is not this one


def test_driver_config_says_what_to_change() -> None:
    with pytest.raises(ValueError, match="pace"):
        DriverConfig(pace="fast")
    with pytest.raises(ValueError, match="room_seconds"):
        DriverConfig(outage=5.0, lease=8.0, room_seconds=4.0)


def test_local_cluster_losses_keep_the_reports_a_coordinator_outage_delivered_late(tmp_path: Path) -> None:
    """300 reports kept through an outage arrive at once after newer ones, stamped with their own (older) times:
    none is missed, and a step retrained later keeps its later loss."""
    from atoll.coordinator.store import SqliteStore
    from atoll.launch.localcluster import LocalCluster
    from atoll.types import StepMetrics

    cluster = LocalCluster(job_path=tmp_path / "job.toml", out=tmp_path)
    cluster.state_db.parent.mkdir(parents=True)
    store = SqliteStore(cluster.state_db)

    def report(node: str, step: int, t: float, loss: float) -> None:
        store.add_step(StepMetrics(job_id="j", node_id=node, plan_epoch=1, step=step, loss=loss, unix_time=t))

    try:
        for step in range(10):
            report("a", step, 1000.0 + step, 5.0)
        assert sorted(cluster.losses()) == list(range(10))
        report("a", 400, 2000.0, 1.0)  # live, newer, read before the backlog arrives
        assert sorted(cluster.losses()) == list(range(10)) + [400]
        for step in range(10, 310):  # the backlog of the outage, older
            report("b", step, 1100.0 + step, 4.0)
        report("c", 5, 3000.0, 0.5)  # step 5 retrained after a rollback
        report("b", 5, 1500.0, 9.0)  # ... and an older report of it, late
        losses = cluster.losses()
    finally:
        store.close()
    assert sorted(losses) == list(range(310)) + [400]
    assert losses[5] == 0.5 and losses[300] == 4.0


class _Failed(grpc.RpcError):
    """What a stub raises for a call the coordinator answered with `code`."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _agent(state_dir: Path) -> NodeAgent:
    """An agent whose outbox retries fast, for calls stubbed in its `call`."""
    return NodeAgent(AgentConfig(coordinator="127.0.0.1:1", token="t", state_dir=state_dir,
                                 backoff=(timedelta(milliseconds=10), timedelta(milliseconds=40))))


@pytest.mark.timeout(30)
def test_a_stop_at_the_job_end_waits_for_the_coordinator_to_take_the_last_reports(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    agent.joins = 1  # joined: a stop leaves
    back = threading.Event()
    taken: list[int] = []

    def call(method: str, request, timeout=None):
        if not back.is_set():
            raise _Failed(grpc.StatusCode.UNAVAILABLE, "connection refused")
        if method == "ReportStep":
            taken.append(request.step)
        return pb.Ack(message="ok")

    agent.call = call  # type: ignore[method-assign]
    threading.Thread(target=agent._outbox_loop, daemon=True).start()
    for step in range(3):
        agent.send_later("ReportStep", pb.StepMetrics(step=step), epoch=0, what=f"step {step}")
    assert agent.undelivered() == 3
    threading.Timer(1.0, back.set).start()  # the coordinator is away for longer than a signal's stop waits
    t0 = time.monotonic()
    agent.stop(flush=timedelta(seconds=20))
    assert taken == [0, 1, 2] and agent.undelivered() == 0
    assert 0.9 < time.monotonic() - t0 < 15


@pytest.mark.timeout(30)
def test_the_report_of_a_copy_on_a_node_that_left_is_dropped_and_the_reports_behind_it_go_on(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    taken: list[str] = []

    def call(method: str, request, timeout=None):
        if method == "ReportCheckpoint" and request.node_id != "a":
            raise _Failed(grpc.StatusCode.NOT_FOUND, "node b was marked left (node stopped); join again")
        taken.append(f"{method} {request.step}")
        return pb.Ack(message="ok")

    agent.call = call  # type: ignore[method-assign]
    threading.Thread(target=agent._outbox_loop, daemon=True).start()
    try:
        agent.send_later("ReportCheckpoint", pb.CheckpointReport(node_id="a", step=100), epoch=1, what="own")
        agent.send_later("ReportCheckpoint", pb.CheckpointReport(node_id="b", step=100, copy_of="a"), epoch=1,
                         what="copy on b")
        agent.send_later("ReportStep", pb.StepMetrics(step=119, has_loss=True), epoch=1, what="step 119")
        assert agent.flush_outbox(timedelta(seconds=5))
        assert taken == ["ReportCheckpoint 100", "ReportStep 119"]
    finally:
        agent.stop(leave=False)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_the_job_survives_a_coordinator_kill_and_a_node_kill(tmp_path: Path) -> None:
    cfg = DriverConfig(nodes=3, gap_steps=5, first_at=10, min_steps=10, restart_after=5.0, outage=3.0, lease=4.0,
                       recover_timeout=120.0, room_seconds=60.0)
    job = write_job(cfg, 100, tmp_path / "job.toml")
    # seed 1 orders the two: the coordinator first, while the first plan trains
    schedule = FaultSchedule(node_kills=1, coordinator_kills=1, seed=1)
    assert schedule.events() == ["coordinator-kill", "node-kill"]
    driver = FaultDriver(cfg, job, tmp_path / "run", seed=1, say=print)
    events = driver.run(schedule, timeout=200.0)
    rec = driver.monitor.snapshot()
    print("\n".join(f"{e.kind} {e.target} at step {e.step}: detection {e.detection_s}, next step {e.next_step_s}, "
                    f"rolled back {e.rolled_back}; {e.role}; {e.note}" for e in events))
    assert [e.kind for e in events] == ["coordinator-kill", "node-kill"], "the job ended before every event"
    # extended while the events came (a minute of training ahead: more than a loaded machine's coordinator
    # restart), stopped a few steps after the last: after the step training went on from, which a kill of a stage's
    # only copy moved back to the last checkpoint
    assert driver.target >= events[-1].step - (events[-1].rolled_back or 0) and rec.finished > 0
    # (a plan the kill failed may have trained past the stop's end before it was rolled back)
    assert set(range(driver.target)) <= rec.reported(), "the job did not complete"
    # a step whose loss all-reduce failed when a replica died is trained without a loss: at most one
    assert len([s for s in rec.losses() if s < driver.target]) >= driver.target - 1
    coordinator, node = events
    assert coordinator.rolled_back == 0, coordinator.note
    assert coordinator.trained_while_down, coordinator.note  # neighbours trained on while it was away
    assert coordinator.next_step_s is not None and coordinator.next_step_s < cfg.outage
    assert coordinator.detection_s is not None and coordinator.detection_s < 60, coordinator  # every node back
    if node.role.startswith("pipeline"):  # a node the plan ran: its death is noticed within about a lease (the
        # lease from its last heartbeat, plus the coordinator's tick and any loop lag a loaded machine adds, and the
        # monitor's own polling): twice the lease bounds it without timing the machine
        assert node.detection_s is not None and node.detection_s <= 2 * cfg.lease, node


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_job_that_ends_while_the_coordinator_is_away_is_recorded_complete(tmp_path: Path) -> None:
    """The coordinator is killed 20 steps before the end and stays away 12 s: the nodes train to the end
    meanwhile, wait for it with their last step and checkpoint reports, and the restarted coordinator records
    the job finished with every step, on the plan it had."""
    # (20 steps take 2-4 s here: the outage outlasts them on a machine three times slower)
    cfg = DriverConfig(nodes=3, gap_steps=5, first_at=100, min_steps=10, outage=12.0, lease=13.0,
                       recover_timeout=120.0, room_seconds=0.0)
    job = write_job(cfg, 120, tmp_path / "job.toml")
    driver = FaultDriver(cfg, job, tmp_path / "run", say=print)
    events = driver.run(FaultSchedule(coordinator_kills=1), timeout=200.0)
    rec = driver.monitor.snapshot()
    assert [e.kind for e in events] == ["coordinator-kill"]
    print(events[0].note)
    assert rec.finished > 0 and sorted(rec.reported()) == list(range(120)) and len(rec.losses()) == 120
    assert events[0].rolled_back == 0 and "no new epoch" in events[0].note, events[0].note
    logs = "".join(p.read_text() for p in (tmp_path / "run").glob("node*.log"))
    # the outage outlasted the training left: the nodes ended while it was away and waited for it
    assert "for the coordinator to take this node's last" in logs
    assert "undelivered" not in logs
