"""Where a node sits in a plan: its pipeline, stage, rows, neighbours and gradient groups.

Runtime rules (checked here, with errors that name the pipeline and stage):
- a pipeline's micro-batch is shared by the replicas of each of its stages, and stages of one pipeline may
  have different widths (FlashFlex's asymmetric shares). A stage's replicas take consecutive row ranges
  of every micro-batch, as even as possible (counts differ by at most one; the first replicas take the
  extra rows): `shares`. A replica exchanges activations and activation-gradients with every replica of
  the neighbouring stages whose rows overlap its own, each carrying the overlap (with equal widths:
  replica r of stage s with replica r of stages s - 1 and s + 1, all rows);
- lanes (`StagePlan.lanes` = L): a stage's replicas form L lanes of dp / L, in rank order, and pipeline
  micro-batch i is trained there by lane i % L alone, whose replicas share its rows as above. A replica of a
  neighbouring stage exchanges micro-batch i with the replicas of lane i % L whose rows overlap its own
  (`Placement.upstream_lanes`, `downstream_lanes`); a laned replica trains only its lane's micro-batches, so it
  reads those rows of its range (`batch_order`) and weighs its gradient by the rows it trained (`trained_rows`);
- pipelines take consecutive rows of the global batch (micro_batch x num_micro_batches each). Inside a
  pipeline the boundaries of every stage's shares cut a micro-batch into *blocks*; row a + t of
  block [a, b) in micro-batch i is row P + m*a + i*(b - a) + t of the global batch (P: the pipeline's first
  row, m: its micro-batches), so every replica trains one contiguous range of rows, [P + m*first,
  P + m*last) (with equal widths, one block per replica: consecutive equal parts of the pipeline's rows);
  `Placement.batch_order` puts a replica's rows in micro-batch order when it spans several blocks;
- in an outer-mode plan all of this holds within the node's replica group: its pipelines share the global
  batch, and gradients are averaged among its own holders only (the groups meet in the outer sync);
- gradients are averaged per *layer segment*: the layer ranges of all pipelines cut the model into
  segments, and every node holding a segment averages that segment's gradients with the other holders,
  weighted by the rows each trained (with one pipeline these are simply the replicas of a stage);
- the squared gradient norms for global clipping are summed over every node of the pipeline, where replica
  0 of each stage adds its stage's norm and the other replicas add 0: after averaging, the replicas of a
  stage hold the same gradients, so each stage counts exactly once whatever the widths;
- tensor parallelism (`StagePlan.tp = t > 1`, `atoll.node.tp`): the stage lists dp x t nodes, replica-major,
  `nodes[r * t + k]` being tp rank k of replica r. A replica's tp ranks share its rows; its tp rank 0 is the
  replica as the rules above see it (it exchanges activations with the neighbouring stages, sits in the loss
  group) and the other ranks exchange nothing with other stages. Each tp rank of replica 0 adds its shards'
  norm. Every holder of a layer must shard it alike (same t), and gradients are averaged per tp rank: the
  segment groups join the holders with the same tp rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from atoll.plan import PipelinePlan, Plan, shares


class PlacementError(ValueError):
    """The plan cannot be run as given; the message says which pipeline or stage and why."""


@dataclass(frozen=True)
class Segment:
    """Layers [start, end) and the node ids that hold them, in rank order."""

    start: int
    end: int
    holders: tuple[str, ...]
    tp_rank: int = 0
    """The tp rank whose shards of these layers the holders average (0 without tensor parallelism)."""


@dataclass(frozen=True)
class Neighbour:
    """A replica of the previous or next stage whose rows overlap this node's."""

    node_id: str
    rows: tuple[int, int]
    """The rows [first, last) of every pipeline micro-batch that replica trains (its whole share; what it
    exchanges with this node is the overlap with this node's rows)."""


