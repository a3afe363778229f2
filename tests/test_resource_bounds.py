"""Resource bounds of the coordinator: half-open connections are dropped after the handshake timeout, connections
beyond the cap are closed, a Join is bounded in size, the rendezvous store listens on the coordinator's address
only and its keys are named from the token, and a flood of junk heartbeat-stream messages is a bounded number of
log lines."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from atoll.coordinator import authz
from atoll.coordinator.ca import Caller, JobAuthority
from atoll.coordinator.errors import InvalidArgument
from atoll.coordinator.membership import MembershipOptions
from atoll.coordinator.service import CoordinatorService, ServiceConfig
from atoll.coordinator.state import CoordinatorOptions
from atoll.coordinator.validation import MAX_JOIN_BYTES
from atoll.job import JobSpec
from atoll.log import RateLimit, setup_logging
from atoll.node.runner import PlanRunner
from atoll.rpc import RpcOptions, make_aio_server, make_channel, rendezvous_prefix
from atoll.tls import bootstrap_rpc
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bounds-token"
pytestmark = pytest.mark.timeout(120)


def _service(**config) -> CoordinatorService:
    opts = CoordinatorOptions(membership=MembershipOptions(lease=timedelta(seconds=30), settle=timedelta(0)),
                              dial_back=False)
    return CoordinatorService(job=JobSpec.load(ROOT / "examples" / "tiny.toml"), token=TOKEN, options=opts,
                              config=ServiceConfig(listen="127.0.0.1:0", tick=timedelta(milliseconds=50),
                                                   **config)).start()


@pytest.fixture
def service() -> Iterator[CoordinatorService]:
    svc = _service()
    yield svc
    svc.stop()


def _closed_within(socks: list[socket.socket], seconds: float) -> int:
    """How many of `socks` the server closed within `seconds`."""
    for s in socks:
        s.setblocking(False)
    closed: set[int] = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and len(closed) < len(socks):
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                if s.recv(4096) == b"":
                    closed.add(i)
            except BlockingIOError:
                pass
            except OSError:
                closed.add(i)
        time.sleep(0.02)
    return len(closed)


def test_half_open_connections_are_dropped_after_the_handshake_timeout() -> None:
    """400 TCP connections that never start their TLS handshake are closed once the timeout (0.5 s here) passes,
    and the coordinator still answers."""
    svc = _service(mutual_tls=True, rpc=RpcOptions(handshake_timeout=timedelta(seconds=0.5)))
    socks: list[socket.socket] = []
    try:
        host, port = svc.address.rsplit(":", 1)
        socks = [socket.create_connection((host, int(port)), timeout=5) for _ in range(400)]
        start = time.monotonic()
        assert _closed_within(socks, 10.0) == 400
        assert time.monotonic() - start < 5.0  # gRPC's own default would hold them 120 s
        assert svc.authority is not None
        rpc = bootstrap_rpc(TOKEN, svc.authority.ca.cert_pem)
        status = pb_grpc.CoordinatorStub(make_channel(svc.address, rpc, token=TOKEN)).GetStatus(
            pb.StatusRequest(), timeout=10)
        assert status.job.job_id == svc.state.job.id
    finally:
        for s in socks:
            s.close()
        svc.stop()


def test_connections_beyond_the_cap_are_closed_as_they_arrive() -> None:
    server = make_aio_server("127.0.0.1:0", [], RpcOptions(max_connections=5))
    socks: list[socket.socket] = []
    try:
        socks = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(20)]
        assert _closed_within(socks, 0.5) >= 15  # all but the five held (the handshake timeout is 10 s)
    finally:
        for s in socks:
            s.close()
        server.stop()


def test_an_oversized_join_is_refused_before_it_is_read(service: CoordinatorService) -> None:
    stub = pb_grpc.CoordinatorStub(make_channel(service.address, RpcOptions(), token=TOKEN))
    profile = pb.NodeProfile(hostname="h", device_kind="cpu", device_name="c", device_count=1,
                             memory_total_bytes=1 << 30, cpu_count=1)
    big = os.urandom(7_900_000)
    for _ in range(5):
        with pytest.raises(grpc.RpcError) as info:
            stub.Join(pb.JoinRequest(token=TOKEN, profile=profile, peer_address="127.0.0.1:1", csr_pem=big), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"at most {MAX_JOIN_BYTES} are accepted" in (info.value.details() or "")
    assert service.store.list_members() == []
    ok = stub.Join(pb.JoinRequest(token=TOKEN, profile=profile, peer_address="127.0.0.1:1"), timeout=10)
    assert ok.node_id


def test_a_join_over_mutual_tls_is_sized_before_its_signing_request_is_parsed(service: CoordinatorService) -> None:
    req = pb.JoinRequest(token=TOKEN, csr_pem=b"-----BEGIN CERTIFICATE REQUEST-----\n" + b"A" * (MAX_JOIN_BYTES + 1))
    with pytest.raises(InvalidArgument, match="the Join is .* bytes; at most"):
        authz._check_join(req, Caller("bootstrap"), service.state, JobAuthority.in_memory())


def _listening_on(port: int, host: str) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return False
    return True


def test_the_rendezvous_store_listens_on_the_coordinators_address_only(service: CoordinatorService) -> None:
    host, port = service.state.rendezvous.rsplit(":", 1)
    assert host == "127.0.0.1"
    assert _listening_on(int(port), "127.0.0.1")
    assert not _listening_on(int(port), "127.0.0.2")  # another loopback address: torch alone binds every interface


def test_rendezvous_keys_are_named_from_the_token() -> None:
    run = SimpleNamespace(ctx=SimpleNamespace(token=TOKEN), plan=SimpleNamespace(job_id="job-1", mode="sync"),
                          run_epoch=3, placement=None)
    prefix = PlanRunner._group_prefix(run)  # type: ignore[arg-type]
    assert prefix == rendezvous_prefix(TOKEN, "job-1", 3)
    assert "job-1" not in prefix and "epoch-3" not in prefix
    assert prefix != rendezvous_prefix("another-token", "job-1", 3)
    assert prefix != rendezvous_prefix(TOKEN, "job-1", 4)


def test_junk_heartbeat_stream_messages_log_a_bounded_number_of_lines(service: CoordinatorService,
                                                                      capfd: pytest.CaptureFixture[str]) -> None:
    setup_logging(0)
    channel = make_channel(service.address, RpcOptions(), token=TOKEN)
    stream = channel.stream_stream("/atoll.v1.Coordinator/HeartbeatStream", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
    junk = [os.urandom(40), b"\x08" + b"\xff" * 12, b"\x12\x05abc"]
    codes = set()
    for i in range(180):
        try:
            list(stream(iter([junk[i % len(junk)]]), timeout=5))
        except grpc.RpcError as e:
            codes.add(e.code())
    assert codes == {grpc.StatusCode.INVALID_ARGUMENT}
    err = capfd.readouterr().err
    assert err.count("Traceback") <= 1 and err.count("HeartbeatStream") <= 3, err[-3000:]


def test_rate_limit_lets_one_line_a_cause_through_each_interval() -> None:
    now = [0.0]
    limit = RateLimit(interval=60.0, clock=lambda: now[0])

    def record(msg: str, level: int = logging.ERROR) -> logging.LogRecord:
        return logging.LogRecord("atoll.x", level, __file__, 1, msg, None, None)

    passed = [limit.filter(record("disk full")) for _ in range(100)]
    assert passed.count(True) == 1
    assert limit.filter(record("another cause"))
    assert limit.filter(record("a warning", logging.WARNING)) and limit.filter(record("a warning", logging.WARNING))
    now[0] = 61.0
    later = record("disk full")
    assert limit.filter(later) and "99 more like it in the last 60 s not logged" in later.getMessage()
    assert not limit.filter(record("disk full"))
