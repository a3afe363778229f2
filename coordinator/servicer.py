"""The Coordinator gRPC servicer: checks the job token, calls a handler, maps domain errors to status codes.

This is the only place where coordinator errors become gRPC status codes. An unexpected exception is
logged with its traceback and answered INTERNAL, so a bad request never takes the coordinator down.
The servicer runs on a `grpc.aio` server: the unary methods are plain functions on its thread pool, and
WatchPlan is a coroutine on its event loop, so an open watch holds no thread.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import NoReturn, TypeVar

import grpc

from atoll.coordinator import handlers
from atoll.coordinator.errors import (AlreadyExists, CoordinatorError, FailedPrecondition, InvalidArgument, NotFound,
                                      Unauthenticated, Unavailable)
from atoll.coordinator.state import CoordinatorState
from atoll.coordinator.watches import PlanWatches, TooManyWatches, WatchReplaced
from atoll.rpc import token_from_metadata
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc

log = logging.getLogger("atoll.coordinator.rpc")

STATUS_CODES: dict[type[CoordinatorError], grpc.StatusCode] = {
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    TooManyWatches: grpc.StatusCode.RESOURCE_EXHAUSTED,
    WatchReplaced: grpc.StatusCode.ABORTED,
}

Req = TypeVar("Req")
Rep = TypeVar("Rep")


def _status(method: str, e: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(e, CoordinatorError):
        code = STATUS_CODES.get(type(e), grpc.StatusCode.INVALID_ARGUMENT)
        log.debug("%s refused (%s): %s", method, code.name, e)
        return code, str(e)
    log.exception("%s failed", method)
    return grpc.StatusCode.INTERNAL, f"{method}: the coordinator failed ({type(e).__name__}: {e}); see its log"


def _abort(context: grpc.ServicerContext, method: str, e: Exception) -> NoReturn:
    context.abort(*_status(method, e))


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, state: CoordinatorState, watches: PlanWatches):
        self.state = state
        self.watches = watches

    def _unary(self, method: str, handler: Callable[[Req, CoordinatorState], Rep], request: Req,
               context: grpc.ServicerContext) -> Rep:
        try:
            if self.state.closed:
                raise Unavailable("the coordinator is shutting down; retry shortly")
            handlers.check_token(token_from_metadata(context), self.state)
            return handler(request, self.state)
        except Exception as e:  # noqa: BLE001 - every failure becomes a status, never a crash
            _abort(context, method, e)

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        return self._unary("Join", handlers.handle_join, request, context)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        return self._unary("Heartbeat", handlers.handle_heartbeat, request, context)

    def ReportProbes(self, request: pb.ProbeReport, context: grpc.ServicerContext) -> pb.Ack:
        return self._unary("ReportProbes", handlers.handle_report_probes, request, context)

    def ReportStep(self, request: pb.StepMetrics, context: grpc.ServicerContext) -> pb.StepAck:
        return self._unary("ReportStep", handlers.handle_report_step, request, context)

    def ReportCheckpoint(self, request: pb.CheckpointReport, context: grpc.ServicerContext) -> pb.Ack:
        return self._unary("ReportCheckpoint", handlers.handle_report_checkpoint, request, context)

    def ReportFailure(self, request: pb.RunFailure, context: grpc.ServicerContext) -> pb.Ack:
        return self._unary("ReportFailure", handlers.handle_report_failure, request, context)

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.Ack:
        return self._unary("Leave", handlers.handle_leave, request, context)

    def OuterSync(self, request: pb.OuterSyncRequest, context: grpc.ServicerContext) -> pb.OuterSyncReply:
        return self._unary("OuterSync", handlers.handle_outer_sync, request, context)

    def GetStatus(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        return self._unary("GetStatus", handlers.handle_status, request, context)

    async def WatchPlan(self, request: pb.WatchPlanRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.Plan]:
        try:
            if self.state.closed:
                raise Unavailable("the coordinator is shutting down; retry shortly")
            handlers.check_token(token_from_metadata(context), self.state)
            async with aclosing(self.watches.watch(request)) as plans:
                async for plan in plans:
                    yield plan
        except Exception as e:  # noqa: BLE001
            await context.abort(*_status("WatchPlan", e))
