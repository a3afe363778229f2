"""The order in which one pipeline stage runs the forward and backward passes of its micro-batches.

A schedule is a pure function of (kind, stage, number of stages, micro-batches, extra in-flight depth): a
list of actions the stage runtime executes in order, blocking on its transport for inputs. Sends never
wait for the receiver (the transport buffers them).

- ``gpipe``: every forward, then every backward (in reverse). Holds all micro-batches in flight.
- ``1f1b``: ``w`` warm-up forwards, then alternate one forward and one backward, then drain the remaining
  backwards; stage ``s`` holds at most ``w + 1`` micro-batches in flight. Strict 1F1B has
  ``w = p - s - 1``; a *deep window* adds ``extra_in_flight = e_s`` to it (``w = min(p - s - 1 + e_s, m)``).

Deep windows, for slow or distant links. Across the boundary from stage ``s`` to ``s + 1`` strict 1F1B keeps
one micro-batch more in flight upstream than downstream, so stage ``s`` can run one forward and one backward
while a micro-batch crosses the link, is processed downstream and its gradient comes back: a round trip
longer than that stalls every micro-batch. With ``d`` micro-batches of extra depth at the boundary stage
``s`` runs ``d`` more cycles of its own work in that time, so a boundary whose round trip (latency both ways
plus transfers) is ``RTT`` needs ``d = ceil(RTT / cycle)``. The extra forwards' activations wait in the
downstream's receive buffer until it takes them, so the upstream's extra warm-up is what the downstream
absorbs; the upstream holds ``d`` more micro-batches' activations for backward. Depths accumulate upstream:
``stage_depths`` turns per-boundary depths ``d_t`` into per-stage extras ``e_s = sum(d_t for t >= s)``, which
keeps every boundary's window at ``1 + d_s``.

Deadlock freedom (with blocking receives and non-blocking sends). Write ``F_k < B_j`` at a stage when it runs
the forward of micro-batch ``k`` before the backward of ``j``; for ``1f1b`` with warm-up ``w`` that holds
iff ``k <= w + j``, for ``gpipe`` always. *Claim*: if for every pair of neighbours every ``F_k < B_j`` of the
downstream also holds upstream (for ``1f1b``: warm-ups never grow downstream, ``w_s >= w_{s+1}``, which
``check_depths`` checks), the stages' schedules run to completion. *Proof*: suppose instead every unfinished
stage waits on a receive. (a) Let stage ``s`` wait for the gradient of ``B_j`` from ``s + 1``, so stage
``s + 1`` has not run ``B_j``. If ``s + 1`` were waiting on a forward ``F_k``, then ``F_k < B_j`` at
``s + 1`` while stage ``s``, which reached ``B_j``, has not run ``F_k``: ``B_j < F_k`` at ``s``, against the
hypothesis. So ``s + 1`` also waits on a backward; by induction so does the last stage, which never receives
a gradient: a contradiction. (b) Let stage ``s`` wait for the activation of ``F_j`` from ``s - 1``, so
``s - 1`` has not run ``F_j``. If ``s - 1`` were waiting on a backward ``B_k``, then ``B_k < F_j`` at
``s - 1`` while ``s``, which reached ``F_j`` without running ``B_k``, has ``F_j < B_k``: again against the
hypothesis. So ``s - 1`` waits on a forward; by induction so does stage 0, which never receives an
activation: a contradiction. Hence no stage waits forever. tests/test_pipeline_schedule.py also checks it
exhaustively for small ``p``, ``m`` and depths with a simulator of blocking receives.

With uniform stage times and free links, strict 1F1B and gpipe both have the bubble (idle) fraction
``(p - 1) / (m + p - 1)``.

Deferred weight gradients (zero-bubble, ``defer_weights = k >= 1``). A backward action then computes only the
gradients of its input (and of what is cheap: biases, norms, embeddings), what the upstream stage waits for; the
weight-gradient products of its linear layers (`atoll.node.wgrad`) become a ``weight`` action of their own,
placed after the backward ``k`` micro-batches later (``W_j`` right after ``B_{j+k}``; the last ``k + 1`` after
the last backward). A weight action needs nothing from a neighbour, so the proof above holds unchanged: the order of
forwards and backwards is 1F1B's. With ``k_s = s + 1`` (`zero_bubble_depths`) every stage's backward chain is
its input-gradient half alone, and a balanced pipeline's step takes ``m (F + B + W) + (p - 1) (F + B - W)``
against 1F1B's ``(m + p - 1) (F + B + W)``, the zero-bubble schedule ZB-H1's bound (Qi et al., *Zero Bubble
Pipeline Parallelism*, ICLR 2024) at 1F1B's in-flight activations; stage ``s`` holds the deferred products
(each layer's input and output gradient) of ``k_s`` micro-batches besides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

ScheduleKind = Literal["1f1b", "gpipe"]
SCHEDULES: tuple[ScheduleKind, ...] = ("1f1b", "gpipe")
Op = Literal["forward", "backward", "weight"]


@dataclass(frozen=True)
class Action:
    op: Op
    micro_batch: int


def _check(kind: str, stage: int, num_stages: int, micro_batches: int, extra_in_flight: int = 0,
           defer_weights: int = 0) -> None:
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; use one of {', '.join(SCHEDULES)}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside a pipeline of {num_stages} stages")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
    if extra_in_flight < 0:
        raise ValueError(f"extra_in_flight must be >= 0 (extra micro-batches in flight), got {extra_in_flight}")
    if defer_weights < 0:
        raise ValueError(f"defer_weights must be >= 0 (micro-batches whose weight gradients wait), got {defer_weights}")


def warmup_forwards(kind: ScheduleKind, *, stage: int, num_stages: int, micro_batches: int,
                    extra_in_flight: int = 0) -> int:
    """Forwards `stage` runs before its first backward: ``min(p - s - 1 + extra_in_flight, m)`` for 1F1B."""
    _check(kind, stage, num_stages, micro_batches, extra_in_flight)
    if kind == "gpipe":
        return micro_batches
    return min(num_stages - stage - 1 + extra_in_flight, micro_batches)


def schedule(kind: ScheduleKind, *, stage: int, num_stages: int, micro_batches: int,
             extra_in_flight: int = 0, defer_weights: int = 0) -> list[Action]:
    """The actions of `stage` (0-based) for one training step of `micro_batches` micro-batches.

    `extra_in_flight` deepens a 1F1B stage's window by that many micro-batches (more warm-up forwards,
    bounded by `micro_batches`); the stages of one pipeline must pass `check_depths`. gpipe ignores it (it
    already holds every micro-batch). `defer_weights` k >= 1 splits each backward: a ``weight`` action for
    micro-batch j follows the backward of micro-batch j + k (the module docstring); 0 keeps them whole.
    """
    _check(kind, stage, num_stages, micro_batches, extra_in_flight, defer_weights)
    m = micro_batches
    warmup = warmup_forwards(kind, stage=stage, num_stages=num_stages, micro_batches=m,
                             extra_in_flight=extra_in_flight)
    if kind == "gpipe":
        order = [Action("forward", i) for i in range(m)] + [Action("backward", i) for i in reversed(range(m))]
    else:
        order = [Action("forward", i) for i in range(warmup)]
        for i in range(m - warmup):
            order.append(Action("forward", warmup + i))
            order.append(Action("backward", i))
        order.extend(Action("backward", i) for i in range(m - warmup, m))
    if not defer_weights:
        return order
    actions: list[Action] = []
    waiting: list[int] = []
    for a in order:
        actions.append(a)
        if a.op == "backward":
            waiting.append(a.micro_batch)
            if len(waiting) > defer_weights:
                actions.append(Action("weight", waiting.pop(0)))
    actions.extend(Action("weight", i) for i in waiting)
    return actions


def zero_bubble_depths(num_stages: int) -> list[int]:
    """`defer_weights` per stage for the zero-bubble schedule: stage s holds back s + 1 micro-batches' weight
    gradients (the depth at which a balanced pipeline reaches ZB-H1's bound, the module docstring)."""
    return [s + 1 for s in range(num_stages)]


def stage_depths(boundary_depths: Sequence[int]) -> list[int]:
    """Per-stage extra in-flight micro-batches from the extra depth of each boundary.

    `boundary_depths[t]` is the depth the link from stage t to t + 1 needs; stage s gets the sum over the
    boundaries at and after it (the last stage 0), so every boundary's window is 1 + its depth.
    """
    if any(d < 0 for d in boundary_depths):
        raise ValueError(f"boundary depths must be >= 0, got {list(boundary_depths)}")
    out = [0]
    for d in reversed(boundary_depths):
        out.append(out[-1] + d)
    return out[::-1]


def check_depths(kind: ScheduleKind, extra_in_flight: Sequence[int], micro_batches: int) -> None:
    """Raise ValueError unless the stages' depths run together without deadlock (the module docstring's
    condition: no stage's warm-up exceeds its upstream's)."""
    p = len(extra_in_flight)
    # m - 1 warm-up forwards give the same order as m (the last forward comes first in the steady phase)
    w = [min(warmup_forwards(kind, stage=s, num_stages=p, micro_batches=micro_batches, extra_in_flight=e),
             micro_batches - 1) for s, e in enumerate(extra_in_flight)]
    for s in range(1, p):
        if w[s] > w[s - 1]:
            raise ValueError(
                f"stage {s} would run {w[s]} warm-up forwards but its upstream stage {s - 1} only {w[s - 1]}, "
                f"which deadlocks: a stage may keep at most one extra micro-batch in flight more than its "
                f"upstream (extra_in_flight {list(extra_in_flight)}); raise stage {s - 1}'s or lower stage {s}'s")


def lane_actions(actions: list[Action], *, lane: int, lanes: int) -> list[Action]:
    """A laned stage's replica's actions (`atoll.plan`: micro-batch i is trained by lane i % lanes): the stage's
    schedule restricted to its lane's micro-batches, in the same order.

    Deadlock freedom carries over. Suppose every unfinished lane waits on a receive, and let a_s be the first
    action of stage s's order (the stage's, not a lane's) that is not done. Every action before it is done, so it
    is the next action of its own lane, which waits on it (a weight action waits on nothing, so a_s is a forward
    or a backward). The proof in the module docstring then goes through
    with a_s in place of "the action stage s waits on": (a) if a_s = B_j, stage s + 1 has not run B_j, so
    a_{s+1} comes before B_j in its order; were it F_k, then F_k < B_j at s + 1, hence at s, so F_k is done at
    s and a_{s+1} could run: a_{s+1} is a backward too, and so on to the last stage, whose backwards wait on no
    one. (b) if a_s = F_k, symmetrically down to stage 0. tests/test_pipeline_schedule.py also runs every
    pipeline of 1-4 stages of 1-3 lanes each (deep windows 0-1, with and without deferred weight gradients, up
    to 12 micro-batches) against each other with blocking receives. A laned stage and those before it open more
    forwards (`PipelinePlan.warmup_extra`), so every lane has work."""
    if lanes < 1 or not 0 <= lane < lanes:
        raise ValueError(f"lane must be in [0, lanes) with lanes >= 1, got lane {lane} of {lanes}")
    return [a for a in actions if a.micro_batch % lanes == lane]


def max_in_flight(actions: list[Action]) -> int:
    """The largest number of micro-batches forwarded but not yet backwarded at once."""
    live = peak = 0
    for a in actions:
        if a.op == "weight":
            continue
        live += 1 if a.op == "forward" else -1
        peak = max(peak, live)
    return peak


def max_deferred(actions: list[Action]) -> int:
    """The largest number of micro-batches whose weight gradients wait at once (after a backward, before its
    weight action)."""
    if not any(a.op == "weight" for a in actions):
        return 0
    live = peak = 0
    for a in actions:
        if a.op == "backward":
            live += 1
        elif a.op == "weight":
            live -= 1
        peak = max(peak, live)
    return peak


def theoretical_bubble(num_stages: int, micro_batches: int) -> float:
    """Idle fraction of every stage of a balanced pipeline: (p - 1) / (m + p - 1)."""
    _check("1f1b", 0, num_stages, micro_batches)
    return (num_stages - 1) / (micro_batches + num_stages - 1)
