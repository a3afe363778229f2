"""The coordinator's servicers against a real in-process gRPC server on port 0."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from atoll.coordinator.membership import MembershipOptions
from atoll.coordinator.service import CoordinatorService, ServiceConfig
from atoll.coordinator.state import CoordinatorOptions
from atoll.coordinator.status import fetch_status, format_status, status_json
from atoll.job import JobSpec
from atoll.rpc import RpcOptions, make_channel
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "tok-123"
pytestmark = pytest.mark.timeout(60)


def profile(host: str = "h1") -> pb.NodeProfile:
    return pb.NodeProfile(hostname=host, device_kind="cpu", device_name="cpu-x", device_count=1,
                          memory_total_bytes=16 << 30, memory_free_bytes=8 << 30, cpu_count=4)


def _start(dial_back: bool) -> CoordinatorService:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    opts = CoordinatorOptions(membership=MembershipOptions(lease=timedelta(seconds=30), settle=timedelta(0)),
                              dial_back=dial_back)
    return CoordinatorService(job=job, token=TOKEN, options=opts,
                              config=ServiceConfig(listen="127.0.0.1:0", metrics_port=0,
                                                   tick=timedelta(milliseconds=50))).start()


@pytest.fixture(scope="module")
def service() -> Iterator[CoordinatorService]:
    # the joins below advertise placeholder addresses nobody listens on: trust them instead of dialing back
    svc = _start(dial_back=False)
    yield svc
    svc.stop()


def stub(service: CoordinatorService, token: str | None = TOKEN, **rpc) -> pb_grpc.CoordinatorStub:
    return pb_grpc.CoordinatorStub(make_channel(service.address, RpcOptions(**rpc), token=token))


def join(service: CoordinatorService, host: str, port: int, token: str = TOKEN) -> pb.JoinReply:
    return stub(service).Join(pb.JoinRequest(token=token, profile=profile(host), peer_address=f"127.0.0.1:{port}"),
                              timeout=5)


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_health_is_serving(service: CoordinatorService) -> None:
    channel = make_channel(service.address)
    h = health_pb2_grpc.HealthStub(channel)
    for name in ("", "atoll.v1.Coordinator"):
        assert h.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_tokens_are_checked_in_the_request_and_the_metadata(service: CoordinatorService) -> None:
    req = pb.JoinRequest(token=TOKEN, profile=profile(), peer_address="127.0.0.1:4000")
    assert code_of(lambda: stub(service, token=None).Join(req, timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: stub(service, token="nope").GetStatus(pb.StatusRequest(), timeout=5)) == \
        grpc.StatusCode.UNAUTHENTICATED
    bad = pb.JoinRequest(token="nope", profile=profile(), peer_address="127.0.0.1:4000")
    assert code_of(lambda: stub(service).Join(bad, timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    watch = stub(service, token="nope").WatchPlan(pb.WatchPlanRequest(), timeout=5)
    assert code_of(lambda: next(watch)) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (pb.JoinRequest(token=TOKEN, profile=pb.NodeProfile(hostname="h", device_kind="cpu", device_name="x",
                                                            device_count=1, memory_total_bytes=1 << 62, cpu_count=1),
                        peer_address="127.0.0.1:1"), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.JoinRequest(token=TOKEN, profile=pb.NodeProfile(), peer_address="127.0.0.1:1"),
         grpc.StatusCode.INVALID_ARGUMENT),
        (pb.JoinRequest(token=TOKEN, job_id="someone-else", profile=profile(), peer_address="127.0.0.1:1"),
         grpc.StatusCode.FAILED_PRECONDITION),
    ],
)
def test_bad_joins_get_their_status_codes(service: CoordinatorService, request_: pb.JoinRequest,
                                          code: grpc.StatusCode) -> None:
    assert code_of(lambda: stub(service).Join(request_, timeout=5)) == code


def test_a_malformed_address_is_refused_before_the_coordinator_dials_it() -> None:
    """With dial-back on, a port past 65535 (which `socket.create_connection` answers with OverflowError) or a
    wildcard is INVALID_ARGUMENT, never dialled and never an UNKNOWN; a well-formed closed port still joins."""
    svc = _start(dial_back=True)
    try:
        for address in ("127.0.0.1:1180591620717411303424", "127.0.0.1:0", "0.0.0.0:7000", "no-port"):
            req = pb.JoinRequest(token=TOKEN, profile=profile("bad"), peer_address=address)
            assert code_of(lambda: stub(svc).Join(req, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT, address
        reply = stub(svc).Join(pb.JoinRequest(token=TOKEN, profile=profile("ok"), peer_address="127.0.0.1:1"),
                               timeout=10)
        assert not reply.reachable and "127.0.0.1:1" in reply.reachability
    finally:
        svc.stop()


def test_huge_messages_are_refused_and_the_coordinator_stays_up(service: CoordinatorService) -> None:
    big = pb.JoinRequest(token=TOKEN, profile=profile("x" * (9 << 20)), peer_address="127.0.0.1:1")
    assert code_of(lambda: stub(service, max_message_bytes=64 << 20).Join(big, timeout=10)) == \
        grpc.StatusCode.RESOURCE_EXHAUSTED
    assert fetch_status(service.address, token=TOKEN).job.name == "tiny"


def test_unknown_nodes_duplicates_and_the_path_to_a_plan(service: CoordinatorService) -> None:
    s = stub(service)
    assert code_of(lambda: s.Heartbeat(pb.HeartbeatRequest(node_id="ghost"), timeout=5)) == grpc.StatusCode.NOT_FOUND
    ids = [join(service, f"host{i}", 6000 + i).node_id for i in range(3)]
    assert join(service, "host0", 6000).node_id != ids[0]  # no id given: a new member
    dup = pb.JoinRequest(token=TOKEN, node_id=ids[0], profile=profile("elsewhere"), peer_address="127.0.0.1:7")
    assert code_of(lambda: s.Join(dup, timeout=5)) == grpc.StatusCode.ALREADY_EXISTS
    same = pb.JoinRequest(token=TOKEN, node_id=ids[0], profile=profile("host0"), peer_address="127.0.0.1:6000")
    assert s.Join(same, timeout=5).node_id == ids[0]
    everyone = [m.node_id for m in fetch_status(service.address, token=TOKEN).members]
    # (host0's two nodes then probe another machine at once, a heartbeat and a half after they are told: 12 s here)
    watch = s.WatchPlan(pb.WatchPlanRequest(node_id=ids[0]), timeout=45)
    for n in [*everyone, *everyone]:  # probe as asked, until nobody is asked anything (twice: host0's round comes
        for _ in range(5):           # once the lone probes are done)
            reply = s.Heartbeat(pb.HeartbeatRequest(node_id=n), timeout=5)
            if not reply.probe:
                break
            s.ReportProbes(pb.ProbeReport(node_id=n, links=[
                pb.LinkMeasurement(src=n, dst=t.node_id, bandwidth_bytes_per_s=1e9, rtt_seconds=1e-4, flows=t.flows)
                for t in reply.probe]), timeout=5)
    plan = next(watch)
    watch.cancel()
    assert plan.epoch >= 1 and plan.job_id == service.state.job.id
    status = fetch_status(service.address, token=TOKEN)
    assert status.plan.epoch == plan.epoch and len(status.islands) == 1
    text = format_status(status)
    assert "cpu0" in text and "1.00 GB/s" in text and f"plan epoch {plan.epoch}" in text
    assert '"islands"' in status_json(status)
    # (the gauges follow the loop round that published the plan, a moment after the watch has it: read again
    # until they do, for at most a few seconds)
    deadline = time.monotonic() + 5
    while True:
        metrics = urllib.request.urlopen(f"http://{service.metrics_address}/metrics", timeout=5).read().decode()
        if f"atoll_plan_epoch {float(plan.epoch)}" in metrics or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert f"atoll_plan_epoch {float(plan.epoch)}" in metrics
    assert 'atoll_members{state="alive"} 4.0' in metrics and "atoll_islands 1.0" in metrics
    assert "atoll_link_bandwidth_bytes_per_second{" in metrics


def test_an_unexpected_handler_failure_is_internal_and_not_fatal(service: CoordinatorService,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from atoll.coordinator import handlers

    def broken(request, state):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(handlers, "handle_leave", broken)
    err = None
    try:
        stub(service).Leave(pb.LeaveRequest(node_id="x"), timeout=5)
    except grpc.RpcError as e:
        err = e
    assert err is not None and err.code() == grpc.StatusCode.INTERNAL and "disk on fire" in err.details()
    assert fetch_status(service.address, token=TOKEN).job.name == "tiny"


def test_status_command_prints_a_table_and_json(service: CoordinatorService,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from atoll.launch.cli import main

    # this coordinator serves plaintext (tests/test_identity.py runs `atoll status` over mutual TLS)
    assert main(["status", "--coordinator", service.address, "--token", TOKEN, "--insecure"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("job tiny (") and "members:" in out and "islands:" in out
    assert main(["status", "--coordinator", service.address, "--token", TOKEN, "--json", "--insecure"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["job"]["name"] == "tiny"
    capsys.readouterr()
    assert main(["status", "--coordinator", service.address, "--token", "wrong", "--insecure"]) == 2
    assert "token" in capsys.readouterr().err


def test_a_join_records_the_host_its_connection_came_from(service: CoordinatorService) -> None:
    """What the coordinator compares when a node that advertises no peer address is joined again from elsewhere
    (handlers._refuse_a_copy_elsewhere): the join's connection host, read from the gRPC peer."""
    reply = stub(service).Join(pb.JoinRequest(token=TOKEN, profile=profile("no-listen"), session="s1"), timeout=5)
    assert service.state.process_of(reply.node_id).seen_from == "127.0.0.1"


def test_a_copy_refused_while_the_node_lives_is_told_when_to_try_again(service: CoordinatorService) -> None:
    """The refusal of a copy of a node's state dir on another address carries when its holder's lease lapses
    (`atoll.rpc.RETRY_AFTER_KEY`), which a node waits for before it tries once more; other refusals carry none."""
    from atoll.rpc import retry_after

    first = stub(service).Join(pb.JoinRequest(token=TOKEN, profile=profile("vm-copied"), session="one",
                                              peer_address="127.0.0.1:6201"), timeout=5)
    stub(service).Heartbeat(pb.HeartbeatRequest(node_id=first.node_id, session="one"), timeout=5)
    with pytest.raises(grpc.RpcError) as refused:
        stub(service).Join(pb.JoinRequest(token=TOKEN, node_id=first.node_id, profile=profile("vm-copied"),
                                          session="two", peer_address="127.0.0.2:6201"), timeout=5)
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    after = retry_after(refused.value)
    assert after is not None and 1.0 <= after <= 31.0, after  # the fixture's lease is 30 s
    with pytest.raises(grpc.RpcError) as bad:
        stub(service).Join(pb.JoinRequest(token=TOKEN, profile=profile(""), session="x"), timeout=5)
    assert retry_after(bad.value) is None
