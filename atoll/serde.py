"""Conversion between the core types and their `atoll.v1` wire messages: `x_to_proto` / `x_from_proto`.

Every pair round-trips (tests/test_serde.py). Nothing else in the project builds these messages by hand.
"""

from __future__ import annotations

from atoll.plan import (CheckpointCopy, RelayRoute, IdleDevices, IslandInfo, OuterPlan, PipelinePlan, Plan, Prediction, ReplicaGroup, SendPlan,
                        StagePlan, StageTiming)
from atoll.types import (CollectiveStats, LayerTiming, LinkMeasurement, LinkStats, NodeProfile, StepMetrics,
                         TensorOffence)
from atoll.v1 import atoll_pb2 as pb

# codec names used in plans, configs and logs <-> the wire enum
CODEC_BY_NAME: dict[str, int] = {
    "identity": pb.CODEC_IDENTITY,
    "fp16": pb.CODEC_FP16,
    "bf16": pb.CODEC_BF16,
    "int8": pb.CODEC_INT8_BLOCK,
    "int4": pb.CODEC_INT4_BLOCK,
    "topk": pb.CODEC_TOPK,
    "sparse2": pb.CODEC_SPARSE2,
    "hadamard": pb.CODEC_HADAMARD,
    "lowrank": pb.CODEC_LOWRANK,
}
CODEC_NAME: dict[int, str] = {v: k for k, v in CODEC_BY_NAME.items()}

DIRECTION_BY_NAME: dict[str, int] = {"forward": pb.DIRECTION_FORWARD, "backward": pb.DIRECTION_BACKWARD,
                                     "outer": pb.DIRECTION_OUTER}
DIRECTION_NAME: dict[int, str] = {v: k for k, v in DIRECTION_BY_NAME.items()}


def codec_id(name: str) -> int:
    try:
        return CODEC_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; codecs: {', '.join(CODEC_BY_NAME)}") from None


def codec_name(codec: int) -> str:
    try:
        return CODEC_NAME[codec]
    except KeyError:
        raise ValueError(f"unknown codec id {codec}") from None


# --- profiles -----------------------------------------------------------------------------------------

def layer_timing_to_proto(t: LayerTiming) -> pb.LayerTiming:
    return pb.LayerTiming(layer_kind=t.layer_kind, micro_batch=t.micro_batch, seq_len=t.seq_len,
                          forward_seconds=t.forward_seconds, backward_seconds=t.backward_seconds,
                          weight_fraction=t.weight_fraction, split_overhead=t.split_overhead)


def layer_timing_from_proto(m: pb.LayerTiming) -> LayerTiming:
    return LayerTiming(layer_kind=m.layer_kind, micro_batch=m.micro_batch, seq_len=m.seq_len,
                       forward_seconds=m.forward_seconds, backward_seconds=m.backward_seconds,
                       weight_fraction=m.weight_fraction, split_overhead=m.split_overhead)


def profile_to_proto(p: NodeProfile) -> pb.NodeProfile:
    return pb.NodeProfile(
        hostname=p.hostname, device_kind=p.device_kind, device_name=p.device_name, device_count=p.device_count,
        memory_total_bytes=p.memory_total_bytes, memory_free_bytes=p.memory_free_bytes, cpu_count=p.cpu_count,
        layer_timings=[layer_timing_to_proto(t) for t in p.layer_timings],
        optimizer_step_seconds=p.optimizer_step_seconds, torch_version=p.torch_version,
        atoll_version=p.atoll_version, region=p.region, unreachable=p.unreachable,
    )


def profile_from_proto(m: pb.NodeProfile) -> NodeProfile:
    return NodeProfile(
        hostname=m.hostname, device_kind=m.device_kind, device_name=m.device_name, device_count=m.device_count,
        memory_total_bytes=m.memory_total_bytes, memory_free_bytes=m.memory_free_bytes, cpu_count=m.cpu_count,
        layer_timings=[layer_timing_from_proto(t) for t in m.layer_timings],
        optimizer_step_seconds=m.optimizer_step_seconds, torch_version=m.torch_version,
        atoll_version=m.atoll_version, region=m.region, unreachable=m.unreachable,
    )


