"""Emulated wide-area latency: which peers get it (`wan_delay`) and the transport holding tensors for it."""

from __future__ import annotations

import subprocess
import time
from contextlib import ExitStack
from dataclasses import replace
from datetime import timedelta

import pytest
import torch

from atoll.compression import CodecSpec
from atoll.node.agent import AgentConfig
from atoll.node.grpc_transport import GrpcTransport, GrpcTransportConfig, PeerRef
from atoll.node.peer import PeerServer
from atoll.node.transport import TensorKey, TransportError
from atoll.node.wan import wan_delay
from atoll.plan import IslandInfo, Plan

SHAPE = (2, 8, 16)
LATENCY = timedelta(milliseconds=300)
T = timedelta(seconds=10)


def _plan() -> Plan:
    return Plan(model="m", global_batch=4, seq_len=8, islands=[
        IslandInfo(id="i0", group="lab-a", nodes=["a0", "a1"]), IslandInfo(id="i1", group="lab-b", nodes=["b0"]),
        IslandInfo(id="i2", group="", nodes=["x0"])])


def test_wan_delay_only_to_peers_of_another_known_region() -> None:
    plan, ms = _plan(), timedelta(milliseconds=50)
    assert wan_delay(plan, "a0", "b0", "lab-a", ms) == ms
    assert wan_delay(plan, "b0", "a1", "lab-b", ms) == ms
    assert wan_delay(plan, "a0", "a1", "lab-a", ms) == timedelta(0)
    assert wan_delay(plan, "a0", "b0", "", ms) == ms  # no --region: this node's region in the plan
    assert wan_delay(plan, "a0", "x0", "lab-a", ms) == timedelta(0)  # the peer's region is not known
    assert wan_delay(plan, "a0", "gone", "lab-a", ms) == timedelta(0)
    assert wan_delay(plan, "a0", "b0", "lab-a", timedelta(0)) == timedelta(0)


def test_negative_latencies_are_refused() -> None:
    with pytest.raises(ValueError, match="added_latency"):
        PeerRef(node_id="p", address="127.0.0.1:1", added_latency=timedelta(milliseconds=-1))
    with pytest.raises(ValueError, match="wan-latency-ms"):
        AgentConfig(coordinator="127.0.0.1:1", token="t", state_dir=".", wan_latency=timedelta(milliseconds=-5))


def test_node_flag_reaches_the_agent_config() -> None:
    from atoll.launch.cli import build_parser

    args = build_parser().parse_args(["node", "--coordinator", "h:1", "--wan-latency-ms", "40"])
    assert args.wan_latency_ms == 40.0
    assert build_parser().parse_args(["node", "--coordinator", "h:1"]).wan_latency_ms == 0.0


@pytest.fixture
def pair():
    """Stage 0 -> stage 1 over loopback; stage 0's link downstream carries LATENCY, the link back none."""
    with ExitStack() as stack:
        servers = [stack.enter_context(PeerServer(node_id=f"n{i}", listen="127.0.0.1:0", token="tok"))
                   for i in range(2)]
        peers = [PeerRef(node_id=f"n{i}", address=s.address) for i, s in enumerate(servers)]
        cfg = GrpcTransportConfig(job_id="job", node_id="n0", plan_epoch=1, stage=0, upstream=None,
                                  downstream=replace(peers[1], added_latency=LATENCY), token="tok", shape=SHAPE,
                                  forward_codec=CodecSpec("identity"), backward_codec=CodecSpec("identity"))
        ts = [GrpcTransport(cfg, servers[0]),
              GrpcTransport(replace(cfg, node_id="n1", stage=1, upstream=peers[0], downstream=None), servers[1])]
        for t in ts:
            stack.callback(t.close)
        yield ts


def test_tensors_arrive_no_sooner_than_the_added_latency(pair) -> None:
    t0, t1 = pair
    t0.send(TensorKey(0, 0, "forward"), torch.zeros(SHAPE))  # warm the channel: connecting is not latency
    t1.recv(TensorKey(0, 0, "forward"), T)
    acts = [torch.randn(SHAPE) for _ in range(4)]
    start = time.monotonic()
    for mb, a in enumerate(acts):  # queued together, held together: about one latency for all, not four
        t0.send(TensorKey(1, mb, "forward"), a)
    got = [t1.recv(TensorKey(1, mb, "forward"), T) for mb in range(4)]
    took = time.monotonic() - start
    assert all(torch.equal(g, a) for g, a in zip(got, acts, strict=True))
    # (four latencies one after another would take 4x: 3.5x leaves a loaded machine room and still tells them apart)
    assert LATENCY.total_seconds() <= took < 3.5 * LATENCY.total_seconds(), took

    start = time.monotonic()  # the other direction has no added latency
    t1.send(TensorKey(1, 0, "backward"), torch.ones(SHAPE))
    t0.recv(TensorKey(1, 0, "backward"), T)
    assert time.monotonic() - start < LATENCY.total_seconds()


def test_a_held_tensor_does_not_delay_closing(pair) -> None:
    t0, _ = pair
    t0.send(TensorKey(0, 0, "forward"), torch.zeros(SHAPE))
    start = time.monotonic()
    t0.close(timedelta(seconds=5))
    assert time.monotonic() - start < LATENCY.total_seconds()
    with pytest.raises(TransportError, match="closed"):
        t0.send(TensorKey(0, 1, "forward"), torch.zeros(SHAPE))


class _Host:
    """A stand-in testbed host: records what it is asked to start, runs nothing."""

    region, ip, wan_latency_ms = "lab-b", "10.9.0.7", 50.0

    def __init__(self) -> None:
        self.started: list[list[str]] = []

    def popen(self, argv, **kwargs):
        self.started.append(list(argv))
        return subprocess.Popen(["true"])

    def reach(self, address: str) -> str:
        return "127.0.0.1:1"


def test_local_cluster_starts_a_node_on_a_host_in_its_region_with_its_latency(tmp_path) -> None:
    from atoll.launch.localcluster import LocalCluster

    host = _Host()
    cluster = LocalCluster(job_path=tmp_path / "job.toml", out=tmp_path)
    cluster.address = "10.9.0.1:7070"
    cluster.start_node("n1", host=host)
    cluster.start_node("n2", host=host, region="elsewhere")
    cluster.stop()
    first, second = host.started
    flags = dict(zip(first[3:], first[4:]))
    assert flags["--listen"] == "10.9.0.7:0" and flags["--region"] == "lab-b" and flags["--wan-latency-ms"] == "50.0"
    assert dict(zip(second[3:], second[4:]))["--region"] == "elsewhere"
