"""`plan_job`: from a model, a cluster and a training spec to a `Plan` (the planner's entry point)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from atoll.coordinator.planner.cluster import GBPS, Cluster, Island
from atoll.coordinator.planner.composer import Candidate, Composer, NoFeasiblePlan, SearchStats, StageChoice
from atoll.coordinator.planner.costmodel import CostModel, LinkCodecModel
from atoll.coordinator.planner.options import PlannerOptions, TrainSpec
from atoll.coordinator.planner.outer import choose_outer, outer_plan, wan_gap
from atoll.coordinator.planner.parallelizer import IslandParallelizer
from atoll.coordinator.planner.profiles import ProfileSet
from atoll.coordinator.planner.multipipe import SEVERAL_PIPELINES_MIN_GAIN, MultiCandidate, several_pipelines
from atoll.coordinator.planner.robust import (BandFigures, Scored, as_model, best_steps, choose,
                                              score_multi, score_single, with_network)
from atoll.coordinator.planner.simulator import PipelineTimes, simulate
from atoll.coordinator.planner.tied import holds_tied_weight, mixes_cuts, tied_copy_params
from atoll.hf import TRAIN_SEQ_LEN
from atoll.modelspec import ModelSpec
from atoll.coordinator.planner.unused import explain_unused
from atoll.plan import GB, IdleDevices, IslandInfo, PipelinePlan, Plan, Prediction, SendPlan, StagePlan, StageTiming
from atoll.units import duration


@dataclass(kw_only=True)
class PlanResult:
    """A plan with what produced it (for the CLI, the picture and the benchmark)."""

    plan: Plan
    candidate: Candidate
    """The first pipeline's candidate."""
    times: list[PipelineTimes]
    """Stage and link times of every pipeline, as simulated (with the cross-pipeline all-reduce)."""
    stats: SearchStats
    seconds: float
    """Wall time of the search."""
    note: str = ""
    """Why the plan trains in its mode when the cluster spans regions (outer mode: `plan.outer.reason`)."""
    left_out: dict[str, str] = field(default_factory=dict)
    """Outer mode: region -> why no replica group trains there."""
    band: BandFigures | None = None
    """Synchronous plans scored under a band of network models: the chosen plan's and the nominal-best plan's
    figures under each (`robust`); None without a band."""

    @property
    def gpus(self) -> int:
        return sum(s.dp * s.tp for p in self.plan.pipelines for s in p.stages)


def plan_job(model: ModelSpec, cluster: Cluster, train: TrainSpec, profiles: ProfileSet | None = None,
             options: PlannerOptions | None = None, *, codec_model: LinkCodecModel | None = None,
             parallelizer: IslandParallelizer | None = None) -> Plan:
    """The best plan found for `model` on `cluster`; raises NoFeasiblePlan (a ValueError) naming the shortfall."""
    return search_plan(model, cluster, train, profiles, options, codec_model=codec_model,
                       parallelizer=parallelizer).plan


def search_plan(model: ModelSpec, cluster: Cluster, train: TrainSpec, profiles: ProfileSet | None = None,
                options: PlannerOptions | None = None, *, codec_model: LinkCodecModel | None = None,
                parallelizer: IslandParallelizer | None = None) -> PlanResult:
    """Like `plan_job`, also returning the chosen candidate and search statistics.

    On a cluster spanning regions the synchronous plan is compared with replica groups, one per region,
    synced every round (`outer`), as `options.outer_mode` says. The plan lists every device it leaves out,
    with the reason (`Plan.idle`).
    """
    result = _search_plan(model, cluster, train, profiles, options, codec_model=codec_model,
                          parallelizer=parallelizer)
    result.plan.idle = idle_devices(result.plan, cluster, model, train, profiles, options, searched=result.stats)
    for d in result.plan.idle:  # a region an outer plan leaves out: why no group trains there
        d.reason = result.left_out.get(cluster.island(d.island).region, d.reason)
    if len(cluster.regions) > 1:
        result.plan.mode_reason = result.note
    return result


