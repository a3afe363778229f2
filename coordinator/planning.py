"""The coordinator's adapter to the planner: members, islands and links in, a runnable `Plan` out.

`make_plan` asks the planner (`atoll.coordinator.planner`) for slices and islands, then fills in what
only the coordinator knows: the plan epoch, the job id, the node ids of each stage in rank order, the
nodes' peer addresses, the rendezvous store of the epoch (hosted by the coordinator; every process group
of the epoch meets there under its own prefix) and the step to resume from. When the planner cannot
place the job, `fallback_plan` gives a plain valid plan so a job never waits on the planner.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
import copy
from dataclasses import dataclass, field, replace

from atoll.coordinator.planner.codecpolicy import mode_codecs
from atoll.coordinator.planner.network import NOMINAL, NetworkModel
from atoll.coordinator.linkmatrix import LinkEstimate
from atoll.coordinator.machineprobe import machine_of, per_flow_links
from atoll.coordinator.store import MemberRecord
from atoll.job import JobSpec
from atoll.plan import CheckpointCopy, IslandInfo, PipelinePlan, Plan, Prediction, ReplicaGroup, StagePlan
from atoll.coordinator.reachability import plan_address, plan_relays, relay_links, unreachable_nodes
from atoll.types import LinkMeasurement

log = logging.getLogger("atoll.coordinator.planning")

@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """What the coordinator knows when it plans."""

    job: JobSpec
    members: Mapping[str, MemberRecord]
    """Alive members by node id."""
    islands: list[IslandInfo]
    matrix: Mapping[tuple[str, str], LinkEstimate]
    """The completed link matrix (for the fallback and for reports)."""
    links: list[LinkMeasurement] = field(default_factory=list)
    """The measured links, as probed."""
    epoch: int
    """Epoch of the plan to make."""
    resume_step: int = 0
    """The last complete checkpoint step."""
    reached_step: int = 0
    """Steps the job had trained (the newest step reported + 1)."""
    live_resume: bool = True
    """Whether the plan's nodes may resume from live state (`membership.live_resume`)."""
    rendezvous: str = ""
    """HOST:PORT of the coordinator's torch.distributed store ("" host: the host nodes dial the coordinator at)."""
    previous: Plan | None = None
    """The plan being replaced (from this coordinator process): an outer-mode plan's replica groups that are
    intact are kept as they run, so a change in one region does not stop the others."""
    failed: frozenset[str] = frozenset()
    """Nodes that reported their run of the previous plan failed, or whose process restarted since it was made: their
    groups are replanned."""
    replan: frozenset[str] = frozenset()
    """Nodes whose replica group is planned afresh though it could run on (a drift replan: its devices no longer
    run at the speeds it was planned for)."""
    checkpoint_copies: list[CheckpointCopy] = field(default_factory=list)
    """Alive nodes' copies of the `resume_step` checkpoint (checkpoint folders are local to each node)."""
    handover: Mapping[str, str] = field(default_factory=dict)
    """Nodes of the previous plan that left gracefully and serve their live state: node id -> Peer address."""
    speed: Mapping[str, float] = field(default_factory=dict)
    """Per node, how many times slower than its profile its device computed in the runs so far
    (`atoll.coordinator.calibration`); the planner sees each profile scaled by it (1: as profiled)."""
    replica_groups: bool = False
    """The plan becomes replica groups of an outer-mode plan (`_plan_around`), which the runtime runs at tp 1."""
    machine_flows: Mapping[str, float] = field(default_factory=dict)
    """Per machine (`machineprobe.machine_of`), bytes/s of one flow while all its nodes send at once (machine
    probes): the planner reads links between machines at most at it (`machineprobe.per_flow_links`)."""
    live_step_s: Mapping[frozenset[str], float] = field(default_factory=dict)
    """Outer mode: the nodes of each replica group measured in the running rounds -> its live inner step time
    (`OuterRounds.live_step_times`); a group of the new plan on exactly those nodes is split by it (`live_split`)."""
    network: NetworkModel = NOMINAL
    """How the planner reads the probed links: as probed, or as the nodes' measured transfers and collectives
    fitted them (`atoll.coordinator.netfit`)."""


