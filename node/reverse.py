"""Reverse streams: how a node that accepts no connections (behind NAT or a firewall) still serves a stage.

Such a node opens a `Peer.Connect` stream to each neighbour that does accept connections (and to the relay
of each neighbour that does not). Over that stream the neighbour makes the calls it cannot dial: each is a
numbered call of `ConnectFrame`s (its request messages, the last marked `end`), answered by one frame (the
reply, or a status code and details). So both directions of tensors, and probes, flow over connections the
unreachable node opened:

- the unreachable node sends by dialing the neighbour's `Transfer` as usual;
- the neighbour sends through `ReverseLink.call("Transfer", ...)`, which the unreachable node's `ReverseDialer`
  feeds into its mailbox, as its own Peer server would have.

Where both ends accept no connections, both dial a relay (a node that does); the sender's Transfer carries the
`atoll-relay-to` header and the relay forwards it over the receiver's Connect stream (`relay_transfer`).

`ReverseRegistry` is the accepting side (one per Peer server); `ReverseDialer` the dialing side (one per
stage run of an unreachable node). Both never hold a call longer than its deadline.
"""

from __future__ import annotations

import itertools
import math
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError

from atoll.compression.wire import parse_chunk
from atoll.node.mailbox import InvalidTransfer, NotReady, ReceiverBusy, TransferReceiver, UnexpectedTransfer
from atoll.node.peer_authz import Forbidden, check_tunnelled
from atoll.node.probe import ProbeTooLarge, receive_probe
from atoll.plan import Plan
from atoll.rpc import RpcOptions, make_channel
from atoll.tls import node_dns_name
from atoll.v1 import atoll_pb2 as pb

if TYPE_CHECKING:
    from atoll.node.grpc_transport import PeerRef

log = logging.getLogger("atoll.node.reverse")

RELAY_METADATA_KEY = "atoll-relay-to"
"""Header of a Transfer call a relay should forward: the node id of the receiver."""
TUNNELLED = ("Transfer", "Probe")
"""The calls a Connect stream carries."""
RELAY_TARGET = "relay "
"""How a `ReverseDialer` target that is a relay is named (`relay HOST:PORT`); other targets are node ids."""


