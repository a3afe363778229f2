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

Every baseline is evaluated by the planner's own cost model (the same compute, transfer, codec, all-reduce
and memory rules) and the same 1F1B simulator. When a stage does not fit in memory every group is cut into 2,
4, ... equal stages; a baseline that still does not fit is reported as infeasible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from atoll.coordinator.planner.cluster import Cluster, Island
from atoll.coordinator.planner.costmodel import CostModel
from atoll.coordinator.planner.multipipe import slowest_link
from atoll.coordinator.planner.parallelizer import DefaultParallelizer, SliceQuery
from atoll.coordinator.planner.simulator import LinkTimes, PipelineTimes, StageTimes, simulate


@dataclass(frozen=True)
class Stage:
    island: Island
    start: int
    end: int
    dp: int
    members: tuple[str, ...] = ()
    """Islands the stage's devices come from (empty: just `island`)."""

    @property
    def sources(self) -> tuple[str, ...]:
        return self.members or (self.island.id,)


@dataclass(frozen=True)
class Result:
    name: str
    step_s: float | None
    """Simulated step time; None when the baseline does not fit."""
    detail: str

    def tokens_per_s(self, tokens_per_step: int) -> float:
        return tokens_per_step / self.step_s if self.step_s else 0.0


def evaluate(cm: CostModel, cluster: Cluster, stages: list[Stage], pipeline_batch: int) -> PipelineTimes | None:
    """Times of one pipeline whose micro-batch of `pipeline_batch` sequences is shared by each stage's replicas
    (ceil(B / dp) sequences on the busiest replica; ceil(global batch / B) micro-batches, the last one
    counted whole when it is not); None when a stage does not fit."""
    m = math.ceil(cm.train.global_batch / pipeline_batch)
    par = DefaultParallelizer(cm)
    p = len(stages)
    out: list[StageTimes] = []
    for i, s in enumerate(stages):
        b = math.ceil(pipeline_batch / s.dp)
        c = par.cost(SliceQuery(start=s.start, end=s.end, micro_batch=b, dp=s.dp, in_flight=min(p - i, m)), s.island)
        if c is None:
            return None
        params = cm.model.slice_params(s.start, s.end)
        out.append(StageTimes(forward_s=c.forward_s, backward_s=c.backward_s,
                              sync_s=cm.allreduce_seconds(params * cm.grad_bytes_per_param, s.dp, s.island),
                              optimizer_s=cm.optimizer_seconds(s.island, params, c.zero, s.dp)))
    links: list[LinkTimes] = []
    cycle = max(x.forward_s + x.backward_s for x in out)
    for s, nx in zip(stages, stages[1:]):
        link = slowest_link(cluster, [s.sources, nx.sources])
        if link is None:
            return None
        streams = min(s.dp, nx.dp)
        bw = cm.stream_bandwidth(s.island, nx.island, link, streams, streams)
        raw = cm.model.boundary_bytes(s.end, math.ceil(pipeline_batch / streams), cm.train.seq_len, cm.train.dtype)
        _, sec = cm.codecs.choose(raw, cm.elem_bytes, bw, link.latency_s, cycle)
        links.append(LinkTimes(forward_s=sec, backward_s=sec))
    return PipelineTimes(stages=tuple(out), links=tuple(links), num_micro_batches=m)


def _flat_chunk(cluster: Cluster, parts: list[tuple[Island, int]]) -> tuple[Island, tuple[str, ...]]:
    """A stage made of devices from several islands, as one island that runs at its slowest member's pace,
    holds what its smallest member holds, and all-reduces over its slowest link."""
    if len(parts) == 1:
        return parts[0][0], ()
    isls = [i for i, _ in parts]
    ids = tuple(i.id for i in isls)
    slow = min(isls, key=lambda i: i.device.tflops_16)
    inner = min([i.inter_node_bandwidth for i in isls]
                + [lk.bandwidth for a in ids for b in ids if a < b and (lk := cluster.link(a, b)) is not None])
    dev = replace(slow.device, tflops_16=min(i.device.tflops_16 for i in isls),
                  tflops_32=min(i.device.tflops_32 for i in isls), memory_gb=min(i.device.memory_gb for i in isls))
    return replace(slow, id="+".join(ids), device=dev, gpus=sum(n for _, n in parts),
                   gpus_per_node=min(i.gpus_per_node for i in isls), inter_node_bandwidth=inner,
                   intra_node_bandwidth=min(i.intra_node_bandwidth for i in isls), latency_s=max(i.latency_s for i in isls)), ids


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
            need, parts = width, []
            while need:
                isl, left = queue[0]
                take = min(need, left)
                parts.append((isl, take))
                need -= take
                queue[0][1] -= take
                if queue[0][1] == 0:
                    queue.pop(0)
            chunks.append(parts)
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
