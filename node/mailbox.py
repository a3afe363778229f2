"""The receive side of the peer transport: what a stage accepts from its neighbours, and where it waits.

A `Mailbox` holds the tensors of one stage replica in one plan epoch, keyed by (step, micro-batch,
direction) and sender: a replica next to a stage of another width receives each micro-batch as row slices
from several senders, each checked against the rows it is expected to send. Next to a stage whose replicas
form lanes (micro-batch i trained by lane i % L), the senders are those of every lane, and each takes only
its own lane's micro-batches. Each Transfer stream is checked against the stage's `ReceiveSpec` from its
first chunk (job, epoch, sender and its lane, step window, shape, dtype, codec, size) before a byte of
payload is buffered, and the bytes it will need are reserved up front, so a peer can never make the node
allocate past `max_buffered_bytes`. The codec layer checks the payload (length, checksum, decoding).

Errors here are plain exceptions; the Peer servicer maps them to gRPC status codes.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
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
    upstream: str | tuple[str, ...] | None
    """Node id(s) that send activations, in row order; None on the first stage (no activations accepted).
    Several senders each send their rows of every micro-batch (a previous stage of another width), or of
    their lane's micro-batches (`sender_lanes`; then those of every lane, lane by lane)."""
    downstream: str | tuple[str, ...] | None
    """Node id(s) that send activation-gradients, in row order; None on the last stage (no gradients
    accepted)."""
    shape: tuple[int, ...] | None
    """Shape of activations and their gradients; None accepts any shape within `max_tensor_bytes`."""
    sender_rows: tuple[tuple[str, int], ...] = ()
    """(node id, rows) for senders whose tensors have `rows` in their first dimension instead of
    `shape[0]`: the row slices of a neighbour stage of another width. Needs `shape`."""
    sender_lanes: tuple[tuple[str, int, int], ...] = ()
    """(node id, lane, lanes) for the senders of a neighbour stage whose replicas form `lanes` lanes: such a
    sender sends only micro-batches i with i % lanes == lane; others from it are refused. Either every
    sender of a direction has an entry, with the same `lanes` and every lane sent by someone, or none has."""
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
        senders = self.senders("forward") + self.senders("backward")
        if len(set(senders)) != len(senders) or not all(senders):
            raise ValueError(f"senders must be distinct, non-empty node ids; got upstream {self.upstream!r}, "
                             f"downstream {self.downstream!r}")
        for node, rows in self.sender_rows:
            if node not in senders:
                raise ValueError(f"sender_rows names {node!r}, which is neither an upstream nor a downstream sender")
            if rows < 1 or self.shape is None or not self.shape:
                raise ValueError(f"sender_rows needs a shape to check and rows >= 1; got {rows} rows from {node!r} "
                                 f"and shape {self.shape}")
        named = [node for node, _, _ in self.sender_lanes]
        if len(set(named)) != len(named):
            raise ValueError(f"sender_lanes names a sender twice: {named}; each sender is in one lane")
        for node, lane, lanes in self.sender_lanes:
            if node not in senders:
                raise ValueError(f"sender_lanes names {node!r}, which is neither an upstream nor a downstream sender")
            if not 0 <= lane < lanes:
                raise ValueError(f"sender_lanes: {node!r} is in lane {lane} of {lanes}; a lane is in [0, lanes)")
        for direction in ("forward", "backward"):
            who = self.senders(direction)
            laned = {node: (lane, lanes) for node, lane, lanes in self.sender_lanes if node in who}
            if not laned:
                continue
            counts = {lanes for _, lanes in laned.values()}
            sent = {lane for lane, _ in laned.values()}
            if len(laned) != len(who) or len(counts) != 1 or sent != set(range(max(counts))):
                raise ValueError(f"sender_lanes of the {direction} senders {', '.join(who)} must give each of them "
                                 f"a lane of one same number of lanes, every lane to someone; got {laned}")

    def senders(self, direction: Direction) -> tuple[str, ...]:
        """Node ids that send `direction` tensors to this stage, in row order (empty: none accepted)."""
        who = self.upstream if direction == "forward" else self.downstream
        if who is None:
            return ()
        return (who,) if isinstance(who, str) else tuple(who)

    def lane_of(self, sender: str) -> tuple[int, int] | None:
        """(lane, lanes) of `sender`, whose stage forms lanes; None: it sends every micro-batch."""
        for node, lane, lanes in self.sender_lanes:
            if node == sender:
                return lane, lanes
        return None

    def expected_shape(self, sender: str) -> tuple[int, ...] | None:
        """The shape of a tensor from `sender` (None: not checked)."""
        if self.shape is None:
            return None
        rows = dict(self.sender_rows).get(sender)
        return self.shape if rows is None else (rows, *self.shape[1:])


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

    def __init__(self, spec: ReceiveSpec, *, max_chunk_bytes: int = WireLimits().max_chunk_bytes,
                 measure: Callable[[torch.Tensor], float] | None = None):
        self.spec = spec
        self.measure = measure
        """Taken of every tensor as it is decoded, on the receive thread (`atoll.node.door.tensor_norm`): handed
        out with it by `take_measured`. None: nothing measured."""
        self._norms: dict[tuple[TensorKey, str], float] = {}
        self._limits = WireLimits(max_tensor_bytes=spec.max_tensor_bytes, max_chunk_bytes=max_chunk_bytes)
        self._cond = threading.Condition()
        # (key, sender) -> (tensor, bytes held)
        self._ready: dict[tuple[TensorKey, str], tuple[torch.Tensor, int]] = {}
        self._delivered: set[tuple[TensorKey, str]] = set()  # taken already; a retried copy is dropped
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
        key: tuple[TensorKey, str] | None = None
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
                    self._reserve(need, key[0], deadline)
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
                    norm = self.measure(done.tensor) if self.measure is not None else None
                    self._deposit(key, done.tensor, held, meta, norm)
                    held, tensors, meta, key = 0, tensors + 1, None, None
            if meta is not None:
                raise InvalidTransfer(f"the stream ended before the {meta.total_bytes} payload bytes of "
                                      f"{_describe(meta)} had arrived")
        finally:
            if held:
                self._release(held)
        return pb.TransferAck(tensors=tensors, bytes=wire,
                              receive_seconds=0.0 if first is None else (last or first) - first)

    def _check(self, meta: pb.TensorMeta) -> tuple[tuple[TensorKey, str], int]:
        """Validate a tensor's meta against the spec; return its (key, sender) and the bytes it will hold."""
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
        senders = s.senders(direction)
        sender_stage = s.stage - 1 if direction == "forward" else s.stage + 1
        if not senders:
            raise UnexpectedTransfer(f"{what}: stage {s.stage} takes no {direction} tensors "
                                     f"(it is the {'first' if direction == 'forward' else 'last'} stage)")
        if meta.pipeline != s.pipeline or meta.stage != sender_stage or meta.sender not in senders:
            raise UnexpectedTransfer(f"{what} claims pipeline {meta.pipeline} stage {meta.stage}; {direction} "
                                     f"tensors of stage {s.stage} come from {', '.join(senders)} "
                                     f"(pipeline {s.pipeline} stage {sender_stage})")
        lane = s.lane_of(meta.sender)
        if lane is not None and meta.micro_batch % lane[1] != lane[0]:
            raise UnexpectedTransfer(f"{what}: {meta.sender} is in lane {lane[0]} of {lane[1]}, which trains the "
                                     f"micro-batches i with i % {lane[1]} = {lane[0]}; micro-batch {meta.micro_batch} "
                                     f"is lane {meta.micro_batch % lane[1]}'s")
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
        expected = s.expected_shape(meta.sender)
        if expected is not None and shape != expected:
            raise InvalidTransfer(f"{what} has shape {list(shape)}; stage {s.stage} expects {list(expected)} "
                                  f"from {meta.sender}")
        if s.codecs is not None and meta.codec not in s.codecs:
            accepted = ", ".join(sorted(codec_name(c) for c in s.codecs))
            raise InvalidTransfer(f"{what} uses codec {CODEC_NAME.get(meta.codec, meta.codec)}, not accepted on "
                                  f"this link ({accepted})")
        raw = math.prod(shape) * dtype.itemsize
        if raw > s.max_tensor_bytes or meta.total_bytes > s.max_tensor_bytes:
            raise InvalidTransfer(f"{what} is too large: {raw} bytes decoded, {meta.total_bytes} on the wire; "
                                  f"the limit is {s.max_tensor_bytes} bytes")
        return (TensorKey(meta.step, meta.micro_batch, direction), meta.sender), raw + meta.total_bytes

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

    def _deposit(self, key: tuple[TensorKey, str], tensor: torch.Tensor, held: int, meta: pb.TensorMeta,
                 norm: float | None = None) -> None:
        keep = tensor.numel() * tensor.element_size()
        with self._cond:
            if key in self._ready or key in self._delivered or key[0].step < self._low_step:
                self._reserved -= held  # a retried copy of a tensor we have, or one nobody will take
            else:
                self._ready[key] = (tensor, keep)
                if norm is not None:
                    self._norms[key] = norm
                self._reserved -= held - keep  # the payload is gone; the decoded tensor stays until taken
                st = self.stats[key[0].direction]
                st.tensors += 1
                st.bytes_wire += meta.total_bytes
                st.bytes_raw += keep
            self._cond.notify_all()

    # --- the stage side -------------------------------------------------------------------------------

    def take(self, key: TensorKey, timeout: float, sender: str | None = None) -> torch.Tensor:
        """The tensor under `key` from `sender` (None: the direction's only sender), waiting up to `timeout`
        seconds; TimeoutError or MailboxClosed otherwise."""
        return self.take_measured(key, timeout, sender)[0]

    def take_measured(self, key: TensorKey, timeout: float, sender: str | None = None
                      ) -> tuple[torch.Tensor, float | None]:
        """`take`, with the norm `measure` took of the tensor as it was decoded (None: not measured)."""
        senders = self.spec.senders(key.direction)
        if sender is None:
            if len(senders) != 1:
                raise ValueError(f"{key.direction} tensors come from {len(senders)} senders here "
                                 f"({', '.join(senders) or 'none'}); name the sender to take from")
            sender = senders[0]
        elif sender not in senders:
            raise ValueError(f"{sender} sends no {key.direction} tensors here; the senders are "
                             f"{', '.join(senders) or 'none'}")
        lane = self.spec.lane_of(sender)
        if lane is not None and key.micro_batch % lane[1] != lane[0]:
            raise ValueError(f"{sender} is in lane {lane[0]} of {lane[1]} and sends no micro-batch "
                             f"{key.micro_batch} (lane {key.micro_batch % lane[1]}'s); take it from that lane")
        slot = (key, sender)
        deadline = time.monotonic() + timeout
        with self._cond:
            while slot not in self._ready:
                if self._closed:
                    raise MailboxClosed(f"the mailbox closed while waiting for {key} from {sender}")
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting = ", ".join(f"{k.step}/{k.micro_batch}/{k.direction}"
                                        + (f" from {n}" if len(self.spec.senders(k.direction)) > 1 else "")
                                        for k, n in sorted(self._ready))
                    raise TimeoutError(f"no tensor for step {key.step} micro-batch {key.micro_batch} "
                                       f"({key.direction}) arrived from {sender} within {timeout:.1f}s; "
                                       f"waiting here: [{waiting}]")
                self._cond.wait(left)
            tensor, held = self._ready.pop(slot)
            self._delivered.add(slot)
            self._reserved -= held
            self._cond.notify_all()
            return tensor, self._norms.pop(slot, None)

    def advance(self, step: int) -> None:
        """The stage is at `step`: refuse older steps and drop what is buffered for them."""
        with self._cond:
            if step <= self._low_step:
                return
            self._low_step = step
            for slot in [k for k in self._ready if k[0].step < step]:
                self._reserved -= self._ready.pop(slot)[1]
                self._norms.pop(slot, None)
            self._delivered = {k for k in self._delivered if k[0].step >= step}
            self._cond.notify_all()

    @property
    def buffered_bytes(self) -> int:
        with self._cond:
            return self._reserved

    def pending(self) -> list[TensorKey]:
        """Keys of the tensors waiting to be taken (a key once per sender)."""
        with self._cond:
            return sorted(k for k, _ in self._ready)

    def close(self) -> None:
        """Wake every waiter: receivers answer that the stage is shutting down, takers get MailboxClosed."""
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._norms.clear()
            self._cond.notify_all()