class TunnelError(grpc.RpcError):
    """A call over a Connect stream failed: the same questions as a failed gRPC call (`code`, `details`)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_CODES = {c.value[0]: c for c in grpc.StatusCode}


@dataclass
class _Pending:
    done: threading.Event
    reply: pb.ConnectFrame | None = None


class ReverseLink:
    """The accepting side of one Connect stream: calls to the node that opened it."""

    def __init__(self, node_id: str, peer: str):
        self.node_id, self.peer = node_id, peer
        self._out: queue.SimpleQueue[pb.ConnectFrame | None] = queue.SimpleQueue()
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.closed = threading.Event()

    def call(self, method: str, messages: Iterable[bytes], timeout: float) -> bytes:
        """One call over the stream: send `messages`, return the serialized reply; raises TunnelError."""
        if method not in TUNNELLED:
            raise ValueError(f"{method} is not carried over Connect streams; only {TUNNELLED}")
        deadline = time.monotonic() + timeout
        call = next(self._ids)
        pending = _Pending(threading.Event())
        with self._lock:
            if self.closed.is_set():
                raise TunnelError(grpc.StatusCode.UNAVAILABLE, f"the Connect stream from {self.node_id} closed; "
                                  f"retry once it reconnects")
            self._pending[call] = pending
        try:
            # every frame before the last carries exactly one request message (an empty one too)
            first = True
            try:
                for message in messages:
                    self._out.put(pb.ConnectFrame(call=call, method=method if first else "", message=bytes(message),
                                                  timeout_seconds=timeout if first else 0.0))
                    first = False
                    if self.closed.is_set():
                        break
            finally:  # also when the messages' source failed: the far side then refuses a cut stream at once
                self._out.put(pb.ConnectFrame(call=call, method=method if first else "", end=True,
                                              timeout_seconds=timeout if first else 0.0))
            if not pending.done.wait(max(0.0, deadline - time.monotonic())):
                raise TunnelError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"{method} to {self.node_id} over its Connect stream got no answer in {timeout:.1f}s")
        finally:
            with self._lock:
                self._pending.pop(call, None)
        reply = pending.reply
        if reply is None:
            raise TunnelError(grpc.StatusCode.UNAVAILABLE, f"the Connect stream from {self.node_id} closed during "
                              f"{method}; retry once it reconnects")
        if reply.code:
            raise TunnelError(_CODES.get(reply.code, grpc.StatusCode.UNKNOWN), reply.details)
        return reply.message

    def frames(self) -> Iterator[pb.ConnectFrame]:
        """The response stream of the Connect call: the frames of the calls made on this link."""
        while True:
            frame = self._out.get()
            if frame is None:
                return
            yield frame

    def answer(self, frame: pb.ConnectFrame) -> None:
        with self._lock:
            pending = self._pending.get(frame.call)
        if pending is not None:
            pending.reply = frame
            pending.done.set()

    def close(self) -> None:
        """Fail the calls in flight (UNAVAILABLE, so senders retry over the next stream) and end the stream."""
        with self._lock:
            self.closed.set()
            pending = list(self._pending.values())
        for p in pending:
            p.done.set()
        self._out.put(None)


class ReverseRegistry:
    """The Connect streams open to this node's Peer server, by the node id that opened them."""

    def __init__(self) -> None:
        self._links: dict[str, ReverseLink] = {}
        self._cond = threading.Condition()

    def serve(self, frames: Iterator[pb.ConnectFrame], peer: str) -> Iterator[pb.ConnectFrame]:
        """The body of the Connect RPC: register the stream under the dialer's id, read its answers on a
        thread, and yield the frames of the calls made on it until either side ends it."""
        try:
            hello = next(frames)
        except StopIteration:
            return
        if not hello.node_id or hello.call:
            raise ValueError("a Connect stream must begin with a frame naming the dialing node (node_id) and no call")
        link = ReverseLink(hello.node_id, peer)
        with self._cond:
            old = self._links.get(link.node_id)
            self._links[link.node_id] = link  # the newest stream takes new calls; an older one drains
            self._cond.notify_all()
        log.info("%s opened a Connect stream from %s%s", link.node_id, peer, " (replacing one)" if old else "")
        yield pb.ConnectFrame()  # call 0: tells the dialer the stream is registered

        def read() -> None:
            try:
                for frame in frames:
                    if frame.reply:
                        link.answer(frame)
            except grpc.RpcError:
                pass  # the dialer went away or the stream's deadline passed
            except Exception:  # noqa: BLE001 - a malformed frame ends this stream only
                log.exception("Connect stream from %s failed", link.node_id)
            finally:
                with self._cond:
                    if self._links.get(link.node_id) is link:
                        del self._links[link.node_id]
                link.close()

        threading.Thread(target=read, name=f"atoll-connect-{link.node_id}", daemon=True).start()
        yield from link.frames()

    def get(self, node_id: str) -> ReverseLink | None:
        with self._cond:
            return self._links.get(node_id)

    def wait(self, node_id: str, timeout: float) -> ReverseLink | None:
        """The open link from `node_id`, waiting up to `timeout` seconds for one."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while node_id not in self._links:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._links[node_id]

    def close(self) -> None:
        with self._cond:
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.close()

    def call(self, node_id: str, method: str, messages: Iterable[bytes], timeout: float) -> bytes:
        """A call to `node_id` over its Connect stream; UNAVAILABLE (retry) while it has none open."""
        link = self.get(node_id)
        if link is None:
            raise TunnelError(grpc.StatusCode.UNAVAILABLE,
                              f"{node_id} accepts no connections and has no Connect stream open to this node yet; "
                              f"retry once it has the plan (it dials its neighbours itself)")
        # frames carry their call number, so calls may overlap (one streams while another awaits its answer)
        return link.call(method, messages, timeout)


def chunk_to_bytes(chunk) -> bytes:
    """The wire form of a chunk as `parse_chunk` read it (a relay forwards what it received)."""
    if isinstance(chunk, pb.TensorChunk):
        return chunk.SerializeToString()
    out = pb.TensorChunk(data=bytes(chunk.data))
    if chunk.meta is not None:
        out.meta.CopyFrom(chunk.meta)
    return out.SerializeToString()


def relay_transfer(registry: ReverseRegistry, to: str, chunks: Iterator, timeout: float) -> pb.TransferAck:
    """Forward one Transfer call to `to` over its Connect stream to this (relaying) node."""
    reply = registry.call(to, "Transfer", (chunk_to_bytes(c) for c in chunks), timeout)
    try:
        return pb.TransferAck.FromString(reply)
    except DecodeError as e:
        raise TunnelError(grpc.StatusCode.INTERNAL, f"{to} answered the relayed Transfer with a message that is not "
                                                    f"a TransferAck ({e}); is it running the same atoll version?") from e


MAX_TUNNELLED_CALL_S = 300.0
"""Longest deadline a call over a Connect stream may carry (the Peer server's own `PeerLimits.max_call`)."""


def _bad_timeout(seconds: float) -> str | None:
    """Why a tunnelled call's deadline is refused (None: it is not; 0 means the default 60 s)."""
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_TUNNELLED_CALL_S:
        return f"the call needs a deadline of at most {MAX_TUNNELLED_CALL_S:.0f}s, got {seconds}"
    return None


def peer_ref(plan: Plan, peer: str, me: str, listening: bool, added_latency: timedelta = timedelta(0)) -> PeerRef:
    """How this node (`me`) reaches neighbour `peer` under `plan`: dial it, use the Connect stream it opened
    here (it accepts no connections, this node does), or go through the plan's relay (neither does)."""
    from atoll.node.grpc_transport import PeerRef

    address = plan.node_addresses.get(peer, "")
    if address:
        return PeerRef(node_id=peer, address=address, added_latency=added_latency)
    if listening:
        return PeerRef(node_id=peer, address="", route="reverse", added_latency=added_latency)
    via = plan.relay_of(me, peer)
    if via is None or not plan.node_addresses.get(via):
        raise ValueError(f"{peer} and this node ({me}) both accept no connections and plan epoch {plan.epoch} names no "
                         f"relay between them; a node that accepts connections must join to relay")
    return PeerRef(node_id=peer, address="", route="relay", relay=plan.node_addresses[via], relay_node=via,
                   added_latency=added_latency)


# --- the dialing side ---------------------------------------------------------------------------------

_STATUS = ((InvalidTransfer, grpc.StatusCode.INVALID_ARGUMENT), (UnexpectedTransfer, grpc.StatusCode.FAILED_PRECONDITION),
           (ReceiverBusy, grpc.StatusCode.RESOURCE_EXHAUSTED), (NotReady, grpc.StatusCode.UNAVAILABLE),
           (ProbeTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED), (TunnelError, grpc.StatusCode.CANCELLED),
           (Forbidden, grpc.StatusCode.PERMISSION_DENIED))


def serve_call(method: str, messages: Iterator[bytes], *, node_id: str, peer: str, timeout: float,
               receiver: TransferReceiver | None, max_probe_bytes: int,
               check: Callable[[Iterator, object], Iterator] | None = None) -> pb.ConnectFrame:
    """Run one tunnelled call on the dialing node and return its answer frame (call number left to set).
    `check(chunks, receiver)` vets a Transfer's chunks as they come (`peer_authz.check_tunnelled`)."""
    try:
        if method == "Transfer":
            if receiver is None:
                return pb.ConnectFrame(reply=True, code=grpc.StatusCode.UNAVAILABLE.value[0],
                                       details=f"node {node_id} runs no stage yet; retry once it has the plan")
            wait = timeout - min(0.5, 0.1 * timeout)
            chunks = (parse_chunk(m) for m in messages)
            if check is not None:
                chunks = check(chunks, receiver)
            ack = receiver.receive(chunks, peer=peer, deadline_seconds=wait)
            return pb.ConnectFrame(reply=True, message=ack.SerializeToString())
        if method == "Probe":
            reply = receive_probe((pb.ProbeChunk.FromString(m) for m in messages), node_id=node_id,
                                  max_bytes=max_probe_bytes)
            return pb.ConnectFrame(reply=True, message=reply.SerializeToString())
        return pb.ConnectFrame(reply=True, code=grpc.StatusCode.UNIMPLEMENTED.value[0],
                               details=f"{method!r} is not carried over Connect streams; only {TUNNELLED}")
    except Exception as e:  # noqa: BLE001 - every failure is answered with a status, as a server would
        for kind, code in _STATUS:
            if isinstance(e, kind):
                return pb.ConnectFrame(reply=True, code=code.value[0], details=str(e))
        log.exception("%s over a Connect stream failed", method)
        return pb.ConnectFrame(reply=True, code=grpc.StatusCode.INTERNAL.value[0],
                               details=f"{method} failed on {node_id}: {type(e).__name__}: {e}")


class _Incoming:
    """The request messages of one tunnelled call, as the worker running it reads them."""

    def __init__(self, deadline: float):
        self.queue: queue.SimpleQueue[bytes | None | BaseException] = queue.SimpleQueue()
        self.deadline = deadline

    def __iter__(self) -> Iterator[bytes]:
        while True:
            try:
                item = self.queue.get(timeout=max(0.0, self.deadline - time.monotonic()))
            except queue.Empty:
                raise TunnelError(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed mid-stream") from None
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


@dataclass(frozen=True, kw_only=True)
class DialerConfig:
    """How an unreachable node keeps its Connect streams open."""

    node_id: str
    """This node's id (the first frame of every stream)."""
    token: str | None
    """Job token of every stream."""
    rpc: RpcOptions
    """Channel settings."""
    stream_lifetime: timedelta = timedelta(seconds=200)
    """How long one stream is used before a fresh one takes new calls (every call needs a deadline; the old
    one stays open `drain` longer for the calls it carries)."""
    drain: timedelta = timedelta(seconds=90)
    """How long a replaced stream stays open for its calls in flight."""
    retry: tuple[timedelta, timedelta] = (timedelta(milliseconds=100), timedelta(seconds=2))
    """First and largest wait before reopening a stream that failed."""
    max_probe_bytes: int = 512 * 1024 * 1024
    """Largest probe accepted over a stream."""

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ValueError("DialerConfig.node_id must not be empty")
        if self.stream_lifetime <= timedelta(0) or self.drain <= timedelta(0):
            raise ValueError("stream_lifetime and drain must be positive")
        if not timedelta(0) < self.retry[0] <= self.retry[1]:
            raise ValueError(f"retry must be (first, largest) with 0 < first <= largest, got {self.retry}")


class ReverseDialer:
    """Keeps a Connect stream open to each of `targets` (node id -> HOST:PORT) and serves the calls made on
    them: Transfer into `receiver()` (the running stage's mailbox), Probe answered at once."""

    def __init__(self, config: DialerConfig, targets: dict[str, str], receiver: Callable[[], TransferReceiver | None],
                 names: dict[str, str] | None = None, senders: dict[str, frozenset[str]] | None = None):
        self.config, self.targets, self._receiver = config, dict(targets), receiver
        self._names = dict(names or {})
        """Node id whose certificate each target's server must hold, where it is not the target's own name (a
        relay's); a relay target without one is taken on any certificate of the job."""
        self._senders = dict(senders or {})
        """Who may send tensors over a neighbour's stream besides the neighbour itself: the nodes it relays to this
        node (a relay that is also a neighbour). Default: the neighbour alone."""
        self._closed = threading.Event()
        self._calls: set[grpc.Future] = set()
        self._lock = threading.Lock()
        self._why: dict[str, str] = {}  # the last failure of each target's stream
        self.connected: dict[str, threading.Event] = {t: threading.Event() for t in targets}
        """Set once a stream to the target is open (for tests and logs)."""
        self._threads = [threading.Thread(target=self._keep, args=(t, a), name=f"atoll-dial-{t}", daemon=True)
                         for t, a in targets.items()]
        for th in self._threads:
            th.start()

    def _keep(self, target: str, address: str) -> None:
        """Open streams to `target` one after another, each for `stream_lifetime`, until closed."""
        cfg = self.config
        # a neighbour dialled by id must hold its own certificate: the calls made over the stream are its
        name = self._names.get(target) or (None if target.startswith(RELAY_TARGET) else target)
        channel = make_channel(address, cfg.rpc, token=cfg.token, server_name=node_dns_name(name) if name else None)
        connect = channel.stream_stream("/atoll.v1.Peer/Connect", request_serializer=pb.ConnectFrame.SerializeToString,
                                        response_deserializer=pb.ConnectFrame.FromString)
        wait = cfg.retry[0].total_seconds()
        failures = 0
        try:
            while not self._closed.is_set():
                done = threading.Event()
                ok = threading.Thread(target=self._stream, args=(connect, target, address, done),
                                      name=f"atoll-dial-{target}-stream", daemon=True)
                started = time.monotonic()
                ok.start()
                # a healthy stream is replaced after its lifetime; a failed one is reopened after a backoff
                end = started + cfg.stream_lifetime.total_seconds()
                while not done.is_set() and not self._closed.is_set() and time.monotonic() < end:
                    done.wait(min(0.5, max(0.0, end - time.monotonic())))
                if self._closed.is_set():
                    return
                if done.is_set():
                    if time.monotonic() - started < 1.0:
                        failures += 1
                        if failures == 1 or failures % 50 == 0:
                            log.warning("cannot open a Connect stream to %s at %s (attempt %d: %s); retrying",
                                        target, address, failures, self._why.get(target, "it ended at once"))
                        self._closed.wait(wait)
                        wait = min(2 * wait, cfg.retry[1].total_seconds())
                        continue
                failures, wait = 0, cfg.retry[0].total_seconds()
        finally:
            channel.close()

    def _stream(self, connect, target: str, address: str, done: threading.Event) -> None:
        cfg = self.config
        out: queue.SimpleQueue[pb.ConnectFrame | None] = queue.SimpleQueue()
        out.put(pb.ConnectFrame(node_id=cfg.node_id))

        def requests() -> Iterator[pb.ConnectFrame]:
            while True:
                frame = out.get()
                if frame is None:
                    return
                yield frame

        calls: dict[int, _Incoming] = {}
        lifetime = (cfg.stream_lifetime + cfg.drain).total_seconds()
        stream = connect(requests(), timeout=lifetime)
        with self._lock:
            self._calls.add(stream)
        try:
            for frame in stream:
                if not frame.call:
                    if not self.connected[target].is_set():
                        log.info("Connect stream to %s (%s) open: it makes its calls to this node over it", target,
                                 address)
                    self.connected[target].set()
                    continue
                incoming = calls.get(frame.call)
                if incoming is None:
                    if not frame.method:
                        continue  # the rest of a call already answered (refused early)
                    why = _bad_timeout(frame.timeout_seconds)
                    if why is not None:  # answered at once; the rest of its frames are skipped as above
                        out.put(pb.ConnectFrame(call=frame.call, reply=True,
                                                code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                                details=f"{frame.method[:40]}: {why}"))
                        continue
                    incoming = calls[frame.call] = _Incoming(time.monotonic() + (frame.timeout_seconds or 60.0))
                    threading.Thread(target=self._serve, args=(frame, incoming, out, target), daemon=True,
                                     name=f"atoll-tunnel-{target}-{frame.call}").start()
                if not frame.end:
                    incoming.queue.put(frame.message)
                else:
                    incoming.queue.put(None)
                    del calls[frame.call]
        except grpc.RpcError as e:
            self._why[target] = f"{e.code().name}: {e.details()}"
            if not self._closed.is_set() and e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                                              grpc.StatusCode.CANCELLED):
                log.debug("Connect stream to %s ended: %s: %s", target, e.code().name, e.details())
        finally:
            gone = TunnelError(grpc.StatusCode.CANCELLED, f"the Connect stream to {target} closed mid-call")
            for incoming in calls.values():
                incoming.queue.put(gone)
            out.put(None)
            with self._lock:
                self._calls.discard(stream)
            done.set()

    def _serve(self, first: pb.ConnectFrame, incoming: _Incoming, out: queue.SimpleQueue, target: str) -> None:
        check = None
        if self.config.rpc.mtls is not None:  # the far end is `target` (its certificate), or a relay that vetted
            dialled = (None if target.startswith(RELAY_TARGET)  # the sender's certificate itself
                       else self._senders.get(target, frozenset((target,))))

            def check(chunks: Iterator, receiver: object) -> Iterator:
                return check_tunnelled(chunks, dialled, receiver)
        answer = serve_call(first.method, iter(incoming), node_id=self.config.node_id, peer=f"connect:{target}",
                            timeout=first.timeout_seconds or 60.0, receiver=self._receiver(),
                            max_probe_bytes=self.config.max_probe_bytes, check=check)
        answer.call = first.call
        out.put(answer)

    def wait_connected(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(e.wait(max(0.0, deadline - time.monotonic())) for e in self.connected.values())

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            calls = list(self._calls)
        for c in calls:
            c.cancel()
        for th in self._threads:
            th.join(timeout=2.0)
