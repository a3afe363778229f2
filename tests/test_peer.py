"""The Peer server and link probes over real gRPC on loopback."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import grpc
import pytest

from atoll.node.peer import PeerLimits, PeerServer, ProbeError, probe_peer
from atoll.rpc import make_channel
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc

T = timedelta(seconds=10)


@pytest.fixture
def server():
    s = PeerServer(node_id="n-peer", listen="127.0.0.1:0", token="tok")
    yield s
    s.stop()


def test_probe_measures_bandwidth_rtt_and_answers_with_node_id(server: PeerServer) -> None:
    assert server.port > 0 and server.address == f"127.0.0.1:{server.port}"
    r = probe_peer(server.address, nbytes=3 * 1024 * 1024 + 7, token="tok", timeout=T)
    assert r.bytes == 3 * 1024 * 1024 + 7
    assert r.node_id == "n-peer"
    assert 0 < r.rtt_seconds < 1.0
    assert r.bandwidth_bytes_per_s > 10e6  # loopback moves far more than 10 MB/s
    m = r.measurement(src="n-me")
    assert (m.src, m.dst, m.probe_bytes) == ("n-me", "n-peer", r.bytes)


def test_empty_probe_gives_rtt_only(server: PeerServer) -> None:
    r = probe_peer(server.address, nbytes=0, token="tok", timeout=T)
    assert r.bytes == 0 and r.bandwidth_bytes_per_s == 0.0 and r.rtt_seconds > 0


def test_wrong_token_is_unauthenticated(server: PeerServer) -> None:
    with pytest.raises(ProbeError, match="UNAUTHENTICATED.*token"):
        probe_peer(server.address, nbytes=10, token="nope", timeout=T)
    with pytest.raises(ProbeError, match="UNAUTHENTICATED"):
        probe_peer(server.address, nbytes=10, token=None, timeout=T)


def test_server_without_token_accepts_anyone() -> None:
    with PeerServer(node_id="open", listen="127.0.0.1:0", token=None) as s:
        assert probe_peer(s.address, nbytes=100, token=None, timeout=T).bytes == 100


def test_oversized_probe_is_cut_off_and_server_stays_up() -> None:
    with PeerServer(node_id="small", listen="127.0.0.1:0", token=None,
                    limits=PeerLimits(max_probe_bytes=1024 * 1024)) as s:
        with pytest.raises(ProbeError, match="RESOURCE_EXHAUSTED.*1048576 bytes"):
            probe_peer(s.address, nbytes=4 * 1024 * 1024, token=None, timeout=T)
        assert probe_peer(s.address, nbytes=1024, token=None, timeout=T).bytes == 1024


def test_call_without_deadline_is_refused(server: PeerServer) -> None:
    raw = grpc.insecure_channel(server.address)
    try:
        stub = pb_grpc.PeerStub(raw)
        with pytest.raises(grpc.RpcError) as e:
            stub.Probe(iter([pb.ProbeChunk(sender="x")]), metadata=(("authorization", "Bearer tok"),))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "deadline" in e.value.details()
    finally:
        raw.close()


def test_transfer_before_a_stage_attaches_is_unavailable(server: PeerServer) -> None:
    ch = make_channel(server.address, token="tok")
    try:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.PeerStub(ch).Transfer(iter([pb.TensorChunk(meta=pb.TensorMeta(step=1))]), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no stage" in e.value.details()
    finally:
        ch.close()


def test_unreachable_peer_fails_within_timeout() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ProbeError, match="did not accept a connection"):
        probe_peer(f"127.0.0.1:{port}", nbytes=10, token=None, timeout=timedelta(seconds=1))


def test_stop_releases_port_and_threads() -> None:
    before = threading.active_count()
    s = PeerServer(node_id="n", listen="127.0.0.1:0", token=None)
    probe_peer(s.address, nbytes=1000, token=None, timeout=T)
    port = s.port
    s.stop()
    s.stop()  # idempotent
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    assert threading.active_count() <= before + 2  # gRPC keeps at most its own pollers


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_concurrent_calls"):
        PeerLimits(max_concurrent_calls=1)
    with pytest.raises(ValueError, match="node_id"):
        PeerServer(node_id="", listen="127.0.0.1:0", token=None)
