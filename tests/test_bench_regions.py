"""The regions benchmark's pure helpers: interpolation, time to reach a loss, tokens trained by a time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench tree is not installed
from bench.regions import interpolate, time_to_reach, tokens_by  # noqa: E402


def test_interpolate_between_and_at_points() -> None:
    xs, ys = [0.0, 10.0, 20.0], [4.0, 3.0, 1.0]
    assert interpolate(xs, ys, 10.0) == 3.0
    assert interpolate(xs, ys, 5.0) == pytest.approx(3.5)
    assert interpolate(xs, ys, 15.0) == pytest.approx(2.0)
    assert interpolate(xs, ys, 0.0) == 4.0 and interpolate(xs, ys, 20.0) == 1.0


def test_interpolate_outside_the_curve_is_none() -> None:
    assert interpolate([1.0, 2.0], [5.0, 4.0], 0.5) is None
    assert interpolate([1.0, 2.0], [5.0, 4.0], 2.5) is None
    assert interpolate([], [], 1.0) is None


def test_time_to_reach_interpolates_the_first_crossing() -> None:
    times, losses = [1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 2.5]
    assert time_to_reach(times, losses, 2.5) == pytest.approx(2.5)
    assert time_to_reach(times, losses, 3.0) == pytest.approx(2.0)
    assert time_to_reach(times, losses, 5.0) == 1.0  # already below at the first point
    assert time_to_reach(times, losses, 1.0) is None  # never reached


def test_tokens_by_counts_each_groups_finished_steps() -> None:
    steps = {0: [1.0, 2.0, 3.0], 1: [1.5, 2.5]}
    assert tokens_by(steps, 0.5, 100) == 0
    assert tokens_by(steps, 2.0, 100) == 300  # group 0: 2 steps, group 1: 1
    assert tokens_by(steps, 10.0, 100) == 500