HANDOVER_SECONDS = 120.0
"""How long after leaving a node is still named as a holder of live state (it serves until its state was
taken, at most about a minute: `atoll.node.state_transfer.StateHolder.wait_handed_over`)."""


def handing_over(previous: Plan | None, members: Iterable[MemberRecord], now: float) -> dict[str, str]:
    """Nodes of `previous` that left gracefully (a Leave, not a lapsed lease) within `HANDOVER_SECONDS`:
    node id -> Peer address. They hold the live state their run left, which the next plan's nodes may fetch."""
    if previous is None:
        return {}
    return {m.node_id: m.peer_address for m in members
            if m.state == "left" and m.node_id in previous.node_addresses and m.peer_address
            and now - m.last_heartbeat_unix <= HANDOVER_SECONDS}


def make_plan(inputs: PlanInputs) -> tuple[Plan, str]:
    """The plan for `inputs` and a line saying how it was made. Raises ValueError when no node is alive."""
    if not inputs.members or not inputs.islands:
        raise ValueError("cannot plan without alive members")
    kept = kept_groups(inputs)
    plan, how = _plan_around(inputs, kept) if kept else _make_plan(inputs)
    note = live_split(plan, inputs.live_step_s, inputs.replan)
    return plan, how + (f"; {note}" if note else "")


def live_split(plan: Plan, live: Mapping[frozenset[str], float], drifted: Collection[str] = ()) -> str:
    """Outer mode: where a replica group of `plan` runs on nodes whose group was measured in the running rounds
    (`live`: its nodes -> live inner step time), split the rounds by that step time rather than the start-up
    profiles' prediction: every group planned afresh gets the whole inner steps that fit the round, H x the fastest
    group's step time (`pace.fitting_steps`; the nodes train it from their first round, the coordinator's decisions
    correct it live from the third). Not for a group of `drifted` nodes (a drift replan): its nodes' measured
    speeds already scale the profiles its new cut was planned from (layers moved off a slowed node), so its new
    plan's predicted step time is the figure, not the pace its nodes had under the cut being replaced (which
    would give the faster cut the slow cut's few steps a round). Groups kept running keep theirs, and
    the groups' predicted step times stay the cost model's (drift detection compares the nodes against those).
    Changes `plan` in place; returns what it changed ("" for nothing)."""
    from atoll.coordinator.pace import PaceOptions, fitting_steps

    if plan.mode != "outer" or plan.outer is None or not live:
        return ""
    drifted = frozenset(drifted)

    def figure(g: int) -> float | None:
        nodes = frozenset(plan.group_nodes(g))
        return None if nodes & drifted else live.get(nodes)

    figures = [figure(g) for g in range(len(plan.groups))]
    step_s = [f or grp.step_time_s for f, grp in zip(figures, plan.groups)]
    measured = [grp.name for f, grp in zip(figures, plan.groups) if f is not None]
    if not measured or min(step_s) <= 0:
        return ""
    h = plan.outer.inner_steps
    target = h * min(step_s)
    changed = []
    for grp, s in zip(plan.groups, step_s):
        if 0 < grp.since_epoch < plan.epoch:
            continue  # kept running: its nodes go on with their rounds
        steps = fitting_steps(h, target / s, h, PaceOptions(hysteresis=0.0))
        if steps != grp.inner_steps:
            changed.append(f"{grp.name} {grp.inner_steps} -> {steps}")
            grp.inner_steps = steps
    return (f"the live step times of {', '.join(measured)} split the rounds"
            + (f" ({', '.join(changed)} inner steps a round)" if changed else ""))


