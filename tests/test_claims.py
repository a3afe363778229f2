"""What a member may claim, checked against the plan: the loss only from the last stage, steps in line with the
peers', a job end corroborated by more than one node (`atoll.coordinator.claims`), failure reports and joins at a
bounded rate per node (`atoll.coordinator.ratelimit`), through the plain handlers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from atoll.coordinator import claims
from atoll.coordinator import handlers as h
from atoll.coordinator.authz import PermissionDenied
from atoll.coordinator.errors import FailedPrecondition, RateLimited, Unavailable
from atoll.coordinator.planning import PlanInputs, finish_plan
from atoll.coordinator.ratelimit import PerNodeLimit, RateOptions
from atoll.coordinator.state import CoordinatorState
from atoll.coordinator.store import MemoryStore
from atoll.job import JobSpec
from atoll.plan import IslandInfo, PipelinePlan, Plan, StagePlan
from atoll.v1 import atoll_pb2 as pb
from test_failure_replan import Clock

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret"


def two_stages(inputs: PlanInputs) -> tuple[Plan, str]:
    """The first member (by id) runs stage 0, the others replicate stage 1, which computes the loss."""
    nodes = sorted(inputs.members)
    layers = inputs.job.model_spec.num_layers
    plan = Plan(model=inputs.job.model.name, global_batch=inputs.job.train.global_batch,
                seq_len=inputs.job.train.seq_len,
                islands=[IslandInfo(id="i0", device="cpu", nodes=nodes)],
                pipelines=[PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
                    StagePlan(island="i0", layers=(0, 2), nodes=nodes[:1]),
                    StagePlan(island="i0", layers=(2, layers), nodes=nodes[1:], dp=len(nodes) - 1)])])
    return finish_plan(plan, inputs), "two stages (test)"


def _profile(host: str) -> pb.NodeProfile:
    return pb.NodeProfile(hostname=host, device_kind="cpu", device_name="cpu-x", device_count=1,
                          memory_total_bytes=16 << 30, memory_free_bytes=8 << 30, cpu_count=4,
                          layer_timings=[pb.LayerTiming(layer_kind="block", micro_batch=4, seq_len=64,
                                                        forward_seconds=0.01, backward_seconds=0.02)])


def _two_stage_state(nodes: int) -> CoordinatorState:
    """A state running a two-stage plan of `nodes` nodes: n0 runs stage 0, the others replicate the last stage."""
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=1000), cluster=replace(job.cluster, expected_nodes=nodes))
    state = CoordinatorState(store=MemoryStore(), job=job, token=TOKEN, clock=Clock(), planner=two_stages)
    names = [f"n{i}" for i in range(nodes)]
    for i, n in enumerate(names):
        h.handle_join(pb.JoinRequest(token=TOKEN, node_id=n, profile=_profile(f"h{i}"),
                                     peer_address=f"127.0.0.1:{5000 + i}"), state)
    for n in names:
        reply = h.handle_heartbeat(pb.HeartbeatRequest(node_id=n), state)
        h.handle_report_probes(pb.ProbeReport(node_id=n, links=[
            pb.LinkMeasurement(src=n, dst=t.node_id, bandwidth_bytes_per_s=2e9, rtt_seconds=1e-4)
            for t in reply.probe]), state)
    state.tick()
    plan = state.current_plan()
    assert plan is not None and [st.nodes for st in plan.pipelines[0].stages] == [["n0"], names[1:]]
    return state


@pytest.fixture
def planned() -> tuple[CoordinatorState, str, list[str]]:
    """A state running a two-stage plan of three nodes: (state, the stage-0 node, the two last-stage nodes)."""
    return _two_stage_state(3), "n0", ["n1", "n2"]


def _report(state: CoordinatorState, node: str, step: int, *, loss: bool = True, value: float = 2.0) -> pb.StepAck:
    return h.handle_report_step(pb.StepMetrics(job_id=state.job.id, node_id=node, plan_epoch=state.epoch, step=step,
                                               pipeline=0, stage=0 if node == "n0" else 1, has_loss=loss, loss=value,
                                               tokens=1024, step_seconds=0.1), state)


def _recorded(state: CoordinatorState) -> dict[int, tuple[float | None, int]]:
    """step -> (its recorded loss, the loss reports merged into it)."""
    return {p.first: (p.loss, p.count) for p in state.store.history()}


def _near_the_end(state: CoordinatorState, nodes: tuple[str, ...]) -> int:
    """Every node reports steps up to two before the last (stage 0's without a loss); returns the last step."""
    last = state.target_steps - 1
    for step in [*range(0, last - 2, 100), last - 2]:
        for n in nodes:
            _report(state, n, step, loss=n != nodes[0])
    return last


def test_a_forged_job_end_from_a_stage_0_node_is_refused(planned) -> None:
    """The finding: a stage-0 node with its own valid identity sent ReportStep(step = last - 1) with a made-up loss,
    and the coordinator marked the job finished."""
    state, first, _ = planned
    last = state.target_steps - 1
    with pytest.raises(PermissionDenied, match="last stage of pipeline 0 .n1, n2. responsible for its loss"):
        _report(state, first, last)
    # without the loss, its step is far past what the others report: held back, never taken as the end
    with pytest.raises(Unavailable, match="more than 128 steps past"):
        _report(state, first, last, loss=False)
    state.tick()
    assert not state.job_complete() and not state.control.finished_unix
    assert h.handle_status(pb.StatusRequest(), state).job_state == "running"
    assert not h.handle_heartbeat(pb.HeartbeatRequest(node_id=first), state).job_finished


def test_a_last_stage_node_alone_cannot_end_the_job(planned) -> None:
    state, first, (a, b) = planned
    last = state.target_steps - 1
    with pytest.raises(Unavailable, match="peers have reported no step yet"):  # far ahead of its peers
        _report(state, a, last)
    _near_the_end(state, (first, a, b))  # the job runs to its last steps, every node reporting
    _report(state, a, last)  # within the window now, and taken; but one node's word
    state.tick()
    assert not state.job_complete() and not state.control.finished_unix
    _report(state, first, last, loss=False)  # a second node at the last step: two of three, a majority
    assert state.job_complete()
    state.clock.t += 1e6  # (the final checkpoint's bounded wait has passed)
    state.tick()
    assert state.control.finished_unix


def test_nodes_that_end_one_after_another_after_an_outage_are_not_planned_around(planned) -> None:
    """The job's nodes trained to the end while the coordinator was away and deliver their last reports when it is
    back, one node after another: the first to have delivered leaves. A replan around its departure (as before)
    left the others' last reports under a superseded plan, and the job was never recorded finished."""
    state, first, (a, b) = planned
    epoch = state.epoch
    last = _near_the_end(state, (first, a, b))
    _report(state, a, last)
    h.handle_leave(pb.LeaveRequest(node_id=a, reason="node stopped"), state)  # delivered, then left
    state.clock.t += 5.0
    state.tick()
    assert state.epoch == epoch and not state.job_complete()  # held: a trained the end and left
    assert "trained the job's last step and left" in state._last_reason
    _report(state, b, last)  # the others' backlogs: with a's, a majority of the plan
    assert state.job_complete()
    state.clock.t += 1e6
    state.tick()
    assert state.epoch == epoch and state.control.finished_unix


def test_the_end_hold_is_bounded(planned) -> None:
    """A node that left after the last step holds replans only `END_HOLD_S`: the others may have died at the end."""
    from atoll.coordinator.state import END_HOLD_S

    state, first, (a, b) = planned
    epoch = state.epoch
    last = _near_the_end(state, (first, a, b))
    _report(state, a, last)
    h.handle_leave(pb.LeaveRequest(node_id=a, reason="node stopped"), state)
    state.clock.t += 5.0
    state.tick()
    assert state.epoch == epoch
    for n in (first, b):  # (alive: their leases are not what this is about)
        h.handle_heartbeat(pb.HeartbeatRequest(node_id=n), state)
    state.clock.t += END_HOLD_S
    for n in (first, b):
        h.handle_heartbeat(pb.HeartbeatRequest(node_id=n), state)
    state.tick()
    state.clock.t += 5.0
    state.tick()
    assert state.epoch > epoch  # planned around the departure after all


def test_a_report_of_an_epoch_that_never_ran_is_refused(planned) -> None:
    state, _, (a, _) = planned
    with pytest.raises(FailedPrecondition, match="never ran"):
        h.handle_report_step(pb.StepMetrics(job_id=state.job.id, node_id=a, plan_epoch=0, step=1), state)


def test_end_corroboration_rule() -> None:
    assert claims.end_corroborated({"a"}, {"a": 9}, 9)  # a plan of one node has only its word
    assert not claims.end_corroborated({"a", "b"}, {"a": 9, "b": 8}, 9)
    assert claims.end_corroborated({"a", "b"}, {"a": 9, "b": 10}, 9)
    assert not claims.end_corroborated({"a", "b", "c", "d"}, {"a": 9, "b": 9}, 9)  # half is not more than half
    assert claims.end_corroborated({"a", "b", "c", "d"}, {"a": 9, "b": 9, "d": 9}, 9)


# --- failure reports and joins, rate-limited per node ----------------------------------------------------------


def _fake_failures(state: CoordinatorState, node: str, seconds: float) -> tuple[int, int]:
    """`node` reports a failure of every plan as soon as it runs, for `seconds` (all members heartbeating);
    returns (plans made, failure reports refused)."""
    first, refused = state.epoch, 0
    end = state.clock.t + seconds
    while state.clock.t < end:
        try:
            h.handle_report_failure(pb.RunFailure(job_id=state.job.id, node_id=node, plan_epoch=state.epoch, step=1,
                                                  reason="fake"), state)
        except RateLimited as e:
            refused += 1
            assert e.retry_after_s > 0
        state.clock.t += 0.5
        for n in ("n0", "n1", "n2"):
            h.handle_heartbeat(pb.HeartbeatRequest(node_id=n), state)
        state.tick()
    return state.epoch - first, refused


def test_fake_failure_reports_from_one_node_force_few_plans(planned) -> None:
    """The finding: fake failure reports from one node forced 4 plans in 20 s."""
    state, first, _ = planned
    plans, refused = _fake_failures(state, first, 20.0)
    assert plans <= 2 and refused > 0, (plans, refused)
    # the penalty doubles while it keeps on: over the next minute it gets at most one more plan
    more, _ = _fake_failures(state, first, 60.0)
    assert more <= 1, more


def test_joins_claiming_one_node_id_are_rate_limited(planned) -> None:
    state, _, (a, _) = planned
    limits = state.options.joins
    for i in range(limits.burst - 1):  # (its first join was one) a node restarting, or moving between addresses
        h.handle_join(pb.JoinRequest(token=TOKEN, node_id=a, profile=_profile("h1"),
                                     peer_address=f"127.0.0.1:{6000 + i}"), state)
    epoch = state.epoch
    with pytest.raises(RateLimited, match=f"node {a} joined more often") as info:
        h.handle_join(pb.JoinRequest(token=TOKEN, node_id=a, profile=_profile("h1"), peer_address="127.0.0.1:6999"),
                      state)
    assert info.value.retry_after_s == pytest.approx(limits.penalty_s)
    assert state.store.get_member(a).peer_address != "127.0.0.1:6999" and state.epoch == epoch
    state.clock.t += limits.penalty_s + limits.every_s  # held off for the penalty, then one more join is earned
    h.handle_join(pb.JoinRequest(token=TOKEN, node_id=a, profile=_profile("h1"), peer_address="127.0.0.1:6999"),
                  state)
    # a first join claims no id: not limited by it
    for i in range(limits.burst + 2):
        h.handle_join(pb.JoinRequest(token=TOKEN, profile=_profile(f"new{i}"), peer_address=f"127.0.0.1:{7000 + i}"),
                      state)


def test_a_rate_limit_forgives_a_node_that_kept_to_its_rate() -> None:
    limit = PerNodeLimit(RateOptions(burst=2, every_s=10.0, penalty_s=5.0, max_penalty_s=40.0))
    assert limit.take("a", 0.0) is None and limit.take("a", 0.0) is None
    assert limit.take("a", 0.0) == 5.0  # past its burst: held off, the hold doubling with each refusal
    assert limit.take("a", 1.0) == pytest.approx(10.0)
    assert limit.take("a", 2.0) == pytest.approx(20.0)
    assert limit.take("b", 2.0) is None  # per node
    assert limit.take("a", 21.0) == pytest.approx(40.0)  # at most max_penalty_s
    assert limit.take("a", 62.0) is None  # the hold is over, and it earned a full bucket again: forgiven
    assert limit.take("a", 62.0) is None
    assert limit.take("a", 62.0) == 5.0


def test_an_outer_job_whose_steps_are_not_whole_rounds_ends_at_its_last_round() -> None:
    """An outer-mode job trains whole rounds, (1010 // 50) x 50 = 1000 steps: its last step is 999, which the end
    check once never looked at (it waited for a report of step 1009, which no group trains)."""
    from test_status import outer_plan

    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=1010), checkpoint=replace(job.checkpoint, interval=0))
    state = CoordinatorState(store=MemoryStore(), job=job, token=TOKEN, clock=Clock())
    for i, n in enumerate("abcd"):
        h.handle_join(pb.JoinRequest(token=TOKEN, node_id=n, profile=_profile(f"h{n}"),
                                     peer_address=f"127.0.0.1:{5000 + i}"), state)
    state.publish(outer_plan(), "test")
    assert state.last_step() == 999
    for step in (900, 999):  # lab-a, one node, reports its last round's end (its word is its group's)
        h.handle_report_step(pb.StepMetrics(job_id=state.job.id, node_id="a", plan_epoch=state.epoch, step=step,
                                            pipeline=0, stage=0, has_loss=True, loss=2.0, tokens=1024,
                                            step_seconds=0.1), state)
    assert state.job_complete()
    state.clock.t += 1e6  # past the final checkpoint's bounded wait
    state.tick()
    assert state.control.finished_unix