# --- links ---------------------------------------------------------------------------------------------

def link_to_proto(x: LinkMeasurement) -> pb.LinkMeasurement:
    return pb.LinkMeasurement(src=x.src, dst=x.dst, bandwidth_bytes_per_s=x.bandwidth_bytes_per_s,
                              rtt_seconds=x.rtt_seconds, probe_bytes=x.probe_bytes, measured_unix=x.measured_unix,
                              flows=x.flows)


def link_from_proto(m: pb.LinkMeasurement) -> LinkMeasurement:
    return LinkMeasurement(src=m.src, dst=m.dst, bandwidth_bytes_per_s=m.bandwidth_bytes_per_s,
                           rtt_seconds=m.rtt_seconds, probe_bytes=m.probe_bytes, measured_unix=m.measured_unix,
                           flows=max(1, m.flows))


def link_stats_to_proto(x: LinkStats) -> pb.LinkStats:
    return pb.LinkStats(peer=x.peer, direction=DIRECTION_BY_NAME[x.direction], bytes_raw=x.bytes_raw,
                        bytes_wire=x.bytes_wire, seconds=x.seconds, codec=codec_id(x.codec),
                        bandwidth_bytes_per_s=x.bandwidth_bytes_per_s, transfers=x.transfers)


def link_stats_from_proto(m: pb.LinkStats) -> LinkStats:
    return LinkStats(peer=m.peer, direction=DIRECTION_NAME.get(m.direction, "forward"), bytes_raw=m.bytes_raw,
                     bytes_wire=m.bytes_wire, seconds=m.seconds, codec=codec_name(m.codec),
                     bandwidth_bytes_per_s=m.bandwidth_bytes_per_s, transfers=m.transfers)


def collective_stats_to_proto(x: CollectiveStats) -> pb.CollectiveStats:
    return pb.CollectiveStats(kind=x.kind, bytes=x.bytes, participants=x.participants, seconds=x.seconds,
                              count=x.count)


def collective_stats_from_proto(m: pb.CollectiveStats) -> CollectiveStats:
    return CollectiveStats(kind=m.kind, bytes=m.bytes, participants=m.participants, seconds=m.seconds,
                           count=max(1, m.count))


# --- islands and plans ---------------------------------------------------------------------------------

def island_to_proto(i: IslandInfo) -> pb.Island:
    return pb.Island(id=i.id, device_name=i.device, node_ids=i.nodes, inner_bandwidth_bytes_per_s=i.inner_bandwidth,
                     outer_bandwidth_bytes_per_s=i.outer_bandwidth, group=i.group, gpus=i.gpus)


def island_from_proto(m: pb.Island) -> IslandInfo:
    return IslandInfo(id=m.id, group=m.group, device=m.device_name, nodes=list(m.node_ids), gpus=m.gpus,
                      inner_bandwidth=m.inner_bandwidth_bytes_per_s, outer_bandwidth=m.outer_bandwidth_bytes_per_s)


def _send_to_proto(s: SendPlan) -> pb.LinkPlan:
    return pb.LinkPlan(codec=codec_id(s.codec), bytes=s.bytes, seconds=s.seconds,
                       backward_seconds=s.backward_seconds, latency_seconds=s.latency_s,
                       codec_params=pb.CodecParams(block_size=s.block_size, topk_fraction=s.topk_fraction,
                                                   zstd_level=s.zstd_level))


def _send_from_proto(m: pb.LinkPlan) -> SendPlan:
    return SendPlan(codec=codec_name(m.codec), bytes=m.bytes, seconds=m.seconds,
                    block_size=m.codec_params.block_size, topk_fraction=m.codec_params.topk_fraction,
                    zstd_level=m.codec_params.zstd_level, backward_seconds=m.backward_seconds,
                    latency_s=m.latency_seconds)


