"""Training progress from step reports: the latest step and the recent throughput."""

from __future__ import annotations

from collections.abc import Iterable

from atoll.types import StepMetrics


def throughput(reports: Iterable[StepMetrics], epoch: int, window: int = 5) -> tuple[int, float]:
    """(latest step reported, tokens per second over the last `window` steps of `epoch`).

    A step's tokens are those reported with a loss (by last stages, once per micro-batch set); its time is
    the longest step time any node of that step reported.
    """
    latest = 0
    tokens: dict[int, int] = {}
    seconds: dict[int, float] = {}
    for r in reports:
        latest = max(latest, r.step)
        if r.plan_epoch != epoch:
            continue
        if r.loss is not None:
            tokens[r.step] = tokens.get(r.step, 0) + r.tokens
        seconds[r.step] = max(seconds.get(r.step, 0.0), r.step_seconds)
    steps = sorted(s for s in tokens if seconds.get(s, 0.0) > 0)[-window:]
    total_s = sum(seconds[s] for s in steps)
    return latest, (sum(tokens[s] for s in steps) / total_s if total_s > 0 else 0.0)