# --- the recorded loss: the loss holders vote ------------------------------------------------------------------------


def test_a_forged_loss_of_one_of_two_last_stage_replicas_is_not_recorded(planned) -> None:
    state, first, (a, b) = planned
    for step in range(3):
        _report(state, first, step, loss=False)
        _report(state, a, step, value=2.0 - 0.1 * step)
        _report(state, b, step, value=0.001)  # b lies: its word against a's, neither is recorded
    _report(state, a, 3, value=1.7)
    _report(state, b, 3, value=1.7)  # they agree again
    assert _recorded(state) == {3: (pytest.approx(1.7), 1)}


def test_a_nodes_second_report_of_a_step_does_not_count_twice(planned) -> None:
    state, _, (a, b) = planned
    _report(state, a, 0, value=2.0)
    _report(state, a, 0, value=2.0)  # its outbox sent it again
    assert _recorded(state) == {}  # b's vote is still to come
    _report(state, b, 0, value=2.0)
    _report(state, b, 0, value=0.5)  # too late: the step is decided
    assert _recorded(state) == {0: (pytest.approx(2.0), 1)}


def test_a_step_one_voter_never_reported_is_decided_once_two_voters_are_past_it(planned) -> None:
    state, _, (a, b) = planned
    _report(state, a, 0, value=2.0)  # b's report of step 0 is lost; of two voters, a alone is not enough
    for step in range(1, claims.LOSS_FLUSH_STEPS + 1):
        _report(state, a, step, value=2.0)
        _report(state, b, step, value=2.0)
    got = _recorded(state)
    assert 0 not in got and set(got) == set(range(1, claims.LOSS_FLUSH_STEPS + 1))


