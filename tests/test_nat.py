"""Nodes that accept no connections: reverse Connect streams, relays, and the plan's relay routes."""

from __future__ import annotations

from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
import torch
from pipeline_harness import tiny_job

from atoll.compression import CodecSpec
from atoll.node.grpc_transport import GrpcTransport, GrpcTransportConfig, PeerRef
from atoll.node.peer import PeerServer
from atoll.node.reverse import MAX_TUNNELLED_CALL_S, ReverseRegistry, TunnelError, _bad_timeout, relay_transfer
from atoll.node.transport import TensorKey
from atoll.v1 import atoll_pb2 as pb

SHAPE = (2, 8, 16)
T = timedelta(seconds=10)
IDENTITY = CodecSpec("identity")
ROOT = Path(__file__).resolve().parents[1]
FAST = dict(retry_initial=timedelta(milliseconds=20), retry_max=timedelta(milliseconds=200))


def _cfg(stage: int, n: int, peers: dict[int, PeerRef], **kw) -> GrpcTransportConfig:
    base = dict(job_id="job", node_id=f"n{stage}", plan_epoch=1, stage=stage, upstream=peers.get(stage - 1),
                downstream=peers.get(stage + 1) if stage + 1 < n else None, token="tok", shape=SHAPE,
                micro_batches=4, forward_codec=IDENTITY, backward_codec=IDENTITY, **FAST)
    base.update(kw)
    return GrpcTransportConfig(**base)


def _roundtrip(ts: list[GrpcTransport]) -> None:
    """Activations down the whole pipeline and gradients back up, compared exactly."""
    for mb in range(3):
        x = torch.randn(SHAPE)
        ts[0].send(TensorKey(0, mb, "forward"), x)
        for i in range(1, len(ts)):
            got = ts[i].recv(TensorKey(0, mb, "forward"), T)
            assert torch.equal(got, x)
            if i + 1 < len(ts):
                ts[i].send(TensorKey(0, mb, "forward"), got)
        g = torch.randn(SHAPE)
        ts[-1].send(TensorKey(0, mb, "backward"), g)
        for i in reversed(range(len(ts) - 1)):
            got = ts[i].recv(TensorKey(0, mb, "backward"), T)
            assert torch.equal(got, g)
            if i > 0:
                ts[i].send(TensorKey(0, mb, "backward"), got)
    for t in ts:
        t.flush(T)


def _dialled_back(stack: ExitStack) -> PeerServer:
    """n0 listens; n1 listens nowhere and opens its Connect stream to n0 (within `stack`): n0's server, whose
    `reverse` calls n1 over that stream."""
    a = stack.enter_context(PeerServer(node_id="n0", listen="127.0.0.1:0", token="tok"))
    b = stack.enter_context(PeerServer(node_id="n1", listen=None, token="tok"))
    peers = {0: PeerRef(node_id="n0", address=a.address), 1: PeerRef(node_id="n1", address="", route="reverse")}
    t1 = GrpcTransport(_cfg(1, 2, peers, accepts_connections=False), b)
    stack.callback(t1.close)
    assert t1.dialer is not None and t1.dialer.wait_connected(10)
    return a


@pytest.mark.timeout(60)
def test_unreachable_middle_stage_gets_both_directions_over_its_own_streams() -> None:
    """n1 listens nowhere: n0 and n2 send to it over the Connect streams n1 opened to them."""
    with ExitStack() as stack:
        servers = [stack.enter_context(PeerServer(node_id=f"n{i}", listen=None if i == 1 else "127.0.0.1:0",
                                                  token="tok")) for i in range(3)]
        assert not servers[1].listening and servers[1].address == ""
        peers = {0: PeerRef(node_id="n0", address=servers[0].address),
                 1: PeerRef(node_id="n1", address="", route="reverse"),
                 2: PeerRef(node_id="n2", address=servers[2].address)}
        ts = [GrpcTransport(_cfg(i, 3, peers, accepts_connections=i != 1), servers[i]) for i in range(3)]
        for t in ts:
            stack.callback(t.close)
        assert ts[1].dialer is not None and ts[1].dialer.wait_connected(10)
        _roundtrip(ts)
        (down,), (up,) = ts[0].link_stats(), ts[2].link_stats()
        assert down.bytes_raw == up.bytes_raw == 3 * 2 * 8 * 16 * 4


