"""A failed run with every node alive: the pure replan decision, the ReportFailure handler, the state's tick,
and what the node does around it (checkpoint pruning, the wait bound, the step reporter)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from atoll.coordinator import handlers as h
from atoll.coordinator.errors import FailedPrecondition, InvalidArgument, NotFound
from atoll.coordinator.membership import (LIVE_FETCH_FAILURES, MembershipOptions, RunFailureRecord,
                                          failure_backoff, failure_decision, live_resume)
from atoll.coordinator.state import CoordinatorOptions, CoordinatorState
from atoll.coordinator.store import MemoryStore
from atoll.job import CheckpointSpec, JobSpec, JobSpecError
from atoll.node.agent import step_wait_timeout
from atoll.node.checkpoint import complete_steps_on_disk, prune_checkpoints, prune_older, step_dir
from atoll.node.runner import _Reporter
from atoll.types import StepMetrics
from atoll.v1 import atoll_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret"
OPTS = MembershipOptions(failure_backoff=timedelta(seconds=1), failure_backoff_max=timedelta(seconds=60))
MEMBERS = {"a", "b", "c"}


def _failure(epoch: int, at: float, node: str = "b", step: int = 37) -> RunFailureRecord:
    return RunFailureRecord(epoch=epoch, node_id=node, step=step, reason="receive from a timed out",
                            reported_unix=at)


def _decide(now: float, epoch: int, failures: dict[int, RunFailureRecord], heard: float | None = None,
            alive: set[str] = MEMBERS):
    heard_at = now if heard is None else heard
    return failure_decision(now, epoch=epoch, failures=failures, alive=alive, planned=MEMBERS,
                            last_heard={n: heard_at for n in alive}, options=OPTS)


# --- the pure decision --------------------------------------------------------------------------------


def test_a_first_failure_replans_at_once_and_says_why() -> None:
    d = _decide(100.0, 4, {4: _failure(4, 100.0)})
    assert d.plan
    assert d.reason == "plan epoch 4 failed on node b at step 37: receive from a timed out"


def test_repeated_failures_of_consecutive_epochs_back_off() -> None:
    assert [failure_backoff(n, OPTS) for n in range(1, 10)] == [0, 1, 2, 4, 8, 16, 32, 60, 60]
    failures = {e: _failure(e, 100.0) for e in (5, 6, 7)}  # three epochs in a row failed: wait 2 s
    waiting = _decide(101.5, 7, failures)
    assert not waiting.plan and "3 epochs failed in a row, replanning 2s after the failure" in waiting.reason
    done = _decide(102.0, 7, failures)
    assert done.plan and "3 epochs failed in a row; waited 2s" in done.reason
    # a gap (epoch 6 was replaced by a membership change, not a failure) starts the count again
    assert _decide(100.0, 7, {5: _failure(5, 90.0), 7: _failure(7, 100.0)}).plan


def test_a_failure_of_an_older_epoch_is_no_reason() -> None:
    d = _decide(100.0, 5, {4: _failure(4, 99.0)})
    assert not d.plan and "no failure reported for plan epoch 5" in d.reason


def test_a_silent_or_departed_member_is_left_to_its_lease() -> None:
    failures = {4: _failure(4, 100.0)}
    silent = _decide(101.0, 4, failures, heard=99.0)  # nobody heard from since the failure
    assert not silent.plan and "waiting to hear from a, b, c" in silent.reason
    gone = _decide(101.0, 4, failures, alive={"a", "b"})
    assert not gone.plan and "membership differs" in gone.reason


def test_failure_backoff_options_are_checked() -> None:
    with pytest.raises(ValueError, match="failure_backoff"):
        MembershipOptions(failure_backoff=timedelta(seconds=5), failure_backoff_max=timedelta(seconds=1))


# --- the handler and the state's tick -----------------------------------------------------------------


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _profile(host: str) -> pb.NodeProfile:
    return pb.NodeProfile(hostname=host, device_kind="cpu", device_name="cpu-x", device_count=1,
                          memory_total_bytes=16 << 30, memory_free_bytes=8 << 30, cpu_count=4,
                          layer_timings=[pb.LayerTiming(layer_kind="block", micro_batch=4, seq_len=64,
                                                        forward_seconds=0.01, backward_seconds=0.02)])


def plan_three(profile=_profile, job: JobSpec | None = None, options: CoordinatorOptions | None = None
               ) -> tuple[CoordinatorState, Clock, list[str]]:
    """A state with three nodes joined (each with `profile(hostname)`), heart-beating and probed, and its first
    plan made (of `job`, default examples/tiny.toml, under `options`)."""
    clock = Clock()
    state = CoordinatorState(store=MemoryStore(), job=job or JobSpec.load(ROOT / "examples" / "tiny.toml"),
                             token=TOKEN, clock=clock, options=options)
    ids = [h.handle_join(pb.JoinRequest(token=TOKEN, profile=profile(f"h{i}"), peer_address=f"127.0.0.1:{5000 + i}"),
                         state).node_id for i in range(3)]
    for n in ids:
        reply = h.handle_heartbeat(pb.HeartbeatRequest(node_id=n), state)
        h.handle_report_probes(pb.ProbeReport(node_id=n, links=[
            pb.LinkMeasurement(src=n, dst=t.node_id, bandwidth_bytes_per_s=2e9, rtt_seconds=1e-4)
            for t in reply.probe]), state)
    state.tick()
    assert state.epoch == 1
    return state, clock, ids


@pytest.fixture
def planned() -> tuple[CoordinatorState, Clock, list[str]]:
    return plan_three()


def _report(state: CoordinatorState, node: str, epoch: int, **kw) -> pb.Ack:
    base = dict(job_id=state.job.id, node_id=node, plan_epoch=epoch, step=12, reason="step 12 failed: closed")
    base.update(kw)
    return h.handle_report_failure(pb.RunFailure(**base), state)


def test_report_failure_is_validated(planned) -> None:
    state, _, ids = planned
    with pytest.raises(NotFound):
        _report(state, "nobody-123456", 1)
    with pytest.raises(FailedPrecondition, match="not 'other-job'"):
        _report(state, ids[0], 1, job_id="other-job")
    with pytest.raises(FailedPrecondition, match="epoch 2"):
        _report(state, ids[0], 2)
    with pytest.raises(FailedPrecondition, match="epoch 0"):
        _report(state, ids[0], 0)
    with pytest.raises(InvalidArgument, match="at most 1000"):
        _report(state, ids[0], 1, reason="x" * 1001)
    with pytest.raises(InvalidArgument, match="empty"):
        _report(state, ids[0], 1, reason="")
    with pytest.raises(InvalidArgument, match="past the job"):
        _report(state, ids[0], 1, step=state.job.train.steps + 1)
    assert state.failures() == {}
    assert _report(state, ids[0], 1).message == "failure of plan epoch 1 recorded"
    assert _report(state, ids[1], 1).message == "failure of plan epoch 1 already known"
    assert state.failures()[1].node_id == ids[0]


def test_the_tick_replans_a_failed_epoch_with_the_same_members(planned) -> None:
    state, clock, ids = planned
    clock.t += 5
    _report(state, ids[1], 1)
    assert state.tick() == []  # nobody heard from since the failure: wait for heartbeats
    clock.t += 1
    for n in ids:
        h.handle_heartbeat(pb.HeartbeatRequest(node_id=n, plan_epoch=1), state)
    events = state.tick()
    assert state.epoch == 2 and len(events) == 1
    assert f"plan epoch 1 failed on node {ids[1]} at step 12: step 12 failed: closed" in events[0]
    plan = state.current_plan()
    assert plan is not None and {n for i in plan.islands for n in i.nodes} == set(ids)
    # a late report of the failed epoch is acknowledged and ignored
    assert "ignored" in _report(state, ids[2], 1).message
    assert state.tick() == [] and state.epoch == 2
    # epoch 2 fails too: the next plan waits failure_backoff (1 s by default)
    _report(state, ids[0], 2)
    for n in ids:
        h.handle_heartbeat(pb.HeartbeatRequest(node_id=n, plan_epoch=2), state)
    assert state.tick() == []
    clock.t += 1
    for n in ids:
        h.handle_heartbeat(pb.HeartbeatRequest(node_id=n, plan_epoch=2), state)
    assert "2 epochs failed in a row" in state.tick()[0] and state.epoch == 3


FETCH = ("setting up pipeline 0 stage 1 of epoch {e} failed: no live holder could give layers [6, 10) at step 28: "
         "could not fetch layers [6, 10) at step 28 from b: DEADLINE_EXCEEDED")


def test_plans_that_failed_to_fetch_the_agreed_live_state_are_followed_by_a_checkpoint_resume() -> None:
    """Made again from the same members, a plan agrees on the same live state: after LIVE_FETCH_FAILURES plans in a
    row failed to fetch it the next resumes from the checkpoint; one such failure, or one of another kind in the
    row, keeps live state."""
    def failures(*reasons: str) -> dict[int, RunFailureRecord]:
        return {e: RunFailureRecord(epoch=e, node_id="b", step=0, reason=r.format(e=e), reported_unix=0.0)
                for e, r in enumerate(reasons, 1) if r}

    assert LIVE_FETCH_FAILURES == 2
    assert live_resume(1, failures(FETCH))
    assert not live_resume(2, failures(FETCH, FETCH))
    assert not live_resume(3, failures("receive from a timed out", FETCH, FETCH))
    assert live_resume(3, failures(FETCH, FETCH, "receive from a timed out"))
    assert live_resume(3, failures(FETCH, "", FETCH))  # epoch 2 did not fail: the row is broken
    assert live_resume(2, failures("receive from a timed out", FETCH))


def test_the_tick_resumes_from_the_checkpoint_after_two_failed_live_fetches(planned) -> None:
    """End to end through the coordinator's handlers: the plan after two fetch failures says it resumes from the
    checkpoint (on the wire and in its JSON), and the plan after a failure of another kind goes back to live
    state."""
    import json

    from atoll.plan import Plan, resume_words
    from atoll.serde import plan_from_proto, plan_to_proto

    state, clock, ids = planned

    def fail(epoch: int, reason: str) -> list[str]:
        _report(state, ids[1], epoch, reason=reason)
        clock.t += 61  # past any backoff
        for n in ids:
            h.handle_heartbeat(pb.HeartbeatRequest(node_id=n, plan_epoch=epoch), state)
        return state.tick()

    assert state.current_plan().live_resume
    assert fail(1, FETCH.format(e=1)) and state.epoch == 2 and state.current_plan().live_resume
    assert fail(2, FETCH.format(e=2)) and state.epoch == 3
    plan = state.current_plan()
    assert not plan.live_resume
    for received in (plan_from_proto(plan_to_proto(plan)), Plan.from_json_dict(json.loads(plan.to_json()))):
        assert not received.live_resume
    assert "could not fetch the live state" in resume_words(0, 40, plan.live_resume)
    assert fail(3, "step 12 failed: closed") and state.epoch == 4 and state.current_plan().live_resume
    assert plan_from_proto(plan_to_proto(state.current_plan())).live_resume


# --- the node's side -----------------------------------------------------------------------------------


def _write(root: Path, step: int, ranges: list[tuple[int, int]]) -> None:
    folder = step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    for a, b in ranges:
        (folder / f"layers-{a:04d}-{b:04d}.pt").write_bytes(b"x")


def test_prune_keeps_the_newest_complete_checkpoints_and_the_resume_step(tmp_path: Path) -> None:
    full = [(0, 3), (3, 6)]
    for step in (10, 20, 30, 40, 50):
        _write(tmp_path, step, full)
    _write(tmp_path, 45, [(0, 3)])  # incomplete, newer than a kept one: stays
    _write(tmp_path, 60, [(0, 3)])  # incomplete (a stage still writing): never counts
    _write(tmp_path, 5, [(0, 2), (2, 6)])  # another cut, complete
    assert complete_steps_on_disk(tmp_path, 6) == [5, 10, 20, 30, 40, 50]
    # the coordinator has acknowledged up to 40 only: 50 does not count yet
    assert prune_checkpoints(tmp_path, total_layers=6, keep=2, upto=40, protect={10}) == [5, 20]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000010", "step-00000030", "step-00000040", "step-00000045", "step-00000050", "step-00000060"]
    assert prune_checkpoints(tmp_path, total_layers=6, keep=0) == []
    assert prune_checkpoints(tmp_path, total_layers=6, keep=5) == []


def test_a_node_holding_part_of_the_layers_or_copies_prunes_what_the_coordinator_says_no_one_needs(
        tmp_path: Path) -> None:
    """No step is complete on a disk holding one stage's layers and a copy of another's, so `prune_checkpoints`
    never deletes anything there: the coordinator's job-wide word (`prune_checkpoints_before`) does."""
    for step in (10, 20, 30, 40):
        _write(tmp_path, step, [(0, 3)])  # this node's stage, and nothing else
    assert prune_checkpoints(tmp_path, total_layers=6, keep=2) == []
    assert prune_older(tmp_path, 30) == [10, 20]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000030", "step-00000040"]
    assert prune_older(tmp_path, 0) == [] and prune_older(tmp_path / "none", 99) == []
    # the running plan's resume step stays, however old
    assert prune_older(tmp_path, 50, keep=30) == [40]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000030"]


