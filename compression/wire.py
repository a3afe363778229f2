"""A tensor as a stream of `pb.TensorChunk`s, and the assembler that turns chunks back into tensors.

The first chunk of a tensor carries `meta` (shape, dtype, codec, total payload bytes, CRC-32 of the
payload); every chunk carries up to `chunk_bytes` of payload. A stream may carry several tensors back to
back. The assembler checks the metadata against `WireLimits` before allocating one buffer of exactly
`total_bytes`, copies each chunk into it once (checksumming it on the way), verifies the checksum and
decodes in place.

The transport's hot path skips protobuf's copies of the payload: the sender builds each chunk's wire form
itself (`chunk_frames`, byte for byte what `SerializeToString` gives) and the receiver's `parse_chunk`
hands a chunk's payload on as a view of the received message, leaving any message not in that plain layout
to protobuf.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from zlib_ng.zlib_ng import crc32  # the same CRC-32 as zlib's, several times faster (folded with PCLMULQDQ)

from atoll.compression.codec import Payload
from atoll.compression.dtypes import dtype_from_proto, dtype_to_proto
from atoll.compression.errors import CodecError
from atoll.compression.limits import WireLimits
from atoll.compression.spec import CodecSpec
from atoll.compression.tensor import EncodedTensor, check_tensor_meta, encode_tensor, get_codec
from atoll.serde import DIRECTION_BY_NAME
from atoll.v1 import atoll_pb2 as pb

DEFAULT_CHUNK_BYTES = 1 << 20

META_FIELDS = ("job_id", "plan_epoch", "step", "micro_batch", "direction", "name", "sender", "pipeline",
               "stage", "replica")
"""The routing fields of `pb.TensorMeta` a caller supplies; the rest describe the payload."""


def _routing(meta: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(meta) - set(META_FIELDS)
    if unknown:
        raise ValueError(f"unknown TensorMeta fields {sorted(unknown)}; allowed: {', '.join(META_FIELDS)}")
    fields = dict(meta)
    direction = fields.get("direction")
    if isinstance(direction, str):
        if direction not in DIRECTION_BY_NAME:
            raise ValueError(f"direction must be one of {', '.join(DIRECTION_BY_NAME)}, got {direction!r}")
        fields["direction"] = DIRECTION_BY_NAME[direction]
    return fields


def tensor_meta(enc: EncodedTensor, meta: Mapping[str, Any]) -> pb.TensorMeta:
    """The first chunk's metadata of `enc`: the routing fields of `meta` (META_FIELDS), then the payload's
    shape, dtype, codec, size and checksum."""
    data = memoryview(enc.payload).cast("B")
    codec_id, params = enc.spec.to_proto()
    return pb.TensorMeta(**_routing(meta), shape=list(enc.shape), dtype=dtype_to_proto(enc.dtype), codec=codec_id,
                         codec_params=params, total_bytes=data.nbytes, checksum=crc32(data))


def encoded_to_chunks(enc: EncodedTensor, meta: Mapping[str, Any],
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.TensorChunk]:
    """The chunks of an already encoded tensor (for callers that encode ahead, e.g. error feedback)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    data = memoryview(enc.payload).cast("B")
    yield pb.TensorChunk(meta=tensor_meta(enc, meta), data=bytes(data[:chunk_bytes]))
    for offset in range(chunk_bytes, data.nbytes, chunk_bytes):
        yield pb.TensorChunk(data=bytes(data[offset:offset + chunk_bytes]))


def tensor_to_chunks(t: torch.Tensor, spec: CodecSpec, meta: Mapping[str, Any],
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.TensorChunk]:
    """Encode `t` under `spec` and yield its chunks. `meta` holds the routing fields (META_FIELDS);
    `direction` may be "forward"/"backward" or the `pb.Direction` value."""
    return encoded_to_chunks(encode_tensor(t, spec), meta, chunk_bytes)


# --- the wire form of a chunk, without protobuf's copies of the payload ------------------------------------
# A TensorChunk is at most two length-delimited fields, in field order: meta (1), then data (2), each
# written only when non-empty. A field's key byte is (number << 3) | 2; its length follows as a varint.

_META_KEY = (1 << 3) | 2
_DATA_KEY = (2 << 3) | 2


def _field_head(key: int, length: int) -> bytes:
    out = bytearray([key])
    while length >= 0x80:
        out.append((length & 0x7F) | 0x80)
        length >>= 7
    out.append(length)
    return bytes(out)