def stage_to_proto(s: StagePlan, index: int) -> pb.Stage:
    m = pb.Stage(index=index, island=s.island, node_ids=s.nodes, layer_start=s.layers[0], layer_end=s.layers[1],
                 dp=s.dp, tp=s.tp, zero=s.zero, recompute=s.recompute, compute_seconds=s.compute_s,
                 memory_bytes_per_device=s.memory_gb_per_device * 1e9, dp_rendezvous=s.dp_rendezvous,
                 recompute_layers=s.recompute_layers, in_flight=s.in_flight,
                 defer_weights=s.defer_weights, defer_layers=s.defer_layers, lanes=s.lanes)
    if s.send is not None:
        m.send.CopyFrom(_send_to_proto(s.send))
    if s.timing is not None:
        t = s.timing
        m.timing.CopyFrom(pb.StageTiming(forward_seconds=t.forward_s, backward_seconds=t.backward_s,
                                         sync_seconds=t.sync_s, sync_hidden_seconds=t.sync_hidden_s,
                                         optimizer_seconds=t.optimizer_s, weight_seconds=t.weight_s,
                                         split_seconds=t.split_s))
    return m


def _timing_from_proto(m: pb.StageTiming) -> StageTiming:
    return StageTiming(forward_s=m.forward_seconds, backward_s=m.backward_seconds, sync_s=m.sync_seconds,
                       sync_hidden_s=m.sync_hidden_seconds, optimizer_s=m.optimizer_seconds,
                       weight_s=m.weight_seconds, split_s=m.split_seconds)


def stage_from_proto(m: pb.Stage) -> StagePlan:
    return StagePlan(island=m.island, layers=(m.layer_start, m.layer_end), dp=m.dp, tp=m.tp, zero=m.zero,
                     recompute=m.recompute, recompute_layers=list(m.recompute_layers), compute_s=m.compute_seconds,
                     memory_gb_per_device=m.memory_bytes_per_device / 1e9,
                     send=_send_from_proto(m.send) if m.HasField("send") else None,
                     nodes=list(m.node_ids), dp_rendezvous=m.dp_rendezvous, in_flight=m.in_flight,
                     defer_weights=m.defer_weights, defer_layers=list(m.defer_layers), lanes=m.lanes or 1,
                     timing=_timing_from_proto(m.timing) if m.HasField("timing") else None)


def group_to_proto(g: ReplicaGroup) -> pb.ReplicaGroup:
    return pb.ReplicaGroup(name=g.name, pipelines=g.pipelines, inner_steps=g.inner_steps,
                           step_time_seconds=g.step_time_s, tokens_per_second=g.tokens_per_s,
                           since_epoch=g.since_epoch, round=g.round)


def group_from_proto(m: pb.ReplicaGroup) -> ReplicaGroup:
    return ReplicaGroup(name=m.name, pipelines=list(m.pipelines), inner_steps=m.inner_steps,
                        step_time_s=m.step_time_seconds, tokens_per_s=m.tokens_per_second,
                        since_epoch=m.since_epoch, round=m.round)


def outer_to_proto(o: OuterPlan) -> pb.OuterPlan:
    return pb.OuterPlan(inner_steps=o.inner_steps, codec=codec_id(o.codec),
                        codec_params=pb.CodecParams(block_size=o.block_size, topk_fraction=o.topk_fraction),
                        lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, overlap=o.overlap,
                        deadline_seconds=o.deadline_s, sync_seconds=o.sync_s, round_seconds=o.round_s,
                        bytes_per_round=o.bytes_per_round, reason=o.reason)


def outer_from_proto(m: pb.OuterPlan) -> OuterPlan:
    return OuterPlan(inner_steps=m.inner_steps, codec=codec_name(m.codec), block_size=m.codec_params.block_size,
                     topk_fraction=m.codec_params.topk_fraction, lr=m.lr, momentum=m.momentum, nesterov=m.nesterov,
                     overlap=m.overlap, deadline_s=m.deadline_seconds, sync_s=m.sync_seconds,
                     round_s=m.round_seconds, bytes_per_round=m.bytes_per_round, reason=m.reason)