def test_heartbeats_say_which_checkpoints_no_node_needs(planned) -> None:
    """Once the job holds `checkpoint.keep` complete checkpoints, heartbeat replies name the oldest of them:
    older steps may go from every disk but the running plan's resume step, which they name too."""
    state, _, ids = planned
    plan = state.current_plan()
    assert state.job.checkpoint.keep == 3
    stages = [(st.layers, st.nodes[0]) for p in plan.pipelines for st in p.stages]

    def beat() -> int:
        reply = h.handle_heartbeat(pb.HeartbeatRequest(node_id=ids[0]), state)
        assert reply.keep_checkpoint_step == plan.resume_step  # kept whatever its age
        return reply.prune_checkpoints_before

    for k, step in enumerate((10, 20, 30, 40)):
        for (a, b), node in stages:
            h.handle_report_checkpoint(pb.CheckpointReport(job_id=state.job.id, node_id=node, plan_epoch=plan.epoch,
                                                           step=step, layer_start=a, layer_end=b, path="p"), state)
        assert beat() == (0 if k < 2 else (10, 20)[k - 2])
    # an incomplete newer step (layers no stage of the plan holds alone) moves nothing
    (a, b), node = stages[0]
    h.handle_report_checkpoint(pb.CheckpointReport(job_id=state.job.id, node_id=node, plan_epoch=plan.epoch,
                                                   step=50, layer_start=a, layer_end=a + 1, path="p"), state)
    assert b > a + 1 and beat() == 20


