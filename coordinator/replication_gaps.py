"""Stages whose checkpoint writer could not write (a full disk), and which node writes them instead.

A node whose checkpoint cannot be written keeps training and reports it (`CheckpointReport.not_written`). The
coordinator records the stage's layers as under-replicated, shows them in the status, and asks a stand-in, another
node that runs exactly those layers in the plan, to write the stage's checkpoints too (`HeartbeatReply.
write_checkpoints`). The gap closes when the writer writes that stage again. A node whose state is sharded (ZeRO,
tp) cannot write a whole stage alone, so it is never chosen. In memory: a restarted coordinator hears of the gap
again at the writer's next checkpoint.

`stand_in` is a pure function of the plan; `ReplicationGaps` keeps the gaps (thread-safe).
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass

from atoll.plan import Plan


def stand_in(plan: Plan | None, writer: str, layers: tuple[int, int], exclude: Collection[str] = ()) -> str | None:
    """The node that writes `layers` in `writer`'s place: the first other node (in plan order) of a stage of exactly
    those layers that holds them whole (no ZeRO, no tp); None when the plan has none."""
    if plan is None:
        return None
    for p in plan.pipelines:
        for st in p.stages:
            if tuple(st.layers) != tuple(layers) or st.tp > 1 or (st.zero and st.dp > 1):
                continue
            for n in st.nodes:
                if n != writer and n not in exclude:
                    return n
    return None


@dataclass(frozen=True)
class Gap:
    layers: tuple[int, int]
    writer: str
    step: int
    reason: str


class ReplicationGaps:
    """The under-replicated stages, by layer range; their stand-ins follow the current plan."""

    def __init__(self) -> None:
        self._gaps: dict[tuple[int, int], Gap] = {}
        self._lock = threading.Lock()

    def not_written(self, writer: str, layers: tuple[int, int], step: int, reason: str) -> bool:
        """Record that `writer` could not write `layers` at `step`; True when the gap is new."""
        with self._lock:
            new = layers not in self._gaps
            self._gaps[layers] = Gap(layers=layers, writer=writer, step=step, reason=reason)
            return new

    def written(self, node: str, layers: tuple[int, int]) -> Gap | None:
        """`node` wrote `layers`: the gap closes when it is the writer that could not (its disk has room again);
        return the gap closed."""
        with self._lock:
            gap = self._gaps.get(layers)
            if gap is None or gap.writer != node:
                return None
            return self._gaps.pop(layers)

    def stand_ins(self, plan: Plan | None) -> set[str]:
        """The nodes asked to write in a writer's place under `plan`."""
        with self._lock:
            gaps = list(self._gaps.values())
        return {n for g in gaps if (n := stand_in(plan, g.writer, g.layers)) is not None}

    def lines(self, plan: Plan | None) -> list[str]:
        """The status's words for each gap."""
        with self._lock:
            gaps = sorted(self._gaps.values(), key=lambda g: g.layers)
        out = []
        for g in gaps:
            who = stand_in(plan, g.writer, g.layers)
            out.append(f"layers [{g.layers[0]}, {g.layers[1]}): {g.writer} could not write the checkpoint of step "
                       f"{g.step} ({g.reason}); " + (f"{who} writes them instead" if who else
                                                     "no other node of the plan holds them whole to write them"))
        return out
