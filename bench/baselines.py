"""Baseline placements the planner is compared with (for the benchmark, not for use).

- ``uniform``: one pipeline over every GPU, one stage per group in the cluster file's order, layers split
  uniformly per GPU (a group's share of layers is its share of the GPUs), heterogeneity ignored;
- ``largest-class``: only the largest island of the device class with the most aggregate peak FLOPS, run
  homogeneously (Megatron style: p equal stages of uniform layers, the best p, width and micro-batch);
- ``flops-proportional``: without islands: every GPU in the file's order in one flat pool cut into p
  equal-width stages, each stage's share of the layers its share of the peak FLOPS; a stage that mixes
  device classes runs at its slowest device's pace and all-reduces over its slowest link.

And a reference beside them (``islands-flops``): one stage per island, layers in proportion to the
island's FLOPS, the simplest heterogeneity-aware split, to show what the planner's search adds to it.

Then the strategies of three published heterogeneous planners, re-implemented in this cost model
(``PUBLISHED``; each function's docstring says what it keeps of its paper and how that was checked):
``sailor-like`` (Strati et al., SOSP'25), ``metis-like`` (Um et al., USENIX ATC'24) and ``flashflex-like``
(Yan et al., 2024). They search their own spaces with this cost model's compute, memory (the island
parallelizer's tensor parallelism, ZeRO and recomputation choices are theirs too), links and simulator, so the planner is compared
with their strategies, not with their cost models.

Every baseline is evaluated by the planner's own cost model (the same compute, transfer, codec, all-reduce
and memory rules) and the same 1F1B simulator. When a stage does not fit in memory every group is cut into 2,
4, ... equal stages; a baseline that still does not fit is reported as infeasible.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from atoll.coordinator.planner.cluster import Cluster, Island, Link
from atoll.coordinator.planner.costmodel import CostModel
from atoll.coordinator.planner.multipipe import slowest_link
from atoll.coordinator.planner.parallelizer import DefaultParallelizer, SliceQuery
from atoll.coordinator.planner.simulator import LinkTimes, PipelineTimes, StageTimes, closed_form_step, simulate
from atoll.plan import PipelinePlan, Plan, StagePlan, lane_in_flight, lane_warmups


@dataclass(frozen=True)
class Stage:
    island: Island
    start: int
    end: int
    dp: int
    members: tuple[str, ...] = ()
    """Islands the stage's devices come from (empty: just `island`)."""
    parts: tuple[tuple[Island, int, int], ...] = ()
    """A stage on devices of several islands: (island, devices, sequences of each pipeline micro-batch they
    run) per island; it runs at its slowest part's pace and all-reduces as `island` (a `_flat_chunk`) does.
    Empty: `dp` devices of `island` sharing each micro-batch evenly."""
    lanes: int = 1
    """The `dp` devices in that many lanes (`atoll.plan`: lane i % lanes takes micro-batch i; not with parts)."""

    @property
    def sources(self) -> tuple[str, ...]:
        return self.members or (self.island.id,)

    def devices(self) -> list[tuple[str, int]]:
        """(island id, devices) the stage takes from each island."""
        return [(i.id, n) for i, n, _ in self.parts] if self.parts else [(self.island.id, self.dp)]


Layout = tuple[tuple[tuple[Stage, ...], int, int], ...]
"""Per pipeline: its stages, its micro-batch (sequences shared by each stage's replicas) and its sequences per
step."""


@dataclass(frozen=True)
class Result:
    name: str
    step_s: float | None
    """Simulated step time; None when the baseline does not fit."""
    detail: str
    layout: Layout = ()
    """What the baseline runs (the published strategies fill it; empty for the others)."""

    def tokens_per_s(self, tokens_per_step: int) -> float:
        return tokens_per_step / self.step_s if self.step_s else 0.0

    def to_plan(self, cm: CostModel) -> Plan:
        """The layout as an atoll plan (a stage on several islands is named after all of them), validated."""
        pipelines = [PipelinePlan(micro_batch=batch, num_micro_batches=math.ceil(share / batch),
                                  stages=[StagePlan(island=s.island.id, layers=(s.start, s.end), dp=s.dp)
                                          for s in stages])
                     for stages, batch, share in self.layout]
        plan = Plan(model=cm.model.name, global_batch=cm.train.global_batch, seq_len=cm.train.seq_len,
                    pipelines=pipelines)
        plan.validate(cm.num_layers)
        return plan


_PARALLELIZERS: dict[int, tuple[CostModel, DefaultParallelizer]] = {}


