"""Replica groups across regions with an outer sync (the DiLoCo family): what the planner predicts and picks.

A synchronous step cannot cross a 1 Gbit/s link; rare, compressed traffic can. For a cluster that spans
regions the planner also plans every region alone, with the synchronous machinery as it is (composer,
several pipelines), as a *replica group* that trains the whole global batch every inner step, and predicts:

- a group's inner step time and tokens/s: those of its own plan;
- the outer sync of one round: every node sends its share of its stage's pseudo-gradients (the stage's
  fp32 parameters spread over the replicas of those layers, through the codec) to the nodes holding the
  same layers in every other group. A region link's shared capacity carries a group's whole encoded replica
  (bytes / capacity); a per-node link (live clusters) carries every host's share in parallel (the busiest
  host's bytes / the link's bandwidth), and no host sends faster than its network interface (`nic_bandwidth`:
  the island's figure between hosts, or for a live island of one node the fastest link measured from it). Regions
  without a direct link are reached over the widest path; a link carries every flow routed over it, each
  direction apart. Plus the route's one-way latency;
- a round: the fastest group trains H inner steps, every other group the whole steps that fit in about the
  same wall time (at least 1), and `simulate_outer` gives the tokens/s with the exchange overlapped with the
  next round (it hides when it lands within one round) or blocking.

The choices, in this order:
- H: the smallest of `INNER_STEPS_LADDER` whose sync hides behind a round (without overlap: whose exposed
  sync costs at most `EXPOSED_WITHOUT_OVERLAP` of a round) and whose whole inner steps per group keep
  `ROUND_EFFICIENCY` of the groups' speed; when none does, the one with the most tokens/s among those that
  hide (else among all); or the options' H;
- codec ("auto", from what the wide-area links carry): the least lossy of int8, int4 and sparse2 (SparseLoCo's
  chunked top-k at 2 bits, at the options' density) whose H so chosen hides its sync within
  `MODEST_INNER_STEPS` inner steps; else the one that hides at the smallest H; else the one with the fastest
  sync. So int8 where the link is fast enough for a modest H, int4, then sparse2 (195x at 1/64) as it slows.
  Plain top-k is not a candidate: at a similar density and error sparse2 sends about an eighth of its bytes;
- groups: of the regions that can each hold the model, every set of two or more that is connected, the one
  with the most tokens/s (a region too slow to pay for the wider sync is left out, and the reason says so);
- mode ("auto"): considered only where the regions meet over links at least `outer_wan_gap` times slower
  than the links measured inside them (wide-area links; a region of one node has none, and where no region has
  one there is nothing to compare), and then outer when it predicts at least `outer_min_gain` x the
  synchronous plan's tokens/s.

An outer-mode token is worth less than a synchronous one (the groups see each other's progress once a
round); plans and reports say so beside the tokens/s.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from atoll.coordinator.planner.cluster import GBPS, Cluster, Link
from atoll.coordinator.planner.options import PlannerOptions, TrainSpec
from atoll.coordinator.planner.simulator import OuterSimResult, simulate_outer
from atoll.modelspec import ModelSpec
from atoll.plan import GB, OuterPlan, Plan, Prediction, ReplicaGroup
from atoll.units import duration

if TYPE_CHECKING:
    from atoll.compression.spec import CodecSpec
    from atoll.coordinator.planner.planjob import PlanResult

INNER_STEPS_LADDER = (1, 2, 5, 10, 20, 50, 100, 200, 500)
"""H values tried, smallest first; the top is the cap."""
MODEST_INNER_STEPS = 20
"""The auto codec keeps the least lossy codec whose sync hides within this many inner steps."""
AUTO_CODECS = ("int8", "int4", "sparse2")
"""Candidates of the auto codec, least lossy first (error feedback keeps what the lossy ones drop)."""
EXPOSED_WITHOUT_OVERLAP = 0.1
"""Without overlap the sync never hides; H is the smallest whose sync costs at most this share of a round."""
ROUND_EFFICIENCY = 0.95
"""H is also large enough that the groups' whole inner steps per round keep this share of the inner steps
per second they would train running apart (a group twice as slow as the fastest cannot train its half of
one step: at H=1 it stretches every round to its own step)."""
MAX_SUBSET_REGIONS = 6
"""Up to this many feasible regions every subset is tried as the set of groups; beyond it, all of them."""
OUTER_TOKEN_NOTE = ("an outer-mode token is worth less than a synchronous one (the groups see each other's "
                    "progress once a round)")


@dataclass(kw_only=True)
class RegionPlan:
    """One region planned alone: a candidate replica group."""

    region: str
    result: PlanResult

    @property
    def step_s(self) -> float:
        return self.result.plan.predicted.step_time_s


@dataclass(frozen=True, kw_only=True)
class SyncCost:
    """One round's exchange of pseudo-gradients under a codec."""

    seconds: float
    """Until every group holds every other group's pseudo-gradients."""
    bytes_per_group: int
    """Encoded bytes one group sends per round, to all the other groups together."""
    link: str
    """The busiest link or interface, readable (e.g. "us-east -> eu-west, 1 Gbit/s")."""
    gbps: float
    """Its bandwidth, Gbit/s."""


