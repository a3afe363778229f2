"""The schedule as a pure function, the in-process transport and the norm exchange."""

from __future__ import annotations

import itertools
import threading
from datetime import timedelta

import pytest
import torch

from atoll.node.inprocess import InProcessLinks, even_cuts
from atoll.node.norm_exchange import InProcessNormGroup, LocalNormExchange, NormExchangeError
from atoll.node.schedule import Action, check_depths, max_in_flight, schedule, stage_depths, theoretical_bubble
from atoll.node.transport import TensorKey, TransportError

SHORT = timedelta(milliseconds=100)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(1, 1), (1, 4), (2, 4), (4, 4), (4, 2), (3, 7)])
def test_every_micro_batch_runs_forward_then_backward_once(kind, p, m):
    for s in range(p):
        actions = schedule(kind, stage=s, num_stages=p, micro_batches=m)
        assert sorted(a.micro_batch for a in actions if a.op == "forward") == list(range(m))
        assert sorted(a.micro_batch for a in actions if a.op == "backward") == list(range(m))
        for i in range(m):
            assert actions.index(Action("forward", i)) < actions.index(Action("backward", i))


def test_1f1b_bounds_in_flight_micro_batches_gpipe_does_not():
    p, m = 4, 8
    for s in range(p):
        assert max_in_flight(schedule("1f1b", stage=s, num_stages=p, micro_batches=m)) == p - s
        assert max_in_flight(schedule("gpipe", stage=s, num_stages=p, micro_batches=m)) == m


def test_1f1b_order_on_a_middle_stage():
    got = [(a.op[0], a.micro_batch) for a in schedule("1f1b", stage=1, num_stages=3, micro_batches=4)]
    assert got == [("f", 0), ("f", 1), ("b", 0), ("f", 2), ("b", 1), ("f", 3), ("b", 2), ("b", 3)]


