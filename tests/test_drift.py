"""Replanning when devices drift from their planned speed (atoll.coordinator.drift and the state's check)."""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import replace

import pytest

from atoll.coordinator import handlers as h
from atoll.coordinator.calibration import predicted_compute
from atoll.coordinator.drift import (DEFAULT_SWITCH_S, DriftOptions, describe, drifted, estimated_rate, estimated_step,
                                     speed_changes, switch_seconds, switch_verdict, unsettled)
from atoll.coordinator.state import CoordinatorOptions, CoordinatorState, unchanged_groups
from atoll.coordinator.store import MemoryStore
from atoll.job import JobSpec
from atoll.plan import OuterPlan, PipelinePlan, Plan, Prediction, ReplicaGroup, StagePlan
from atoll.types import StepMetrics
from atoll.v1 import atoll_pb2 as pb

from test_calibration import _profile
from test_failure_replan import ROOT, TOKEN, Clock, plan_three


def _plan(**stage1) -> Plan:
    stages = [StagePlan(island="x", layers=(0, 3), dp=1, compute_s=0.3, nodes=["a"]),
              StagePlan(**{"island": "y", "layers": (3, 6), "dp": 1, "compute_s": 0.2, "nodes": ["b"], **stage1})]
    return Plan(model="tiny", global_batch=8, seq_len=64, epoch=2,
                predicted=Prediction(step_time_s=3.0, tokens_per_s=1.0, mfu=0.1, bottleneck=""),
                pipelines=[PipelinePlan(micro_batch=1, num_micro_batches=8, stages=stages)])


def test_the_running_plan_is_re_estimated_at_its_slowest_stages_new_pace() -> None:
    plan = _plan()
    assert estimated_step(plan, {}) == pytest.approx(3.0)
    # b now takes 0.2 x 2.5 = 0.5 s a micro-batch against the 0.3 s bottleneck it was planned beside
    assert estimated_step(plan, {"b": 2.5}) == pytest.approx(3.0 * 0.5 / 0.3)
    assert estimated_step(plan, {"b": 1.2}) == pytest.approx(3.0)  # still under the bottleneck
    assert estimated_step(plan, {"a": 0.5}) == pytest.approx(3.0 * 0.2 / 0.3)  # a faster bottleneck
    # against the median node (1.0 here): b and c drifted
    assert drifted({"a": 1.2, "b": 1.3, "c": 0.7, "d": 0.85, "e": 1.0}, 1.25) == {"b": 1.3, "c": 0.7}
    # every node 1.6x slower (nodes sharing a machine's cores), one 4x: only that one drifted, and by 2.5x
    assert drifted({"a": 1.6, "b": 1.5, "c": 1.7, "d": 4.0, "e": 1.6}, 1.25) == pytest.approx({"d": 2.5})
    assert drifted({"a": 2.0, "b": 2.1}, 1.25) == {} and drifted({}, 1.25) == {}
    # a change within the epoch: the last steps' median over the first ones' (15 steps: too few for two windows)
    assert speed_changes({"a": [1.0] * 10 + [3.0] * 10, "b": [2.0] * 20, "c": [1.0] * 15}, 10) == {"a": 3.0, "b": 1.0}
    # a slowdown two steps old is not a window yet, but its node is unsettled (against the median node: c's 1.2x
    # sharing the host is not); one slow step among fast ones is not (the median of the newest three), nor too few steps
    compute = {"a": [1.0] * 12 + [4.4] * 2, "b": [1.0] * 14, "c": [1.0] * 12 + [1.2] * 2, "d": [1.0] * 13 + [4.0],
               "e": [1.0] * 5 + [5.0] * 3}
    assert speed_changes(compute, 10) == {} and unsettled(compute, 10, 1.25) == {"a"}
    assert unsettled({"a": [1.0] * 10 + [1.0, 5.0], "b": [1.0] * 12, "c": [1.0] * 12}, 10, 1.25, newest=1) == {"a"}
    assert describe({"a": 0.5, "b": 2.1}) == ("node b computes 2.10x slower than planned, node a 2.00x faster "
                                              "(against the median node)")


