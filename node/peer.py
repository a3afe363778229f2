"""The node's Peer gRPC server: Transfer (tensors from pipeline neighbours), Probe (link measurements),
FetchOuter (pseudo-gradients and outer state for the other replica groups) and Connect (reverse streams from
nodes that accept no connections; see `atoll.node.reverse`). A Transfer with the `atoll-relay-to` header is
forwarded over the named node's Connect stream (this node relays).

A node that accepts no connections (`listen=None`) has a `PeerServer` that serves nothing: its stage's
mailbox attaches there all the same, and tensors reach it over the Connect streams it opens.

The servicer is thin: it checks the job token and the call's deadline, hands the stream to a plain
function (`receive_probe`) or to the receiver the running stage attached (`attach`), and maps their
exceptions to status codes. The server starts before any plan exists, so Transfer answers UNAVAILABLE
(retry) until a stage attaches its receiver.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import grpc

from atoll.compression.wire import parse_chunk
from atoll.node.mailbox import InvalidTransfer, NotReady, ReceiverBusy, TransferReceiver, UnexpectedTransfer
from atoll.node.probe import ProbeError, ProbeResult, ProbeTooLarge, probe_peer, receive_probe
from atoll.node.replication import take_copy
from atoll.node.state_transfer import StateHolder, StateTransferError
from atoll.node.reverse import RELAY_METADATA_KEY, ReverseRegistry, TunnelError, relay_transfer
from atoll.node.peer_authz import Forbidden, PlanMembers, StateAccess, caller_id, check_dialer, check_sender
from atoll.plan import Plan
from atoll.rpc import RpcOptions, ServerHandle, make_server, peer_certificate, token_from_metadata, token_matches
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc

__all__ = ["PeerLimits", "PeerServer", "ProbeError", "ProbeResult", "probe_peer"]

log = logging.getLogger("atoll.node.peer")


@dataclass(frozen=True, kw_only=True)
class PeerLimits:
    """What the Peer server accepts from any caller, whatever the running stage expects."""

    max_probe_bytes: int = 512 * 1024 * 1024
    """Largest probe payload; a longer probe is cut off with RESOURCE_EXHAUSTED."""
    max_call: timedelta = timedelta(minutes=5)
    """Longest deadline a Transfer or Probe call may carry. Calls without a deadline are refused, so a
    silent caller cannot hold a server thread forever."""
    max_concurrent_calls: int = 16
    """Server threads; each open Transfer or Probe stream holds one."""

    def __post_init__(self) -> None:
        if self.max_probe_bytes < 0:
            raise ValueError(f"max_probe_bytes must be >= 0, got {self.max_probe_bytes}")
        if self.max_call <= timedelta(0):
            raise ValueError(f"max_call must be positive, got {self.max_call}")
        if self.max_concurrent_calls < 2:
            raise ValueError(f"max_concurrent_calls must be at least 2 (one per neighbour), "
                             f"got {self.max_concurrent_calls}")


class _PeerServicer(pb_grpc.PeerServicer):
    def __init__(self, owner: PeerServer):
        self._owner = owner

    def _admit(self, context: grpc.ServicerContext, method: str) -> float:
        """Check token (without TLS; with it, the certificate says who calls) and deadline; return the seconds the
        call has left."""
        expected = self._owner.token
        if (self._owner.rpc.mtls is None and expected is not None
                and not token_matches(token_from_metadata(context), expected)):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"{method}: missing or wrong job token; start the node with the job's --token")
        remaining = context.time_remaining()
        limit = self._owner.limits.max_call.total_seconds()
        if remaining is None or remaining > limit:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{method}: the call needs a deadline of at most {limit:.0f}s")
        return remaining

    def _caller(self, context: grpc.ServicerContext) -> str | None:
        """The calling node's id from its certificate (mutual TLS), None without TLS."""
        if self._owner.rpc.mtls is None:
            return None
        try:
            return caller_id(peer_certificate(context))
        except Forbidden as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))

    def _check_state(self, context: grpc.ServicerContext, check: str, request, remaining: float) -> None:
        """With mutual TLS, the `StateAccess` rule `check` for the caller's certificate (PERMISSION_DENIED)."""
        caller = self._caller(context)
        if caller is not None:
            try:
                getattr(self._owner.state_access, check)(caller, request, wait=min(3.0, 0.3 * remaining))
            except Forbidden as e:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))

    def Transfer(self, request_iterator, context):
        remaining = self._admit(context, "Transfer")
        relay_to = dict(context.invocation_metadata() or ()).get(RELAY_METADATA_KEY)
        if relay_to and relay_to != self._owner.node_id:
            caller = self._caller(context)
            if caller is not None:  # a relay forwards only tensors whose sender is the certificate's node
                request_iterator = check_sender(request_iterator, caller, None)
            try:
                return relay_transfer(self._owner.reverse, relay_to, request_iterator, remaining - min(0.5, 0.1 * remaining))
            except Forbidden as e:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
            except TunnelError as e:
                context.abort(e.code(), f"relay {self._owner.node_id}: {e.details()}")
            except grpc.RpcError:
                context.abort(grpc.StatusCode.CANCELLED, "Transfer: the caller went away mid-stream")
        receiver = self._owner.receiver
        if receiver is None:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"node {self._owner.node_id} runs no stage yet; retry once it has the plan")
        caller = self._caller(context)
        if caller is not None:  # the tensors' sender must be the certificate's node, and the plan's neighbour
            request_iterator = check_sender(request_iterator, caller, receiver)
        # waits inside end a little before the caller's deadline, so it hears why (busy) instead of a timeout
        wait = remaining - min(0.5, 0.1 * remaining)
        try:
            return receiver.receive(request_iterator, peer=context.peer(), deadline_seconds=wait)
        except Forbidden as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except InvalidTransfer as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except UnexpectedTransfer as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ReceiverBusy as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except NotReady as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except grpc.RpcError:
            # the caller cancelled or its deadline passed while we read; nobody is left to answer
            context.abort(grpc.StatusCode.CANCELLED, "Transfer: the caller went away mid-stream")

    def FetchOuter(self, request, context):
        remaining = self._admit(context, "FetchOuter")
        outbox = self._owner.outbox
        if outbox is None:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"node {self._owner.node_id} runs no outer sync yet; retry once it has the plan")
        caller = self._caller(context)
        if caller is not None:  # outer state goes to members of this node's recent plans, each asking as itself
            try:
                if request.sender != caller:
                    raise Forbidden(f"FetchOuter: the caller's certificate is node {caller}'s, but the request "
                                    f"names {request.sender[:80]!r}")
                self._owner.plan_members.check(caller, "FetchOuter")
            except Forbidden as e:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        try:
            frames = outbox.frames(request, wait=max(0.0, min(5.0, remaining - 1.0)))
        except KeyError as e:  # before LookupError, its base: never here (a wrong name, a round long gone)
            context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]) if e.args else "not found")
        except LookupError as e:  # not here yet: the caller retries
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        yield from frames

    def Connect(self, request_iterator, context):
        self._admit(context, "Connect")
        caller = self._caller(context)
        if caller is not None:  # a stream that relayed tensors reach is opened by that node only
            request_iterator = check_dialer(request_iterator, caller)
        try:
            yield from self._owner.reverse.serve(request_iterator, context.peer())
        except Forbidden as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def FetchState(self, request, context):
        remaining = self._admit(context, "FetchState")
        self._check_state(context, "check_fetch", request, remaining)
        holder = self._owner.state
        if holder is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"node {self._owner.node_id} serves no state yet; retry")
        try:
            chunks = holder.chunks(request)
        except KeyError as e:  # before LookupError, its base
            context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]) if e.args else "not found")
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        yield from chunks

    def HeldState(self, request, context):
        remaining = self._admit(context, "HeldState")
        self._check_state(context, "check_held", request, remaining)
        holder = self._owner.state
        if holder is None:
            return pb.HeldStateReply(holds=False, node_id=self._owner.node_id)
        try:
            return holder.held(request.plan_epoch, wait=max(0.0, remaining - min(1.0, 0.2 * remaining)))
        except LookupError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    def Replicate(self, request, context):
        remaining = self._admit(context, "Replicate")
        self._check_state(context, "check_replicate", request, remaining)
        holder = self._owner.state
        try:
            reply = take_copy(request, checkpoint_dir=holder.checkpoint_dir if holder is not None else None,
                              node_id=self._owner.node_id, token=self._owner.token, rpc=self._owner.rpc,
                              timeout=timedelta(seconds=max(1.0, remaining - 1.0)))
            if self._owner.copy_taken is not None:
                self._owner.copy_taken(request, reply)
            return reply
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except LookupError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (StateTransferError, OSError) as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"node {self._owner.node_id} could not take the copy: {e}")

    def Probe(self, request_iterator, context):
        self._admit(context, "Probe")
        try:
            return receive_probe(request_iterator, node_id=self._owner.node_id,
                                 max_bytes=self._owner.limits.max_probe_bytes)
        except ProbeTooLarge as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except grpc.RpcError:
            context.abort(grpc.StatusCode.CANCELLED, "Probe: the caller went away mid-stream")


