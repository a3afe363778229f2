"""Encode/decode one tensor under a `CodecSpec`: the entry points the transport and error feedback use."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from atoll.compression.codec import Codec, Payload, codec_class, numel_of
from atoll.compression.dtypes import WIRE_DTYPES, element_size
from atoll.compression.errors import CodecError
from atoll.compression.limits import WireLimits
from atoll.compression.spec import CodecSpec
from atoll.compression.zstd_stage import ZstdStage


@lru_cache(maxsize=256)
def get_codec(spec: CodecSpec) -> Codec:
    """The codec `spec` names, followed by the zstd stage when `spec.zstd_level > 0`."""
    codec = codec_class(spec.codec_id)(spec)
    return ZstdStage(codec, spec.zstd_level) if spec.zstd_level > 0 else codec


@dataclass(frozen=True, eq=False)
class EncodedTensor:
    """A tensor as it crosses the wire."""

    payload: Payload
    """The encoded bytes (a bytes-like buffer; `bytes(payload)` copies)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    """dtype of the decoded tensor."""
    spec: CodecSpec
    raw_bytes: int
    """Bytes of the tensor before encoding."""

    @property
    def wire_bytes(self) -> int:
        return memoryview(self.payload).nbytes

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else 1.0


def encode_tensor(t: torch.Tensor, spec: CodecSpec) -> EncodedTensor:
    """`t` under `spec`. The identity codec's payload is a view of `t` itself (no copy): do not modify `t`
    until the payload has been sent."""
    codec = get_codec(spec)
    payload = codec.encode(t)
    return EncodedTensor(payload=payload, shape=tuple(t.shape), dtype=t.dtype, spec=spec,
                         raw_bytes=t.numel() * t.element_size())


def check_tensor_meta(shape: Sequence[int], dtype: torch.dtype, spec: CodecSpec, payload_bytes: int,
                      limits: WireLimits) -> None:
    """Everything about an incoming tensor that can be checked before allocating for it."""
    if len(shape) > limits.max_dims:
        raise CodecError(f"tensor has {len(shape)} dimensions, more than the limit of {limits.max_dims}")
    numel = numel_of(shape)
    if numel > limits.max_elements:
        raise CodecError(f"tensor of shape {tuple(shape)} has {numel} elements, more than the limit of "
                         f"{limits.max_elements}; raise WireLimits.max_elements or send smaller tensors")
    if dtype not in WIRE_DTYPES:
        raise CodecError(f"dtype {dtype} cannot be carried on the wire")
    raw = numel * element_size(dtype)
    if raw > limits.max_tensor_bytes:
        raise CodecError(f"tensor of shape {tuple(shape)} {dtype} is {raw} bytes, more than the limit of "
                         f"{limits.max_tensor_bytes}; raise WireLimits.max_tensor_bytes or send smaller tensors")
    if payload_bytes > limits.max_tensor_bytes:
        raise CodecError(f"payload of {payload_bytes} bytes exceeds the limit of {limits.max_tensor_bytes}")
    codec = get_codec(spec)
    if dtype not in codec.accepts:
        raise CodecError(f"codec {spec.codec} cannot carry dtype {dtype}")
    if spec.zstd_level == 0:
        expected = codec.wire_size(shape, dtype)
        if payload_bytes != expected:
            raise CodecError(f"{spec.label()} payload for shape {tuple(shape)} {dtype} must be {expected} bytes, "
                             f"the metadata says {payload_bytes}")


def decode_tensor(payload: Payload, shape: Sequence[int], dtype: torch.dtype, spec: CodecSpec,
                  limits: WireLimits | None = None) -> torch.Tensor:
    """The tensor `payload` encodes; CodecError on anything that does not add up."""
    limits = limits or WireLimits()
    check_tensor_meta(shape, dtype, spec, memoryview(payload).nbytes, limits)
    return get_codec(spec).decode(payload, shape, dtype)