def test_a_switch_must_gain_enough_and_repay_its_cost() -> None:
    kw = dict(current_s=1.0, steps_left=1000, switch_s=30.0, min_gain=0.1)
    assert switch_verdict(new_s=0.7, **kw).go
    small = switch_verdict(new_s=0.95, **kw)
    assert not small.go and "5% shorter (a switch needs 10%)" in small.why
    late = switch_verdict(new_s=0.7, **{**kw, "steps_left": 50})  # 15 s saved against a 30 s restart
    assert not late.go and "less than switching costs (30 s)" in late.why
    # the restart as last measured: publication to the epoch's first step report, the median of the last three
    steps = [StepMetrics(job_id="j", node_id="a", plan_epoch=e, step=s, unix_time=t)
             for e, s, t in ((1, 0, 104.0), (1, 1, 105.0), (2, 9, 212.0), (3, 20, 306.0))]
    assert switch_seconds([(1, 100.0), (2, 200.0), (3, 300.0)], steps) == pytest.approx(6.0)
    assert switch_seconds([(4, 400.0)], steps) == DEFAULT_SWITCH_S
    with pytest.raises(ValueError, match="threshold"):
        DriftOptions(threshold=0.9)


def _state(steps: int = 400, drift: DriftOptions | None = None) -> tuple[CoordinatorState, Clock, list[str]]:
    """Three CPU nodes joined, probed and planned (one stage of three replicas)."""
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    return plan_three(_profile, replace(job, train=replace(job.train, steps=steps)),
                      CoordinatorOptions(drift=drift or DriftOptions()))


def _run(state: CoordinatorState, clock: Clock, slow: dict[str, float], steps: range,
         nodes: Collection[str] | None = None) -> None:
    """Every node of the plan (of `nodes` where given) reports `steps`, computing its predicted time times its
    factor in `slow`."""
    plan = state.current_plan()
    members = state.alive_members()
    expected = {n: sec for n, sec in predicted_compute(plan).items() if n in members and (nodes is None or n in nodes)}
    for step in steps:
        clock.t += 1.0
        for n, sec in expected.items():
            h.handle_report_step(pb.StepMetrics(job_id=state.job.id, node_id=n, plan_epoch=plan.epoch, step=step,
                                                compute_seconds=slow.get(n, 1.0) * sec, step_seconds=1.0,
                                                unix_time=clock.t), state)
    for n in expected:
        h.handle_heartbeat(pb.HeartbeatRequest(node_id=n), state)


def _later(state: CoordinatorState, clock: Clock, seconds: float) -> None:
    """`seconds` pass, every member heartbeating at their end (no lease lapses)."""
    clock.t += seconds
    for n in state.alive_members():
        h.handle_heartbeat(pb.HeartbeatRequest(node_id=n), state)


def _layers(plan: Plan, node: str) -> int:
    return sum(st.layers[1] - st.layers[0] for p in plan.pipelines for st in p.stages if node in st.nodes)