@dataclass(frozen=True, kw_only=True)
class Placement:
    node_id: str
    pipeline: int
    stage: int
    replica: int
    num_stages: int
    dp: int
    """Replicas of this node's stage."""
    layers: tuple[int, int]
    micro_batch: int
    """Rows of one pipeline micro-batch (all replicas of a stage together)."""
    num_micro_batches: int
    micro_rows: tuple[int, int]
    """Rows [first, last) of every pipeline micro-batch this replica trains."""
    upstream: tuple[Neighbour, ...]
    """Replicas of the previous stage whose rows overlap this node's, in row order (empty on the first stage);
    where that stage has lanes this node meets more than one of, every lane's, in lane order (`upstream_lanes`
    says which one each micro-batch goes to)."""
    downstream: tuple[Neighbour, ...]
    """Replicas of the next stage whose rows overlap this node's, as `upstream` (empty on the last stage)."""
    rows: tuple[int, int]
    """Rows [first, last) of the global batch that hold this replica's (micro_rows' share of every micro-batch;
    a laned replica trains only its lane's micro-batches' of them, `batch_order`)."""
    blocks: tuple[tuple[int, int], ...]
    """The pipeline's row blocks inside `micro_rows` (see the module docstring): one with equal widths."""
    pipeline_nodes: tuple[str, ...]
    """Every node of this pipeline, stage by stage, in rank order (the norm-exchange group)."""
    loss_group: tuple[str, ...]
    """Last-stage nodes of every pipeline (the group that sums the reported loss)."""
    segments: tuple[Segment, ...]
    """Segments of this node's layers held by more than one node."""
    group: int = 0
    """The node's replica group (outer-mode plans; 0 otherwise)."""
    tp: int = 1
    """Tensor-parallel degree of this node's stage."""
    tp_rank: int = 0
    """This node's rank in its stage replica's tp group (0: the rank that talks to the other stages)."""
    tp_group: tuple[str, ...] = ()
    """The node ids of this stage replica's tp ranks, in rank order (this node alone when tp = 1)."""
    lane: int = 0
    """This replica's lane: it trains the pipeline micro-batches i with i % lanes == lane."""
    lanes: int = 1
    """Lanes of this node's stage."""
    upstream_lanes: tuple[tuple[Neighbour, ...], ...] = ()
    """Where the previous stage has lanes and this node meets several of them: per lane of that stage, its
    replicas whose rows overlap this node's (micro-batch i goes to lane i % len); empty otherwise."""
    downstream_lanes: tuple[tuple[Neighbour, ...], ...] = ()
    """The same for the next stage."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def replica_micro_batch(self) -> int:
        """Sequences per micro-batch on this replica."""
        return self.micro_rows[1] - self.micro_rows[0]

    @property
    def micro_batch_ids(self) -> range:
        """The pipeline micro-batches this replica trains, in order: every one, or its lane's."""
        return range(self.lane, self.num_micro_batches, self.lanes)

    @property
    def trained_rows(self) -> int:
        """Sequences of the global batch this replica trains per step."""
        return self.replica_micro_batch * len(self.micro_batch_ids)

    @property
    def counts_norm(self) -> bool:
        """Whether this node adds its stage's squared gradient norm to the pipeline's sum (replica 0 does)."""
        return self.replica == 0

    def batch_order(self) -> list[int] | None:
        """The order in which to take this replica's rows (indices into global rows `rows`) so that its
        batch splits into micro-batches as consecutive equal parts; None when they are in order already. A laned
        replica takes only its lane's micro-batches' rows (`trained_rows` of them)."""
        if len(self.blocks) <= 1 and self.lanes == 1:
            return None
        m, first = self.num_micro_batches, self.micro_rows[0]
        return [m * (a - first) + i * (b - a) + t for i in self.micro_batch_ids for a, b in self.blocks
                for t in range(b - a)]


def _stage_shares(p: int, s: int, pipe: PipelinePlan) -> list[tuple[int, int]]:
    st = pipe.stages[s]
    if not st.nodes:
        raise PlacementError(f"pipeline {p} stage {s} lists no nodes; a runnable plan names each stage's nodes")
    if st.tp < 1:
        raise PlacementError(f"pipeline {p} stage {s}: tp = {st.tp}; it must be at least 1")
    if st.dp * st.tp != len(st.nodes):
        raise PlacementError(f"pipeline {p} stage {s}: dp = {st.dp} x tp = {st.tp} needs {st.dp * st.tp} nodes "
                             f"(nodes[r * tp + k] is tp rank k of replica r), but {len(st.nodes)} are listed")
    per_lane = st.dp // st.lanes
    if pipe.micro_batch < per_lane:
        lanes = f" in each of its {st.lanes} lanes" if st.lanes > 1 else ""
        raise PlacementError(f"pipeline {p} stage {s}: its {per_lane} replicas{lanes} cannot share a micro-batch "
                             f"of {pipe.micro_batch} sequences; give the pipeline a micro-batch of at least "
                             f"{per_lane}, the stage fewer nodes or more lanes")
    return shares(pipe.micro_batch, per_lane)


def _replicas(st) -> list[str]:
    """The node standing for each replica of a stage towards the other stages: its tp rank 0."""
    return list(st.nodes[::max(1, st.tp)])


def _check_distinct(plan: Plan) -> None:
    seen: dict[str, tuple[int, int]] = {}
    for p, pipe in enumerate(plan.pipelines):
        for s, st in enumerate(pipe.stages):
            for n in st.nodes:
                if n in seen:
                    raise PlacementError(f"node {n} is listed in pipeline {seen[n][0]} stage {seen[n][1]} and again in "
                                         f"pipeline {p} stage {s}; each node runs one stage")
                seen[n] = (p, s)


