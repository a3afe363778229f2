"""Each forgery of issue 12 tried as an outsider holding the job token would, against real servers over mutual
TLS: a coordinator with its job CA in a state dir, Peer servers under node certificates, and an `atoll node`
process on a locked state dir. Every attempt is refused with PERMISSION_DENIED, and the victim is unharmed."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
import torch

from atoll.compression.spec import CodecSpec
from atoll.compression.wire import tensor_to_chunks
from atoll.coordinator.membership import MembershipOptions
from atoll.coordinator.service import CoordinatorService, ServiceConfig
from atoll.coordinator.state import CoordinatorOptions
from atoll.job import JobSpec
from atoll.node.credentials import NodeCredentials
from atoll.node.identity import StateDirLock
from atoll.node.mailbox import Mailbox, ReceiveSpec
from atoll.node.peer import PeerServer
from atoll.node.ca_hash import CaHashError, fetch_ca, parse_ca_hash
from atoll.node.outer import fetch_outer
from atoll.node.probe import ProbeError, probe_peer
from atoll.node.reverse import RELAY_METADATA_KEY, RELAY_TARGET, DialerConfig, ReverseDialer, TunnelError, chunk_to_bytes
from atoll.node.state_transfer import StateHolder, checkpoint_file, held_state
from atoll.plan import PipelinePlan, Plan, StagePlan
from atoll.rpc import RpcOptions, make_channel
from atoll.tls import CertificateAuthority, bootstrap_rpc, cert_from_pem, fingerprint, make_csr, new_key, node_dns_name
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "forgery-token"
SHAPE = (2, 8, 16)
pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _profile(host: str) -> pb.NodeProfile:
    return pb.NodeProfile(hostname=host, device_kind="cpu", device_name="cpu-x", device_count=1,
                          memory_total_bytes=16 << 30, memory_free_bytes=8 << 30, cpu_count=4)


@dataclass
class Enrolled:
    """A node that joined for real: its credentials, and a coordinator stub speaking under its certificate."""

    node_id: str
    credentials: NodeCredentials
    stub: pb_grpc.CoordinatorStub


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("forgery")
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    opts = CoordinatorOptions(membership=MembershipOptions(lease=timedelta(seconds=60), settle=timedelta(0)),
                              dial_back=False)
    svc = CoordinatorService(job=job, token=TOKEN, options=opts,
                             config=ServiceConfig(listen="127.0.0.1:0", state_dir=tmp / "coordinator",
                                                  tick=timedelta(milliseconds=50), mutual_tls=True)).start()
    ca_pem = (tmp / "coordinator" / "ca.pem").read_bytes()
    channels: list[grpc.Channel] = []

    def enroll(node_id: str) -> Enrolled:
        creds = NodeCredentials(tmp / node_id, node_id=node_id, token=TOKEN, coordinator_ca_pem=ca_pem)
        boot = make_channel(svc.address, creds.coordinator_rpc(RpcOptions()), token=TOKEN)
        challenge = pb_grpc.CoordinatorStub(boot).JoinChallenge(pb.JoinChallengeRequest(token=TOKEN, node_id=node_id),
                                                                timeout=10).challenge
        reply = pb_grpc.CoordinatorStub(boot).Join(pb.JoinRequest(
            token=TOKEN, node_id=node_id, job_id=job.id, profile=_profile(node_id),
            peer_address=f"127.0.0.1:{10000 + len(channels)}", csr_pem=creds.csr(challenge)), timeout=10)
        boot.close()
        creds.accept(reply.certificate_pem, reply.ca_pem)
        channel = make_channel(svc.address, creds.coordinator_rpc(RpcOptions()), token=TOKEN)
        channels.append(channel)
        return Enrolled(node_id, creds, pb_grpc.CoordinatorStub(channel))

    nodes = {name: enroll(name) for name in ("s0", "s1", "forger")}
    n = job.model_spec.num_layers
    plan = Plan(model=job.model.name, global_batch=job.train.global_batch, seq_len=job.train.seq_len,
                epoch=svc.state.epoch + 1, job_id=job.id, resume_step=0,
                pipelines=[PipelinePlan(micro_batch=2, num_micro_batches=4, stages=[
                    StagePlan(island="i0", layers=(0, n // 2), nodes=["s0"]),
                    StagePlan(island="i0", layers=(n // 2, n), nodes=["s1"])])],
                node_addresses={"s0": "127.0.0.1:10000", "s1": "127.0.0.1:10001"})
    svc.state.publish(plan, "forgery test")
    yield {"svc": svc, "nodes": nodes, "plan": plan, "ca_pem": ca_pem, "tmp": tmp, "job": job}
    for channel in channels:
        channel.close()
    svc.stop()


def _denied(call) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, (info.value.code(), info.value.details())
    return info.value.details()


def test_heartbeats_for_another_node_are_refused(world: dict) -> None:
    forger, svc = world["nodes"]["forger"], world["svc"]
    before = svc.store.get_member("s0").last_heartbeat_unix
    details = _denied(lambda: forger.stub.Heartbeat(pb.HeartbeatRequest(node_id="s0"), timeout=5))
    assert "forger" in details and "s0" in details
    assert svc.store.get_member("s0").last_heartbeat_unix == before  # the victim's lease was not renewed
    forger.stub.Heartbeat(pb.HeartbeatRequest(node_id="forger"), timeout=5)  # its own is fine


def test_heartbeat_streams_for_another_node_are_refused(world: dict) -> None:
    forger, svc = world["nodes"]["forger"], world["svc"]
    before = svc.store.get_member("s0").last_heartbeat_unix
    details = _denied(lambda: list(forger.stub.HeartbeatStream(iter([pb.HeartbeatRequest(node_id="s0")]), timeout=5)))
    assert "forger" in details and "s0" in details
    # nor by opening the stream as itself and then speaking for the victim
    with pytest.raises(grpc.RpcError) as info:
        list(forger.stub.HeartbeatStream(iter([pb.HeartbeatRequest(node_id="forger"), pb.HeartbeatRequest(node_id="s0")]),
                                         timeout=5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "one node" in info.value.details()
    assert svc.store.get_member("s0").last_heartbeat_unix == before  # the victim's lease was not renewed
    replies = list(forger.stub.HeartbeatStream(iter([pb.HeartbeatRequest(node_id="forger")] * 2), timeout=5))
    assert len(replies) == 2  # its own are fine


def test_a_spoofed_leave_is_refused(world: dict) -> None:
    forger, svc = world["nodes"]["forger"], world["svc"]
    _denied(lambda: forger.stub.Leave(pb.LeaveRequest(node_id="s1", reason="spoofed"), timeout=5))
    assert svc.store.get_member("s1").state == "alive"


def test_a_join_under_a_live_nodes_id_is_refused(world: dict) -> None:
    svc, job = world["svc"], world["job"]
    address = svc.store.get_member("s0").peer_address
    # with the token alone and a key of its own
    boot = make_channel(svc.address, bootstrap_rpc(TOKEN, world["ca_pem"]), token=TOKEN)
    try:
        details = _denied(lambda: pb_grpc.CoordinatorStub(boot).Join(pb.JoinRequest(
            token=TOKEN, node_id="s0", job_id=job.id, profile=_profile("evil"), peer_address="127.0.0.1:6666",
            csr_pem=make_csr(new_key(), "s0")), timeout=10))
        assert "another key" in details
        # with the token alone and no key at all: it cannot even ask
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.CoordinatorStub(boot).Join(pb.JoinRequest(token=TOKEN, node_id="s0", job_id=job.id,
                                                              profile=_profile("evil"), peer_address="x:1"), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # a token-only certificate may not heartbeat at all
        _denied(lambda: pb_grpc.CoordinatorStub(boot).Heartbeat(pb.HeartbeatRequest(node_id="s0"), timeout=5))
        _denied(lambda: list(pb_grpc.CoordinatorStub(boot).HeartbeatStream(
            iter([pb.HeartbeatRequest(node_id="s0")]), timeout=5)))
    finally:
        boot.close()
    # under its own certificate
    forger = world["nodes"]["forger"]
    _denied(lambda: forger.stub.Join(pb.JoinRequest(
        token=TOKEN, node_id="s0", job_id=job.id, profile=_profile("evil"), peer_address="127.0.0.1:6666",
        csr_pem=forger.credentials.csr()), timeout=10))
    assert svc.store.get_member("s0").peer_address == address  # its address was not taken over


def test_a_replayed_join_is_refused(world: dict) -> None:
    """The finding: a replayed Join (the same signing request and token) was accepted, forced a replan and blanked
    the node's address in the plan."""
    svc, job, s1 = world["svc"], world["job"], world["nodes"]["s1"]
    address, epoch = svc.store.get_member("s1").peer_address, svc.state.epoch
    challenge = s1.stub.JoinChallenge(pb.JoinChallengeRequest(token=TOKEN, node_id="s1"), timeout=10).challenge
    seen = pb.JoinRequest(token=TOKEN, node_id="s1", job_id=job.id, profile=_profile("s1"), peer_address=address,
                          csr_pem=s1.credentials.csr(challenge))
    s1.stub.Join(seen, timeout=10)  # the node's own join, taken once
    boot = make_channel(svc.address, bootstrap_rpc(TOKEN, world["ca_pem"]), token=TOKEN)
    try:
        for replay in (seen, pb.JoinRequest(token=TOKEN, node_id="s1", job_id=job.id, profile=_profile("s1"),
                                            csr_pem=seen.csr_pem)):  # as recorded, and without its address
            assert "replayed" in _denied(lambda: pb_grpc.CoordinatorStub(boot).Join(replay, timeout=10))
        # a node of an older atoll, which asks no challenge, is told to upgrade
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.CoordinatorStub(boot).Join(pb.JoinRequest(
                token=TOKEN, node_id="s1", job_id=job.id, profile=_profile("s1"), peer_address=address,
                csr_pem=s1.credentials.csr()), timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "upgrade atoll" in info.value.details()
    finally:
        boot.close()
    assert svc.store.get_member("s1").peer_address == address and svc.state.epoch == epoch


def test_checkpoint_reports_for_another_stage_or_far_steps_are_refused(world: dict) -> None:
    nodes, plan, job = world["nodes"], world["plan"], world["job"]
    n = job.model_spec.num_layers

    def report(who: Enrolled, node_id: str, step: int, layers: tuple[int, int]):
        return lambda: who.stub.ReportCheckpoint(pb.CheckpointReport(
            job_id=job.id, node_id=node_id, plan_epoch=plan.epoch, step=step, layer_start=layers[0],
            layer_end=layers[1], path="/tmp/x", bytes=1), timeout=5)

    s1 = nodes["s1"]
    assert "holds layers" in _denied(report(s1, "s1", 10, (0, n // 2)))  # stage 0's layers
    assert "outside plan epoch" in _denied(report(s1, "s1", 10**6, (n // 2, n)))  # the step 10^6
    assert "node forger reports a file on node 's0'" in _denied(report(nodes["forger"], "s0", 10, (0, n // 2)))
    # a copy s1 took of stage 0's layers is reported by s1, the holder, never by the writer in its name
    assert "reported by the node that holds it" in _denied(report(nodes["s0"], "s1", 10, (0, n // 2)))
    assert "holds layers none" in _denied(report(nodes["forger"], "forger", 10, (0, n)))  # not in the plan
    report(s1, "s1", 10, (n // 2, n))()  # its own stage at a step of the job: recorded
    assert all(c.step <= job.train.steps for c in world["svc"].store.list_checkpoints())


@pytest.fixture()
def stage1_server(world: dict) -> Iterator[PeerServer]:
    s1, plan, job = world["nodes"]["s1"], world["plan"], world["job"]
    server = PeerServer(node_id="s1", listen="127.0.0.1:0", token=TOKEN, rpc=s1.credentials.peer_rpc(RpcOptions()))
    box = Mailbox(ReceiveSpec(job_id=job.id, plan_epoch=plan.epoch, pipeline=0, stage=1, upstream="s0",
                              downstream=None, shape=SHAPE, micro_batches=4))
    server.attach(box)
    server.note_plan(plan)
    yield server
    server.stop()


def _send(sender: Enrolled, address: str, claimed: str, epoch: int, job_id: str,
          metadata: tuple = ()) -> pb.TransferAck:
    meta = dict(job_id=job_id, plan_epoch=epoch, step=0, micro_batch=0, direction="forward", name="act",
                sender=claimed, pipeline=0, stage=0, replica=0)
    chunks = list(tensor_to_chunks(torch.full(SHAPE, float("nan")), CodecSpec("identity"), meta, 1024))
    channel = make_channel(address, sender.credentials.peer_rpc(RpcOptions()))
    try:
        return pb_grpc.PeerStub(channel).Transfer(iter(chunks), timeout=10, metadata=metadata)
    finally:
        channel.close()


def _open_stream(who: Enrolled, address: str, name: str, held: threading.Event):
    """A Connect stream naming `name`, open until `held` is set, once the server has registered it."""
    def frames():
        yield pb.ConnectFrame(node_id=name)
        held.wait(20)

    channel = make_channel(address, who.credentials.peer_rpc(RpcOptions()))
    stream = pb_grpc.PeerStub(channel).Connect(frames(), timeout=30)
    next(stream)  # call 0: registered
    return channel, stream


def _connect_as(who: Enrolled, address: str, name: str) -> None:
    held = threading.Event()
    held.set()
    channel, stream = _open_stream(who, address, name, held)
    stream.cancel()
    channel.close()


@contextmanager
def _connected(who: Enrolled, address: str) -> Iterator[None]:
    held = threading.Event()
    channel, stream = _open_stream(who, address, who.node_id, held)  # kept referenced: the stream stays open
    try:
        yield
    finally:
        held.set()
        stream.cancel()
        channel.close()


def test_forged_activations_from_stage_0_are_refused(world: dict, stage1_server: PeerServer) -> None:
    forger, s0 = world["nodes"]["forger"], world["nodes"]["s0"]
    epoch, job_id = world["plan"].epoch, world["job"].id
    # claiming to be stage 0's node, under its own certificate
    details = _denied(lambda: _send(forger, stage1_server.address, "s0", epoch, job_id))
    assert "certificate is node forger's" in details
    # as itself: the plan does not put it upstream of stage 1
    assert "neither upstream nor downstream" in _denied(lambda: _send(forger, stage1_server.address, "forger",
                                                                       epoch, job_id))
    # nor through this node as a relay towards a node that opened a Connect stream here (s0 plays one)
    with _connected(s0, stage1_server.address):
        relay = ((RELAY_METADATA_KEY, "s0"),)
        assert "claims to come from 's1'" in _denied(lambda: _send(forger, stage1_server.address, "s1", epoch,
                                                                   job_id, metadata=relay))
    # and a stream opened under another node's name, to receive what is relayed to it, is refused
    assert "the stream names 's0'" in _denied(lambda: _connect_as(forger, stage1_server.address, "s0"))
    assert stage1_server.receiver.stats["forward"].tensors == 0  # type: ignore[union-attr]
    # the real stage 0 gets through
    assert _send(s0, stage1_server.address, "s0", epoch, job_id).tensors == 1


def test_outer_state_is_served_only_to_plan_members(world: dict, stage1_server: PeerServer) -> None:
    forger, s0 = world["nodes"]["forger"], world["nodes"]["s0"]

    class Outbox:
        def frames(self, request, wait):
            return iter(())

    stage1_server.attach_outbox(Outbox())

    def fetch(who: Enrolled, sender: str):
        channel = make_channel(stage1_server.address, who.credentials.peer_rpc(RpcOptions()))
        try:
            return list(pb_grpc.PeerStub(channel).FetchOuter(pb.OuterFetchRequest(sender=sender, kind="delta"),
                                                             timeout=10))
        finally:
            channel.close()

    assert "none of the plans" in _denied(lambda: fetch(forger, "forger"))
    _denied(lambda: fetch(forger, "s0"))
    assert fetch(s0, "s0") == []


def test_the_job_token_is_not_sent_to_peers(world: dict) -> None:
    rpc = world["nodes"]["s0"].credentials.peer_rpc(RpcOptions())
    assert rpc.mtls is not None and not rpc.mtls.send_token


def test_a_second_process_on_a_locked_state_dir_fails_with_one_line(world: dict) -> None:
    tmp = world["tmp"]
    (tmp / "token").write_text(TOKEN + "\n")
    (tmp / "ca.pem").write_bytes(world["ca_pem"])
    state = tmp / "locked-node"
    with StateDirLock(state):  # a live node holds it
        proc = subprocess.run(
            [sys.executable, "-m", "atoll", "node", "--coordinator", world["svc"].address, "--token-file",
             str(tmp / "token"), "--state-dir", str(state)],
            capture_output=True, text=True, timeout=100)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if " I " not in ln[:12] and ln.strip()]  # past the info lines
    assert len(errors) == 1 and "in use by another atoll node" in errors[0], proc.stderr


def test_a_neighbour_dialled_by_name_must_hold_its_own_certificate(world: dict, stage1_server: PeerServer) -> None:
    """A node that sits at another's address (it took the port, or a path leads to it) does not receive the
    tensors meant for that node: the sender expects the neighbour's own name in the server's certificate."""
    s0, plan, job = world["nodes"]["s0"], world["plan"], world["job"]
    meta = dict(job_id=job.id, plan_epoch=plan.epoch, step=1, micro_batch=0, direction="forward", name="act",
                sender="s0", pipeline=0, stage=0, replica=0)

    def send(expected: str) -> pb.TransferAck:
        chunks = list(tensor_to_chunks(torch.ones(SHAPE), CodecSpec("identity"), meta, 1024))
        channel = make_channel(stage1_server.address, s0.credentials.peer_rpc(RpcOptions()),
                               server_name=node_dns_name(expected))
        try:
            return pb_grpc.PeerStub(channel).Transfer(iter(chunks), timeout=5)
        finally:
            channel.close()

    with pytest.raises(grpc.RpcError) as info:
        send("forger")  # s1's server is not the forger's
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert send("s1").tensors == 1


# --- stage state, reverse streams, named servers and the CA hash ------------------------------------------


@contextmanager
def _server_of(who: Enrolled, plan: Plan, checkpoint_dir: Path) -> Iterator[PeerServer]:
    """A node's Peer server that follows `plan` and keeps its checkpoints in `checkpoint_dir`."""
    server = PeerServer(node_id=who.node_id, listen="127.0.0.1:0", token=TOKEN,
                        rpc=who.credentials.peer_rpc(RpcOptions()))
    server.state = StateHolder(node_id=who.node_id, checkpoint_dir=checkpoint_dir)
    server.note_plan(plan)
    try:
        yield server
    finally:
        server.stop()


def _peer(who: Enrolled, address: str, server: str | None = None) -> tuple[grpc.Channel, pb_grpc.PeerStub]:
    channel = make_channel(address, who.credentials.peer_rpc(RpcOptions()),
                           server_name=node_dns_name(server) if server else None)
    return channel, pb_grpc.PeerStub(channel)


def _fetch_state(who: Enrolled, address: str, sender: str, step: int, layers: tuple[int, int]) -> bytes:
    channel, stub = _peer(who, address)
    try:
        return b"".join(c.data for c in stub.FetchState(pb.StateFetchRequest(
            job_id="j", kind="checkpoint", step=step, layer_start=layers[0], layer_end=layers[1], sender=sender),
            timeout=10))
    finally:
        channel.close()


def test_stage_state_goes_only_to_plan_members_for_their_own_layers(world: dict) -> None:
    """FetchState and HeldState: a node outside the plan gets nothing; a member gets the state of its own layers
    (or of a file this node asked it to copy), never another stage's, and asks only as itself."""
    nodes, plan, tmp = world["nodes"], world["plan"], world["tmp"]
    n = world["job"].model_spec.num_layers
    s0, forger = nodes["s0"], nodes["forger"]
    mine = (n // 2, n)  # s1's layers
    with _server_of(nodes["s1"], plan, tmp / "ckpt-state-s1") as s1_server:
        path = checkpoint_file(tmp / "ckpt-state-s1", 10, mine)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"stage 1's weights")
        assert "none of the plans" in _denied(lambda: _fetch_state(forger, s1_server.address, "forger", 10, mine))
        assert "fetches only the state of its own layers" in _denied(
            lambda: _fetch_state(s0, s1_server.address, "s0", 10, mine))
        assert "certificate is node forger's" in _denied(lambda: _fetch_state(forger, s1_server.address, "s0", 10,
                                                                             (0, n // 2)))
        # a file this node asked s0 to copy (the writer grants it before its Replicate call)
        s1_server.state_access.grant("s0", 10, mine)
        assert _fetch_state(s0, s1_server.address, "s0", 10, mine) == b"stage 1's weights"
        # s0's own layers: allowed (it holds none here: NOT_FOUND, not PERMISSION_DENIED)
        with pytest.raises(grpc.RpcError) as info:
            _fetch_state(s0, s1_server.address, "s0", 10, (0, n // 2))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND

        def held(who: Enrolled, sender: str) -> pb.HeldStateReply:
            channel, stub = _peer(who, s1_server.address)
            try:
                return stub.HeldState(pb.HeldStateRequest(job_id="j", plan_epoch=plan.epoch, sender=sender),
                                      timeout=10)
            finally:
                channel.close()

        assert "none of the plans" in _denied(lambda: held(forger, "forger"))
        assert "certificate is node forger's" in _denied(lambda: held(forger, "s0"))
        assert held(s0, "s0").node_id == "s1"


def test_replicate_is_taken_only_from_the_writer_of_its_own_layers(world: dict) -> None:
    """Replicate: only the writer (its certificate) asks for copies, only of its own stage's layers, and the
    copy is fetched only from a server holding the writer's own certificate (not from an address a forger
    names)."""
    nodes, plan, tmp = world["nodes"], world["plan"], world["tmp"]
    n = world["job"].model_spec.num_layers
    s0, forger = nodes["s0"], nodes["forger"]
    layers = (0, n // 2)
    with _server_of(s0, plan, tmp / "ckpt-rep-s0") as s0_server, \
            _server_of(nodes["s1"], plan, tmp / "ckpt-rep-s1") as s1_server, \
            _server_of(forger, plan, tmp / "ckpt-rep-forger") as forger_server:
        for root, data in ((tmp / "ckpt-rep-s0", b"real"), (tmp / "ckpt-rep-forger", b"poison")):
            path = checkpoint_file(root, 20, layers)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        forger_server.state_access.grant("s1", 20, layers)

        def replicate(who: Enrolled, source: str, source_address: str, rng: tuple[int, int]) -> pb.ReplicateReply:
            channel, stub = _peer(who, s1_server.address, "s1")
            try:
                return stub.Replicate(pb.ReplicateRequest(job_id="j", step=20, layer_start=rng[0], layer_end=rng[1],
                                                          source=source, source_address=source_address,
                                                          plan_epoch=plan.epoch), timeout=20)
            finally:
                channel.close()

        copy = checkpoint_file(tmp / "ckpt-rep-s1", 20, layers)
        # the forger, as s0, pointing s1 at its own server
        assert "only the writer" in _denied(lambda: replicate(forger, "s0", forger_server.address, layers))
        # s0 asking for a copy of a stage it does not run
        assert "only its own stage's" in _denied(lambda: replicate(s0, "s0", s0_server.address, (n // 2, n)))
        # s0 itself, but with a source address where another node answers: s1 expects s0's certificate there
        with pytest.raises(grpc.RpcError) as info:
            replicate(s0, "s0", forger_server.address, layers)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
        assert not copy.exists()
        # s0 for its own layers without a grant: s1 may not fetch the file
        with pytest.raises(grpc.RpcError) as info:
            replicate(s0, "s0", s0_server.address, layers)
        assert "PERMISSION_DENIED" in (info.value.details() or "")
        # the real thing: the writer grants, asks, and s1 fetches from it
        s0_server.state_access.grant("s1", 20, layers)
        assert replicate(s0, "s0", s0_server.address, layers).bytes == 4
        assert copy.read_bytes() == b"real"


def _tunnel_send(server: PeerServer, to: str, claimed: str, epoch: int, job_id: str) -> pb.TransferAck:
    meta = dict(job_id=job_id, plan_epoch=epoch, step=0, micro_batch=0, direction="forward", name="act",
                sender=claimed, pipeline=0, stage=0, replica=0)
    chunks = tensor_to_chunks(torch.ones(SHAPE), CodecSpec("identity"), meta, 1024)
    return pb.TransferAck.FromString(server.reverse.call(to, "Transfer", (chunk_to_bytes(c) for c in chunks), 10.0))


def test_tensors_over_a_nodes_own_connect_stream_are_checked_per_call(world: dict) -> None:
    """A node that accepts no connections (s1 here) receives over the streams it opens: the node it dialled
    sends only as itself, a relay only tensors of the plan's neighbours, and a server that is not the node
    dialled gets no stream at all."""
    nodes, plan, job, tmp = world["nodes"], world["plan"], world["job"], world["tmp"]
    s0, s1, forger = nodes["s0"], nodes["s1"], nodes["forger"]
    box = Mailbox(ReceiveSpec(job_id=job.id, plan_epoch=plan.epoch, pipeline=0, stage=1, upstream="s0",
                              downstream=None, shape=SHAPE, micro_batches=4))
    config = DialerConfig(node_id="s1", token=TOKEN, rpc=s1.credentials.peer_rpc(RpcOptions()))
    with _server_of(s0, plan, tmp / "ckpt-rev-s0") as s0_server, \
            _server_of(forger, plan, tmp / "ckpt-rev-forger") as forger_server:
        # s1 dials s0 by name, s0's address held by the forger: no stream opens
        dialer = ReverseDialer(config, {"s0": forger_server.address}, lambda: box)
        try:
            assert not dialer.wait_connected(2.0)
            assert forger_server.reverse.get("s1") is None
        finally:
            dialer.close()
        dialer = ReverseDialer(config, {"s0": s0_server.address, f"{RELAY_TARGET}{forger_server.address}":
                                        forger_server.address}, lambda: box)
        try:
            assert dialer.wait_connected(10.0)
            with pytest.raises(TunnelError) as info:  # the dialled s0 claiming another sender
                _tunnel_send(s0_server, "s1", "forger", plan.epoch, job.id)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "only as itself" in info.value.details()
            with pytest.raises(TunnelError) as info:  # a relay forwarding a tensor of no neighbour
                _tunnel_send(forger_server, "s1", "forger", plan.epoch, job.id)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "neither upstream nor downstream" in info.value.details()
            assert box.stats["forward"].tensors == 0
            assert _tunnel_send(s0_server, "s1", "s0", plan.epoch, job.id).tensors == 1
        finally:
            dialer.close()


def test_probes_and_fetches_by_node_expect_that_nodes_certificate(world: dict) -> None:
    """Probes, outer fetches and HeldState name the node they dial: another node of the job at its address is
    not taken for it."""
    nodes, plan, tmp = world["nodes"], world["plan"], world["tmp"]
    s0 = nodes["s0"]
    rpc = s0.credentials.peer_rpc(RpcOptions())
    with _server_of(nodes["s1"], plan, tmp / "ckpt-named-s1") as s1_server:
        with pytest.raises(ProbeError):
            probe_peer(s1_server.address, nbytes=1024, token=None, rpc=rpc, timeout=timedelta(seconds=3),
                       sender="s0", node="forger")
        assert probe_peer(s1_server.address, nbytes=1024, token=None, rpc=rpc, timeout=timedelta(seconds=10),
                          sender="s0", node="s1").node_id == "s1"
        request = pb.OuterFetchRequest(sender="s0", kind="delta")
        with pytest.raises(grpc.RpcError) as info:
            fetch_outer(s1_server.address, request, token=None, rpc=rpc, timeout=timedelta(seconds=3), node="forger")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as info:
            held_state(s1_server.address, job_id="j", epoch=plan.epoch, sender="s0", token=None, rpc=rpc,
                       timeout=timedelta(seconds=3), node="forger")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert held_state(s1_server.address, job_id="j", epoch=plan.epoch, sender="s0", token=None, rpc=rpc,
                          timeout=timedelta(seconds=10), node="s1").node_id == "s1"


def test_a_node_joins_with_the_ca_hash_alone(world: dict) -> None:
    """`--ca-hash`: the CA the coordinator presents is kept only when its fingerprint is the one given."""
    svc, ca_pem = world["svc"], world["ca_pem"]
    good = fingerprint(cert_from_pem(ca_pem, "ca"))
    assert fetch_ca(svc.address, token=TOKEN, ca_hash=good) == ca_pem
    assert fetch_ca(svc.address, token=TOKEN, ca_hash=good.upper().replace("SHA256:", "sha256:")) == ca_pem
    other = fingerprint(CertificateAuthority.create().cert)  # a CA someone in between would present
    with pytest.raises(CaHashError, match="presents no CA with fingerprint"):
        fetch_ca(svc.address, token=TOKEN, ca_hash=other)
    with pytest.raises(CaHashError, match="not sha256"):
        parse_ca_hash("md5:abc")
    # the node command: no ca.pem anywhere near, a wrong hash is one clear line
    folder = world["tmp"] / "hash-only"
    folder.mkdir()
    (folder / "token").write_text(TOKEN + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "atoll", "node", "--coordinator", svc.address, "--token-file", str(folder / "token"),
         "--state-dir", str(folder / "state"), "--ca-hash", other],
        capture_output=True, text=True, timeout=100)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if " I " not in ln[:12] and ln.strip()]
    assert len(errors) == 1 and "presents no CA with fingerprint" in errors[0], proc.stderr


def test_a_relay_named_by_the_plan_must_hold_its_own_certificate(world: dict) -> None:
    """Another node of the job at the relay's address gets no stream from a node behind NAT, so it cannot pass
    off tensors as the relayed neighbour's."""
    nodes, plan, job, tmp = world["nodes"], world["plan"], world["job"], world["tmp"]
    box = Mailbox(ReceiveSpec(job_id=job.id, plan_epoch=plan.epoch, pipeline=0, stage=1, upstream="s0",
                              downstream=None, shape=SHAPE, micro_batches=4))
    config = DialerConfig(node_id="s1", token=TOKEN, rpc=nodes["s1"].credentials.peer_rpc(RpcOptions()))
    with _server_of(nodes["forger"], plan, tmp / "ckpt-relay-forger") as forger_server:
        target = f"{RELAY_TARGET}{forger_server.address}"
        dialer = ReverseDialer(config, {target: forger_server.address}, lambda: box, names={target: "s0"})
        try:
            assert not dialer.wait_connected(2.0)  # the plan's relay is s0; the forger answers at its address
        finally:
            dialer.close()
        dialer = ReverseDialer(config, {target: forger_server.address}, lambda: box, names={target: "forger"})
        try:
            assert dialer.wait_connected(10.0)  # the named relay itself: the stream opens
        finally:
            dialer.close()


def test_a_neighbour_that_also_relays_may_send_as_itself_and_as_those_it_relays() -> None:
    """A node behind NAT keeps one Connect stream to a neighbour that is also its relay (the neighbour's server
    keys streams by the dialing node, so two would replace each other): tensors over it may name the neighbour
    or a node it relays here, nobody else."""
    from types import SimpleNamespace

    from atoll.node.peer_authz import Forbidden, check_tunnelled

    def chunk(sender: str):
        return pb.TensorChunk(meta=pb.TensorMeta(sender=sender))

    both = frozenset(("last", "first"))
    assert len(list(check_tunnelled(iter([chunk("last"), chunk("first")]), both, SimpleNamespace()))) == 2
    with pytest.raises(Forbidden, match="claims to come from 'other'"):
        list(check_tunnelled(iter([chunk("other")]), both, SimpleNamespace()))
    with pytest.raises(Forbidden, match="claims to come from 'first'"):
        list(check_tunnelled(iter([chunk("first")]), "last", SimpleNamespace()))