def _share(plan: Plan, node: str) -> float:
    """The node's part of a step's work: its layers' share of the model times its rows' share of the batch."""
    from atoll.plan import shares
    layers = max(st.layers[1] for p in plan.pipelines for st in p.stages)
    got = 0.0
    for p in plan.pipelines:
        for st in p.stages:
            if node in st.nodes:
                a, b = shares(p.micro_batch, st.dp)[st.nodes.index(node) // st.tp]
                got += (st.layers[1] - st.layers[0]) / layers * (b - a) * p.num_micro_batches / plan.global_batch
    return got


def test_a_node_that_slows_down_is_planned_around() -> None:
    state, clock, ids = _state()
    first = state.current_plan()
    slow = next(n for n in ids if _layers(first, n) == max(_layers(first, m) for m in ids))
    _run(state, clock, {}, range(0, 11))  # as planned: the first step, then 10
    _run(state, clock, {slow: 3.0}, range(11, 18))
    _later(state, clock, 61)
    assert state.tick() == [] and state.epoch == 1  # 7 slow steps: too few to judge
    _run(state, clock, {slow: 3.0}, range(18, 24))
    events = state.tick()
    assert state.epoch == 1 and events == []  # checked a moment ago: the next check waits the interval
    _later(state, clock, 61)
    events = state.tick()
    assert state.epoch == 2, events
    assert any(f"drift: node {slow} computes 3.00x slower than planned" in e for e in events), events
    second = state.current_plan()
    # its own island now (it no longer slows its peers'), with well under half its former share of the work (1/7 would
    # balance a third of the speed)
    # the first plan: one stage of the three nodes (the demo's plan, `planning.NEAR_EQUAL`), 3 of each
    # micro-batch's 8 rows on the slow one
    assert [len(st.nodes) for p in first.pipelines for st in p.stages] == [3]
    assert _share(first, slow) == pytest.approx(3 / 8)
    assert _share(second, slow) < 1 / 6 and not any(
        slow in i.nodes and len(i.nodes) > 1 for i in second.islands)
    assert second.predicted.step_time_s < 0.9 * estimated_step(first, {slow: 3.0})
    assert state.speed[slow] == pytest.approx(3.0)  # the new plan was made with the measured speed
    assert "drift" in state.store.plan_history()[-1].reason
    # the new plan runs as it predicts: no further drift, no further plan
    _run(state, clock, {}, range(24, 50))
    _later(state, clock, 61)
    assert state.tick() == [] and state.epoch == 2


def test_no_replan_within_the_threshold_for_a_model_error_when_disabled_or_near_the_end() -> None:
    state, clock, ids = _state()
    _run(state, clock, {}, range(0, 11))
    _run(state, clock, {ids[0]: 1.2, ids[1]: 0.85}, range(11, 22))  # within 1.25x either way
    _later(state, clock, 61)
    assert state.tick() == [] and state.epoch == 1
    # a node computing twice its prediction from the epoch's first step: the cost model's error on its layers,
    # not a drift (moving its layers would move the error), so no replan
    steady, clock, ids = _state()
    _run(steady, clock, {ids[0]: 2.0}, range(0, 22))
    _later(steady, clock, 61)
    assert steady.tick() == [] and steady.epoch == 1
    # every node slowing alike: the plan's balance holds
    alike, clock, ids = _state()
    _run(alike, clock, {}, range(0, 11))
    _run(alike, clock, {n: 2.0 for n in ids}, range(11, 22))
    _later(alike, clock, 61)
    assert alike.tick() == [] and alike.epoch == 1
    off, clock, ids = _state(drift=DriftOptions(enabled=False))
    _run(off, clock, {}, range(0, 11))
    _run(off, clock, {ids[0]: 3.0}, range(11, 22))
    _later(off, clock, 61)
    assert off.tick() == [] and off.epoch == 1
    near, clock, ids = _state(steps=24)  # two steps left: nothing a switch could win back
    first = near.current_plan()
    slow = next(n for n in ids if _layers(first, n) == max(_layers(first, m) for m in ids))
    _run(near, clock, {}, range(0, 11))
    _run(near, clock, {slow: 3.0}, range(11, 22))
    _later(near, clock, 61)
    assert near.tick() == [] and near.epoch == 1


def test_a_node_too_slow_to_help_is_left_idle_and_hands_its_state_over() -> None:
    state, clock, ids = _state()
    first = state.current_plan()
    slow = next(n for n in ids if _layers(first, n) == max(_layers(first, m) for m in ids))
    _run(state, clock, {}, range(0, 11))
    _run(state, clock, {slow: 4.0}, range(11, 22))
    _later(state, clock, 61)
    state.tick()
    second = state.current_plan()
    assert state.epoch == 2 and _share(second, slow) == 0.0
    assert any(slow in i.nodes for i in second.idle), second.idle
    # alive and idle, it holds the layers its last run left: the new plan's nodes are told to ask it
    assert second.handover == {slow: first.node_addresses[slow]}


def _outer_state(steps: int = 400) -> tuple[CoordinatorState, Clock, dict[str, str]]:
    """Four CPU nodes in two regions (two each) over a slow wide-area link, planned as two outer-mode replica
    groups: node id -> region."""
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=steps),
                  outer=replace(job.outer, mode="outer", inner_steps=10, deadline_seconds=30.0))
    clock = Clock()
    state = CoordinatorState(store=MemoryStore(), job=job, token=TOKEN, clock=clock,
                             options=CoordinatorOptions(drift=DriftOptions()))
    region: dict[str, str] = {}
    for i in range(4):
        p = _profile(f"h{i}")
        p.region = "lab-a" if i < 2 else "lab-b"
        n = h.handle_join(pb.JoinRequest(token=TOKEN, profile=p, peer_address=f"127.0.0.1:{5000 + i}"), state).node_id
        region[n] = p.region
    for n in region:
        reply = h.handle_heartbeat(pb.HeartbeatRequest(node_id=n), state)
        h.handle_report_probes(pb.ProbeReport(node_id=n, links=[
            pb.LinkMeasurement(src=n, dst=t.node_id, rtt_seconds=1e-4 if region[n] == region[t.node_id] else 0.05,
                               bandwidth_bytes_per_s=2e9 if region[n] == region[t.node_id] else 2e6)
            for t in reply.probe]), state)
    state.tick()
    assert state.epoch == 1
    return state, clock, region