@dataclass(kw_only=True)
class OuterChoice:
    """Replica groups with their codec, H and predicted round."""

    groups: list[RegionPlan]
    codec: CodecSpec
    inner_steps: int
    group_steps: list[int]
    """Inner steps per round of each group."""
    sync: SyncCost
    sim: OuterSimResult
    tokens_per_s: float
    hides: bool
    left_out: dict[str, str]
    """Region -> why it was left out of the groups (a line naming it)."""


def pseudo_gradient_bytes(spec: CodecSpec, numel: int) -> int:
    """Encoded bytes of `numel` fp32 pseudo-gradient elements under `spec`."""
    import torch

    from atoll.compression.tensor import get_codec

    return get_codec(spec).payload_size(int(numel), torch.float32)


SPARSE_CODECS = ("topk", "sparse2")
"""The codecs whose plans carry the fraction they keep (`OuterPlan.topk_fraction`)."""


def codec_label(name: str, fraction: float) -> str:
    """How plans and reports name an outer codec: "int8", "top-k 0.02", "sparse2 0.0156"."""
    if name == "topk":
        return f"top-k {fraction:.3g}"
    return f"{name} {fraction:.3g}" if name in SPARSE_CODECS else name


def codec_spec(name: str, options: PlannerOptions) -> CodecSpec:
    from atoll.compression.spec import CodecSpec

    if name == "topk":
        return CodecSpec("topk", topk_fraction=options.outer_topk_fraction)
    if name == "sparse2":
        return CodecSpec("sparse2", topk_fraction=options.outer_sparse_fraction)
    return CodecSpec(name)


SAME_SPEED = 0.15
"""Groups whose predicted step times are within this fraction of the fastest count as equally fast: live
profiles of identical machines differ by about this much, and unequal H would leave one group rounds to
train alone at the end."""


def group_inner_steps(step_s: Sequence[float], h: int) -> list[int]:
    """Inner steps per round of each group: H for the fastest, and for every other group the whole steps
    that fit the round (at least 1). The round is the fastest group's H steps, or stretched to a slower
    group's next whole step when that trains more tokens per second in all."""
    fast = min(range(len(step_s)), key=lambda g: step_s[g])
    if all(t <= step_s[fast] * (1 + SAME_SPEED) for t in step_s):
        return [h] * len(step_s)  # groups within profiling noise of each other train the same H
    base = h * step_s[fast]
    best: tuple[float, list[int]] | None = None
    for wall in [base] + [math.ceil(base / t - 1e-9) * t for t in step_s]:
        steps = [h if g == fast else max(1, math.floor(wall / t + 1e-9)) for g, t in enumerate(step_s)]
        rate = sum(steps) / max(s * t for s, t in zip(steps, step_s))
        if best is None or rate > best[0] * (1 + 1e-9):
            best = (rate, steps)
    assert best is not None
    return best[1]


def region_links(cluster: Cluster) -> dict[frozenset[str], Link]:
    """The slowest link between islands of each pair of connected regions."""
    by_region = {r: [i.id for i in cluster.islands if i.region == r] for r in cluster.regions}
    out: dict[frozenset[str], Link] = {}
    for a, b in itertools.combinations(cluster.regions, 2):
        found = [lk for x in by_region[a] for y in by_region[b] if (lk := cluster.link(x, y)) is not None]
        if found:
            out[frozenset((a, b))] = min(found, key=lambda lk: lk.bandwidth)
    return out


