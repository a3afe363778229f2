"""The coordinator's adapter to the planner: the fallback plan, node ids, peer addresses and the rendezvous."""

from __future__ import annotations

from pathlib import Path

import pytest

from atoll.coordinator.islands import form_islands
from atoll.coordinator.linkmatrix import complete_matrix
from atoll.coordinator.planning import PlanInputs, fallback_plan, finish_plan, make_plan
from atoll.coordinator.store import MemberRecord
from atoll.job import JobSpec
from atoll.types import LayerTiming, LinkMeasurement, NodeProfile

ROOT = Path(__file__).resolve().parents[1]


def _inputs(groups: dict[str, list[str]], timings: bool = True, epoch: int = 4) -> PlanInputs:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    lt = [LayerTiming(layer_kind=k, micro_batch=b, seq_len=64, forward_seconds=1e-3 * b, backward_seconds=2e-3 * b)
          for k in ("embedding", "block", "head") for b in (2, 4, 8)] if timings else []
    members, links = {}, []
    for device, nodes in groups.items():
        for i, n in enumerate(nodes):
            members[n] = MemberRecord(node_id=n, peer_address=f"10.0.{len(members)}.1:5000", profile=NodeProfile(
                hostname=n, device_kind="cpu", device_name=device, memory_total_bytes=8 << 30,
                memory_free_bytes=8 << 30, layer_timings=lt))
    ids = sorted(members)
    for a in ids:
        for b in ids:
            if a < b:
                fast = members[a].profile.device_name == members[b].profile.device_name
                links.append(LinkMeasurement(src=a, dst=b, bandwidth_bytes_per_s=1e9 if fast else 1e7,
                                             rtt_seconds=1e-4))
    matrix = complete_matrix(ids, links)
    islands = form_islands({n: m.profile for n, m in members.items()}, matrix)
    return PlanInputs(job=job, members=members, islands=islands, matrix=matrix, links=links, epoch=epoch,
                      resume_step=25, rendezvous="10.0.9.9:29400")


def test_fallback_splits_layers_evenly_over_islands_with_one_dp_degree() -> None:
    inputs = _inputs({"x": ["a1", "a2", "a3"], "y": ["b1", "b2"], "z": ["c1", "c2", "c3", "c4"]})
    plan = finish_plan(fallback_plan(inputs), inputs)
    plan.validate(6)
    (pipeline,) = plan.pipelines
    assert [s.layers for s in pipeline.stages] == [(0, 2), (2, 4), (4, 6)]
    assert [s.island for s in pipeline.stages] == [i.id for i in inputs.islands]
    assert {s.dp for s in pipeline.stages} == {2}  # the smallest island has 2 nodes; 2 divides 4 micro-batches
    assert pipeline.micro_batch == 4 * 2  # the job's micro_batch on each of the 2 replicas
    assert pipeline.num_micro_batches * pipeline.micro_batch == 16  # the global batch
    assert [s.nodes for s in pipeline.stages] == [["a1", "a2"], ["b1", "b2"], ["c1", "c2"]]
    assert (plan.epoch, plan.resume_step, plan.job_id) == (4, 25, inputs.job.id)
    assert plan.rendezvous == "10.0.9.9:29400"
    assert {s.dp_rendezvous for s in pipeline.stages} == {"tcp://10.0.9.9:29400"}


def test_plan_names_every_node_address() -> None:
    inputs = _inputs({"x": ["a1", "a2"], "y": ["b1"]})
    plan = finish_plan(fallback_plan(inputs), inputs)
    used = {n for p in plan.pipelines for s in p.stages for n in s.nodes}
    assert plan.node_addresses == {n: inputs.members[n].peer_address for n in used}


def test_make_plan_uses_the_planner_when_it_can_place_the_job() -> None:
    inputs = _inputs({"x": ["a1", "a2"], "y": ["b1", "b2"]})
    plan, how = make_plan(inputs)
    assert how == "planner"
    plan.validate(6)
    assert plan.epoch == 4 and plan.predicted.step_time_s > 0
    assert sum(p.micro_batch * p.num_micro_batches for p in plan.pipelines) == 16
    alive = set(inputs.members)
    for p in plan.pipelines:
        for s in p.stages:
            assert s.nodes and set(s.nodes) <= alive and len(s.nodes) == s.dp
            assert s.dp_rendezvous == "tcp://10.0.9.9:29400"
            assert plan.node_addresses[s.nodes[0]] == inputs.members[s.nodes[0]].peer_address


