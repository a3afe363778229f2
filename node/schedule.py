"""The order in which one pipeline stage runs the forward and backward passes of its micro-batches.

A schedule is a pure function of (kind, stage, number of stages, micro-batches): a list of actions the
stage runtime executes in order, blocking on its transport for inputs. Both kinds below are
deadlock-free with blocking receives as long as sends do not wait for the receiver.

- ``gpipe``: every forward, then every backward (in reverse). Holds all micro-batches in flight.
- ``1f1b``: ``p - s - 1`` warm-up forwards, then alternate one forward and one backward, then drain
  the remaining backwards. Stage ``s`` holds at most ``p - s`` micro-batches in flight.

With uniform stage times both have the bubble (idle) fraction ``(p - 1) / (m + p - 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ScheduleKind = Literal["1f1b", "gpipe"]
SCHEDULES: tuple[ScheduleKind, ...] = ("1f1b", "gpipe")
Op = Literal["forward", "backward"]


@dataclass(frozen=True)
class Action:
    op: Op
    micro_batch: int


def _check(kind: str, stage: int, num_stages: int, micro_batches: int) -> None:
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; use one of {', '.join(SCHEDULES)}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside a pipeline of {num_stages} stages")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")


def schedule(kind: ScheduleKind, *, stage: int, num_stages: int, micro_batches: int) -> list[Action]:
    """The actions of `stage` (0-based) for one training step of `micro_batches` micro-batches."""
    _check(kind, stage, num_stages, micro_batches)
    m = micro_batches
    if kind == "gpipe":
        return [Action("forward", i) for i in range(m)] + [Action("backward", i) for i in reversed(range(m))]
    warmup = min(num_stages - stage - 1, m)
    actions = [Action("forward", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions.append(Action("forward", warmup + i))
        actions.append(Action("backward", i))
    actions.extend(Action("backward", i) for i in range(m - warmup, m))
    return actions


def max_in_flight(actions: list[Action]) -> int:
    """The largest number of micro-batches forwarded but not yet backwarded at once."""
    live = peak = 0
    for a in actions:
        live += 1 if a.op == "forward" else -1
        peak = max(peak, live)
    return peak


def theoretical_bubble(num_stages: int, micro_batches: int) -> float:
    """Idle fraction of every stage of a balanced pipeline: (p - 1) / (m + p - 1)."""
    _check("1f1b", 0, num_stages, micro_batches)
    return (num_stages - 1) / (micro_batches + num_stages - 1)
