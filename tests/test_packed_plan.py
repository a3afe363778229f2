"""Packed plans (WatchPlanPacked): the plan a watch gets is the one published, packed once for every watch, and a
packed plan that is damaged, oversized or inconsistent is refused with a clear error."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import zstandard

from atoll.coordinator.membership import MembershipOptions
from atoll.coordinator.service import CoordinatorService, ServiceConfig
from atoll.coordinator.state import CoordinatorOptions
from atoll.job import JobSpec
from atoll.plan import PipelinePlan, Plan, StagePlan
from atoll.rpc import RpcOptions, make_channel
from atoll.serde import plan_from_packed, plan_to_proto
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "tok-packed"
pytestmark = pytest.mark.timeout(60)


def _plan(job: JobSpec, epoch: int, nodes: int = 300) -> Plan:
    names = [f"node-{i:04d}" for i in range(nodes)]
    stages = [StagePlan(island=f"i{k}", nodes=names[k::3], layers=(2 * k, 2 * k + 2), dp=len(names[k::3]))
              for k in range(3)]
    return Plan(model="tiny", global_batch=job.train.global_batch, seq_len=job.train.seq_len, epoch=epoch,
                job_id=job.id, pipelines=[PipelinePlan(stages=stages, micro_batch=2, num_micro_batches=4)],
                node_addresses={n: f"10.0.{i // 250}.{i % 250}:7171" for i, n in enumerate(names)})


def _packed(plan: Plan, **change) -> pb.PackedPlan:
    raw = plan_to_proto(plan).SerializeToString()
    m = pb.PackedPlan(epoch=plan.epoch, plan_bytes=len(raw), plan_zstd=zstandard.ZstdCompressor().compress(raw))
    for k, v in change.items():
        setattr(m, k, v)
    return m


def test_a_packed_plan_unpacks_to_the_plan() -> None:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    plan = _plan(job, 3)
    m = _packed(plan)
    assert len(m.plan_zstd) * 4 < m.plan_bytes  # the node ids and addresses repeat: it packs well
    assert plan_from_packed(m, 8 << 20) == plan


@pytest.mark.parametrize("change, error", [
    ({"plan_zstd": b"not a zstd frame"}, "does not unpack"),
    ({"plan_bytes": 100}, "bytes, not the 100 it states"),  # refused before anything is allocated
    ({"epoch": 4}, "holds epoch 3"),
    ({"plan_bytes": 64 << 20}, "over this node's message limit"),
])
def test_a_bad_packed_plan_is_refused(change: dict, error: str) -> None:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    with pytest.raises(ValueError, match=error):
        plan_from_packed(_packed(_plan(job, 3), **change), 8 << 20)


def test_a_frame_of_fewer_bytes_than_stated_is_refused() -> None:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    m = _packed(_plan(job, 3))
    m.plan_bytes += 10
    with pytest.raises(ValueError, match=r"holds \d+ bytes, not the \d+ it states"):
        plan_from_packed(m, 8 << 20)


def test_watches_get_the_published_plan_packed_once() -> None:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    opts = CoordinatorOptions(membership=MembershipOptions(lease=timedelta(seconds=30)))
    svc = CoordinatorService(job=job, token=TOKEN, options=opts, config=ServiceConfig(listen="127.0.0.1:0")).start()
    try:
        stub = pb_grpc.CoordinatorStub(make_channel(svc.address, RpcOptions(), token=TOKEN))
        plan = _plan(job, 1)
        plan = Plan(**{**plan.__dict__, "rendezvous": svc.state.rendezvous})
        svc.state.publish(plan, "test")
        packed = [next(iter(stub.WatchPlanPacked(pb.WatchPlanRequest(), timeout=10))) for _ in range(3)]
        full = next(iter(stub.WatchPlan(pb.WatchPlanRequest(), timeout=10)))
        assert all(m == packed[0] for m in packed)
        assert plan_from_packed(packed[0], 8 << 20) == svc.state.current_plan()
        assert pb.Plan.FromString(zstandard.ZstdDecompressor().decompress(packed[0].plan_zstd)) == full
        assert svc.watches._packed is not None and svc.watches._packed[1] is svc.watches._packed[1]
    finally:
        svc.stop()