def _group_of(plan: Plan, node: str) -> ReplicaGroup:
    return next(g for g in plan.groups if any(node in st.nodes for p in g.pipelines for st in plan.pipelines[p].stages))


def test_a_node_that_slows_down_in_outer_mode_has_its_group_replanned_while_the_other_runs_on() -> None:
    """Outer mode: one node of lab-b computes 3x slower. Its group holds every round back (each round waits for
    the slowest group), so the coordinator plans lab-b afresh from its recent speeds, keeping lab-a's group running
    as it is (same since-epoch, nodes and cuts); the new plan predicts a faster round than the old one re-estimated."""
    state, clock, region = _outer_state(steps=2000)  # long enough that the recovery below repays its switch too
    first = state.current_plan()
    assert first.mode == "outer" and len(first.groups) == 2, first.mode
    slow = next(n for n in sorted(region) if region[n] == "lab-b" and _layers(first, n) > 0)
    _run(state, clock, {}, range(0, 11))
    _run(state, clock, {slow: 3.0}, range(11, 24))
    _later(state, clock, 61)
    events = state.tick()
    assert state.epoch == 2, events
    assert any(f"drift: node {slow} computes 3.00x slower than planned" in e for e in events), events
    second = state.current_plan()
    assert second.mode == "outer" and len(second.groups) == 2
    a_node = next(n for n in region if region[n] == "lab-a")
    kept, old_a = _group_of(second, a_node), _group_of(first, a_node)
    assert kept.since_epoch == (old_a.since_epoch or first.epoch) and kept.inner_steps == old_a.inner_steps
    assert [[st.nodes for st in second.pipelines[p].stages] for p in kept.pipelines] == \
        [[st.nodes for st in first.pipelines[p].stages] for p in old_a.pipelines]
    b = _group_of(second, next(n for n in region if region[n] == "lab-b" and _layers(second, n) > 0))
    assert b.since_epoch == 2
    assert state.speed[slow] == pytest.approx(3.0) and all(state.speed.get(n, 1.0) == 1.0 for n in region
                                                            if n != slow)
    assert estimated_rate(second, {}) > 1.1 * estimated_rate(first, {slow: 3.0})
    assert "drift" in state.store.plan_history()[-1].reason
    # the new plan runs as it predicts: no further drift, no further plan
    _run(state, clock, {}, range(24, 50))
    _later(state, clock, 61)
    assert state.tick() == [] and state.epoch == 2
    # the node recovers (its compute back at its profile's, a third of what the plan now predicts): its group is
    # planned afresh again at its own speed, lab-a still running as it is
    _run(state, clock, {slow: 1 / 3}, range(50, 63))
    _later(state, clock, 61)
    events = state.tick()
    assert state.epoch == 3 and any("faster than planned" in e for e in events), events
    third = state.current_plan()
    assert state.speed[slow] == pytest.approx(1.0) and _group_of(third, a_node).since_epoch == kept.since_epoch
    assert estimated_rate(third, {}) > 1.1 * estimated_rate(second, {})


def test_a_slowed_group_is_judged_from_its_own_reports_while_the_other_group_reports_five_times_as_many() -> None:
    """Outer mode: the groups step at their own pace, so the group holding a slowed node reports a fraction of the
    other's steps. The check reads back until each node has reports enough (a fixed count of the newest reports,
    four nodes x 24, held eight steps of the slow group's: too few to judge, and the drift went unseen)."""
    state, clock, region = _outer_state(steps=2000)
    first = state.current_plan()
    slow = next(n for n in sorted(region) if region[n] == "lab-b" and _layers(first, n) > 0)
    _run(state, clock, {}, range(0, 11))
    lab_a = {n for n in region if region[n] == "lab-a"}
    for k, step in enumerate(range(11, 26)):
        _run(state, clock, {}, range(11 + 5 * k, 16 + 5 * k), nodes=lab_a)  # lab-a runs five steps to each of lab-b's
        _run(state, clock, {slow: 3.0}, range(step, step + 1), nodes=set(region) - lab_a)
    _later(state, clock, 61)
    events = state.tick()
    assert state.epoch == 2, events
    assert any(f"drift: node {slow} computes 3.00x slower than planned" in e for e in events), events
    assert state.speed[slow] == pytest.approx(3.0)