def place(plan: Plan, node_id: str, num_layers: int) -> Placement | None:
    """This node's place in `plan`, or None when the plan gives it no work."""
    plan.validate(num_layers)
    _check_distinct(plan)
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
    tp_of: dict[str, tuple[int, int]] = {}  # node -> (its stage's tp, its tp rank)
    loss_group: list[str] = []
    for p in pipelines:
        pipe = plan.pipelines[p]
        splits = [_stage_shares(p, s, pipe) for s in range(len(pipe.stages))]
        bounds = sorted({b for split in splits for r in split for b in r})
        m = pipe.num_micro_batches
        for st in pipe.stages:
            holders.extend((st.layers, n) for n in st.nodes)
            tp_of.update((n, (st.tp, i % st.tp)) for i, n in enumerate(st.nodes))
        loss_group.extend(_replicas(pipe.stages[-1]))
        for s, st in enumerate(pipe.stages):
            if node_id not in st.nodes:
                continue
            r, k_tp = divmod(st.nodes.index(node_id), st.tp)
            per_lane = st.dp // st.lanes
            lane = r // per_lane
            a, b = splits[s][r % per_lane]

            def overlapping(k: int) -> tuple[tuple[Neighbour, ...], tuple[tuple[Neighbour, ...], ...]]:
                """(neighbours, per-lane neighbours) on stage k: see `Placement.upstream` and `upstream_lanes`."""
                if not 0 <= k < len(pipe.stages) or k_tp:  # a tp rank other than 0 exchanges nothing
                    return (), ()
                other = pipe.stages[k]
                reps, d = _replicas(other), other.dp // other.lanes
                by_lane = tuple(tuple(Neighbour(n, rr) for n, rr in zip(reps[x * d:(x + 1) * d], splits[k])
                                      if rr[0] < b and a < rr[1]) for x in range(other.lanes))
                # the lanes of stage k this replica's micro-batches (i = lane mod L) reach: i mod other.lanes
                met = sorted({i % other.lanes for i in range(lane, m, st.lanes)})
                if len(met) == 1:
                    return by_lane[met[0]], ()
                return tuple(nb for x in by_lane for nb in x), by_lane

            (up, up_lanes), (down, down_lanes) = overlapping(s - 1), overlapping(s + 1)
            found = Placement(
                node_id=node_id, pipeline=p, stage=s, replica=r, num_stages=len(pipe.stages), dp=st.dp,
                layers=st.layers, micro_batch=pipe.micro_batch, num_micro_batches=m, micro_rows=(a, b),
                upstream=up, downstream=down, lane=lane, lanes=st.lanes, upstream_lanes=up_lanes,
                downstream_lanes=down_lanes,
                rows=(row + m * a, row + m * b),
                blocks=tuple((x, y) for x, y in zip(bounds, bounds[1:]) if a <= x and y <= b),
                pipeline_nodes=tuple(n for stage in pipe.stages for n in stage.nodes),
                loss_group=(), segments=(), group=group,
                tp=st.tp, tp_rank=k_tp, tp_group=tuple(st.nodes[r * st.tp:(r + 1) * st.tp]),
            )
        row += pipe.micro_batch * m
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
            every = [n for (x, y), n in holders if x <= lo and hi <= y]
            degrees = sorted({tp_of[n][0] for n in every})
            if len(degrees) > 1:
                raise PlacementError(f"layers [{lo}, {hi}) are held under tp degrees {degrees}; every holder of a "
                                     "layer must shard it alike (plan one tp degree per layer)")
            seg_holders = tuple(n for n in every if tp_of[n][1] == found.tp_rank)
            if len(seg_holders) > 1:
                segments.append(Segment(lo, hi, seg_holders, found.tp_rank))
    return Placement(**{**found.__dict__, "loss_group": tuple(loss_group), "segments": tuple(segments)})


def _group_layout(plan: Plan, node_id: str) -> tuple | None:
    for g in plan.groups:
        pipes = [plan.pipelines[p] for p in sorted(g.pipelines)]
        if any(node_id in st.nodes for pipe in pipes for st in pipe.stages):
            return (g.since_epoch, g.inner_steps, tuple(
                (pipe.micro_batch, pipe.num_micro_batches,
                 tuple((st.layers, tuple(st.nodes), st.lanes) for st in pipe.stages))
                for pipe in pipes))
    return None


def group_continues(old: Plan, new: Plan, node_id: str) -> bool:
    """Whether `new` keeps this node's replica group exactly as `old` runs it (same since-epoch, nodes, cuts,
    lanes and batch), so the node keeps training through the replan instead of restarting from a checkpoint."""
    if old.mode != "outer" or new.mode != "outer" or old.global_batch != new.global_batch:
        return False
    if old.rendezvous != new.rendezvous:  # a restarted coordinator: the groups meet afresh
        return False
    layout = _group_layout(old, node_id)
    return layout is not None and layout[0] > 0 and layout == _group_layout(new, node_id)
