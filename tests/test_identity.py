"""Node identity: the job CA and its files, bootstrap credentials, node certificates, the authorization rules,
the state-dir lock, and agents that join and probe each other over mutual TLS."""

from __future__ import annotations

import stat
import time
from datetime import timedelta
from pathlib import Path

import grpc
import pytest

from atoll.coordinator.authz import PermissionDenied, PlanLookup, authorize, check_checkpoint
from atoll.coordinator.ca import PLAINTEXT, Caller, JobAuthority
from atoll.coordinator.islands import IslandOptions
from atoll.coordinator.membership import MembershipOptions
from atoll.coordinator.linkmatrix import ProbeOptions
from atoll.coordinator.service import CoordinatorService, ServiceConfig
from atoll.coordinator.state import CoordinatorOptions, CoordinatorState
from atoll.coordinator.status import fetch_status
from atoll.coordinator.store import MemberRecord, MemoryStore
from atoll.job import JobSpec
from atoll.node.agent import AgentConfig, AgentError, NodeAgent
from atoll.node.credentials import CERT_FILE, KEY_FILE, NodeCredentials
from atoll.node.identity import StateDirLock, StateDirLocked
from atoll.plan import PipelinePlan, Plan, StagePlan
from atoll.rpc import RpcOptions, make_channel
from atoll.tls import (CertificateAuthority, bootstrap_ca, bootstrap_client, bootstrap_rpc, cert_from_pem,
                       common_name, find_ca, make_csr, new_key)
from atoll.types import NodeProfile
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "identity-token"
pytestmark = pytest.mark.timeout(60)


# --- certificates ---------------------------------------------------------------------------------------

def test_the_bootstrap_ca_is_the_same_for_every_holder_of_the_token() -> None:
    assert bootstrap_ca(TOKEN).cert_pem == bootstrap_ca(TOKEN).cert_pem
    assert bootstrap_ca(TOKEN).cert_pem != bootstrap_ca(TOKEN + "x").cert_pem
    _, cert_pem = bootstrap_client(TOKEN)
    cert = cert_from_pem(cert_pem, "bootstrap")
    assert bootstrap_ca(TOKEN).issued(cert) and not bootstrap_ca("other").issued(cert)


def test_the_job_ca_tells_its_node_certificates_from_bootstrap_ones() -> None:
    authority = JobAuthority.in_memory()
    key = new_key()
    cert_pem = authority.issue("n1", make_csr(key, "someone-else"))  # the name asked for does not count
    assert common_name(cert_from_pem(cert_pem, "n1")) == "n1"
    assert authority.caller(cert_pem) == Caller("node", "n1")
    assert authority.caller(bootstrap_client(TOKEN)[1]).kind == "bootstrap"
    # a token holder can sign any name with the bootstrap key, and even copy the job CA's name as issuer:
    # only the job CA's signature makes a node
    forged = CertificateAuthority(bootstrap_ca(TOKEN).key, authority.ca.cert).sign_node(make_csr(new_key(), "x"), "n1")
    from atoll.tls import cert_to_pem

    assert authority.caller(cert_to_pem(forged)).kind == "bootstrap"


