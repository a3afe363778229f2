"""The event-driven 1F1B simulator against closed forms."""

from __future__ import annotations

import pytest

from atoll.coordinator.planner.simulator import (LinkTimes, PipelineTimes, StageTimes, closed_form_step,
                                                 one_f_one_b_order, simulate, step_lower_bound)


def _uniform(p: int, m: int, f: float, b: float, link: float = 0.0, sync: float = 0.0) -> PipelineTimes:
    return PipelineTimes(stages=tuple(StageTimes(forward_s=f, backward_s=b, sync_s=sync) for _ in range(p)),
                         links=tuple(LinkTimes(forward_s=link, backward_s=link) for _ in range(p - 1)),
                         num_micro_batches=m)


@pytest.mark.parametrize("p,m", [(1, 1), (1, 7), (2, 1), (2, 4), (4, 4), (4, 16), (8, 3), (5, 32)])
def test_homogeneous_matches_closed_form(p: int, m: int) -> None:
    f, b = 0.3, 0.6
    r = simulate(_uniform(p, m, f, b))
    assert r.step_time_s == pytest.approx((m + p - 1) * (f + b))
    assert closed_form_step(_uniform(p, m, f, b)) == pytest.approx((m + p - 1) * (f + b))
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_all_reduce_and_optimizer_follow_the_last_backward() -> None:
    t = PipelineTimes(stages=(StageTimes(forward_s=1, backward_s=2, sync_s=5, optimizer_s=1),
                              StageTimes(forward_s=1, backward_s=2, sync_s=0.5)),
                      links=(LinkTimes(forward_s=0, backward_s=0),), num_micro_batches=2)
    r = simulate(t)
    assert r.pipeline_time_s == pytest.approx(3 * 3)
    assert r.step_time_s == pytest.approx(9 + 5 + 1)  # stage 0 finishes last and syncs longest


def test_links_add_to_fill_and_a_slow_link_becomes_the_cycle() -> None:
    # one micro-batch: F0, send, F1, B1, send back, B0
    r = simulate(_uniform(2, 1, 1.0, 2.0, link=0.5))
    assert r.step_time_s == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)
    # a link slower than compute paces the steady state: m transfers back to back
    slow = simulate(_uniform(2, 20, 0.1, 0.2, link=1.0))
    assert slow.step_time_s >= 20 * 1.0
    # the closed form ranks candidates; with links pacing, 1F1B's coupling of directions costs more
    assert slow.step_time_s >= closed_form_step(_uniform(2, 20, 0.1, 0.2, link=1.0)) - 1e-9


def test_slowest_stage_sets_the_pace() -> None:
    t = PipelineTimes(stages=(StageTimes(forward_s=0.1, backward_s=0.2), StageTimes(forward_s=1, backward_s=2),
                              StageTimes(forward_s=0.1, backward_s=0.2)),
                      links=(LinkTimes(forward_s=0, backward_s=0),) * 2, num_micro_batches=10)
    r = simulate(t, record=True)
    assert r.step_time_s >= 10 * 3.0
    assert r.step_time_s == pytest.approx(closed_form_step(t), rel=0.05)
    fb = [e for e in r.events if e.kind in "FB"]
    assert len(fb) == 2 * 3 * 10
    for s in range(3):  # a stage never runs two operations at once
        mine = sorted((e.start, e.end) for e in fb if e.stage == s)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(mine, mine[1:]))


def test_order_is_one_f_one_b() -> None:
    assert one_f_one_b_order(0, 3, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2),
                                          ("B", 3)]
    assert one_f_one_b_order(2, 3, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="links"):
        PipelineTimes(stages=(StageTimes(forward_s=1, backward_s=1),) * 2, links=(), num_micro_batches=1)
    with pytest.raises(ValueError, match="num_micro_batches"):
        _uniform(1, 0, 1, 1)


def test_lower_bound_never_exceeds_the_simulation() -> None:
    import random

    rng = random.Random(7)
    for _ in range(300):
        p, m = rng.randint(1, 6), rng.randint(1, 12)
        t = PipelineTimes(
            stages=tuple(StageTimes(forward_s=rng.uniform(0.01, 1), backward_s=rng.uniform(0.01, 2),
                                    sync_s=rng.uniform(0, 2), optimizer_s=rng.uniform(0, 0.5)) for _ in range(p)),
            links=tuple(LinkTimes(forward_s=rng.uniform(0, 0.5), backward_s=rng.uniform(0, 0.5)) for _ in range(p - 1)),
            num_micro_batches=m)
        assert step_lower_bound(t) <= simulate(t).step_time_s + 1e-9
    # exact on equal stages with free links
    assert step_lower_bound(_uniform(4, 16, 0.3, 0.6)) == pytest.approx((16 + 4 - 1) * 0.9)


