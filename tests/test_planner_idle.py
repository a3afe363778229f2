"""Devices a plan leaves idle: tied models that fit whole on an island use the cluster, a live plan of equal nodes
is the same from run to run, and every idle device's reason gives the figures the search found."""

from __future__ import annotations

import random
from pathlib import Path

from atoll.coordinator.islands import form_islands
from atoll.coordinator.linkmatrix import complete_matrix
from atoll.coordinator.planner import PlannerOptions, TrainSpec, parse_cluster, plan_job
from atoll.coordinator.planner.costmodel import CostModel
from atoll.coordinator.planner.parallelizer import DefaultParallelizer, SliceQuery
from atoll.coordinator.planning import PlanInputs, make_plan
from atoll.coordinator.store import MemberRecord
from atoll.job import JobSpec
from atoll.models import preset_spec
from atoll.types import LayerTiming, LinkMeasurement, NodeProfile
from atoll.units import duration

ROOT = Path(__file__).resolve().parents[1]
LAB = parse_cluster('[[group]]\nname = "rtx4090"\ndevice = "RTX4090"\ncount = 16\ngpus_per_node = 4\n'
                    'inter_node_gbps = 25\n\n[[group]]\nname = "t4"\ndevice = "T4"\ncount = 16\ngpus_per_node = 8\n'
                    'inter_node_gbps = 10\n', source="lab")
QWEN = preset_spec("qwen2.5-0.5b").with_seq_len(8192)
TRAIN = TrainSpec(global_batch=512, seq_len=8192, dtype="bf16")


def test_a_tied_model_whole_on_one_stage_may_shard_its_states() -> None:
    # 16 RTX 4090 sharing 16 sequences of 8,192 tokens: the whole model fits with ZeRO-1 (18.3 of 21.6 GB); a
    # cut model's last stage holds the tied weight's copy and trains it without ZeRO, which reach counted for the
    # whole model too (it found [1, n) at best, recomputing, and the search never one stage of the whole model)
    cm = CostModel(QWEN, TRAIN)
    par = DefaultParallelizer(cm)
    isl = LAB.island("rtx4090")
    n = QWEN.num_layers
    whole = par.cost(SliceQuery(start=0, end=n, micro_batch=1, dp=16, in_flight=1, batch=16), isl)
    assert whole is not None and whole.zero >= 1
    assert par.reach(isl, 1, 16, 1, n, float("inf"), batch=16) == 0


def test_a_tied_model_runs_pipelines_all_cut_or_all_whole_on_every_island() -> None:
    # before: the tied model's one-pipeline-per-island split mixed a whole pipeline with cut ones and was dropped,
    # and the search's reach missed the whole-model stage: 7 of 64 GPUs of the lab, 71 s a step
    plan = plan_job(QWEN, LAB, TRAIN)
    used = sum(s.dp * s.tp for p in plan.pipelines for s in p.stages)
    assert used == 32 and not plan.idle
    assert len({len(p.stages) > 1 for p in plan.pipelines}) == 1
    assert plan.predicted.step_time_s < 20


# the tiny job's layers as a CPU node profiles them (ms: forward, backward; weight share, split overhead)
TINY = {("embedding", 2): (0.128, 0.186, 0, 0), ("block", 2): (0.76, 1.04, 0.21, 0.14),
        ("head", 2): (0.235, 0.304, 0.3, 0.11), ("embedding", 4): (0.118, 0.18, 0, 0),
        ("block", 4): (0.93, 1.66, 0.22, 0.13), ("head", 4): (0.344, 0.462, 0.318, 0.053),
        ("embedding", 8): (0.132, 0.225, 0, 0), ("block", 8): (1.6, 3.3, 0.23, 0.05),
        ("head", 8): (0.565, 0.79, 0.32, 0.06)}


def _demo_inputs(seed: int, bandwidth: float, rtt: float) -> PlanInputs:
    """The demo's three equal CPU nodes on one machine, each timing and link off by measurement noise (5% on
    layer timings, as two profiles of one node differ; 20% on links)."""
    rng = random.Random(seed)
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    members = {}
    for i in range(3):
        timings = [LayerTiming(layer_kind=k, micro_batch=b, seq_len=64,
                               forward_seconds=f * 1e-3 * rng.lognormvariate(0, 0.05),
                               backward_seconds=bw * 1e-3 * rng.lognormvariate(0, 0.05), weight_fraction=w,
                               split_overhead=s * rng.uniform(0.5, 1.5)) for (k, b), (f, bw, w, s) in TINY.items()]
        members[f"node{i + 1}"] = MemberRecord(node_id=f"node{i + 1}", peer_address=f"127.0.0.1:{5000 + i}",
                                               profile=NodeProfile(hostname="h", device_kind="cpu", device_name="cpu",
                                                                   memory_total_bytes=25 << 30,
                                                                   memory_free_bytes=20 << 30, cpu_count=2,
                                                                   layer_timings=timings,
                                                                   optimizer_step_seconds=8e-4 * rng.lognormvariate(0, 0.05)))
    ids = sorted(members)
    links = [LinkMeasurement(src=a, dst=b, bandwidth_bytes_per_s=bandwidth * rng.lognormvariate(0, 0.2),
                             rtt_seconds=rtt * rng.lognormvariate(0, 0.2)) for a in ids for b in ids if a != b]
    matrix = complete_matrix(ids, links)
    islands = form_islands({n: m.profile for n, m in members.items()}, matrix)
    return PlanInputs(job=job, members=members, islands=islands, matrix=matrix, links=links, epoch=1,
                      rendezvous="127.0.0.1:1")


def _shape(plan) -> tuple:
    return tuple((p.micro_batch, tuple((s.layers, s.dp, s.lanes) for s in p.stages)) for p in plan.pipelines)


def test_the_demo_plans_the_same_on_every_run_and_uses_its_three_nodes() -> None:
    # loopback between the nodes' processes; without near_equal these profiles gave two plans (a stage of 3
    # replicas, or 3 stages) about 1-7% apart in either order
    plans = [make_plan(_demo_inputs(seed, 3e8, 2e-4))[0] for seed in range(6)]
    assert len({_shape(p) for p in plans}) == 1, [_shape(p) for p in plans]
    assert all(not p.idle and sum(s.dp for q in p.pipelines for s in q.stages) == 3 for p in plans)


def test_near_equal_prefers_more_devices_then_fewer_stages() -> None:
    fast = plan_job(QWEN, LAB, TRAIN, options=PlannerOptions(several_pipelines=False))
    near = plan_job(QWEN, LAB, TRAIN, options=PlannerOptions(several_pipelines=False, near_equal=0.1))
    assert near.predicted.step_time_s <= fast.predicted.step_time_s * 1.1
    devices = [sum(s.dp * s.tp for p in x.pipelines for s in p.stages) for x in (fast, near)]
    assert devices[1] >= devices[0]


def test_an_idle_node_is_told_what_the_plan_that_used_it_predicted() -> None:
    # links slow enough (5 ms a round trip) that a third stage costs more than it brings on some profiles
    told = 0
    for seed in range(5):
        plan = make_plan(_demo_inputs(seed, 3e7, 5e-3))[0]
        for idle in plan.idle:
            assert "no arrangement tried" not in idle.reason and "not worth adding" not in idle.reason
            assert f"against the plan's {duration(plan.predicted.step_time_s)}" in idle.reason, idle.reason
            assert "runs 3 of them" in idle.reason and "was predicted at" in idle.reason
            told += 1
    assert told