def idle_devices(plan: Plan, cluster: Cluster, model: ModelSpec, train: TrainSpec,
                 profiles: ProfileSet | None = None, options: PlannerOptions | None = None,
                 searched: SearchStats | None = None) -> list[IdleDevices]:
    """The devices of `cluster` no stage of `plan` runs on, per island, with the reason: for an island left out
    whole, `explain_unused`'s (memory, links, speed); else what the search found of arrangements that run more
    of them (`searched`: the fastest it composed and its predicted step, or the lower bound that pruned them)."""
    used: dict[str, int] = {}
    named: set[str] = set()
    shapes: dict[str, list[str]] = {}
    for pl in plan.pipelines:
        for st in pl.stages:
            used[st.island] = used.get(st.island, 0) + st.dp * st.tp
            named.update(st.nodes)
            shapes.setdefault(st.island, []).append(f"dp {st.dp} x tp {st.tp}"
                                                    + (f" in {st.lanes} lanes" if st.lanes > 1 else ""))
    found = {isl.id: _searched_reason(isl.id, used.get(isl.id, 0), plan, searched) for isl in cluster.islands}
    whole = {u.island: u.reason for u in explain_unused(plan, cluster, model, train, profiles, options, found)}
    out: list[IdleDevices] = []
    for isl in cluster.islands:
        left = isl.gpus - used.get(isl.id, 0)
        if left <= 0:
            continue
        reason = whole.get(isl.id)
        if reason is None:
            kinds = ", ".join(dict.fromkeys(shapes.get(isl.id, [])))
            reason = f"its other {isl.gpus - left} run stages of {kinds}; {found[isl.id]}"
        nodes = [n for n in isl.nodes if n not in named] if cluster.source == "live" else []
        out.append(IdleDevices(island=isl.id, gpus=left, reason=reason, nodes=nodes))
    return out


def _searched_reason(island: str, used: int, plan: Plan, searched: SearchStats | None) -> str:
    """What the search found of pipelines that run more than `used` devices of `island`, against `plan`."""
    chosen = plan.predicted.step_time_s
    more = [c for (i, g), c in (searched.using.items() if searched else ()) if i == island and g > used]
    for c in more:
        if not c.step_s:
            c.step_s = simulate(c.times).step_time_s
    if more:
        c = min(more, key=lambda c: c.step_s)
        n = sum(st.cost.gpus for st in c.stages if st.island.id == island)
        return (f"the fastest pipeline the search composed that runs {n} of them ({len(c.stages)} stages on "
                f"{c.gpus} devices, micro-batches of {c.micro_batch}) was predicted at {duration(c.step_s)} a step, "
                f"against the plan's {duration(chosen)}")
    bounds = [b for (i, g), b in (searched.bounds.items() if searched else ()) if i == island and g > used]
    if bounds:
        return (f"every arrangement that would run more of them was predicted no faster than {duration(min(bounds))} "
                f"a step at the least (a lower bound), against the plan's {duration(chosen)}")
    return f"no arrangement the search tried runs more than {used} of them"


