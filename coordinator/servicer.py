"""The Coordinator gRPC servicer: checks the job token, calls a handler, maps domain errors to status codes.

This is the only place where coordinator errors become gRPC status codes. An unexpected exception is
logged with its traceback and answered INTERNAL, so a bad request never takes the coordinator down.
The servicer runs on a `grpc.aio` server: the unary methods are plain functions on its thread pool, and
WatchPlan is a coroutine on its event loop, so an open watch holds no thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import NoReturn, TypeVar

import grpc

from atoll.coordinator import authz, handlers
from atoll.coordinator.ca import PLAINTEXT, Caller, JobAuthority
from atoll.coordinator.errors import (AlreadyExists, CoordinatorError, FailedPrecondition, InvalidArgument, NotFound,
                                      RateLimited, Unauthenticated, Unavailable)
from atoll.coordinator.state import CoordinatorState
from atoll.coordinator.validation import MAX_JOIN_BYTES, check_address
from atoll.coordinator.watches import PlanWatches, TooManyWatches, WatchReplaced
from atoll.coordinator.heartbeats import HeartbeatStreams, StreamReplaced, TooManyHeartbeatStreams
from atoll.coordinator.dialback import dial_back
from atoll.rpc import RETRY_AFTER_KEY, peer_certificate, peer_host, token_from_metadata, token_matches
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
    RateLimited: grpc.StatusCode.RESOURCE_EXHAUSTED,
    TooManyWatches: grpc.StatusCode.RESOURCE_EXHAUSTED,
    TooManyHeartbeatStreams: grpc.StatusCode.RESOURCE_EXHAUSTED,
    StreamReplaced: grpc.StatusCode.ABORTED,
    WatchReplaced: grpc.StatusCode.ABORTED,
    authz.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
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
    after = getattr(e, "retry_after_s", None)
    if after is not None:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, f"{after:.1f}"),))
    context.abort(*_status(method, e))



def _dialable(address: str) -> bool:
    """Whether `address` passes the join's own address check (HOST:PORT, a port in range, not a wildcard)."""
    try:
        check_address("peer_address", address)
    except InvalidArgument:
        return False
    return True

