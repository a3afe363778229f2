"""A plan sent on every open watch is serialized once (`SerializeOnce`, which WatchPlan is registered with)."""

from __future__ import annotations

import grpc

from atoll.coordinator.watches import SerializeOnce, add_coordinator_to_server
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc


class _Counted:
    def __init__(self, data: bytes):
        self.data, self.calls = data, 0

    def SerializeToString(self) -> bytes:  # noqa: N802 - the protobuf name
        self.calls += 1
        return self.data


def test_the_same_message_is_serialized_once_and_a_new_one_again() -> None:
    once = SerializeOnce()
    first, second = _Counted(b"plan 1"), _Counted(b"plan 2")
    assert [once(first) for _ in range(1000)] == [b"plan 1"] * 1000
    assert first.calls == 1
    assert once(second) == b"plan 2" and once(second) == b"plan 2" and second.calls == 1
    assert once(first) == b"plan 1" and first.calls == 2  # only the last message is remembered


def test_watch_plan_is_registered_with_it_and_the_other_methods_as_generated() -> None:
    class Server:
        def __init__(self) -> None:
            self.registered: dict = {}

        def add_generic_rpc_handlers(self, handlers) -> None:
            pass

        def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
            self.registered[service] = handlers

    server = Server()
    add_coordinator_to_server(pb_grpc.CoordinatorServicer(), server)
    handlers = server.registered["atoll.v1.Coordinator"]
    assert isinstance(handlers["WatchPlan"].response_serializer, SerializeOnce)
    assert handlers["WatchPlan"].response_streaming and not handlers["WatchPlan"].request_streaming
    plan = pb.Plan(epoch=3)
    assert handlers["WatchPlan"].response_serializer(plan) == plan.SerializeToString()
    assert handlers["Heartbeat"].response_serializer == pb.HeartbeatReply.SerializeToString
    assert isinstance(handlers["Heartbeat"], grpc.RpcMethodHandler)