def test_a_lying_replica_of_three_is_outvoted_named_and_quarantined() -> None:
    state = _two_stage_state(4)
    liar = "n3"
    for step in range(3):
        _report(state, "n0", step, loss=False)
        for n in ("n1", "n2"):
            _report(state, n, step, value=2.0 - 0.1 * step)
        _report(state, liar, step, value=0.001)
    assert _recorded(state) == {s: (pytest.approx(2.0 - 0.1 * s), 1) for s in range(3)}
    assert state.offences.summary()[liar][0] == 3
    member = state.store.get_member(liar)
    assert member is not None and member.state == "quarantined"
    assert all(state.store.get_member(n).state != "quarantined" for n in ("n0", "n1", "n2"))
    # the status shows the newest loss the vote decided, not the newest report's: one replica's claim for the next
    # step, which nobody has corroborated yet, is not shown
    _report(state, "n1", 3, value=0.5)
    status = h.handle_status(pb.StatusRequest(), state)
    assert status.has_loss and status.loss == pytest.approx(1.8) and status.loss_step == 2


def test_a_single_replica_last_stage_is_taken_at_its_word() -> None:
    state = _two_stage_state(2)
    _report(state, "n1", 0, value=2.5)
    _report(state, "n1", 1, value=2.4)
    assert _recorded(state) == {0: (pytest.approx(2.5), 1), 1: (pytest.approx(2.4), 1)}


