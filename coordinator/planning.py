"""The coordinator's adapter to the planner: members, islands and links in, a runnable `Plan` out.

`make_plan` asks the planner (`atoll.coordinator.planner`) for slices and islands, then fills in what
only the coordinator knows: the plan epoch, the job id, the node ids of each stage in rank order, the
data-parallel rendezvous address of each stage and the step to resume from. When the planner cannot
place the job, `fallback_plan` gives a plain valid plan so a job never waits on the planner.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from atoll.coordinator.linkmatrix import LinkEstimate
from atoll.coordinator.store import MemberRecord
from atoll.job import JobSpec
from atoll.plan import IslandInfo, PipelinePlan, Plan, Prediction, StagePlan
from atoll.types import LinkMeasurement

log = logging.getLogger("atoll.coordinator.planning")

RENDEZVOUS_PORTS = (20000, 30000)
"""dp_rendezvous ports are drawn from this range, below Linux's ephemeral ports (32768-60999), so a
stage's rank 0 can bind its port while the node's other sockets hold ephemeral ones."""


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
    "adaptive" the planner picks each link's codec.
    """
    from atoll.coordinator.planner import Cluster, PlannerOptions, ProfileSet, TrainSpec, plan_job

    job = inputs.job
    islands = {i.id: list(i.nodes) for i in inputs.islands}
    profiles = {n: m.profile for n, m in inputs.members.items()}
    # an unreachable pair (a failed probe, bandwidth 0) is left to the planner's fallback for unmeasured pairs
    links = [x for x in inputs.links if x.bandwidth_bytes_per_s > 0 and x.src in profiles and x.dst in profiles]
    cluster = Cluster.from_nodes(islands, profiles, links)
    codecs = {"adaptive": ("identity", "bf16", "fp16", "int8")}.get(job.compression.mode, (job.compression.mode,))
    options = PlannerOptions(micro_batches=(job.train.micro_batch,), activation_codecs=codecs)
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
    """Fill in epoch, job id, resume step, stage node ids and rendezvous addresses."""
    plan.epoch, plan.job_id, plan.resume_step = inputs.epoch, inputs.job.id, inputs.resume_step
    islands = {i.id: i for i in inputs.islands}
    taken: set[tuple[str, int]] = set()
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
            host = _host(inputs.members[stage.nodes[0]].peer_address)
            port = rendezvous_port(inputs.job.id, inputs.epoch, p_index, s_index)
            while (host, port) in taken:  # two stages whose rank 0 shares a host need distinct ports
                port = RENDEZVOUS_PORTS[0] + (port + 1 - RENDEZVOUS_PORTS[0]) % (RENDEZVOUS_PORTS[1] - RENDEZVOUS_PORTS[0])
            taken.add((host, port))
            stage.dp_rendezvous = f"tcp://{host}:{port}"
    return plan


def rendezvous_port(job_id: str, epoch: int, pipeline: int, stage: int) -> int:
    """A port in RENDEZVOUS_PORTS that differs between epochs, so a new epoch's group never meets the
    lingering socket of the old one."""
    digest = hashlib.sha256(f"{job_id}/{epoch}/{pipeline}/{stage}".encode()).digest()
    lo, hi = RENDEZVOUS_PORTS
    return lo + int.from_bytes(digest[:4], "big") % (hi - lo)


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0]
