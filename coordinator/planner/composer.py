"""The composer: slice boundaries and islands for each stage, minimising the bottleneck stage time.

A candidate (a *setup*) fixes an ordered chain of islands, the width w_i of a stage on each island (its
data-parallel replicas) and the pipeline's micro-batch B, which every stage shares evenly among its replicas
(B / w_i sequences each, FlashFlex's asymmetric shares); island i can then host up to floor(gpus_i / w_i)
stages, and the step has m = global_batch / B micro-batches. Three families of setups are tried: one width
for every stage (replica r feeds replica r), every island cut into the same number d of stages, as wide
as the island allows, and, in chains of two islands of one region, each island cut into its own power-of-two number of
stages (a slow island in a few wide stages, which the parallelizer may run tensor-parallel, a fast one in
more narrow ones). For a candidate the composer finds the smallest bottleneck T (the
largest of every stage's compute time per micro-batch and every boundary's time on the wire under its
codec) by a parametric search: for a given T a greedy pass from the last layer backwards gives each stage as
many layers as fit within T and its memory (the stage's position from the end fixes its 1F1B in-flight
micro-batches), which decides feasibility exactly because every stage's time and memory grow with its
slice. A boundary whose round trip (latency both ways plus both transfers) would stall strict 1F1B gets a
deep window (`window_depth`: about round trip / cycle extra micro-batches in flight, accumulated upstream),
as deep as each stage's memory allows without changing its placement or cost. Bisection on T then
converges on the minimum; a few relaxed T are tried too, since fewer, fuller
stages shorten fill and drain.

Lanes: a stage may have more devices than the micro-batch has sequences and tensor parallelism can take (one
GPU per machine, a small global batch): its replicas then form L lanes (`atoll.plan`), lane i % L taking
micro-batch i, so each lane shares a micro-batch among width / L devices and the stage keeps pace with its
neighbours though each lane is L times slower. A setup whose widths a micro-batch cannot share is tried with
its wide islands in the fewest lanes that can (`_lanes`); a lane's time per micro-batch over L is what the
bottleneck compares (`IslandCost.pace_s`), the simulator runs the lanes, and the stages up to a laned one hold
more micro-batches in flight (`atoll.plan.lane_warmups`), as the node does.

Free order: a chain may visit an island twice. After the island-contiguous chains, the best few are tried
again with one island of their region cut into two parts (between nodes) placed anywhere with other islands
between them, so V100 / A100 / V100 can be found where it is better (`split_setups`).

Refinement: the best candidates' cuts are then tuned with their islands, widths and micro-batch fixed, one
layer at a time across a boundary while the simulated step improves (`refine`), for what the bottleneck
alone does not see (the first stage's exposed all-reduce, fill and drain, a transfer that shrinks with the
cut).

Pruning keeps thousands of GPUs fast: per-island layer tables are memoised; chains only order regions and,
within a region, islands by memory (the front of a 1F1B pipeline holds the most activations), a region
alone also from the slowest class to the fastest (every order when the cluster has at most 4 islands),
dropping the slowest device classes as variants; candidates are visited in order of a lower bound from
their total compute capacity, stopping as soon as the bound cannot beat the best step found, and one is
simulated only when its own lower bound could beat the best simulated step.
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass, field, replace

from atoll.coordinator.planner.cluster import Cluster, Island
from atoll.coordinator.planner.costmodel import (WINDOW_TOLERANCE, CostModel, deepest_deferral, held_deferred,
                                                window_depth)
from atoll.coordinator.planner.parallelizer import DefaultParallelizer, IslandCost, IslandParallelizer, SliceQuery
from atoll.coordinator.planner.tied import tied_sync_seconds
from atoll.coordinator.planner.simulator import (LinkTimes, PipelineTimes, StageTimes, closed_form_step, simulate,
                                                 step_lower_bound)
from atoll.plan import lane_in_flight, lane_warmup


ALL_ORDERS_UP_TO = 4
"""Clusters of at most this many islands have every order of each region's islands tried (the two orders
above first): the first stage finishes its backward last, so which island runs it decides how much of its
all-reduce stays exposed, which the bottleneck alone does not see."""


def _divisors(n: int) -> set[int]:
    return {d for k in range(1, math.isqrt(n) + 1) if n % k == 0 for d in (k, n // k)}


MIXED_CUTS_UP_TO = 2
"""Chains of at most this many islands, all of one region, also try every island cut into its own number of
stages."""
MIXED_CUTS_MAX = 16
"""Most stages per island in those mixed cuts (powers of two up to it)."""


SPLIT_FRACTIONS = (0.25, 0.5, 0.75)
"""Shares of an island's nodes its front part takes when a chain visits it twice (`Composer.split_setups`)."""
SPLIT_SEEDS = 4
"""Best contiguous candidates whose chains are tried again with one island visited twice."""
MAX_LANES = 8
"""Most lanes a stage is split into (`Composer._lanes`): each adds a micro-batch's time to the pipeline's fill."""
REFINE_BUDGET = 48
"""Most simulations `Composer.refine` spends on one candidate (one layer moved across a boundary each)."""