def plan_to_proto(p: Plan) -> pb.Plan:
    m = _plan_to_proto(p)
    m.mode = p.mode
    m.groups.extend(group_to_proto(g) for g in p.groups)
    if p.outer is not None:
        m.outer.CopyFrom(outer_to_proto(p.outer))
    m.idle.extend(pb.IdleDevices(island=x.island, gpus=x.gpus, reason=x.reason, nodes=x.nodes) for x in p.idle)
    m.checkpoint_copies.extend(pb.CheckpointCopy(node_id=c.node_id, layer_start=c.layers[0], layer_end=c.layers[1],
                                                 address=c.address) for c in p.checkpoint_copies)
    m.handover.update(p.handover)
    m.relays.extend(pb.RelayRoute(a=r.a, b=r.b, via=r.via, bandwidth_bytes_per_s=r.bandwidth_bytes_per_s)
                    for r in p.relays)
    return m


def _plan_to_proto(p: Plan) -> pb.Plan:
    return pb.Plan(
        epoch=p.epoch, job_id=p.job_id, model=p.model, global_batch=p.global_batch, seq_len=p.seq_len,
        predicted=pb.PlanPrediction(step_time_seconds=p.predicted.step_time_s,
                                    tokens_per_second=p.predicted.tokens_per_s, mfu=p.predicted.mfu,
                                    bottleneck=p.predicted.bottleneck),
        islands=[island_to_proto(i) for i in p.islands],
        pipelines=[pb.Pipeline(index=k, micro_batch=pl.micro_batch, num_micro_batches=pl.num_micro_batches,
                               stages=[stage_to_proto(s, j) for j, s in enumerate(pl.stages)])
                   for k, pl in enumerate(p.pipelines)],
        resume_step=p.resume_step, node_addresses=p.node_addresses, rendezvous=p.rendezvous,
        reached_step=p.reached_step, mode_reason=p.mode_reason, checkpoint_resume=not p.live_resume,
    )


def plan_from_packed(m: pb.PackedPlan, max_bytes: int) -> Plan:
    """The plan of a `PackedPlan` (WatchPlanPacked): its zstd frame unpacked to at most `max_bytes` (the channel's
    message limit, as if it had come as a `Plan`), parsed and converted. ValueError says what is wrong with it."""
    import zstandard
    from google.protobuf.message import DecodeError

    if m.plan_bytes > max_bytes:
        raise ValueError(f"a packed plan of {m.plan_bytes} bytes is over this node's message limit ({max_bytes})")
    try:
        # the frame states its size, and decompression allocates that: checked against the stated length first
        size = zstandard.frame_content_size(m.plan_zstd)
        if size != m.plan_bytes:
            raise ValueError(f"a packed plan's frame holds {size} bytes, not the {m.plan_bytes} it states")
        raw = zstandard.ZstdDecompressor().decompress(m.plan_zstd, max_output_size=max(1, m.plan_bytes))
    except zstandard.ZstdError as e:
        raise ValueError(f"a packed plan does not unpack: {e}") from None
    if len(raw) != m.plan_bytes:
        raise ValueError(f"a packed plan unpacked to {len(raw)} bytes, not the {m.plan_bytes} it states")
    try:
        plan = pb.Plan.FromString(raw)
    except DecodeError as e:
        raise ValueError(f"a packed plan is not a Plan message: {e}") from None
    if plan.epoch != m.epoch:
        raise ValueError(f"a packed plan says epoch {m.epoch} but holds epoch {plan.epoch}")
    return plan_from_proto(plan)


