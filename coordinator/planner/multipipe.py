"""Several pipelines side by side: islands split into groups, each group running its own pipeline on its
share of the global batch, data-parallel with the others.

Groups tried: one per region, and one per island. Each group's pipeline comes from the composer on that
group alone; the batch is shared in proportion to the groups' throughput (in multiples of a granule, so
every share still divides into micro-batches), and rebalanced once on the shares' measured step times.
A coarse granule can leave a fast group idle (4 A100 and 4 V100 sharing 512 sequences in granules of 64
get 384 and 128, where their speeds ask for about 364 and 148), so when the split is close enough to the
best single pipeline to matter, granules a quarter and a sixteenth as large are tried too.
Every stage then also all-reduces its gradients with the other pipelines (with plain AdamW: the runtime runs
no ZeRO over holders from several pipelines, so none is planned): a ring over the P pipelines on
the slowest link between their islands, 2 (P-1)/P x the stage's gradient bytes, carried by all the
stage's hosts at once on per-host links, or by the whole shared capacity of a region link.

One pipeline or several (`SEVERAL_PIPELINES_MIN_GAIN`): the plan runs several pipelines only when the cost
model predicts them at least 5% faster than the best single pipeline (with heterogeneous stages, in any
island order). One pipeline is simpler to run (one micro-batch count, one gradient group per stage instead
of averaging per layer segment across pipelines cut differently), and a smaller gain is within what the
split's own approximations move (the batch's granules, the cross-pipeline all-reduce's estimate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from atoll.coordinator.planner.cluster import Cluster, Link
from atoll.coordinator.planner.composer import Candidate, Composer
from atoll.coordinator.planner.costmodel import CostModel
from atoll.coordinator.planner.options import TrainSpec
from atoll.coordinator.planner.parallelizer import DefaultParallelizer, IslandParallelizer
from atoll.coordinator.planner.simulator import PipelineTimes, simulate


SEVERAL_PIPELINES_MIN_GAIN = 1.05
"""Several pipelines replace the best single one only when its predicted step is at least this many times
theirs."""


@dataclass(kw_only=True)
class MultiCandidate:
    """Pipelines on disjoint groups of islands, with their batch shares and cross-pipeline all-reduce."""

    pipelines: list[Candidate]
    shares: list[int]
    """Sequences per step of each pipeline."""
    cross_sync_s: list[list[float]]
    """Per pipeline, per stage: the all-reduce with the other pipelines."""
    times: list[PipelineTimes]
    """Per pipeline, the stage times with that all-reduce included."""
    step_s: float

    @property
    def gpus(self) -> int:
        return sum(c.gpus for c in self.pipelines)


def slowest_link(cluster: Cluster, groups: Sequence[Sequence[str]]) -> Link | None:
    """The slowest link between islands of different groups (None when one such pair is not connected)."""
    worst: Link | None = None
    for gi, a_ids in enumerate(groups):
        for b_ids in groups[gi + 1:]:
            for a in a_ids:
                for b in b_ids:
                    lk = cluster.link(a, b)
                    if lk is None:
                        return None
                    if worst is None or lk.bandwidth < worst.bandwidth:
                        worst = lk
    return worst


def _with_cross_sync(cm: CostModel, cands: list[Candidate], link: Link) -> tuple[list[PipelineTimes], list[list[float]]]:
    p = len(cands)
    total_grad = cm.model.total_params * cm.grad_bytes_per_param
    times, cross = [], []
    for c in cands:
        extra = []
        for st in c.stages:
            nbytes = cm.model.slice_params(st.start, st.end) * cm.grad_bytes_per_param
            if link.shared:  # every stage of every pipeline crosses the same capacity at once
                sec = 2 * (p - 1) / p * total_grad / link.bandwidth
            else:
                # per GPU flow (cluster): every GPU of the stage carries its share of the gradients
                sec = 2 * (p - 1) / p * nbytes / (link.bandwidth * st.cost.gpus)
            extra.append(sec + 2 * math.ceil(math.log2(p)) * link.latency_s)
        # a stage whose layers other pipelines hold too averages per layer segment with plain AdamW, not ZeRO
        # (`atoll.node.runner`), so nothing of its reduction overlaps its backward
        stages = tuple(replace(s, sync_s=s.sync_s + x, sync_hidden_s=0.0 if x > 0 else s.sync_hidden_s)
                       for s, x in zip(c.times.stages, extra))
        times.append(replace(c.times, stages=stages))
        cross.append(extra)
    return times, cross


def _granule(g: int, parts: int) -> int:
    """Largest power of two dividing g that still leaves at least 4 granules per part."""
    q = g & -g
    while q > 1 and g // q < 4 * parts:
        q //= 2
    return q


def _round_shares(g: int, weights: list[float], q: int) -> list[int]:
    units = g // q
    raw = [w / sum(weights) * units for w in weights]
    got = [max(1, int(r)) for r in raw]
    while sum(got) > units:
        got[max(range(len(got)), key=lambda i: got[i])] -= 1
    order = sorted(range(len(raw)), key=lambda i: raw[i] - int(raw[i]), reverse=True)
    k = 0
    while sum(got) < units:
        got[order[k % len(order)]] += 1
        k += 1
    return [x * q for x in got]


def capacity_bound_s(cm: CostModel, cluster: Cluster, groups: Sequence[Sequence[str]],
                     parallelizer: IslandParallelizer | None, link: Link) -> float:
    """A step no split over these groups can beat, found before composing any of them: the global batch
    computed by every GPU of the groups at its most efficient shape (`DefaultParallelizer.best_rate`), plus,
    over a shared link (a region link every pipeline's gradients cross at once), the all-reduce of the whole
    model's gradients across the pipelines. With catalog devices every layer's time is its FLOPs at one rate
    per device and shape, so no device is relatively faster at some layers and the rate bounds any cut of the
    model; a measured profile could break that, and another parallelizer's stage costs need not follow the
    cost model's tables: 0 (no bound) for either."""
    if parallelizer is not None and not isinstance(parallelizer, DefaultParallelizer):
        return 0.0
    ids = {i for gr in groups for i in gr}
    if any(cm.profiles.get(isl.timing_key) for isl in cluster.islands if isl.id in ids):
        return 0.0
    par = parallelizer or DefaultParallelizer(cm)
    rate = sum(isl.gpus * par.best_rate(isl) for isl in cluster.islands if isl.id in ids)
    if rate <= 0:
        return 0.0
    p = len(groups)
    cross = 0.0
    if link.shared:
        total_grad = cm.model.total_params * cm.grad_bytes_per_param
        cross = 2 * (p - 1) / p * total_grad / link.bandwidth + 2 * math.ceil(math.log2(p)) * link.latency_s
    return cm.train.global_batch / rate + cross


def several_pipelines(cm: CostModel, cluster: Cluster, groups: list[list[str]],
                      parallelizer: IslandParallelizer | None = None, *,
                      beat_s: float = math.inf, refine_below_s: float = math.inf,
                      cuts: str = "any") -> MultiCandidate | None:
    """The best split of the global batch over one pipeline per group (None when a group cannot hold the
    model or the groups are not all connected, or when even perfectly shared work could not beat `beat_s`).
    Finer granules are tried only when the coarse split's step is below `refine_below_s` (a split far
    behind the best single pipeline is not worth the search). `cuts`: "whole" keeps every pipeline one stage,
    "cut" every one in several (its best candidate of more than one stage), as a tied model trains
    (`coordinator.planner.tied`); "any" either."""
    if len(groups) < 2:
        return None
    link = slowest_link(cluster, groups)
    if link is None:
        return None
    g = cm.train.global_batch
    q = _granule(g, len(groups))
    if g // q < len(groups):
        return None
    if capacity_bound_s(cm, cluster, groups, parallelizer, link) >= beat_s:
        return None
    found: dict[tuple[int, int], Candidate | None] = {}
    # every stage averages its gradients with the other pipelines' holders of its layers, per layer segment,
    # which the runtime does with plain AdamW (ZeRO needs a stage's replicas to be exactly the holders of its
    # layers: `PlanRunner._zero`), so the pipelines are planned without ZeRO
    options = replace(cm.options, zero_stages=(0,), max_stages=1 if cuts == "whole" else cm.options.max_stages)

    def best(k: int, share: int) -> Candidate | None:
        if (k, share) not in found:
            sub_cm = CostModel(cm.model, TrainSpec(global_batch=share, seq_len=cm.train.seq_len, dtype=cm.train.dtype,
                                                    optimizer=cm.train.optimizer), cm.profiles, options, cm.codecs)
            top = Composer(cost_model=sub_cm, cluster=cluster.subset(groups[k]), parallelizer=parallelizer).search()
            found[k, share] = next((c for c in top if cuts != "cut" or len(c.stages) > 1), None)
        return found[k, share]

    # first shares: each group's throughput on an equal share
    probe = [best(k, g) for k in range(len(groups))]
    if any(c is None for c in probe):
        return None
    first = [1.0 / c.step_s for c in probe]  # type: ignore[union-attr]
    # the groups' speeds on the whole batch added up, plus the least all-reduce across pipelines any
    # stage of those pipelines pays: a rough, optimistic step for any split (pipelines composed for other
    # shares may differ), to give up early on splits that cannot pay off
    _, cross = _with_cross_sync(cm, [c for c in probe if c is not None], link)
    if 1.0 / sum(first) + min(min(x) for x in cross) >= beat_s:
        return None
    result: MultiCandidate | None = None
    for granule in (q, q // 4, q // 16):
        if granule < 1 or (granule < q and (result is None or result.step_s >= refine_below_s)):
            break
        weights = first
        for _ in range(2):
            shares = _round_shares(g, weights, granule)
            cands = [best(k, s) for k, s in enumerate(shares)]
            if any(c is None for c in cands):
                break
            ok = [c for c in cands if c is not None]
            times, cross = _with_cross_sync(cm, ok, link)
            steps = [simulate(t).step_time_s for t in times]
            step = max(steps)
            if result is None or step < result.step_s:
                result = MultiCandidate(pipelines=ok, shares=shares, cross_sync_s=cross, times=times, step_s=step)
            # rebalance on what each share took
            weights = [s / t for s, t in zip(shares, steps)]
    return result