def split_island(island: Island, fraction: float) -> tuple[Island, Island] | None:
    """Two parts of an island, the first with about `fraction` of it, cut between nodes (between devices
    when the island is one node); None when it has one device. A part keeps the island's id and node list
    (the plan hands a stage its devices in order, part after part) with fewer GPUs."""
    hosts = -(-island.gpus // island.gpus_per_node)
    if hosts >= 2:
        front = min(hosts - 1, max(1, round(fraction * hosts))) * island.gpus_per_node
    elif island.gpus >= 2:
        front = min(island.gpus - 1, max(1, round(fraction * island.gpus)))
    else:
        return None
    return replace(island, gpus=front), replace(island, gpus=island.gpus - front)


def _distinct(cands: list[Candidate]) -> list[Candidate]:
    """`cands` without repeats of one pipeline (the same stages on the same islands and devices, reached from
    different chain orders), first kept: each refinement slot goes to a different pipeline."""
    seen: set[tuple] = set()
    out = []
    for c in cands:
        key = (c.micro_batch, c.num_micro_batches,
               tuple((st.island.id, st.island.gpus, st.start, st.end, st.cost.dp, st.cost.tp, st.cost.lanes)
                     for st in c.stages))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _preference(c: Candidate) -> tuple:
    """Among pipelines predicted equally fast (`PlannerOptions.near_equal`): the most devices, the fewest stages,
    the largest micro-batch, then the faster."""
    return (-c.gpus, len(c.stages), -c.micro_batch, c.step_s)


class NoFeasiblePlan(ValueError):
    """No arrangement of the model fits the cluster; the message names the shortfall."""


@dataclass(frozen=True, kw_only=True)
class StageChoice:
    island: Island
    start: int
    end: int
    cost: IslandCost
    sync_s: float
    optimizer_s: float
    in_flight: int = 0
    """Extra micro-batches in flight beyond strict 1F1B (deep window; `StagePlan.in_flight`)."""
    defer: int = 0
    """Micro-batches whose weight gradients wait for their own action (zero-bubble; `StagePlan.defer_weights`)."""
    defer_layers: tuple[int, ...] = ()
    """The layers whose weight gradients the stage defers when not all of them (`StagePlan.defer_layers`; empty:
    all, when `defer` is set)."""
    weight_s: float = 0.0
    """Of the backward per micro-batch, the weight-gradient part the stage defers (0 when it does not)."""
    split_s: float = 0.0
    """What running the backward in two passes adds per micro-batch where the stage defers (`StageTimes.split_s`)."""
    defer_bytes: float = 0.0
    """Memory per device the deferred weight gradients hold at most (on top of `cost.memory_bytes`)."""

    @property
    def memory_bytes(self) -> float:
        return self.cost.memory_bytes + self.defer_bytes


def _undeferred(st: StageChoice) -> StageChoice:
    """The stage computing its weight gradients in backward (no deferral, nothing held for it)."""
    return replace(st, defer=0, defer_layers=(), weight_s=0.0, split_s=0.0, defer_bytes=0.0)


@dataclass(frozen=True, kw_only=True)
class LinkChoice:
    codec: str
    raw_bytes: int
    forward_s: float
    backward_s: float
    latency_s: float = 0.0
    """Of forward_s and backward_s, the link's one-way latency."""


@dataclass(kw_only=True)
class Candidate:
    """One composed pipeline: its stages, links and predicted times."""

    order: tuple[str, ...]
    micro_batch: int
    """Sequences per micro-batch of the pipeline, shared evenly by each stage's replicas."""
    num_micro_batches: int
    stages: list[StageChoice]
    links: list[LinkChoice]
    times: PipelineTimes
    estimate_s: float
    step_s: float = 0.0
    """Simulated step time (0 until simulated)."""
    placed: tuple[tuple[int, int, int, int], ...] = ()
    """Per stage: (chain index of its island, first layer, end layer, in-flight micro-batches of strict 1F1B)."""

    @property
    def bottleneck_s(self) -> float:
        """The slowest stage's compute or link's time on the wire, per micro-batch (latency is the windows')."""
        return max([s.cost.pace_s for s in self.stages]
                   + [max(x.forward_s, x.backward_s) - x.latency_s for x in self.links])

    @property
    def gpus(self) -> int:
        return sum(s.cost.gpus for s in self.stages)


@dataclass(kw_only=True)
class SearchStats:
    candidates: int = 0
    evaluated: int = 0
    pruned: int = 0
    infeasible: int = 0
    simulated: int = 0
    using: dict[tuple[str, int], Candidate] = field(default_factory=dict, repr=False)
    """(island id, devices of it a pipeline runs on) -> the candidate of that usage with the least estimated step
    the search composed (what an idle device's reason compares the plan with, `Composer.using_more`)."""
    bounds: dict[tuple[str, int], float] = field(default_factory=dict, repr=False)
    """(island id, devices of it a setup could run on) -> the least lower bound of the setups the search pruned,
    none of which could beat the best step found."""


@dataclass(kw_only=True)
class _Setup:
    order: tuple[Island, ...]
    widths: tuple[int, ...]
    """Devices of a stage on each island of the chain (dp x tp, the parallelizer splits them)."""
    batch: int
    """Sequences per pipeline micro-batch (B)."""
    m: int
    caps: tuple[int, ...]
    """Most stages each island can host."""
    bound: float
    lanes: tuple[int, ...] = ()
    """Lanes of a stage on each island (its width's devices split into that many lanes); empty: none anywhere."""

    def lane(self, i: int) -> int:
        """Lanes of a stage on island i."""
        return self.lanes[i] if self.lanes else 1

    def lane_width(self, i: int) -> int:
        """Devices of one lane of a stage on island i (its whole width without lanes)."""
        return self.widths[i] // self.lane(i)

    def per_replica(self, i: int) -> int:
        """Sequences of the busiest device when every device of a lane of a stage on island i is its own
        replica."""
        return -(-self.batch // self.lane_width(i))

    def cut(self, j: int) -> "_Setup":
        return _Setup(order=self.order[:j], widths=self.widths[:j], batch=self.batch, m=self.m,
                      caps=self.caps[:j], bound=self.bound, lanes=self.lanes[:j])


@dataclass(kw_only=True)
class Composer:
    cost_model: CostModel
    cluster: Cluster
    parallelizer: IslandParallelizer | None = None
    stats: SearchStats = field(default_factory=SearchStats)

    def __post_init__(self) -> None:
        if self.parallelizer is None:
            self.parallelizer = DefaultParallelizer(self.cost_model)
        self._fast = isinstance(self.parallelizer, DefaultParallelizer)
        self._setup_of: dict[int, _Setup] = {}  # the setup of each candidate in `stats.using`

    # --- search space ---------------------------------------------------------------------------------

    def orders(self) -> list[tuple[Island, ...]]:
        """Island chains: regions in every order, islands by memory within each (the front of a 1F1B
        pipeline holds the most activations); one region alone also from the slowest class to the fastest
        (a fast island runs more layers per micro-batch, so it holds more activations per micro-batch in
        flight and is best where fewest are in flight) and, in small clusters, in every order; slow classes
        dropped as variants."""
        by_region: dict[str, list[Island]] = {}
        for isl in self.cluster.islands:
            by_region.setdefault(isl.region, []).append(isl)
        speed = {i.id: self._speed(i) for i in self.cluster.islands}
        bases: dict[str, list[tuple[Island, ...]]] = {}
        variants: dict[str, list[tuple[Island, ...]]] = {}
        for r, isls in by_region.items():
            by_memory = tuple(sorted(isls, key=lambda i: (-i.device.memory_gb, -speed[i.id], i.id)))
            by_speed = tuple(sorted(isls, key=lambda i: (speed[i.id], -i.device.memory_gb, i.id)))
            bases[r] = list(dict.fromkeys((by_memory, by_speed)))
            if len(self.cluster.islands) <= ALL_ORDERS_UP_TO:
                bases[r].extend(o for o in itertools.permutations(by_memory) if o not in bases[r])
            classes = sorted({speed[i.id] for i in isls}, reverse=True)
            vs = []
            for ordered in bases[r]:
                vs.append(ordered)
                for keep in classes[:-1]:
                    vs.append(tuple(i for i in ordered if speed[i.id] >= keep))
            variants[r] = list(dict.fromkeys(vs))
        out: list[tuple[Island, ...]] = []
        regions = list(by_region)
        for r in regions:  # one region alone, with its variants
            out.extend(variants[r])
        for k in range(2, len(regions) + 1):
            for perm in itertools.permutations(regions, k):  # every region by memory
                chain = [bases[r][0] for r in perm]
                if all(self._connected(x, y) for x, y in zip(chain, chain[1:])):
                    out.append(tuple(i for part in chain for i in part))
        return list(dict.fromkeys(out))

    def _connected(self, a: tuple[Island, ...], b: tuple[Island, ...]) -> bool:
        return self.cluster.link(a[-1].id, b[0].id) is not None

    def _speed(self, island: Island) -> float:
        """Whole-model micro-batches per second of one device at micro-batch 1 (a ranking key)."""
        t = self.cost_model.table(island, 1)
        return 1.0 / max(1e-12, t.pf[-1] + t.pb[-1])

    def _shapes(self, order: tuple[Island, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...], int, tuple[int, ...]]]:
        """(widths, caps, batch B, lanes) of the setups of a chain.

        Widths: one for every stage (powers of two, each island's size, and every divisor of the islands'
        common size, so a width that leaves no GPU over exists whenever one does), or every island cut into
        d stages (d a power of two or such a divisor). B: any divisor of the global batch every stage can
        share, its replicas' shares differing by at most one sequence (`DefaultParallelizer.splits`; with
        `equal_widths`, or another parallelizer, B / width must be an allowed micro-batch). A shape with a width
        no split can share B comes with its wide islands in lanes instead (`_lanes`)."""
        cm = self.cost_model
        g = cm.train.global_batch
        max_units = min(cm.num_layers, cm.options.max_stages)
        out = []
        biggest = max(i.gpus for i in order)
        common = _divisors(math.gcd(*(i.gpus for i in order)))
        # one width for every stage
        ws = {1 << k for k in range(int(math.log2(biggest)) + 1)} | {i.gpus for i in order} | common
        for w in sorted(ws):
            out.append(((w,) * len(order), tuple(min(i.gpus // w, max_units) for i in order)))
        # every island cut into d stages
        if not cm.options.equal_widths:
            for d in sorted({1 << k for k in range(int(math.log2(max_units)) + 1)} | common):
                if d <= max_units:
                    out.append((tuple(max(1, i.gpus // d) for i in order), tuple(min(d, i.gpus) for i in order)))
            # each island cut into its own number of stages (a slow island in few wide stages running tensor
            # parallelism, a fast one in more narrow ones), in chains of a few islands of one region
            if 1 < len(order) <= MIXED_CUTS_UP_TO and len({i.region for i in order}) == 1:
                cuts = [1 << k for k in range(MIXED_CUTS_MAX.bit_length()) if (1 << k) <= max_units]
                for ds in itertools.product(cuts, repeat=len(order)):
                    if len(set(ds)) > 1 and all(d <= i.gpus for d, i in zip(ds, order)):
                        out.append((tuple(i.gpus // d for d, i in zip(ds, order)), ds))
        batches = _divisors(g)
        shapes = []
        for w, c in dict.fromkeys(out):
            if c[-1] <= 0:
                continue
            for b in sorted(batches):
                if all(self._shares(isl, x, b) for isl, x in zip(order, w)):
                    shapes.append((w, c, b, ()))
                elif lanes := self._lanes(order, w, b, g // b):  # a width no split can share B: in lanes
                    shapes.append((w, c, b, lanes))
        return shapes

    def _lanes(self, order: tuple[Island, ...], widths: tuple[int, ...], batch: int, m: int) -> tuple[int, ...]:
        """Lanes per island for stages of `widths` devices on micro-batches of `batch` sequences: 1 where the
        devices can share it (`_shares`: a replica per device, or tensor parallelism), else the fewest lanes
        (dividing the width and the m micro-batches, at most `MAX_LANES`) whose devices can; empty when no island
        needs lanes or one has none that fit (and with a parallelizer other than the default, which knows no
        lanes). Only where no split shares it: where tensor parallelism can, a lane's micro-batch takes L times
        as long through the stage, which lengthens fill and drain more than the steady state gains on the
        benchmark's clusters, and a search of both would take twice as long."""
        if not self._fast:
            return ()
        out = []
        for isl, x in zip(order, widths):
            if self._shares(isl, x, batch):
                out.append(1)
                continue
            lane = next((k for k in range(2, MAX_LANES + 1)
                         if x % k == 0 and m % k == 0 and x // k <= batch and self._shares(isl, x // k, batch)), 0)
            if not lane:
                return ()
            out.append(lane)
        return tuple(out) if max(out) > 1 else ()

    def _shares(self, island: Island, width: int, batch: int) -> bool:
        """Whether `width` devices of the island can share a pipeline micro-batch of `batch` sequences."""
        if self._fast:
            assert isinstance(self.parallelizer, DefaultParallelizer)
            return bool(self.parallelizer.splits(island, width, batch))
        return batch % width == 0 and batch // width in self.cost_model.options.micro_batches

    def setups(self) -> list[_Setup]:
        cm = self.cost_model
        g = cm.train.global_batch
        max_units = min(cm.num_layers, cm.options.max_stages)
        out: list[_Setup] = []
        chains = dict.fromkeys(order[:j] for order in self.orders() for j in range(len(order), 0, -1))
        for order in chains:
            for widths, caps, batch, lanes in self._shapes(order):
                s = _Setup(order=order, widths=widths, batch=batch, m=g // batch, caps=caps, bound=0.0, lanes=lanes)
                s.bound = self._lower_bound(s, s.m, max_units)
                out.append(s)
        return out

    def _rate(self, s: _Setup, max_units: int) -> tuple[float, float]:
        """(micro-batches per second of all work spread over the setup's fastest stages, the least time one
        micro-batch's own path through the whole model takes on one stage: its forwards and input gradients)."""
        full, path = [], []
        deferring = self.cost_model.options.zero_bubble
        for i, (isl, c) in enumerate(zip(s.order, s.caps)):
            if self._fast:
                assert isinstance(self.parallelizer, DefaultParallelizer)
                # a stage in lanes runs that many micro-batches at once, each at a lane's pace
                full.extend([self.parallelizer.compute_floor(isl, s.lane_width(i), s.batch) / s.lane(i)] * c)
                path.append(self.parallelizer.path_floor(isl, s.lane_width(i), s.batch))
            else:
                t = self.cost_model.table(isl, s.per_replica(i))
                full.extend([t.pf[-1] + t.pb[-1]] * c)
                # a stage deferring its weight-gradient products runs them off the micro-batch's path
                path.append(t.pf[-1] + t.pb[-1] - (t.pw[-1] if deferring and t.pw else 0.0))
        full.sort()
        return sum(1.0 / x for x in full[:max_units]), min(path)

    def _lower_bound(self, s: _Setup, m: int, max_units: int) -> float:
        """Step time no arrangement of this setup can beat: m - 1 micro-batches at the best rate, plus one
        that must pass every layer (its forwards and input gradients: deferred weight-gradient products leave
        its path)."""
        speed, fastest = self._rate(s, max_units)
        return (m - 1) / speed + fastest

    def split_setups(self, seeds: list[_Setup]) -> list[_Setup]:
        """Free order around the best chains: each seed's chain with one island of its region visited twice,
        cut in two parts (`split_island`) placed anywhere with at least one other island between them
        (V100 / A100 / V100), an island the seed left out included. The seed's micro-batch B is kept and every
        part keeps its island's width in the seed (the widest that fits the part and still divides B into
        an allowed per-replica size; for an island the seed did not use, the seed's widest)."""
        cm = self.cost_model
        sizes = set(cm.options.micro_batches)
        max_units = min(cm.num_layers, cm.options.max_stages)
        out: dict[tuple, _Setup] = {}
        for seed in seeds:
            region = seed.order[0].region
            if any(i.region != region for i in seed.order):
                continue
            width_of = {i.id: w for i, w in zip(seed.order, seed.widths)}
            for x in (i for i in self.cluster.islands if i.region == region):
                rest = tuple(i for i in seed.order if i.id != x.id)
                if not rest:
                    continue
                for f in SPLIT_FRACTIONS:
                    parts = split_island(x, f)
                    if parts is None:
                        continue
                    for p in range(len(rest)):
                        for q in range(p + 1, len(rest) + 1):
                            order = (*rest[:p], parts[0], *rest[p:q], parts[1], *rest[q:])
                            widths = []
                            for isl in order:
                                want = width_of.get(isl.id, max(seed.widths))
                                if cm.options.equal_widths:  # the seed's one width, or the part is not used
                                    fits = want <= isl.gpus and seed.batch % want == 0 and seed.batch // want in sizes
                                    widths.append(want if fits else 0)
                                    continue
                                w = next((w for w in range(min(want, isl.gpus), 0, -1)
                                          if seed.batch % w == 0 and seed.batch // w in sizes), 0)
                                widths.append(w)
                            if 0 in widths:
                                continue
                            caps = tuple(min(i.gpus // w, max_units) for i, w in zip(order, widths))
                            key = (tuple((i.id, i.gpus) for i in order), tuple(widths), seed.batch)
                            if key not in out:
                                s = _Setup(order=order, widths=tuple(widths), batch=seed.batch, m=seed.m, caps=caps,
                                           bound=0.0)
                                s.bound = self._lower_bound(s, s.m, max_units)
                                out[key] = s
        return list(out.values())

    # --- one setup ------------------------------------------------------------------------------------

    def _link(self, s: _Setup, i: int, j: int, boundary: int,
              streams: int = 0) -> tuple[int, float, float] | None:
        """(raw bytes per stream, stream bandwidth, latency) from a stage on island i to one on island j, over
        `streams` streams at once, each carrying its share of the micro-batch's activation (0: one per device
        of the narrower stage, the most there can be before the stages' tensor parallelism is chosen)."""
        cm = self.cost_model
        src, dst = s.order[i], s.order[j]
        link = self.cluster.link(src.id, dst.id)
        if link is None:
            return None
        streams = streams or min(s.lane_width(i), s.lane_width(j))
        # where the replicas sit: both stages' devices (every lane, every tp rank) share one node, or the stream
        # crosses nodes; two parts of a split island are cut between nodes
        devices = max(s.widths[i], s.widths[j]) if i == j or src.id != dst.id else src.gpus_per_node
        bw = cm.stream_bandwidth(src, dst, link, devices, streams=streams)
        raw = -(-cm.model.boundary_bytes(boundary, s.batch, cm.train.seq_len, cm.train.dtype) // streams)
        return raw, bw, cm.stream_latency(src, dst, link, devices)

    def _fastest_link(self, s: _Setup, i: int, j: int, boundary: int, *, latency: bool = False) -> float:
        """The quickest time on the wire of the boundary (inf: no link); with `latency`, its arrival."""
        got = self._link(s, i, j, boundary)
        if got is None:
            return math.inf
        raw, bw, lat = got
        return self.cost_model.codecs.fastest(raw, self.cost_model.elem_bytes, bw, lat if latency else 0.0)

    def _query(self, s: _Setup, i: int, a: int, e: int, k: int) -> SliceQuery:
        return SliceQuery(start=a, end=e, micro_batch=s.per_replica(i), dp=s.lane_width(i), in_flight=k, batch=s.batch,
                          lanes=s.lane(i))

    def _reach(self, s: _Setup, i: int, k: int, end: int, limit: float) -> int:
        isl = s.order[i]
        if self._fast:
            assert isinstance(self.parallelizer, DefaultParallelizer)
            # a lane may take `lanes` x the stage's pace per micro-batch
            return self.parallelizer.reach(isl, s.per_replica(i), s.lane_width(i), k, end, limit * s.lane(i),
                                           batch=s.batch, lanes=s.lane(i))
        assert self.parallelizer is not None
        par = self.parallelizer

        def ok(a: int) -> bool:
            c = par.cost(self._query(s, i, a, end, k), isl)
            return c is not None and c.pace_s <= limit

        if not ok(end - 1):
            return end
        lo, hi = 0, end - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if ok(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def greedy(self, s: _Setup, limit: float) -> list[tuple[int, int, int, int]] | None:
        """Stages (chain index of the island, start, end, in_flight) placing every layer within `limit`.

        A link is usable when its time on the wire fits `limit`; its latency is left to the boundary's
        window (`_windows`), which never takes layers from a stage.
        """
        max_stages = self.cost_model.options.max_stages
        e = self.cost_model.num_layers
        placed: list[tuple[int, int, int, int]] = []
        later: int | None = None
        need, after = -1, 0  # the next stage's warm-up forwards and the lanes after it (`atoll.plan.lane_warmups`)
        for i in range(len(s.order) - 1, -1, -1):
            if e == 0:
                break
            # (no link at all is never usable, even with no limit: `inf > inf` would let it through)
            if later is not None and not self._fastest_link(s, i, later, e) <= min(limit, sys.float_info.max):
                continue
            for _ in range(s.caps[i]):
                if e == 0 or len(placed) >= max_stages:
                    break
                # two stages on one island still pass activations over the island's own links
                if later == i and not self._fastest_link(s, i, i, e) <= min(limit, sys.float_info.max):
                    break
                # micro-batches in flight on a lane of it: strict 1F1B's p - i without lanes
                lanes = s.lane(i)
                warm = lane_warmup(lanes, after, need)
                k = lane_in_flight(warm, lanes, s.m)
                a = self._reach(s, i, k, e, limit)
                if a == e:
                    break
                placed.append((i, a, e, k))
                need, after = warm, after + lanes
                e = a
                later = i
        if e != 0:
            return None
        placed.reverse()
        return placed

    def _windows(self, s: _Setup, placed: list[tuple[int, int, int, int]], costs: list[IslandCost],
                 cycle: float) -> list[int]:
        """Extra micro-batches in flight per stage (deep windows) for a placement with strict 1F1B `costs`.

        Boundary t wants `window_depth` of its round trip at the fastest codec (latency both ways plus both
        transfers) against `cycle`. Stage s may hold up to cap_s extra micro-batches: as many as fit in its
        memory without changing its cost (no recomputation or ZeRO stage forced by them). Extras never
        shrink upstream (e_s >= e_{s+1}, which keeps every window at least strict), so e_s is at most the
        smallest cap of stages 0..s; from the last stage back, each takes its downstream's extra plus its
        boundary's depth, within that bound.
        """
        n = len(placed)
        depth = [window_depth(2 * self._fastest_link(s, i, j, e, latency=True), cycle)
                 for (i, _, e, _), (j, _, _, _) in zip(placed, placed[1:])]
        if not any(depth):
            return [0] * n
        want = sum(depth)
        par = self.parallelizer
        assert par is not None
        caps = []
        for (i, a, e, k), c in zip(placed, costs):
            # beyond m - k + 1 extra the warm-up already runs every micro-batch
            lo, hi = 0, max(0, min(want, s.m - k + 1))
            while lo < hi:
                mid = (lo + hi + 1) // 2
                got = par.cost(self._query(s, i, a, e, min(k + mid, s.m)), s.order[i])
                if got is not None and got.time_s <= c.time_s * (1 + 1e-12):
                    lo = mid
                else:
                    hi = mid - 1
            caps.append(lo)
        bound = list(itertools.accumulate(caps, min))
        extra = [0] * n
        for t in range(n - 2, -1, -1):
            extra[t] = min(extra[t + 1] + depth[t], bound[t])
        return extra

    def prefixes(self, s: _Setup) -> list[_Setup]:
        """The setup's chain cut after each island: the greedy fills from the back, so the chain's last
        island is always used; shorter chains let a later island be left out."""
        return [s.cut(j) for j in range(len(s.order), 0, -1) if s.caps[j - 1] > 0]

    def min_bottleneck(self, s: _Setup, rel_tol: float = 3e-3) -> float | None:
        """The smallest bottleneck T of any chain of the setup's islands in its order (None: nothing fits)."""
        ts = [t for p in self.prefixes(s) if (t := self._chain_bottleneck(p, rel_tol)) is not None]
        return min(ts, default=None)

    def _chain_bottleneck(self, s: _Setup, rel_tol: float = 3e-3) -> float | None:
        """The smallest T for which `greedy` places every layer, using the chain's last island."""
        first = self.greedy(s, math.inf)
        if first is None:
            return None
        hi = self._evaluate(s, first).bottleneck_s
        units = min(sum(s.caps), self.cost_model.options.max_stages)
        # no stage can be faster than all the work spread over every unit
        lo = max(hi / (2 * units), 0.999 / self._rate(s, units)[0])
        for _ in range(60):  # make lo infeasible: a true lower end for the bisection
            if self.greedy(s, lo) is None:
                break
            hi, lo = lo, lo / 2
        while hi - lo > rel_tol * hi:
            mid = (lo + hi) / 2
            if self.greedy(s, mid) is not None:
                hi = mid
            else:
                lo = mid
        return hi

    def _evaluate(self, s: _Setup, placed: list[tuple[int, int, int, int]]) -> Candidate:
        cm = self.cost_model
        costs = []
        for i, a, e, k in placed:
            c = self.parallelizer.cost(self._query(s, i, a, e, k), s.order[i])  # type: ignore[union-attr]
            assert c is not None, "greedy placed a stage that does not fit"
            costs.append(c)
        cycle = max([c.pace_s for c in costs] + [self._fastest_link(s, i, j, e)
                                                 for (i, _, e, _), (j, _, _, _) in zip(placed, placed[1:])])
        extras = self._windows(s, placed, costs, cycle)
        stages: list[StageChoice] = []
        for (i, a, e, k), c, x in zip(placed, costs, extras):
            isl = s.order[i]
            if x:  # the same time, with the memory of the deeper window
                c = self.parallelizer.cost(self._query(s, i, a, e, min(k + x, s.m)), isl)  # type: ignore[union-attr]
                assert c is not None, "_windows gave a stage a depth that does not fit"
            params = cm.model.slice_params(a, e)
            sync = cm.grad_sync_seconds(params, isl, c.dp, c.tp)
            opt = cm.optimizer_seconds(isl, params, c.zero, c.dp, c.tp)
            stages.append(StageChoice(island=isl, start=a, end=e, cost=c, sync_s=sync, optimizer_s=opt, in_flight=x))
        if len(stages) > 1 and cm.model.config.tied_head:  # the tied weight's copies sum their gradients
            tied = tied_sync_seconds(cm, self.cluster, stages[0].island, stages[-1].island)
            for k in (0, -1):
                stages[k] = replace(stages[k], sync_s=stages[k].sync_s + tied)
        if cm.options.zero_bubble and len(stages) > 1:
            stages = [self._deferred(st, n, s.m) for n, st in enumerate(stages)]
        cycle = max(st.cost.pace_s for st in stages)
        links: list[LinkChoice] = []
        for n, ((i, _, e, _), (j, _, _, _), x, y) in enumerate(zip(placed, placed[1:], extras, extras[1:])):
            # tp rank 0 of a replica alone sends and receives (atoll.node.tp): a stream per replica
            got = self._link(s, i, j, e, streams=min(stages[n].cost.dp // stages[n].cost.lanes,
                                                     stages[n + 1].cost.dp // stages[n + 1].cost.lanes))
            assert got is not None
            raw, bw, lat = got
            # a transfer hides under the cycle; with a deep window of depth d its latency, and a round trip
            # up to the share of d cycles the window tolerates, hide too
            hidden = ((2 + x - y) * (1 + WINDOW_TOLERANCE) - 2) * cycle / 2
            codec, sec = cm.codecs.choose(raw, cm.elem_bytes, bw, lat, max(cycle, min(cycle + lat, hidden)))
            links.append(LinkChoice(codec=codec, raw_bytes=raw, forward_s=sec, backward_s=sec,
                                    latency_s=min(lat, sec)))
        times = PipelineTimes(
            stages=tuple(self._stage_times(st, deferred=True) for st in stages),
            links=tuple(LinkTimes(forward_s=x.forward_s, backward_s=x.backward_s, latency_s=x.latency_s)
                        for x in links),
            num_micro_batches=s.m, in_flight=tuple(st.in_flight for st in stages),
            defer=tuple(st.defer for st in stages) if any(st.defer for st in stages) else ())
        cand = Candidate(order=tuple(i.id for i in s.order), micro_batch=s.batch, num_micro_batches=s.m,
                         stages=stages, links=links, times=times, estimate_s=closed_form_step(times),
                         placed=tuple(placed))
        if times.defer:  # ranked as the faster of the two: a split backward may cost more than deferring fills
            plain = replace(times, defer=(), stages=tuple(self._stage_times(st, deferred=False) for st in stages))
            estimate = closed_form_step(plain)
            if estimate <= cand.estimate_s:
                return replace(cand, stages=[_undeferred(st) for st in stages], times=plain, estimate_s=estimate)
        return cand

    def _stage_times(self, st: StageChoice, *, deferred: bool) -> StageTimes:
        """What the simulator needs of a stage: its gradient sync overlaps the last backward action, which is
        the last micro-batch's deferred weight gradients where the stage defers them (`deferred`)."""
        c = st.cost
        window = st.weight_s if deferred and st.defer else c.backward_s
        cm = self.cost_model
        params = cm.model.slice_params(st.start, st.end)
        hidden = cm.sync_hidden_seconds(cm.grad_sync_seconds(params, st.island, c.dp, c.tp), params, zero=c.zero,
                                        dp=c.dp, tp=c.tp, window_s=window)  # not the tied weight's sum
        return StageTimes(forward_s=c.forward_s, backward_s=c.backward_s, sync_s=st.sync_s, sync_hidden_s=hidden,
                          optimizer_s=st.optimizer_s, weight_s=st.weight_s, split_s=st.split_s, lanes=c.lanes)

    def _deferred(self, st: StageChoice, n: int, m: int) -> StageChoice:
        """Stage `n` of its pipeline with its weight gradients deferred: as much of them as memory allows, as
        deep as helps (`n + 1` micro-batches, the zero-bubble depth, `atoll.node.schedule.zero_bubble_depths`).
        Every layer at the deepest depth that holds them; where not even one micro-batch of every layer's fits,
        as many layers as fit one deep defer theirs and the rest compute them in backward
        (`StagePlan.defer_layers`), as deep as those fit (a shorter input-gradient backward shortens the
        pipeline's critical path more than a deeper deferral of less, as the simulator shows on the benchmark's
        memory-bound plans). Unchanged where the runtime computes them in backward (ZeRO-2 and above) or nothing
        worth an action of its own fits."""
        c, cm = st.cost, self.cost_model
        if c.zero >= 2:
            return st
        t = cm.table(st.island, c.micro_batch, c.tp)
        w = t.weight(st.start, st.end)
        if w <= 0 or w < cm.options.min_deferred_s:  # too short to pay for an action of its own
            return st
        room = cm.memory_capacity(st.island) - c.memory_bytes
        deepest = min(n + 1, m)
        per, act = cm.deferred_parts(t, st.start, st.end, c.recompute_layers)
        k = deepest_deferral(per, act, room, deepest)  # every layer, as deep as fits (the zero-bubble depth when it does)
        split = t.split(st.start, st.end)
        if k:
            return replace(st, defer=k, weight_s=min(w, c.backward_s + split), split_s=split,
                           defer_bytes=held_deferred(per, act, k))
        # not every layer fits even one micro-batch deep: as many layers as fit, then as deep as they fit. The
        # layers that give the most weight-gradient time per byte held come first (blocks alike, in their order;
        # the head's output gradient is large for its time)
        ratio = {i: t.weight(i, i + 1) / t.stash(i, i + 1) for i in range(st.start, st.end) if t.stash(i, i + 1) > 0}
        top = max(ratio.values(), default=1.0)
        chosen: list[int] = []
        per = 0
        for i in sorted(ratio, key=lambda i: (-round(ratio[i] / top, 6), i)):
            more = per + t.stash(i, i + 1)
            if deepest_deferral(more, act, room, 1):  # the bytes held grow with each layer added
                chosen.append(i)
                per = more
        wk = sum(t.weight(i, i + 1) for i in chosen)
        if not chosen or wk < cm.options.min_deferred_s:
            return st
        k = deepest_deferral(per, act, room, deepest)
        split = sum(t.split(i, i + 1) for i in chosen)
        return replace(st, defer=k, defer_layers=tuple(sorted(chosen)), weight_s=min(wk, c.backward_s + split),
                       split_s=split, defer_bytes=held_deferred(per, act, k))

    def _plain_if_faster(self, cand: Candidate) -> Candidate:
        """A simulated candidate (`step_s` set), or, where its stages defer weight gradients and plain 1F1B
        simulates faster (a pipeline whose deferred work lands where a stage would otherwise start its next
        micro-batch), the same pipeline without the deferral. The search ranks candidates with their deferral and
        asks this of the ones it returns."""
        if not cand.times.defer:
            return cand
        plain = replace(cand.times, defer=())
        if step_lower_bound(plain) >= cand.step_s:  # plain 1F1B cannot be faster: no need to simulate it
            return cand
        step = simulate(plain).step_time_s
        if step >= cand.step_s:
            return cand
        stages = [_undeferred(st) for st in cand.stages]
        return replace(cand, stages=stages, times=plain, estimate_s=closed_form_step(plain), step_s=step)

    def _filled_if_faster(self, cand: Candidate, s: _Setup) -> Candidate:
        """A simulated candidate, or the same pipeline with deeper warm-ups where that simulates faster: stage i
        runs up to p - i - 1 more forwards before its first backward (`StagePlan.in_flight`), as far as its
        memory holds them at the same cost. Under strict 1F1B a stage waits from its warm-up's end until its
        first gradient comes back; the extra forwards fill that wait, and with deferred weight gradients filling
        the drain (zero-bubble) little of either is left (ZB-H2, Qi et al., ICLR 2024, which doubles the first
        stage's activations for it).

        Both compete for the same memory, so two ways are tried: the warm-ups in what the deferred weight
        gradients leave, and the warm-ups first with the deferral then fitted in what they leave; each at the
        full depth and at half of it. The search's own deep windows (slow links) are kept as a floor."""
        n = len(cand.stages)
        if n < 2 or not self.cost_model.options.fill_warmup:
            return cand
        best = cand
        tried: set[tuple[tuple[int, int, tuple[int, ...]], ...]] = {
            tuple((st.in_flight, st.defer, st.defer_layers) for st in cand.stages)}
        full = [max(st.in_flight, min(k - 1, s.m - k)) for st, (_, _, _, k) in zip(cand.stages, cand.placed)]
        for warmups_first in (False, True):
            base = [_undeferred(st) if warmups_first else st for st in cand.stages]
            costs = [self._deeper(s, st, placed) for st, placed in zip(base, cand.placed)]
            caps = [st.in_flight + len(got) - 1 for st, got in zip(base, costs)]
            # the warm-ups first too only where a stage's deferred products left it short of its full warm-up
            trade = not warmups_first and caps != full and any(st.defer for st in cand.stages)
            for idx in range(1, n):  # warm-ups may not grow downstream (`PipelineTimes`): one more extra at most
                caps[idx] = min(caps[idx], caps[idx - 1] + 1)
            for half in (False, True):
                if half and best is not cand:
                    break  # the full depth gained: half of it fills less
                # the floor and the halving keep the one-more-at-most rule that both `caps` and the floor hold
                extra = [max(st.in_flight, (x + 1) // 2 if half else x) for st, x in zip(base, caps)]
                stages = [replace(st, in_flight=x, cost=got[x - st.in_flight])
                          for st, x, got in zip(base, extra, costs)]
                if warmups_first and self.cost_model.options.zero_bubble:
                    stages = [self._deferred(st, k, s.m) for k, st in enumerate(stages)]
                key = tuple((st.in_flight, st.defer, st.defer_layers) for st in stages)
                if key in tried:
                    continue
                tried.add(key)
                times = replace(cand.times, in_flight=tuple(extra),
                                stages=tuple(replace(t, weight_s=st.weight_s, split_s=st.split_s)
                                             for t, st in zip(cand.times.stages, stages)),
                                defer=tuple(st.defer for st in stages) if any(st.defer for st in stages) else ())
                if step_lower_bound(times) >= best.step_s:
                    continue
                step = simulate(times).step_time_s
                self.stats.simulated += 1
                if step < best.step_s * (1 - 1e-9):
                    best = replace(cand, stages=stages, times=times, estimate_s=closed_form_step(times),
                                   step_s=step)
            if not trade:
                break
        return best

    def _deeper(self, s: _Setup, st: StageChoice, placed: tuple[int, int, int, int]) -> list[IslandCost]:
        """The stage's cost at its own extra depth and at each further extra micro-batch in flight, up to p - i - 1
        of them (i its place), while the parallelizer keeps its time and shape and the memory holds them beside
        its deferred weight gradients."""
        i, a, e, k = placed
        c, cm, par = st.cost, self.cost_model, self.parallelizer
        assert par is not None
        room = cm.memory_capacity(st.island) - st.defer_bytes
        shape = (c.dp, c.tp, c.zero, tuple(c.recompute_layers))
        got = [c]
        want = min(k - 1, s.m - k)  # strict 1F1B holds p - i micro-batches (`placed`): p - i - 1 more at most
        for x in range(st.in_flight + 1, want + 1):
            g = par.cost(self._query(s, i, a, e, min(k + x, s.m)), st.island)
            if (g is None or g.time_s > c.time_s * (1 + 1e-12) or g.memory_bytes > room
                    or (g.dp, g.tp, g.zero, tuple(g.recompute_layers)) != shape):
                break  # memory grows with depth: the first miss ends it
            got.append(g)
        return got

    def best_for(self, s: _Setup) -> Candidate | None:
        """The best candidate of any chain of the setup's islands in its order."""
        got = [c for p in self.prefixes(s) if (c := self.chain_best(p)) is not None]
        return min(got, key=lambda c: c.estimate_s, default=None)

    def chain_best(self, s: _Setup) -> Candidate | None:
        """The best candidate whose last stage is on the chain's last island."""
        t = self._chain_bottleneck(s)
        if t is None:
            return None
        best: Candidate | None = None
        seen: set[tuple] = set()
        for f in self.cost_model.options.refine_factors:
            placed = self.greedy(s, t * f)
            if placed is None:
                continue
            key = tuple(placed)
            if key in seen:
                continue
            seen.add(key)
            cand = self._evaluate(s, placed)
            self._note_usage(cand, s)
            if best is None or cand.estimate_s < best.estimate_s:
                best = cand
        return best

    def _note_usage(self, cand: Candidate, s: _Setup) -> None:
        """Keep `cand` as its islands' usage's best (`SearchStats.using`) and its total's (`near_equal`)."""
        per: dict[str, int] = {}
        for st in cand.stages:
            per[st.island.id] = per.get(st.island.id, 0) + st.cost.gpus
        for key in [*per.items(), ("", cand.gpus)]:
            got = self.stats.using.get(key)
            if got is None or cand.estimate_s < got.estimate_s:
                self.stats.using[key] = cand
                self._setup_of[id(cand)] = s

    def using_more(self, island: str, used: int) -> Candidate | None:
        """The simulated best candidate the search composed that runs more than `used` devices of `island` ("":
        of the whole cluster), or None when it composed none."""
        got = [c for (i, g), c in self.stats.using.items() if i == island and g > used]
        best: Candidate | None = None
        for c in got:
            if not c.step_s:
                c.step_s = simulate(c.times).step_time_s
            if best is None or c.step_s < best.step_s:
                best = c
        return best

    def finish(self, cand: Candidate, refine: bool = True) -> Candidate:
        """A composed candidate (`stats.using`) simulated, and with `refine` refined and filled as the search's
        leading ones are."""
        if not cand.step_s:
            cand.step_s = simulate(cand.times).step_time_s
        s = self._setup_of.get(id(cand))
        if s is None or not refine:
            return cand
        return self._filled_if_faster(self._plain_if_faster(self.refine(cand, s)), s)

    def _near_equal(self, top: list[Candidate]) -> list[Candidate]:
        """`top` led by the preferred of the candidates within `near_equal` of the fastest (with the best composed
        pipeline of each larger device count, refined, when it comes within it): the most devices, the fewest
        stages, the largest micro-batch."""
        tol = self.cost_model.options.near_equal
        pool = list(top)
        for (i, g), c in self.stats.using.items():
            if i or g <= top[0].gpus or any(c is t for t in pool):
                continue
            if not c.step_s:
                c.step_s = simulate(c.times).step_time_s
            if c.step_s <= top[0].step_s * (1 + tol) * (1 + tol):  # refinement may bring it within
                s = self._setup_of[id(c)]
                pool.append(self._filled_if_faster(self._plain_if_faster(self.refine(c, s)), s))
        fastest = min(c.step_s for c in pool)
        near = [c for c in pool if c.step_s <= fastest * (1 + tol)]
        pick = min(near, key=_preference)
        return [pick] + sorted((c for c in pool if c is not pick), key=lambda c: c.step_s)

    # --- the whole search -----------------------------------------------------------------------------

    def search(self) -> list[Candidate]:
        """The best candidates, simulated, best first (empty when nothing fits).

        Setups are visited by their lower bound; a candidate is simulated unless its own lower bound
        (`step_lower_bound`) already reaches the best simulated step; the search stops once a setup's bound
        reaches it. Then the same over `split_setups` of the best chains found (free order).
        """
        top: list[Candidate] = []
        source: dict[int, _Setup] = {}
        best = math.inf
        seeds: list[_Setup] = []
        reach = 1 + self.cost_model.options.near_equal  # a near-equal step may win (`_near_equal`): not pruned
        for phase in range(2):
            setups = sorted(self.setups() if phase == 0 else self.split_setups(seeds), key=lambda s: s.bound)
            self.stats.candidates += len(setups)
            for n, s in enumerate(setups):
                if s.bound >= best * reach:
                    self.stats.pruned += len(setups) - n
                    for rest in setups[n:]:  # sorted by bound: the first of each usage has its least
                        for isl, w, c in zip(rest.order, rest.widths, rest.caps):
                            self.stats.bounds.setdefault((isl.id, w * c), rest.bound)
                    break
                self.stats.evaluated += 1
                cand = self.chain_best(s)
                if cand is None:
                    self.stats.infeasible += 1
                    continue
                if step_lower_bound(cand.times) >= best * reach:
                    continue
                cand.step_s = simulate(cand.times).step_time_s
                self.stats.simulated += 1
                top.append(cand)
                source[id(cand)] = s
                best = min(best, cand.step_s)
            top.sort(key=lambda c: c.step_s)
            seeds = [source[id(c)] for c in top[:SPLIT_SEEDS]]
        top = _distinct(top)
        if self.cost_model.options.near_equal > 0:  # the preferred of the near-equal ones are refined too
            tol = 1 + self.cost_model.options.near_equal
            near = sorted((c for c in top if c.step_s <= top[0].step_s * tol * tol), key=_preference)
            top = near + [c for c in top if c.step_s > top[0].step_s * tol * tol]
        top = top[:self.cost_model.options.simulate_top]
        top = [self._filled_if_faster(self._plain_if_faster(self.refine(c, source[id(c)])), source[id(c)])
               for c in top]
        top.sort(key=lambda c: c.step_s)
        if top and self.cost_model.options.near_equal > 0:
            top = self._near_equal(top)
        return top

    def refine(self, cand: Candidate, s: _Setup, budget: int = REFINE_BUDGET) -> Candidate:
        """The candidate with its layer cuts tuned after its stages' islands and widths are fixed: one layer
        at a time moves across a boundary (either way) while the simulated step improves, at most `budget`
        simulations. The bisection balances the bottleneck alone; this sees what it does not: the first
        stage's exposed all-reduce and optimizer, fill and drain, transfers that grow or shrink with the cut,
        and stages whose time or memory (ZeRO, recomputation) jumps at a layer."""
        best, tried = cand, 0
        improved = True
        while improved and tried < budget:
            improved = False
            placed = list(best.placed)
            for t in range(len(placed) - 1):
                for delta in (-1, 1):
                    if tried >= budget:
                        break
                    (i, a, e, k), (j, _, e2, k2) = placed[t], placed[t + 1]
                    cut = e + delta
                    if not a < cut < e2:
                        continue
                    moved = placed[:t] + [(i, a, cut, k), (j, cut, e2, k2)] + placed[t + 2:]
                    if any(self.parallelizer.cost(self._query(s, x, lo, hi, kk), s.order[x]) is None  # type: ignore[union-attr]
                           for x, lo, hi, kk in moved[t:t + 2]):
                        continue
                    if math.isinf(self._fastest_link(s, i, j, cut)):
                        continue
                    c = self._evaluate(s, moved)
                    if step_lower_bound(c.times) >= best.step_s:
                        continue
                    tried += 1
                    c.step_s = simulate(c.times).step_time_s
                    self.stats.simulated += 1
                    if c.step_s < best.step_s * (1 - 1e-9):
                        best, placed, improved = c, moved, True
        return best