@pytest.mark.timeout(60)
def test_two_unreachable_neighbours_exchange_through_a_relay() -> None:
    """n0 and n1 both listen nowhere; r (not in the pipeline) relays every tensor between them."""
    with ExitStack() as stack:
        relay = stack.enter_context(PeerServer(node_id="r", listen="127.0.0.1:0", token="tok"))
        servers = [stack.enter_context(PeerServer(node_id=f"n{i}", listen=None, token="tok")) for i in range(2)]
        peers = {i: PeerRef(node_id=f"n{i}", address="", route="relay", relay=relay.address) for i in range(2)}
        ts = [GrpcTransport(_cfg(i, 2, peers, accepts_connections=False), servers[i]) for i in range(2)]
        for t in ts:
            stack.callback(t.close)
        assert all(t.dialer is not None and t.dialer.wait_connected(10) for t in ts)
        _roundtrip(ts)


@pytest.mark.timeout(60)
def test_refusals_cross_the_tunnel_with_their_status() -> None:
    """A tensor the unreachable receiver refuses (wrong shape) fails the sender's link with the receiver's reason."""
    with ExitStack() as stack:
        a = stack.enter_context(PeerServer(node_id="n0", listen="127.0.0.1:0", token="tok"))
        b = stack.enter_context(PeerServer(node_id="n1", listen=None, token="tok"))
        peers = {0: PeerRef(node_id="n0", address=a.address), 1: PeerRef(node_id="n1", address="", route="reverse")}
        t0 = GrpcTransport(_cfg(0, 2, peers), a)
        t1 = GrpcTransport(_cfg(1, 2, peers, accepts_connections=False, shape=(3, 8, 16)), b)
        stack.callback(t0.close)
        stack.callback(t1.close)
        assert t1.dialer is not None and t1.dialer.wait_connected(10)
        t0.send(TensorKey(0, 0, "forward"), torch.randn(SHAPE))
        with pytest.raises(Exception, match="shape"):
            t0.flush(T)


def test_a_call_to_a_node_without_a_stream_is_retryable() -> None:
    with pytest.raises(TunnelError) as e:
        ReverseRegistry().call("nobody", "Transfer", iter([b""]), 1.0)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "accepts no connections" in e.value.details()


@pytest.mark.timeout(60)
def test_a_tunnelled_call_must_carry_a_bounded_deadline() -> None:
    """A call over a Connect stream with a deadline past `MAX_TUNNELLED_CALL_S` (or not finite) is answered
    INVALID_ARGUMENT at once, and holds no thread of the dialing node."""
    with ExitStack() as stack:
        a = _dialled_back(stack)
        for seconds in (MAX_TUNNELLED_CALL_S + 1, 1e9):
            with pytest.raises(TunnelError) as e:
                a.reverse.call("n1", "Probe", iter([b""]), seconds)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "deadline" in e.value.details()
        # what a caller's own clock cannot wait for, a far end may still send
        assert all(_bad_timeout(x) for x in (float("inf"), float("nan"), -1.0))
        assert _bad_timeout(0.0) is None and _bad_timeout(MAX_TUNNELLED_CALL_S) is None


def test_a_relayed_reply_that_is_not_an_ack_is_a_status_not_a_crash() -> None:
    class Garbled:
        def call(self, to, method, messages, timeout):
            list(messages)
            return b"\xff\xff\xff"

    with pytest.raises(TunnelError) as e:
        relay_transfer(Garbled(), "n1", iter([]), 1.0)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "TransferAck" in e.value.details()


def test_relay_route_needs_the_relay_address() -> None:
    with pytest.raises(ValueError, match="relay"):
        PeerRef(node_id="x", address="", route="relay")
    with pytest.raises(ValueError, match="HOST:PORT"):
        PeerRef(node_id="x", address="")
    assert PeerRef(node_id="x", address="", route="reverse").route == "reverse"


