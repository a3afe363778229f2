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


_SLICE = 1 << 19  # elements per slice: temporaries stay a few MiB (cache-resident, no page-faulting allocations)


class _BlockQuant(Codec):
    levels: int

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def _blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def _code_bytes(self, padded: int) -> int:
        raise NotImplementedError

    def _store(self, codes: torch.Tensor, b0: int, b1: int, q: torch.Tensor) -> None:
        """Write the rounded values `q` [b1 - b0, block] of blocks [b0, b1) into the code region."""
        raise NotImplementedError

    def _load(self, codes: torch.Tensor, b0: int, b1: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 codes [b1 - b0, block], centred on zero, of blocks [b0, b1) (written into `out` if given)."""
        raise NotImplementedError

    def payload_size(self, numel: int, dtype: torch.dtype) -> int:
        nb = self._blocks(numel)
        return 2 * nb + self._code_bytes(nb * self.block_size)

    def _rows(self) -> int:
        # blocks per slice; even, so that a slice never starts inside an int4 byte
        return max(2, (_SLICE // self.block_size) & ~1)

    def encode(self, t: torch.Tensor) -> Payload:
        flat = self._flat(t)
        n, bs = flat.numel(), self.block_size
        if n == 0:
            return b""
        nb = self._blocks(n)
        out = torch.empty(self.payload_size(n, flat.dtype), dtype=torch.uint8, device=flat.device)
        scales, codes = out[: 2 * nb].view(torch.bfloat16), out[2 * nb:]
        rows = self._rows()
        for b0 in range(0, nb, rows):
            b1 = min(nb, b0 + rows)
            part = flat[b0 * bs: b1 * bs]
            if part.dtype != torch.float32 or part.numel() != (b1 - b0) * bs:
                x = torch.zeros((b1 - b0) * bs, dtype=torch.float32, device=flat.device)
                x[: part.numel()] = part  # upcast (and zero-pad the last block) in one copy
            else:
                x = part
            scale, q = self._quantize(x.view(b1 - b0, bs))
            scales[b0:b1] = scale
            self._store(codes, b0, b1, q)
        return tensor_bytes(out)

    def decode(self, payload: Payload, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        buf, n = self._check_decode(payload, shape, dtype)
        out = torch.empty(n, dtype=dtype)
        if n == 0:
            return out.view(tuple(shape))
        nb, bs = self._blocks(n), self.block_size
        scales, codes = buf[: 2 * nb].view(torch.bfloat16), buf[2 * nb:]
        rows = self._rows()
        for b0 in range(0, nb, rows):
            b1 = min(nb, b0 + rows)
            e1 = min(n, b1 * bs)
            scale = scales[b0:b1].float().unsqueeze(1)
            if dtype == torch.float32 and e1 == b1 * bs:
                # straight into the output: no temporary
                self._load(codes, b0, b1, out[b0 * bs: e1].view(b1 - b0, bs)).mul_(scale)
            else:
                out[b0 * bs: e1] = self._load(codes, b0, b1).mul_(scale).view(-1)[: e1 - b0 * bs]
        return out.view(tuple(shape))

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bfloat16 scales [nb], float32 values/scale rounded to integers [nb, block]) of float32 x [nb, block]."""
        absmax = torch.maximum(x.amax(dim=1), x.amin(dim=1).neg_())  # two reductions beat abs().amax()
        exact = absmax.div_(self.levels)
        scale = exact.to(torch.bfloat16)
        # next bfloat16 up where rounding went down: scales are >= 0, so their bit patterns are ordered
        scale.view(torch.int16).add_((scale.float() < exact).to(torch.int16))
        s = scale.float()
        inv = torch.where(s > 0, s.reciprocal(), torch.zeros_like(s))
        q = torch.mul(x, inv.unsqueeze(1))
        q.round_()
        return scale, q

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

    def _store(self, codes: torch.Tensor, b0: int, b1: int, q: torch.Tensor) -> None:
        bs = self.block_size
        codes[b0 * bs: b1 * bs].view(torch.int8).view(q.shape).copy_(q.to(torch.int8))

    def _load(self, codes: torch.Tensor, b0: int, b1: int, out: torch.Tensor | None = None) -> torch.Tensor:
        bs = self.block_size
        q = codes[b0 * bs: b1 * bs].view(torch.int8).view(b1 - b0, bs)
        return q.to(torch.float32) if out is None else out.copy_(q)


@register
class Int4BlockCodec(_BlockQuant):
    """int4 codes in [-7, 7], two per byte, one bfloat16 absmax scale per block (default 64: 7.5x)."""

    id = pb.CODEC_INT4_BLOCK
    name = "int4"
    levels = 7

    def _code_bytes(self, padded: int) -> int:
        return (padded + 1) // 2

    def _store(self, codes: torch.Tensor, b0: int, b1: int, q: torch.Tensor) -> None:
        bs = self.block_size
        q = q.view(-1).add_(8).to(torch.uint8)
        if q.numel() % 2:  # only the last slice: pad its final byte's high nibble with a zero code
            q = torch.cat([q, q.new_full((1,), 8)])
        pairs = q.view(-1, 2)
        first = b0 * bs // 2
        dst = codes[first: first + pairs.shape[0]]
        torch.bitwise_left_shift(pairs[:, 1], 4, out=dst)
        dst.bitwise_or_(pairs[:, 0])

    def _load(self, codes: torch.Tensor, b0: int, b1: int, out: torch.Tensor | None = None) -> torch.Tensor:
        bs = self.block_size
        count = (b1 - b0) * bs
        packed = codes[b0 * bs // 2: b0 * bs // 2 + (count + 1) // 2]
        if out is None or count % 2:
            nibbles = torch.empty(packed.numel(), 2, dtype=torch.float32)
        else:
            nibbles = out.view(-1, 2)
        nibbles[:, 0] = packed.bitwise_and(15)
        nibbles[:, 1] = packed.bitwise_right_shift(4)
        codes_f = nibbles.view(-1)[:count].sub_(8).view(b1 - b0, bs)
        if out is not None and codes_f.data_ptr() != out.data_ptr():
            return out.copy_(codes_f)
        return codes_f