def test_a_node_that_becomes_faster_in_outer_mode_restarts_no_group() -> None:
    """A faster node holds no round back, and a group planned afresh restarts at its round's start: no replan (unless
    it had been planned slower than its profile, above)."""
    state, clock, region = _outer_state()
    first = state.current_plan()
    fast = next(n for n in sorted(region) if region[n] == "lab-a" and _layers(first, n) > 0)
    _run(state, clock, {}, range(0, 11))
    _run(state, clock, {fast: 0.4}, range(11, 24))
    _later(state, clock, 61)
    assert state.tick() == [] and state.epoch == 1


def test_outer_mode_is_re_estimated_at_its_slowest_groups_new_pace() -> None:
    def pipe(nodes: list[str]) -> PipelinePlan:
        return PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
            StagePlan(island="i", layers=(0, 3), nodes=[nodes[0]], compute_s=0.01),
            StagePlan(island="i", layers=(3, 6), nodes=[nodes[1]], compute_s=0.01)])
    plan = Plan(model="tiny", global_batch=16, seq_len=64, mode="outer", pipelines=[pipe(["a1", "a2"]), pipe(["b1", "b2"])],
                groups=[ReplicaGroup(name="a", pipelines=[0], inner_steps=10, step_time_s=0.1),
                        ReplicaGroup(name="b", pipelines=[1], inner_steps=10, step_time_s=0.1)],
                outer=OuterPlan(inner_steps=10, sync_s=0.5), predicted=Prediction(step_time_s=0.1))
    base = estimated_rate(plan, {})
    assert base == pytest.approx(2 * 16 * 64 / 0.1, rel=0.01)  # two groups, the exchange hidden behind a round
    # b2 twice as slow: group b's steps take twice as long, and every round waits for it
    assert estimated_rate(plan, {"b2": 2.0}) == pytest.approx(base / 2, rel=0.01)
    # a synchronous plan: tokens over `estimated_step`
    sync = replace(plan, mode="sync", groups=[], outer=None, pipelines=[pipe(["a1", "a2"])])
    assert estimated_rate(sync, {"a1": 1.5}) == pytest.approx(16 * 64 / (0.1 * 1.5))


def test_a_slowed_group_the_planner_would_run_as_it_runs_is_not_restarted_for_nothing(caplog) -> None:
    """A node of lab-b computes 3x slower, and the planner's new plan runs lab-b as it runs (the same nodes, cuts and
    batches: here the planner is made to return the running plan; on bench.regions' testbed a one-node region):
    a replan would only start lab-b's round again, a rollback of the steps it trained in it (bench.regions (c)
    measured 9), where its inner steps a round already follow its live pace. No replan, and the log says why."""
    state, clock, region = _outer_state(steps=2000)
    first = state.current_plan()
    slow = next(n for n in sorted(region) if region[n] == "lab-b" and _layers(first, n) > 0)
    lab_b = frozenset(n for n in region if region[n] == "lab-b")
    state.planner = lambda inputs: (replace(first), "planner")
    _run(state, clock, {}, range(0, 11))
    _run(state, clock, {slow: 3.0}, range(11, 24))
    _later(state, clock, 61)
    with caplog.at_level(logging.INFO, logger="atoll.coordinator"):
        assert state.tick() == [] and state.epoch == first.epoch
    assert "would run as they do" in caplog.text and "lab-b" in caplog.text, caplog.text
    assert unchanged_groups(first, first, lab_b) == ["lab-b"]
    moved = replace(first, pipelines=[replace(p, micro_batch=p.micro_batch * 2) for p in first.pipelines])
    assert unchanged_groups(first, moved, lab_b) == []
    assert unchanged_groups(first, replace(first, groups=first.groups[:1]), lab_b) == []
