"""The receive side of the peer transport: what a stage accepts from its neighbours, and where it waits.

A `Mailbox` holds the tensors of one stage replica in one plan epoch, keyed by (step, micro-batch,
direction). Each Transfer stream is checked against the stage's `ReceiveSpec` from its first chunk
(job, epoch, sender, step window, shape, dtype, codec, size) before a byte of payload is buffered, and
the bytes it will need are reserved up front, so a peer can never make the node allocate past
`max_buffered_bytes`. The codec layer checks the payload (length, checksum, decoding).

Errors here are plain exceptions; the Peer servicer maps them to gRPC status codes.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from atoll.compression import ChunkAssembler, CodecError, WireLimits
from atoll.compression.dtypes import TORCH_DTYPES
from atoll.compression.wire import Chunk
from atoll.node.transport import Direction, TensorKey
from atoll.serde import CODEC_NAME, codec_name
from atoll.v1 import atoll_pb2 as pb

_DIRECTION_OF: dict[int, Direction] = {pb.DIRECTION_FORWARD: "forward", pb.DIRECTION_BACKWARD: "backward"}


class InvalidTransfer(ValueError):
    """A message is malformed or does not match what the stage expects (shape, dtype, size, codec, checksum)."""


class UnexpectedTransfer(RuntimeError):
    """A well-formed message this node cannot take: another job or plan epoch, a wrong sender, a past step."""


class NotReady(RuntimeError):
    """The tensor is for a stage or plan epoch this node has not started yet; the sender should retry."""


class ReceiverBusy(RuntimeError):
    """The mailbox had no room (or the step was too far ahead) until the call's deadline; retry later."""


class MailboxClosed(RuntimeError):
    """The stage stopped; nothing more is received or handed out."""


class TransferReceiver(Protocol):
    """Takes the chunks of one Transfer call and answers with its acknowledgement."""

    def receive(self, chunks: Iterator[Chunk], *, peer: str,
                deadline_seconds: float) -> pb.TransferAck: ...


@dataclass(frozen=True, kw_only=True)
class ReceiveSpec:
    """What one stage replica accepts from its neighbours in one plan epoch."""

    job_id: str
    """Job the tensors must belong to."""
    plan_epoch: int
    """Plan epoch the tensors must carry; others are refused with FAILED_PRECONDITION."""
    pipeline: int
    """Pipeline index of this stage."""
    stage: int
    """Stage index; activations come from `stage - 1`, gradients from `stage + 1`."""
    upstream: str | None
    """Node id that sends activations; None on the first stage (no activations accepted)."""
    downstream: str | None
    """Node id that sends activation-gradients; None on the last stage (no gradients accepted)."""
    shape: tuple[int, ...] | None
    """Shape of activations and their gradients; None accepts any shape within `max_tensor_bytes`."""
    dtype: torch.dtype = torch.float32
    """Dtype of decoded activations and gradients."""
    micro_batches: int | None = None
    """Micro-batches per step; a larger index is refused. None: not checked."""
    codecs: frozenset[int] | None = None
    """Codec ids (atoll.v1 Codec) accepted; None accepts every codec."""
    step_window: int = 2
    """Steps accepted ahead of the oldest step still open: a neighbour may run this far ahead."""
    max_tensor_bytes: int = 256 * 1024 * 1024
    """Largest decoded tensor, and largest encoded payload, accepted."""
    max_buffered_bytes: int = 1024 * 1024 * 1024
    """Bytes held by waiting tensors and tensors being received, together."""

    def __post_init__(self) -> None:
        if self.step_window < 1:
            raise ValueError(f"step_window must be at least 1, got {self.step_window}")
        if self.max_tensor_bytes < 1:
            raise ValueError(f"max_tensor_bytes must be positive, got {self.max_tensor_bytes}")
        if self.max_buffered_bytes < 2 * self.max_tensor_bytes:
            raise ValueError(f"max_buffered_bytes ({self.max_buffered_bytes}) must hold at least one tensor and "
                             f"its payload: 2 * max_tensor_bytes = {2 * self.max_tensor_bytes}")
        if self.shape is not None and any(d < 0 for d in self.shape):
            raise ValueError(f"shape {self.shape} has a negative dimension")
        if self.dtype not in TORCH_DTYPES.values():
            raise ValueError(f"dtype {self.dtype} has no wire form; use one of {sorted(map(str, TORCH_DTYPES.values()))}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, got {self.micro_batches}")


@dataclass
class ReceivedStats:
    """Totals of what a mailbox accepted, per direction."""

    tensors: int = 0
    bytes_wire: int = 0
    bytes_raw: int = 0


def _describe(meta: pb.TensorMeta) -> str:
    return (f"tensor {meta.name or '?'} (step {meta.step}, micro-batch {meta.micro_batch}, "
            f"{_DIRECTION_OF.get(meta.direction, 'no direction')}) from {meta.sender or '?'}")


