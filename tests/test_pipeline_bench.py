"""The benchmark's own measuring tools: the FLOP-balanced cut and the schedule replay."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from atoll.models import preset
from atoll.modelspec import ModelSpec
from atoll.node.schedule import schedule, theoretical_bubble
from atoll.node.stage import OpTiming, StepResult
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench tree is not installed
from bench.pipeline import balanced_cuts, replay_bubble  # noqa: E402


def _result(stage: int, p: int, m: int, fwd: float, bwd: float) -> StepResult:
    tl = [OpTiming(a.op, a.micro_batch, 0.0, 0.0, 0.0, 0.0, fwd if a.op == "forward" else bwd)
          for a in schedule("1f1b", stage=stage, num_stages=p, micro_batches=m)]
    return StepResult(step=0, loss=None, grad_norm=None, tokens=0, step_seconds=1.0, pipeline_seconds=1.0,
                      compute_seconds=0.0, wait_seconds=0.0, timeline=tl)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8)])
def test_replay_of_uniform_stages_gives_the_theoretical_bubble(p, m):
    idle = replay_bubble([_result(s, p, m, 1.0, 2.0) for s in range(p)], p, m)
    assert sum(idle) / p == pytest.approx(theoretical_bubble(p, m))


def test_replay_sees_an_unbalanced_stage():
    p, m = 2, 4
    idle = replay_bubble([_result(0, p, m, 1.0, 2.0), _result(1, p, m, 2.0, 4.0)], p, m)
    assert idle[0] > theoretical_bubble(p, m) > idle[1]


def test_balanced_cuts_split_equal_blocks_evenly():
    spec = ModelSpec.from_config(preset("125m"))
    assert balanced_cuts(spec, 1) == [0, 14]
    cuts = balanced_cuts(spec, 2)
    assert cuts[0] == 0 and cuts[-1] == 14 and len(cuts) == 3
    cost = [x.flops_fwd_per_token for x in spec.layers]
    stages = [sum(cost[a:b]) for a, b in zip(cuts, cuts[1:])]
    assert max(stages) <= min(stages) * 1.4
