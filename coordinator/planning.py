"""The coordinator's adapter to the planner: members, islands and links in, a runnable `Plan` out.

`make_plan` asks the planner (`atoll.coordinator.planner`) for slices and islands, then fills in what
only the coordinator knows: the plan epoch, the job id, the node ids of each stage in rank order, the
nodes' peer addresses, the rendezvous store of the epoch (hosted by the coordinator; every process group
of the epoch meets there under its own prefix) and the step to resume from. When the planner cannot
place the job, `fallback_plan` gives a plain valid plan so a job never waits on the planner.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from atoll.coordinator.linkmatrix import LinkEstimate
from atoll.coordinator.store import MemberRecord
from atoll.job import JobSpec
from atoll.plan import IslandInfo, PipelinePlan, Plan, Prediction, StagePlan
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
    rendezvous: str = ""
    """HOST:PORT of the coordinator's torch.distributed store ("" host: the host nodes dial the coordinator at)."""


def make_plan(inputs: PlanInputs) -> tuple[Plan, str]:
    """The plan for `inputs` and a line saying how it was made. Raises ValueError when no node is alive."""
    if not inputs.members or not inputs.islands:
        raise ValueError("cannot plan without alive members")
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


def planner_plan(inputs: PlanInputs) -> Plan:
    """The planner's plan for the live cluster: islands as formed, profiles as joined, links as probed.

    The job's micro-batch size and a fixed compression mode are passed on as constraints; with
    "adaptive" the planner picks each link's codec. The job's [outer] section says whether a cluster spanning
    regions may train as replica groups with an outer sync, and how.
    """
    from atoll.coordinator.planner import Cluster, PlannerOptions, ProfileSet, TrainSpec, plan_job

    job = inputs.job
    islands = {i.id: list(i.nodes) for i in inputs.islands}
    profiles = {n: m.profile for n, m in inputs.members.items()}
    # an unreachable pair (a failed probe, bandwidth 0) is left to the planner's fallback for unmeasured pairs
    links = [x for x in inputs.links if x.bandwidth_bytes_per_s > 0 and x.src in profiles and x.dst in profiles]
    regions = {i.id: i.group or "default" for i in inputs.islands}  # live islands carry their region as group
    cluster = Cluster.from_nodes(islands, profiles, links, regions=regions)
    codecs = {"adaptive": ("identity", "bf16", "fp16", "int8")}.get(job.compression.mode, (job.compression.mode,))
    # the runtime runs stages of one width per pipeline (replica r of a stage feeds replica r of the next)
    outer = job.outer
    options = PlannerOptions(micro_batches=(job.train.micro_batch,), activation_codecs=codecs, equal_widths=True,
                             outer_mode=outer.mode, outer_inner_steps=outer.inner_steps, outer_codec=outer.codec,
                             outer_topk_fraction=outer.topk_fraction, outer_overlap=outer.overlap, outer_lr=outer.lr,
                             outer_momentum=outer.momentum, outer_nesterov=outer.nesterov,
                             outer_deadline_s=outer.deadline_seconds)
    train = TrainSpec(global_batch=job.train.global_batch, seq_len=job.train.seq_len, dtype=job.train.dtype)
    return plan_job(job.model_spec, cluster, train, ProfileSet.from_node_profiles(islands, profiles), options)


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
    """Fill in epoch, job id, resume step, stage node ids, peer addresses and the rendezvous store."""
    plan.epoch, plan.job_id, plan.resume_step = inputs.epoch, inputs.job.id, inputs.resume_step
    plan.rendezvous = inputs.rendezvous
    islands = {i.id: i for i in inputs.islands}
    for p_index, pipeline in enumerate(plan.pipelines):
        for s_index, stage in enumerate(pipeline.stages):
            if not stage.nodes:
                island = islands.get(stage.island)
                if island is None:
                    raise ValueError(f"stage {s_index} of pipeline {p_index} names unknown island {stage.island!r}")
                stage.nodes = list(island.nodes[:stage.dp])
            missing = [n for n in stage.nodes if n not in inputs.members]
            if missing:
                raise ValueError(f"stage {s_index} of pipeline {p_index} names nodes that are not alive: {missing}")
            stage.dp_rendezvous = f"tcp://{inputs.rendezvous}" if inputs.rendezvous else ""
            for n in stage.nodes:
                plan.node_addresses[n] = inputs.members[n].peer_address
    return plan
