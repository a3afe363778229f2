"""Heartbeats on one stream per node: each gets its reply in order, renews the lease as a unary heartbeat does, and
the stream is bounded (one node per stream, per-node replacement, a life, a limit). The node's sender reopens a
stream the coordinator ended and falls back to unary calls where the coordinator has no streams."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures
from datetime import timedelta
from pathlib import Path

import grpc
import pytest

from atoll.coordinator.membership import MembershipOptions
from atoll.coordinator.service import CoordinatorService, ServiceConfig
from atoll.coordinator.state import CoordinatorOptions
from atoll.job import JobSpec
from atoll.node.heartbeat_stream import HeartbeatSender, HeartbeatTimeout
from atoll.rpc import RpcOptions, make_channel
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "tok-heartbeat"
pytestmark = pytest.mark.timeout(60)


def _service(**config) -> CoordinatorService:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    opts = CoordinatorOptions(membership=MembershipOptions(lease=timedelta(seconds=30)))
    return CoordinatorService(job=job, token=TOKEN, options=opts,
                              config=ServiceConfig(listen="127.0.0.1:0", **config)).start()


@pytest.fixture
def coordinator() -> Iterator[CoordinatorService]:
    svc = _service()
    yield svc
    svc.stop()


def _stub(svc: CoordinatorService) -> pb_grpc.CoordinatorStub:
    return pb_grpc.CoordinatorStub(make_channel(svc.address, RpcOptions(), token=TOKEN))


def _join(stub: pb_grpc.CoordinatorStub, host: str) -> str:
    profile = pb.NodeProfile(hostname=host, device_kind="cpu", device_name="cpu-x", device_count=1,
                             memory_total_bytes=16 << 30, memory_free_bytes=8 << 30, cpu_count=4)
    return stub.Join(pb.JoinRequest(token=TOKEN, profile=profile, peer_address="127.0.0.1:6100"), timeout=5).node_id


def _sender(stub: pb_grpc.CoordinatorStub, **kw) -> HeartbeatSender:
    return HeartbeatSender(lambda requests, life: stub.HeartbeatStream(requests, timeout=life),
                           lambda req, seconds: stub.Heartbeat(req, timeout=seconds), **kw)


def _wait(cond, what: str, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_heartbeats_on_one_stream_renew_the_lease(coordinator: CoordinatorService) -> None:
    stub = _stub(coordinator)
    node = _join(stub, "h0")
    sender = _sender(stub)
    try:
        last = coordinator.store.get_member(node).last_heartbeat_unix
        for step in range(1, 6):
            reply = sender.beat(pb.HeartbeatRequest(node_id=node, plan_epoch=0, step=step), 5)
            assert reply.lease_seconds == 30 and reply.plan_epoch == coordinator.state.epoch
            now = coordinator.store.get_member(node).last_heartbeat_unix
            assert now >= last
            last = now
        assert coordinator.heartbeats.open == 1  # the five heartbeats shared one stream
        assert sender.streaming
    finally:
        sender.reset()
    _wait(lambda: coordinator.heartbeats.open == 0, "the closed stream was not released")


def test_an_unknown_node_is_told_to_join_and_the_next_beat_opens_a_new_stream(coordinator: CoordinatorService) -> None:
    stub = _stub(coordinator)
    sender = _sender(stub)
    with pytest.raises(grpc.RpcError) as info:
        sender.beat(pb.HeartbeatRequest(node_id="stranger"), 5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "join first" in info.value.details()
    node = _join(stub, "h1")
    assert sender.beat(pb.HeartbeatRequest(node_id=node), 5).lease_seconds == 30
    sender.reset()


def test_a_stream_speaks_for_one_node(coordinator: CoordinatorService) -> None:
    stub = _stub(coordinator)
    a, b = _join(stub, "ha"), _join(stub, "hb")
    with pytest.raises(grpc.RpcError) as info:
        list(stub.HeartbeatStream(iter([pb.HeartbeatRequest(node_id=a), pb.HeartbeatRequest(node_id=b)]), timeout=5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert a in info.value.details() and "one node" in info.value.details()


def test_a_stream_ends_after_its_life_and_the_sender_reopens_it() -> None:
    svc = _service(max_watch_life=timedelta(seconds=0.3))
    try:
        stub = _stub(svc)
        node = _join(stub, "h2")
        sender = _sender(stub)
        for _ in range(4):  # each beat after the life's end finds the stream ended, reopens and is answered
            assert sender.beat(pb.HeartbeatRequest(node_id=node), 5).lease_seconds == 30
            time.sleep(0.4)
        sender.reset()
    finally:
        svc.stop()


def test_a_node_holds_two_streams_at_most(coordinator: CoordinatorService) -> None:
    stub = _stub(coordinator)
    node = _join(stub, "h3")
    senders = [_sender(stub) for _ in range(3)]
    for s in senders:
        s.beat(pb.HeartbeatRequest(node_id=node), 5)
    # the third stream of the node ended the first at once, though it waited idle for its next heartbeat
    _wait(lambda: coordinator.heartbeats.open == 2, f"{coordinator.heartbeats.open} streams open, not 2")
    for s in senders[1:]:
        s.beat(pb.HeartbeatRequest(node_id=node), 5)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        senders[0].beat(pb.HeartbeatRequest(node_id=node), 5)
    assert info.value.code() == grpc.StatusCode.ABORTED and "replaced" in info.value.details()
    assert time.monotonic() - t0 < 2  # the answer was there already, not the beat's deadline
    senders[0].beat(pb.HeartbeatRequest(node_id=node), 5)  # the failure reset its stream: the next beat opens one
    for s in senders:
        s.reset()


def test_past_the_limit_a_beat_goes_unary() -> None:
    svc = _service(max_heartbeat_streams=1)
    try:
        stub = _stub(svc)
        a, b = _join(stub, "h4"), _join(stub, "h5")
        first, second = _sender(stub), _sender(stub)
        first.beat(pb.HeartbeatRequest(node_id=a), 5)
        before = svc.store.get_member(b).last_heartbeat_unix
        time.sleep(0.01)
        assert second.beat(pb.HeartbeatRequest(node_id=b), 5).lease_seconds == 30  # refused a stream: unary
        assert svc.store.get_member(b).last_heartbeat_unix > before
        assert second.streaming  # only that beat: the next one tries a stream again
        first.reset()
        second.reset()
    finally:
        svc.stop()


class _UnaryOnly(pb_grpc.CoordinatorServicer):
    """A coordinator of an older version: unary heartbeats only."""

    def __init__(self) -> None:
        self.beats = 0

    def Heartbeat(self, request, context):
        self.beats += 1
        return pb.HeartbeatReply(lease_seconds=7)


def test_a_coordinator_without_streams_gets_unary_heartbeats() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    old = _UnaryOnly()
    pb_grpc.add_CoordinatorServicer_to_server(old, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        stub = _stub_at(f"127.0.0.1:{port}")
        sender = _sender(stub)
        for _ in range(3):
            assert sender.beat(pb.HeartbeatRequest(node_id="n"), 5).lease_seconds == 7
        assert not sender.streaming and old.beats == 3
    finally:
        server.stop(0)


def _stub_at(address: str) -> pb_grpc.CoordinatorStub:
    return pb_grpc.CoordinatorStub(make_channel(address, RpcOptions(), token=TOKEN))


class _Silent(pb_grpc.CoordinatorServicer):
    """A coordinator that takes heartbeats on a stream and never answers them."""

    def HeartbeatStream(self, request_iterator, context):
        for _ in request_iterator:
            pass
        return iter(())


def test_a_beat_with_no_reply_times_out_and_closes_its_stream() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_CoordinatorServicer_to_server(_Silent(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        sender = _sender(_stub_at(f"127.0.0.1:{port}"))
        t0 = time.monotonic()
        with pytest.raises(HeartbeatTimeout) as info:
            sender.beat(pb.HeartbeatRequest(node_id="n"), 0.5)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0.4 < time.monotonic() - t0 < 3
        assert sender._stream is None  # the next beat opens a fresh stream
    finally:
        server.stop(0)


def test_a_stopping_coordinator_ends_its_heartbeat_streams_at_once() -> None:
    svc = _service()
    stub = _stub(svc)
    node = _join(stub, "h6")
    sender = _sender(stub)
    sender.beat(pb.HeartbeatRequest(node_id=node), 5)
    t0 = time.monotonic()
    svc.stop()
    # the stream waited for the next heartbeat; the stop did not spend its grace period (2 s) on it
    assert time.monotonic() - t0 < 1.5
    with pytest.raises(grpc.RpcError) as info:
        sender.beat(pb.HeartbeatRequest(node_id=node), 2)
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def test_a_process_first_heard_on_its_heartbeat_stream_is_known_by_the_streams_host(
        coordinator: CoordinatorService) -> None:
    """A node process the coordinator first hears of by its heartbeat stream (the coordinator restarted since its
    join) is recorded with the host the stream came from, which a copy of a `--no-listen` node is told apart by."""
    stub = _stub(coordinator)
    node = _join(stub, "h-stream")  # (a join without a session records none: as if before a restart)
    assert coordinator.state.process_of(node) is None
    sender = _sender(stub)
    try:
        sender.beat(pb.HeartbeatRequest(node_id=node, session="s-1"), 5)
        assert sender.streaming
        heard = coordinator.state.process_of(node)
        assert heard is not None and heard.session == "s-1" and heard.seen_from == "127.0.0.1"
    finally:
        sender.reset()