def kept_groups(inputs: PlanInputs) -> list[int]:
    """Replica groups of the previous outer-mode plan that run on unchanged: every node alive at the same
    peer address, none reported a failure or is named in `replan`, and no other alive node in their region (a
    node joining a region replans that region's group)."""
    prev = inputs.previous
    if prev is None or prev.mode != "outer" or inputs.job.outer.mode == "sync":
        return []
    region = {n: m.profile.region for n, m in inputs.members.items()}
    kept = []
    for g, group in enumerate(prev.groups):
        nodes = prev.group_nodes(g)
        if not nodes or any(n not in inputs.members or plan_address(inputs.members[n]) != prev.node_addresses.get(n)
                            or n in inputs.failed or n in inputs.replan for n in nodes):
            continue
        regions = {region[n] for n in nodes}
        others = {n for n in inputs.members if n not in nodes and region[n] in regions}
        if not others:
            kept.append(g)
    return kept


def _plan_around(inputs: PlanInputs, kept: list[int]) -> tuple[Plan, str]:
    """Keep the `kept` groups of the previous plan as they run; plan the other alive nodes as new groups."""
    prev = inputs.previous
    assert prev is not None and prev.outer is not None
    plan = Plan(model=prev.model, global_batch=prev.global_batch, seq_len=prev.seq_len, mode="outer",
                outer=replace(prev.outer), predicted=replace(prev.predicted))
    kept_nodes: set[str] = set()
    island_ids: set[str] = set()
    # island ids are not stable across re-forming (a departure renumbers them): a kept stage names the island
    # that holds its nodes now, so the plan's islands list every node it runs
    island_of = {n: i.id for i in inputs.islands for n in i.nodes}
    for g in kept:
        group = prev.groups[g]
        first = len(plan.pipelines)
        for p in group.pipelines:
            plan.pipelines.append(copy.deepcopy(prev.pipelines[p]))
            for st in plan.pipelines[-1].stages:
                kept_nodes.update(st.nodes)
                st.island = island_of.get(st.nodes[0], st.island) if st.nodes else st.island
                island_ids.add(st.island)
        plan.groups.append(replace(group, pipelines=list(range(first, len(plan.pipelines))),
                                   since_epoch=group.since_epoch or prev.epoch))
    rest = {n: m for n, m in inputs.members.items() if n not in kept_nodes}
    how = f"kept {len(kept)} replica group(s) running ({', '.join(prev.groups[g].name for g in kept)})"
    if rest:
        islands = [replace(i, nodes=[n for n in i.nodes if n in rest]) for i in inputs.islands]
        islands = [i for i in islands if i.nodes]
        sub_inputs = replace(inputs, members=rest, islands=islands, previous=None, replica_groups=True)
        sub, sub_how = _make_plan(sub_inputs)
        sub_groups = sub.groups if sub.mode == "outer" else [ReplicaGroup(
            name=",".join(sorted({i.group or i.id for i in sub.islands})) or "group",
            pipelines=list(range(len(sub.pipelines))), step_time_s=sub.predicted.step_time_s,
            tokens_per_s=sub.predicted.tokens_per_s)]
        kept_step = max((prev.groups[g].step_time_s for g in kept), default=0.0)
        offset = len(plan.pipelines)
        plan.pipelines.extend(sub.pipelines)
        for grp in sub_groups:
            h = plan.outer.inner_steps
            if kept_step > 0 and grp.step_time_s > 0:  # rounds of about the same wall time everywhere
                h = max(1, round(h * kept_step / grp.step_time_s)) if grp.step_time_s > kept_step else h
            plan.groups.append(replace(grp, pipelines=[p + offset for p in grp.pipelines], since_epoch=inputs.epoch,
                                       inner_steps=h if sub.mode != "outer" else grp.inner_steps))
        how += f"; planned the rest: {sub_how}"
    plan.islands = [i for i in inputs.islands if i.id in island_ids or any(n in rest for n in i.nodes)]
    plan.predicted.tokens_per_s = sum(g.tokens_per_s for g in plan.groups)
    plan = finish_plan(plan, inputs)
    plan.validate(inputs.job.model_spec.num_layers)
    return plan, how


