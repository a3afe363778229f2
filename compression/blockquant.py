"""Block-wise absmax quantisation: int8 and int4 (two values per byte).

Payload layout (little-endian): `[scales: bfloat16 x n_blocks][codes]`. The tensor is flattened and
zero-padded to whole blocks; each block's scale is absmax/levels rounded *up* to bfloat16 (bfloat16 keeps
float32's range, and rounding up keeps every code within +-levels without a clamping pass). int8 codes are
int8 in [-127, 127]; int4 codes are q+8 in [1, 15], element 2i in the low nibble of byte i and 2i+1 in the
high nibble. A block holding inf or NaN decodes as non-finite (NaN or inf) throughout, so an overflow
is never hidden.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

import torch

from atoll.compression.codec import Codec, Payload, register, tensor_bytes
from atoll.compression.dtypes import unit_roundoff
from atoll.v1 import atoll_pb2 as pb

_SCALE_ROUNDING = 2.0 ** -7  # a scale rounded up to bfloat16 is at most this much (relative) too large


class _BlockQuant(Codec):
    levels: int

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def _blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def _code_bytes(self, padded: int) -> int:
        raise NotImplementedError

    def payload_size(self, numel: int, dtype: torch.dtype) -> int:
        nb = self._blocks(numel)
        return 2 * nb + self._code_bytes(nb * self.block_size)

    def _scaled(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bfloat16 scales [nb], float32 values/scale rounded to integers [nb, block])."""
        n, bs = flat.numel(), self.block_size
        nb = self._blocks(n)
        if flat.dtype != torch.float32:
            flat = flat.float()  # reductions in half precision are far slower on CPU than a float32 pass
        if nb * bs != n:
            padded = flat.new_zeros(nb * bs)
            padded[:n] = flat
            flat = padded
        x = flat.view(nb, bs)
        absmax = torch.maximum(x.amax(dim=1), x.amin(dim=1).neg_())  # two reductions beat abs().amax()
        exact = absmax.div_(self.levels)
        scale = exact.to(torch.bfloat16)
        low = scale.float() < exact
        if bool(low.any()):
            scale.view(torch.int16)[low] += 1  # next bfloat16 up: scales are >= 0, so the bit pattern is ordered
        s = scale.float()
        inv = torch.where(s > 0, s.reciprocal(), torch.zeros_like(s))
        q = torch.mul(x, inv.unsqueeze(1))
        q.round_()
        return scale, q

    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor, numel: int, shape: Sequence[int],
                    dtype: torch.dtype) -> torch.Tensor:
        """codes: float32 [nb, block] (already centred), scales: bfloat16 [nb]."""
        codes.mul_(scales.float().unsqueeze(1))
        out = codes.view(-1)[:numel]
        return out.to(dtype).view(tuple(shape)) if dtype != torch.float32 else out.reshape(tuple(shape))

    def error_bound(self, t: torch.Tensor) -> float:
        if t.numel() == 0:
            return 0.0
        m = float(t.detach().abs().max().float())
        return m * ((1 + _SCALE_ROUNDING) / (2 * self.levels) * (1 + 1e-5) + unit_roundoff(t.dtype)) + 1e-30

    @property
    def expected_error(self) -> float:
        # uniform rounding error (step / sqrt(12)) with step = E[block absmax] / levels, for N(0, 1) data
        bs = self.block_size
        if bs == 1:
            return 0.0
        absmax = NormalDist().inv_cdf(1 - 0.5 / (bs + 1))
        return absmax / self.levels / math.sqrt(12)


@register
class Int8BlockCodec(_BlockQuant):
    """int8 codes with one bfloat16 absmax scale per block (default 64: 3.88x smaller than float32)."""

    id = pb.CODEC_INT8_BLOCK
    name = "int8"
    levels = 127

    def _code_bytes(self, padded: int) -> int:
        return padded

    def encode(self, t: torch.Tensor) -> Payload:
        flat = self._flat(t)
        if flat.numel() == 0:
            return b""
        scale, q = self._scaled(flat)
        nb = scale.numel()
        out = torch.empty(self.payload_size(flat.numel(), flat.dtype), dtype=torch.uint8, device=flat.device)
        out[: 2 * nb].view(torch.bfloat16).copy_(scale)
        out[2 * nb:].view(torch.int8).view(q.shape).copy_(q.to(torch.int8))
        return tensor_bytes(out)

    def decode(self, payload: Payload, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        buf, numel = self._check_decode(payload, shape, dtype)
        if numel == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        nb = self._blocks(numel)
        scales = buf[: 2 * nb].view(torch.bfloat16)
        codes = buf[2 * nb:].view(torch.int8).view(nb, self.block_size).to(torch.float32)
        return self._dequantize(codes, scales, numel, shape, dtype)


@register
class Int4BlockCodec(_BlockQuant):
    """int4 codes in [-7, 7], two per byte, one bfloat16 absmax scale per block (default 64: 7.5x)."""

    id = pb.CODEC_INT4_BLOCK
    name = "int4"
    levels = 7

    def _code_bytes(self, padded: int) -> int:
        return (padded + 1) // 2

    def encode(self, t: torch.Tensor) -> Payload:
        flat = self._flat(t)
        if flat.numel() == 0:
            return b""
        scale, q = self._scaled(flat)
        nb = scale.numel()
        q = q.view(-1).add_(8).to(torch.uint8)
        if q.numel() % 2:
            q = torch.cat([q, q.new_full((1,), 8)])
        pairs = q.view(-1, 2)
        out = torch.empty(self.payload_size(flat.numel(), flat.dtype), dtype=torch.uint8, device=flat.device)
        out[: 2 * nb].view(torch.bfloat16).copy_(scale)
        codes = out[2 * nb:]
        torch.bitwise_left_shift(pairs[:, 1], 4, out=codes)
        codes.bitwise_or_(pairs[:, 0])
        return tensor_bytes(out)

    def decode(self, payload: Payload, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        buf, numel = self._check_decode(payload, shape, dtype)
        if numel == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        nb = self._blocks(numel)
        padded = nb * self.block_size
        scales = buf[: 2 * nb].view(torch.bfloat16)
        packed = buf[2 * nb:]
        nibbles = torch.empty(packed.numel(), 2, dtype=torch.float32)
        nibbles[:, 0] = packed.bitwise_and(15)
        nibbles[:, 1] = packed.bitwise_right_shift(4)
        codes = nibbles.view(-1)[:padded].sub_(8).view(nb, self.block_size)
        return self._dequantize(codes, scales, numel, shape, dtype)
