"""Outer rounds by wall-clock time (`atoll.coordinator.pace`): each replica group's inner steps a round follow its
live step time, with hysteresis, and the outer deadline follows the live round."""

from __future__ import annotations

import pytest

from atoll.coordinator.pace import (GroupPace, PaceOptions, PaceState, RoundPace, estimate, outer_deadline,
                                    round_steps, shift, step_time)

OPTS = PaceOptions()


def _paces(seconds: list[float], steps: int, first_round: int = 0, unix: float = 100.0) -> tuple[RoundPace, ...]:
    return tuple(RoundPace(round=first_round + k, seconds=s, steps=steps, unix=unix) for k, s in enumerate(seconds))


def _group(name: str, steps: int, seconds: list[float], per_round: int | None = None) -> GroupPace:
    return GroupPace(name=name, since_epoch=1, steps=steps, paces=_paces(seconds, per_round or steps))


def test_uneven_groups_get_steps_in_proportion_to_their_speed() -> None:
    """Three regions planned alike from their profiles (H=20 each) measure 0.1, 0.2 and 0.5 s a step: rounds of
    20 x 0.1 s, and the others train the steps that fit, 10 and 4 (the fastest no longer waits 8 s a round)."""
    state = PaceState(h=20, groups=(_group("a", 20, [0.1, 0.1]), _group("b", 20, [0.2, 0.2]),
                                    _group("c", 20, [0.5, 0.5])))
    d = round_steps(120.0, state, OPTS)
    assert [g.steps for g in d.groups] == [20, 10, 4], d.reason
    assert d.target_s == pytest.approx(2.0) and d.round_s == pytest.approx(2.0)
    assert set(d.changed) == {"b", "c"} and "b 20 -> 10" in d.reason
    assert [g.step_s for g in d.groups] == pytest.approx([0.1, 0.2, 0.5])
    # a group far slower than the round still trains one step (it cannot train less)
    d = round_steps(120.0, PaceState(h=4, groups=(_group("a", 4, [0.1]), _group("z", 4, [1.0]))), OPTS)
    assert [g.steps for g in d.groups] == [4, 1] and d.round_s == pytest.approx(1.0)
    # the steps that fit, not the nearest: 1.67 steps of b fit a round of 5 x 0.1 s, so 1 (with 2 its rounds would
    # run 20% over, and every other group would wait that long every round); the fastest trains H
    d = round_steps(120.0, PaceState(h=5, groups=(_group("a", 2, [0.1]), _group("b", 5, [0.3]))), OPTS)
    assert [g.steps for g in d.groups] == [5, 1], d.reason


def test_hysteresis_keeps_steps_that_are_near_enough() -> None:
    """Steps that fit but are short of the ideal by at most 10% stay; short by more they grow to what fits; steps
    that run over the round shrink at once, past a 2% tolerance; noise around a boundary does not flap them; a group
    within the tolerance of the fastest trains H. (Figures taken as exact here: `prior_noise` 0.)"""
    opts = PaceOptions(prior_noise=0.0)
    near = PaceState(h=50, groups=(_group("a", 50, [0.1]), _group("b", 46, [0.105])))  # 47.6 fit: short 3%
    assert [g.steps for g in round_steps(120.0, near, opts).groups] == [50, 46]
    far = PaceState(h=50, groups=(_group("a", 50, [0.1]), _group("b", 40, [0.105])))  # short 16%
    assert [g.steps for g in round_steps(120.0, far, opts).groups] == [50, 47]
    over = PaceState(h=50, groups=(_group("a", 50, [0.1]), _group("b", 49, [0.105])))  # over by 3%
    assert [g.steps for g in round_steps(120.0, over, opts).groups] == [50, 47]
    # a group of about 3 steps a round whose time moves by a few percent (2.9-3.03 steps fit)
    steps = 3
    for s in (0.33, 0.34, 0.335, 0.345, 0.33):
        state = PaceState(h=10, groups=(_group("a", 10, [0.1]), _group("b", steps, [s])))
        steps = round_steps(120.0, state, opts).groups[1].steps
        assert steps == 3, s
    # ... and one of 8-9 (8.3-8.6 fit): it stays at 8, not back and forth, until it no longer fits; within 2% of
    # the fastest it trains H
    steps = 10
    for s, want in ((0.12, 8), (0.116, 8), (0.118, 8), (0.12, 8), (0.13, 7), (0.101, 10), (0.1, 10)):
        state = PaceState(h=10, groups=(_group("a", 10, [0.1]), _group("b", steps, [s])))
        steps = round_steps(120.0, state, opts).groups[1].steps
        assert steps == want, (s, steps)
    # no hysteresis: every change is taken
    assert round_steps(120.0, near, PaceOptions(hysteresis=0.0, prior_noise=0.0)).groups[1].steps == 47
    # a single figure is taken as 5% noisy (prior_noise): b 5% slower than a cannot be told apart from it
    assert [g.steps for g in round_steps(120.0, near, OPTS).groups] == [50, 50]


