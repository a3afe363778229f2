"""Each island cut into its own number of stages, and the benchmark's ceiling as an upper bound."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.baselines import BASELINES, PUBLISHED, REFERENCE  # noqa: E402
from bench.planner import SCENARIOS, ceiling  # noqa: E402

from atoll.coordinator.planner import TrainSpec, parse_cluster, search_plan  # noqa: E402
from atoll.coordinator.planner.composer import Composer  # noqa: E402
from atoll.coordinator.planner.costmodel import CostModel  # noqa: E402
from atoll.models import preset_spec  # noqa: E402

CLUSTER = parse_cluster("""
[[group]]
name = "a100"
device = "A100-40GB"
count = 4
gpus_per_node = 4
inter_node_gbps = 25
[[group]]
name = "v100"
device = "V100-16GB"
count = 4
gpus_per_node = 4
inter_node_gbps = 25
""")


def test_islands_of_a_chain_are_cut_into_different_numbers_of_stages() -> None:
    model = preset_spec("350m")
    cm = CostModel(model, TrainSpec(global_batch=512, seq_len=model.config.seq_len))
    setups = Composer(cost_model=cm, cluster=CLUSTER).setups()
    two = [s for s in setups if len(s.order) == 2]
    mixed = {(s.widths, s.caps) for s in two if len(set(s.caps)) > 1 and all(
        w * c == i.gpus for w, c, i in zip(s.widths, s.caps, s.order))}
    # e.g. the A100s in two stages of 2 and the V100s in one stage of 4, and the other way round
    assert ((2, 4), (2, 1)) in mixed or ((4, 2), (1, 2)) in mixed, sorted(mixed)


def test_the_plan_beats_every_baseline_and_stays_under_the_ceiling() -> None:
    s = next(x for x in SCENARIOS if x.name.startswith("8 gpu"))
    model = preset_spec(s.model)
    train = TrainSpec(global_batch=s.global_batch, seq_len=model.config.seq_len)
    cm = CostModel(model, train)
    cluster = s.load()
    plan = search_plan(model, cluster, train).plan.predicted.tokens_per_s
    others = [b(cm, cluster).tokens_per_s(train.tokens_per_step) for b in (*BASELINES, *PUBLISHED, REFERENCE)]
    top = ceiling(cm, cluster)
    assert plan >= max(others) * (1 - 1e-9)
    assert plan <= top and max(others) <= top
    # the ceiling counts each GPU at its most efficient shape, tensor-parallel ones included: the A100s alone
    # at their best tp-2 shape stay under it
    a100 = cluster.island("a100")
    per_gpu = max(b / (t.pf[-1] + t.pb[-1]) / 2 for b in range(1, 17) for t in [cm.table(a100, b, 2)])
    assert top >= a100.gpus * per_gpu * model.config.seq_len


@pytest.mark.parametrize("ratio, note", [(1.2, ""), (1.1, "out of reach")])
def test_a_target_above_the_ceiling_says_it_cannot_be_met(ratio: float, note: str) -> None:
    from bench.planner import _out_of_reach

    assert (note in _out_of_reach(ratio, 1.15)) and (bool(note) == bool(_out_of_reach(ratio, 1.15)))