def test_a_loss_far_ahead_of_the_peers_is_answered_retry_later(planned) -> None:
    state, first, (a, _) = planned
    _report(state, first, 10, loss=False)
    _report(state, a, 10 + claims.LOSS_STEP_WINDOW)
    with pytest.raises(Unavailable):
        _report(state, a, 11 + claims.LOSS_STEP_WINDOW)
    _report(state, a, 11 + claims.LOSS_STEP_WINDOW, loss=False)  # without a loss, the wider window holds


def test_the_loss_decision_rule() -> None:
    three = {"a": (2.0, None, 100.0), "b": (2.0, 1.9, 110.0), "c": (0.1, 0.1, 1e6)}
    d = claims.decide(5, 1, 3, three)
    assert (d.loss, d.val_loss, d.tokens_per_second, d.liars) == (2.0, 1.9, 105.0, (("c", 0.1),))
    assert claims.decide(5, 1, 2, {"a": (2.0, None, None), "b": (1.0, None, None)}).loss is None
    assert claims.decide(5, 1, 2, {"a": (2.0, None, None)}).loss is None  # one of two: no word alone
    assert claims.decide(5, 1, 1, {"a": (2.0, None, None)}).loss == 2.0
    # three that all disagree: no majority, nobody named
    d = claims.decide(5, 1, 3, {"a": (1.0, None, None), "b": (2.0, None, None), "c": (3.0, None, None)})
    assert d.loss is None and d.liars == () and d.note


