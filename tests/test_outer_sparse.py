"""Outer mode with sparse2 pseudo-gradients (SparseLoCo's 1/64 at 2 bits, error feedback) against int8: two
replica groups as threads with real gRPC peers, the loss after a fixed number of steps, and the bytes a round."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pipeline_harness import run_outer_plan, stage, tiny_job

from atoll.compression import CodecSpec, get_codec
from atoll.plan import OuterPlan, PipelinePlan

STEPS = 100
H = 2
LAST = 10
LOSS_BOUND = 0.08
"""sparse2's mean loss over the last `LAST` steps stays within this fraction of int8's (measured: +4.8%, 2.388
against 2.278). Error feedback sends AdamW's flat pseudo-gradients slowly at 1/64 a round: sparse2 trails by 50%
after 12 rounds and closes the gap as its residual fills (the price of 50x fewer bytes a round). Outer momentum 0.9
on top of error feedback diverged here after 40 rounds; SparseLoCo uses the error-feedback accumulator in place of
outer momentum, so the test runs plain averaging."""


def _losses(codec: str, tmp_path: Path) -> tuple[float, float, dict[str, dict[str, torch.Tensor]]]:
    """(mean loss of both groups over the first `LAST` steps, over the last `LAST`, node -> parameters at the end)."""
    job = tiny_job(STEPS)
    outer = OuterPlan(inner_steps=H, codec=codec, topk_fraction=1 / 64 if codec == "sparse2" else 0.0, lr=1.0,
                      momentum=0.0, overlap=False, deadline_s=30.0)
    groups = [[PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[stage((0, 6), [node])])] for node in "ab"]
    run = run_outer_plan(job, groups, outer, tmp_path / codec)
    losses, params, rounds = run.losses, run.params, run.rounds
    assert rounds.latest_decided == STEPS // H - 1
    first = [losses[(g, s)] for g in (0, 1) for s in range(LAST)]
    last = [losses[(g, s)] for g in (0, 1) for s in range(STEPS - LAST, STEPS)]
    return sum(first) / len(first), sum(last) / len(last), params


@pytest.mark.timeout(480)
def test_sparse2_trains_within_a_stated_bound_of_int8(tmp_path: Path) -> None:
    start, int8, _ = _losses("int8", tmp_path)
    _, sparse, params = _losses("sparse2", tmp_path)
    assert sparse < 0.7 * start and int8 < 0.7 * start  # it trains under both
    assert sparse <= (1 + LOSS_BOUND) * int8, (sparse, int8)
    # both groups end on the same outer parameters
    for name, t in params["a"].items():
        assert torch.allclose(t, params["b"][name], atol=1e-6), name
    # what one round sends of these parameters, against int8
    numel = sum(t.numel() for t in params["a"].values())
    wire = {c: sum(get_codec(CodecSpec(c, topk_fraction=1 / 64)).payload_size(t.numel(), torch.float32)
                   for t in params["a"].values()) for c in ("int8", "sparse2")}
    assert wire["int8"] > 30 * wire["sparse2"], (numel, wire)