def plan_from_proto(m: pb.Plan) -> Plan:
    return Plan(
        model=m.model, global_batch=m.global_batch, seq_len=m.seq_len,
        predicted=Prediction(step_time_s=m.predicted.step_time_seconds, tokens_per_s=m.predicted.tokens_per_second,
                             mfu=m.predicted.mfu, bottleneck=m.predicted.bottleneck),
        islands=[island_from_proto(i) for i in m.islands],
        pipelines=[PipelinePlan(micro_batch=pl.micro_batch, num_micro_batches=pl.num_micro_batches,
                                stages=[stage_from_proto(s) for s in pl.stages]) for pl in m.pipelines],
        epoch=m.epoch, job_id=m.job_id, resume_step=m.resume_step, reached_step=m.reached_step,
        live_resume=not m.checkpoint_resume, node_addresses=dict(m.node_addresses),
        rendezvous=m.rendezvous, mode=m.mode or "sync", mode_reason=m.mode_reason, groups=[group_from_proto(g) for g in m.groups],
        outer=outer_from_proto(m.outer) if m.HasField("outer") else None,
        idle=[IdleDevices(island=x.island, gpus=x.gpus, reason=x.reason, nodes=list(x.nodes)) for x in m.idle],
        checkpoint_copies=[CheckpointCopy(node_id=c.node_id, layers=(c.layer_start, c.layer_end), address=c.address)
                           for c in m.checkpoint_copies],
        handover=dict(m.handover),
        relays=[RelayRoute(a=r.a, b=r.b, via=r.via, bandwidth_bytes_per_s=r.bandwidth_bytes_per_s) for r in m.relays],
    )


# --- steps ---------------------------------------------------------------------------------------------

def step_metrics_to_proto(s: StepMetrics) -> pb.StepMetrics:
    return pb.StepMetrics(
        job_id=s.job_id, node_id=s.node_id, plan_epoch=s.plan_epoch, step=s.step, pipeline=s.pipeline,
        stage=s.stage, has_loss=s.loss is not None, loss=s.loss if s.loss is not None else 0.0, tokens=s.tokens,
        step_seconds=s.step_seconds, compute_seconds=s.compute_seconds, wait_seconds=s.wait_seconds,
        links=[link_stats_to_proto(x) for x in s.links], unix_time=s.unix_time,
        peak_memory_bytes=s.peak_memory_bytes, has_val_loss=s.val_loss is not None,
        val_loss=s.val_loss if s.val_loss is not None else 0.0,
        loss_scale=s.loss_scale if s.loss_scale is not None else 0.0, skipped=s.skipped,
        restored_from=s.restored_from, restore_bytes=s.restore_bytes, restore_seconds=s.restore_seconds,
        steps_rolled_back=s.steps_rolled_back, offences=[offence_to_proto(o) for o in s.offences],
        collectives=[collective_stats_to_proto(c) for c in s.collectives],
    )


def offence_to_proto(o: TensorOffence) -> pb.TensorOffence:
    return pb.TensorOffence(sender=o.sender, kind=o.kind, direction=o.direction, step=o.step,
                            micro_batch=o.micro_batch, norm=o.norm, finite=o.finite, detail=o.detail)


def offence_from_proto(m: pb.TensorOffence) -> TensorOffence:
    return TensorOffence(sender=m.sender, kind=m.kind, direction=m.direction, step=m.step, micro_batch=m.micro_batch,
                         norm=m.norm, finite=m.finite, detail=m.detail)


def step_metrics_from_proto(m: pb.StepMetrics) -> StepMetrics:
    return StepMetrics(
        job_id=m.job_id, node_id=m.node_id, plan_epoch=m.plan_epoch, step=m.step, pipeline=m.pipeline,
        stage=m.stage, loss=m.loss if m.has_loss else None, tokens=m.tokens, step_seconds=m.step_seconds,
        compute_seconds=m.compute_seconds, wait_seconds=m.wait_seconds,
        links=[link_stats_from_proto(x) for x in m.links], unix_time=m.unix_time,
        peak_memory_bytes=m.peak_memory_bytes, val_loss=m.val_loss if m.has_val_loss else None,
        loss_scale=m.loss_scale if m.loss_scale > 0 else None, skipped=m.skipped,
        restored_from=m.restored_from, restore_bytes=m.restore_bytes, restore_seconds=m.restore_seconds,
        steps_rolled_back=m.steps_rolled_back, offences=[offence_from_proto(o) for o in m.offences],
        collectives=[collective_stats_from_proto(c) for c in m.collectives],
    )