def _search_plan(model: ModelSpec, cluster: Cluster, train: TrainSpec, profiles: ProfileSet | None,
                 options: PlannerOptions | None, *, codec_model: LinkCodecModel | None,
                 parallelizer: IslandParallelizer | None) -> PlanResult:
    t0 = time.perf_counter()
    options = options or PlannerOptions()
    if train.seq_len != model.config.seq_len:
        model = model.with_seq_len(train.seq_len)
    sync = search_sync(model, cluster, train, profiles, options, codec_model=codec_model, parallelizer=parallelizer)
    if options.outer_mode == "sync" or len(cluster.regions) < 2:
        return sync
    gap = wan_gap(cluster)
    # (no link inside any region, each one node: nothing to compare, and the predicted gain decides)
    if options.outer_mode == "auto" and gap is not None and gap[1] is not None and gap[0] * options.outer_wan_gap > gap[1]:
        sync.note = (f"sync: the slowest link between regions ({gap[0] / GBPS:.3g} Gbit/s) is within "
                     f"{options.outer_wan_gap:g}x of the slowest inside them ({gap[1] / GBPS:.3g} Gbit/s); replica "
                     "groups with an outer sync are for wide-area links")
        sync.seconds = time.perf_counter() - t0
        return sync

    # a replica group's plan re-scores its region's leading candidates under the band, without a whole search
    # under each model: outer mode plans every region, and its groups meet over the wide-area link only once a round
    regional = replace(options, band_search_up_to=0)

    def plan_region(sub: Cluster) -> PlanResult:
        return search_sync(model, sub, train, profiles, regional, codec_model=codec_model, parallelizer=parallelizer)

    choice, why = choose_outer(cluster, model, train, options, plan_region)
    sync_tps = sync.plan.predicted.tokens_per_s
    if choice is None:
        sync.note, sync.seconds = f"sync: {why}", time.perf_counter() - t0
        return sync
    gain = choice.tokens_per_s / sync_tps if sync_tps > 0 else math.inf
    if options.outer_mode == "auto" and gain < options.outer_min_gain:
        sync.note = (f"sync: replica groups per region would give {gain:.2f}x the synchronous plan's tokens/s, "
                     f"below the {options.outer_min_gain:g}x auto mode asks of them")
        sync.seconds = time.perf_counter() - t0
        return sync
    plan = outer_plan(choice, sync.plan, cluster, model, train, options)
    first = choice.groups[0].result
    return PlanResult(plan=plan, candidate=first.candidate, times=[t for g in choice.groups for t in g.result.times],
                      stats=sync.stats, seconds=time.perf_counter() - t0, note=plan.outer.reason if plan.outer else "",
                      left_out=choice.left_out)


def search_sync(model: ModelSpec, cluster: Cluster, train: TrainSpec, profiles: ProfileSet | None = None,
                options: PlannerOptions | None = None, *, codec_model: LinkCodecModel | None = None,
                parallelizer: IslandParallelizer | None = None) -> PlanResult:
    """The best synchronous plan: one step over every pipeline (what each replica group runs in outer mode)."""
    t0 = time.perf_counter()
    if train.seq_len != model.config.seq_len:
        model = model.with_seq_len(train.seq_len)
    cm = CostModel(model, train, profiles, options, codec_model)
    composer = Composer(cost_model=cm, cluster=cluster, parallelizer=parallelizer)
    top = composer.search()
    groups: list[list[list[str]]] = []
    if cm.options.several_pipelines:
        if 1 < len(cluster.regions) <= 4:
            groups.append([[i.id for i in cluster.islands if i.region == r] for r in cluster.regions])
        by_island = [[i.id] for i in cluster.islands]
        if 1 < len(cluster.islands) <= 4 and by_island not in groups:  # (an island a region: searched once)
            groups.append(by_island)
    multi: MultiCandidate | None = None
    # splits more than 10% behind the best single pipeline are not refined
    single = top[0].step_s if top else math.inf
    for gr in groups:
        kw = dict(beat_s=single / SEVERAL_PIPELINES_MIN_GAIN, refine_below_s=1.1 * single)
        got = several_pipelines(cm, cluster, gr, parallelizer, **kw)
        if got is not None and model.config.tied_head and mixes_cuts([len(p.stages) for p in got.pipelines]):
            # a tied head: every pipeline cut, or every one whole (coordinator.planner.tied); the better of the two
            tries = [several_pipelines(cm, cluster, gr, parallelizer, cuts=c, **kw) for c in ("whole", "cut")]
            got = min((t for t in tries if t is not None), key=lambda t: t.step_s, default=None)
        if got is not None and (multi is None or got.step_s < multi.step_s):
            multi = got
    # one pipeline unless several are measurably faster (multipipe.SEVERAL_PIPELINES_MIN_GAIN)
    if multi is not None and top and multi.step_s * SEVERAL_PIPELINES_MIN_GAIN > top[0].step_s:
        multi = None
    if not top and multi is None:
        raise NoFeasiblePlan(explain_infeasible(cm, cluster))
    band: BandFigures | None = None
    nominal = cm.options.network.name
    if cm.options.band and top:
        pool = band_pool(cm, cluster, composer, top, parallelizer)
        if multi is not None:
            pool.append(score_multi(multi.pipelines, multi.shares, cm,
                                    [with_network(cm, n) for n in (cm.options.network, *cm.options.band)], cluster))
        pick, why = choose(pool, nominal, cluster.total_gpus, cm.options.near_equal)
        fastest = min(pool, key=lambda e: e.steps[nominal])
        band = BandFigures(models=[cm.options.network, *cm.options.band], tokens_per_step=train.tokens_per_step,
                           chosen=dict(pick.steps), nominal_best=dict(fastest.steps), best=best_steps(pool), why=why,
                           candidates=len(pool))
        multi = None
        if pick.multi:
            priced, mtimes = pick.multi[nominal]
            multi = MultiCandidate(pipelines=priced, shares=pick.shares, times=mtimes, step_s=pick.steps[nominal],
                                   cross_sync_s=[[t.sync_s - c.sync_s for t, c in zip(mt.stages, p.times.stages)]
                                                 for mt, p in zip(mtimes, priced)])
        else:
            top = [pick.single[nominal]] + [c for c in top if c is not pick.single[nominal]]
    if multi is not None:
        pipes = list(zip(multi.pipelines, multi.times, multi.shares))
        cross = max(max(x) for x in multi.cross_sync_s)
        plan = to_plan(pipes, cm, cluster, note=f"; all-reduce across the {len(pipes)} pipelines {cross:.2f} s")
        first = multi.pipelines[0]
    else:
        first = top[0]
        plan = to_plan([(first, first.times, train.global_batch)], cm, cluster)
    times = [t for _, t, _ in pipes] if multi is not None and plan.pipelines and len(plan.pipelines) > 1 \
        else [first.times]
    return PlanResult(plan=plan, candidate=first, times=times, stats=composer.stats,
                      seconds=time.perf_counter() - t0, band=band)