class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, state: CoordinatorState, watches: PlanWatches, authority: JobAuthority | None = None,
                 heartbeats: HeartbeatStreams | None = None):
        self.state = state
        self.watches = watches
        self.heartbeats = heartbeats or HeartbeatStreams(state, max_streams=watches.max_watches,
                                                         max_life=watches.max_life)
        self.authority = authority
        """The job CA when the server runs mutual TLS (callers are told apart by certificate); None: plaintext."""
        self._plans = authz.PlanLookup()
        self._join_lock = threading.Lock()

    def _caller(self, context: grpc.ServicerContext) -> Caller:
        return PLAINTEXT if self.authority is None else self.authority.caller(peer_certificate(context))

    def _unary(self, method: str, handler: Callable[[Req, CoordinatorState], Rep], request: Req,
               context: grpc.ServicerContext) -> Rep:
        try:
            return self._call(method, handler, request, context)
        except Exception as e:  # noqa: BLE001 - every failure becomes a status, never a crash
            _abort(context, method, e)

    def _call(self, method: str, handler: Callable[[Req, CoordinatorState], Rep], request: Req,
              context: grpc.ServicerContext) -> Rep:
        """Check the caller and run the handler; domain errors propagate (`_unary` maps them)."""
        if self.state.closed:
            raise Unavailable("the coordinator is shutting down; retry shortly")
        handlers.check_token(token_from_metadata(context), self.state)
        caller = self._caller(context)
        if method == "Join":
            with self._join_lock:  # from the key check to the certificate: two keys cannot both pass for one id
                authz.authorize(method, request, caller, self.state, self.authority, self._plans)
                return authz.issue_certificate(request, handler(request, self.state), self.authority)
        authz.authorize(method, request, caller, self.state, self.authority, self._plans)
        return handler(request, self.state)

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        # dial the node back before the join lock (it may wait seconds), and only for a caller with the token and a
        # well-formed address (a malformed one is answered INVALID_ARGUMENT by handle_join, undialled)
        why: str | None = None
        if request.peer_address and self.state.options.dial_back and _dialable(request.peer_address) and \
                request.ByteSize() <= MAX_JOIN_BYTES and \
                token_matches(token_from_metadata(context), self.state.token):
            why = dial_back(request.peer_address)
        seen_from = peer_host(context.peer())
        return self._unary("Join", lambda req, st: handlers.handle_join(req, st, dial_back=lambda _: why,
                                                                         seen_from=seen_from),
                           request, context)

    def JoinChallenge(self, request: pb.JoinChallengeRequest,
                      context: grpc.ServicerContext) -> pb.JoinChallengeReply:
        return self._unary("JoinChallenge", handlers.handle_join_challenge, request, context)

    def ControlJob(self, request: pb.JobControlRequest, context: grpc.ServicerContext) -> pb.JobControlReply:
        return self._unary("ControlJob", handlers.handle_control_job, request, context)

    async def Heartbeat(self, request: pb.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> pb.HeartbeatReply:
        # on the event loop, not a pool thread: a heartbeat only reads and renews memory (no disk, no lock held
        # for long), and at thousands of nodes the hop to a thread and back cost more than the heartbeat itself
        try:
            return self._call("Heartbeat", handlers.handle_heartbeat, request, context)
        except Exception as e:  # noqa: BLE001 - every failure becomes a status, never a crash
            await context.abort(*_status("Heartbeat", e))

    async def HeartbeatStream(self, requests: AsyncIterator[pb.HeartbeatRequest],
                              context: grpc.aio.ServicerContext) -> AsyncIterator[pb.HeartbeatReply]:
        # the token and the caller's certificate are read once, at the stream's start; each heartbeat is then
        # checked to speak for the stream's node (its first message's, which the certificate must name), and the
        # stream's token against the job's (a comparison: a token changed since still refuses the next beat)
        try:
            if self.state.closed:
                raise Unavailable("the coordinator is shutting down; retry shortly")
            token = token_from_metadata(context)
            handlers.check_token(token, self.state)
            caller = self._caller(context)

            def check(req: pb.HeartbeatRequest) -> None:
                authz.authorize("Heartbeat", req, caller, self.state, self.authority)

            async with aclosing(self.heartbeats.serve(requests, check, lambda: handlers.check_token(token, self.state),
                                                      seen_from=peer_host(context.peer()))) as replies:
                async for reply in replies:
                    yield reply
        except grpc.aio.AbortError:  # a request that did not parse, answered INVALID_ARGUMENT by the decode guard
            raise
        except Exception as e:  # noqa: BLE001
            await context.abort(*_status("HeartbeatStream", e))

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
        async for plan in self._watch("WatchPlan", request, context, packed=False):
            yield plan

    async def WatchPlanPacked(self, request: pb.WatchPlanRequest,
                              context: grpc.aio.ServicerContext) -> AsyncIterator[pb.PackedPlan]:
        async for plan in self._watch("WatchPlanPacked", request, context, packed=True):
            yield plan

    async def _watch(self, method: str, request: pb.WatchPlanRequest, context: grpc.aio.ServicerContext, *,
                     packed: bool) -> AsyncIterator[pb.Plan | pb.PackedPlan]:
        try:
            if self.state.closed:
                raise Unavailable("the coordinator is shutting down; retry shortly")
            handlers.check_token(token_from_metadata(context), self.state)
            authz.authorize("WatchPlan", request, self._caller(context), self.state, self.authority)
            async with aclosing(self.watches.watch(request, packed=packed)) as plans:
                async for plan in plans:
                    yield plan
        except Exception as e:  # noqa: BLE001
            await context.abort(*_status(method, e))