def _add_peer_servicer(servicer: pb_grpc.PeerServicer, server: grpc.Server) -> None:
    """The generated `add_PeerServicer_to_server`, except that Transfer's chunks are read by `parse_chunk`,
    which hands their payload on without copying it."""
    handlers = {
        "Transfer": grpc.stream_unary_rpc_method_handler(
            servicer.Transfer, request_deserializer=parse_chunk,
            response_serializer=pb.TransferAck.SerializeToString),
        "Probe": grpc.stream_unary_rpc_method_handler(
            servicer.Probe, request_deserializer=pb.ProbeChunk.FromString,
            response_serializer=pb.ProbeReply.SerializeToString),
        # the outbox yields each chunk already in its wire form (`chunk_frames`)
        "FetchOuter": grpc.unary_stream_rpc_method_handler(
            servicer.FetchOuter, request_deserializer=pb.OuterFetchRequest.FromString, response_serializer=None),
        "Connect": grpc.stream_stream_rpc_method_handler(
            servicer.Connect, request_deserializer=pb.ConnectFrame.FromString,
            response_serializer=pb.ConnectFrame.SerializeToString),
        "FetchState": grpc.unary_stream_rpc_method_handler(
            servicer.FetchState, request_deserializer=pb.StateFetchRequest.FromString,
            response_serializer=pb.StateChunk.SerializeToString),
        "HeldState": grpc.unary_unary_rpc_method_handler(
            servicer.HeldState, request_deserializer=pb.HeldStateRequest.FromString,
            response_serializer=pb.HeldStateReply.SerializeToString),
        "Replicate": grpc.unary_unary_rpc_method_handler(
            servicer.Replicate, request_deserializer=pb.ReplicateRequest.FromString,
            response_serializer=pb.ReplicateReply.SerializeToString),
    }
    methods = set(pb.DESCRIPTOR.services_by_name["Peer"].methods_by_name)
    if methods != set(handlers):
        raise RuntimeError(f"the Peer service has methods {sorted(methods)}; handlers are registered for "
                           f"{sorted(handlers)}: update _add_peer_servicer")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("atoll.v1.Peer", handlers),))
    server.add_registered_method_handlers("atoll.v1.Peer", handlers)


