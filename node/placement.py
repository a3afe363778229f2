"""Where a node sits in a plan: its pipeline, stage, replica, neighbours and gradient groups.

Runtime rules (checked here, with errors that name the pipeline and stage):
- a pipeline's micro-batch is shared by the replicas of each of its stages, and within one pipeline every
  stage has the same data-parallel degree d: replica r of stage s exchanges activations with replica r
  of stages s - 1 and s + 1 (a "pipeline replica" that runs micro_batch / d sequences per micro-batch);
- pipelines take consecutive rows of the global batch (micro_batch x num_micro_batches each), and the
  replicas of a pipeline consecutive equal parts of its rows;
- in an outer-mode plan all of this holds within the node's replica group: its pipelines share the global
  batch, and gradients are averaged among its own holders only (the groups meet in the outer sync);
- gradients are averaged per *layer segment*: the layer ranges of all pipelines cut the model into
  segments, and every node holding a segment averages that segment's gradients with the other holders,
  weighted by the rows each trained (with one pipeline these are simply the replicas of a stage).
"""

from __future__ import annotations

from dataclasses import dataclass

from atoll.plan import Plan


class PlacementError(ValueError):
    """The plan cannot be run as given; the message says which pipeline or stage and why."""


@dataclass(frozen=True)
class Segment:
    """Layers [start, end) and the node ids that hold them, in rank order."""

    start: int
    end: int
    holders: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Placement:
    node_id: str
    pipeline: int
    stage: int
    replica: int
    num_stages: int
    dp: int
    layers: tuple[int, int]
    micro_batch: int
    num_micro_batches: int
    upstream: str | None
    downstream: str | None
    rows: tuple[int, int]
    """Rows [first, last) of the global batch this pipeline replica trains on."""
    replica_micro_batch: int
    """Sequences per micro-batch on this replica (the pipeline micro-batch / dp)."""
    chain: tuple[str, ...]
    """The node ids of this pipeline replica, stage by stage (the norm-exchange group)."""
    loss_group: tuple[str, ...]
    """Last-stage node of every pipeline replica (the group that sums the reported loss)."""
    segments: tuple[Segment, ...]
    """Segments of this node's layers held by more than one node."""
    group: int = 0
    """The node's replica group (outer-mode plans; 0 otherwise)."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


def place(plan: Plan, node_id: str, num_layers: int) -> Placement | None:
    """This node's place in `plan`, or None when the plan gives it no work."""
    plan.validate(num_layers)
    group, pipelines = 0, list(range(len(plan.pipelines)))
    if plan.mode == "outer":
        for g, grp in enumerate(plan.groups):
            if any(node_id in st.nodes for p in grp.pipelines for st in plan.pipelines[p].stages):
                group, pipelines = g, sorted(grp.pipelines)
                break
        else:
            return None
    row = 0
    found: Placement | None = None
    holders: list[tuple[tuple[int, int], str]] = []
    loss_group: list[str] = []
    for p in pipelines:
        pipe = plan.pipelines[p]
        dps = {len(s.nodes) for s in pipe.stages}
        if len(dps) != 1 or 0 in dps:
            raise PlacementError(f"pipeline {p}: every stage needs the same number (> 0) of nodes, got "
                                 f"{[len(s.nodes) for s in pipe.stages]}")
        dp = dps.pop()
        for s, st in enumerate(pipe.stages):
            if st.dp != dp:
                raise PlacementError(f"pipeline {p} stage {s}: dp = {st.dp} but {dp} nodes are listed")
            holders.extend((st.layers, n) for n in st.nodes)
        if pipe.micro_batch % dp:
            raise PlacementError(f"pipeline {p}: its micro-batch of {pipe.micro_batch} does not split over "
                                 f"{dp} replicas")
        share = pipe.micro_batch // dp * pipe.num_micro_batches
        for r in range(dp):
            chain = tuple(st.nodes[r] for st in pipe.stages)
            loss_group.append(chain[-1])
            if node_id in chain:
                s = chain.index(node_id)
                st = pipe.stages[s]
                found = Placement(
                    node_id=node_id, pipeline=p, stage=s, replica=r, num_stages=len(pipe.stages), dp=dp,
                    layers=st.layers, micro_batch=pipe.micro_batch, num_micro_batches=pipe.num_micro_batches,
                    upstream=chain[s - 1] if s > 0 else None,
                    downstream=chain[s + 1] if s + 1 < len(chain) else None,
                    rows=(row, row + share), replica_micro_batch=pipe.micro_batch // dp,
                    chain=chain, loss_group=(), segments=(), group=group,
                )
            row += share
    if row != plan.global_batch:
        where = f"replica group {group}'s pipelines" if plan.mode == "outer" else "the pipelines"
        raise PlacementError(f"{where} train {row} sequences per step, the global batch is {plan.global_batch}")
    if found is None:
        return None
    bounds = sorted({b for (a, e), _ in holders for b in (a, e)})
    a, b = found.layers
    segments = []
    for lo, hi in zip(bounds, bounds[1:]):
        if a <= lo and hi <= b:
            seg_holders = tuple(n for (x, y), n in holders if x <= lo and hi <= y)
            if len(seg_holders) > 1:
                segments.append(Segment(lo, hi, seg_holders))
    return Placement(**{**found.__dict__, "loss_group": tuple(loss_group), "segments": tuple(segments)})


def _group_layout(plan: Plan, node_id: str) -> tuple | None:
    for g in plan.groups:
        pipes = [plan.pipelines[p] for p in sorted(g.pipelines)]
        if any(node_id in st.nodes for pipe in pipes for st in pipe.stages):
            return (g.since_epoch, g.inner_steps, tuple(
                (pipe.micro_batch, pipe.num_micro_batches, tuple((st.layers, tuple(st.nodes)) for st in pipe.stages))
                for pipe in pipes))
    return None


def group_continues(old: Plan, new: Plan, node_id: str) -> bool:
    """Whether `new` keeps this node's replica group exactly as `old` runs it (same since-epoch, nodes, cuts
    and batch), so the node keeps training through the replan instead of restarting from a checkpoint."""
    if old.mode != "outer" or new.mode != "outer" or old.global_batch != new.global_batch:
        return False
    if old.rendezvous != new.rendezvous:  # a restarted coordinator: the groups meet afresh
        return False
    layout = _group_layout(old, node_id)
    return layout is not None and layout[0] > 0 and layout == _group_layout(new, node_id)