def band_pool(cm: CostModel, cluster: Cluster, composer: Composer, top: list[Candidate],
              parallelizer: IslandParallelizer | None) -> list[Scored]:
    """The candidates the robust choice compares (`robust`), each scored under every model of the band: the
    search's leading pipelines, the best composed pipeline of a few other device counts and of the most devices,
    and on clusters of one region and at most `band_search_up_to` devices the leading pipelines of a search under
    each other model."""
    models = [with_network(cm, n) for n in (cm.options.network, *cm.options.band)]
    pool: list[Scored] = []
    seen: set[tuple] = set()

    def add(c: Candidate, built: CostModel, origin: str) -> None:
        key = (c.micro_batch, tuple((st.island.id, st.island.gpus, st.start, st.end, st.cost.dp, st.cost.tp,
                                     st.cost.zero, st.in_flight, st.defer) for st in c.stages))
        if key not in seen:
            seen.add(key)
            pool.append(score_single(as_model(c, built, cm, cluster), cm, models, cluster, origin=origin))

    def others(comp: Composer, lead: list[Candidate]) -> list[Candidate]:
        """The best composed pipelines of a few other device counts, and of the most devices, finished."""
        totals = sorted(((g, c) for (i, g), c in comp.stats.using.items() if not i and all(c is not t for t in lead)),
                        key=lambda x: x[1].estimate_s)
        extra = [c for _, c in totals[:cm.options.band_others]]
        most = max(totals, key=lambda x: (x[0], -x[1].estimate_s), default=None)
        if most is not None and all(c is not most[1] for c in extra):
            extra.append(most[1])
        # the plan of the most devices is refined as the leading ones are (the idle rule compares with it); the
        # others are simulated as composed (a refinement costs dozens of simulations, at 4,096 GPUs seconds)
        return [comp.finish(c, refine=most is not None and c is most[1]) for c in extra]

    for c in top:
        add(c, cm, "nominal search")
    for c in others(composer, top):
        add(c, cm, "nominal search, another device count")
    o = cm.options
    if parallelizer is None and (len(cluster.regions) == 1 or o.band_search_regions) \
            and cluster.total_gpus <= o.band_search_up_to:
        for other in models[1:]:
            comp = Composer(cost_model=other, cluster=cluster)
            found = comp.search()
            name = other.options.network.name
            for c in found:
                add(c, other, f"search under the {name} model")
            for c in others(comp, found):
                add(c, other, f"search under the {name} model, another device count")
    return pool