def test_in_outer_mode_each_group_votes_on_its_own_loss() -> None:
    from atoll.plan import OuterPlan, ReplicaGroup

    def pipe(nodes: list[str]) -> PipelinePlan:
        return PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
            StagePlan(island="i0", layers=(0, 2), nodes=nodes[:1]),
            StagePlan(island="i0", layers=(2, 4), nodes=nodes[1:], dp=len(nodes) - 1)])

    plan = Plan(model="tiny", global_batch=16, seq_len=64, epoch=1, mode="outer", outer=OuterPlan(inner_steps=5),
                pipelines=[pipe(["a0", "a1", "a2", "a3"]), pipe(["b0", "b1"])],
                groups=[ReplicaGroup(name="lab-a", pipelines=[0]), ReplicaGroup(name="lab-b", pipelines=[1])])
    assert claims.loss_voters(plan, 0) == {"a1", "a2", "a3"} and claims.loss_voters(plan, 1) == {"b1"}
    votes = claims.LossVotes()
    assert [d.loss for d in votes.add(plan, "b1", 1, 7, 3.0, None, None)] == [3.0]  # its group's only voter
    assert votes.add(plan, "a1", 0, 7, 2.0, None, None) == []
    assert votes.add(plan, "a2", 0, 7, 0.1, None, None) == []
    assert votes.add(plan, "b1", 0, 7, 0.1, None, None) == []  # not a voter of group lab-a
    (d,) = votes.add(plan, "a3", 0, 7, 2.0, None, None)
    assert (d.step, d.loss, d.liars) == (7, 2.0, (("a2", 0.1),))
