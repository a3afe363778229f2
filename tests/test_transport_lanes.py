"""Lanes in the gRPC pipeline transport: a neighbour stage whose replicas take micro-batch i by lane i % L."""

from __future__ import annotations

from contextlib import ExitStack
from datetime import timedelta

import grpc
import pytest
import torch

from atoll.compression import CodecSpec, tensor_to_chunks
from atoll.node.grpc_transport import GrpcTransport, GrpcTransportConfig, Lanes, PeerRef, RowPeer
from atoll.node.mailbox import Mailbox, ReceiveSpec, UnexpectedTransfer
from atoll.node.peer import PeerServer
from atoll.node.transport import TensorKey
from atoll.rpc import make_channel
from atoll.v1 import atoll_pb2_grpc as pb_grpc

ROWS = 4
SHAPE = (ROWS, 8, 16)
T = timedelta(seconds=10)
IDENTITY = CodecSpec("identity")
FAST = dict(retry_initial=timedelta(milliseconds=20), retry_max=timedelta(milliseconds=200))


def _cfg(node: str, stage: int, **kw) -> GrpcTransportConfig:
    base = dict(job_id="job", node_id=node, plan_epoch=1, stage=stage, upstream=None, downstream=None, token="tok",
                shape=SHAPE, micro_batches=4, forward_codec=IDENTITY, backward_codec=IDENTITY, **FAST)
    base.update(kw)
    return GrpcTransportConfig(**base)


def _servers(stack: ExitStack, names: list[str], unlisted: frozenset[str] = frozenset()) -> dict[str, PeerServer]:
    return {n: stack.enter_context(PeerServer(node_id=n, listen=None if n in unlisted else "127.0.0.1:0",
                                              token="tok")) for n in names}


def _refs(servers: dict[str, PeerServer]) -> dict[str, PeerRef]:
    return {n: PeerRef(node_id=n, address=s.address) if s.address else PeerRef(node_id=n, address="", route="reverse")
            for n, s in servers.items()}


def _start(stack: ExitStack, servers: dict[str, PeerServer], cfgs: dict[str, GrpcTransportConfig]
           ) -> dict[str, GrpcTransport]:
    ts = {n: GrpcTransport(c, servers[n]) for n, c in cfgs.items()}
    for t in ts.values():
        stack.callback(t.close)
    return ts


def _exchange(ts: dict[str, GrpcTransport], lanes: list[dict[str, tuple[int, int]]]) -> None:
    """n0 sends micro-batches 0..3 into the lanes (node -> its rows), each lane's replicas get their rows and
    send gradients back, and n0 assembles them scaled to its own mean."""
    acts = [torch.randn(SHAPE) for _ in range(4)]
    for mb, a in enumerate(acts):
        ts["n0"].send(TensorKey(0, mb, "forward"), a)
    grads = {}
    for mb, a in enumerate(acts):
        for node, (lo, hi) in lanes[mb % len(lanes)].items():
            assert torch.equal(ts[node].recv(TensorKey(0, mb, "forward"), T), a[lo:hi])
            grads[mb, node] = torch.randn(hi - lo, *SHAPE[1:])
            ts[node].send(TensorKey(0, mb, "backward"), grads[mb, node])
    for mb in reversed(range(4)):
        want = torch.empty(SHAPE)
        for node, (lo, hi) in lanes[mb % len(lanes)].items():
            want[lo:hi] = grads[mb, node] * ((hi - lo) / ROWS)  # each replica's gradient of its own mean
        assert torch.allclose(ts["n0"].recv(TensorKey(0, mb, "backward"), T), want)
    for t in ts.values():
        t.flush(T)
    for t in ts.values():
        assert t.mailbox.pending() == [] and t.mailbox.buffered_bytes == 0


@pytest.mark.timeout(60)
def test_micro_batches_alternate_between_two_lanes_of_one_replica_each() -> None:
    with ExitStack() as stack:
        servers = _servers(stack, ["n0", "a", "b"])
        ref = _refs(servers)
        ts = _start(stack, servers, {
            "n0": _cfg("n0", 0, downstream=Lanes((ref["a"], ref["b"]))),
            "a": _cfg("a", 1, upstream=ref["n0"]),
            "b": _cfg("b", 1, upstream=ref["n0"]),
        })
        _exchange(ts, [{"a": (0, ROWS)}, {"b": (0, ROWS)}])
        stats = {(s.peer, s.direction): s.bytes_raw for s in ts["n0"].link_stats()}
        raw = ROWS * 8 * 16 * 4
        assert stats == {("a", "forward"): 2 * raw, ("b", "forward"): 2 * raw}  # one link per lane's replica


