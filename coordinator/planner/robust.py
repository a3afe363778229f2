"""Robust choice: the plan with the least worst-case regret over a band of network models.

The search composes pipelines under one reading of the cluster's links (`PlannerOptions.network`, the nominal
one by default). Which reading is right depends on the real NICs, so the leading candidates are scored under
every model of the band (`PlannerOptions.band`, by default `network.PESSIMISTIC`): each candidate's stages, cuts,
widths, windows and deferrals stay as they are, and what the network decides is priced again under the other
model (`as_model`: the gradient all-reduce and what of it hides, ZeRO-2/3's per-micro-batch collectives, the
activation transfers with the codec each link would then get, the tied weight's sum), then simulated. A candidate's
regret under a model is its shortfall against the best candidate under that model (1 - best step / its step). The
plan is the fastest candidate under the nominal model among those whose worst-case regret over the band is within
5% (`REGRET_BUDGET`), or within a point of the least any candidate reaches where no candidate is within 5%: a plan
that loses little under every model is not traded for nominal speed, nor for robustness it does not need.

The candidates are the search's leading pipelines, the best composed pipelines of a few other total device counts
(another width, another cut) and of the most devices, and, on clusters of one region and at most
`band_search_up_to` devices, the leading pipelines of the whole search run again under each model of the band.
Larger clusters, and those spanning regions, re-score only: a candidate per model costs one simulation, where a
search costs thousands.

Idle devices: a candidate that leaves 10% or more of the cluster idle (`IDLE_SHARE`) is kept only where it beats
the best candidate running more of them under every model of the band; else that one is the plan.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from atoll.coordinator.planner.cluster import Cluster, Link
from atoll.coordinator.planner.composer import Candidate, LinkChoice
from atoll.coordinator.planner.costmodel import WINDOW_TOLERANCE, CostModel
from atoll.coordinator.planner.network import NetworkModel
from atoll.coordinator.planner.options import TrainSpec
from atoll.coordinator.planner.simulator import LinkTimes, PipelineTimes, simulate
from atoll.coordinator.planner.tied import tied_sync_seconds

IDLE_SHARE = 0.10
"""A plan leaving this share of the cluster's devices idle must beat the best plan running them under every
model of the band."""


def with_network(cm: CostModel, network: NetworkModel) -> CostModel:
    """The cost model reading the links as `network` says; its layer tables (which no network changes: tensor
    parallelism stays inside a node) are shared."""
    if cm.options.network == network:
        return cm
    other = copy.copy(cm)
    other.options = replace(cm.options, network=network)
    return other


def as_model(cand: Candidate, cm_from: CostModel, cm_to: CostModel, cluster: Cluster) -> Candidate:
    """`cand` (composed under `cm_from`) priced under `cm_to`'s network, its arrangement unchanged, simulated."""
    if cm_from.options.network == cm_to.options.network:
        return cand
    stages = []
    times = []
    tied = cm_to.model.config.tied_head and len(cand.stages) > 1
    for n, (st, t) in enumerate(zip(cand.stages, cand.times.stages)):
        c, isl = st.cost, st.island
        df = db = 0.0
        if c.zero >= 2 and c.dp > 1:  # per micro-batch collectives inside the stage's time (`DefaultParallelizer`)
            shard = cm_to.table(isl, c.micro_batch, c.tp).params_of(st.start, st.end)
            per_node = max(1, isl.gpus_per_node // c.tp)
            if c.zero >= 3:
                nbytes = shard * cm_to.weight_bytes_per_param
                df = db = (cm_to.allreduce_seconds(nbytes, c.dp, isl, per_node)
                           - cm_from.allreduce_seconds(nbytes, c.dp, isl, per_node)) / 2
            else:
                nbytes = shard * cm_to.grad_bytes_per_param
                db = (cm_to.allreduce_seconds(nbytes, c.dp, isl, per_node)
                      - cm_from.allreduce_seconds(nbytes, c.dp, isl, per_node)) / 2
        params = cm_to.model.slice_params(st.start, st.end)
        grad = cm_to.grad_sync_seconds(params, isl, c.dp, c.tp)
        sync = grad
        if tied and n in (0, len(cand.stages) - 1):
            sync += tied_sync_seconds(cm_to, cluster, cand.stages[0].island, cand.stages[-1].island)
        cost = replace(c, forward_s=c.forward_s + df, backward_s=c.backward_s + db)
        window = st.weight_s if cand.times.defer and st.defer else cost.backward_s
        hidden = cm_to.sync_hidden_seconds(grad, params, zero=c.zero, dp=c.dp, tp=c.tp, window_s=window)
        stages.append(replace(st, cost=cost, sync_s=sync))
        times.append(replace(t, forward_s=t.forward_s + df, backward_s=t.backward_s + db, sync_s=sync,
                             sync_hidden_s=min(hidden, sync)))
    cycle = max(st.cost.pace_s for st in stages)
    links: list[LinkChoice] = []
    for n, x in enumerate(cand.links):
        a, b = stages[n], stages[n + 1]
        src, dst = a.island, b.island
        link = cluster.link(src.id, dst.id)
        assert link is not None, "a composed pipeline's stages are linked"
        same = cand.placed[n][0] == cand.placed[n + 1][0] if cand.placed else src.id == dst.id
        devices = max(a.cost.gpus, b.cost.gpus) if same or src.id != dst.id else src.gpus_per_node
        streams = min(a.cost.dp // a.cost.lanes, b.cost.dp // b.cost.lanes)
        bw = cm_to.stream_bandwidth(src, dst, link, devices, streams=streams)
        lat = cm_to.stream_latency(src, dst, link, devices)
        hide = ((2 + a.in_flight - b.in_flight) * (1 + WINDOW_TOLERANCE) - 2) * cycle / 2
        codec, sec = cm_to.codecs.choose(x.raw_bytes, cm_to.elem_bytes, bw, lat, max(cycle, min(cycle + lat, hide)))
        links.append(LinkChoice(codec=codec, raw_bytes=x.raw_bytes, forward_s=sec, backward_s=sec,
                                latency_s=min(lat, sec)))
    ptimes = replace(cand.times, stages=tuple(times),
                     links=tuple(LinkTimes(forward_s=x.forward_s, backward_s=x.backward_s, latency_s=x.latency_s)
                                 for x in links))
    return replace(cand, stages=stages, links=links, times=ptimes, step_s=simulate(ptimes).step_time_s)


@dataclass(kw_only=True)
class Scored:
    """A candidate plan (one pipeline, or several data-parallel with each other) under each model of the band."""

    steps: dict[str, float]
    """Model name -> simulated step time."""
    gpus: int
    single: dict[str, Candidate] = field(default_factory=dict)
    """One pipeline: its candidate as priced under each model."""
    multi: dict[str, tuple[list[Candidate], list[PipelineTimes]]] = field(default_factory=dict)
    """Several pipelines: per model, the pipelines and their times with the cross-pipeline all-reduce."""
    shares: list[int] = field(default_factory=list)
    """Several pipelines: each one's sequences per step."""
    origin: str = "nominal search"
    """Which search composed it."""

    def regret(self, best: dict[str, float]) -> dict[str, float]:
        """Per model, the shortfall of its tokens/s against the best candidate's under that model."""
        return {k: 1.0 - best[k] / s if s > 0 and math.isfinite(s) else 1.0 for k, s in self.steps.items()}

    def worst(self, best: dict[str, float]) -> float:
        return max(self.regret(best).values())


def score_single(cand: Candidate, cm: CostModel, models: Sequence[CostModel], cluster: Cluster,
                 origin: str = "nominal search") -> Scored:
    """`cand` (composed under `cm`, simulated) under each of `models`."""
    single = {m.options.network.name: as_model(cand, cm, m, cluster) for m in models}
    return Scored(steps={k: c.step_s for k, c in single.items()}, gpus=cand.gpus, single=single, origin=origin)


def score_multi(pipelines: Sequence[Candidate], shares: Sequence[int], cm: CostModel, models: Sequence[CostModel],
                cluster: Cluster) -> Scored:
    """Several pipelines (each composed under a cost model of its share of the batch, `multipipe`) under each of
    `models`, with their cross-pipeline all-reduce over the slowest link between their islands."""
    from atoll.coordinator.planner.multipipe import _with_cross_sync, slowest_link

    groups = [sorted({st.island.id for st in c.stages}) for c in pipelines]
    link = slowest_link(cluster, groups)
    assert link is not None, "several pipelines are linked"
    steps: dict[str, float] = {}
    multi: dict[str, tuple[list[Candidate], list[PipelineTimes]]] = {}
    for m in models:
        net = m.options.network
        priced = []
        for c, share in zip(pipelines, shares):
            train = TrainSpec(global_batch=share, seq_len=cm.train.seq_len, dtype=cm.train.dtype,
                              optimizer=cm.train.optimizer)
            sub = CostModel(cm.model, train, cm.profiles, replace(m.options, zero_stages=(0,)), cm.codecs)
            base = CostModel(cm.model, train, cm.profiles, replace(cm.options, zero_stages=(0,)), cm.codecs)
            priced.append(as_model(c, base, sub, cluster))
        cross = Link(bandwidth=link.bandwidth * net.p2p_scale, latency_s=link.latency_s + net.p2p_latency_s,
                     shared=link.shared)
        times, _ = _with_cross_sync(m, priced, cross)
        steps[net.name] = max(simulate(t).step_time_s for t in times)
        multi[net.name] = (priced, times)
    return Scored(steps=steps, gpus=sum(c.gpus for c in pipelines), multi=multi, shares=list(shares),
                  origin="several pipelines")


def best_steps(pool: Sequence[Scored]) -> dict[str, float]:
    """Per model, the least step any candidate of `pool` reaches."""
    names = pool[0].steps
    return {k: min(s.steps[k] for s in pool) for k in names}


REGRET_BUDGET = 0.05
"""A worst-case regret the choice accepts without giving up nominal speed for less: among the candidates within
max(this, the least worst-case regret + `REGRET_SLACK`), the fastest under the nominal model is the plan."""
REGRET_SLACK = 0.01


def choose(pool: Sequence[Scored], nominal: str, total_gpus: int, tolerance: float = 0.0,
           budget: float = REGRET_BUDGET) -> tuple[Scored, str]:
    """The plan of `pool` and why: of the candidates whose worst-case regret is within `budget` (or within
    `REGRET_SLACK` of the least any reaches, where that is more), the fastest under the nominal model, or with
    `tolerance` > 0 (near-equal plans, `PlannerOptions.near_equal`) the earliest of `pool`, which lists the search's
    preferred first. Then the idle rule (`IDLE_SHARE`)."""
    best = best_steps(pool)
    least = min(s.worst(best) for s in pool)
    bound = max(budget, least + REGRET_SLACK)
    within = [s for s in pool if s.worst(best) <= bound + 1e-9]
    if tolerance > 0:
        fastest = min(s.steps[nominal] for s in within)
        pick = next(s for s in within if s.steps[nominal] <= fastest * (1 + tolerance))
    else:
        pick = min(within, key=lambda s: s.steps[nominal])
    why = (f"worst-case regret over the band ({pick.worst(best):.1%}; the least any candidate reaches "
           f"{least:.1%}), the fastest under the nominal model within {bound:.0%}")
    if total_gpus - pick.gpus >= IDLE_SHARE * total_gpus:
        more = [s for s in pool if total_gpus - s.gpus < IDLE_SHARE * total_gpus]
        if more:
            using = min(more, key=lambda s: (s.worst(best), s.steps[nominal]))
            if not all(pick.steps[k] < using.steps[k] for k in pick.steps):
                slower = [k for k in pick.steps if pick.steps[k] >= using.steps[k]]
                why = (f"it runs {using.gpus} of {total_gpus} devices where the least-regret candidate left "
                       f"{total_gpus - pick.gpus} idle and was no faster under the {', '.join(slower)} model")
                pick = using
    return pick, why


@dataclass(kw_only=True)
class BandFigures:
    """What `atoll plan` prints: the chosen plan and the nominal-best plan under each model of the band."""

    models: list[NetworkModel]
    tokens_per_step: int
    chosen: dict[str, float]
    """Model name -> the chosen plan's predicted step time."""
    nominal_best: dict[str, float]
    """Model name -> the step time of the plan fastest under the nominal model."""
    best: dict[str, float]
    """Model name -> the least step of any candidate scored."""
    why: str
    candidates: int

    def regret(self, steps: dict[str, float]) -> dict[str, float]:
        return {k: 1.0 - self.best[k] / s if s > 0 else 1.0 for k, s in steps.items()}

    def lines(self) -> list[str]:
        """A small table: per model, tokens/s and regret of the chosen plan and of the nominal-best plan."""
        rc, rn = self.regret(self.chosen), self.regret(self.nominal_best)
        out = [f"network band: {self.candidates} candidates scored under each model; chosen for its {self.why}",
               f"  {'model':<14} {'chosen tok/s':>14} {'regret':>7} {'nominal-best tok/s':>19} {'regret':>7}"]
        for m in self.models:
            k = m.name
            out.append(f"  {k:<14} {self.tokens_per_step / self.chosen[k]:>14,.0f} {rc[k]:>7.1%} "
                       f"{self.tokens_per_step / self.nominal_best[k]:>19,.0f} {rn[k]:>7.1%}")
        if self.chosen == self.nominal_best:
            out.append("  (the chosen plan is the nominal-best plan)")
        out.extend(f"  {m.describe()}" for m in self.models)
        return out