def _make_plan(inputs: PlanInputs) -> tuple[Plan, str]:
    try:
        plan, how = planner_plan(inputs), "planner"
        plan = finish_plan(plan, inputs)
        plan.validate(inputs.job.model_spec.num_layers)
    except (ImportError, ValueError) as e:  # NoFeasiblePlan is a ValueError; so are unusable measurements
        log.warning("the planner could not place the job (%s); using the fallback plan", e)
        plan, how = fallback_plan(inputs), f"fallback plan: layers split evenly over the islands ({e})"
        plan = finish_plan(plan, inputs)
        plan.validate(inputs.job.model_spec.num_layers)
    return plan, how


NEAR_EQUAL = 0.1
"""`PlannerOptions.near_equal` of plans from node profiles: three profiles of equal CPU nodes, each timing 5% apart
from run to run, put the demo's near-equal plans (one stage of three replicas, three stages, two stages) up to 7%
apart in either order, and a smaller margin let the choice flip between runs."""


DRIFTED = 1.5
"""A device calibrated this many times slower or faster than its profile is off it by more than noise."""


def _drifted(speed: Mapping[str, float]) -> bool:
    return any(f > DRIFTED or f < 1 / DRIFTED for f in speed.values())


def planner_plan(inputs: PlanInputs) -> Plan:
    """The planner's plan for the live cluster: islands as formed, profiles as joined, links as probed.

    The job's micro-batch size (the most sequences one replica runs per micro-batch) and a fixed compression
    mode are passed on as constraints; with "adaptive" the planner picks each link's codec. Stages of one
    pipeline may have different widths: the runtime shares each micro-batch's rows among a stage's replicas
    and regroups them between stages (`atoll.node.placement`). The job's [outer] section says whether a cluster spanning
    regions may train as replica groups with an outer sync, and how.
    """
    from atoll.coordinator.planner import Cluster, PlannerOptions, ProfileSet, TrainSpec, plan_job

    job = inputs.job
    islands = {i.id: list(i.nodes) for i in inputs.islands}
    # each device as fast as its runs showed it to be, not only as it profiled at join
    profiles = {n: m.profile.scaled(inputs.speed.get(n, 1.0)) for n, m in inputs.members.items()}
    # an unreachable pair (a failed probe, bandwidth 0) is left to the planner's fallback for unmeasured pairs
    links = [x for x in inputs.links if x.bandwidth_bytes_per_s > 0 and x.src in profiles and x.dst in profiles]
    # per GPU flow, as the planner reads a link: between machines, what a flow gets while the machines' nodes all send
    machines = {n: machine_of(n, m.profile) for n, m in inputs.members.items()}
    capped = per_flow_links(links, machines, inputs.machine_flows)
    if capped != links:
        log.info("links between machines read at one flow of all their nodes sending at once: %s",
                 ", ".join(f"{m} {bw * 8 / 1e6:.1f} Mbit/s" for m, bw in sorted(inputs.machine_flows.items())))
    links = capped
    # two nodes that accept no connections talk through a relay: the planner sees that link at the slower leg
    links, _ = relay_links(links, profiles, unreachable_nodes(inputs.members))
    regions = {i.id: i.group or "default" for i in inputs.islands}  # live islands carry their region as group
    # [cluster] host_tp: the nodes of one machine (one process per GPU) may run a stage tensor-parallel; the
    # runtime runs tp in synchronous plans only, so not where replica groups across regions are possible
    host_tp = job.cluster.host_tp and not inputs.replica_groups and (len(set(regions.values())) == 1
                                                                     or job.outer.mode == "sync")
    hosts = machines if host_tp else None
    cluster = Cluster.from_nodes(islands, profiles, links, regions=regions, hosts=hosts)
    codecs = mode_codecs(job.compression.mode)
    outer = job.outer
    options = PlannerOptions(micro_batches=(job.train.micro_batch,), activation_codecs=codecs, equal_widths=False,
                             outer_mode=outer.mode, outer_inner_steps=outer.inner_steps, outer_codec=outer.codec,
                             outer_topk_fraction=outer.topk_fraction, outer_sparse_fraction=outer.sparse_fraction,
                             outer_overlap=outer.overlap, outer_lr=outer.lr,
                             outer_momentum=outer.momentum, outer_nesterov=outer.nesterov,
                             outer_deadline_s=outer.deadline_seconds, zero_bubble=job.train.zero_bubble,
                             fill_warmup=job.train.zero_bubble,  # off: plain 1F1B, nothing filled either
                             # the runtime shards optimizer state and gradients (ZeRO-1/2), never the weights
                             zero_stages=(0, 1, 2), max_tp=8 if host_tp else 1,
                             # profiles are measurements some percent apart from run to run (equal CPUs too):
                             # plans within that are taken as equal, and the same one chosen every time
                             # (not where a device runs well off its profile: its speed is measured then, not
                             # noise, and a tie kept on it costs what the drift replan is for)
                             near_equal=0.0 if _drifted(inputs.speed) else NEAR_EQUAL,
                             # links as probed, or as the nodes' measured transfers fitted them (`netfit`): the
                             # network is measured here, not a spec sheet's figures, so no band of guesses
                             network=inputs.network, band=())
    train = TrainSpec(global_batch=job.train.global_batch, seq_len=job.train.seq_len, dtype=job.train.dtype)
    timings = ProfileSet.from_node_profiles(islands, profiles, job.model_spec.block_params)
    if not host_tp:
        return plan_job(job.model_spec, cluster, train, timings, options)
    # the search prunes by bounds and refines only its best few: with more choices it may settle on a plan a
    # search without tp beats, so the plan without tp is the floor (and the answer where tp cannot be placed);
    # a model that fits only split over tp ranks has no plan without it
    plain: Plan | None = None
    try:
        plain = plan_job(job.model_spec, cluster, train, timings, replace(options, max_tp=1))
    except ValueError as e:
        log.info("no plan without tensor parallelism (%s); planning with it", e)
    try:
        with_tp = plan_job(job.model_spec, cluster, train, timings, options)
    except ValueError as e:  # a tp group would span machines (NodeAssignmentError), or nothing fits
        if plain is None:
            raise
        log.warning("%s; planning without tensor parallelism", e)
        return plain
    if plain is None:
        return with_tp
    faster = with_tp.predicted.step_time_s < plain.predicted.step_time_s
    log.info("host_tp: the plan with tensor parallelism within machines predicts %.3f s a step, without %.3f s; "
             "keeping the one %s", with_tp.predicted.step_time_s, plain.predicted.step_time_s,
             "with tp" if faster else "without tp")
    return with_tp if faster else plain