def test_connect_frames_round_trip() -> None:
    f = pb.ConnectFrame(call=3, method="Transfer", message=b"x", timeout_seconds=2.5)
    assert pb.ConnectFrame.FromString(f.SerializeToString()) == f


@pytest.mark.timeout(60)
def test_the_norm_exchange_meets_at_the_store_when_a_member_accepts_no_connections() -> None:
    import threading

    import torch.distributed as dist

    from atoll.node.store_exchange import StoreNormExchange

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    clients = [dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
               for _ in range(3)]
    members = [StoreNormExchange(c, "job/e1/norm-0/", rank=i, size=3) for i, c in enumerate(clients)]
    sums: dict[int, list[float]] = {i: [] for i in range(3)}

    def run(i: int) -> None:
        for r in range(5):
            sums[i].append(members[i].all_sum(float(10 * r + i), timedelta(seconds=10)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(sums[i] == [30.0 * r + 3 for r in range(5)] for i in range(3)), sums
    assert not server.check(["job/e1/norm-0/0/0"]) and server.check(["job/e1/norm-0/4/2"])  # old rounds deleted
    from atoll.node.norm_exchange import NormExchangeError

    with pytest.raises(NormExchangeError, match=r"member\(s\) \[1, 2\]"):
        members[0].all_sum(1.0, timedelta(milliseconds=200))


# --- processes -----------------------------------------------------------------------------------------------


def _pinned_three_stage_job(tmp: Path, steps: int):
    """A job and a pinned plan of three one-node stages (first, middle, last: the nodes' names and ids); returns
    (job, job path, plan path, out folder)."""
    from atoll.plan import PipelinePlan, Plan, StagePlan

    job = tiny_job(steps, nodes=3)
    job_path, plan_path, out = tmp / "job.toml", tmp / "plan.json", tmp / "cluster"
    job_path.write_text(job.to_toml())
    plan = Plan(model="tiny", global_batch=16, seq_len=64, pipelines=[PipelinePlan(
        micro_batch=4, num_micro_batches=4, stages=[StagePlan(island="a", layers=(0, 2), nodes=["first"]),
                                                   StagePlan(island="b", layers=(2, 4), nodes=["middle"]),
                                                   StagePlan(island="c", layers=(4, 6), nodes=["last"])])])
    plan.validate(job.model.n_layers + 2)
    plan.save(plan_path)
    return job, job_path, plan_path, out


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_no_listen_node_serves_a_middle_stage(tmp_path: Path) -> None:
    """`atoll node --no-listen` runs the middle stage: both neighbours send to it over the Connect streams it
    opened, and the losses equal one process's."""
    from atoll.launch.localcluster import LocalCluster
    from atoll.node.local import train_local

    steps = 5
    job, job_path, plan_path, out = _pinned_three_stage_job(tmp_path, steps)
    expected, _ = train_local(job)
    with LocalCluster(job_path=job_path, out=out, profile_seconds=1.0) as cluster:
        cluster.start_coordinator(extra=["--plan", str(plan_path)])
        for name in ("first", "middle", "last"):
            cluster.start_node(name, node_id=name, extra=["--no-listen"] if name == "middle" else [])
        losses = cluster.wait_losses(steps, 200)
        status = cluster.status()
    assert status.plan.node_addresses["middle"] == "" and status.plan.node_addresses["first"]
    assert [m.profile.unreachable for m in sorted(status.members, key=lambda m: m.node_id)] == [False, False, True]
    log = (out / "middle.log").read_text()
    assert "accepts no connections" in log and "Connect stream to first" in log and "Connect stream to last" in log
    for s in range(steps):
        assert abs(losses[s] - expected[s]) <= 1e-4 * abs(expected[s]), (s, losses[s], expected[s])


_DIAL_ONE = """
import socket, sys
host, port = sys.argv[1].rsplit(":", 1)
try:
    socket.create_connection((host, int(port)), timeout=2).close()
    print("ok")
except OSError as e:
    print(type(e).__name__)
"""
_LISTEN = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(); print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept(); c.close()
"""


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_two_no_listen_neighbours_train_through_a_relay(tmp_path: Path) -> None:
    """The first two stages both run --no-listen: the plan names the last stage's node (which accepts
    connections and probed both) as their relay, every tensor between them goes through it, and the losses
    equal one process's."""
    from atoll.launch.localcluster import LocalCluster
    from atoll.node.local import train_local

    steps = 4
    job, job_path, plan_path, out = _pinned_three_stage_job(tmp_path, steps)
    expected, _ = train_local(job)
    with LocalCluster(job_path=job_path, out=out, profile_seconds=1.0) as cluster:
        cluster.start_coordinator(extra=["--plan", str(plan_path)])
        for name in ("first", "middle", "last"):
            cluster.start_node(name, node_id=name, extra=["--no-listen"] if name != "last" else [])
        losses = cluster.wait_losses(steps, 200)
        status = cluster.status()
    assert [(r.a, r.b, r.via) for r in status.plan.relays] == [("first", "middle", "last")]
    assert status.plan.relays[0].bandwidth_bytes_per_s > 0
    log = (out / "first.log").read_text()
    assert "Connect stream to relay" in log
    # middle's neighbour is also its relay: one stream carries both, so neither replaces the other at the relay
    assert "(replacing one)" not in (out / "last.log").read_text()
    for s in range(steps):
        assert abs(losses[s] - expected[s]) <= 1e-4 * abs(expected[s]), (s, losses[s], expected[s])


def outbound_only(namespace: str, device: str = "eth0") -> None:
    """Make a host of the testbed accept no connections while its own go out, as behind NAT or a stateful
    firewall: its interface never sends the SYN+ACK that accepts a connection (an htb class whose queue holds
    nothing takes them), so connections into it time out, while its own connections (it sends SYN, then ACKs)
    pass. Stateless and built from tc alone, as neither iptables nor nftables is needed."""
    import subprocess

    def tc(*argv: str) -> None:
        subprocess.run(["ip", "netns", "exec", namespace, "tc", *argv], check=True, capture_output=True, timeout=10)

    tc("qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "10", "r2q", "1000")
    tc("class", "add", "dev", device, "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit")
    tc("class", "add", "dev", device, "parent", "1:", "classid", "1:20", "htb", "rate", "1kbit")
    tc("qdisc", "add", "dev", device, "parent", "1:20", "handle", "20:", "pfifo", "limit", "0")
    # IPv4 without options: TCP's flags byte is at offset 20 + 13; SYN (0x02) and ACK (0x10) both set
    tc("filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
       "match", "ip", "protocol", "6", "0xff", "match", "u8", "0x12", "0x12", "at", "33", "flowid", "1:20")


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_node_in_an_outbound_only_namespace_serves_a_middle_stage(tmp_path: Path) -> None:
    """The middle stage runs on a testbed host whose firewall drops inbound connections. It is started like any
    node (no --no-listen): the coordinator cannot dial it back, tells it so, and it serves its stage over the
    streams it opens; the losses equal one process's."""
    import subprocess
    import sys

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # the bench tree is not installed
    from bench.geo import geo_testbed, geo_unavailable

    reason = geo_unavailable()
    if reason:
        pytest.skip(reason)
    from atoll.launch.localcluster import LocalCluster
    from atoll.node.local import train_local

    steps = 4
    job, job_path, plan_path, out = _pinned_three_stage_job(tmp_path, steps)
    expected, _ = train_local(job)
    with geo_testbed(regions={"lab": 3}, cpu_quota=None) as tb:
        first, middle, last = tb.hosts
        outbound_only(middle.namespace)
        server = first.popen([sys.executable, "-c", _LISTEN, first.ip], stdout=subprocess.PIPE, text=True)
        into_first = f"{first.ip}:{server.stdout.readline().strip()}"
        listener = middle.popen([sys.executable, "-c", _LISTEN, middle.ip], stdout=subprocess.PIPE, text=True)
        into_middle = f"{middle.ip}:{listener.stdout.readline().strip()}"
        dial = [sys.executable, "-c", _DIAL_ONE]
        assert first.run(dial + [into_middle]).strip() != "ok", "the filter should drop connections into the host"
        assert middle.run(dial + [into_first]).strip() == "ok", "connections out of the host should pass"
        with LocalCluster(job_path=job_path, out=out, profile_seconds=1.0) as cluster:
            cluster.start_coordinator(host=tb.coordinator, extra=["--plan", str(plan_path)])
            for name, host in zip(("first", "middle", "last"), tb.hosts):
                cluster.start_node(name, node_id=name, host=host)
            losses = cluster.wait_losses(steps, 240)
            status = cluster.status()
    assert status.plan.node_addresses["middle"] == "" and status.plan.node_addresses["last"]
    log = (out / "middle.log").read_text()
    assert "could not dial this node back" in log and "--advertise" in log
    for s in range(steps):
        assert abs(losses[s] - expected[s]) <= 1e-4 * abs(expected[s]), (s, losses[s], expected[s])


# --- the coordinator's side ----------------------------------------------------------------------------------


def _link(a: str, b: str, bw: float, rtt: float = 0.01):
    from atoll.types import LinkMeasurement

    return LinkMeasurement(src=a, dst=b, bandwidth_bytes_per_s=bw, rtt_seconds=rtt)


def test_a_pair_of_unreachable_nodes_gets_the_link_through_its_best_relay() -> None:
    from atoll.coordinator.reachability import relay_links

    # u1 and u2 accept no connections; r1's slower leg is 50 MB/s, r2's 80 MB/s: r2 relays
    links = [_link("u1", "r1", 100e6), _link("u2", "r1", 50e6), _link("u1", "r2", 80e6, 0.02),
             _link("r2", "u2", 90e6, 0.03), _link("r1", "r2", 1e9)]
    seen, routes = relay_links(links, ["u1", "u2", "r1", "r2"], {"u1", "u2"})
    assert routes == {frozenset(("u1", "u2")): ("r2", 80e6)}
    relayed = [x for x in seen if {x.src, x.dst} == {"u1", "u2"}]
    assert len(relayed) == 2 and all(x.bandwidth_bytes_per_s == 80e6 for x in relayed)
    assert all(abs(x.rtt_seconds - 0.05) < 1e-12 for x in relayed)  # the legs' round trips add up
    assert len(seen) == len(links) + 2
    _, none = relay_links([_link("u1", "r1", 1e9)], ["u1", "u2", "r1"], {"u1", "u2"})
    assert none == {}  # r1 never measured a leg to u2: no relay


def test_the_plan_names_a_relay_only_between_two_unreachable_neighbours() -> None:
    from atoll.coordinator.reachability import plan_relays
    from atoll.plan import PipelinePlan, Plan, StagePlan

    plan = Plan(model="tiny", global_batch=16, seq_len=64, pipelines=[PipelinePlan(
        micro_batch=4, num_micro_batches=4, stages=[StagePlan(island="a", layers=(0, 2), nodes=["u1"]),
                                                   StagePlan(island="b", layers=(2, 4), nodes=["u2"]),
                                                   StagePlan(island="c", layers=(4, 6), nodes=["r"])])])
    relays, missing = plan_relays(plan, {"u1", "u2"}, {frozenset(("u1", "u2")): ("r", 5e7)})
    assert [(x.a, x.b, x.via, x.bandwidth_bytes_per_s) for x in relays] == [("u1", "u2", "r", 5e7)] and not missing
    plan.relays = relays
    assert plan.relay_of("u2", "u1") == "r" and plan.relay_of("u2", "r") is None
    from atoll.serde import plan_from_proto, plan_to_proto

    assert plan_from_proto(plan_to_proto(plan)).relays == relays
    assert Plan.from_json(plan.to_json()).relays == relays
    _, missing = plan_relays(plan, {"u1", "u2"}, {})
    assert len(missing) == 1 and "start a node that accepts connections" in missing[0]


def test_probes_never_dial_a_node_that_accepts_no_connections() -> None:
    from atoll.coordinator import handlers as h
    from atoll.coordinator.state import CoordinatorState
    from atoll.coordinator.store import MemoryStore
    from atoll.job import JobSpec
    from atoll.v1 import atoll_pb2 as pb

    state = CoordinatorState(store=MemoryStore(), job=JobSpec.load(ROOT / "examples" / "tiny.toml"), token="t",
                             clock=lambda: 1000.0)
    profile = pb.NodeProfile(hostname="h", device_kind="cpu", device_name="x", device_count=1,
                             memory_total_bytes=1 << 30, cpu_count=1)
    ids = {}
    for name, address in (("r1", "127.0.0.1:1"), ("r2", "127.0.0.1:2"), ("u1", ""), ("u2", "")):
        ids[name] = h.handle_join(pb.JoinRequest(token="t", profile=profile, peer_address=address), state).node_id
    asked = {name: {t.node_id for t in h.handle_heartbeat(pb.HeartbeatRequest(node_id=i), state).probe}
             for name, i in ids.items()}
    unreachable = {ids["u1"], ids["u2"]}
    assert not (asked["r1"] | asked["r2"]) & unreachable  # nobody dials u1 or u2 ...
    assert asked["u1"] and asked["u1"] <= {ids["r1"], ids["r2"]}  # u1 probes the nodes it can dial
    assert ids["u2"] not in asked["u1"] and ids["u1"] not in asked["u2"]  # ... their own link is a relay's


def test_a_probe_crosses_a_connect_stream() -> None:
    with ExitStack() as stack:
        a = _dialled_back(stack)
        chunks = [pb.ProbeChunk(sender="n0").SerializeToString(), pb.ProbeChunk(payload=b"x" * 1000).SerializeToString()]
        reply = pb.ProbeReply.FromString(a.reverse.call("n1", "Probe", iter(chunks), 5.0))
        assert (reply.bytes, reply.node_id) == (1000, "n1")


def test_status_shows_who_dials_out_and_who_relays() -> None:
    from atoll.coordinator.status import format_status

    s = pb.StatusReply()
    s.members.add(node_id="u1", peer_address="", state="alive", profile=pb.NodeProfile(unreachable=True))
    s.members.add(node_id="r", peer_address="10.0.0.1:7171", state="alive")
    s.plan.pipelines.add()
    s.plan.relays.add(a="u1", b="u2", via="r", bandwidth_bytes_per_s=5e7)
    text = format_status(s, now=0.0)
    assert "- (dials out)" in text and "10.0.0.1:7171 " in text
    assert "u1 <-> u2 relayed by r (50.00 MB/s, the slower leg)" in text


@pytest.mark.timeout(120)
def test_the_reverse_benchmark_runs_every_path(capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # the bench tree is not installed
    from bench.reverse import main

    assert main(["--tensor-mib", "1", "--total-mib", "4", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for path in ("dial", "reverse", "relay"):
        assert f"round 1: {path}" in out
    assert "targets met: " in out.splitlines()[-1]


def test_a_node_that_accepts_no_connections_is_an_island_of_its_own() -> None:
    from types import SimpleNamespace

    from atoll.coordinator.reachability import separate_unreachable
    from atoll.plan import IslandInfo
    from atoll.types import NodeProfile

    def member(address: str, count: int = 1):
        return SimpleNamespace(peer_address=address, profile=NodeProfile(device_count=count))

    members = {"r1": member("10.0.0.1:1"), "r2": member("10.0.0.2:1"), "u1": member("", 2), "u2": member(""),
               "s": member("10.0.0.3:1")}
    islands = [IslandInfo(id="gpu0", group="lab", nodes=["r1", "u1", "r2", "u2"], gpus=5, inner_bandwidth=1e9,
                          outer_bandwidth=1e8), IslandInfo(id="gpu1", nodes=["s"], gpus=1)]
    got = separate_unreachable(islands, members)
    assert [(i.id, i.nodes, i.gpus, i.group) for i in got] == [
        ("gpu0", ["r1", "r2"], 2, "lab"), ("gpu0-u0", ["u1"], 2, "lab"), ("gpu0-u1", ["u2"], 1, "lab"),
        ("gpu1", ["s"], 1, "")]
    assert got[1].inner_bandwidth == 0.0 and got[1].outer_bandwidth == 1e9
    assert separate_unreachable(islands[1:], members) == islands[1:]
