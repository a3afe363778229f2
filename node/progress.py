"""A node's progress line: where training stands, in its log every so often, so a person tailing a node's log sees
it move (the job's whole progress is `atoll status`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from atoll.types import StepMetrics

log = logging.getLogger("atoll.node.runner")

PROGRESS_EVERY_S = 30.0
"""Seconds between two progress lines of a node (the first step of each run is logged at once)."""


class ProgressLine:
    """Logs "step N (N + 1 of M done)" with the step time (and the loss, on the node that reports it) on a run's first step and
    then at most every `every_s` seconds, with the mean step time since the line before."""

    def __init__(self, total: int, *, every_s: float = PROGRESS_EVERY_S, clock: Callable[[], float] = time.monotonic,
                 emit: Callable[[str], None] | None = None):
        self.total, self.every_s, self.clock = total, every_s, clock
        self.emit = emit or (lambda line: log.info("%s", line))
        self._last: float | None = None
        self._steps = 0
        self._seconds = 0.0

    def step(self, m: StepMetrics) -> str | None:
        """Count the step `m` reports; the line logged now, if one is due."""
        self._steps += 1
        self._seconds += m.step_seconds
        now = self.clock()
        if self._last is not None and now - self._last < self.every_s:
            return None
        mean = self._seconds / max(1, self._steps)
        line = (f"step {m.step} ({m.step + 1} of {self.total} done; plan epoch {m.plan_epoch}, pipeline {m.pipeline} "
                f"stage {m.stage}): {mean:.3g} s/step")
        if m.tokens and mean > 0:
            line += f", {m.tokens / mean:,.0f} tokens/s here"
        if m.loss is not None:
            line += f", loss {m.loss:.4f}"
        self._last, self._steps, self._seconds = now, 0, 0.0
        self.emit(line)
        return line