def fallback_plan(inputs: PlanInputs) -> Plan:
    """FALLBACK, used only when the planner cannot place the job: one pipeline over the islands in order,
    the layers split evenly (the first stages take the remainder), every stage with the same
    data-parallel degree: the largest that fits the smallest island used and divides the micro-batches.

    As in the planner's plans, a pipeline micro-batch is shared evenly by a stage's replicas: each replica
    runs the job's micro_batch sequences, so the pipeline micro-batch is micro_batch x dp.
    """
    job = inputs.job
    num_layers = job.model_spec.num_layers
    islands = inputs.islands[:num_layers]
    smallest = min(len(i.nodes) for i in islands)
    micro = job.train.num_micro_batches
    dp = max(d for d in range(1, smallest + 1) if micro % d == 0)
    base, extra = divmod(num_layers, len(islands))
    stages, start = [], 0
    for k, island in enumerate(islands):
        end = start + base + (1 if k < extra else 0)
        stages.append(StagePlan(island=island.id, layers=(start, end), dp=dp, nodes=list(island.nodes[:dp])))
        start = end
    return Plan(model=job.model.name, global_batch=job.train.global_batch, seq_len=job.train.seq_len,
                predicted=Prediction(bottleneck="not predicted (fallback plan)"), islands=list(inputs.islands),
                pipelines=[PipelinePlan(micro_batch=job.train.micro_batch * dp, num_micro_batches=micro // dp,
                                        stages=stages)])