def _draw(pool: list[list], need: int) -> list[tuple[Island, int]]:
    """Take `need` devices from the front of `pool` ([island, devices left] pairs, used up in order)."""
    parts = []
    while need:
        isl, left = pool[0]
        take = min(need, left)
        parts.append((isl, take))
        need -= take
        pool[0][1] -= take
        if pool[0][1] == 0:
            pool.pop(0)
    return parts

def _parallelizer(cm: CostModel) -> DefaultParallelizer:
    """One island parallelizer per cost model, so its tables are built once per scenario."""
    got = _PARALLELIZERS.get(id(cm))
    if got is None or got[0] is not cm:
        if len(_PARALLELIZERS) > 64:
            _PARALLELIZERS.clear()
        got = _PARALLELIZERS[id(cm)] = (cm, DefaultParallelizer(cm))
    return got[1]


def evaluate(cm: CostModel, cluster: Cluster, stages: list[Stage], pipeline_batch: int,
             batch: int | None = None, *, capped: bool = False) -> PipelineTimes | None:
    """Times of one pipeline whose micro-batch of `pipeline_batch` sequences is shared by each stage's replicas
    (ceil(B / dp) sequences on the busiest replica, or a stage's `parts` as they say; ceil(batch / B)
    micro-batches of the pipeline's `batch` sequences per step (default: the global batch), the last one
    counted whole when it is not); None when a stage does not fit, or, `capped`, when a replica would run
    more sequences per micro-batch than the planner's largest allowed size (`PlannerOptions.micro_batches`;
    the published strategies are held to it as the planner is)."""
    m = math.ceil((batch or cm.train.global_batch) / pipeline_batch)
    par = _parallelizer(cm)
    warm = lane_warmups([s.lanes for s in stages])  # stage i's warm-up: p - i - 1 without lanes
    out: list[StageTimes] = []
    replicas: list[int] = []
    for i, s in enumerate(stages):
        lanes = s.lanes
        runs = s.parts or ((s.island, s.dp // lanes, pipeline_batch),)
        worst = None
        params = cm.model.slice_params(s.start, s.end)
        for isl, devices, rows in runs:
            b = max(1, math.ceil(rows / devices))
            if capped and b > max(cm.options.micro_batches):
                return None
            # the island parallelizer splits the devices into replicas (tensor parallelism within a node)
            c = par.cost(SliceQuery(start=s.start, end=s.end, micro_batch=b, dp=devices, lanes=lanes, batch=rows,
                                    in_flight=lane_in_flight(warm[i], lanes, m)), isl)
            if c is None:
                return None
            opt = cm.optimizer_seconds(isl, params, c.zero, c.dp, c.tp)
            if worst is None or c.time_s > worst[0].time_s:
                worst = (c, max(opt, worst[1] if worst else 0.0))
        assert worst is not None
        c, opt = worst
        replicas.append(max(1, s.dp // c.tp))
        out.append(StageTimes(forward_s=c.forward_s, backward_s=c.backward_s, lanes=lanes,
                              sync_s=cm.grad_sync_seconds(params, s.island, replicas[-1], c.tp), optimizer_s=opt))
    links: list[LinkTimes] = []
    cycle = max((x.forward_s + x.backward_s) / x.lanes for x in out)
    for n, (s, nx) in enumerate(zip(stages, stages[1:])):
        link = slowest_link(cluster, [s.sources, nx.sources])
        if link is None:
            return None
        # one stream per replica pair (tp rank 0 of a replica alone sends), as the composer counts them
        streams = min(replicas[n] // s.lanes, replicas[n + 1] // nx.lanes)
        bw = cm.stream_bandwidth(s.island, nx.island, link, streams, streams)
        raw = -(-cm.model.boundary_bytes(s.end, pipeline_batch, cm.train.seq_len, cm.train.dtype) // streams)
        _, sec = cm.codecs.choose(raw, cm.elem_bytes, bw, link.latency_s, cycle)
        # the simulator lets latency delay a transfer without occupying the link, as for the plan's links
        links.append(LinkTimes(forward_s=sec, backward_s=sec, latency_s=min(link.latency_s, sec)))
    return PipelineTimes(stages=tuple(out), links=tuple(links), num_micro_batches=m)


def _flat_chunk(cluster: Cluster, parts: list[tuple[Island, int]]) -> tuple[Island, tuple[str, ...]]:
    """A stage made of devices from several islands, as one island that runs at its slowest member's pace,
    holds what its smallest member holds, and all-reduces over its slowest link."""
    if len(parts) == 1:
        return parts[0][0], ()
    isls = [i for i, _ in parts]
    ids = tuple(i.id for i in isls)
    slow = min(isls, key=lambda i: i.device.tflops_16)
    inner = min([i.inter_node_bandwidth for i in isls if i.inter_node_bandwidth is not None]
                + [lk.bandwidth for a in ids for b in ids if a < b and (lk := cluster.link(a, b)) is not None])
    dev = replace(slow.device, tflops_16=min(i.device.tflops_16 for i in isls),
                  tflops_32=min(i.device.tflops_32 for i in isls), memory_gb=min(i.device.memory_gb for i in isls))
    return replace(slow, id="+".join(ids), device=dev, gpus=sum(n for _, n in parts),
                   gpus_per_node=min(i.gpus_per_node for i in isls), inter_node_bandwidth=inner,
                   intra_node_bandwidth=min(i.intra_node_bandwidth or inner for i in isls),
                   latency_s=max(i.latency_s for i in isls)), ids


def _split(total: int, weights: list[float]) -> list[int] | None:
    """Layer counts proportional to weights, each >= 1, summing to total (None if impossible)."""
    if len(weights) > total:
        return None
    wsum = sum(weights)
    acc, prev, counts = 0.0, 0, []
    for w in weights:
        acc += w
        cut = round(total * acc / wsum)
        counts.append(cut - prev)
        prev = cut
    # every stage gets at least one layer: take from the largest
    for i, c in enumerate(counts):
        while counts[i] < 1:
            j = max(range(len(counts)), key=lambda k: counts[k])
            counts[j] -= 1
            counts[i] += 1
    return counts


def _proportional(cm: CostModel, cluster: Cluster, weight: dict[str, float], name: str) -> Result:
    islands = list(cluster.islands)
    cuts = {i.id: 1 for i in islands}
    L = cm.num_layers
    best: tuple[float, str] | None = None
    for _ in range(12):
        parts: list[tuple[Island, int, float]] = []  # island, dp, weight of the part
        for isl in islands:
            k = cuts[isl.id]
            parts.extend((isl, isl.gpus // k, weight[isl.id] / k) for _ in range(k))
        counts = _split(L, [w for _, _, w in parts])
        if counts is None:
            break
        stages, a = [], 0
        for (isl, dp, _), n in zip(parts, counts):
            stages.append(Stage(isl, a, a + n, dp))
            a += n
        widest = max(s.dp for s in stages)
        for j in (1, 2, 4, 8, 16):
            times = evaluate(cm, cluster, stages, widest * j)
            if times is None:
                continue
            step = simulate(times).step_time_s
            if best is None or step < best[0]:
                best = (step, f"{len(stages)} stages, micro-batch {widest * j}")
        if best is not None:
            break
        # nothing fit: cut every group into twice as many stages
        if all(cuts[i.id] * 2 > i.gpus for i in islands):
            break
        for isl in islands:
            if cuts[isl.id] * 2 <= isl.gpus:
                cuts[isl.id] *= 2
    if best is None:
        return Result(name, None, "does not fit")
    return Result(name, best[0], best[1])


def uniform(cm: CostModel, cluster: Cluster) -> Result:
    return _proportional(cm, cluster, {i.id: float(i.gpus) for i in cluster.islands}, "uniform")


def island_proportional(cm: CostModel, cluster: Cluster) -> Result:
    """Reference, not one of the three baselines: one stage per island, layers in proportion to its FLOPS."""
    w = {i.id: i.gpus * i.device.peak_flops(cm.train.dtype) for i in cluster.islands}
    return _proportional(cm, cluster, w, "islands-flops")


def flops_proportional(cm: CostModel, cluster: Cluster) -> Result:
    """All GPUs in the cluster file's order as one flat pool, cut into p stages of equal width; each stage's
    share of the layers is its share of the peak FLOPS (no islands: a stage may mix device classes and then
    runs at its slowest device's pace). The best p, micro-batch and memory options are kept."""
    flat: list[tuple[Island, int]] = [(i, i.gpus) for i in cluster.islands]
    n = cluster.total_gpus
    L = cm.num_layers
    best: tuple[float, str] | None = None
    p = 1
    while p <= min(L, n):
        width = n // p
        chunks: list[list[tuple[Island, int]]] = []
        queue = [list(x) for x in flat]
        for _ in range(p):
            chunks.append(_draw(queue, width))
        made = [_flat_chunk(cluster, c) for c in chunks]
        weights = [sum(k * i.device.peak_flops(cm.train.dtype) for i, k in c) for c in chunks]
        counts = _split(L, weights)
        if counts is not None:
            stages, a = [], 0
            for (isl, members), k in zip(made, counts):
                stages.append(Stage(isl, a, a + k, width, members))
                a += k
            for b in cm.options.micro_batches:
                times = evaluate(cm, cluster, stages, width * b)
                if times is None:
                    continue
                step = simulate(times).step_time_s
                if best is None or step < best[0]:
                    best = (step, f"{p} stages x dp {width}, micro-batch {b}")
        p *= 2
    if best is None:
        return Result("flops-proportional", None, "does not fit")
    return Result("flops-proportional", best[0], best[1])


def largest_class(cm: CostModel, cluster: Cluster) -> Result:
    by_class: dict[str, float] = {}
    for i in cluster.islands:
        by_class[i.device.name] = by_class.get(i.device.name, 0.0) + i.gpus * i.device.peak_flops(cm.train.dtype)
    cls = max(by_class, key=lambda k: by_class[k])
    isl = max((i for i in cluster.islands if i.device.name == cls), key=lambda i: i.gpus)
    L = cm.num_layers
    g = cm.train.global_batch
    best: tuple[float, str] | None = None
    p = 1
    while p <= min(L, isl.gpus):
        width = isl.gpus // p
        counts = _split(L, [1.0] * p)
        assert counts is not None
        stages, a = [], 0
        for n in counts:
            stages.append(Stage(isl, a, a + n, width))
            a += n
        for b in cm.options.micro_batches:
            if g % (width * b):
                continue
            times = evaluate(cm, cluster, stages, width * b)
            if times is None:
                continue
            step = simulate(times).step_time_s
            if best is None or step < best[0]:
                best = (step, f"{isl.id}: {p} stages x dp {width}, micro-batch {b}")
        p *= 2
    if best is None:
        return Result("largest-class", None, f"{isl.id}: does not fit")
    return Result("largest-class", best[0], best[1])


BASELINES = (uniform, largest_class, flops_proportional)
REFERENCE = island_proportional


# --- the strategies of published heterogeneous planners ------------------------------------------------


def _speed(cm: CostModel, island: Island) -> float:
    """Sequences per second of one device of the island through the whole model (micro-batch 1)."""
    t = cm.table(island, 1)
    return 1.0 / max(1e-12, t.pf[-1] + t.pb[-1])


def _uniform_layers(total: int, p: int) -> list[int]:
    """Sailor's cut: total // p layers per stage, the remainder one more each on the last stages."""
    base, extra = divmod(total, p)
    return [base + (1 if i >= p - extra else 0) for i in range(p)]


def _stage(cluster: Cluster, parts: list[tuple[Island, int]], start: int, end: int,
           rows: list[int] | None = None) -> Stage:
    """A stage on `parts` (island, devices); `rows` gives each part's sequences of a pipeline micro-batch (a
    stage of one part shares it evenly)."""
    isl, members = _flat_chunk(cluster, parts)
    dp = sum(n for _, n in parts)
    if len(parts) == 1:
        return Stage(isl, start, end, dp)
    assert rows is not None
    return Stage(isl, start, end, dp, members, tuple((i, n, r) for (i, n), r in zip(parts, rows)))


def _shares(total: int, weights: list[float], floor: int = 0) -> list[int]:
    """Integers proportional to weights summing to total (largest remainders), each at least `floor`."""
    raw = [w / sum(weights) * total for w in weights]
    got = [max(floor, int(r)) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - int(raw[i]), reverse=True)
    k = 0
    while sum(got) < total:
        got[order[k % len(order)]] += 1
        k += 1
    while sum(got) > total:
        j = max(range(len(got)), key=lambda i: got[i])
        got[j] -= 1
    return got


def _fits(cm: CostModel, stages: list[Stage], pipeline_batch: int, batch: int) -> list[bool]:
    """Per stage: does it fit in memory at its 1F1B depth."""
    m = math.ceil(batch / pipeline_batch)
    par = _parallelizer(cm)
    out = []
    for i, s in enumerate(stages):
        runs = s.parts or ((s.island, s.dp, pipeline_batch),)
        out.append(all(par.cost(SliceQuery(start=s.start, end=s.end, micro_batch=max(1, math.ceil(r / n)), dp=n,
                                           in_flight=min(len(stages) - i, m), batch=r), isl) is not None
                       for isl, n, r in runs))
    return out


def _by_capacity(cm: CostModel, weights: list[float], build, pipeline_batch: int, batch: int,
                 attempts: int = 4) -> list[Stage] | None:
    """Layers in proportion to each stage's compute capacity; a stage that does not fit in memory gives up
    part of its share and the layers are cut again (Metis' LayerLoadBalancer, as FlashFlex also does)."""
    w = list(weights)
    for _ in range(attempts):
        counts = _split(cm.num_layers, w)
        if counts is None:
            return None
        stages, a = [], 0
        for k, n in enumerate(counts):
            stages.append(build(k, a, a + n))
            a += n
        ok = _fits(cm, stages, pipeline_batch, batch)
        if all(ok):
            return stages
        w = [x if fit else x * 0.7 for x, fit in zip(w, ok)]
    return None


class _Best:
    """Keeps the options of a baseline by the closed-form estimate, simulates the few best at the end."""

    def __init__(self, keep: int = 10) -> None:
        self.keep = keep
        self.options: list[tuple[float, int, list[PipelineTimes], str, Layout]] = []

    def add(self, times: list[PipelineTimes], detail: str, layout: Layout) -> None:
        est = max(closed_form_step(t) for t in times)
        self.options.append((est, len(self.options), times, detail, layout))
        if len(self.options) > 4 * self.keep:
            self.options = sorted(self.options, key=lambda o: o[:2])[:self.keep]

    def result(self, name: str) -> Result:
        best: tuple[float, str, Layout] | None = None
        for _, _, times, detail, layout in sorted(self.options, key=lambda o: o[:2])[:self.keep]:
            step = max(simulate(t).step_time_s for t in times)
            if best is None or step < best[0]:
                best = (step, detail, layout)
        if best is None:
            return Result(name, None, "does not fit")
        return Result(name, best[0], best[1], best[2])


def sailor_like(cm: CostModel, cluster: Cluster) -> Result:
    """Sailor's strategy (Strati et al., "Sailor: Automating Distributed Training over Dynamic, Heterogeneous,
    and Geo-distributed Clusters", SOSP'25): one pipeline of p stages with the layers split uniformly (L // p
    each, the remainder one more on the last stages), D data-parallel replicas per stage drawn from any GPU
    type (heterogeneous data parallelism within a stage: replica r of a stage may be a V100 while replica r of
    the next is an A100), every replica on the same micro-batch size, a stage running at its slowest replica's
    pace (the straggler), per-stage all-reduce over the slowest link among its replicas. Replicas are taken
    from the fastest GPU type first, so slower types are used only when p x D asks for them. The best p, D
    and micro-batch are kept.

    Checked against the authors' planner source (github.com/eth-easl/sailor,
    sailor/Planner/sailor_planner/cpp_src/planner_utils.cpp): `get_stages` (uniform layers, remainder on the
    last stages), `simulate_time_single_stage` (a stage's time is the max over the GPU types of its replicas,
    one micro-batch size for all), `merge_stages_get_time` (replica k of a stage sends to replica k of the next,
    so every stage has the same D). Its per-stage tensor-parallel heuristic (`find_tmp_degrees`: per GPU type
    the smallest tp that fits, raised where tp speeds the stage up) is the island parallelizer's choice here:
    per stage, the fastest dp x tp split of its devices that fits (tp within a node), with ZeRO and
    recomputation where they are needed. Not compared with a plan published in the paper.
    """
    L, g = cm.num_layers, cm.train.global_batch
    speed = {i.id: _speed(cm, i) for i in cluster.islands}
    fastest_first = sorted(cluster.islands, key=lambda i: (-speed[i.id], -i.device.memory_gb, i.id))
    n = cluster.total_gpus
    best = _Best()
    ps = sorted({p for p in range(1, 17)} | {p for p in (20, 24, 32, 40, 48, 64, 96, 128)} | {L})
    for p in (p for p in ps if p <= min(L, n)):
        counts = _uniform_layers(L, p)
        d = 1
        while d * p <= n:
            pool = [[i, i.gpus] for i in fastest_first]
            per_stage = [_draw(pool, d) for _ in range(p)]
            for mb in cm.options.micro_batches:
                batch = d * mb
                if batch > g:
                    continue
                stages, a = [], 0
                for parts, k in zip(per_stage, counts):
                    stages.append(_stage(cluster, parts, a, a + k, [x * mb for _, x in parts]))
                    a += k
                times = evaluate(cm, cluster, stages, batch, capped=True)
                if times is not None:
                    best.add([times], f"{p} stages x {d} replicas (uniform layers), micro-batch {mb}",
                             ((tuple(stages), batch, g),))
            d *= 2
    return best.result("sailor-like")


def _metis_groups(n: int, p: int, variance: float = 0.5, limit: int | None = 4) -> list[tuple[int, ...]]:
    """Metis' device-group shapes (`gen_dgroups_for_stages_with_variance`): p power-of-two stage sizes in
    non-decreasing order summing to n, none below variance x max(n // p, p // n); the most even first (at most
    `limit`; None: all)."""
    low = max(n // p, p // n) * variance
    shapes = [1 << k for k in range(n.bit_length()) if (1 << k) >= low and (1 << k) <= n]
    out: list[tuple[int, ...]] = []

    def rec(left: int, k: int, lo: int, acc: list[int]) -> None:
        if limit is not None and len(out) >= 64:
            return
        if k == 0:
            if left == 0:
                out.append(tuple(acc))
            return
        for i in range(lo, len(shapes)):
            s = shapes[i]
            if s * k > left:
                break
            if shapes[-1] * k < left:
                continue
            rec(left - s, k - 1, i, acc + [s])

    rec(n, p, 0, [])
    out.sort(key=lambda t: (max(t) - min(t), t))
    return out if limit is None else out[:limit]


def _metis_orders(shape: tuple[int, ...], max_permute_len: int = 4) -> list[tuple[int, ...]]:
    """The orders Metis tries of one shape (its `permute`): while more than `max_permute_len` units remain, the
    smallest equal neighbours are merged in pairs from the front (as many pairs as the excess, or half the
    leading run of the smallest, whichever is more; the run counted as the source counts it, one past its
    length), then every distinct order of the units, each unit's groups kept together."""
    units: list[tuple[int, ...]] = [(x,) for x in shape]
    excess = len(units) - max_permute_len
    while excess > 0:
        smallest = sum(units[0])
        run = next((i for i, u in enumerate(units) if u != units[0]), len(units) - 1) + 1
        excess = max(excess, run // 2)
        merged: list[tuple[int, ...]] = []
        for i in range(0, len(units), 2):
            if i // 2 >= excess:
                merged.extend(units[i:])
                break
            if i + 1 >= len(units):
                merged.append(units[i])
            elif sum(units[i]) == smallest and sum(units[i + 1]) == smallest:
                merged.append(units[i] + units[i + 1])
            else:
                merged.extend(units[i:i + 2])
        units = merged
        if excess == len(units) - max_permute_len:  # no merge is left to make
            break
        excess = len(units) - max_permute_len
    return [tuple(x for u in order for x in u) for order in dict.fromkeys(itertools.permutations(units))]


METIS_ORDERS = 6
"""The metis-like search tries at most this many of Metis' orders of each device-group shape (`_metis_orders`)."""


def metis_like(cm: CostModel, cluster: Cluster) -> Result:
    """Metis' strategy (Um et al., "Metis: Fast Automatic Distributed Training on Heterogeneous GPUs", USENIX
    ATC'24): every device laid out in an order of the device types (each permutation of the types: the
    inter-stage plan's node sequence), cut into p consecutive device groups whose sizes are powers of two
    adding up to every device (none below half of n / p), one stage per group; layers in proportion to each
    stage's compute capacity, and a stage that does not fit in memory gives up part of its share before the
    layers are cut again; inside a stage the island parallelizer's dp x tp split (Metis prefers data
    parallelism and takes tp where memory asks for it), a group that mixes types splitting each micro-batch
    among its devices in proportion to their speed; the number of micro-batches searched. The best order, p,
    groups and micro-batch are kept.

    Checked against the authors' source (github.com/SamsungLabs/Metis): search_space/plan.py
    (`InterStagePlanGenerator`: permutations of device types x stage counts x device groups x micro-batch
    counts), search_space/device_group.py (`gen_device_group_shapes`: powers of two;
    `gen_dgroups_for_stages_with_variance`: no group below variance x n / p, variance 0.5), model/load_balancer.py
    (`LayerComputeBalancer`: layers by stage compute performance; `_adj_compute_performance`: a stage short of
    memory keeps about 0.9 x capacity / demand of its share, taken here as 0.7 per attempt since the
    parallelizer answers fit or not, not by how much; `DataLoadBalancer`: a mixed group's batch by speed).
    Its search space checked against the authors' own output: for their example cluster (4 A100 + 4 T4, the
    README's SCALE_VARIANCE=1 and MAX_PERMUTE_LEN=4) the device groups `_metis_groups` and `_metis_orders` give
    are exactly those listed in the repository's results/het_search_space, for every stage count
    (tests/test_baselines.py). Here it runs with the generator's own defaults (variance 0.5, max_permute_len 4),
    every stage count up to 32, at most 6 type orders, and the 4 most even shapes per stage count with up to
    `METIS_ORDERS` orders of each, to run in seconds; widening that to 16 shapes and every order changed no
    in-region scenario's best metis-like plan in `bench.planner` (measured). Not compared with a plan
    published in the paper.
    """
    L, g = cm.num_layers, cm.train.global_batch
    speed = {i.id: _speed(cm, i) for i in cluster.islands}
    classes: dict[str, list[Island]] = {}
    for isl in cluster.islands:
        classes.setdefault(isl.device.name, []).append(isl)
    cls_speed = {c: max(speed[i.id] for i in v) for c, v in classes.items()}
    perms = list(itertools.permutations(classes))
    if len(perms) > 6:
        fast = tuple(sorted(classes, key=lambda c: -cls_speed[c]))
        mem = tuple(sorted(classes, key=lambda c: -classes[c][0].device.memory_gb))
        perms = list(dict.fromkeys([fast, fast[::-1], mem, mem[::-1], *perms[:2]]))
    n = cluster.total_gpus
    best = _Best()
    ps = list(range(1, min(L, n, 32) + 1))  # every stage count, as Metis tries, up to 32
    for perm in perms:
        flat = [(i, i.gpus) for c in perm for i in classes[c]]
        for p in ps:
            for shape in _metis_groups(n, p):
                for groups in _metis_orders(shape)[:METIS_ORDERS]:
                    queue = [list(x) for x in flat]
                    chunks: list[list[tuple[Island, int]]] = []
                    for size in groups:
                        need, parts = size, []
                        while need:
                            isl, left = queue[0]
                            take = min(need, left)
                            parts.append((isl, take))
                            need -= take
                            queue[0][1] -= take
                            if queue[0][1] == 0:
                                queue.pop(0)
                        chunks.append(parts)
                    weights = [sum(k * speed[i.id] for i, k in c) for c in chunks]
                    widest = max(groups)
                    for mb in cm.options.micro_batches:
                        batch = widest * mb
                        if batch > g or g % batch:
                            continue

                        def build(k: int, a: int, e: int, chunks=chunks, batch=batch) -> Stage:
                            parts = chunks[k]
                            rows = _shares(batch, [x * speed[i.id] for i, x in parts], floor=1)
                            return _stage(cluster, parts, a, e, rows)

                        stages = _by_capacity(cm, weights, build, batch, g)
                        if stages is None:
                            continue
                        times = evaluate(cm, cluster, stages, batch, capped=True)
                        if times is not None:
                            best.add([times], f"{' / '.join(perm)}: groups {list(groups)}, micro-batch {batch}",
                                     ((tuple(stages), batch, g),))
    return best.result("metis-like")


def _cross_sync(cm: CostModel, times: PipelineTimes, stages: list[Stage], pipelines: int, link: Link) -> PipelineTimes:
    """A pipeline's stages with the all-reduce across `pipelines` pipelines added (the planner's formula in
    multipipe: a ring over the slowest link between them, carried by a stage's hosts at once, or the whole
    shared capacity of a region link)."""
    p = pipelines
    total_grad = cm.model.total_params * cm.grad_bytes_per_param
    out = []
    for st, s in zip(times.stages, stages):
        nbytes = cm.model.slice_params(s.start, s.end) * cm.grad_bytes_per_param
        if link.shared:
            sec = 2 * (p - 1) / p * total_grad / link.bandwidth
        else:
            hosts = max(1, math.ceil(s.dp / s.island.gpus_per_node))
            sec = 2 * (p - 1) / p * nbytes / (link.bandwidth * hosts)
        out.append(replace(st, sync_s=st.sync_s + sec + 2 * math.ceil(math.log2(p)) * link.latency_s))
    return replace(times, stages=tuple(out))


def flashflex_like(cm: CostModel, cluster: Cluster) -> Result:
    """FlashFlex's strategy (Yan et al., "FlashFlex: Accommodating Large Language Model Training over
    Heterogeneous Environment", 2024): a hierarchical graph partition. The hosts are first cut into P pipelines
    of about equal compute, cutting the fewest fast links (hosts of an island stay together, islands in order
    of speed, so a pipeline is a run of whole hosts that may span two islands); each pipeline's devices are then
    cut into stages (each island's share of the pipeline into s equal groups), layers in proportion to each
    stage's compute with memory repartitioning, and the global batch is shared among the pipelines in
    proportion to their speed (rebalanced once on their simulated steps). Pipelines run data-parallel with each
    other (the planner's cross-pipeline all-reduce). The best P, s and micro-batch per pipeline are kept.

    Checked against the authors' source (github.com/Relaxed-System-Lab/FlashFlex, experimental/partitioner.py):
    METIS partitions the device graph (vertex weights compute, edge weights bandwidth) into `npipeline` parts,
    then each part into K stages, `get_stage_order` orders a pipeline's stages along its best-connected path and
    `create_layer_partition` assigns layers. Here the partition is the balanced contiguous cut of hosts in island
    order that METIS converges to on such graphs (intra-island edges far heavier than the rest), not METIS itself;
    a stage's tensor parallelism is the island parallelizer's choice, the same on every replica of the stage
    (not FlashFlex's asymmetric tp within a stage). Not compared with a plan published in the paper.
    """
    g = cm.train.global_batch
    speed = {i.id: _speed(cm, i) for i in cluster.islands}
    ordered = sorted(cluster.islands, key=lambda i: (-speed[i.id], i.region, i.id))
    hosts: list[tuple[Island, int]] = []
    for isl in ordered:
        left = isl.gpus
        while left:
            take = min(left, isl.gpus_per_node)
            hosts.append((isl, take))
            left -= take
    total = sum(n * speed[i.id] for i, n in hosts)
    best = _Best()
    P = 1
    while P <= min(16, len(hosts), g):
        # contiguous cut of the hosts into P runs of about equal compute
        runs: list[list[tuple[Island, int]]] = [[] for _ in range(P)]
        acc, k = 0.0, 0
        for i, (isl, n) in enumerate(hosts):
            if k < P - 1 and acc >= (k + 1) * total / P and runs[k] and len(hosts) - i >= P - k - 1:
                k += 1
            runs[k].append((isl, n))
            acc += n * speed[isl.id]
        if any(not r for r in runs):
            P *= 2
            continue
        pipes: list[list[tuple[Island, int]]] = []
        for r in runs:
            merged: dict[str, list] = {}
            for isl, n in r:
                merged.setdefault(isl.id, [isl, 0])[1] += n
            pipes.append([(x[0], x[1]) for x in merged.values()])
        groups = [[i.id for i, _ in pp] for pp in pipes]
        link = slowest_link(cluster, groups) if P > 1 else None
        if P > 1 and link is None:
            P *= 2
            continue
        weights = [sum(n * speed[i.id] for i, n in pp) for pp in pipes]
        shares = _shares(g, weights, floor=1)
        for _ in range(2):
            chosen: list[tuple[float, PipelineTimes, str, tuple[Stage, ...], int, int]] = []
            for pp, share in zip(pipes, shares):
                options: list[tuple[float, PipelineTimes, str, tuple[Stage, ...], int]] = []
                for s in (1, 2, 4, 8):
                    units = [(i, n // s) for i, n in pp for _ in range(s)]
                    if any(n < 1 for _, n in units):
                        continue
                    widest = max(n for _, n in units)
                    for mb in cm.options.micro_batches:
                        batch = widest * mb
                        if batch > share:
                            continue

                        def build(k: int, a: int, e: int, units=units) -> Stage:
                            return Stage(units[k][0], a, e, units[k][1])

                        stages = _by_capacity(cm, [n * speed[i.id] for i, n in units], build, batch, share)
                        if stages is None:
                            continue
                        times = evaluate(cm, cluster, stages, batch, share, capped=True)
                        if times is None:
                            continue
                        if link is not None:
                            times = _cross_sync(cm, times, stages, P, link)
                        options.append((closed_form_step(times), times, f"{len(stages)} stages, micro-batch {batch}",
                                        tuple(stages), batch))
                if not options:
                    break
                # the closed form misses the round trip of a slow link: simulate the few it ranks best
                simulated = [(simulate(o[1]).step_time_s, o) for o in sorted(options, key=lambda o: o[0])[:4]]
                step, (_, times, detail, stages, batch) = min(simulated, key=lambda x: x[0])
                chosen.append((step, times, detail, stages, batch, share))
            if len(chosen) < P:
                break
            best.add([c[1] for c in chosen],
                     f"{P} pipelines: " + "; ".join(c[2] for c in chosen[:2]) + ("; ..." if P > 2 else ""),
                     tuple((c[3], c[4], c[5]) for c in chosen))
            # rebalance the shares on what each pipeline's share took
            shares = _shares(g, [c[5] / c[0] for c in chosen], floor=1)
        P *= 2
    return best.result("flashflex-like")


PUBLISHED = (sailor_like, metis_like, flashflex_like)