def _simulate(kind: str, p: int, m: int, tf: float = 1.0, tb: float = 2.0) -> float:
    """Run the schedules of all stages against each other with fixed op times; return the makespan."""
    acts = [schedule(kind, stage=s, num_stages=p, micro_batches=m) for s in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    pos, clock = [0] * p, [0.0] * p
    while any(pos[s] < len(acts[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] == len(acts[s]):
                continue
            a = acts[s][pos[s]]
            dep = ("forward", s - 1, a.micro_batch) if a.op == "forward" else ("backward", s + 1, a.micro_batch)
            need = (a.op == "forward" and s > 0) or (a.op == "backward" and s < p - 1)
            if need and dep not in done:
                continue
            start = max(clock[s], done[dep] if need else 0.0)
            clock[s] = start + (tf if a.op == "forward" else tb)
            done[(a.op, s, a.micro_batch)] = clock[s]
            pos[s] += 1
            progressed = True
        assert progressed, "the schedules deadlock"
    return max(clock)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (3, 5)])
def test_schedules_do_not_deadlock_and_match_the_theoretical_bubble(kind, p, m):
    makespan = _simulate(kind, p, m)
    busy = m * 3.0
    assert 1 - busy / makespan == pytest.approx(theoretical_bubble(p, m))


def test_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown schedule"):
        schedule("zigzag", stage=0, num_stages=1, micro_batches=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside a pipeline"):
        schedule("1f1b", stage=2, num_stages=2, micro_batches=1)
    with pytest.raises(ValueError, match="micro_batches"):
        schedule("1f1b", stage=0, num_stages=2, micro_batches=0)


def test_even_cuts():
    assert even_cuts(6, 1) == [0, 6]
    assert even_cuts(6, 2) == [0, 3, 6]
    assert even_cuts(6, 4) == [0, 2, 3, 4, 6]
    with pytest.raises(ValueError):
        even_cuts(3, 4)


def test_in_process_transport_routes_by_direction_and_copies():
    links = InProcessLinks(3)
    t0, t1, t2 = (links.transport(s) for s in range(3))
    x = torch.ones(2)
    t1.send(TensorKey(0, 0, "forward"), x)
    t1.send(TensorKey(0, 0, "backward"), x * 2)
    x.add_(10)  # the receiver holds a copy
    assert torch.equal(t2.recv(TensorKey(0, 0, "forward"), SHORT), torch.ones(2))
    assert torch.equal(t0.recv(TensorKey(0, 0, "backward"), SHORT), torch.full((2,), 2.0))
    assert t0.pending() == t1.pending() == t2.pending() == 0


def test_in_process_transport_errors():
    links = InProcessLinks(2)
    t0, t1 = links.transport(0), links.transport(1)
    with pytest.raises(TransportError, match="no stage downstream"):
        t1.send(TensorKey(0, 0, "forward"), torch.zeros(1))
    with pytest.raises(TransportError, match="no stage upstream"):
        t0.send(TensorKey(0, 0, "backward"), torch.zeros(1))
    with pytest.raises(TransportError, match="did not arrive"):
        t1.recv(TensorKey(0, 0, "forward"), SHORT)
    t0.send(TensorKey(0, 1, "forward"), torch.zeros(1))
    with pytest.raises(TransportError, match="twice"):
        t0.send(TensorKey(0, 1, "forward"), torch.zeros(1))


def test_closing_wakes_a_waiting_receiver():
    links = InProcessLinks(2)
    errors: list[Exception] = []

    def wait() -> None:
        try:
            links.transport(1).recv(TensorKey(0, 0, "forward"), timedelta(seconds=30))
        except TransportError as e:
            errors.append(e)

    th = threading.Thread(target=wait)
    th.start()
    links.close()
    th.join(5)
    assert not th.is_alive() and "closed" in str(errors[0])


def test_norm_exchange_sums_in_rank_order_over_rounds():
    group = InProcessNormGroup(3)
    out: dict[tuple[int, int], float] = {}

    def member(rank: int) -> None:
        ex = group.member(rank)
        for rnd in range(5):
            out[(rank, rnd)] = ex.all_sum(float(rank + 1) * (rnd + 1), timedelta(seconds=10))

    threads = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(out[(r, rnd)] == 6.0 * (rnd + 1) for r in range(3) for rnd in range(5))
    assert LocalNormExchange().all_sum(2.5, SHORT) == 2.5


def test_norm_exchange_times_out_naming_the_missing_stage():
    ex = InProcessNormGroup(2).member(0)
    with pytest.raises(NormExchangeError, match=r"stage\(s\) \[1\]"):
        ex.all_sum(1.0, SHORT)


# --- deep windows --------------------------------------------------------------------------------------------


def _run_blocking(acts: list[list[Action]], tf: float = 1.0, tb: float = 2.0,
                  latency: list[float] | None = None) -> float | None:
    """Every stage runs its actions in order, each blocking until its input has arrived (a forward's
    activation from upstream, a backward's gradient from downstream, `latency[s]` after it left across the
    boundary s -> s + 1); sends never block. Returns the makespan, or None when the stages deadlock."""
    p = len(acts)
    lat = latency or [0.0] * max(0, p - 1)
    done: dict[tuple[str, int, int], float] = {}
    pos, clock = [0] * p, [0.0] * p
    while any(pos[s] < len(acts[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(acts[s]):
                a = acts[s][pos[s]]
                if a.op == "forward":
                    src, ready = ("forward", s - 1, a.micro_batch), (lat[s - 1] if s > 0 else 0.0)
                    need = s > 0
                else:
                    src, ready = ("backward", s + 1, a.micro_batch), (lat[s] if s < p - 1 else 0.0)
                    need = s < p - 1
                if need and src not in done:
                    break
                start = max(clock[s], done[src] + ready if need else 0.0)
                clock[s] = start + (tf if a.op == "forward" else tb)
                done[(a.op, s, a.micro_batch)] = clock[s]
                pos[s] += 1
                progressed = True
        if not progressed:
            return None
    return max(clock)


@pytest.mark.parametrize("p,m,e", [(1, 3, 2), (2, 4, 1), (2, 4, 5), (3, 7, 2), (4, 8, 3), (4, 2, 1)])
def test_a_deep_window_runs_every_micro_batch_once_and_holds_its_depth(p, m, e):
    for s in range(p):
        actions = schedule("1f1b", stage=s, num_stages=p, micro_batches=m, extra_in_flight=e)
        assert sorted(a.micro_batch for a in actions if a.op == "forward") == list(range(m))
        assert [a.micro_batch for a in actions if a.op == "backward"] == list(range(m))
        for i in range(m):
            assert actions.index(Action("forward", i)) < actions.index(Action("backward", i))
        assert max_in_flight(actions) == min(p - s + e, m)
    # depth 0 is strict 1F1B
    assert schedule("1f1b", stage=0, num_stages=p, micro_batches=m, extra_in_flight=0) == \
        schedule("1f1b", stage=0, num_stages=p, micro_batches=m)


def test_deep_window_order_on_the_stage_before_a_slow_link():
    got = [(a.op[0], a.micro_batch)
           for a in schedule("1f1b", stage=0, num_stages=2, micro_batches=5, extra_in_flight=2)]
    assert got == [("f", 0), ("f", 1), ("f", 2), ("f", 3), ("b", 0), ("f", 4), ("b", 1), ("b", 2), ("b", 3), ("b", 4)]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_depths_that_check_never_deadlock_and_those_refused_do(p):
    """Exhaustive over small pipelines: every per-stage depth vector with 0..3 extra per stage and 1..6
    micro-batches. `check_depths` accepts exactly the vectors whose schedules run to completion against
    each other with blocking receives."""
    accepted = 0
    for m in range(1, 7):
        for extras in itertools.product(range(4), repeat=p):
            acts = [schedule("1f1b", stage=s, num_stages=p, micro_batches=m, extra_in_flight=e)
                    for s, e in enumerate(extras)]
            completes = _run_blocking(acts) is not None
            try:
                check_depths("1f1b", extras, m)
                ok = True
            except ValueError as err:
                assert "deadlocks" in str(err)
                ok = False
            assert ok == completes, (p, m, extras)
            accepted += ok
    assert accepted > 0
    if p > 1:  # a downstream stage two deeper than its upstream is refused (and would deadlock)
        with pytest.raises(ValueError, match="warm-up forwards"):
            check_depths("1f1b", [0] * (p - 1) + [2], 8)


def test_stage_depths_accumulate_boundary_depths_upstream():
    assert stage_depths([]) == [0]
    assert stage_depths([2]) == [2, 0]
    assert stage_depths([2, 0, 1]) == [3, 1, 1, 0]
    for bd in itertools.product(range(3), repeat=3):
        check_depths("1f1b", stage_depths(list(bd)), 6)  # never refused
    with pytest.raises(ValueError, match=">= 0"):
        stage_depths([1, -1])
    with pytest.raises(ValueError, match="extra_in_flight"):
        schedule("1f1b", stage=0, num_stages=2, micro_batches=4, extra_in_flight=-1)


def test_gpipe_ignores_the_extra_depth():
    assert schedule("gpipe", stage=0, num_stages=2, micro_batches=4, extra_in_flight=3) == \
        schedule("gpipe", stage=0, num_stages=2, micro_batches=4)


def test_a_deep_window_hides_a_slow_link_strict_1f1b_stalls_on():
    """Two stages, forward 1 and backward 2 per micro-batch, a link whose latency is 4.5 (a round trip of 3
    cycles): strict 1F1B waits out every round trip; a window of ceil(9 / 3) = 3 extra micro-batches keeps
    the stages busy, and the step takes the latency-free step plus one round trip."""
    p, m, lat = 2, 16, [4.5]
    free = _run_blocking([schedule("1f1b", stage=s, num_stages=p, micro_batches=m) for s in range(p)])
    strict = _run_blocking([schedule("1f1b", stage=s, num_stages=p, micro_batches=m) for s in range(p)], latency=lat)
    deep = _run_blocking([schedule("1f1b", stage=s, num_stages=p, micro_batches=m, extra_in_flight=e)
                          for s, e in enumerate(stage_depths([3]))], latency=lat)
    assert free is not None and strict is not None and deep is not None
    assert free == pytest.approx((m + p - 1) * 3.0)
    assert strict == pytest.approx(m * (3.0 + 3.0 + 2 * lat[0]) / 2 + 3.0)  # every loop waits a round trip
    assert deep == pytest.approx(free + 2 * lat[0])
    assert strict / deep > 2.0


def _run_lanes(acts: list[list[list[Action]]], scale: list[float] | None = None) -> float | None:
    """`_run_blocking` with lanes: `acts[s][l]` are the actions of lane l of stage s, each lane an executor of
    its own (forward 1, backward 2, times `scale[s]`); a forward needs the micro-batch's forward done on the
    stage before (whichever lane ran it), a backward its backward on the stage after. Returns the makespan, or
    None on a deadlock."""
    p = len(acts)
    scale = scale or [1.0] * p
    done: dict[tuple[str, int, int], float] = {}
    pos = [[0] * len(lanes) for lanes in acts]
    clock = [[0.0] * len(lanes) for lanes in acts]
    while any(pos[s][x] < len(acts[s][x]) for s in range(p) for x in range(len(acts[s]))):
        progressed = False
        for s in range(p):
            for x, order in enumerate(acts[s]):
                while pos[s][x] < len(order):
                    a = order[pos[s][x]]
                    if a.op == "weight":
                        src, need = None, False
                    elif a.op == "forward":
                        src, need = ("forward", s - 1, a.micro_batch), s > 0
                    else:
                        src, need = ("backward", s + 1, a.micro_batch), s < p - 1
                    if need and src not in done:
                        break
                    start = max(clock[s][x], done[src] if need else 0.0)
                    clock[s][x] = start + scale[s] * (1.0 if a.op == "forward" else 2.0)
                    done[(a.op, s, a.micro_batch)] = clock[s][x]
                    pos[s][x] += 1
                    progressed = True
        if not progressed:
            return None
    return max(max(c) for c in clock)


def _laned_actions(lanes: tuple[int, ...], extras: tuple[int, ...], m: int, defer: int = 0) -> list[list[list[Action]]]:
    from atoll.node.schedule import lane_actions
    from atoll.plan import PipelinePlan, StagePlan
    p = len(lanes)
    pipe = PipelinePlan(micro_batch=8, num_micro_batches=m, stages=[
        StagePlan(island="i", layers=(s, s + 1), dp=x, lanes=x, in_flight=e) for s, (x, e) in enumerate(zip(lanes, extras))])
    out = []
    for s in range(p):
        e = pipe.warmup_extra(s)
        acts = schedule("1f1b", stage=s, num_stages=p, micro_batches=m, extra_in_flight=e, defer_weights=defer)
        out.append([lane_actions(acts, lane=x, lanes=lanes[s]) for x in range(lanes[s])])
    return out


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_laned_stages_never_deadlock(p):
    """Exhaustive over small pipelines: every stage in 1, 2 or 3 lanes, extra depths the plan accepts (a stage at
    most one deeper than the one before, counting the lanes downstream), with and without deferred weight
    gradients, every micro-batch count the lanes divide up to 12: each lane runs its share once, in 1F1B order,
    and the stages run to completion against each other with blocking receives."""
    import math
    runs = 0
    for lanes in itertools.product((1, 2, 3), repeat=p):
        step = math.lcm(*lanes)
        for extras in itertools.product(range(2), repeat=p):
            if any(extras[s + 1] > extras[s] + 1 for s in range(p - 1)):
                continue
            for m in range(step, 13, step):
                for defer in (0, 1):
                    acts = _laned_actions(lanes, extras, m, defer)
                    for s, per_lane in enumerate(acts):
                        got = sorted(a.micro_batch for order in per_lane for a in order if a.op == "backward")
                        assert got == list(range(m))
                        for x, order in enumerate(per_lane):
                            assert all(a.micro_batch % lanes[s] == x for a in order)
                    assert _run_lanes(acts) is not None, (lanes, extras, m, defer)
                    runs += 1
    assert runs > 0


def test_lanes_keep_a_wide_stage_busy():
    """A middle stage of two lanes, each twice as slow as its neighbours, trains about as fast as one executor as
    fast as they are: the upstream keeps one more micro-batch in flight, so both lanes always have one. Without
    that extra depth the lanes take turns."""
    m = 24
    one_fast = _run_lanes(_laned_actions((1, 1, 1), (0, 0, 0), m))
    two_lanes = _run_lanes(_laned_actions((1, 2, 1), (0, 0, 0), m), [1.0, 2.0, 1.0])
    assert one_fast == 3 * m + 2 * 3  # m cycles of F + B, and the fill and drain of two more stages
    assert two_lanes is not None and two_lanes <= one_fast + 3.0  # the lanes' own fill: one F + B longer
    from atoll.node.schedule import lane_actions
    shallow = [[schedule("1f1b", stage=s, num_stages=3, micro_batches=m)] for s in range(3)]
    shallow[1] = [lane_actions(shallow[1][0], lane=x, lanes=2) for x in range(2)]
    slow = _run_lanes(shallow, [1.0, 2.0, 1.0])
    assert slow is not None and slow > two_lanes + m