def finish_plan(plan: Plan, inputs: PlanInputs) -> Plan:
    """Fill in epoch, job id, resume step, stage node ids, peer addresses and the rendezvous store.

    A stage without node ids takes the next dp x tp nodes of its island that no stage of the plan runs on
    yet (an island may host several stages, each on nodes of its own); a node listed twice is refused.
    """
    plan.epoch, plan.job_id, plan.resume_step = inputs.epoch, inputs.job.id, inputs.resume_step
    plan.reached_step = max(inputs.reached_step, inputs.resume_step)
    plan.live_resume = inputs.live_resume
    plan.rendezvous = inputs.rendezvous
    plan.checkpoint_copies, plan.handover = list(inputs.checkpoint_copies), dict(inputs.handover)
    for g in plan.groups:
        g.since_epoch = g.since_epoch or inputs.epoch
    islands = {i.id: i for i in inputs.islands}
    for info in plan.islands:  # a live plan's islands carry their region (the planner's copies name a cluster group)
        live = islands.get(info.id)
        if live is not None:
            info.group = live.group
            info.nodes = info.nodes or list(live.nodes)
    taken: dict[str, tuple[int, int]] = {}
    for p_index, pipeline in enumerate(plan.pipelines):
        for s_index, stage in enumerate(pipeline.stages):
            for n in stage.nodes:
                if n in taken:
                    raise ValueError(f"node {n} is listed in stage {taken[n][1]} of pipeline {taken[n][0]} and again "
                                     f"in stage {s_index} of pipeline {p_index}; a node runs one stage")
                taken[n] = (p_index, s_index)
    for p_index, pipeline in enumerate(plan.pipelines):
        for s_index, stage in enumerate(pipeline.stages):
            if not stage.nodes:
                island = islands.get(stage.island)
                if island is None:
                    raise ValueError(f"stage {s_index} of pipeline {p_index} names unknown island {stage.island!r}")
                need = stage.dp * stage.tp
                free = [n for n in island.nodes if n not in taken]
                if len(free) < need:
                    raise ValueError(f"stage {s_index} of pipeline {p_index} needs {need} nodes of island "
                                     f"{stage.island!r}; only {len(free)} are not running another stage")
                stage.nodes = free[:need]
                taken.update((n, (p_index, s_index)) for n in stage.nodes)
            missing = [n for n in stage.nodes if n not in inputs.members]
            if missing:
                raise ValueError(f"stage {s_index} of pipeline {p_index} names nodes that are not alive: {missing}")
            stage.dp_rendezvous = f"tcp://{inputs.rendezvous}" if inputs.rendezvous else ""
            for n in stage.nodes:
                plan.node_addresses[n] = plan_address(inputs.members[n])
    # a node of the previous plan still alive but given no stage (left idle) holds the live state its run left:
    # the new plan's nodes take it from there rather than roll back to a checkpoint
    prev = inputs.previous
    if prev is not None:
        for n in prev.node_addresses:
            m = inputs.members.get(n)
            if n not in plan.node_addresses and n not in plan.handover and m is not None and plan_address(m):
                plan.handover[n] = plan_address(m)
    unreachable = unreachable_nodes(inputs.members)
    if unreachable:
        _, routes = relay_links(inputs.links, inputs.members, unreachable)
        plan.relays, missing = plan_relays(plan, unreachable, routes)
        for line in missing:  # their stages will fail to connect and say so; the next plan may have a relay
            log.warning("plan epoch %d: %s", plan.epoch, line)
        for r in plan.relays:  # the relay's address, also when it runs no stage itself
            plan.node_addresses[r.via] = inputs.members[r.via].peer_address
    return plan
