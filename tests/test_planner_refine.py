"""The composer's layer-cut refinement, and the live validation's repeat, interleave and overhead helpers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from atoll.coordinator.planner import TrainSpec, parse_cluster
from atoll.coordinator.planner.composer import Composer
from atoll.coordinator.planner.costmodel import CostModel
from atoll.coordinator.planner.simulator import LinkTimes, PipelineTimes, StageTimes, simulate
from atoll.modelspec import ModelConfig, ModelSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ at the repository root

MODEL = ModelSpec.from_config(ModelConfig(name="t10", vocab_size=8000, d_model=1024, n_layers=8, n_heads=8,
                                          seq_len=512))
CLUSTER = parse_cluster("""
[[group]]
name = "v100"
device = "V100-32GB"
count = 4
gpus_per_node = 4
[[group]]
name = "a100"
device = "A100-80GB"
count = 4
gpus_per_node = 4
""")


def _composer() -> Composer:
    return Composer(cost_model=CostModel(MODEL, TrainSpec(global_batch=64, seq_len=512)), cluster=CLUSTER)


def test_refine_moves_layers_back_to_a_better_cut() -> None:
    comp = _composer()
    best = comp.search()[0]
    assert best.placed and len(best.placed) >= 2
    setup = next(s for s in comp.setups() if tuple(i.id for i in s.order) == best.order
                 and s.batch == best.micro_batch and all(p[0] < len(s.order) for p in best.placed)
                 and comp.chain_best(s) is not None)
    # the first cut moved two layers off the balance the search found: slower, and refine must win it back
    (i, a, e, k), (j, _, e2, k2) = best.placed[0], best.placed[1]
    shift = 2 if e + 2 < e2 else -2
    if not a < e + shift < e2:
        pytest.skip("the best plan's first two stages are too short to move a cut by two layers")
    moved = [(i, a, e + shift, k), (j, e + shift, e2, k2), *best.placed[2:]]
    worse = comp._evaluate(setup, moved)
    worse.step_s = simulate(worse.times).step_time_s
    refined = comp.refine(worse, setup)
    assert refined.step_s < worse.step_s
    assert refined.step_s == pytest.approx(simulate(refined.times).step_time_s)
    assert [(st.start, st.end) for st in refined.stages][0][1] != e + shift
    # never worse than what it was given, and a zero budget returns the candidate as it was
    assert comp.refine(refined, setup).step_s <= refined.step_s
    assert comp.refine(worse, setup, budget=0) is worse
    # the cuts still cover every layer in order
    cuts = [(st.start, st.end) for st in refined.stages]
    assert cuts[0][0] == 0 and cuts[-1][1] == MODEL.num_layers
    assert all(x[1] == y[0] and x[0] < x[1] for x, y in zip(cuts, cuts[1:]))


def test_validation_repeats_interleave_and_take_medians() -> None:
    from bench.planner_validate import SHAPES, combine, interleaved

    order = interleaved(SHAPES[:3], 3)
    assert [s.name for _, s in order] == [s.name for s in (*SHAPES[:3], *reversed(SHAPES[:3]), *SHAPES[:3])]
    assert [r for r, _ in order] == [0] * 3 + [1] * 3 + [2] * 3

    def run(pred: float, meas: float) -> dict:
        return {"before": pred, "during": pred, "replayed": pred, "measured": meas, "share": 0.5, "seen": 0.4,
                "factor": 2.0, "overhead": 0.001}

    # the gap is the median of each run's own gap, so one disturbed run does not move it
    r = combine([run(1.0, 1.0), run(1.1, 1.0), run(1.0, 2.0)])
    assert r["gap_during"] == pytest.approx(0.0)
    assert r["measured"] == pytest.approx(1.0) and r["spread"] == "-50%..+10%"
    assert combine([run(1.2, 1.0)])["spread"] == "-"
    assert r["gap_calibrated"] is None and r["spread_calibrated"] == "-"
    # the calibrated reading: the runs after the first, each predicted from its previous run's speed
    later = [run(1.0, 1.0), {**run(1.0, 1.0), "calibrated": 1.3}, {**run(1.0, 1.0), "calibrated": 0.9},
             {**run(1.0, 1.0), "calibrated": 1.05}]
    c = combine(later)
    assert c["gap_calibrated"] == pytest.approx(0.05) and c["spread_calibrated"] == "-10%..+30%"
    with pytest.raises(ValueError):
        combine([])


def test_action_overhead_is_the_steps_cpu_beyond_compute_and_optimizer() -> None:
    from bench.planner_validate import action_overhead, with_action_overhead

    # node a: 1.0 s of CPU, 0.8 of compute, 0.1 of optimizer over 20 actions: 5 ms each; node b: 10 ms each
    steps = {"a": [(1.0, 0.8, 0.1, 20), (1.0, 0.8, 0.1, 20)], "b": [(0.5, 0.3, 0.0, 20)]}
    assert action_overhead(steps) == pytest.approx(0.005)
    assert action_overhead({"a": [(0.5, 0.6, 0.0, 4)]}) == 0.0  # never negative
    with pytest.raises(ValueError):
        action_overhead({"a": []})
    times = PipelineTimes(stages=(StageTimes(forward_s=1.0, backward_s=2.0), StageTimes(forward_s=1.0, backward_s=2.0)),
                          links=(LinkTimes(forward_s=0.1, backward_s=0.1),), num_micro_batches=4)
    more = with_action_overhead(times, 0.5)
    assert [(s.forward_s, s.backward_s) for s in more.stages] == [(1.5, 2.5), (1.5, 2.5)]
    assert simulate(more).step_time_s > simulate(times).step_time_s
    assert with_action_overhead(times, 0.0) is times