def explain_infeasible(cm: CostModel, cluster: Cluster) -> str:
    """Why nothing fits: the memory the model needs against what the cluster offers, or the batch shape."""
    model, train = cm.model, cm.train
    too_long = _sequence_too_long(cm, cluster)
    if too_long:
        return f"model {model.name} cannot be placed on {cluster.source or 'the cluster'}: {too_long}"
    states = sum(model.model_state_bytes(0, model.num_layers, train.dtype, train.optimizer).values())
    act = model.activation_bytes(0, model.num_layers, 1, train.seq_len, train.dtype, recompute=True)
    need = states + act
    usable = sum(cm.memory_capacity(i) * i.gpus for i in cluster.islands)
    head = f"model {model.name} cannot be placed on {cluster.source or 'the cluster'}"
    if need > usable:
        return (f"{head}: it needs {need / GB:.1f} GB (weights, gradients and {train.optimizer} states "
                f"{states / GB:.1f} GB plus activations of one sequence {act / GB:.1f} GB) but the "
                f"{cluster.total_gpus} GPUs offer {usable / GB:.1f} GB usable "
                f"({1 - cm.options.memory_reserve_fraction:.0%} of their memory); {_memory_hint(cm, cluster, need)}")
    biggest = max(model.layers, key=lambda x: x.params)
    one = cm.state_bytes(biggest.params, 3, max(i.gpus for i in cluster.islands))
    best_dev = max(cm.memory_capacity(i) for i in cluster.islands)
    if one > best_dev:
        return (f"{head}: its largest layer ({biggest.kind} {biggest.index}) needs {one / GB:.1f} GB per device "
                f"even under ZeRO-3, more than the {best_dev / GB:.1f} GB usable on the largest device")
    if need > TIGHT_SHARE * usable:
        # the sum fits, but not with the activations of the micro-batches in flight and the layers split over
        # devices of different sizes
        return (f"{head}: the model needs {need / GB:.1f} GB, {need / usable:.0%} of the {usable / GB:.1f} GB the "
                f"cluster offers, too little room once its layers are split over devices of these sizes with the "
                f"activations of the micro-batches in flight; {_memory_hint(cm, cluster, need / TIGHT_SHARE)}")
    g = train.global_batch
    more = "a multiple of the islands' sizes" if g & (g - 1) == 0 else "a power of two, or a multiple of the islands' sizes"
    return (f"{head}: the model needs {need / GB:.1f} GB and the cluster offers {usable / GB:.1f} GB, but no "
            f"pipeline of at most {cm.options.max_stages} stages whose widths divide global batch "
            f"{g} fits; try a global batch with more divisors ({more})")