def wan_gap(cluster: Cluster) -> tuple[float, float | None] | None:
    """(slowest link between two regions, slowest link inside a region) in bytes/s, the second None where no
    region has a link inside it (each region one node); None without two connected regions."""
    between = region_links(cluster)
    if not between:
        return None
    inside = [i.inter_node_bandwidth for i in cluster.islands if i.inter_node_bandwidth is not None]
    for a, b in itertools.combinations(cluster.islands, 2):
        if a.region == b.region and (lk := cluster.link(a.id, b.id)) is not None:
            inside.append(lk.bandwidth)
    return min(lk.bandwidth for lk in between.values()), min(inside, default=None)


def nic_bandwidth(cluster: Cluster, island_id: str) -> float | None:
    """Bytes/s one host of the island sends at: its figure between hosts (per GPU flow), or, for an island of
    one node (which has none), the fastest link measured from it to another island (it reached that much);
    None where it has neither."""
    isl = cluster.island(island_id)
    if isl.inter_node_bandwidth is not None:
        return isl.inter_node_bandwidth
    return max((lk.bandwidth for k, lk in cluster.links.items() if island_id in k), default=None)


def widest_route(links: dict[frozenset[str], Link], src: str, dst: str) -> list[str] | None:
    """Regions from src to dst along the path of the widest bottleneck (fewest hops on ties), None if cut off."""
    heap: list[tuple[float, int, str, list[str]]] = [(-math.inf, 0, src, [src])]
    done: set[str] = set()
    while heap:
        neg_bw, hops, here, path = heapq.heappop(heap)
        if here == dst:
            return path
        if here in done:
            continue
        done.add(here)
        for pair, lk in links.items():
            if here in pair:
                (there,) = pair - {here}
                if there not in done:
                    heapq.heappush(heap, (max(neg_bw, -lk.bandwidth), hops + 1, there, path + [there]))
    return None


def sync_cost(groups: Sequence[RegionPlan], cluster: Cluster, model: ModelSpec, spec: CodecSpec) -> SyncCost | None:
    """Predicted exchange of one round among `groups` under `spec` (None when two groups cannot reach each other)."""
    links = region_links(cluster)
    whole: list[int] = []  # encoded bytes of one replica, per group
    host: list[int] = []  # busiest GPU's encoded bytes, per group and destination
    nic: list[float | None] = []  # slowest GPU flow of the group's hosts (links inside a region are per GPU flow)
    for g in groups:
        plan = g.result.plan
        n_pipes = len(plan.pipelines)
        whole.append(pseudo_gradient_bytes(spec, model.total_params))
        busiest = 0
        for p in plan.pipelines:
            for s in p.stages:
                # each layer's pseudo-gradient is sent once per group, shared by every GPU holding it (a tp
                # rank holds 1 / tp of its replica's layers), each GPU over its own flow
                per_gpu = math.ceil(model.slice_params(*s.layers) / (s.dp * s.tp * n_pipes))
                busiest = max(busiest, pseudo_gradient_bytes(spec, per_gpu))
        host.append(busiest)
        known = [bw for p in plan.pipelines for s in p.stages if (bw := nic_bandwidth(cluster, s.island)) is not None]
        nic.append(min(known, default=None))
    load: dict[tuple[str, str], float] = {}
    latency = 0.0
    for a, b in itertools.permutations(range(len(groups)), 2):
        route = widest_route(links, groups[a].region, groups[b].region)
        if route is None:
            return None
        lat = 0.0
        for u, v in zip(route, route[1:]):
            lk = links[frozenset((u, v))]
            load[u, v] = load.get((u, v), 0.0) + (whole[a] if lk.shared else host[a])
            lat += lk.latency_s
        latency = max(latency, lat)
    worst, seconds = "", 0.0
    gbps = 0.0
    for (u, v), nbytes in load.items():
        lk = links[frozenset((u, v))]
        t = nbytes / lk.bandwidth
        if t > seconds:
            seconds, worst, gbps = t, f"{u} -> {v}", lk.bandwidth / GBPS
    others = len(groups) - 1
    for g, h, bw in zip(groups, host, nic):
        if bw is None:  # no figure for its interface: its links above bound it
            continue
        t = h * others / bw
        if t > seconds:
            seconds, worst, gbps = t, f"the network interfaces of {g.region}", bw / GBPS
    return SyncCost(seconds=seconds + latency, bytes_per_group=whole[0] * others,
                    link=f"{worst}, {gbps:g} Gbit/s", gbps=gbps)