def test_a_sync_hidden_under_the_last_backward_leaves_only_its_exposed_part_on_the_step() -> None:
    """A stage's gradient sync that overlaps its last backward (`sync_hidden_s`, ZeRO-1's reduce-scatter) adds only
    the rest after the last backward; the closed form and the lower bound count the same."""
    from atoll.coordinator.planner.simulator import closed_form_step, step_lower_bound
    serial = PipelineTimes(stages=(StageTimes(forward_s=1.0, backward_s=2.0, sync_s=1.0, optimizer_s=0.5),),
                           links=(), num_micro_batches=4)
    hidden = PipelineTimes(stages=(StageTimes(forward_s=1.0, backward_s=2.0, sync_s=1.0, sync_hidden_s=0.4,
                                              optimizer_s=0.5),), links=(), num_micro_batches=4)
    assert simulate(serial).step_time_s == pytest.approx(12 + 1.5)
    assert simulate(hidden).step_time_s == pytest.approx(12 + 0.6 + 0.5)
    assert closed_form_step(hidden) == pytest.approx(simulate(hidden).step_time_s)
    assert step_lower_bound(hidden) <= simulate(hidden).step_time_s + 1e-9
    with pytest.raises(ValueError, match="sync_hidden_s"):
        StageTimes(forward_s=1.0, backward_s=2.0, sync_s=1.0, sync_hidden_s=1.5)


def test_only_a_zero_1_stage_without_tp_hides_part_of_its_sync() -> None:
    """The cost model hides half the all-reduce (the reduce-scatter) but the last bucket's share, at most the
    window, and only for ZeRO-1 at tp 1 with replicas."""
    from atoll.coordinator.planner import TrainSpec
    from atoll.coordinator.planner.costmodel import ZERO1_BUCKET_BYTES, CostModel
    from atoll.models import preset_spec
    cm = CostModel(preset_spec("tiny"), TrainSpec(global_batch=8, seq_len=32))
    params = int(4 * ZERO1_BUCKET_BYTES / cm.grad_bytes_per_param)  # four buckets
    assert cm.sync_hidden_seconds(1.0, params, zero=1, dp=4, tp=1, window_s=10.0) == pytest.approx(0.5 * 0.75)
    assert cm.sync_hidden_seconds(1.0, params, zero=1, dp=4, tp=1, window_s=0.1) == pytest.approx(0.1)
    for zero, dp, tp in ((0, 4, 1), (2, 4, 1), (1, 4, 2), (1, 1, 1)):
        assert cm.sync_hidden_seconds(1.0, params, zero=zero, dp=dp, tp=tp, window_s=10.0) == 0.0


def _laned(lanes: tuple[int, ...], scale: tuple[float, ...], m: int, **kw) -> PipelineTimes:
    return PipelineTimes(stages=tuple(StageTimes(forward_s=1.0 * x, backward_s=2.0 * x, lanes=k, **kw)
                                      for k, x in zip(lanes, scale)),
                         links=tuple(LinkTimes(forward_s=0.0, backward_s=0.0) for _ in lanes[1:]), num_micro_batches=m)


def test_lanes_run_as_fast_as_one_stage_that_many_times_faster() -> None:
    """A stage of L lanes, each L times slower than its neighbours, keeps pace with them: the step is the
    balanced pipeline's plus the lanes' longer fill (their own micro-batch takes L times as long), the figures
    the node's schedules give (tests/test_pipeline_schedule.py runs the same schedules as blocking executors)."""
    m = 24
    base = simulate(_laned((1, 1, 1), (1, 1, 1), m)).step_time_s
    assert base == pytest.approx(3 * m + 2 * 3)
    assert simulate(_laned((1, 2, 1), (1, 2, 1), m)).step_time_s == pytest.approx(base + 3)
    assert simulate(_laned((1, 3, 1), (1, 3, 1), m)).step_time_s == pytest.approx(base + 6)
    # a laned first and last stage
    assert simulate(_laned((2, 1, 2), (2, 1, 2), m)).step_time_s <= base + 2 * 3 + 1e-9
    # each lane runs every L-th micro-batch, its share of the stage's order
    ev = simulate(_laned((1, 2), (1, 2), 4), record=True).events
    assert sorted((e.lane, e.micro_batch) for e in ev if e.stage == 1 and e.kind == "F") == \
        [(0, 0), (0, 2), (1, 1), (1, 3)]
    # the stage's busy share: its lanes' mean
    r = simulate(_laned((1, 2, 1), (1, 2, 1), m))
    assert r.busy_s[1] == pytest.approx(r.busy_s[0])


def test_with_lanes_the_bounds_hold_and_the_closed_form_stays_close() -> None:
    import random

    rng = random.Random(11)
    for _ in range(300):
        p = rng.randint(1, 5)
        lanes = tuple(rng.choice((1, 1, 2, 3)) for _ in range(p))
        unit = 6  # lcm of the lane counts
        m = unit * rng.randint(1, 3)
        t = PipelineTimes(
            stages=tuple(StageTimes(forward_s=rng.uniform(0.05, 1) * k, backward_s=rng.uniform(0.05, 2) * k,
                                    sync_s=rng.uniform(0, 1), optimizer_s=rng.uniform(0, 0.3), lanes=k)
                         for k in lanes),
            links=tuple(LinkTimes(forward_s=rng.uniform(0, 0.3), backward_s=rng.uniform(0, 0.3)) for _ in range(p - 1)),
            num_micro_batches=m, defer=tuple(rng.randint(0, 2) for _ in range(p)))
        got = simulate(t).step_time_s
        assert step_lower_bound(t) <= got + 1e-9
        assert 0.5 * got <= closed_form_step(t) <= 2.0 * got