def _sequence_too_long(cm: CostModel, cluster: Cluster) -> str:
    """Why one sequence fits no device, or "" when each layer fits one sequence somewhere: the layer that fits
    nowhere, at the least memory any stage holding it can take (micro-batch 1, one in flight, its states sharded
    over a whole island where the runtime may, any tp), with the figures and what to change. Activations grow
    with the sequence and no number of devices shares one sequence's, so this is a cause of its own."""
    from atoll.coordinator.planner.parallelizer import DefaultParallelizer, SliceQuery

    model, train, o = cm.model, cm.train, cm.options
    par = DefaultParallelizer(cm)
    n = model.num_layers
    best: tuple[float, float, float, int, Island] | None = None  # (need / usable, need, activations, layer, island)
    for i in range(n):
        fits, least = False, None
        for isl in cluster.islands:
            usable = cm.memory_capacity(isl)
            for tp in (t for t in par.tps if t <= isl.gpus_per_node):
                d = max(1, isl.gpus // tp)
                zero = 0 if holds_tied_weight(model, i, i + 1) else max(o.zero_stages, default=0)
                q = SliceQuery(start=i, end=i + 1, micro_batch=1, dp=d * tp, in_flight=1, batch=d)
                need = par.evaluate(q, isl, zero=zero, tp=tp).memory_bytes
                act = cm.table(isl, 1, tp).act[i] + cm.stage_output_bytes(i + 1, 1)
                if need <= usable:
                    fits = True
                    break
                if least is None or need / usable < least[0]:
                    least = (need / usable, need, act, i, isl)
            if fits:
                break
        if not fits and least is not None and (best is None or least[0] > best[0]):
            best = least
    if best is None:
        return ""
    _, need, act, i, isl = best
    usable = cm.memory_capacity(isl)
    layer = model.layers[i]
    what = {"embedding": "the embedding", "head": "the head", "block": f"block {i}"}[layer.kind]
    parts = f"its activations {act / GB:.1f} GB"
    if layer.kind == "head" and layer.saved_fp32_elems_per_token:
        logp = train.seq_len * layer.saved_fp32_elems_per_token * 4
        parts += (f", {logp / GB:.1f} GB of them the fp32 log-probabilities over the {model.config.vocab_size:,}-token "
                  "vocabulary that the loss keeps")
    elif layer.kind == "block":
        parts += " (recomputation cannot shrink them: a recomputed block holds them all again in its backward)"
    copy = " (the tied embedding's copy included)" if tied_copy_params(model, i, i + 1) else ""
    parts += f"; its weights, gradients and optimizer states {(need - act) / GB:.1f} GB{copy}"
    fit = int(train.seq_len * (usable - (need - act)) / act) if act > 0 and usable > need - act else 0
    shorter = 1 << (fit.bit_length() - 1) if fit > 0 else 0
    hint = "train shorter sequences (--seq-len, or train.seq_len in a job)"
    if shorter:
        usual = f", and {TRAIN_SEQ_LEN:,} is what such models usually train at" if shorter > TRAIN_SEQ_LEN else ""
        hint = (f"train shorter sequences: --seq-len (or train.seq_len in a job) {shorter:,} fits {what}{usual}")
    return (f"one sequence of {train.seq_len:,} tokens fits on no device: {what} (layer {i}) alone needs "
            f"{need / GB:.1f} GB with it at the least ({parts}), and the roomiest device for it, {isl.device.name}, "
            f"has {usable / GB:.1f} GB usable ({1 - o.memory_reserve_fraction:.0%} of its memory). {hint[0].upper()}"
            f"{hint[1:]}; or use devices of more than {need / GB / (1 - o.memory_reserve_fraction):.0f} GB")


TIGHT_SHARE = 0.6
"""Past this share of a cluster's usable memory, a model whose total fits is said to lack room rather than to meet
a batch it cannot divide (the planner's searches found no layout of it)."""


def _memory_hint(cm: CostModel, cluster: Cluster, need: float) -> str:
    """What would make a model that needs `need` bytes fit, for the job's own dtype and optimizer."""
    model, train = cm.model, cm.train
    usable = sum(cm.memory_capacity(i) * i.gpus for i in cluster.islands)
    biggest = max(cluster.islands, key=cm.memory_capacity)
    more = math.ceil((need - usable) / cm.memory_capacity(biggest))
    hint = f"add {'devices' if cluster.source == 'live' else 'GPUs'} (about {more} more {biggest.device.name})"
    if train.dtype == "fp32":
        # mixed precision keeps fp32 masters: the states stay as they are and only the activations halve
        half = model.activation_bytes(0, model.num_layers, 1, train.seq_len, "bf16", recompute=True)
        states = sum(model.model_state_bytes(0, model.num_layers, "bf16", train.optimizer).values())
        if states + half <= usable:
            return f"train in bf16 (it halves the activations; {states / GB + half / GB:.1f} GB would fit) or {hint}"
        return f"{hint}; training in bf16 instead of fp32 would not fit either (it keeps fp32 master weights)"
    return f"{hint}; the job already trains in {train.dtype}"


def _bottleneck(c: Candidate, pipeline_s: float, step_s: float, busy: float) -> str:
    worst_stage = max(range(len(c.stages)), key=lambda i: c.stages[i].cost.pace_s)
    st = c.stages[worst_stage]
    lanes = f", {st.cost.lanes} lanes at once" if st.cost.lanes > 1 else ""
    what = (f"compute of stage {worst_stage} on {st.island.id} (layers [{st.start}, {st.end}), "
            f"{duration(st.cost.time_s)} per micro-batch{lanes})")
    if c.links:
        # a link paces the pipeline by its time on the wire; its latency is left to the window before it
        worst_link = max(range(len(c.links)), key=lambda i: c.links[i].forward_s - c.links[i].latency_s)
        x = c.links[worst_link]
        wire = x.forward_s - x.latency_s
        if wire > st.cost.pace_s:
            what = (f"link {c.stages[worst_link].island.id} -> {c.stages[worst_link + 1].island.id} "
                    f"({x.codec}, {duration(wire)} per micro-batch on the wire)")
    tail = step_s - pipeline_s
    bubble = 1 - busy / pipeline_s if pipeline_s > 0 else 0.0
    return f"{what}; pipeline bubble {bubble:.0%}, all-reduce and optimizer {duration(tail)}"


class NodeAssignmentError(ValueError):
    """The stages' tp groups cannot each be given nodes of one machine (`assign_nodes`)."""


def assign_nodes(pipelines: list[list[StageChoice]]) -> dict[tuple[int, int], list[str]]:
    """The live nodes of each stage ((pipeline, stage) -> node ids, replica-major: `nodes[r * tp + k]` is tp rank k
    of replica r, `atoll.node.tp`): each stage takes dp x tp of its island's nodes, none twice. A tp group's nodes
    share a machine (`Island.hosts`): stages of the widest tp take theirs first, each group from the machine
    with the most nodes left (ties: the first), then tp-1 stages the rest in island order. Raises
    NodeAssignmentError where some tp group finds no machine with tp nodes left."""
    free: dict[str, dict[str, list[str]]] = {}  # island id -> machine -> nodes left, in island order
    for stages in pipelines:
        for st in stages:
            isl = st.island
            if isl.id not in free:
                machines = isl.hosts or isl.nodes
                by_machine: dict[str, list[str]] = {}
                for n, m in zip(isl.nodes, machines):
                    by_machine.setdefault(m, []).append(n)
                free[isl.id] = by_machine
    order = sorted(((p, k) for p, stages in enumerate(pipelines) for k in range(len(stages))),
                   key=lambda pk: (-pipelines[pk[0]][pk[1]].cost.tp, pk))
    out: dict[tuple[int, int], list[str]] = {}
    for p, k in order:
        st = pipelines[p][k]
        tp, machines = st.cost.tp, free[st.island.id]
        if tp == 1:
            left = [n for ns in machines.values() for n in ns]
            if len(left) < st.cost.gpus:
                raise NodeAssignmentError(f"island {st.island.id}: stage {k} of pipeline {p} needs {st.cost.gpus} "
                                          f"nodes, {len(left)} are left")
            nodes = left[:st.cost.gpus]
        else:
            nodes = []
            for _ in range(st.cost.dp):
                host = max(machines, key=lambda m: len(machines[m]), default=None)
                if host is None or len(machines[host]) < tp:
                    raise NodeAssignmentError(
                        f"island {st.island.id}: stage {k} of pipeline {p} runs tp {tp}, and no machine has {tp} "
                        "of its nodes left for another replica")
                nodes.extend(machines[host][:tp])
                machines[host] = machines[host][tp:]
        taken = set(nodes)
        for m in machines:
            machines[m] = [n for n in machines[m] if n not in taken]
        out[p, k] = nodes
    return out


def to_plan(pipes: list[tuple[Candidate, PipelineTimes, int]], cm: CostModel, cluster: Cluster,
            note: str = "") -> Plan:
    """A Plan from (candidate, its simulated times, its share of the global batch) per pipeline."""
    train = cm.train
    sims = [simulate(t) for _, t, _ in pipes]
    step = max(s.step_time_s for s in sims)
    slowest = max(range(len(pipes)), key=lambda k: sims[k].step_time_s)
    peak = sum(st.island.device.peak_flops(train.dtype) * st.cost.gpus for c, _, _ in pipes for st in c.stages)
    mfu = cm.model_flops_per_step() / (step * peak) if peak > 0 and step > 0 else 0.0
    islands = []
    for isl in cluster.islands:
        outer = max((lk.bandwidth for k, lk in cluster.links.items() if isl.id in k), default=0.0)
        islands.append(IslandInfo(id=isl.id, group=isl.group, device=isl.device.name, nodes=list(isl.nodes),
                                  gpus=isl.gpus, inner_bandwidth=isl.inter_node_bandwidth or 0.0,  # 0: none
                                  outer_bandwidth=outer))
    # live islands list one node per device: hand each stage its own dp x tp of them
    given = assign_nodes([list(c.stages) for c, _, _ in pipes]) if cluster.source == "live" else {}
    pipelines: list[PipelinePlan] = []
    for p_index, (c, times, share) in enumerate(pipes):
        stages: list[StagePlan] = []
        for k, st in enumerate(c.stages):
            nodes = given.get((p_index, k), [])
            send = None
            if k < len(c.links):
                x, lt = c.links[k], times.links[k]
                block = getattr(cm.codecs, "block_size", None)
                send = SendPlan(codec=x.codec, bytes=x.raw_bytes, seconds=x.forward_s,
                                block_size=block(x.codec) if block else (128 if x.codec in ("int8", "int4") else 0),
                                backward_seconds=lt.backward_s, latency_s=lt.latency_s)
            t = times.stages[k]
            # what the simulation took, so the plan simulates (and draws) as predicted wherever it is read
            timing = StageTiming(forward_s=t.forward_s, backward_s=t.backward_s, sync_s=t.sync_s,
                                 sync_hidden_s=t.sync_hidden_s, optimizer_s=t.optimizer_s, weight_s=t.weight_s,
                                 split_s=t.split_s)
            stages.append(StagePlan(island=st.island.id, layers=(st.start, st.end), dp=st.cost.dp, tp=st.cost.tp,
                                    zero=st.cost.zero, recompute=st.cost.recompute,
                                    recompute_layers=[] if st.cost.recompute else list(st.cost.recompute_layers),
                                    compute_s=st.cost.time_s,
                                    memory_gb_per_device=st.memory_bytes / GB, send=send, nodes=nodes,
                                    in_flight=st.in_flight, defer_weights=st.defer,
                                    defer_layers=list(st.defer_layers), lanes=st.cost.lanes, timing=timing))
        assert c.micro_batch * c.num_micro_batches == share
        pipelines.append(PipelinePlan(micro_batch=c.micro_batch, num_micro_batches=c.num_micro_batches,
                                      stages=stages))
    worst = pipes[slowest][0]
    sim = sims[slowest]
    bottleneck = _bottleneck(worst, sim.pipeline_time_s, sim.step_time_s, max(sim.busy_s))
    if len(pipes) > 1:
        bottleneck = f"pipeline {slowest}: {bottleneck}{note}"
    plan = Plan(model=cm.model.name, global_batch=train.global_batch, seq_len=train.seq_len,
                predicted=Prediction(step_time_s=step, tokens_per_s=train.tokens_per_step / step, mfu=mfu,
                                     bottleneck=bottleneck),
                islands=islands, pipelines=pipelines)
    plan.validate(cm.num_layers)
    return plan