def _pick_h(step_s: list[float], sync_s: float, options: PlannerOptions) -> tuple[int, list[int], bool]:
    ladder = (options.outer_inner_steps,) if options.outer_inner_steps else INNER_STEPS_LADDER
    free = sum(1 / t for t in step_s)  # inner steps per second of the groups running apart
    tried: list[tuple[int, list[int], bool, float]] = []
    for h in ladder:
        steps = group_inner_steps(step_s, h)
        compute = max(s * t for s, t in zip(steps, step_s))
        limit = compute if options.outer_overlap else EXPOSED_WITHOUT_OVERLAP * compute
        hides = sync_s <= limit
        rate = sum(simulate_outer(step_s, steps, sync_s, overlap=options.outer_overlap).steps_per_s)
        if hides and rate >= ROUND_EFFICIENCY * free:
            return h, steps, True
        tried.append((h, steps, hides, rate))
    # nothing both hides and rounds well: the fastest of those that hide, else of all (smallest H on ties)
    pool = [x for x in tried if x[2]] or tried
    h, steps, hides, _ = max(pool, key=lambda x: x[3] * (1 - 1e-9 * x[0]))
    return h, steps, hides


def _choose(groups: list[RegionPlan], cluster: Cluster, model: ModelSpec, train: TrainSpec,
            options: PlannerOptions, left_out: dict[str, str]) -> OuterChoice | None:
    names = AUTO_CODECS if options.outer_codec == "auto" else (options.outer_codec,)
    step_s = [g.step_s for g in groups]
    tried: list[OuterChoice] = []
    for name in names:
        spec = codec_spec(name, options)
        cost = sync_cost(groups, cluster, model, spec)
        if cost is None:
            return None
        h, steps, hides = _pick_h(step_s, cost.seconds, options)
        sim = simulate_outer(step_s, steps, cost.seconds, overlap=options.outer_overlap)
        tried.append(OuterChoice(groups=groups, codec=spec, inner_steps=h, group_steps=steps, sync=cost, sim=sim,
                                 tokens_per_s=sim.tokens_per_s(train.tokens_per_step), hides=hides,
                                 left_out=left_out))
    modest = [c for c in tried if c.hides and c.inner_steps <= MODEST_INNER_STEPS]
    if modest:
        return modest[0]
    hiding = [c for c in tried if c.hides]
    if hiding:
        return min(hiding, key=lambda c: c.inner_steps)
    return min(tried, key=lambda c: c.sync.seconds)


def choose_outer(cluster: Cluster, model: ModelSpec, train: TrainSpec, options: PlannerOptions,
                 plan_region: Callable[[Cluster], PlanResult]) -> tuple[OuterChoice | None, str]:
    """The best replica groups for `cluster` (one per region), or None and why not."""
    from atoll.coordinator.planner.composer import NoFeasiblePlan

    feasible: list[RegionPlan] = []
    skipped: dict[str, str] = {}
    for r in cluster.regions:
        try:
            res = plan_region(cluster.subset([i.id for i in cluster.islands if i.region == r]))
        except NoFeasiblePlan:
            skipped[r] = f"{r} cannot hold the model alone"
            continue
        feasible.append(RegionPlan(region=r, result=res))
    if len(feasible) < 2:
        why = "; ".join(skipped.values()) or "one region"
        return None, f"outer mode needs two regions that can each hold the model ({why})"
    sizes = range(len(feasible), 1, -1) if len(feasible) <= MAX_SUBSET_REGIONS else (len(feasible),)
    best: OuterChoice | None = None
    for k in sizes:
        for subset in itertools.combinations(feasible, k):
            out = {g.region: f"{g.region} left out: the groups train faster without it (its own plan "
                   f"{g.result.plan.predicted.tokens_per_s:,.0f} tokens/s)" for g in feasible if g not in subset}
            got = _choose(list(subset), cluster, model, train, options, {**skipped, **out})
            if got is not None and (best is None or got.tokens_per_s > best.tokens_per_s * (1 + 1e-9)):
                best = got
    if best is None:
        return None, "outer mode needs the regions connected: no route between two of them"
    return best, ""


def _gbps(x: float) -> str:
    return f"{x:.3g} Gbit/s"


def format_bytes(n: float) -> str:
    """1.23 GB, 45.6 MB: how much a round sends."""
    return f"{n / GB:.2f} GB" if n >= GB else f"{n / 1e6:.1f} MB"


