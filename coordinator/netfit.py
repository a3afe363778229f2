"""Live calibration of the network model from the transfers and collectives nodes time.

The planner reads the probed links through a `NetworkModel` (`atoll.coordinator.planner.network`). Probes are short
and run before training; under a training job's load a link may carry less, and a NIC shared by several flows
less still. Nodes report in every step what they measured (`StepMetrics.links`: bytes, seconds and messages per
peer and direction; `StepMetrics.collectives`: the gradient all-reduces by size and group size), and the
coordinator fits the model to them:

1. each report becomes a `Sample`: the measured seconds of one message or call beside what the model the running
   plan was made under predicts for it, split in its bandwidth term (bytes over the link's rate; 2 (N-1)/N of the
   bytes for a ring all-reduce) and its latency term (the link's latency; 2 (N-1) of them for the ring);
2. per kind ("p2p", "collective"), a least-squares fit of measured - latency term = a + k x bandwidth term (`fit_kind`):
   k is how many times slower the link moves bytes than the model says, a the latency the model leaves out;
3. the fitted model (`fit_network`) scales the plan's model by 1 / k per kind and adds a, so the planner can
   re-plan under it; `replan_verdict` decides with hysteresis whether to: the fit must have moved from the model the
   running plan was made under by more than `CalibrationOptions.change` (so a fit wobbling around it replans
   nothing, and after a replan the next needs another move of that size), and the best plan under the fitted
   model must predict steps at least `CalibrationOptions.min_gain` shorter than the running plan re-scored under it;
4. the status shows, per kind, the samples, the model's and the fit's mean prediction and the mean measurement
   (`describe_fit`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from atoll.coordinator.planner.network import NetworkModel
from atoll.plan import Plan
from atoll.types import StepMetrics

KINDS = ("p2p", "collective")


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One measured transfer or collective beside the model's prediction of it."""

    kind: str
    """"p2p" (an activation or gradient message to the next or previous stage) or "collective"."""
    seconds: float
    """Measured, for one message or call."""
    wire_s: float
    """The model's bandwidth term: bytes over the link's achievable rate (a ring all-reduce: 2 (N-1)/N of them)."""
    latency_s: float = 0.0
    """The model's latency term (a ring all-reduce: 2 (N-1) hops)."""
    hops: int = 1
    """Latencies the transfer pays (2 (N-1) for a ring over N)."""

    @property
    def predicted_s(self) -> float:
        return self.wire_s + self.latency_s


@dataclass(frozen=True, kw_only=True)
class KindFit:
    """The fit of one kind of transfer: measured = latency term + a + k x bandwidth term."""

    kind: str
    samples: int
    slowdown: float
    """k: how many times longer the bytes take than the model says (4.0: the link is 4x slower)."""
    extra_latency_s: float
    """a per hop: latency the model leaves out."""
    predicted_s: float
    """Mean of the model's predictions over the samples."""
    fitted_s: float
    """Mean of the fit's predictions over the samples."""
    measured_s: float
    """Mean of the measurements."""


