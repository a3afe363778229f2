"""The schedule as a pure function, the in-process transport and the norm exchange."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from atoll.node.inprocess import InProcessLinks, even_cuts
from atoll.node.norm_exchange import InProcessNormGroup, LocalNormExchange, NormExchangeError
from atoll.node.schedule import Action, max_in_flight, schedule, theoretical_bubble
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
