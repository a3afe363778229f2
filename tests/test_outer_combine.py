"""How a round's contributions combine into the update (`atoll.node.outer.combine_weights`)."""

from __future__ import annotations

import pytest
import torch

from atoll.node.outer import combine_weights

TPS = 16 * 64  # tokens a step


def test_equal_groups_get_the_plain_mean() -> None:
    assert combine_weights([10 * TPS, 10 * TPS]) == [0.5, 0.5]
    assert combine_weights([10 * TPS] * 4) == [0.25] * 4


def test_uneven_groups_move_as_far_as_the_fastest_alone() -> None:
    # groups of 10, 5 and 2 inner steps whose pseudo-gradients grow with their steps (the same direction per step):
    # the update is the fastest group's 10 steps, where a mean weighted by tokens moved 129/17 = 7.6 steps
    per_step = torch.tensor([1.0, -2.0, 0.5])
    steps = [10, 5, 2]
    w = combine_weights([s * TPS for s in steps])
    update = sum(wi * s * per_step for wi, s in zip(w, steps))
    assert torch.allclose(update, 10 * per_step)
    by_tokens = sum(s * s * per_step for s in steps) / sum(steps)
    assert torch.allclose(by_tokens, 129 / 17 * per_step)


def test_one_participant_is_not_extrapolated() -> None:
    assert combine_weights([2 * TPS]) == [1.0]  # a slow group alone: its own 2 steps, not scaled to H


def test_a_group_that_trained_nothing_counts_nothing() -> None:
    assert combine_weights([0, 10 * TPS]) == [0.0, 1.0]
    assert combine_weights([0, 0]) == []


@pytest.mark.parametrize("tps", [1, TPS, 4096 * 2048])
def test_the_weights_do_not_depend_on_the_tokens_a_step(tps) -> None:
    assert combine_weights([10 * tps, 4 * tps]) == pytest.approx([10 / 14, 10 / 14])
