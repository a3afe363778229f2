"""Why a plan leaves an island unused: memory, the island's links to the islands in use, its speed, or simply a
faster plan without it. A pure function of the plan, the cluster and the cost model, for `atoll plan`."""

from __future__ import annotations

from dataclasses import dataclass

from atoll.coordinator.planner.cluster import GBPS, Cluster, Island
from atoll.coordinator.planner.costmodel import CostModel
from atoll.coordinator.planner.options import PlannerOptions, TrainSpec
from atoll.coordinator.planner.parallelizer import DefaultParallelizer
from atoll.coordinator.planner.profiles import ProfileSet
from atoll.modelspec import ModelSpec
from atoll.plan import GB, Plan
from atoll.units import duration


@dataclass(frozen=True, kw_only=True)
class UnusedIsland:
    island: str
    reason: str


def explain_unused(plan: Plan, cluster: Cluster, model: ModelSpec, train: TrainSpec,
                   profiles: ProfileSet | None = None, options: PlannerOptions | None = None,
                   searched: dict[str, str] | None = None) -> list[UnusedIsland]:
    """Each island of `cluster` that hosts no stage of `plan`, in the cluster's order, with the reason; where it
    is neither memory, links nor speed, `searched[island]` (what the search found of plans with it) if given."""
    used = {s.island for pl in plan.pipelines for s in pl.stages}
    idle = [i for i in cluster.islands if i.id not in used]
    if not idle:
        return []
    if train.seq_len != model.config.seq_len:
        model = model.with_seq_len(train.seq_len)
    cm = CostModel(model, train, profiles, options)
    return [UnusedIsland(island=i.id, reason=_reason(i, plan, cluster, cm, sorted(used), (searched or {}).get(i.id)))
            for i in idle]


def _reason(isl: Island, plan: Plan, cluster: Cluster, cm: CostModel, used: list[str], searched: str | None) -> str:
    model, train = cm.model, cm.train
    dev = f"{isl.gpus} x {isl.device.name}"
    # the cheapest a stage on it can be: one block, its states sharded over every device, one sequence in flight
    block = max(range(model.num_layers), key=lambda k: model.layers[k].params)
    layer = model.layers[block]
    need = cm.state_bytes(layer.params, 3, isl.gpus) + layer.activation_bytes(1, train.seq_len, train.dtype,
                                                                              recompute=True)
    usable = cm.memory_capacity(isl)
    if need > usable:
        return (f"too little memory: one layer needs {need / GB:.1f} GB per device even under ZeRO-3 over its "
                f"{dev}, and each has {usable / GB:.1f} GB usable")

    bottleneck = max(s.compute_s for pl in plan.pipelines for s in pl.stages)
    step = plan.predicted.step_time_s
    micro = max(pl.micro_batch for pl in plan.pipelines)
    links = [(lk.bandwidth, lk.latency_s, lk.shared, u) for u in used if (lk := cluster.link(isl.id, u)) is not None]
    if not links:
        return "no link to the islands in use"
    act = model.boundary_bytes(model.num_layers // 2, micro, train.seq_len, train.dtype)

    def send_s(link: tuple[float, float, bool, str]) -> float:
        # a link's figure is per GPU flow (cluster): the GPUs split the transfer, unless it is a shared capacity
        return cm.transfer_seconds(act / (1 if link[2] else min(isl.gpus, micro)), link[0], link[1])

    bw, latency, shared, peer = min(links, key=send_s)
    streams = 1 if shared else min(isl.gpus, micro)
    send = send_s((bw, latency, shared, peer))
    grads = cm.grad_bytes_per_param * model.total_params
    allreduce = 2 * grads / (cm.options.link_efficiency * bw * (1 if shared else isl.gpus))
    if send > bottleneck and allreduce > step:
        return (f"its links are too slow: the fastest to an island in use ({bw / GBPS:.3g} Gbit/s to {peer}"
                f"{'' if shared else ' per GPU'}) takes {_s(send)} for one micro-batch's activations "
                f"({act / 1e6:.1f} MB{'' if shared else f' over {streams} GPUs'}), more than the slowest stage's "
                f"{_s(bottleneck)}; as a pipeline of its own it would all-reduce {grads / GB:.1f} GB of gradients "
                f"over it, {_s(allreduce)} against a {_s(step)} step")

    k = min(block, model.num_layers - 1)
    # the island's GPUs sharing a micro-batch at their best split into tensor-parallel replicas
    par = DefaultParallelizer(cm)
    splits = par.splits(isl, isl.gpus, micro) or par.splits(isl, min(isl.gpus, micro), micro)
    try:
        one = min((cm.table(isl, rows, tp).forward(k, k + 1) + cm.table(isl, rows, tp).backward(k, k + 1)
                   for tp, _, rows in splits), default=0.0)
    except ValueError:  # a device with neither a profile nor a peak: no time to compare
        one = 0.0
    if one > bottleneck:
        return (f"too slow: one layer takes {_s(one)} per micro-batch of {micro} sequences on its {dev}, more "
                f"than the slowest stage in use ({_s(bottleneck)})")

    if searched:
        return f"the plan is faster without it: {searched}"
    peak = sum(i.gpus * i.device.peak_flops(train.dtype) for i in cluster.islands)
    share = isl.gpus * isl.device.peak_flops(train.dtype) / peak if peak > 0 else 0.0
    return (f"the plan is faster without it: its {dev} hold {share:.0%} of the cluster's peak compute, and no "
            f"arrangement tried with them (another stage, deeper pipelines, a pipeline of their own) beat the "
            f"{_s(step)} step")


def _s(seconds: float) -> str:
    return duration(seconds)
