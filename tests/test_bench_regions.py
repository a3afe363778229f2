"""The regions benchmark's pure helpers: interpolation, time to reach a loss, tokens trained by a time, the ideal's
batch and figures, the targets' arithmetic, stalls, rollbacks, checkpoints and anchor mismatches."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench tree is not installed
from bench.regions import (  # noqa: E402
    Fault,
    Ideal,
    RunResult,
    count_mismatch_lines,
    describe_steps,
    ideal_figures,
    ideal_rows,
    judge_faults,
    interpolate,
    longest_gap_after,
    loss_targets,
    missing_checkpoints,
    parse_only,
    region_step_times,
    steps_went_back,
    time_to_reach,
    tokens_by,
)


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


def test_step_times_are_kept_by_step_number() -> None:
    """A group that trains 2 steps of each round of H = 10 completes steps 8, 9, 18, 19, ...: the checkpoint of step 20
    is paired with its completion of step 19, not with its 20th step (which it reaches at step ~99). Its region's
    last node completes a step; a step trained again after a rollback counts at its newest completion."""
    from types import SimpleNamespace as R

    reports = [R(node_id=n, plan_epoch=1, step=s, unix_time=float(s) + (0.5 if n == "c2" else 0.0))
               for s in (8, 9, 18, 19, 28, 29) for n in ("c1", "c2")]
    reports += [R(node_id="a1", plan_epoch=1, step=s, unix_time=float(s)) for s in range(30)]
    reports += [R(node_id="c1", plan_epoch=2, step=19, unix_time=40.0)]  # trained again after a rollback
    times = region_step_times(reports, {"c1": "lab-c", "c2": "lab-c", "a1": "lab-a"})
    assert sorted(times["lab-c"]) == [8, 9, 18, 19, 28, 29]
    assert times["lab-c"][9] == 9.5 and times["lab-c"][19] == 40.0
    assert len(times["lab-a"]) == 30 and times["lab-a"][19] == 19.0


def test_parse_only_keeps_the_order_and_refuses_unknown_keys() -> None:
    assert parse_only(None) == ["a", "b", "c"] and parse_only("") == ["a", "b", "c"]
    assert parse_only("c, A") == ["a", "c"]
    with pytest.raises(ValueError, match="d"):
        parse_only("a,d")


def test_ideal_rows_scale_the_best_batch_by_the_regions_rates_alone() -> None:
    assert ideal_rows(16, {"a": 1000.0, "b": 1000.0}, "a") == 32
    assert ideal_rows(16, {"a": 700.0, "b": 400.0, "c": 150.0}, "a") == 29  # 16 x 1250 / 700 = 28.6
    assert ideal_rows(16, {"a": 700.0}, "a") == 16


def test_ideal_figures_from_the_curves() -> None:
    # the best region: steps 10..40, its final loss 2.0 reached at its last point (40 steps, 20 s, 0.5 s a step)
    ideal = ideal_figures(rows=32, target=2.0, best_steps=[10, 20, 30, 40], best_losses=[3.0, 2.6, 2.2, 2.0],
                          best_times=[5.0, 10.0, 15.0, 20.0], best_step_s=0.5, ideal_steps=[10, 20, 30],
                          ideal_losses=[2.8, 2.2, 1.8])
    assert ideal.s_1 == pytest.approx(40.0) and ideal.t_1 == pytest.approx(20.0)
    assert ideal.s_ideal == pytest.approx(25.0)  # 2.2 at 20, 1.8 at 30: 2.0 halfway
    assert ideal.t_ideal == pytest.approx(12.5)
    never = ideal_figures(rows=32, target=1.0, best_steps=[10], best_losses=[2.0], best_times=[5.0], best_step_s=0.5,
                          ideal_steps=[10], ideal_losses=[1.5])
    assert never.s_ideal is None and never.t_ideal is None and never.t_1 is None


def test_loss_targets_judge_against_t_1_and_half_the_ideal_gain() -> None:
    ideal = Ideal(rows=32, target=2.0, s_ideal=25.0, s_1=40.0, t_ideal=12.5, t_1=20.0)
    ok = loss_targets("(b)", 16.0, ideal)  # 0.8 T_1; gains 4 s of the 7.5 s the ideal gains
    assert [hit for _, hit in ok] == [True, True]
    short = loss_targets("(b)", 18.5, ideal)  # 0.925 T_1, but 1.5 s < 3.75 s
    assert [hit for _, hit in short] == [True, False]
    slow = loss_targets("(b)", 19.5, ideal)
    assert [hit for _, hit in slow] == [False, False]
    assert [hit for _, hit in loss_targets("(b)", None, ideal)] == [False, False]
    no_ideal = replace(ideal, s_ideal=None, t_ideal=None)
    assert [hit for _, hit in loss_targets("(b)", 16.0, no_ideal)] == [True, False]


def test_longest_gap_after_a_fault_counts_from_the_fault_up_to_the_next() -> None:
    times = [1.0, 2.0, 3.0, 10.0, 11.0, 30.0]
    assert longest_gap_after(times, 0.0) == pytest.approx(19.0)
    assert longest_gap_after(times, 5.0) == pytest.approx(19.0)  # 11 -> 30
    assert longest_gap_after(times, 5.0, until=20.0) == pytest.approx(9.0)  # 11 -> 30 counts up to 20
    assert longest_gap_after(times, 2.5, until=15.0) == pytest.approx(7.0)  # 3 -> 10; 11 -> 15 is 4
    assert longest_gap_after(times, 40.0) == 0.0


def test_steps_went_back_finds_repeats_and_rollbacks() -> None:
    assert steps_went_back([0, 1, 2, 3]) == []
    assert steps_went_back([0, 1, 2, 1, 2, 3]) == [(2, 1)]
    assert steps_went_back([4, 4]) == [(4, 4)]


def test_missing_checkpoints_every_interval_through_the_final_step() -> None:
    assert missing_checkpoints([10, 20, 30, 35], 10, 35) == []
    assert missing_checkpoints([10, 30], 10, 35) == [20, 35]
    assert missing_checkpoints([], 10, 0) == []
    assert describe_steps([10, 20, 30, 40, 45]) == "step-10..40 every 10, 45"
    assert describe_steps([5, 9]) == "step-5, 9"
    assert describe_steps([]) == "none"


def test_mismatch_lines_are_counted_over_the_coordinators_lifetimes() -> None:
    log = ("I outer round 3, layer 1: the anchors differ: 0000abcd on n1 (lab-a); 0000abce on n2 (lab-b)\n"
           "I outer rounds resumed from the store\n"
           "E outer round 7, layer 0: the anchors differ: ...\n")
    assert count_mismatch_lines(log) == 2
    assert count_mismatch_lines("") == 0


def test_a_runs_step_times_mean_and_median() -> None:
    r = RunResult(name="x", plan="", wall_s=10.0, tokens=0, tokens_per_step=1, wan_bytes=None,
                  step_times={"lab-a": [0.0, 1.0, 2.0, 12.0, 13.0]})
    assert r.step_s("lab-a") == pytest.approx(13.0 / 4)  # an outage counts in the mean
    assert r.median_step_s("lab-a") == pytest.approx(1.0)  # not in the median
    assert r.step_s("lab-b") == 0.0 and r.median_step_s("lab-b") == 0.0


def test_a_killed_region_that_never_steps_again_stalls_to_the_runs_end() -> None:
    r = RunResult(name="x", plan="", wall_s=100.0, tokens=0, tokens_per_step=1, wan_bytes=None,
                  step_times={"lab-a": [float(t) for t in range(0, 101)], "lab-b": [0.0, 1.0, 2.0, 50.0]},
                  faults=[Fault(kind="coordinator", start=10.0, end=20.0), Fault(kind="region", start=55.0, end=60.0)])
    judge_faults(r, "lab-b")
    assert r.faults[0].stall_s == pytest.approx(30.0)  # lab-b: 20 -> 50 (up to the next fault at 55)
    assert r.faults[1].stall_s == pytest.approx(40.0)  # lab-b restarted at 60, no step by the end at 100
    assert "never stepped" in r.faults[1].note
