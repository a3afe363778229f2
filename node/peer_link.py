"""One direction of a stage replica's traffic: the sender side of the link to one neighbour.

`send` queues a tensor and returns; sender threads pick the codec (fixed, or the link policy's choice
from the measured bandwidth), encode and stream it in one Transfer call with a deadline. One tensor
streams at a time, so each transfer measures the link; the others encode meanwhile, or wait for the
receiver to check and decode what they sent. Queued and in-flight tensors are bounded in bytes.
Transient failures are retried with exponential backoff; a refusal is final and raised by the next
call on the link. A testbed may add latency to a peer (`PeerRef.added_latency`): each tensor waits it
out in its sender thread before its turn on the wire.

A peer that accepts no connections (`PeerRef.route` "reverse") is sent to over the Connect stream it opened
to this node's Peer server; one reached through a relay ("relay") by a Transfer to the relay that names it
(`atoll.node.reverse`). Either way the retries, deadlines and measurements are the same.

The lowrank codec is PowerSGD proper on a link (`atoll.compression.lowrank.LowRankLink`): one per link and
direction, warm-started from the previous tensor's subspace, with error feedback on the backward direction
(activation-gradients). Its state lives on the sender only: both factors go on the wire, so decoding is the
stateless codec's and a receiver checks the payload like any other. A link lives for one plan epoch (a
transport per run), so a new plan starts every direction afresh.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import torch

from atoll.compression import CodecSpec, EncodedTensor, LinkPolicy, encode_tensor
from atoll.compression.lowrank import LowRankLink
from atoll.compression.wire import chunk_frames, tensor_meta
from atoll.node.reverse import RELAY_METADATA_KEY, ReverseRegistry
from atoll.node.transport import Direction, TensorKey, TransportError
from atoll.rpc import make_channel
from atoll.tls import node_dns_name
from atoll.serde import DIRECTION_BY_NAME
from atoll.types import LinkStats
from atoll.v1 import atoll_pb2 as pb

if TYPE_CHECKING:
    from atoll.node.grpc_transport import GrpcTransportConfig, PeerRef

log = logging.getLogger("atoll.node.peer_link")

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED,
                       grpc.StatusCode.INTERNAL})
"""Status codes of failures that may pass: a restarting, busy or slow peer. Others are final."""


@dataclass
class _Outgoing:
    key: TensorKey
    tensor: torch.Tensor
    raw_bytes: int
    ready: float
    """time.monotonic() from which it may go on the wire (the peer's emulated latency after `send`)"""


@dataclass
class _Totals:
    bytes_raw: int = 0
    bytes_wire: int = 0
    seconds: float = 0.0
    codec: str = "identity"
    transfers: int = 0


class _Turn:
    """A held lock released once, from whichever thread gets there first (gRPC's or the sender's)."""

    def __init__(self, lock: threading.Lock):
        self._lock, self._guard, self._held = lock, threading.Lock(), True

    def release(self) -> None:
        with self._guard:
            if self._held:
                self._held = False
                self._lock.release()


class PeerLink:
    """Sends to one neighbour: a channel, a bounded queue, sender threads and the link's policy."""

    def __init__(self, cfg: GrpcTransportConfig, peer: PeerRef, direction: Direction,
                 reverse: ReverseRegistry | None = None):
        self.cfg, self.peer, self.direction = cfg, peer, direction
        if peer.route == "reverse" and reverse is None:
            raise ValueError(f"{peer.node_id} accepts no connections: sending to it needs this node's Peer server "
                             f"(its Connect streams)")
        self.reverse = reverse
        self.fixed = cfg.forward_codec if direction == "forward" else cfg.backward_codec
        self.policy = LinkPolicy(cfg.policy, initial_bandwidth_bytes_per_s=cfg.initial_bandwidth_bytes_per_s,
                                 latency_s=cfg.latency.total_seconds())
        # dialled directly, the server must hold the neighbour's own certificate (mutual TLS), not any node's
        self.channel = None if peer.route == "reverse" else \
            make_channel(peer.relay if peer.route == "relay" else peer.address, cfg.rpc, token=cfg.token,
                         server_name=node_dns_name(peer.node_id) if peer.route != "relay" else
                         node_dns_name(peer.relay_node) if peer.relay_node else None)
        self.metadata = ((RELAY_METADATA_KEY, peer.node_id),) if peer.route == "relay" else None
        # Peer.Transfer, fed the chunks already serialized (`chunk_frames`) to spare protobuf's copies
        self.transfer = None if self.channel is None else self.channel.stream_unary(
            "/atoll.v1.Peer/Transfer", response_deserializer=pb.TransferAck.FromString)
        self.queue: queue.SimpleQueue[_Outgoing | None] = queue.SimpleQueue()
        self.cond = threading.Condition()
        self.in_flight = 0  # raw bytes queued or being sent
        self.error: TransportError | None = None
        self.closing = threading.Event()
        self.calls: set[grpc.Future] = set()
        self.totals = _Totals()
        self.policy_lock = threading.Lock()  # LinkPolicy is not thread-safe
        self.lowrank: dict[CodecSpec, LowRankLink] = {}  # PowerSGD state of this direction, per spec
        self.lowrank_lock = threading.Lock()  # a LowRankLink is not thread-safe either
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
        item = _Outgoing(key=key, tensor=tensor, raw_bytes=tensor.numel() * tensor.element_size(),
                         ready=time.monotonic() + self.peer.added_latency.total_seconds())
        limit, deadline = self.cfg.max_in_flight_bytes, time.monotonic() + self.cfg.send_timeout.total_seconds()
        with self.cond:
            # a tensor larger than the limit is let through alone, so it cannot wait forever
            while self.in_flight and self.in_flight + item.raw_bytes > limit and self.error is None:
                if self.closing.is_set():
                    raise TransportError(f"{key}: the transport closed while waiting for room on the link")
                left = deadline - time.monotonic()
                if left <= 0:
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
                         bandwidth_bytes_per_s=self.policy.bandwidth or 0.0, transfers=t.transfers)

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
        if self.channel is not None:
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
                if isinstance(e, grpc.FutureCancelledError) and self.closing.is_set():
                    return  # the link closed under its last send (the plan was superseded): nothing failed
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
            return self.policy.choose(item.raw_bytes, role, overlap, dtype=item.tensor.dtype,
                                      shape=tuple(item.tensor.shape)).spec

    def _encode(self, tensor: torch.Tensor, spec: CodecSpec) -> EncodedTensor:
        if spec.codec != "lowrank" or spec.zstd_level:
            return encode_tensor(tensor, spec)
        with self.lowrank_lock:
            link = self.lowrank.get(spec)
            if link is None:
                link = self.lowrank[spec] = LowRankLink(spec, error_feedback=self.direction == "backward")
            return link.encode(tensor)

    def _send(self, item: _Outgoing) -> None:
        cfg, key = self.cfg, item.key
        # emulated latency: this thread waits out the tensor's own delay; the other sender threads and
        # the wire go on meanwhile, so tensors queued together arrive together, not one delay apart
        hold = item.ready - time.monotonic()
        if hold > 0 and self.closing.wait(hold):
            raise TransportError(f"{key}: the transport closed while sending to {self.peer.node_id}")
        spec = self._choose(item)
        meta = dict(job_id=cfg.job_id, plan_epoch=cfg.plan_epoch, step=key.step, micro_batch=key.micro_batch,
                    direction=DIRECTION_BY_NAME[key.direction], name="act" if key.direction == "forward" else "grad",
                    sender=cfg.node_id, pipeline=cfg.pipeline, stage=cfg.stage, replica=cfg.replica)
        enc = self._encode(item.tensor, spec)
        first, wire = tensor_meta(enc, meta), enc.wire_bytes
        deadline = time.monotonic() + cfg.delivery_timeout.total_seconds()
        backoff = cfg.retry_initial.total_seconds()
        attempt = 0
        while True:
            attempt += 1
            try:
                start, end = self._transfer(chunk_frames(first, enc.payload, cfg.chunk_bytes))
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
            since = max(start, self.last_ack)
            seconds = max(end - since if since < end else end - start, 1e-9)
            self.last_ack = max(self.last_ack, end)
        with self.policy_lock:
            self.policy.observe(wire, seconds)
        with self.cond:
            t = self.totals
            t.bytes_raw += item.raw_bytes
            t.bytes_wire += wire
            t.seconds += seconds
            t.transfers += 1
            t.codec = spec.codec

    def _transfer(self, frames: Iterator[bytes]) -> tuple[float, float]:
        """One Transfer call of serialized chunks, made as gRPC asks for them; returns when its turn on the
        wire began and when it was acknowledged."""
        while not self.wire.acquire(timeout=0.1):
            if self.closing.is_set():
                raise TransportError("the transport closed while waiting to send")
        turn = _Turn(self.wire)

        def stream():
            try:
                yield from frames
            finally:  # gRPC took the last chunk: the next tensor may start streaming
                turn.release()

        start = time.perf_counter()
        if self.transfer is None:  # the peer accepts no connections: over the Connect stream it opened to us
            assert self.reverse is not None
            try:
                self.reverse.call(self.peer.node_id, "Transfer", stream(), self.cfg.call_timeout.total_seconds())
            finally:
                turn.release()
            return start, time.perf_counter()
        try:
            call = self.transfer.future(stream(), timeout=self.cfg.call_timeout.total_seconds(),
                                        metadata=self.metadata)
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
