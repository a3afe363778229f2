"""Plan watches hold no server thread: far more watches than threads leave the unary calls answering, and the
watches are bounded in number, per node and in life."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from atoll.coordinator.membership import MembershipOptions
from atoll.coordinator.service import CoordinatorService, ServiceConfig
from atoll.coordinator.state import CoordinatorOptions
from atoll.job import JobSpec
from atoll.plan import Plan
from atoll.rpc import RpcOptions, make_aio_server, make_channel
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "tok-watch"
WATCHES = 200
pytestmark = pytest.mark.timeout(30)


def _service(**config) -> CoordinatorService:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    opts = CoordinatorOptions(membership=MembershipOptions(lease=timedelta(seconds=30)))
    return CoordinatorService(job=job, token=TOKEN, options=opts,
                              config=ServiceConfig(listen="127.0.0.1:0", **config)).start()


@pytest.fixture
def small_pool() -> Iterator[CoordinatorService]:
    svc = _service(max_workers=4, max_watches=WATCHES + 10)
    yield svc
    svc.stop()


def _stubs(service: CoordinatorService, n: int) -> list[pb_grpc.CoordinatorStub]:
    return [pb_grpc.CoordinatorStub(make_channel(service.address, RpcOptions(), token=TOKEN)) for _ in range(n)]


def _join(stub: pb_grpc.CoordinatorStub, host: str) -> str:
    profile = pb.NodeProfile(hostname=host, device_kind="cpu", device_name="cpu-x", device_count=1,
                             memory_total_bytes=16 << 30, memory_free_bytes=8 << 30, cpu_count=4)
    return stub.Join(pb.JoinRequest(token=TOKEN, profile=profile, peer_address="127.0.0.1:6100"), timeout=5).node_id


def _wait_open(service: CoordinatorService, n: int) -> None:
    """Until the coordinator holds exactly `n` watches."""
    deadline = time.monotonic() + 10
    while service.watches.open != n:
        assert time.monotonic() < deadline, f"{service.watches.open} watches open, not {n}"
        time.sleep(0.02)


def _publish(service: CoordinatorService, epoch: int) -> Plan:
    job = service.state.job
    plan = Plan(model="tiny", global_batch=job.train.global_batch, seq_len=job.train.seq_len, epoch=epoch,
                job_id=job.id, rendezvous=service.state.rendezvous)
    service.state.publish(plan, "test")
    return plan


def test_many_open_watches_leave_the_unary_calls_answering(small_pool: CoordinatorService) -> None:
    stubs = _stubs(small_pool, 4)
    node = _join(stubs[0], "h0")
    watches = [stubs[i % len(stubs)].WatchPlan(pb.WatchPlanRequest(), timeout=20) for i in range(WATCHES)]
    try:
        _wait_open(small_pool, WATCHES)  # 200 watches on a server of 4 threads
        for _ in range(3):
            t0 = time.monotonic()
            assert stubs[1].GetStatus(pb.StatusRequest(), timeout=2).job.name == "tiny"
            assert stubs[2].Heartbeat(pb.HeartbeatRequest(node_id=node), timeout=2).lease_seconds == 30
            assert time.monotonic() - t0 < 2
        plan = _publish(small_pool, 1)
        assert {next(w).epoch for w in watches} == {plan.epoch}  # every watcher hears of the new plan
    finally:
        for w in watches:
            w.cancel()
    _wait_open(small_pool, 0)  # cancelled watches are let go


def test_watches_beyond_the_limit_are_refused_and_a_node_keeps_two() -> None:
    svc = _service(max_watches=3)
    try:
        stub = _stubs(svc, 1)[0]
        node = _join(stub, "h0")
        first, second = (stub.WatchPlan(pb.WatchPlanRequest(node_id=node), timeout=20) for _ in range(2))
        _wait_open(svc, 2)
        third = stub.WatchPlan(pb.WatchPlanRequest(node_id=node), timeout=20)  # ends the oldest of the node's
        with pytest.raises(grpc.RpcError) as replaced:
            next(first)
        assert replaced.value.code() == grpc.StatusCode.ABORTED and "replaced" in replaced.value.details()
        _wait_open(svc, 2)
        anonymous = stub.WatchPlan(pb.WatchPlanRequest(), timeout=20)
        _wait_open(svc, 3)
        with pytest.raises(grpc.RpcError) as refused:
            next(stub.WatchPlan(pb.WatchPlanRequest(), timeout=20))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_watches" in refused.value.details()
        _publish(svc, 1)
        assert [next(w).epoch for w in (second, third, anonymous)] == [1, 1, 1]
        for w in (second, third, anonymous):
            w.cancel()
    finally:
        svc.stop()


def test_a_watch_ends_after_its_life_and_on_stop() -> None:
    svc = _service(max_watch_life=timedelta(milliseconds=300))
    stub = _stubs(svc, 1)[0]
    t0 = time.monotonic()
    assert list(stub.WatchPlan(pb.WatchPlanRequest(), timeout=20)) == []  # ends cleanly; the node reopens it
    assert time.monotonic() - t0 < 5
    svc.stop()

    svc = _service()
    stub = _stubs(svc, 1)[0]
    watch = stub.WatchPlan(pb.WatchPlanRequest(), timeout=20)
    _wait_open(svc, 1)
    t0 = time.monotonic()
    svc.stop()
    assert list(watch) == [] and time.monotonic() - t0 < 5


def test_the_aio_server_refuses_a_port_in_use() -> None:
    svc = _service()
    try:
        with pytest.raises(OSError, match="could not listen"):
            make_aio_server(svc.address, [], RpcOptions())
    finally:
        svc.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is needed to make a test certificate")
def test_the_coordinator_serves_calls_watches_and_health_over_tls(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60)
    svc = _service(rpc=RpcOptions(tls_cert=cert, tls_key=key))
    try:
        channel = make_channel(svc.address, RpcOptions(tls_root_ca=cert), token=TOKEN)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = pb_grpc.CoordinatorStub(channel)
        assert stub.GetStatus(pb.StatusRequest(), timeout=10).job.name == "tiny"
        watch = stub.WatchPlan(pb.WatchPlanRequest(), timeout=10)
        _wait_open(svc, 1)
        _publish(svc, 1)
        assert next(watch).epoch == 1
        watch.cancel()
    finally:
        svc.stop()