def test_the_ca_survives_a_restart_with_private_files(tmp_path: Path) -> None:
    first = JobAuthority.load_or_create(tmp_path)
    cert_pem = first.issue("n1", make_csr(new_key(), "n1"))
    first.close()
    for name in ("ca.key", "server.key"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
    again = JobAuthority.load_or_create(tmp_path)
    assert again.ca.cert_pem == first.ca.cert_pem and again.fingerprint == first.fingerprint
    assert again.caller(cert_pem) == Caller("node", "n1")  # issued before the restart, still a node
    assert again.bindings.get("n1") == first.cert_key_id(cert_pem)
    again.close()
    (tmp_path / "ca.key").unlink()
    with pytest.raises(ValueError, match="restore ca.key"):
        JobAuthority.load_or_create(tmp_path)


def test_a_client_finds_the_ca_beside_its_token_file(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("t\n")
    with pytest.raises(FileNotFoundError, match="--tls-ca"):
        find_ca(None, tmp_path / "token")
    (tmp_path / "ca.pem").write_bytes(JobAuthority.in_memory().ca.cert_pem)
    assert find_ca(None, tmp_path / "token") == tmp_path / "ca.pem"
    with pytest.raises(FileNotFoundError, match="no such file"):
        find_ca(tmp_path / "nope.pem", None)


# --- authorization rules --------------------------------------------------------------------------------

def _state() -> CoordinatorState:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    return CoordinatorState(store=MemoryStore(), job=job, token=TOKEN, rendezvous="")


def _alive(state: CoordinatorState, node_id: str) -> None:
    state.store.put_member(MemberRecord(node_id=node_id, peer_address="127.0.0.1:1",
                                        profile=NodeProfile(hostname="h", device_kind="cpu"), state="alive",
                                        joined_unix=state.clock(), last_heartbeat_unix=state.clock(), reason=""))


def test_a_node_speaks_only_as_itself_and_the_token_only_joins() -> None:
    state, authority = _state(), JobAuthority.in_memory()
    me = Caller("node", "a")
    authorize("Heartbeat", pb.HeartbeatRequest(node_id="a"), me, state, authority)
    for method, request in (("Heartbeat", pb.HeartbeatRequest(node_id="b")), ("Leave", pb.LeaveRequest(node_id="b")),
                            ("ReportStep", pb.StepMetrics(node_id="b")), ("WatchPlan", pb.WatchPlanRequest()),
                            ("ReportFailure", pb.RunFailure(node_id="b")), ("OuterSync", pb.OuterSyncRequest())):
        with pytest.raises(PermissionDenied, match="node a's"):
            authorize(method, request, me, state, authority)
    boot = Caller("bootstrap", "atoll-bootstrap")
    authorize("GetStatus", pb.StatusRequest(), boot, state, authority)
    with pytest.raises(PermissionDenied, match="may only join"):
        authorize("Heartbeat", pb.HeartbeatRequest(node_id="a"), boot, state, authority)
    authorize("Heartbeat", pb.HeartbeatRequest(node_id="b"), PLAINTEXT, state, None)  # insecure: no identities


def test_a_join_under_a_live_id_needs_the_key_it_was_issued_for() -> None:
    state, authority = _state(), JobAuthority.in_memory()
    boot = Caller("bootstrap", "atoll-bootstrap")
    key = new_key()
    authority.issue("a", make_csr(key, "a"))
    _alive(state, "a")
    fresh = lambda: state.challenges.issue(state.clock())  # noqa: E731 - each join asks for its challenge
    authorize("Join", pb.JoinRequest(node_id="a", csr_pem=make_csr(key, "a", fresh())), boot, state, authority)
    with pytest.raises(PermissionDenied, match="held by a live node with another key"):
        authorize("Join", pb.JoinRequest(node_id="a", csr_pem=make_csr(new_key(), "a", fresh())), boot, state,
                  authority)
    state.store.set_member_state("a", "gone", "lease expired")
    authorize("Join", pb.JoinRequest(node_id="a", csr_pem=make_csr(new_key(), "a", fresh())), boot, state, authority)
    with pytest.raises(Exception, match="signing request"):
        authorize("Join", pb.JoinRequest(node_id="c"), boot, state, authority)


def test_checkpoint_reports_only_for_own_stages_within_the_steps() -> None:
    state = _state()
    plan = Plan(model="tiny", global_batch=8, seq_len=64, epoch=1, job_id=state.job.id, resume_step=10,
                pipelines=[PipelinePlan(micro_batch=2, num_micro_batches=4, stages=[
                    StagePlan(island="i", layers=(0, 3), nodes=["a"]), StagePlan(island="i", layers=(3, 6), nodes=["b"])])])
    state.publish(plan, "test")
    plans = PlanLookup()
    ok = pb.CheckpointReport(node_id="a", plan_epoch=1, step=20, layer_start=0, layer_end=3)
    check_checkpoint(ok, state, plans)
    with pytest.raises(PermissionDenied, match=r"holds layers \[0, 3\)"):
        check_checkpoint(pb.CheckpointReport(node_id="a", plan_epoch=1, step=20, layer_start=3, layer_end=6),
                         state, plans)
    for step in (10**6, 5):
        with pytest.raises(PermissionDenied, match="outside plan epoch 1's steps"):
            check_checkpoint(pb.CheckpointReport(node_id="a", plan_epoch=1, step=step, layer_start=0, layer_end=3),
                             state, plans)


# --- the state-dir lock ---------------------------------------------------------------------------------

def test_one_process_per_state_dir(tmp_path: Path) -> None:
    with StateDirLock(tmp_path):
        with pytest.raises(StateDirLocked, match="in use by another atoll node"):
            StateDirLock(tmp_path)
    StateDirLock(tmp_path).release()  # free again once released


# --- agents over mutual TLS -----------------------------------------------------------------------------

def _profile(host: str) -> NodeProfile:
    return NodeProfile(hostname=host, device_kind="cpu", device_name="test-cpu", memory_total_bytes=8 << 30,
                       memory_free_bytes=4 << 30, cpu_count=2)


@pytest.fixture()
def tls_service(tmp_path: Path):
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    opts = CoordinatorOptions(membership=MembershipOptions(lease=timedelta(seconds=5), settle=timedelta(0)),
                              probes=ProbeOptions(probe_bytes=64 * 1024), islands=IslandOptions(relative_threshold=0.01))
    svc = CoordinatorService(job=job, token=TOKEN, options=opts,
                             config=ServiceConfig(listen="127.0.0.1:0", state_dir=tmp_path / "coordinator",
                                                  tick=timedelta(milliseconds=50), mutual_tls=True)).start()
    yield svc
    svc.stop()


def _agent(svc: CoordinatorService, state_dir: Path, host: str) -> NodeAgent:
    cfg = AgentConfig(coordinator=svc.address, token=TOKEN, state_dir=state_dir, listen="127.0.0.1:0",
                      tls_ca=(svc.config.state_dir / "ca.pem").read_bytes(), connect_timeout=timedelta(seconds=20),
                      backoff=(timedelta(milliseconds=50), timedelta(milliseconds=500)))
    return NodeAgent(cfg, profile=_profile(host))


def test_agents_join_heartbeat_and_probe_each_other_over_mutual_tls(tls_service: CoordinatorService,
                                                                     tmp_path: Path) -> None:
    agents = [_agent(tls_service, tmp_path / f"n{i}", f"h{i}").start() for i in range(2)]
    try:
        for agent in agents:
            assert (agent.config.state_dir / CERT_FILE).is_file()
            assert stat.S_IMODE((agent.config.state_dir / KEY_FILE).stat().st_mode) == 0o600
        def measured() -> list:
            return [link for link in tls_service.store.list_links() if link.bandwidth_bytes_per_s > 0]

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not measured():
            time.sleep(0.1)  # one probes the other's peer server, over mutual TLS under the job CA
        assert measured(), tls_service.store.list_links()
        rpc = bootstrap_rpc(TOKEN, (tls_service.config.state_dir / "ca.pem").read_bytes())
        status = fetch_status(tls_service.address, token=TOKEN, rpc=rpc)
        assert {m.node_id for m in status.members if m.state == "alive"} == {a.node_id for a in agents}
    finally:
        for agent in agents:
            agent.stop()
    # a restarted node comes back with its certificate: its first call is already as itself
    again = NodeCredentials(tmp_path / "n0", node_id=agents[0].node_id, token=TOKEN,
                            coordinator_ca_pem=(tls_service.config.state_dir / "ca.pem").read_bytes())
    assert again.has_certificate


def test_a_plaintext_or_certificate_less_client_gets_no_answer(tls_service: CoordinatorService) -> None:
    plain = pb_grpc.CoordinatorStub(make_channel(tls_service.address, RpcOptions(), token=TOKEN))
    with pytest.raises(grpc.RpcError) as info:
        plain.GetStatus(pb.StatusRequest(), timeout=3)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    wrong = bootstrap_rpc("not-the-token", (tls_service.config.state_dir / "ca.pem").read_bytes())
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.CoordinatorStub(make_channel(tls_service.address, wrong, token=TOKEN)).GetStatus(
            pb.StatusRequest(), timeout=3)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake fails: no certificate of this job


@pytest.mark.timeout(60)
def test_a_node_with_a_wrong_token_says_so_and_gives_up(tls_service: CoordinatorService, tmp_path: Path) -> None:
    """The coordinator refuses the bootstrap certificate a wrong token vouches for; a TLS handshake of the node's
    own says so a few seconds in, and the node stops retrying (a wrong token never becomes right) instead of
    trying for its whole connect timeout."""
    cfg = AgentConfig(coordinator=tls_service.address, token="not-the-job-token", state_dir=tmp_path / "n",
                      listen="127.0.0.1:0", tls_ca=(tls_service.config.state_dir / "ca.pem").read_bytes(),
                      connect_timeout=timedelta(seconds=50),
                      backoff=(timedelta(milliseconds=50), timedelta(milliseconds=500)))
    agent = NodeAgent(cfg, profile=_profile("h"))
    started = time.monotonic()
    with pytest.raises(AgentError, match=r"refuses this client's certificate.*the token is not this job's"):
        agent.start()
    assert time.monotonic() - started < 30
    agent.stop(leave=False)
