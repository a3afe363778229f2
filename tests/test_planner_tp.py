"""Tensor parallelism inside a node, stage widths of any count, and every device left out named with a reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from atoll.coordinator.planner import (PlannerOptions, TrainSpec, load_cluster, parse_cluster, plan_job,
                                       search_plan)
from atoll.coordinator.planner.costmodel import CostModel
from atoll.coordinator.planner.parallelizer import DefaultParallelizer, SliceQuery
from atoll.coordinator.planner.report import format_plan
from atoll.models import preset_spec
from atoll.modelspec import ModelConfig, ModelSpec
from atoll.node.placement import shares
from atoll.plan import Plan

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "clusters"


def _v100s(count: int, gpus_per_node: int = 8) -> str:
    return (f'[[group]]\nname = "v100"\ndevice = "V100-32GB"\ncount = {count}\ngpus_per_node = {gpus_per_node}\n'
            'intra_node_gbps = 300\ninter_node_gbps = 50\n')


def test_tp_is_chosen_where_it_wins_a_large_model_on_v100_nodes() -> None:
    model = preset_spec("13b")
    cluster = parse_cluster(_v100s(16))
    train = TrainSpec(global_batch=32, seq_len=4096)
    plan = plan_job(model, cluster, train)
    without = plan_job(model, cluster, train, options=PlannerOptions(max_tp=1))
    assert {s.tp for s in plan.pipelines[0].stages} != {1}
    assert all(s.tp == 1 for s in without.pipelines[0].stages)
    assert plan.predicted.tokens_per_s > 1.1 * without.predicted.tokens_per_s
    assert sum(s.dp * s.tp for s in plan.pipelines[0].stages) == 16
    # carried in the JSON and printed per stage
    back = Plan.from_json(plan.to_json())
    assert [(s.dp, s.tp) for s in back.pipelines[0].stages] == [(s.dp, s.tp) for s in plan.pipelines[0].stages]
    s = plan.pipelines[0].stages[0]
    assert f"dp {s.dp} x tp {s.tp}" in format_plan(plan, cluster)


def test_tp_stays_within_a_node_and_divides_the_heads() -> None:
    model = preset_spec("13b")
    plan = plan_job(model, parse_cluster(_v100s(16, gpus_per_node=2)), TrainSpec(global_batch=32, seq_len=4096))
    assert all(s.tp <= 2 for p in plan.pipelines for s in p.stages)
    odd = ModelSpec.from_config(ModelConfig(name="h12", style="llama", vocab_size=8000, d_model=768, n_layers=4,
                                            n_heads=12, n_kv_heads=4, ffn_hidden=3072, seq_len=512))
    par = DefaultParallelizer(CostModel(odd, TrainSpec(global_batch=32, seq_len=512)))
    assert par.tps == [1, 2, 4]  # divide 12 heads, 4 kv heads and 3072
    isl = parse_cluster(_v100s(16)).islands[0]
    assert {tp for tp, _, _ in par.splits(isl, 16, 16)} == {1, 2, 4}
    assert {tp for tp, _, _ in par.splits(isl, 12, 12)} == {1, 2, 4}
    assert {tp for tp, _, _ in par.splits(isl, 6, 6)} == {1, 2}  # tp divides the stage's devices


def test_replicas_share_a_micro_batch_as_evenly_as_the_runtime_does() -> None:
    model = preset_spec("350m")
    cm = CostModel(model, TrainSpec(global_batch=96, seq_len=1024))
    par = DefaultParallelizer(cm)
    isl = parse_cluster(_v100s(24)).islands[0]
    # 32 sequences over 24 devices: 24 replicas of 1 or 2, 12 of 2 or 3 (tp 2), 6 of 5 or 6 (tp 4)...
    got = {tp: (dp, rows) for tp, dp, rows in par.splits(isl, 24, 32)}
    for tp, (dp, rows) in got.items():
        parts = [b - a for a, b in shares(32, dp)]
        assert dp * tp == 24 and max(parts) == rows and max(parts) - min(parts) <= 1
    # every replica needs a sequence: 16 sequences cannot feed 24 replicas of one device
    assert [(tp, dp) for tp, dp, _ in par.splits(isl, 24, 16)] == [(2, 12), (4, 6), (8, 3)]
    c = par.cost(SliceQuery(start=0, end=4, micro_batch=1, dp=24, in_flight=1, batch=32), isl)
    assert c is not None and c.gpus == 24 and c.micro_batch == -(-32 // c.dp)
    # a runtime that cannot regroup rows gets exact shares of an allowed size
    exact = DefaultParallelizer(CostModel(model, TrainSpec(global_batch=96, seq_len=1024),
                                          options=PlannerOptions(equal_widths=True)))
    assert all(32 % dp == 0 and rows in (1, 2, 4, 8) for _, dp, rows in exact.splits(isl, 24, 32))


def test_a_wide_island_is_used_whole_when_its_size_is_not_a_power_of_two() -> None:
    model = preset_spec("350m")
    plan = search_plan(model, parse_cluster(_v100s(24)), TrainSpec(global_batch=96, seq_len=1024)).plan
    assert sum(s.dp * s.tp for p in plan.pipelines for s in p.stages) == 24 and not plan.idle


@pytest.mark.parametrize("name", sorted(p.stem for p in EXAMPLES.glob("*.toml")))
def test_no_device_is_left_out_without_a_reason(name: str) -> None:
    model = preset_spec("350m")
    cluster = load_cluster(EXAMPLES / f"{name}.toml")
    plan = search_plan(model, cluster, TrainSpec(global_batch=256, seq_len=1024)).plan
    used: dict[str, int] = {}
    for p in plan.pipelines:
        for s in p.stages:
            used[s.island] = used.get(s.island, 0) + s.dp * s.tp
            assert s.tp <= cluster.island(s.island).gpus_per_node
    idle = {x.island: x for x in plan.idle}
    for isl in cluster.islands:
        left = isl.gpus - used.get(isl.id, 0)
        assert left == (idle[isl.id].gpus if isl.id in idle else 0), isl.id
        if left:
            assert idle[isl.id].reason


def test_idle_devices_carry_their_reason_into_the_json_and_the_report() -> None:
    cluster = parse_cluster("""
[[group]]
name = "fast"
tflops = 400
memory_gb = 80
count = 8
[[group]]
name = "slow"
tflops = 2
memory_gb = 16
count = 8
inter_node_gbps = 10
""")
    plan = search_plan(preset_spec("350m"), cluster, TrainSpec(global_batch=64, seq_len=1024)).plan
    assert [(x.island, x.gpus) for x in plan.idle] == [("slow", 8)] and plan.idle[0].reason
    assert Plan.from_json(plan.to_json()).idle == plan.idle
    text = format_plan(plan, cluster)
    assert "idle:" in text and f"slow: idle, {plan.idle[0].reason}" in text
