"""Which checkpoint steps are complete: every stage of some pipeline of the plan that wrote them reported."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from atoll.coordinator.store import CheckpointRecord
from atoll.plan import Plan


def complete_steps(records: Iterable[CheckpointRecord], plans: Mapping[int, Plan]) -> list[int]:
    """Steps, ascending, at which a whole model was saved under one plan epoch.

    A step is complete when, for the plan of the reports' epoch, each stage of at least one pipeline
    has a report of exactly its layer range (from any of its replicas).
    """
    seen: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for r in records:
        seen.setdefault((r.step, r.plan_epoch), set()).add((r.layer_start, r.layer_end))
    done = set()
    for (step, epoch), ranges in seen.items():
        plan = plans.get(epoch)
        if plan is None:
            continue
        if any(all(s.layers in ranges for s in p.stages) for p in plan.pipelines if p.stages):
            done.add(step)
    return sorted(done)