def test_make_plan_falls_back_and_says_why() -> None:
    plan, how = make_plan(_inputs({"x": ["a1", "a2"]}, timings=False))
    assert how.startswith("fallback plan") and "(" in how
    plan.validate(6)
    with pytest.raises(ValueError, match="without alive members"):
        make_plan(PlanInputs(job=_inputs({"x": ["a"]}).job, members={}, islands=[], matrix={}, epoch=1))


def _outer_previous(inputs: PlanInputs):
    from atoll.plan import OuterPlan, PipelinePlan, Plan, ReplicaGroup, StagePlan

    def pipe(nodes):
        return PipelinePlan(micro_batch=4, num_micro_batches=4,
                            stages=[StagePlan(island="i", layers=(0, 3), nodes=[nodes[0]]),
                                    StagePlan(island="i", layers=(3, 6), nodes=[nodes[1]])])
    prev = Plan(model="tiny", global_batch=16, seq_len=64, epoch=3, job_id=inputs.job.id, mode="outer",
                rendezvous=inputs.rendezvous, pipelines=[pipe(["a1", "a2"]), pipe(["b1", "b2"])],
                groups=[ReplicaGroup(name="lab-a", pipelines=[0], inner_steps=5, since_epoch=1, step_time_s=0.1,
                                     tokens_per_s=100.0),
                        ReplicaGroup(name="lab-b", pipelines=[1], inner_steps=5, since_epoch=2, step_time_s=0.1,
                                     tokens_per_s=100.0)],
                outer=OuterPlan(inner_steps=5, codec="int8"),
                node_addresses={n: m.peer_address for n, m in inputs.members.items()})
    return prev


def _regions(inputs: PlanInputs, regions: dict[str, str]) -> None:
    for n, m in inputs.members.items():
        m.profile.region = regions[n]


def test_a_replan_keeps_intact_replica_groups_running() -> None:
    """A node of lab-b dies: lab-a's group is kept as it runs (same since-epoch, nodes, cuts), lab-b's
    survivor is planned afresh as a new group of the new epoch."""
    from dataclasses import replace

    from atoll.coordinator.planning import kept_groups

    full = _inputs({"x": ["a1", "a2", "b1", "b2"]})
    _regions(full, {"a1": "lab-a", "a2": "lab-a", "b1": "lab-b", "b2": "lab-b"})
    prev = _outer_previous(full)
    members = {n: m for n, m in full.members.items() if n != "b2"}
    islands = [replace(i, nodes=[n for n in i.nodes if n != "b2"]) for i in full.islands]
    inputs = replace(full, members=members, islands=islands, previous=prev)
    assert kept_groups(inputs) == [0]
    plan, how = make_plan(inputs)
    plan.validate(6)
    assert plan.mode == "outer" and "kept 1 replica group" in how
    assert plan.groups[0].since_epoch == 1 and plan.groups[0].name == "lab-a"
    assert [s.nodes for s in plan.pipelines[0].stages] == [["a1"], ["a2"]]
    assert plan.groups[1].since_epoch == inputs.epoch
    assert {n for p in plan.groups[1].pipelines for s in plan.pipelines[p].stages for n in s.nodes} == {"b1"}
    # a failure reported by a node, or a node back at another address, replans its group too
    assert kept_groups(replace(inputs, failed=frozenset({"a2"}))) == []
    moved = dict(members)
    moved["a1"] = replace(members["a1"], peer_address="10.9.9.9:1")
    assert kept_groups(replace(inputs, members=moved)) == []
    # with every node alive both groups are kept; a node joining lab-a replans lab-a's group
    assert kept_groups(replace(full, previous=prev)) == [0, 1]
    joined = dict(full.members)
    joined["a3"] = replace(full.members["a1"], node_id="a3", peer_address="10.0.7.1:5000")
    assert kept_groups(replace(full, members=joined, previous=prev)) == [1]


