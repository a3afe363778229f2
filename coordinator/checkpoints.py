"""The checkpoint index: which steps are complete, who holds which copy, and how far replication got.

Checkpoint folders are local to each node: a stage's writer keeps its file and `[checkpoint] replicas`
other nodes take copies (`atoll.node.replication`); each copy is reported as its holder's. A step is
complete when, for the plan of the reports' epoch, each stage of at least one pipeline has a copy of
exactly its layer range, on any node. A resume needs those copies on nodes that are alive.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from atoll.coordinator.store import CheckpointRecord
from atoll.plan import CheckpointCopy, Plan


def complete_steps(records: Iterable[CheckpointRecord], plans: Mapping[int, Plan],
                   holders: Collection[str] | None = None) -> list[int]:
    """Steps, ascending, at which a whole model was saved under one plan epoch.

    A step is complete when, for the plan of the reports' epoch, each stage of at least one pipeline
    has a report of exactly its layer range (from any of its replicas or any node holding a copy).
    With `holders`, only copies on those nodes count (the alive ones: what a resume can load).
    """
    seen: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for r in records:
        if holders is None or r.node_id in holders:
            seen.setdefault((r.step, r.plan_epoch), set()).add((r.layer_start, r.layer_end))
    done = set()
    for (step, epoch), ranges in seen.items():
        plan = plans.get(epoch)
        if plan is None:
            continue
        if any(all(s.layers in ranges for s in p.stages) for p in plan.pipelines if p.stages):
            done.add(step)
    return sorted(done)


def resume_step(records: list[CheckpointRecord], plans: Mapping[int, Plan], alive: Collection[str]) -> int:
    """The step a new plan resumes from when no live state covers the model: the newest complete step whose
    copies alive nodes hold; else the newest complete one (its files may lie on a shared file system); else 0."""
    on_alive = complete_steps(records, plans, holders=alive)
    if on_alive:
        return on_alive[-1]
    done = complete_steps(records, plans)
    return done[-1] if done else 0


def copies_of(records: Iterable[CheckpointRecord], step: int, addresses: Mapping[str, str]) -> list[CheckpointCopy]:
    """The copies of `step` held by the nodes in `addresses` (alive node id -> Peer address), one per
    (node, layer range), in a stable order."""
    out = {(r.node_id, r.layer_start, r.layer_end) for r in records if r.step == step and r.node_id in addresses}
    return [CheckpointCopy(node_id=n, layers=(a, b), address=addresses[n]) for n, a, b in sorted(out)]


def replication(records: Iterable[CheckpointRecord], step: int) -> dict[tuple[int, int], int]:
    """Copies of each layer range of `step`: how far its replication got (writer included)."""
    holders: dict[tuple[int, int], set[str]] = {}
    for r in records:
        if r.step == step:
            holders.setdefault((r.layer_start, r.layer_end), set()).add(r.node_id)
    return {rng: len(nodes) for rng, nodes in sorted(holders.items())}