def test_checkpoint_keep_is_written_only_when_set() -> None:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    assert job.checkpoint.keep == 3 and "keep" not in job.to_toml()
    text = job.to_toml().replace("[checkpoint]\n", "[checkpoint]\nkeep = 5\n").replace(f"id = \"{job.id}\"\n", "")
    other = JobSpec.from_toml(text)
    assert other.checkpoint.keep == 5 and other.id != job.id and JobSpec.from_toml(other.to_toml()) == other
    with pytest.raises(JobSpecError, match="checkpoint.keep"):
        CheckpointSpec(keep=-1)


def test_the_wait_bound_follows_measured_steps() -> None:
    default = timedelta(seconds=120)
    assert step_wait_timeout([], default) == default
    assert step_wait_timeout([0.1, 0.2, 0.3], default) == timedelta(seconds=10)
    assert step_wait_timeout([3.0, 2.0, 50.0], default) == timedelta(seconds=30)


def _metrics(step: int) -> StepMetrics:
    return StepMetrics(job_id="j", node_id="n", plan_epoch=1, step=step, pipeline=0, stage=0, loss=None, tokens=1,
                       step_seconds=0.1, compute_seconds=0.1, wait_seconds=0.0, links=[], unix_time=0.0)


@pytest.mark.timeout(20)
def test_the_step_reporter_retries_through_an_outage_without_blocking() -> None:
    up = threading.Event()
    sent: list[int] = []

    def send(m: StepMetrics) -> bool:
        if not up.is_set():
            raise ConnectionError("coordinator away")
        sent.append(m.step)
        return m.step == 9

    reporter = _Reporter(send, capacity=4, backoff=(0.01, 0.05))
    t0 = time.monotonic()
    for step in range(10):
        reporter.put(_metrics(step))
    assert time.monotonic() - t0 < 0.5  # put never waits for the coordinator
    time.sleep(0.1)
    up.set()
    reporter.close(timedelta(seconds=5))
    assert sent[-4:] == [6, 7, 8, 9] and set(sent) <= {5, 6, 7, 8, 9}  # the oldest were dropped, the rest sent
    assert reporter.stop_requested.is_set()