def outer_reason(choice: OuterChoice, sync_tps: float, options: PlannerOptions) -> str:
    o = choice.sim
    ratio = choice.tokens_per_s / sync_tps if sync_tps > 0 else math.inf
    head = "outer (forced by the options)" if options.outer_mode == "outer" else "outer"
    names = ", ".join(g.region for g in choice.groups)
    label = codec_label(choice.codec.codec, choice.codec.topk_fraction)
    text = (f"{head}: {len(choice.groups)} groups ({names}), {ratio:.2f}x the synchronous plan's tokens/s "
            f"({sync_tps:,.0f}); {label} pseudo-gradients, {format_bytes(choice.sync.bytes_per_group)} per round "
            f"over {_gbps(choice.sync.gbps)} take {choice.sync.seconds:.1f} s, ")
    if choice.hides:
        hidden = "hidden behind" if options.outer_overlap else f"at most {EXPOSED_WITHOUT_OVERLAP:.0%} of"
        text += f"{hidden} H={choice.inner_steps} rounds of {o.compute_s:.1f} s"
    else:
        text += (f"not hidden even at H={choice.inner_steps} (rounds of {o.compute_s:.1f} s, "
                 f"{o.exposed_s:.1f} s exposed per round)")
    if options.outer_codec == "auto":
        text += (f"; codec auto: the least lossy of int8, int4, sparse2 {options.outer_sparse_fraction:.3g} whose "
                 f"sync hides within H <= {MODEST_INNER_STEPS}, else the one hiding at the smallest H")
    if options.outer_inner_steps:
        text += f"; H={options.outer_inner_steps} set by the options"
    for note in choice.left_out.values():
        text += f"; {note}"
    return text + f"; {OUTER_TOKEN_NOTE}"


def outer_plan(choice: OuterChoice, sync_plan: Plan, cluster: Cluster, model: ModelSpec, train: TrainSpec,
               options: PlannerOptions) -> Plan:
    """The Plan of `choice`: the groups' pipelines in order, their groups and the outer settings."""
    sim = choice.sim
    pipelines = []
    groups: list[ReplicaGroup] = []
    for g, steps, rate in zip(choice.groups, choice.group_steps, sim.steps_per_s):
        first = len(pipelines)
        pipelines.extend(g.result.plan.pipelines)
        groups.append(ReplicaGroup(name=g.region, pipelines=list(range(first, len(pipelines))), inner_steps=steps,
                                   step_time_s=g.step_s, tokens_per_s=rate * train.tokens_per_step))
    tps = choice.tokens_per_s
    f, b = model.slice_flops_per_token(0, model.num_layers)
    peak = sum(cluster.island(s.island).device.peak_flops(train.dtype) * s.dp * s.tp
               for p in pipelines for s in p.stages)
    mfu = (f + b) * tps / peak if peak > 0 else 0.0
    pace = max(range(len(choice.groups)), key=lambda k: choice.group_steps[k] * choice.groups[k].step_s)
    pg = choice.groups[pace]
    bottleneck = (f"outer rounds of {duration(sim.round_s)} paced by group {pg.region} "
                  f"({choice.group_steps[pace]} inner steps of {duration(pg.step_s)}; within a step: "
                  f"{pg.result.plan.predicted.bottleneck})")
    if sim.exposed_s > 0.01 * sim.round_s:
        bottleneck = (f"outer sync over {choice.sync.link}: {duration(choice.sync.seconds)} per round, "
                      f"{duration(sim.exposed_s)} of it exposed; {bottleneck}")
    outer = OuterPlan(inner_steps=choice.inner_steps, codec=choice.codec.codec,
                      topk_fraction=choice.codec.topk_fraction if choice.codec.codec in SPARSE_CODECS else 0.0,
                      block_size=choice.codec.block_size if choice.codec.codec in ("int8", "int4") else 0,
                      lr=options.outer_lr, momentum=options.outer_momentum, nesterov=options.outer_nesterov,
                      overlap=options.outer_overlap,
                      deadline_s=options.outer_deadline_s or max(30.0, sim.round_s),
                      sync_s=choice.sync.seconds, round_s=sim.compute_s, bytes_per_round=choice.sync.bytes_per_group,
                      reason=outer_reason(choice, sync_plan.predicted.tokens_per_s, options))
    plan = Plan(model=sync_plan.model, global_batch=train.global_batch, seq_len=train.seq_len,
                predicted=Prediction(step_time_s=sim.round_s / choice.inner_steps, tokens_per_s=tps, mfu=mfu,
                                     bottleneck=bottleneck),
                islands=list(sync_plan.islands), pipelines=pipelines, mode="outer", groups=groups, outer=outer)
    plan.validate(model.num_layers)
    return plan