def test_a_group_that_slows_down_gets_fewer_steps_within_one_round() -> None:
    """b trained 10 steps a round at 0.1 s for rounds 0-5, then 0.3 s in round 6 (a co-tenant came): the next
    decision gives it 3 steps (rounds of 10 x 0.1 s), from its newest round alone (3x beyond every round before)."""
    a = _group("a", 10, [0.1] * 7)
    b = GroupPace(name="b", since_epoch=1, steps=10, paces=_paces([0.1] * 6 + [0.3], 10)[-OPTS.window_rounds:])
    d = round_steps(120.0, PaceState(h=10, groups=(a, b)), OPTS)
    assert [g.steps for g in d.groups] == [10, 3], d.reason
    # it stays slow: measured from its slow rounds while the fast ones still fill most of its window
    for slow in (2, 3, 4):
        paces = _paces([0.1] * 6 + [0.3] * slow, 3)[-OPTS.window_rounds:]
        b = GroupPace(name="b", since_epoch=1, steps=3, paces=paces)
        assert round_steps(120.0, PaceState(h=10, groups=(a, b)), OPTS).groups[1].steps == 3, slow
    # ... and back when it recovers (the co-tenant left after one round, or after five)
    for slow in (1, 5):
        paces = _paces([0.1] * 2 + [0.3] * slow + [0.1], 3)[-OPTS.window_rounds:]
        b = GroupPace(name="b", since_epoch=1, steps=3, paces=paces)
        assert round_steps(120.0, PaceState(h=10, groups=(a, b)), OPTS).groups[1].steps == 10, slow
    # a group of 1 step a round is measured over its newest rounds until they cover min_steps steps
    paces = _paces([0.9, 0.5, 0.5], 1)
    assert step_time(120.0, paces, OPTS) == pytest.approx(0.5)
    assert step_time(120.0, paces[:1], OPTS) == pytest.approx(0.9)


def test_equal_groups_keep_their_steps_through_a_cpu_quotas_noise() -> None:
    """Two equal groups under CPU quotas whose per-round figures swing by 40-80% (measured on bench.regions'
    testbed: 0.106-0.20 s a step in one run, each group's in turn the slower): neither is cut from H, where the
    newest round alone cut each to 7-8 of its 10 steps in turn. A group 30% slower through the same noise still is
    cut once its figures show it, and a shift of 30% in two rounds is seen."""
    noisy_a = [0.106, 0.151, 0.111, 0.129, 0.144, 0.118, 0.168, 0.125]
    noisy_b = [0.151, 0.107, 0.160, 0.118, 0.125, 0.179, 0.113, 0.140]
    for n in range(1, len(noisy_a) + 1):
        for a_s, b_s in ((noisy_a, noisy_b), (noisy_b, noisy_a)):
            state = PaceState(h=10, groups=(_group("a", 10, a_s[:n]), _group("b", 10, b_s[:n])))
            d = round_steps(120.0, state, OPTS)
            if n >= 3:  # (from one or two figures no noise is known: the steps follow them)
                assert [g.steps for g in d.groups] == [10, 10], (n, d.reason)
    slower = [1.3 * s for s in noisy_b]
    d = round_steps(120.0, PaceState(h=10, groups=(_group("a", 10, noisy_a), _group("b", 10, slower))), OPTS)
    assert [g.steps for g in d.groups] == [10, 7], d.reason
    shifted = _paces([0.1] * 6 + [0.13, 0.131], 10)
    est = estimate(120.0, shifted, OPTS)
    assert est is not None and est.seconds == pytest.approx(0.1305) and est.rounds == 2
    assert shift([0.131, 0.13] + [0.1] * 6) == 2 and shift([0.106, 0.151, 0.111, 0.129]) == 0


def test_without_live_figures_the_steps_stay_and_old_figures_expire() -> None:
    state = PaceState(h=10, groups=(_group("a", 10, []), _group("b", 7, [])))
    d = round_steps(120.0, state, OPTS)
    assert [g.steps for g in d.groups] == [10, 7] and d.target_s == 0 and "no live" in d.reason
    # one group measured: it sets the round; the other keeps its steps until it is measured
    state = PaceState(h=10, groups=(_group("a", 10, [0.2]), _group("b", 7, [])))
    d = round_steps(120.0, state, OPTS)
    assert [g.steps for g in d.groups] == [10, 7] and "no live figure yet for b" in d.reason
    # figures older than max_age_s count no more
    assert step_time(100.0 + OPTS.max_age_s + 1, _paces([0.2], 10), OPTS) is None


def test_the_outer_deadline_follows_the_live_round() -> None:
    assert outer_deadline(30.0, 4.0, OPTS) == 30.0  # the plan's figure is the least
    assert outer_deadline(30.0, 40.0, OPTS) == 80.0  # rounds longer than planned: two of them
    with pytest.raises(ValueError, match="hysteresis"):
        PaceOptions(hysteresis=1.5)
