"""The pipeline `Transport` over gRPC: one stage replica's links to its upstream and downstream peers.

Sending: `send` queues the tensor on the link towards its receiver and returns; the link's sender
thread picks a codec (the job's fixed one, or the link policy's choice from the measured bandwidth),
encodes, streams the chunks in one Transfer call with a deadline, and feeds the measured transfer
back to the policy. Queued and in-flight tensors are bounded in bytes: `send` blocks (up to
`send_timeout`) when the link is full. Transient failures (peer unreachable, busy, not started yet)
are retried with exponential backoff until `delivery_timeout`; a refusal (bad shape, old epoch, ...) is
final and raised by the next `send`, `flush` or `recv` of that link.

Receiving: a `Mailbox` attached to the node's `PeerServer` validates and buffers what the neighbours
send; `recv` waits on it.

The caller must not modify a tensor in place after `send` until `flush` (as with isend).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import grpc
import torch

from atoll.compression import CodecSpec, LinkPolicy, PolicyConfig, tensor_to_chunks
from atoll.node.mailbox import Mailbox, MailboxClosed, ReceiveSpec
from atoll.node.peer import PeerServer
from atoll.node.transport import Direction, TensorKey, Transport, TransportError
from atoll.rpc import RpcOptions, make_channel
from atoll.serde import DIRECTION_BY_NAME
from atoll.types import LinkStats
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc

log = logging.getLogger("atoll.node.grpc_transport")

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED,
                       grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})
"""Status codes of failures that may pass: a restarting, busy or slow peer. Others are final."""


@dataclass(frozen=True, kw_only=True)
class PeerRef:
    """A neighbour: its node id and the address of its Peer server."""

    node_id: str
    address: str

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ValueError("PeerRef.node_id must not be empty")
        if ":" not in self.address:
            raise ValueError(f"PeerRef.address must be HOST:PORT, got {self.address!r}")


@dataclass(frozen=True, kw_only=True)
class GrpcTransportConfig:
    """One stage replica's place in the plan and how its links behave."""

    job_id: str
    """Job id every tensor carries."""
    node_id: str
    """This node's id (the sender of every tensor)."""
    plan_epoch: int
    """Plan epoch; tensors of any other epoch are refused."""
    pipeline: int = 0
    """Pipeline index in the plan."""
    stage: int
    """Stage index in the pipeline."""
    replica: int = 0
    """Data-parallel rank of this node within its stage."""
    upstream: PeerRef | None
    """The previous stage's replica this one exchanges with; None on the first stage."""
    downstream: PeerRef | None
    """The next stage's replica; None on the last stage."""
    shape: tuple[int, ...] | None
    """Shape of the activations (and gradients) crossing the stage boundaries; None: not checked."""
    dtype: torch.dtype = torch.float32
    """Dtype of activations and gradients."""
    micro_batches: int | None = None
    """Micro-batches per step, to refuse out-of-range indices; None: not checked."""
    token: str | None = None
    """Job token sent with every call."""
    rpc: RpcOptions = field(default_factory=RpcOptions)
    """Channel settings (message size, keepalive, TLS)."""
    forward_codec: CodecSpec | None = None
    """Codec of activations sent downstream; None lets the link policy choose per tensor."""
    backward_codec: CodecSpec | None = None
    """Codec of gradients sent upstream; None lets the link policy choose per tensor."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """Link policy settings, used for directions without a fixed codec."""
    initial_bandwidth_bytes_per_s: float | None = None
    """Link bandwidth (from the probe or the plan) until transfers measure it; None: no estimate, so the
    policy starts with the least lossy codec."""
    latency: timedelta = timedelta(0)
    """One-way latency of the links (from the probe), for the policy's predictions."""
    overlap: timedelta | None = None
    """Compute time a transfer should hide under (the stage's time per micro-batch, from the plan): the
    policy picks the least lossy codec that fits in it. Required when a direction has no fixed codec."""
    chunk_bytes: int = 1024 * 1024
    """Payload bytes per chunk message."""
    parallel_calls: int = 2
    """Tensors a link works on at once. One streams its chunks at a time (so transfers measure the link);
    the others encode, or wait for the receiver to check and decode what they sent."""
    max_in_flight_bytes: int = 256 * 1024 * 1024
    """Raw bytes queued or being sent per link before `send` blocks."""
    call_timeout: timedelta = timedelta(seconds=60)
    """Deadline of one Transfer call (one tensor)."""
    send_timeout: timedelta = timedelta(seconds=120)
    """How long `send` may wait for room on a full link before failing."""
    delivery_timeout: timedelta = timedelta(seconds=120)
    """How long one tensor may be retried (peer unreachable, busy, not started) before the link fails."""
    retry_initial: timedelta = timedelta(milliseconds=50)
    """First backoff after a transient failure; doubled after each further one."""
    retry_max: timedelta = timedelta(seconds=2)
    """Longest backoff between retries."""
    step_window: int = 2
    """Steps a neighbour may run ahead of this stage."""
    max_tensor_bytes: int = 256 * 1024 * 1024
    """Largest tensor accepted from a neighbour (decoded, and on the wire)."""
    max_buffered_bytes: int = 1024 * 1024 * 1024
    """Bytes the mailbox may hold (waiting tensors and tensors being received)."""

    def __post_init__(self) -> None:
        if self.upstream is None and self.downstream is None:
            raise ValueError("a transport needs an upstream or a downstream peer; a one-stage pipeline needs none")
        if self.stage < 0 or self.pipeline < 0 or self.replica < 0 or self.plan_epoch < 0:
            raise ValueError("stage, pipeline, replica and plan_epoch must be >= 0")
        if (self.stage == 0) != (self.upstream is None):
            raise ValueError(f"stage {self.stage}: only stage 0 has no upstream peer")
        if self.chunk_bytes < 1024 or self.chunk_bytes > self.rpc.max_message_bytes - 4096:
            raise ValueError(f"chunk_bytes must be in [1024, rpc.max_message_bytes - 4096 = "
                             f"{self.rpc.max_message_bytes - 4096}], got {self.chunk_bytes}")
        if (self.forward_codec is None or self.backward_codec is None) and self.overlap is None:
            raise ValueError("a direction without a fixed codec is chosen by the link policy, which needs `overlap` "
                             "(the stage's compute time per micro-batch); set it, or fix forward_codec and "
                             "backward_codec")
        if self.overlap is not None and self.overlap < timedelta(0):
            raise ValueError(f"overlap must be >= 0, got {self.overlap}")
        if self.parallel_calls < 1:
            raise ValueError(f"parallel_calls must be at least 1, got {self.parallel_calls}")
        if self.max_in_flight_bytes < 1:
            raise ValueError(f"max_in_flight_bytes must be positive, got {self.max_in_flight_bytes}")
        if self.initial_bandwidth_bytes_per_s is not None and self.initial_bandwidth_bytes_per_s <= 0:
            raise ValueError(f"initial_bandwidth_bytes_per_s must be positive or None, "
                             f"got {self.initial_bandwidth_bytes_per_s}")
        for name in ("call_timeout", "send_timeout", "delivery_timeout", "retry_initial", "retry_max"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def receive_spec(self) -> ReceiveSpec:
        return ReceiveSpec(
            job_id=self.job_id, plan_epoch=self.plan_epoch, pipeline=self.pipeline, stage=self.stage,
            upstream=self.upstream.node_id if self.upstream else None,
            downstream=self.downstream.node_id if self.downstream else None,
            shape=self.shape, dtype=self.dtype, micro_batches=self.micro_batches, step_window=self.step_window,
            max_tensor_bytes=self.max_tensor_bytes, max_buffered_bytes=self.max_buffered_bytes)


@dataclass
class _Outgoing:
    key: TensorKey
    tensor: torch.Tensor
    raw_bytes: int


@dataclass
class _Totals:
    bytes_raw: int = 0
    bytes_wire: int = 0
    seconds: float = 0.0
    codec: str = "identity"


class _Turn:
    """A held lock released once, from whichever thread gets there first (gRPC's or the sender's)."""

    def __init__(self, lock: threading.Lock):
        self._lock, self._guard, self._held = lock, threading.Lock(), True

    def release(self) -> None:
        with self._guard:
            if self._held:
                self._held = False
                self._lock.release()


class _Link:
    """Sends to one neighbour: a channel, a bounded queue, a sender thread and the link's policy."""

    def __init__(self, cfg: GrpcTransportConfig, peer: PeerRef, direction: Direction):
        self.cfg, self.peer, self.direction = cfg, peer, direction
        self.fixed = cfg.forward_codec if direction == "forward" else cfg.backward_codec
        self.policy = LinkPolicy(cfg.policy, initial_bandwidth_bytes_per_s=cfg.initial_bandwidth_bytes_per_s,
                                 latency_s=cfg.latency.total_seconds())
        self.channel = make_channel(peer.address, cfg.rpc, token=cfg.token)
        self.stub = pb_grpc.PeerStub(self.channel)
        self.queue: queue.SimpleQueue[_Outgoing | None] = queue.SimpleQueue()
        self.cond = threading.Condition()
        self.in_flight = 0  # raw bytes queued or being sent
        self.error: TransportError | None = None
        self.closing = threading.Event()
        self.calls: set[grpc.Future] = set()
        self.totals = _Totals()
        self.policy_lock = threading.Lock()  # LinkPolicy is not thread-safe
        self.wire = threading.Lock()  # held by the tensor whose chunks are streaming
        self.last_ack = 0.0
        self.threads = [threading.Thread(target=self._run, name=f"atoll-send-{direction}-{peer.node_id}-{i}",
                                         daemon=True) for i in range(cfg.parallel_calls)]
        for th in self.threads:
            th.start()

    # --- caller side ---

    def enqueue(self, key: TensorKey, tensor: torch.Tensor) -> None:
        self.raise_error()
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu", non_blocking=False)
        item = _Outgoing(key=key, tensor=tensor, raw_bytes=tensor.numel() * tensor.element_size())
        limit, deadline = self.cfg.max_in_flight_bytes, time.monotonic() + self.cfg.send_timeout.total_seconds()
        with self.cond:
            # a tensor larger than the limit is let through alone, so it cannot wait forever
            while self.in_flight and self.in_flight + item.raw_bytes > limit and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0 or self.closing.is_set():
                    raise TransportError(
                        f"{key}: the link to {self.peer.node_id} stayed full ({self.in_flight} of {limit} bytes "
                        f"in flight) for {self.cfg.send_timeout.total_seconds():.0f}s; the peer is not keeping up")
                self.cond.wait(left)
            self.raise_error()
            self.in_flight += item.raw_bytes
        self.queue.put(item)

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def flush(self, deadline: float) -> None:
        with self.cond:
            while self.in_flight and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportError(f"{self.in_flight} bytes to {self.peer.node_id} were still in flight "
                                         f"when the flush timed out")
                self.cond.wait(left)
        self.raise_error()

    def take_stats(self) -> LinkStats:
        with self.cond:
            t, self.totals = self.totals, _Totals(codec=self.totals.codec)
        return LinkStats(peer=self.peer.node_id, direction=self.direction, bytes_raw=t.bytes_raw,
                         bytes_wire=t.bytes_wire, seconds=t.seconds, codec=t.codec,
                         bandwidth_bytes_per_s=self.policy.bandwidth or 0.0)

    def close(self, timeout: float) -> None:
        self.closing.set()
        for _ in self.threads:
            self.queue.put(None)
        with self.cond:
            calls = list(self.calls)
            self.cond.notify_all()
        for call in calls:
            call.cancel()
        deadline = time.monotonic() + timeout
        for th in self.threads:
            th.join(max(0.0, deadline - time.monotonic()))
        self.channel.close()

    # --- sender thread ---

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None or self.closing.is_set():
                return
            try:
                if self.error is None:
                    self._send(item)
            except TransportError as e:
                if not self.closing.is_set():
                    log.error("%s", e)
                with self.cond:
                    self.error = self.error or e
            except Exception as e:  # an encoder bug must fail the step, not kill the thread silently
                log.exception("sending %s to %s failed", item.key, self.peer.node_id)
                with self.cond:
                    self.error = self.error or TransportError(f"{item.key}: sending to {self.peer.node_id} "
                                                              f"failed: {type(e).__name__}: {e}")
            finally:
                with self.cond:
                    self.in_flight -= item.raw_bytes
                    self.cond.notify_all()

    def _choose(self, item: _Outgoing) -> CodecSpec:
        if self.fixed is not None:
            return self.fixed
        role = "activation" if self.direction == "forward" else "activation_grad"
        with self.policy_lock:
            overlap = self.cfg.overlap.total_seconds() if self.cfg.overlap is not None else 0.0
            return self.policy.choose(item.raw_bytes, role, overlap,
                                      dtype=item.tensor.dtype).spec

    def _send(self, item: _Outgoing) -> None:
        cfg, key = self.cfg, item.key
        spec = self._choose(item)
        meta = dict(job_id=cfg.job_id, plan_epoch=cfg.plan_epoch, step=key.step, micro_batch=key.micro_batch,
                    direction=DIRECTION_BY_NAME[key.direction], name="act" if key.direction == "forward" else "grad",
                    sender=cfg.node_id, pipeline=cfg.pipeline, stage=cfg.stage, replica=cfg.replica)
        chunks = list(tensor_to_chunks(item.tensor, spec, meta, cfg.chunk_bytes))
        wire = sum(len(c.data) for c in chunks)
        deadline = time.monotonic() + cfg.delivery_timeout.total_seconds()
        backoff = cfg.retry_initial.total_seconds()
        attempt = 0
        while True:
            attempt += 1
            try:
                start, end = self._transfer(chunks)
                break
            except grpc.RpcError as e:
                code, details = e.code(), e.details()
                if self.closing.is_set():
                    raise TransportError(f"{key}: the transport closed while sending to {self.peer.node_id}") from None
                if code not in RETRYABLE:
                    raise TransportError(f"{key}: {self.peer.node_id} ({self.peer.address}) refused the tensor: "
                                         f"{code.name}: {details}") from None
                if time.monotonic() + backoff > deadline:
                    raise TransportError(f"{key}: could not deliver to {self.peer.node_id} ({self.peer.address}) "
                                         f"in {attempt} attempts over {cfg.delivery_timeout.total_seconds():.1f}s; "
                                         f"last: {code.name}: {details}") from None
                log.debug("%s to %s: %s (%s); retry in %.2fs", key, self.peer.node_id, code.name, details, backoff)
                if self.closing.wait(backoff):
                    raise TransportError(f"{key}: the transport closed while sending to {self.peer.node_id}") from None
                backoff = min(backoff * 2, cfg.retry_max.total_seconds())
        with self.cond:
            # from the later of this tensor's turn on the wire and the previous acknowledgement: the time the
            # link spent on these bytes, as the receiver's checking of the previous tensor overlaps them
            seconds = end - max(start, self.last_ack)
            self.last_ack = end
        with self.policy_lock:
            self.policy.observe(wire, seconds)
        with self.cond:
            t = self.totals
            t.bytes_raw += item.raw_bytes
            t.bytes_wire += wire
            t.seconds += seconds
            t.codec = spec.codec


    def _transfer(self, chunks: list[pb.TensorChunk]) -> tuple[float, float]:
        """One Transfer call; returns when its turn on the wire began and when it was acknowledged."""
        while not self.wire.acquire(timeout=0.1):
            if self.closing.is_set():
                raise TransportError("the transport closed while waiting to send")
        turn = _Turn(self.wire)

        def stream():
            try:
                yield from chunks
            finally:  # gRPC took the last chunk: the next tensor may start streaming
                turn.release()

        start = time.perf_counter()
        try:
            call = self.stub.Transfer.future(stream(), timeout=self.cfg.call_timeout.total_seconds())
            with self.cond:
                self.calls.add(call)
            try:
                call.result()
            finally:
                with self.cond:
                    self.calls.discard(call)
        finally:
            turn.release()
        return start, time.perf_counter()


class GrpcTransport(Transport):
    """`Transport` for one stage replica over gRPC; receives through `server`, which the node owns."""

    def __init__(self, config: GrpcTransportConfig, server: PeerServer):
        self.config = config
        self._server = server
        self.mailbox = Mailbox(config.receive_spec(), max_chunk_bytes=config.rpc.max_message_bytes)
        self._links: dict[Direction, _Link] = {}
        if config.downstream is not None:
            self._links["forward"] = _Link(config, config.downstream, "forward")
        if config.upstream is not None:
            self._links["backward"] = _Link(config, config.upstream, "backward")
        self._closed = False
        server.attach(self.mailbox)

    def _link(self, direction: Direction, verb: str) -> _Link:
        link = self._links.get(direction)
        if link is None:
            where = "downstream" if direction == "forward" else "upstream"
            raise TransportError(f"stage {self.config.stage} has no {where} peer to {verb} {direction} tensors")
        return link

    def send(self, key: TensorKey, tensor: torch.Tensor) -> None:
        if self._closed:
            raise TransportError(f"{key}: the transport is closed")
        self.mailbox.advance(key.step)
        self._link(key.direction, "send").enqueue(key, tensor)

    def recv(self, key: TensorKey, timeout: timedelta) -> torch.Tensor:
        # forward tensors come from upstream, where this stage's backward link points, and vice versa
        sender = self._link("backward" if key.direction == "forward" else "forward", "receive")
        sender.raise_error()
        self.mailbox.advance(key.step)
        try:
            return self.mailbox.take(key, timeout.total_seconds())
        except TimeoutError as e:
            raise TransportError(f"from {sender.peer.node_id}: {e}") from None
        except MailboxClosed as e:
            raise TransportError(str(e)) from None

    def flush(self, timeout: timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        for link in self._links.values():
            link.flush(deadline)

    def link_stats(self) -> list[LinkStats]:
        """Traffic sent on each link since the last call (for the step's metrics)."""
        return [link.take_stats() for link in self._links.values()]

    def close(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Stop receiving and sending; tensors not yet delivered are dropped. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._server.detach(self.mailbox)
        self.mailbox.close()
        for link in self._links.values():
            link.close(timeout.total_seconds())

    def __enter__(self) -> GrpcTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
