"""A randomized Hadamard rotation, then 2-4-bit codes with one scale per group: a stage boundary's codec.

Incoherence processing as QuIP# (Tseng et al., 2024) and QuaRot (Ashkboos et al., 2024) apply it before
low-bit quantization: a random orthogonal rotation spreads an activation's outlier channels over a whole
block, so a block's absmax (and with it the quantization step) falls from the outlier's size towards the
block's RMS. Here the rotation is H D: D flips signs at random (seeded from `CodecSpec.seed`, so sender and
receiver draw the same flips with no bytes on the wire), H is the orthonormal Walsh-Hadamard matrix of
`ROTATION` elements, applied by the fast transform (log2(ROTATION) vectorised butterfly passes). It is its own
inverse up to D, so decoding is the same transform the other way round. Forward activations and backward
activation-gradients take it alike.

The flattened tensor is zero-padded to whole rotation blocks of `ROTATION` (256) elements and rotated; the
rotated stream is cut into groups of `CodecSpec.block_size` elements (zero-padded to a whole group), each with
a bfloat16 step s = absmax / 2**(bits - 1) rounded up; a value x is coded c = clamp(floor(x / s) + 2**(bits-1),
0, 2**bits - 1) and decoded (c - 2**(bits - 1) + 1/2) s (uniform mid-rise: every code is a level, none
wasted on an exact zero), at most s / 2 off.

Payload: `[steps: bfloat16 x groups][codes: `bits` bits each, LSB first, zero-padded to a whole byte]`. Decoding
refuses a step that is negative, inf or NaN and set padding bits; a tensor holding inf or NaN is refused at
encoding (a rotation would smear it over its whole block).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cached_property
from statistics import NormalDist

import torch

from atoll.compression.codec import Codec, Payload, register, tensor_bytes
from atoll.compression.dtypes import unit_roundoff
from atoll.compression.errors import CodecError
from atoll.compression.sparse import _pack, _unpack, _unpack_bits
from atoll.v1 import atoll_pb2 as pb

ROTATION = 256
"""Elements per rotation block (a power of two): a d_model of 768 or 4096 is whole blocks of it."""
_SCALE_ROUNDING = 2.0 ** -7  # a step rounded up to bfloat16 is at most this much (relative) too large
_SLICE_BLOCKS = 2048  # rotation blocks transformed at once: temporaries of a few MiB

LOSS_COST = {"hadamard/4b/64": 0.007}
"""Measured loss cost by spec label: the tiny job's mean loss over the last 5 of 30 steps on two stages through
this codec, over identity's, minus one (2.8952 against 2.8761; tests/test_wan_codecs.py trains it). The link
policy's and planner's quality-aware choice is to read it (issue 39, item 2)."""



def fwht(x: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform of each row of `x` [rows, 2**k] (float32; a new tensor).
    Symmetric and orthogonal, so it is its own inverse."""
    rows, n = x.shape
    h = 1
    while h < n:
        y = x.view(rows, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        x = torch.stack((a + b, a - b), dim=2).view(rows, n)
        h *= 2
    return x * (1.0 / math.sqrt(n))


@register
class HadamardCodec(Codec):
    """Randomized Hadamard rotation of 256-element blocks, then `bits`-bit codes with a bfloat16 step per group
    (4 bits, groups of 64: 7.5x smaller than float32; 2 bits, groups of 128: 15x)."""

    id = pb.CODEC_HADAMARD
    name = "hadamard"

    @property
    def bits(self) -> int:
        return self.spec.bits

    @cached_property
    def _signs(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.spec.seed)
        return torch.randint(0, 2, (ROTATION,), generator=g).mul_(2).sub_(1).float()

    def _sizes(self, numel: int) -> tuple[int, int, int]:
        """(rotated elements, groups, coded elements) of a tensor of `numel` elements."""
        rotated = -(-numel // ROTATION) * ROTATION
        groups = -(-rotated // self.spec.block_size)
        return rotated, groups, groups * self.spec.block_size

    def payload_size(self, numel: int, dtype: torch.dtype) -> int:
        if numel == 0:
            return 0
        _, groups, coded = self._sizes(numel)
        return 2 * groups + -(-coded * self.bits // 8)

    def _rotate(self, flat: torch.Tensor, rotated: int) -> torch.Tensor:
        """float32 H D x of the flattened tensor, zero-padded to `rotated` elements."""
        x = torch.zeros(rotated, dtype=torch.float32, device=flat.device)
        x[: flat.numel()] = flat
        x = x.view(-1, ROTATION).mul_(self._signs.to(flat.device))
        return torch.cat([fwht(x[r: r + _SLICE_BLOCKS]) for r in range(0, x.shape[0], _SLICE_BLOCKS)]).view(-1)

    def _steps(self, y: torch.Tensor, groups: int, coded: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rotated values zero-padded to whole groups [groups, block], their bfloat16 steps rounded up)."""
        if coded > y.numel():
            y = torch.cat([y, y.new_zeros(coded - y.numel())])
        y = y.view(groups, self.spec.block_size)
        exact = y.abs().amax(dim=1) / (1 << (self.bits - 1))
        step = exact.to(torch.bfloat16)
        # next bfloat16 up where rounding went down (steps are >= 0: their bit patterns are ordered)
        step.view(torch.int16).add_((step.float() < exact).to(torch.int16))
        return y, step

    def encode(self, t: torch.Tensor) -> Payload:
        flat = self._flat(t)
        n = flat.numel()
        if n == 0:
            return b""
        if not bool(torch.isfinite(flat).all()):
            raise CodecError(f"hadamard cannot encode non-finite values: the tensor of shape {tuple(t.shape)} holds "
                             f"inf or NaN (a rotation would spread it over its block; find where it overflowed)")
        rotated, groups, coded = self._sizes(n)
        y, step = self._steps(self._rotate(flat, rotated), groups, coded)
        s = step.float().unsqueeze(1)
        half = 1 << (self.bits - 1)
        inv = torch.where(s > 0, s.reciprocal(), torch.zeros_like(s))
        codes = torch.floor(y * inv).add_(half).clamp_(0, 2 * half - 1).to(torch.int32).view(-1)
        out = torch.cat([step.view(torch.uint8), _pack(codes, self.bits)])
        assert out.numel() == self.payload_size(n, flat.dtype)
        return tensor_bytes(out)

    def decode(self, payload: Payload, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        buf, n = self._check_decode(payload, shape, dtype)
        if n == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        rotated, groups, coded = self._sizes(n)
        step = buf[: 2 * groups].view(torch.bfloat16).float()
        if not bool(torch.isfinite(step).all()) or bool((step < 0).any()):
            raise CodecError(f"hadamard payload for shape {tuple(shape)}: a group's step is negative, inf or NaN "
                             f"(corrupt payload)")
        code_bytes = buf[2 * groups:]
        if bool(_unpack_bits(code_bytes)[coded * self.bits:].any()):
            raise CodecError(f"hadamard payload for shape {tuple(shape)}: padding bits after the last code are set "
                             f"(corrupt payload)")
        half = 1 << (self.bits - 1)
        y = _unpack(code_bytes, coded, self.bits).view(groups, -1).float().sub_(half - 0.5).mul_(step.unsqueeze(1))
        x = y.view(-1)[:rotated].view(-1, ROTATION)
        x = torch.cat([fwht(x[r: r + _SLICE_BLOCKS]) for r in range(0, x.shape[0], _SLICE_BLOCKS)])
        x = x.mul_(self._signs).view(-1)[:n]
        return x.to(dtype).view(tuple(shape))

    def error_bound(self, t: torch.Tensor) -> float:
        """Each rotated value is off by at most half its group's step; the inverse rotation is orthonormal, so
        an element's error is at most the L2 norm of its rotation block's error."""
        flat = t.detach().reshape(-1)
        n = flat.numel()
        if n == 0:
            return 0.0
        rotated, groups, coded = self._sizes(n)
        y, step = self._steps(self._rotate(flat.float(), rotated), groups, coded)
        half_step = (step.float() / 2).repeat_interleave(self.spec.block_size)[:rotated].view(-1, ROTATION)
        block_err = half_step.square().sum(1).sqrt().max()
        m = float(flat.abs().max().float())
        return float(block_err) * (1 + 1e-4) + m * (unit_roundoff(t.dtype) + 1e-6) + 1e-30

    @property
    def expected_error(self) -> float:
        # rotated N(0, 1) data stay N(0, 1); uniform rounding error step / sqrt(12), step = E[group absmax] /
        # 2**(bits - 1)
        bs = self.spec.block_size
        absmax = NormalDist().inv_cdf(1 - 0.5 / (bs + 1))
        return absmax / (1 << (self.bits - 1)) / math.sqrt(12)
