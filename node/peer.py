"""The node's Peer gRPC server: Transfer (tensors from pipeline neighbours), Probe (link measurements) and
FetchOuter (pseudo-gradients and outer state for the other replica groups).

The servicer is thin: it checks the job token and the call's deadline, hands the stream to a plain
function (`receive_probe`) or to the receiver the running stage attached (`attach`), and maps their
exceptions to status codes. The server starts before any plan exists, so Transfer answers UNAVAILABLE
(retry) until a stage attaches its receiver.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import timedelta

import grpc

from atoll.compression.wire import parse_chunk
from atoll.node.mailbox import InvalidTransfer, NotReady, ReceiverBusy, TransferReceiver, UnexpectedTransfer
from atoll.node.probe import ProbeError, ProbeResult, ProbeTooLarge, probe_peer, receive_probe
from atoll.rpc import RpcOptions, ServerHandle, make_server, token_from_metadata, token_matches
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
        """Check token and deadline; return the seconds the call has left."""
        expected = self._owner.token
        if expected is not None and not token_matches(token_from_metadata(context), expected):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"{method}: missing or wrong job token; start the node with the job's --token")
        remaining = context.time_remaining()
        limit = self._owner.limits.max_call.total_seconds()
        if remaining is None or remaining > limit:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{method}: the call needs a deadline of at most {limit:.0f}s")
        return remaining

    def Transfer(self, request_iterator, context):
        remaining = self._admit(context, "Transfer")
        receiver = self._owner.receiver
        if receiver is None:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"node {self._owner.node_id} runs no stage yet; retry once it has the plan")
        # waits inside end a little before the caller's deadline, so it hears why (busy) instead of a timeout
        wait = remaining - min(0.5, 0.1 * remaining)
        try:
            return receiver.receive(request_iterator, peer=context.peer(), deadline_seconds=wait)
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
        try:
            frames = outbox.frames(request, wait=max(0.0, min(5.0, remaining - 1.0)))
        except KeyError as e:  # before LookupError, its base: never here (a wrong name, a round long gone)
            context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]) if e.args else "not found")
        except LookupError as e:  # not here yet: the caller retries
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        yield from frames

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
    }
    methods = set(pb.DESCRIPTOR.services_by_name["Peer"].methods_by_name)
    if methods != set(handlers):
        raise RuntimeError(f"the Peer service has methods {sorted(methods)}; handlers are registered for "
                           f"{sorted(handlers)}: update _add_peer_servicer")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("atoll.v1.Peer", handlers),))
    server.add_registered_method_handlers("atoll.v1.Peer", handlers)


class PeerServer:
    """A started Peer server. `address` is the real HOST:PORT (port 0 is resolved)."""

    def __init__(self, *, node_id: str, listen: str, token: str | None, rpc: RpcOptions | None = None,
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
        servicer = _PeerServicer(self)
        self._handle: ServerHandle = make_server(
            listen, [lambda s: _add_peer_servicer(servicer, s)], self.rpc,
            max_workers=limits.max_concurrent_calls)
        log.info("peer server of %s listening on %s", node_id, self._handle.address)

    @property
    def address(self) -> str:
        return self._handle.address

    @property
    def port(self) -> int:
        return self._handle.port

    @property
    def receiver(self) -> TransferReceiver | None:
        return self._receiver

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
        self._handle.stop(grace)

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