@pytest.mark.timeout(60)
def test_a_checkpoint_that_cannot_be_written_fails_alone(tmp_path: Path, caplog) -> None:
    """A full disk or a folder without permission fails the checkpoint, with a clear log line, not the run."""
    from dataclasses import replace

    from atoll.node.peer import PeerServer
    from atoll.node.runner import PlanRunner, RunContext
    from atoll.plan import PipelinePlan, Plan, StagePlan

    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=4, warmup=1), checkpoint=replace(job.checkpoint, interval=2),
                  compression=replace(job.compression, mode="identity"))
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the checkpoint folder should be")
    reported: list = []
    server = PeerServer(node_id="a", listen="127.0.0.1:0", token="t")
    try:
        plan = Plan(model="tiny", global_batch=16, seq_len=64, epoch=1, job_id="job", pipelines=[
            PipelinePlan(micro_batch=4, num_micro_batches=4,
                         stages=[StagePlan(island="i", layers=(0, 6), dp=1, nodes=["a"])])])
        ctx = RunContext(node_id="a", job=job, peer_server=server, checkpoint_dir=blocked,
                         report_step=lambda m: False, report_checkpoint=reported.append)
        with caplog.at_level("ERROR", logger="atoll.node.runner"):
            assert PlanRunner(ctx, plan).run(threading.Event()) == 4
    finally:
        server.stop()
    # each reported as not written (the coordinator records the stage under-replicated), none as a checkpoint
    assert [(c.step, bool(c.not_written)) for c in reported] == [(2, True), (4, True)]
    assert [r.getMessage().split(" under ")[0] for r in caplog.records
            if r.name == "atoll.node.runner" and r.levelname == "ERROR"] == [
        "checkpoint of step 2 (layers [0, 6)) could not be written", "checkpoint of step 4 (layers [0, 6)) could not be written"]