def chunk_frames(first: pb.TensorMeta, payload: Payload, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """The serialized chunks of one tensor whose metadata is `first` (from `tensor_meta`): the same bytes as
    `SerializeToString` of each chunk `encoded_to_chunks` yields, with one copy of the payload instead of
    three. A gRPC stream with no request serializer sends them as they are."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    data = memoryview(payload).cast("B")
    meta = first.SerializeToString()
    head = _field_head(_META_KEY, len(meta)) + meta
    for offset in range(0, max(data.nbytes, 1), chunk_bytes):
        part = data[offset:offset + chunk_bytes]
        parts = [head] if offset == 0 else []
        if part.nbytes:
            parts += [_field_head(_DATA_KEY, part.nbytes), part]
        yield b"".join(parts)


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it) of the varint at `pos`; (-1, pos) when it is cut off or too long."""
    value = shift = 0
    end = min(len(buf), pos + 10)
    while pos < end:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    return -1, pos


@dataclass(frozen=True, slots=True)
class WireChunk:
    """A `pb.TensorChunk` as `parse_chunk` read it: `data` is a view of the received message, not a copy.
    Answers the two questions the receivers ask of a chunk (`HasField("meta")`, then `meta` and `data`)."""

    meta: pb.TensorMeta | None
    data: memoryview

    def HasField(self, name: str) -> bool:  # noqa: N802  (protobuf's spelling, so either kind of chunk is fed)
        if name != "meta":
            raise ValueError(f"a TensorChunk has no message field {name!r}")
        return self.meta is not None


Chunk = pb.TensorChunk | WireChunk
"""What the assembler and the mailbox take: a protobuf chunk, or one `parse_chunk` read."""


def parse_chunk(message: bytes) -> Chunk:
    """The request deserializer of Transfer. A message laid out as `chunk_frames` writes it (meta, data, each
    at most once and in that order, nothing else) becomes a `WireChunk` whose payload is not copied; protobuf
    parses anything else, so malformed messages fail exactly as they would there."""
    n, pos, meta = len(message), 0, None
    if n and message[0] == _META_KEY:
        length, start = _varint(message, 1)
        if length < 0 or start + length > n:
            return pb.TensorChunk.FromString(message)
        meta, pos = pb.TensorMeta.FromString(message[start:start + length]), start + length
    data = memoryview(b"")
    if pos < n and message[pos] == _DATA_KEY:
        length, start = _varint(message, pos + 1)
        if length < 0 or start + length > n:
            return pb.TensorChunk.FromString(message)
        data, pos = memoryview(message)[start:start + length], start + length
    if pos != n:
        return pb.TensorChunk.FromString(message)
    return WireChunk(meta=meta, data=data)


@dataclass(frozen=True, eq=False)
class AssembledTensor:
    meta: pb.TensorMeta
    """The first chunk's metadata."""
    tensor: torch.Tensor
    wire_bytes: int
    """Payload bytes received for it."""

    @property
    def spec(self) -> CodecSpec:
        return CodecSpec.from_proto(self.meta.codec, self.meta.codec_params)


class ChunkAssembler:
    """Feeds on the chunks of one stream; returns each tensor as its last chunk arrives. Not thread-safe:
    one assembler per stream."""

    def __init__(self, limits: WireLimits | None = None) -> None:
        self.limits = limits or WireLimits()
        self._meta: pb.TensorMeta | None = None
        self._spec: CodecSpec | None = None
        self._dtype: torch.dtype | None = None
        self._buf: np.ndarray | None = None
        self._filled = 0
        self._crc = 0

    @property
    def pending(self) -> bool:
        """Whether a tensor has started and not yet completed."""
        return self._meta is not None

    def finish(self) -> None:
        """Call at the end of the stream: CodecError if it stopped inside a tensor."""
        if self._meta is not None:
            meta, filled = self._meta, self._filled
            self._reset()
            raise CodecError(f"stream ended inside tensor {meta.name!r} (step {meta.step}, micro-batch "
                             f"{meta.micro_batch}) after {filled} of {meta.total_bytes} payload bytes: truncated")

    def feed(self, chunk: Chunk) -> AssembledTensor | None:
        data = chunk.data
        if len(data) > self.limits.max_chunk_bytes:
            self._reset()
            raise CodecError(f"chunk of {len(data)} bytes exceeds the limit of {self.limits.max_chunk_bytes}")
        if chunk.HasField("meta"):
            if self._meta is not None:
                filled, total = self._filled, self._meta.total_bytes
                self._reset()
                raise CodecError(f"a new tensor's metadata arrived after {filled} of {total} payload bytes of the "
                                 f"previous one: that tensor was truncated")
            self._start(chunk.meta)
        elif self._meta is None:
            raise CodecError("chunk without metadata at the start of a tensor: the first chunk must carry `meta`")
        assert self._buf is not None
        end = self._filled + len(data)
        if end > len(self._buf):
            total = len(self._buf)
            self._reset()
            raise CodecError(f"chunks overflow the tensor: {end} payload bytes received, metadata says {total}")
        self._buf[self._filled:end] = np.frombuffer(data, dtype=np.uint8)  # numpy copies without the GIL
        self._crc = crc32(data, self._crc)
        self._filled = end
        if end < len(self._buf):
            return None
        return self._complete()

    def _start(self, meta: pb.TensorMeta) -> None:
        dtype = dtype_from_proto(meta.dtype)
        spec = CodecSpec.from_proto(meta.codec, meta.codec_params)
        check_tensor_meta(list(meta.shape), dtype, spec, meta.total_bytes, self.limits)
        self._meta, self._spec, self._dtype = meta, spec, dtype
        # not zero-filled: `feed` writes every byte before `_complete` reads any
        self._buf = torch.empty(meta.total_bytes, dtype=torch.uint8).numpy()
        self._filled = 0
        self._crc = 0

    def _complete(self) -> AssembledTensor:
        meta, spec, dtype, buf, crc = self._meta, self._spec, self._dtype, self._buf, self._crc
        assert meta is not None and spec is not None and dtype is not None and buf is not None
        self._reset()
        if crc != meta.checksum:
            raise CodecError(f"checksum mismatch for tensor {meta.name!r} (step {meta.step}, micro-batch "
                             f"{meta.micro_batch}): payload CRC-32 {crc:#010x}, metadata says {meta.checksum:#010x}; "
                             f"the payload was corrupted in transit")
        tensor = get_codec(spec).decode(memoryview(buf), list(meta.shape), dtype)
        return AssembledTensor(meta=meta, tensor=tensor, wire_bytes=len(buf))

    def _reset(self) -> None:
        self._meta = self._spec = self._dtype = self._buf = None
        self._filled = self._crc = 0