@pytest.mark.timeout(60)
def test_a_lane_of_two_replicas_splits_the_rows_and_its_gradients_are_scaled() -> None:
    with ExitStack() as stack:
        servers = _servers(stack, ["n0", "a", "b0", "b1"])
        ref = _refs(servers)
        lane1 = (RowPeer(peer=ref["b0"], rows=(0, 2)), RowPeer(peer=ref["b1"], rows=(2, 4)))
        up = (RowPeer(peer=ref["n0"], rows=(0, ROWS)),)
        ts = _start(stack, servers, {
            "n0": _cfg("n0", 0, downstream=Lanes((ref["a"], lane1)), rows=(0, ROWS)),
            "a": _cfg("a", 1, upstream=ref["n0"]),
            "b0": _cfg("b0", 1, upstream=up, rows=(0, 2), shape=(2, *SHAPE[1:])),
            "b1": _cfg("b1", 1, upstream=up, rows=(2, 4), shape=(2, *SHAPE[1:]), replica=1),
        })
        spec = ts["n0"].mailbox.spec
        assert spec.senders("backward") == ("a", "b0", "b1")
        assert spec.sender_rows == (("b0", 2), ("b1", 2))
        assert spec.sender_lanes == (("a", 0, 2), ("b0", 1, 2), ("b1", 1, 2))
        _exchange(ts, [{"a": (0, ROWS)}, {"b0": (0, 2), "b1": (2, 4)}])


@pytest.mark.timeout(60)
def test_a_node_that_accepts_no_connections_dials_every_lanes_replicas() -> None:
    with ExitStack() as stack:
        servers = _servers(stack, ["n0", "a", "b"], unlisted=frozenset({"n0"}))
        ref = _refs(servers)
        ts = _start(stack, servers, {
            "n0": _cfg("n0", 0, downstream=Lanes((ref["a"], ref["b"])), accepts_connections=False),
            "a": _cfg("a", 1, upstream=ref["n0"]),
            "b": _cfg("b", 1, upstream=ref["n0"]),
        })
        dialer = ts["n0"].dialer
        assert dialer is not None and set(dialer.targets) == {"a", "b"} and dialer.wait_connected(10)
        _exchange(ts, [{"a": (0, ROWS)}, {"b": (0, ROWS)}])


def test_a_lane_sender_is_refused_another_lanes_micro_batch_over_grpc() -> None:
    with ExitStack() as stack:
        servers = _servers(stack, ["n0", "a", "b"])
        ref = _refs(servers)
        ts = _start(stack, servers, {"n0": _cfg("n0", 0, downstream=Lanes((ref["a"], ref["b"])))})
        meta = dict(job_id="job", plan_epoch=1, step=0, micro_batch=1, direction="backward", name="grad",
                    sender="a", pipeline=0, stage=1)
        ch = make_channel(servers["n0"].address, token="tok")
        try:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.PeerStub(ch).Transfer(iter(tensor_to_chunks(torch.randn(SHAPE), IDENTITY, meta, 4096)),
                                              timeout=5)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "a is in lane 0 of 2" in e.value.details() and "micro-batch 1 is lane 1's" in e.value.details()
            g = torch.randn(SHAPE)  # its own lane's micro-batch is taken
            pb_grpc.PeerStub(ch).Transfer(iter(tensor_to_chunks(g, IDENTITY, {**meta, "micro_batch": 2}, 4096)),
                                          timeout=5)
        finally:
            ch.close()
        assert torch.equal(ts["n0"].recv(TensorKey(0, 2, "backward"), T), g)


def _spec(**kw) -> ReceiveSpec:
    base = dict(job_id="job", plan_epoch=1, pipeline=0, stage=1, upstream=("a", "b"), downstream=None, shape=SHAPE,
                micro_batches=4, sender_lanes=(("a", 0, 2), ("b", 1, 2)), max_tensor_bytes=64 * 1024,
                max_buffered_bytes=256 * 1024)
    base.update(kw)
    return ReceiveSpec(**base)


