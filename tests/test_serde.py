"""Every x_to_proto / x_from_proto pair round-trips, and survives serialisation to bytes."""

from __future__ import annotations

from atoll import serde
from atoll.plan import IslandInfo, OuterPlan, PipelinePlan, Plan, Prediction, ReplicaGroup, SendPlan, StagePlan
from atoll.types import CollectiveStats, LayerTiming, LinkMeasurement, LinkStats, NodeProfile, StepMetrics
from atoll.v1 import atoll_pb2 as pb


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def test_profile_round_trip() -> None:
    p = NodeProfile(hostname="h1", device_kind="cuda", device_name="NVIDIA H100", device_count=8,
                    memory_total_bytes=80 << 30, memory_free_bytes=79 << 30, cpu_count=96,
                    layer_timings=[LayerTiming(layer_kind="block", micro_batch=4, seq_len=2048,
                                               forward_seconds=0.01, backward_seconds=0.02,
                                               weight_fraction=0.3, split_overhead=0.08)],
                    optimizer_step_seconds=0.003, torch_version="2.13.0", atoll_version="0.1.0",
                    region="eu-west")
    assert serde.profile_from_proto(_wire(serde.profile_to_proto(p))) == p


def test_link_round_trip() -> None:
    x = LinkMeasurement(src="a", dst="b", bandwidth_bytes_per_s=1.25e8, rtt_seconds=0.08, probe_bytes=1 << 20,
                        measured_unix=1.7e9)
    assert serde.link_from_proto(_wire(serde.link_to_proto(x))) == x


def test_island_round_trip() -> None:
    i = IslandInfo(id="i0", group="a100-east", device="A100-80GB", nodes=["n1", "n2"], gpus=2,
                   inner_bandwidth=1e10, outer_bandwidth=1e8)
    assert serde.island_from_proto(_wire(serde.island_to_proto(i))) == i


def _plan() -> Plan:
    return Plan(
        model="tiny", global_batch=16, seq_len=64, epoch=3, job_id="job", resume_step=25,
        node_addresses={"n1": "127.0.0.1:7001", "n2": "127.0.0.1:7002"}, rendezvous="127.0.0.1:29400",
        predicted=Prediction(step_time_s=0.5, tokens_per_s=2048.0, mfu=0.1, bottleneck="stage 1 compute"),
        islands=[IslandInfo(id="i0", device="cpu", nodes=["n1"], gpus=1),
                 IslandInfo(id="i1", device="cpu", nodes=["n2", "n3"], gpus=2)],
        pipelines=[PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
            StagePlan(island="i0", layers=(0, 3), compute_s=0.1, memory_gb_per_device=0.5, nodes=["n1"],
                      send=SendPlan(codec="int8", bytes=65536, seconds=0.01, block_size=64)),
            StagePlan(island="i1", layers=(3, 6), dp=2, lanes=2, zero=1, recompute=True, compute_s=0.2,
                      memory_gb_per_device=0.25, nodes=["n2", "n3"], dp_rendezvous="tcp://127.0.0.1:29500"),
        ])],
    )


def test_plan_round_trip() -> None:
    p = _plan()
    assert serde.plan_from_proto(_wire(serde.plan_to_proto(p))) == p


def test_plan_json_round_trip() -> None:
    p = _plan()
    assert Plan.from_json(p.to_json()) == p
    p.validate(num_layers=6)


def test_lanes_deepen_the_warm_up_of_their_stage_and_those_before() -> None:
    """A last stage of two lanes: each lane holds a micro-batch, so both stages open one forward more than strict
    1F1B. A middle stage of two lanes opens two more (each lane keeps one micro-batch ahead of the next stage), the
    stage before it as many; the last stage adds only its own deep window."""
    pipe = _plan().pipelines[0]
    assert [pipe.warmup_extra(s) for s in range(2)] == [1, 1]
    three = PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
        StagePlan(island="i", layers=(0, 1)), StagePlan(island="i", layers=(1, 2), dp=2, lanes=2),
        StagePlan(island="i", layers=(2, 3), in_flight=1)])
    assert [three.warmup_extra(s) for s in range(3)] == [2, 2, 1]


def _outer_plan() -> Plan:
    p = _plan()
    p.pipelines.append(PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
        StagePlan(island="i2", layers=(0, 6), nodes=["n4"])]))
    p.global_batch = 16
    p.mode = "outer"
    p.groups = [ReplicaGroup(name="eu", pipelines=[0], inner_steps=10, step_time_s=0.5, tokens_per_s=2048.0,
                             since_epoch=2, round=4),
                ReplicaGroup(name="us", pipelines=[1], inner_steps=7, step_time_s=0.7, tokens_per_s=1400.0,
                             since_epoch=3)]
    p.outer = OuterPlan(inner_steps=10, codec="topk", topk_fraction=0.25, lr=0.7, momentum=0.9, nesterov=True,
                        overlap=True, deadline_s=12.0, sync_s=3.5, round_s=5.0, bytes_per_round=123456,
                        reason="outer: 1.9x the synchronous plan")
    return p


def test_outer_plan_round_trip() -> None:
    p = _outer_plan()
    p.validate(num_layers=6)
    assert serde.plan_from_proto(_wire(serde.plan_to_proto(p))) == p
    assert Plan.from_json(p.to_json()) == p
    assert p.group_of(1) == 1 and p.group_of(0) == 0


def test_outer_plan_needs_every_pipeline_in_one_group() -> None:
    import pytest

    p = _outer_plan()
    p.groups[1].pipelines = []
    with pytest.raises(ValueError, match="exactly one replica group"):
        p.validate(num_layers=6)


def test_step_metrics_round_trip() -> None:
    s = StepMetrics(job_id="j", node_id="n", plan_epoch=2, step=7, pipeline=0, stage=1, loss=3.5, tokens=1024,
                    step_seconds=0.4, compute_seconds=0.3, wait_seconds=0.1, unix_time=1.7e9,
                    links=[LinkStats(peer="n2", direction="backward", bytes_raw=100, bytes_wire=30, seconds=0.01,
                                     codec="int8", bandwidth_bytes_per_s=1e8, transfers=4)],
                    collectives=[CollectiveStats(kind="all_reduce", bytes=4096, participants=3, seconds=0.02, count=2)])
    assert serde.step_metrics_from_proto(_wire(serde.step_metrics_to_proto(s))) == s
    no_loss = StepMetrics(job_id="j", node_id="n", plan_epoch=2, step=7)
    assert serde.step_metrics_from_proto(serde.step_metrics_to_proto(no_loss)).loss is None


def test_unknown_codec_is_a_clear_error() -> None:
    import pytest

    with pytest.raises(ValueError, match="unknown codec"):
        serde.codec_id("int3")
    with pytest.raises(ValueError, match="unknown codec id"):
        serde.codec_name(99)
    assert serde.codec_name(pb.CODEC_INT8_BLOCK) == "int8"