class PeerServer:
    """A started Peer server. `address` is the real HOST:PORT (port 0 is resolved); "" when it does not
    listen (`listen=None`: the node accepts no connections)."""

    def __init__(self, *, node_id: str, listen: str | None, token: str | None, rpc: RpcOptions | None = None,
                 limits: PeerLimits = PeerLimits()):
        if not node_id:
            raise ValueError("node_id must not be empty")
        self.node_id = node_id
        self.token = token
        self.limits = limits
        self.rpc = rpc or RpcOptions()
        self._lock = threading.Lock()
        self._receiver: TransferReceiver | None = None
        self._outbox = None
        self.state: StateHolder | None = None
        """The stage state this node serves (FetchState, HeldState) and its checkpoint folder (Replicate)."""
        self.reverse = ReverseRegistry()
        """Connect streams open to this server (from nodes that accept no connections)."""
        self.plan_members = PlanMembers()
        """Members of the plans this node followed last (`note_plan`): who may fetch its outer state."""
        self.state_access = StateAccess()
        """Who may ask for its stage state or push it copies (`note_plan`; `grant` before each Replicate)."""
        self.copy_taken: Callable[[pb.ReplicateRequest, pb.ReplicateReply], None] | None = None
        """Called after each copy this node took (Replicate): the node reports it to the coordinator as its own, with
        the file's CRC-32, under its own certificate (the coordinator records it only as its writer's file)."""
        servicer = _PeerServicer(self)
        self._handle: ServerHandle | None = None
        if listen is None:
            log.info("node %s accepts no connections: its neighbours send over the streams it opens", node_id)
            return
        self._handle = make_server(
            listen, [lambda s: _add_peer_servicer(servicer, s)], self.rpc,
            max_workers=limits.max_concurrent_calls)
        log.info("peer server of %s listening on %s", node_id, self._handle.address)

    @property
    def listening(self) -> bool:
        return self._handle is not None

    @property
    def address(self) -> str:
        return self._handle.address if self._handle is not None else ""

    @property
    def port(self) -> int:
        return self._handle.port if self._handle is not None else 0

    @property
    def receiver(self) -> TransferReceiver | None:
        return self._receiver

    def note_plan(self, plan: Plan) -> None:
        """A plan this node follows: its members may fetch outer state here."""
        self.plan_members.note(plan)
        self.state_access.note(plan)

    def attach(self, receiver: TransferReceiver) -> None:
        """Route Transfer calls to `receiver` (the running stage's mailbox), replacing any earlier one."""
        with self._lock:
            self._receiver = receiver

    @property
    def outbox(self):
        """What FetchOuter serves (`atoll.node.outer.OuterOutbox`), or None."""
        return self._outbox

    def attach_outbox(self, outbox) -> None:
        with self._lock:
            self._outbox = outbox

    def detach_outbox(self, outbox=None) -> None:
        with self._lock:
            if outbox is None or self._outbox is outbox:
                self._outbox = None

    def detach(self, receiver: TransferReceiver | None = None) -> None:
        """Stop routing Transfer calls; with `receiver`, only if it is still the attached one."""
        with self._lock:
            if receiver is None or self._receiver is receiver:
                self._receiver = None

    def stop(self, grace: timedelta = timedelta(seconds=1)) -> None:
        """Stop serving: open calls get `grace` to finish, then are cancelled. Idempotent."""
        self.detach()
        self.detach_outbox()
        self.reverse.close()
        if self._handle is not None:
            self._handle.stop(grace)

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
