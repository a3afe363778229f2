"""Fuzzing every RPC of both services (Coordinator and Peer) against real in-process servers: valid-shaped
messages with random field values, random bytes and truncated messages never crash a server, never hang a
call past its deadline, and are never answered INTERNAL or UNKNOWN. `python -m bench.fuzz` runs 10,000 cases
per service against servers in their own processes; this is the bounded form for CI."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from atoll.coordinator.service import CoordinatorService, ServiceConfig
from atoll.job import JobSpec
from atoll.node.peer import PeerServer
from atoll.v1 import atoll_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.fuzz import KNOWN_NODES, TOKEN, Case, call, case_strategy, methods  # noqa: E402
pytestmark = pytest.mark.timeout(120)
EXAMPLES = 120
"""Cases per service: about 10 s each on a loaded CI machine."""


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, tuple[object, grpc.Channel]]]:
    peer = PeerServer(node_id=KNOWN_NODES[0], listen="127.0.0.1:0", token=TOKEN)
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    coordinator = CoordinatorService(job=job, token=TOKEN, config=ServiceConfig(listen="127.0.0.1:0")).start()
    channels = {"Coordinator": grpc.insecure_channel(coordinator.address),
                "Peer": grpc.insecure_channel(peer.address)}
    join = channels["Coordinator"].unary_unary("/atoll.v1.Coordinator/Join",
                                               request_serializer=pb.JoinRequest.SerializeToString,
                                               response_deserializer=pb.JoinReply.FromString)
    for i, n in enumerate(KNOWN_NODES):  # members, so calls naming them reach past the membership check
        join(pb.JoinRequest(token=TOKEN, node_id=n, peer_address=peer.address, profile=pb.NodeProfile(
            hostname=f"h{i}", device_kind="cpu", device_name="cpu", device_count=1, memory_total_bytes=1 << 30,
            cpu_count=1)), timeout=30, metadata=(("authorization", f"Bearer {TOKEN}"),))
    yield {"Coordinator": (coordinator, channels["Coordinator"]), "Peer": (peer, channels["Peer"])}
    for ch in channels.values():
        ch.close()
    coordinator.stop()
    peer.stop()


def _alive(service: str, channel: grpc.Channel) -> bool:
    probe = (Case("/atoll.v1.Coordinator/GetStatus", (pb.StatusRequest().SerializeToString(),), True)
             if service == "Coordinator" else
             Case("/atoll.v1.Peer/HeldState", (pb.HeldStateRequest().SerializeToString(),), True))
    return call(channel, probe).code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL", "UNKNOWN")


@pytest.mark.parametrize("service", ["Coordinator", "Peer"])
def test_every_rpc_answers_garbage_with_invalid_argument(servers, service: str) -> None:
    """A request that does not parse is refused by the server factory's guard, before the token check (a request
    stream may be refused before its first message is read: then the refusal stands)."""
    _, channel = servers[service]
    garbage = b"\xff\xff\xff\xff\x0f\x08"  # a varint longer than ten bytes: no message parses it
    for m in methods(service):
        path = f"/atoll.v1.{service}/{m.name}"
        for token in (True, False):
            out = call(channel, Case(path, (garbage,), token))
            if m.client_streaming:
                assert out.code not in ("OK", "INTERNAL", "UNKNOWN") and not out.hang, (path, token, out)
            else:
                assert out.code == "INVALID_ARGUMENT", (path, token, out)


@pytest.mark.parametrize("service", ["Coordinator", "Peer"])
def test_fuzzed_requests_never_crash_hang_or_fail_internally(servers, service: str) -> None:
    _, channel = servers[service]
    seen: set[str] = set()

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(case=case_strategy(service))
    def one(case: Case) -> None:
        seen.add(case.method)
        out = call(channel, case)
        assert not out.hang, f"{case.method} ran into its deadline ({out.seconds:.1f}s): {case}"
        assert not out.wrong, f"{case.method} answered {out.code}: {case}"

    one()
    assert len(seen) >= len(methods(service)) // 2  # the cases spread over the service's methods
    assert _alive(service, channel)


def test_integers_beyond_int64_are_refused_before_they_reach_the_store(servers) -> None:
    """uint64 fields >= 2^63 would overflow SQLite's int64 (an OverflowError where they are stored): refused."""
    from atoll.rpcguard import out_of_range

    _, channel = servers["Coordinator"]
    for request, method in [(pb.HeartbeatRequest(node_id=KNOWN_NODES[0], plan_epoch=2**63), "Heartbeat"),
                            (pb.HeartbeatRequest(node_id=KNOWN_NODES[0], step=2**64 - 1), "Heartbeat"),
                            (pb.CheckpointReport(node_id=KNOWN_NODES[0], plan_epoch=1, step=2**63, layer_end=1),
                             "ReportCheckpoint")]:
        out = call(channel, Case(f"/atoll.v1.Coordinator/{method}", (request.SerializeToString(),), True))
        assert out.code == "INVALID_ARGUMENT", (request, out)
    ok = pb.HeartbeatRequest(node_id=KNOWN_NODES[0], plan_epoch=2**63 - 1)
    assert out_of_range(ok) is None
    nested = pb.StepMetrics(node_id="a", links=[pb.LinkStats(peer="b"), pb.LinkStats(peer="c", bytes_raw=2**63)])
    assert out_of_range(nested) == f"links[1].bytes_raw = {2**63}"