def test_mailbox_refuses_a_micro_batch_of_another_lane() -> None:
    box = Mailbox(_spec())
    meta = dict(job_id="job", plan_epoch=1, step=0, direction="forward", name="act", pipeline=0, stage=0)

    def send(sender: str, mb: int) -> None:
        chunks = tensor_to_chunks(torch.randn(SHAPE), IDENTITY, {**meta, "sender": sender, "micro_batch": mb}, 4096)
        box.receive(iter(chunks), peer="ipv4:127.0.0.1:1", deadline_seconds=2.0)

    with pytest.raises(UnexpectedTransfer, match=r"from a: a is in lane 0 of 2.*micro-batch 1 is lane 1's"):
        send("a", 1)
    with pytest.raises(UnexpectedTransfer, match="b is in lane 1 of 2"):
        send("b", 2)
    send("a", 2)
    send("b", 3)
    assert box.pending() == [TensorKey(0, 2, "forward"), TensorKey(0, 3, "forward")]
    with pytest.raises(ValueError, match="sends no micro-batch 3"):
        box.take(TensorKey(0, 3, "forward"), 1.0, sender="a")
    assert box.take(TensorKey(0, 3, "forward"), 1.0, sender="b").shape == SHAPE


def test_lane_spec_is_validated() -> None:
    with pytest.raises(ValueError, match="names 'c', which is neither"):
        _spec(sender_lanes=(("a", 0, 2), ("c", 1, 2)))
    with pytest.raises(ValueError, match="names a sender twice"):
        _spec(sender_lanes=(("a", 0, 2), ("a", 1, 2)))
    with pytest.raises(ValueError, match=r"lane 2 of 2; a lane is in \[0, lanes\)"):
        _spec(sender_lanes=(("a", 0, 2), ("b", 2, 2)))
    with pytest.raises(ValueError, match="every lane to someone"):
        _spec(sender_lanes=(("a", 0, 2),))  # b has none
    with pytest.raises(ValueError, match="every lane to someone"):
        _spec(sender_lanes=(("a", 0, 3), ("b", 1, 3)))  # nobody sends lane 2
    with pytest.raises(ValueError, match="every lane to someone"):
        _spec(sender_lanes=(("a", 0, 2), ("b", 1, 3)))


def test_lanes_config_is_validated() -> None:
    p = {n: PeerRef(node_id=n, address="127.0.0.1:1") for n in ("u", "a", "b", "c")}
    with pytest.raises(ValueError, match="a node appears in two lanes"):
        Lanes((p["a"], (RowPeer(peer=p["b"], rows=(0, 2)), RowPeer(peer=p["a"], rows=(2, 4)))))
    with pytest.raises(ValueError, match="at least one lane"):
        Lanes(())
    with pytest.raises(ValueError, match="lane 1 must be a PeerRef or a non-empty tuple of RowPeer"):
        Lanes((p["a"], ()))
    with pytest.raises(ValueError, match="a neighbour appears twice"):  # on both sides
        _cfg("n", 1, upstream=p["a"], downstream=Lanes((p["b"], p["a"])))
    with pytest.raises(ValueError, match=r"downstream lane 1 neighbours' rows \[\(0, 2\)\] must .* cover"):
        _cfg("n", 0, rows=(0, ROWS), downstream=Lanes((p["a"], (RowPeer(peer=p["b"], rows=(0, 2)),))))
    with pytest.raises(ValueError, match="downstream lane 0 neighbours given as RowPeer need"):
        _cfg("n", 0, downstream=Lanes(((RowPeer(peer=p["b"], rows=(0, 4)),), p["a"])))
    cfg = _cfg("n", 1, upstream=p["u"], downstream=Lanes((p["a"], p["b"], p["c"])))
    with pytest.raises(ValueError, match="form 3 lanes; give the micro-batch"):
        cfg.routes("downstream")
    assert [r.peer.node_id for r in cfg.routes("downstream", 5)] == ["c"]
    assert [r.peer.node_id for r in cfg.routes("upstream", 5)] == ["u"]  # a plain side ignores the micro-batch
    assert [r.peer.node_id for r in cfg.all_routes("downstream")] == ["a", "b", "c"]
    one = _cfg("n", 0, downstream=Lanes((p["a"],)))  # one lane is a plain side
    assert [r.peer.node_id for r in one.routes("downstream")] == ["a"]
    assert one.receive_spec().sender_lanes == () and one.receive_spec().downstream == "a"