class Mailbox:
    """Bounded buffer of the tensors sent to one stage replica; see the module docstring."""

    def __init__(self, spec: ReceiveSpec, *, max_chunk_bytes: int = WireLimits().max_chunk_bytes):
        self.spec = spec
        self._limits = WireLimits(max_tensor_bytes=spec.max_tensor_bytes, max_chunk_bytes=max_chunk_bytes)
        self._cond = threading.Condition()
        self._ready: dict[TensorKey, tuple[torch.Tensor, int]] = {}  # key -> (tensor, bytes held)
        self._delivered: set[TensorKey] = set()  # taken already; a retried copy is dropped
        self._reserved = 0
        self._low_step = 0
        self._closed = False
        self.stats: dict[Direction, ReceivedStats] = {"forward": ReceivedStats(), "backward": ReceivedStats()}

    # --- the server side ------------------------------------------------------------------------------

    def receive(self, chunks: Iterator[Chunk], *, peer: str, deadline_seconds: float) -> pb.TransferAck:
        """Take one Transfer stream: one or more tensors, each a meta chunk then data chunks."""
        deadline = time.monotonic() + deadline_seconds
        tensors = wire = 0
        first = last = None
        key: TensorKey | None = None
        held = 0
        assembler = ChunkAssembler(self._limits)
        meta: pb.TensorMeta | None = None
        try:
            for chunk in chunks:
                last = time.perf_counter()
                first = first or last
                if chunk.HasField("meta"):
                    if meta is not None:
                        raise InvalidTransfer(f"{_describe(chunk.meta)} began before the {meta.total_bytes} "
                                              f"payload bytes of {_describe(meta)} had arrived")
                    meta = chunk.meta
                    key, need = self._check(meta)
                    self._reserve(need, key, deadline)
                    held = need
                elif meta is None:
                    raise InvalidTransfer(f"a data chunk from {peer} came before any meta chunk; "
                                          "each tensor starts with its TensorMeta")
                try:
                    done = assembler.feed(chunk)
                except CodecError as e:
                    raise InvalidTransfer(f"{_describe(meta)}: {e}") from None
                if done is not None and key is not None:
                    wire += done.wire_bytes  # (reading chunk.data again would copy every chunk once more)
                    self._check_decoded(meta, done.tensor)
                    self._deposit(key, done.tensor, held, meta)
                    held, tensors, meta, key = 0, tensors + 1, None, None
            if meta is not None:
                raise InvalidTransfer(f"the stream ended before the {meta.total_bytes} payload bytes of "
                                      f"{_describe(meta)} had arrived")
        finally:
            if held:
                self._release(held)
        return pb.TransferAck(tensors=tensors, bytes=wire,
                              receive_seconds=0.0 if first is None else (last or first) - first)

    def _check(self, meta: pb.TensorMeta) -> tuple[TensorKey, int]:
        """Validate a tensor's meta against the spec; return its key and the bytes it will hold."""
        s, what = self.spec, _describe(meta)
        if meta.job_id != s.job_id:
            raise UnexpectedTransfer(f"{what} belongs to job {meta.job_id!r}; this node runs job {s.job_id!r}")
        if meta.plan_epoch > s.plan_epoch:
            raise NotReady(f"{what} is of plan epoch {meta.plan_epoch}, which has not started here; "
                           f"this node still runs epoch {s.plan_epoch}")
        if meta.plan_epoch < s.plan_epoch:
            raise UnexpectedTransfer(f"{what} is of plan epoch {meta.plan_epoch}, which is over; "
                                     f"this node runs epoch {s.plan_epoch}")
        direction = _DIRECTION_OF.get(meta.direction)
        if direction is None:
            raise InvalidTransfer(f"{what} names no direction; set DIRECTION_FORWARD or DIRECTION_BACKWARD")
        sender, sender_stage = ((s.upstream, s.stage - 1) if direction == "forward"
                                else (s.downstream, s.stage + 1))
        if sender is None:
            raise UnexpectedTransfer(f"{what}: stage {s.stage} takes no {direction} tensors "
                                     f"(it is the {'first' if direction == 'forward' else 'last'} stage)")
        if meta.pipeline != s.pipeline or meta.stage != sender_stage or meta.sender != sender:
            raise UnexpectedTransfer(f"{what} claims pipeline {meta.pipeline} stage {meta.stage}; {direction} "
                                     f"tensors of stage {s.stage} come from {sender} "
                                     f"(pipeline {s.pipeline} stage {sender_stage})")
        if meta.step < self._low_step:
            raise UnexpectedTransfer(f"{what} is for step {meta.step}, which this stage has finished "
                                     f"(it is at step {self._low_step})")
        if s.micro_batches is not None and meta.micro_batch >= s.micro_batches:
            raise InvalidTransfer(f"{what}: micro-batch {meta.micro_batch} is out of range; a step has "
                                  f"{s.micro_batches} micro-batches")
        dtype = TORCH_DTYPES.get(meta.dtype)
        if dtype != s.dtype:
            got = dtype if dtype is not None else f"id {meta.dtype} (no such dtype)"
            raise InvalidTransfer(f"{what} has dtype {got}; stage {s.stage} expects {s.dtype}")
        shape = tuple(meta.shape)
        if any(d < 0 for d in shape):
            raise InvalidTransfer(f"{what} has a negative dimension in shape {list(shape)}")
        if s.shape is not None and shape != s.shape:
            raise InvalidTransfer(f"{what} has shape {list(shape)}; stage {s.stage} expects {list(s.shape)}")
        if s.codecs is not None and meta.codec not in s.codecs:
            accepted = ", ".join(sorted(codec_name(c) for c in s.codecs))
            raise InvalidTransfer(f"{what} uses codec {CODEC_NAME.get(meta.codec, meta.codec)}, not accepted on "
                                  f"this link ({accepted})")
        raw = math.prod(shape) * dtype.itemsize
        if raw > s.max_tensor_bytes or meta.total_bytes > s.max_tensor_bytes:
            raise InvalidTransfer(f"{what} is too large: {raw} bytes decoded, {meta.total_bytes} on the wire; "
                                  f"the limit is {s.max_tensor_bytes} bytes")
        return TensorKey(meta.step, meta.micro_batch, direction), raw + meta.total_bytes

    def _check_decoded(self, meta: pb.TensorMeta, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != tuple(meta.shape) or tensor.dtype != TORCH_DTYPES[meta.dtype]:
            raise InvalidTransfer(f"{_describe(meta)} decoded to {list(tensor.shape)} {tensor.dtype}, "
                                  f"its meta says {list(meta.shape)} {TORCH_DTYPES[meta.dtype]}")

    def _reserve(self, need: int, key: TensorKey, deadline: float) -> None:
        """Wait until `need` bytes fit and `key.step` is inside the window, or raise ReceiverBusy."""
        s = self.spec
        with self._cond:
            while True:
                if self._closed:
                    raise UnexpectedTransfer("the stage is shutting down; no more tensors are taken")
                if key.step < self._low_step:
                    raise UnexpectedTransfer(f"step {key.step} finished while its tensor waited for room")
                fits = self._reserved + need <= s.max_buffered_bytes
                if fits and key.step < self._low_step + s.step_window:
                    self._reserved += need
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    why = (f"{self._reserved} of {s.max_buffered_bytes} buffered bytes are taken" if not fits
                           else f"step {key.step} is more than {s.step_window} steps ahead of step {self._low_step}")
                    raise ReceiverBusy(f"no room for {key} before the call's deadline: {why}; retry later")
                self._cond.wait(min(left, 1.0))

    def _release(self, nbytes: int) -> None:
        with self._cond:
            self._reserved -= nbytes
            self._cond.notify_all()

    def _deposit(self, key: TensorKey, tensor: torch.Tensor, held: int, meta: pb.TensorMeta) -> None:
        keep = tensor.numel() * tensor.element_size()
        with self._cond:
            if key in self._ready or key in self._delivered or key.step < self._low_step:
                self._reserved -= held  # a retried copy of a tensor we have, or one nobody will take
            else:
                self._ready[key] = (tensor, keep)
                self._reserved -= held - keep  # the payload is gone; the decoded tensor stays until taken
                st = self.stats[key.direction]
                st.tensors += 1
                st.bytes_wire += meta.total_bytes
                st.bytes_raw += keep
            self._cond.notify_all()

    # --- the stage side -------------------------------------------------------------------------------

    def take(self, key: TensorKey, timeout: float) -> torch.Tensor:
        """The tensor under `key`, waiting up to `timeout` seconds; TimeoutError or MailboxClosed otherwise."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._ready:
                if self._closed:
                    raise MailboxClosed(f"the mailbox closed while waiting for {key}")
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting = ", ".join(f"{k.step}/{k.micro_batch}/{k.direction}" for k in sorted(self._ready))
                    raise TimeoutError(f"no tensor for step {key.step} micro-batch {key.micro_batch} "
                                       f"({key.direction}) arrived within {timeout:.1f}s; "
                                       f"waiting here: [{waiting}]")
                self._cond.wait(left)
            tensor, held = self._ready.pop(key)
            self._delivered.add(key)
            self._reserved -= held
            self._cond.notify_all()
            return tensor

    def advance(self, step: int) -> None:
        """The stage is at `step`: refuse older steps and drop what is buffered for them."""
        with self._cond:
            if step <= self._low_step:
                return
            self._low_step = step
            for key in [k for k in self._ready if k.step < step]:
                self._reserved -= self._ready.pop(key)[1]
            self._delivered = {k for k in self._delivered if k.step >= step}
            self._cond.notify_all()

    @property
    def buffered_bytes(self) -> int:
        with self._cond:
            return self._reserved

    def pending(self) -> list[TensorKey]:
        with self._cond:
            return sorted(self._ready)

    def close(self) -> None:
        """Wake every waiter: receivers answer that the stage is shutting down, takers get MailboxClosed."""
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._cond.notify_all()
