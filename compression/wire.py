"""A tensor as a stream of `pb.TensorChunk`s, and the assembler that turns chunks back into tensors.

The first chunk of a tensor carries `meta` (shape, dtype, codec, total payload bytes, CRC-32 of the
payload); every chunk carries up to `chunk_bytes` of payload. A stream may carry several tensors back to
back. The assembler checks the metadata against `WireLimits` before allocating one buffer of exactly
`total_bytes`, copies each chunk into it once, verifies the checksum and decodes in place.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

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


def encoded_to_chunks(enc: EncodedTensor, meta: Mapping[str, Any],
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.TensorChunk]:
    """The chunks of an already encoded tensor (for callers that encode ahead, e.g. error feedback)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    data = memoryview(enc.payload).cast("B")
    codec_id, params = enc.spec.to_proto()
    first = pb.TensorMeta(**_routing(meta), shape=list(enc.shape), dtype=dtype_to_proto(enc.dtype), codec=codec_id,
                          codec_params=params, total_bytes=data.nbytes, checksum=zlib.crc32(data))
    yield pb.TensorChunk(meta=first, data=bytes(data[:chunk_bytes]))
    for offset in range(chunk_bytes, data.nbytes, chunk_bytes):
        yield pb.TensorChunk(data=bytes(data[offset:offset + chunk_bytes]))


def tensor_to_chunks(t: torch.Tensor, spec: CodecSpec, meta: Mapping[str, Any],
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.TensorChunk]:
    """Encode `t` under `spec` and yield its chunks. `meta` holds the routing fields (META_FIELDS);
    `direction` may be "forward"/"backward" or the `pb.Direction` value."""
    return encoded_to_chunks(encode_tensor(t, spec), meta, chunk_bytes)


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
        self._buf: bytearray | None = None
        self._filled = 0

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

    def feed(self, chunk: pb.TensorChunk) -> AssembledTensor | None:
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
        self._buf[self._filled:end] = data
        self._filled = end
        if end < len(self._buf):
            return None
        return self._complete()

    def _start(self, meta: pb.TensorMeta) -> None:
        dtype = dtype_from_proto(meta.dtype)
        spec = CodecSpec.from_proto(meta.codec, meta.codec_params)
        check_tensor_meta(list(meta.shape), dtype, spec, meta.total_bytes, self.limits)
        self._meta, self._spec, self._dtype = meta, spec, dtype
        self._buf = bytearray(meta.total_bytes)
        self._filled = 0

    def _complete(self) -> AssembledTensor:
        meta, spec, dtype, buf = self._meta, self._spec, self._dtype, self._buf
        assert meta is not None and spec is not None and dtype is not None and buf is not None
        self._reset()
        crc = zlib.crc32(buf)
        if crc != meta.checksum:
            raise CodecError(f"checksum mismatch for tensor {meta.name!r} (step {meta.step}, micro-batch "
                             f"{meta.micro_batch}): payload CRC-32 {crc:#010x}, metadata says {meta.checksum:#010x}; "
                             f"the payload was corrupted in transit")
        tensor = get_codec(spec).decode(buf, list(meta.shape), dtype)
        return AssembledTensor(meta=meta, tensor=tensor, wire_bytes=len(buf))

    def _reset(self) -> None:
        self._meta = self._spec = self._dtype = self._buf = None
        self._filled = 0
