"""Codecs that change only the element type: identity, fp16 and bf16."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from atoll.compression.codec import Codec, Payload, is_readonly, register, tensor_bytes
from atoll.compression.dtypes import WIRE_DTYPES, element_size, unit_roundoff
from atoll.v1 import atoll_pb2 as pb

FP16_MAX = 65504.0
_TINY = 2.0 ** -24  # the smallest fp16 subnormal: the absolute error floor of going through fp16


def _owned(t: torch.Tensor, payload: Payload) -> torch.Tensor:
    """`t`, copied if it still aliases a read-only payload (decoded tensors must be writable)."""
    return t.clone() if is_readonly(payload) else t


def _max_abs(t: torch.Tensor) -> float:
    return float(t.detach().abs().max().float()) if t.numel() else 0.0


class _Cast(Codec):
    wire: torch.dtype

    def encode(self, t: torch.Tensor) -> Payload:
        flat = self._flat(t)
        return tensor_bytes(self._convert(flat) if flat.dtype != self.wire else flat)

    def _convert(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.to(self.wire)

    def decode(self, payload: Payload, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        buf, numel = self._check_decode(payload, shape, dtype)
        if numel == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        wire = buf.view(self.wire)
        out = wire.to(dtype) if dtype != self.wire else _owned(wire, payload)
        return out.view(tuple(shape))

    def payload_size(self, numel: int, dtype: torch.dtype) -> int:
        return numel * element_size(self.wire)


@register
class IdentityCodec(_Cast):
    """The tensor's own bytes, in its own dtype (also int32/int64). Lossless."""

    id = pb.CODEC_IDENTITY
    name = "identity"
    accepts = frozenset(WIRE_DTYPES)

    def encode(self, t: torch.Tensor) -> Payload:
        return tensor_bytes(self._flat(t))

    def decode(self, payload: Payload, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        buf, numel = self._check_decode(payload, shape, dtype)
        if numel == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        return _owned(buf.view(dtype), payload).view(tuple(shape))

    def payload_size(self, numel: int, dtype: torch.dtype) -> int:
        return numel * element_size(dtype)

    def error_bound(self, t: torch.Tensor) -> float:
        return 0.0

    @property
    def expected_error(self) -> float:
        return 0.0


@register
class Fp16Codec(_Cast):
    """float16 on the wire. Values beyond +-65504 are clamped to +-65504 (not scaled), so an outlier costs
    only itself; inf and NaN pass through unchanged."""

    id = pb.CODEC_FP16
    name = "fp16"
    wire = torch.float16

    def _convert(self, flat: torch.Tensor) -> torch.Tensor:
        half = flat.to(torch.float16)
        if half.numel():
            lo, hi = torch.aminmax(half)
            # one pass over the (smaller) result decides; only tensors with inf, NaN or overflow pay for clamping
            if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
                clamped = flat.clamp(-FP16_MAX, FP16_MAX)
                half = torch.where(torch.isfinite(flat), clamped, flat).to(torch.float16)
        return half

    def error_bound(self, t: torch.Tensor) -> float:
        m = _max_abs(t)
        return max(0.0, m - FP16_MAX) + m * (unit_roundoff(torch.float16) + unit_roundoff(t.dtype)) + _TINY

    @property
    def expected_error(self) -> float:
        return 2.0 ** -12


@register
class Bf16Codec(_Cast):
    """bfloat16 on the wire: the range of float32, 8 bits of mantissa."""

    id = pb.CODEC_BF16
    name = "bf16"
    wire = torch.bfloat16

    def error_bound(self, t: torch.Tensor) -> float:
        m = _max_abs(t)
        return m * (unit_roundoff(torch.bfloat16) + unit_roundoff(t.dtype)) + _TINY

    @property
    def expected_error(self) -> float:
        return 2.0 ** -9
