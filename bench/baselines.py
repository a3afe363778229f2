"""Baseline placements the planner is compared with (for the benchmark, not for use).

- ``uniform``: one pipeline over every GPU, one stage per group in the cluster file's order, layers split
  uniformly per GPU (a group's share of layers is its share of the GPUs), heterogeneity ignored;
- ``largest-class``: only the largest island of the device class with the most aggregate peak FLOPS, run
  homogeneously (Megatron style: p equal stages of uniform layers, the best p, width and micro-batch);
- ``flops-proportional``: like ``uniform`` but each group's share of layers is its share of the peak FLOPS,
  without islands (stages straddle no device classes, but links and memory do not shape the split).

Every baseline is evaluated by the planner's own cost model (the same compute, transfer, codec, all-reduce
and memory rules) and the same 1F1B simulator. When a stage does not fit in memory every group is cut into 2,
4, ... equal stages; a baseline that still does not fit is reported as infeasible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from atoll.coordinator.planner.cluster import Cluster, Island
from atoll.coordinator.planner.costmodel import CostModel
from atoll.coordinator.planner.parallelizer import DefaultParallelizer, SliceQuery
from atoll.coordinator.planner.simulator import LinkTimes, PipelineTimes, StageTimes, simulate


@dataclass(frozen=True)
class Stage:
    island: Island
    start: int
    end: int
    dp: int


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
    (the first ceil(B / dp) sequences on the busiest replica); None when a stage does not fit."""
    g = cm.train.global_batch
    if g % pipeline_batch:
        return None
    m = g // pipeline_batch
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
        link = cluster.link(s.island.id, nx.island.id)
        if link is None:
            return None
        streams = min(s.dp, nx.dp)
        bw = cm.stream_bandwidth(s.island, nx.island, link, streams, streams)
        raw = cm.model.boundary_bytes(s.end, math.ceil(pipeline_batch / streams), cm.train.seq_len, cm.train.dtype)
        _, sec = cm.codecs.choose(raw, cm.elem_bytes, bw, link.latency_s, cycle)
        links.append(LinkTimes(forward_s=sec, backward_s=sec))
    return PipelineTimes(stages=tuple(out), links=tuple(links), num_micro_batches=m)


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


def flops_proportional(cm: CostModel, cluster: Cluster) -> Result:
    w = {i.id: i.gpus * i.device.peak_flops(cm.train.dtype) for i in cluster.islands}
    return _proportional(cm, cluster, w, "flops-proportional")


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