@dataclass(frozen=True, kw_only=True)
class NetworkFit:
    model: NetworkModel
    """The model the fit gives (the base model where a kind had too few samples)."""
    kinds: dict[str, KindFit] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class CalibrationOptions:
    """When the coordinator re-fits the network model and replans under it."""

    enabled: bool = True
    min_samples: int = 8
    """Samples of a kind before its fit counts."""
    change: float = 1.5
    """A fit changes the model when some kind's bandwidth (or its latency over the samples' mean time) moved by
    more than this factor from the model the running plan was made under."""
    min_gain: float = 0.10
    """Replan when the best plan under the fitted model predicts steps at least this much shorter than the running
    plan re-scored under it."""

    def __post_init__(self) -> None:
        if self.min_samples < 2:
            raise ValueError(f"calibration min_samples must be >= 2 (a line needs two points), got {self.min_samples}")
        if not self.change > 1.0:
            raise ValueError(f"calibration change must be a factor above 1, got {self.change}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"calibration min_gain must be in [0, 1), got {self.min_gain}")


def fit_kind(samples: Sequence[Sample], kind: str) -> KindFit | None:
    """Least squares of measured - latency term = a + k x bandwidth term over `samples` of `kind` (None: fewer than
    two, or none with a bandwidth term). Where the sizes do not vary (one tensor size: no slope to fit), a is 0 and
    k their mean ratio. k is kept positive and a non-negative (a fit below them is noise about a fast link)."""
    xs = [s for s in samples if s.kind == kind and s.wire_s > 0 and s.seconds > 0 and math.isfinite(s.seconds)]
    if len(xs) < 2:
        return None
    x = [s.wire_s for s in xs]
    y = [s.seconds - s.latency_s for s in xs]
    n = len(xs)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((v - mx) ** 2 for v in x)
    if sxx <= (1e-6 * mx) ** 2 * n:
        a, k = 0.0, max(my / mx, 1e-6)
    else:
        k = sum((u - mx) * (v - my) for u, v in zip(x, y)) / sxx
        a = my - k * mx
        if a < 0 or k <= 0:  # through the origin instead: no extra latency
            a, k = 0.0, max(sum(u * v for u, v in zip(x, y)) / sum(u * u for u in x), 1e-6)
    hops = sum(s.hops for s in xs) / n
    return KindFit(kind=kind, samples=n, slowdown=k, extra_latency_s=a / max(hops, 1.0),
                   predicted_s=sum(s.predicted_s for s in xs) / n,
                   fitted_s=sum(s.latency_s + a + k * s.wire_s for s in xs) / n,
                   measured_s=sum(s.seconds for s in xs) / n)


def fit_network(samples: Sequence[Sample], base: NetworkModel, *, min_samples: int = 8) -> NetworkFit:
    """The model the samples give: `base` (the model their predictions were made under) with each kind of at least
    `min_samples` samples scaled by its fit."""
    kinds = {k: f for k in KINDS if (f := fit_kind(samples, k)) is not None}
    model = replace(base, name="fitted")
    p2p, coll = kinds.get("p2p"), kinds.get("collective")
    if p2p is not None and p2p.samples >= min_samples:
        model = replace(model, p2p_scale=base.p2p_scale / p2p.slowdown,
                        p2p_latency_s=base.p2p_latency_s + p2p.extra_latency_s)
    if coll is not None and coll.samples >= min_samples:
        model = replace(model, collective_scale=base.collective_scale / coll.slowdown,
                        collective_latency_s=base.collective_latency_s + coll.extra_latency_s)
    return NetworkFit(model=model, kinds=kinds)


def model_change(fitted: NetworkModel, planned: NetworkModel, typical_s: Mapping[str, float] | None = None) -> float:
    """The largest factor by which `fitted` departs from `planned`: per kind, its bandwidth scale's ratio, and where
    `typical_s` gives a kind's mean measured seconds, 1 + the latency added over it."""
    ratios = [fitted.p2p_scale / planned.p2p_scale, fitted.collective_scale / planned.collective_scale]
    out = max(max(r, 1 / r) for r in ratios)
    for kind, extra in (("p2p", fitted.p2p_latency_s - planned.p2p_latency_s),
                        ("collective", fitted.collective_latency_s - planned.collective_latency_s)):
        t = (typical_s or {}).get(kind, 0.0)
        if t > 0:
            out = max(out, 1 + abs(extra) / t)
    return out


@dataclass(frozen=True)
class Verdict:
    go: bool
    why: str


def replan_verdict(*, fitted: NetworkModel, planned: NetworkModel, running_s: float, best_s: float,
                   options: CalibrationOptions, typical_s: Mapping[str, float] | None = None) -> Verdict:
    """Whether to replan under `fitted`: it moved from `planned` (the running plan's model) by more than
    `options.change`, and the best plan under it (`best_s` a step) beats the running plan re-scored under it
    (`running_s`) by `options.min_gain`. The two thresholds are the hysteresis: a fit near the planned model replans
    nothing however the plans compare, and a fit that moved replans only for a real gain."""
    moved = model_change(fitted, planned, typical_s)
    if moved <= options.change:
        return Verdict(False, f"the fitted network is within {moved:.2f}x of the plan's (a replan needs "
                              f"{options.change:g}x)")
    if running_s <= 0 or best_s <= 0:
        return Verdict(False, "no prediction to compare")
    gain = 1.0 - best_s / running_s
    if gain < options.min_gain:
        return Verdict(False, f"the fitted network moved {moved:.2f}x, but the best plan under it predicts "
                              f"{best_s:.3g} s a step against the running plan's {running_s:.3g} s under it "
                              f"({gain:.0%} shorter; a replan needs {options.min_gain:.0%})")
    return Verdict(True, f"the fitted network moved {moved:.2f}x from the plan's ({fitted.describe()}); the best "
                         f"plan under it predicts {best_s:.3g} s a step against the running plan's {running_s:.3g} s "
                         f"({gain:.0%} shorter)")


def samples_from_steps(steps: Iterable[StepMetrics], link_of: Mapping[tuple[str, str], tuple[float, float]],
                       group_of: Mapping[str, Sequence[str]], link_efficiency: float, planned: NetworkModel
                       ) -> list[Sample]:
    """Samples from step reports, predicted under `planned` applied to the probed links.

    `link_of`: (node, peer) -> (bytes/s, one-way latency s) as probed; `group_of`: node -> the nodes of its stage's
    data-parallel group (its all-reduce ring, over the slowest of their links). Live nodes hold one device each, so
    every transfer between two of them crosses nodes: the model's p2p rate is the probed one x `link_efficiency` x
    its p2p scale, and an all-reduce a ring over them."""
    out: list[Sample] = []
    for m in steps:
        for x in m.links:
            got = link_of.get((m.node_id, x.peer)) or link_of.get((x.peer, m.node_id))
            if got is None or x.transfers <= 0 or x.bytes_wire <= 0:
                continue
            bw, lat = got
            per = x.bytes_wire / x.transfers
            out.append(Sample(kind="p2p", seconds=x.seconds / x.transfers,
                              wire_s=per / (bw * link_efficiency * planned.p2p_scale),
                              latency_s=lat + planned.p2p_latency_s))
        group = group_of.get(m.node_id, ())
        for c in m.collectives:
            n = c.participants
            if n < 2 or c.count <= 0 or len(group) < 2:
                continue
            ring = [link_of.get((a, b)) or link_of.get((b, a)) for a, b in zip(group, [*group[1:], group[0]])]
            if any(r is None for r in ring):
                continue
            bw = min(r[0] for r in ring if r is not None)
            lat = max(r[1] for r in ring if r is not None)
            out.append(Sample(kind="collective", seconds=c.seconds / c.count,
                              wire_s=2 * (n - 1) / n * c.bytes / (bw * link_efficiency * planned.collective_scale),
                              latency_s=2 * (n - 1) * (lat + planned.collective_latency_s), hops=2 * (n - 1)))
    return out


def plan_step_under(plan: Plan, planned: NetworkModel, fitted: NetworkModel) -> float:
    """The step `plan` (made under `planned`) takes under `fitted`, through the planner's simulator: each link's time
    on the wire scaled by the ratio of the two models' p2p scales and its latency by their difference, each stage's
    gradient sync by the collective scales (live nodes hold one device each: every transfer and every all-reduce
    crosses nodes). 0 for a plan without timings (the fallback)."""
    from atoll.coordinator.planner.simulator import LinkTimes, PipelineTimes, plan_pipeline_times, simulate

    p2p = planned.p2p_scale / fitted.p2p_scale
    coll = planned.collective_scale / fitted.collective_scale
    lat = fitted.p2p_latency_s - planned.p2p_latency_s
    worst = 0.0
    for i in range(len(plan.pipelines)):
        t = plan_pipeline_times(plan, i)
        if t is None:
            return 0.0
        links = tuple(LinkTimes(forward_s=max(x.latency_s + lat, 0.0) + (x.forward_s - x.latency_s) * p2p,
                                backward_s=max(x.latency_s + lat, 0.0) + (x.backward_s - x.latency_s) * p2p,
                                latency_s=max(x.latency_s + lat, 0.0)) for x in t.links)
        stages = tuple(replace(st, sync_s=st.sync_s * coll, sync_hidden_s=min(st.sync_hidden_s, st.sync_s * coll))
                       for st in t.stages)
        priced: PipelineTimes = replace(t, links=links, stages=stages)
        worst = max(worst, simulate(priced).step_time_s)
    return worst


def describe_fit(fit: NetworkFit) -> list[str]:
    """Status lines: per kind, samples, the plan's model's mean prediction, the fit's and the mean measurement."""
    out = []
    for k in KINDS:
        f = fit.kinds.get(k)
        if f is None:
            out.append(f"{k}: no samples yet")
            continue
        out.append(f"{k}: {f.samples} samples, predicted {f.predicted_s * 1e3:.3g} ms, fitted {f.fitted_s * 1e3:.3g} ms, "
                   f"measured {f.measured_s * 1e3:.3g} ms (bytes {f.slowdown:.2f}x slower than planned, "
                   f"+{f.extra_latency_s * 1e3:.3g} ms a hop)")
    return out
