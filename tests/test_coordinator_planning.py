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
