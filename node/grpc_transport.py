"""The pipeline `Transport` over gRPC: one stage replica's links to its upstream and downstream peers.

Sending goes through a `PeerLink` per neighbour (codec choice, chunked Transfer calls, backpressure,
retries, measurement; see `atoll.node.peer_link`). Receiving: a `Mailbox` attached to the node's
`PeerServer` validates and buffers what the neighbours send; `recv` waits on it.

The caller must not modify a tensor in place after `send` until `flush` (as with isend).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from atoll.compression import CodecSpec, PolicyConfig
from atoll.node.mailbox import Mailbox, MailboxClosed, ReceiveSpec
from atoll.node.peer import PeerServer
from atoll.node.peer_link import PeerLink
from atoll.node.transport import Direction, TensorKey, Transport, TransportError
from atoll.rpc import RpcOptions
from atoll.serde import codec_id
from atoll.types import LinkStats


@dataclass(frozen=True, kw_only=True)
class PeerRef:
    """A neighbour: its node id, the address of its Peer server and any emulated latency to it."""

    node_id: str
    address: str
    added_latency: timedelta = timedelta(0)
    """Emulation knob for testbeds (`atoll.node.wan`): each tensor sent to this peer is held this long
    before it goes on the wire, as a wide-area link's one-way latency would delay it; other tensors and
    links go on meanwhile. Zero (the default) outside testbeds."""

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ValueError("PeerRef.node_id must not be empty")
        if ":" not in self.address:
            raise ValueError(f"PeerRef.address must be HOST:PORT, got {self.address!r}")
        if self.added_latency < timedelta(0):
            raise ValueError(f"PeerRef.added_latency must be >= 0, got {self.added_latency}")


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
    accept_codecs: frozenset[str] | None = None
    """Codec names accepted from the neighbours (e.g. the job's fixed codec); None accepts every codec."""

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
        for name in self.accept_codecs or ():
            codec_id(name)  # raises on an unknown name
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
            max_tensor_bytes=self.max_tensor_bytes, max_buffered_bytes=self.max_buffered_bytes,
            codecs=None if self.accept_codecs is None else frozenset(codec_id(c) for c in self.accept_codecs))


class GrpcTransport(Transport):
    """`Transport` for one stage replica over gRPC; receives through `server`, which the node owns."""

    def __init__(self, config: GrpcTransportConfig, server: PeerServer):
        self.config = config
        self._server = server
        self.mailbox = Mailbox(config.receive_spec(), max_chunk_bytes=config.rpc.max_message_bytes)
        self._links: dict[Direction, PeerLink] = {}
        if config.downstream is not None:
            self._links["forward"] = PeerLink(config, config.downstream, "forward")
        if config.upstream is not None:
            self._links["backward"] = PeerLink(config, config.upstream, "backward")
        self._closed = False
        server.attach(self.mailbox)

    def _link(self, direction: Direction, verb: str) -> PeerLink:
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