def test_a_live_plan_names_each_island_by_its_region() -> None:
    inputs = _inputs({"x": ["a1", "a2"], "y": ["b1"]})
    _regions(inputs, {"a1": "lab-a", "a2": "lab-a", "b1": "lab-b"})
    from atoll.coordinator.islands import form_islands

    islands = form_islands({n: m.profile for n, m in inputs.members.items()}, inputs.matrix)
    from dataclasses import replace

    plan, _ = make_plan(replace(inputs, islands=islands))
    assert {i.group for i in plan.islands} <= {"lab-a", "lab-b"}
    for n in ("a1", "a2", "b1"):
        if any(n in s.nodes for p in plan.pipelines for s in p.stages):
            assert plan.region_of(n) == inputs.members[n].profile.region


def test_a_plan_as_nodes_and_the_demo_receive_it_simulates_to_its_predicted_step() -> None:
    """The demo's plan.png simulated a rough split of each stage's compute (a third forward, two thirds backward,
    no warm-up, all-reduce or optimizer) and drew a timeline ending at 87 ms against the 55.6 ms it predicted:
    the planner's own times now travel with the plan (through the wire and its JSON) and simulate to it."""
    import json

    from atoll.coordinator.planner.simulator import plan_pipeline_times, simulate
    from atoll.plan import Plan
    from atoll.serde import plan_from_proto, plan_to_proto

    for groups in ({"x": ["a1", "a2", "a3"]}, {"x": ["a1", "a2"], "y": ["b1", "b2"]}):
        plan, how = make_plan(_inputs(groups))
        assert not how.startswith("fallback"), how
        for received in (plan_from_proto(plan_to_proto(plan)), Plan.from_json_dict(json.loads(plan.to_json()))):
            steps = [simulate(plan_pipeline_times(received, k)).step_time_s for k in range(len(received.pipelines))]
            assert max(steps) == pytest.approx(plan.predicted.step_time_s, rel=1e-9), (groups, steps)
    fallback = finish_plan(fallback_plan(_inputs({"x": ["a1", "a2"]})), _inputs({"x": ["a1", "a2"]}))
    assert plan_pipeline_times(fallback, 0) is None  # no simulation behind it: the picture says each stage's compute


def test_a_group_planned_afresh_is_split_by_the_live_step_times_of_its_nodes() -> None:
    """lab-b's node b2 reported a failed run: lab-b is planned afresh on the same nodes while lab-a runs on. The
    running rounds measured lab-b at 0.35 s a step against lab-a's 0.1: the new plan gives lab-b the 1 step that fits
    a round of 5 x 0.1 s from its first round (before, the profiles' split, until live decisions corrected it two
    rounds later); lab-a, kept running, keeps its 5."""
    from dataclasses import replace

    full = _inputs({"x": ["a1", "a2", "b1", "b2"]})
    _regions(full, {"a1": "lab-a", "a2": "lab-a", "b1": "lab-b", "b2": "lab-b"})
    inputs = replace(full, previous=_outer_previous(full), failed=frozenset({"b2"}))
    plain, _ = make_plan(inputs)
    profiled = plain.groups[1].inner_steps  # the profiles' split
    assert plain.groups[0].inner_steps == 5 and profiled > 1
    b_nodes = frozenset(plain.group_nodes(1))
    live = {frozenset({"a1", "a2"}): 0.1, b_nodes: 0.35}
    plan, how = make_plan(replace(inputs, live_step_s=live))
    b = plan.groups[1].name  # (the test's islands carry no region: the group is named by its island)
    assert [(g.name, g.inner_steps) for g in plan.groups] == [("lab-a", 5), (b, 1)], how
    assert f"the live step times of lab-a, {b} split the rounds ({b} {profiled} -> 1 inner steps a round)" in how
    assert [g.step_time_s for g in plan.groups] == [g.step_time_s for g in plain.groups]  # the cost model's stay
    # a drift replan of lab-b's nodes cut it afresh from their measured speeds: the pace measured under the cut
    # being replaced is not its pace (it gave the faster cut the slow one's steps a round)
    drift, how = make_plan(replace(inputs, live_step_s=live, replan=b_nodes))
    assert [g.inner_steps for g in drift.groups] == [5, plain.groups[1].inner_steps], how
    # a group on other nodes than those measured is not split by their figure
    other, how = make_plan(replace(inputs, live_step_s={frozenset({"b1"}): 0.35, frozenset({"a1", "a2"}): 0.1}))
    assert [g.inner_steps for g in other.groups] == [5, profiled] or b_nodes == frozenset({"b1"}), how
