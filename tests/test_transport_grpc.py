"""The gRPC peer transport between two stage replicas in one process, over loopback."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import ExitStack
from datetime import timedelta

import grpc
import pytest
import torch

from atoll.compression import CodecSpec, tensor_to_chunks
from atoll.node.grpc_transport import GrpcTransport, GrpcTransportConfig, PeerRef
from atoll.node.peer import PeerServer
from atoll.node.transport import TensorKey, TransportError
from atoll.rpc import make_channel
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc

SHAPE = (2, 16, 32)
T = timedelta(seconds=10)
IDENTITY = CodecSpec("identity")
FAST = dict(retry_initial=timedelta(milliseconds=20), retry_max=timedelta(milliseconds=200))


def _cfg(stage: int, peers: dict[int, PeerRef], **kw) -> GrpcTransportConfig:
    base = dict(job_id="job", node_id=f"n{stage}", plan_epoch=1, stage=stage, upstream=peers.get(stage - 1),
                downstream=peers.get(stage + 1), token="tok", shape=SHAPE, micro_batches=4,
                forward_codec=IDENTITY, backward_codec=IDENTITY, **FAST)
    base.update(kw)
    return GrpcTransportConfig(**base)


@pytest.fixture
def pair():
    """Two stages (0 -> 1), each with its own Peer server and transport."""
    with ExitStack() as stack:
        servers = [stack.enter_context(PeerServer(node_id=f"n{i}", listen="127.0.0.1:0", token="tok"))
                   for i in range(2)]
        peers = {i: PeerRef(node_id=f"n{i}", address=s.address) for i, s in enumerate(servers)}

        def make(**kw):
            ts = [GrpcTransport(_cfg(i, peers, **kw), servers[i]) for i in range(2)]
            for t in ts:
                stack.callback(t.close)
            return ts

        yield make, servers, peers


def test_activations_downstream_gradients_upstream(pair) -> None:
    make, _, _ = pair
    t0, t1 = make()
    acts = [torch.randn(SHAPE) for _ in range(4)]
    for mb, a in enumerate(acts):  # several micro-batches in flight at once
        t0.send(TensorKey(0, mb, "forward"), a)
    for mb in reversed(range(4)):  # taken in any order
        assert torch.equal(t1.recv(TensorKey(0, mb, "forward"), T), acts[mb])
    g = torch.randn(SHAPE)
    t1.send(TensorKey(0, 3, "backward"), g)
    assert torch.equal(t0.recv(TensorKey(0, 3, "backward"), T), g)
    t0.flush(T)
    t1.flush(T)
    (s0,), (s1,) = t0.link_stats(), t1.link_stats()
    raw = 2 * 16 * 32 * 4
    assert (s0.peer, s0.direction, s0.bytes_raw, s0.bytes_wire, s0.codec) == ("n1", "forward", 4 * raw, 4 * raw,
                                                                             "identity")
    assert (s1.peer, s1.direction, s1.bytes_raw) == ("n0", "backward", raw)
    assert s0.seconds > 0
    assert t0.link_stats()[0].bytes_raw == 0  # drained per call


def test_int8_link_carries_a_quarter_of_the_bytes(pair) -> None:
    make, _, _ = pair
    t0, t1 = make(forward_codec=CodecSpec("int8"))
    a = torch.randn(SHAPE)
    t0.send(TensorKey(2, 0, "forward"), a)
    got = t1.recv(TensorKey(2, 0, "forward"), T)
    assert (got - a).abs().max() < 0.05 * a.abs().max()
    t0.flush(T)
    s = t0.link_stats()[0]
    assert s.codec == "int8" and s.bytes_wire < s.bytes_raw / 3


def test_policy_picks_the_codec_and_learns_the_bandwidth(pair) -> None:
    make, _, _ = pair
    big = (64, 64, 64)  # 1 MiB, above the policy's smallest measured transfer
    t0, t1 = make(shape=big, initial_bandwidth_bytes_per_s=1e3, overlap=timedelta(milliseconds=50),
                  forward_codec=None)
    t0.send(TensorKey(0, 0, "forward"), torch.randn(big))
    t1.recv(TensorKey(0, 0, "forward"), T)
    t0.flush(T)
    s = t0.link_stats()[0]
    assert s.codec != "identity"  # at 1 kB/s nothing but compression can come close
    assert s.bandwidth_bytes_per_s > 1e6  # one loopback transfer moved the estimate


def test_send_blocks_when_in_flight_bytes_are_full(pair) -> None:
    make, servers, _ = pair
    raw = 2 * 16 * 32 * 4
    t0, t1 = make(max_in_flight_bytes=2 * raw, send_timeout=timedelta(seconds=1))
    servers[1].detach()  # the receiver is not ready: every Transfer is answered UNAVAILABLE and retried
    t0.send(TensorKey(0, 0, "forward"), torch.randn(SHAPE))
    t0.send(TensorKey(0, 1, "forward"), torch.randn(SHAPE))
    start = time.monotonic()
    with pytest.raises(TransportError, match="stayed full"):
        t0.send(TensorKey(0, 2, "forward"), torch.randn(SHAPE))
    assert 0.9 < time.monotonic() - start < 3


def test_receiver_that_starts_late_gets_the_tensor(pair) -> None:
    make, servers, _ = pair
    t0, t1 = make()
    servers[1].detach()
    a = torch.randn(SHAPE)
    t0.send(TensorKey(0, 0, "forward"), a)
    time.sleep(0.3)  # a few retries fail while nobody takes tensors
    servers[1].attach(t1.mailbox)
    assert torch.equal(t1.recv(TensorKey(0, 0, "forward"), T), a)
    t0.flush(T)


def test_peer_that_comes_up_late_is_reached_by_reconnecting() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    peers = {0: PeerRef(node_id="n0", address="127.0.0.1:1"), 1: PeerRef(node_id="n1", address=f"127.0.0.1:{port}")}
    with PeerServer(node_id="n0", listen="127.0.0.1:0", token="tok") as s0:
        t0 = GrpcTransport(_cfg(0, peers), s0)
        try:
            a = torch.randn(SHAPE)
            t0.send(TensorKey(0, 0, "forward"), a)
            time.sleep(0.5)
            with PeerServer(node_id="n1", listen=f"127.0.0.1:{port}", token="tok") as s1:
                t1 = GrpcTransport(_cfg(1, peers), s1)
                assert torch.equal(t1.recv(TensorKey(0, 0, "forward"), T), a)
                t0.flush(T)
                t1.close()
        finally:
            t0.close()


def test_vanished_peer_fails_the_send_after_its_timeout(pair) -> None:
    make, servers, _ = pair
    t0, _ = make(delivery_timeout=timedelta(milliseconds=800))
    servers[1].stop()
    t0.send(TensorKey(0, 0, "forward"), torch.randn(SHAPE))
    with pytest.raises(TransportError, match=r"could not deliver to n1 .* attempts"):
        t0.flush(T)
    with pytest.raises(TransportError, match="could not deliver"):
        t0.send(TensorKey(0, 1, "forward"), torch.randn(SHAPE))


def test_refusal_is_final_and_names_the_reason(pair) -> None:
    make, servers, peers = pair
    t0 = GrpcTransport(_cfg(0, peers, shape=(3, 3)), servers[0])  # disagrees with stage 1 about the shape
    _, t1 = make()
    try:
        t0.send(TensorKey(0, 0, "forward"), torch.randn(3, 3))
        with pytest.raises(TransportError, match=r"refused the tensor: INVALID_ARGUMENT: .*shape \[3, 3\]"):
            t0.flush(T)
    finally:
        t0.close()


def test_codec_outside_the_accepted_set_is_refused(pair) -> None:
    make, servers, peers = pair
    t0, t1 = make(accept_codecs=frozenset({"identity"}))
    code, details = _status(servers[1].address, _chunks(codec="int8"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "codec int8, not accepted on this link (identity)" in details
    with pytest.raises(ValueError, match="unknown codec 'zip'"):
        _cfg(1, peers, accept_codecs=frozenset({"zip"}))


def test_recv_times_out_with_a_clear_error(pair) -> None:
    make, _, _ = pair
    _, t1 = make()
    with pytest.raises(TransportError, match=r"from n0: no tensor for step 0 micro-batch 1"):
        t1.recv(TensorKey(0, 1, "forward"), timedelta(milliseconds=100))
    with pytest.raises(TransportError, match="no downstream peer"):
        t1.send(TensorKey(0, 0, "forward"), torch.randn(SHAPE))


def test_close_leaves_no_threads_and_wakes_waiters(pair) -> None:
    make, _, _ = pair
    before = {t.name for t in threading.enumerate()}
    t0, t1 = make()
    assert any(n.startswith("atoll-send") for n in {t.name for t in threading.enumerate()} - before)
    errors = []
    th = threading.Thread(target=lambda: _catch(errors, lambda: t1.recv(TensorKey(0, 0, "forward"), T)))
    th.start()
    time.sleep(0.1)
    t0.close()
    t1.close()
    t1.close()
    th.join(2)
    assert errors and "closed" in str(errors[0])
    left = {t.name for t in threading.enumerate()} - before
    assert not [n for n in left if n.startswith("atoll-send")]


def _catch(errors: list, fn) -> None:
    try:
        fn()
    except TransportError as e:
        errors.append(e)


# --- a misbehaving peer, talking to the server directly ------------------------------------------------

def _raw_transfer(address: str, chunks, token: str = "tok"):
    ch = make_channel(address, token=token)
    try:
        return pb_grpc.PeerStub(ch).Transfer(iter(chunks), timeout=5)
    finally:
        ch.close()


def _chunks(t: torch.Tensor | None = None, codec: str = "identity", **meta) -> list[pb.TensorChunk]:
    base = dict(job_id="job", plan_epoch=1, step=0, micro_batch=0, direction="forward", name="act", sender="n0",
                pipeline=0, stage=0)
    base.update(meta)
    return list(tensor_to_chunks(torch.randn(SHAPE) if t is None else t, CodecSpec(codec), base, 1024))


def _status(address: str, chunks) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        _raw_transfer(address, chunks)
    return e.value.code(), e.value.details()


def test_bad_messages_get_a_clear_status_and_the_node_stays_up(pair) -> None:
    make, servers, _ = pair
    t0, t1 = make()
    addr = servers[1].address
    corrupt = _chunks()
    corrupt[3].data = b"\x00" * len(corrupt[3].data)
    cases = [
        (_chunks(torch.randn(2, 16, 16)), grpc.StatusCode.INVALID_ARGUMENT, "shape [2, 16, 16]"),
        (corrupt, grpc.StatusCode.INVALID_ARGUMENT, "checksum mismatch"),
        (_chunks(plan_epoch=0), grpc.StatusCode.FAILED_PRECONDITION, "plan epoch 0, which is over"),
        (_chunks(torch.randn(SHAPE).half()), grpc.StatusCode.INVALID_ARGUMENT, "dtype torch.float16"),
        (_chunks(micro_batch=9), grpc.StatusCode.INVALID_ARGUMENT, "micro-batch 9 is out of range"),
        (_chunks(sender="mallory"), grpc.StatusCode.FAILED_PRECONDITION, "come from n0"),
    ]
    for chunks, code, words in cases:
        got, details = _status(addr, chunks)
        assert got == code and words in details, (got, details)
    assert _status(addr, [pb.TensorChunk(data=b"x")])[0] == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        _raw_transfer(addr, _chunks(), token="wrong")
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert t1.mailbox.buffered_bytes == 0
    a = torch.randn(SHAPE)  # the node still works
    t0.send(TensorKey(0, 0, "forward"), a)
    assert torch.equal(t1.recv(TensorKey(0, 0, "forward"), T), a)


def test_oversized_tensor_is_refused_from_its_meta(pair) -> None:
    make, servers, _ = pair
    _, t1 = make(shape=None, max_tensor_bytes=1 << 20, max_buffered_bytes=4 << 20)
    head = _chunks(torch.zeros(1024, 1024))[0]  # 4 MiB decoded; only the meta chunk is sent
    code, details = _status(servers[1].address, [head])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "too large: 4194304 bytes" in details
    assert t1.mailbox.buffered_bytes == 0


def test_peer_vanishing_mid_stream_releases_its_room(pair) -> None:
    make, servers, _ = pair
    t0, t1 = make()
    chunks = _chunks()
    stop = threading.Event()

    def half_then_hang():
        yield from chunks[:3]
        stop.wait(5)  # the sender stalls mid-tensor, then its call is cancelled

    ch = make_channel(servers[1].address, token="tok")
    fut = pb_grpc.PeerStub(ch).Transfer.future(half_then_hang(), timeout=5)
    deadline = time.monotonic() + 5
    while t1.mailbox.buffered_bytes == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t1.mailbox.buffered_bytes > 0  # the tensor's room is reserved while it streams
    fut.cancel()
    stop.set()
    ch.close()
    deadline = time.monotonic() + 5
    while t1.mailbox.buffered_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t1.mailbox.buffered_bytes == 0 and t1.mailbox.pending() == []
    a = torch.randn(SHAPE)
    t0.send(TensorKey(0, 0, "forward"), a)
    assert torch.equal(t1.recv(TensorKey(0, 0, "forward"), T), a)


def test_config_is_validated() -> None:
    p = PeerRef(node_id="x", address="127.0.0.1:1")
    with pytest.raises(ValueError, match="only stage 0 has no upstream"):
        GrpcTransportConfig(job_id="j", node_id="n", plan_epoch=0, stage=1, upstream=None, downstream=p, shape=None,
                            overlap=timedelta(0))
    with pytest.raises(ValueError, match="chunk_bytes"):
        GrpcTransportConfig(job_id="j", node_id="n", plan_epoch=0, stage=0, upstream=None, downstream=p, shape=None,
                            overlap=timedelta(0), chunk_bytes=64 << 20)
    with pytest.raises(ValueError, match="needs `overlap`"):
        GrpcTransportConfig(job_id="j", node_id="n", plan_epoch=0, stage=0, upstream=None, downstream=p, shape=None)
    with pytest.raises(ValueError, match="HOST:PORT"):
        PeerRef(node_id="x", address="nowhere")
