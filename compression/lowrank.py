"""Rank-r factors of a stage-boundary tensor: PowerSGD's subspace iteration applied to activations.

Follows PowerSGD (Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019), taken from weight gradients to the (tokens x d_model) tensors a
pipeline boundary carries, as Subspace Networks (arXiv 2506.01260) argue those tensors are close to low rank.
The tensor is the matrix M [rows, cols] whose columns are its last dimension (rows: every other dimension);
with k = min(rank, rows, cols), one step of subspace iteration from Q [cols, k] gives P = orth(M Q) and
Q' = M^T P, and M ~ P Q'^T. The receiver needs no state: both factors are sent.

- `LowRankCodec` (the registry's, stateless and thread-safe): each tensor starts from a random Q drawn from
  `CodecSpec.seed` and takes `ITERATIONS` steps (a randomized range finder, Halko, Martinsson and Tropp 2011).
- `LowRankLink` (one per link and direction, not thread-safe): PowerSGD proper. It warm-starts each tensor
  from the previous tensor's Q' (one step a tensor: successive micro-batches' activations share their
  principal subspace), and for activation-gradients keeps an error-feedback residual, so what the rank drops
  is sent with a later micro-batch. `reset()` forgets both; call it on a plan change (a new epoch, new
  neighbours or shapes).

The factors' precision is `CodecSpec.bits`:
- 16: `[P: bfloat16 rows x k, row-major][Q': bfloat16 cols x k, row-major]`, 2 k (rows + cols) bytes: for 2,048
  tokens x 768 at rank 16, 90 KiB against 6 MiB of float32 (70x; 35x against bfloat16).
- 4 or 8 (the default is 4): each factor entry as a `bits`-bit mid-rise code (as hadamard's) with a bfloat16
  step per row of P (a token's k coefficients) and per column of Q' (a basis direction), rounded up:
  `[P steps: bfloat16 x rows][Q' steps: bfloat16 x k][P codes, packed LSB first][Q' codes, packed]`, each
  code block zero-padded to a whole byte. At 4 bits, rank 32 of 512 tokens x 256 is 13 KiB against 512 KiB of
  float32 (39x); rank 16 of 2,048 x 768, 28 KiB (222x). The sender's warm start and error feedback see what
  the receiver decodes, quantization included.
The size is a function of the shape, not only of the element count (`wire_size`). Decoding refuses a
non-finite factor or step, a negative step, set padding bits and a product that overflows the output dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from atoll.compression.codec import Codec, Payload, numel_of, register, tensor_bytes
from atoll.compression.sparse import _pack, _unpack, _unpack_bits
from atoll.compression.dtypes import unit_roundoff
from atoll.compression.errors import CodecError
from atoll.compression.spec import CodecSpec
from atoll.compression.tensor import EncodedTensor
from atoll.v1 import atoll_pb2 as pb

ITERATIONS = 2
"""Subspace-iteration steps from a random start (the stateless codec); a warm start takes one."""
_FACTOR_ROUNDING = 2.0 ** -8  # relative error of a factor entry rounded to nearest bfloat16

LOSS_COST = {"lowrank/r16": 0.003}
"""Measured loss cost by spec label: the tiny job's mean loss over the last 5 of 30 steps on two stages through
this codec (rank 16 of d_model 64, bfloat16 factors), over identity's, minus one (2.8837 against 2.8761;
tests/test_wan_codecs.py trains it). `atoll.compression.losscost` holds every codec's."""



def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """(rows, cols) of the matrix a tensor of `shape` is factored as: its last dimension is the columns."""
    cols = shape[-1] if len(shape) else 1
    return (numel_of(shape) // cols if cols else 0), cols


def _orth(p: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(p, mode="reduced").Q


@register
class LowRankCodec(Codec):
    """Rank-`rank` factors in bfloat16 of the (rows x last dimension) matrix, from a seeded random start."""

    id = pb.CODEC_LOWRANK
    name = "lowrank"

    def rank_of(self, shape: Sequence[int]) -> int:
        rows, cols = matrix_shape(shape)
        return min(self.spec.rank, rows, cols)

    def wire_size(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        rows, cols = matrix_shape(shape)
        k, b = self.rank_of(shape), self.spec.bits
        if b == 16 or k == 0:
            return 2 * k * (rows + cols)
        return 2 * (rows + k) + -(-rows * k * b // 8) + -(-cols * k * b // 8)

    def _quantize(self, f: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes int32, bfloat16 steps rounded up) of factor `f` with one step per slice along `dim`."""
        half = 1 << (self.spec.bits - 1)
        exact = f.abs().amax(dim=dim) / half
        step = exact.to(torch.bfloat16)
        step.view(torch.int16).add_((step.float() < exact).to(torch.int16))  # round up (steps are >= 0)
        s = step.float().unsqueeze(dim)
        inv = torch.where(s > 0, s.reciprocal(), torch.zeros_like(s))
        return torch.floor(f * inv).add_(half).clamp_(0, 2 * half - 1).to(torch.int32), step

    def _dequantize(self, codes: torch.Tensor, step: torch.Tensor, dim: int) -> torch.Tensor:
        half = 1 << (self.spec.bits - 1)
        return codes.float().sub_(half - 0.5).mul_(step.float().unsqueeze(dim))

    def payload_size(self, numel: int, dtype: torch.dtype) -> int:
        # without a shape (the link policy's estimate): a flat vector, one row, rank 1
        return self.wire_size((numel,), dtype)

    def start(self, cols: int, k: int, device: torch.device) -> torch.Tensor:
        """The seeded random Q [cols, k] every tensor of this width starts from without a warm start."""
        g = torch.Generator().manual_seed(self.spec.seed)
        return torch.randn(cols, k, generator=g).to(device)

    def factor(self, m: torch.Tensor, q: torch.Tensor, iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(P [rows, k] orthonormal, Q' [cols, k]) after `iterations` subspace-iteration steps from `q`."""
        for _ in range(iterations):
            p = _orth(m @ q)
            q = m.T @ p
        return p, q

    def encode(self, t: torch.Tensor) -> Payload:
        return self.encode_from(t, None)[0]

    def encode_from(self, t: torch.Tensor, q: torch.Tensor | None) -> tuple[Payload, torch.Tensor | None]:
        """(payload, float32 Q' to warm-start the next tensor from) of `t`, from `q` (one step) or, when None
        or of another size, from the seeded start (`ITERATIONS` steps)."""
        flat = self._flat(t)
        shape = tuple(t.shape)
        k = self.rank_of(shape)
        if k == 0:
            return b"", None
        if not bool(torch.isfinite(flat).all()):
            raise CodecError(f"lowrank cannot encode non-finite values: the tensor of shape {shape} holds inf or NaN "
                             f"(find where it overflowed)")
        rows, cols = matrix_shape(shape)
        m = flat.float().view(rows, cols)
        if q is None or q.shape != (cols, k):
            p, q = self.factor(m, self.start(cols, k, m.device), ITERATIONS)
        else:
            p, q = self.factor(m, q.to(m.device), 1)
        if self.spec.bits == 16:
            out = torch.cat([p.reshape(-1), q.reshape(-1)]).to(torch.bfloat16)
            if not bool(torch.isfinite(out).all()):
                raise CodecError(f"lowrank factors of the tensor of shape {shape} overflow bfloat16")
            return tensor_bytes(out.view(torch.uint8)), q
        pc, ps = self._quantize(p, 1)  # a step per row of P
        qc, qs = self._quantize(q, 0)  # a step per column of Q'
        if not bool(torch.isfinite(qs.float()).all()):
            raise CodecError(f"lowrank factors of the tensor of shape {shape} overflow bfloat16")
        b = self.spec.bits
        out = torch.cat([ps.view(torch.uint8), qs.view(torch.uint8), _pack(pc.reshape(-1), b), _pack(qc.reshape(-1), b)])
        return tensor_bytes(out), q

    def decode(self, payload: Payload, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        buf, n = self._check_decode(payload, shape, dtype)
        k = self.rank_of(shape)
        if k == 0:
            return torch.zeros(tuple(shape), dtype=dtype)
        rows, cols = matrix_shape(shape)
        p, q = self._factors(buf, shape, rows, cols, k)
        out = (p @ q.T).to(dtype)
        if not bool(torch.isfinite(out).all()):
            raise CodecError(f"lowrank payload for shape {tuple(shape)}: its product overflows {dtype} (corrupt "
                             f"payload, or a sender whose tensor did not fit {dtype})")
        return out.view(tuple(shape))

    def _factors(self, buf: torch.Tensor, shape: Sequence[int], rows: int, cols: int,
                 k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(P [rows, k], Q' [cols, k]) as float32 from a payload of the right size; CodecError if corrupt."""
        if self.spec.bits == 16:
            f = buf.view(torch.bfloat16).float()
            if not bool(torch.isfinite(f).all()):
                raise CodecError(f"lowrank payload for shape {tuple(shape)}: a factor holds inf or NaN (corrupt "
                                 f"payload)")
            return f[: rows * k].view(rows, k), f[rows * k:].view(cols, k)
        b = self.spec.bits
        steps = buf[: 2 * (rows + k)].view(torch.bfloat16).float()
        if not bool(torch.isfinite(steps).all()) or bool((steps < 0).any()):
            raise CodecError(f"lowrank payload for shape {tuple(shape)}: a factor's step is negative, inf or NaN "
                             f"(corrupt payload)")
        p_bytes = -(-rows * k * b // 8)
        pb, qb = buf[2 * (rows + k): 2 * (rows + k) + p_bytes], buf[2 * (rows + k) + p_bytes:]
        for codes, n in ((pb, rows * k), (qb, cols * k)):
            if bool(_unpack_bits(codes)[n * b:].any()):
                raise CodecError(f"lowrank payload for shape {tuple(shape)}: padding bits after a factor's last code "
                                 f"are set (corrupt payload)")
        p = self._dequantize(_unpack(pb, rows * k, b).view(rows, k), steps[:rows], 1)
        q = self._dequantize(_unpack(qb, cols * k, b).view(cols, k), steps[rows:], 0)
        return p, q

    def error_bound(self, t: torch.Tensor) -> float:
        """The float32 factors' own error (what the rank leaves), plus the rounding of each factor entry to
        bfloat16 (|dP Q'^T + P dQ'^T| <= 2u' |P_i| |Q'_j| per entry) and of the output to its dtype."""
        shape = tuple(t.shape)
        k = self.rank_of(shape)
        if t.numel() == 0:
            return 0.0
        m = t.detach().reshape(-1).float().view(*matrix_shape(shape))
        if k == 0:
            return float(m.abs().max())
        p, q = self.factor(m, self.start(m.shape[1], k, m.device), ITERATIONS)
        approx = p @ q.T
        residual = float((m - approx).abs().max())
        cross = float(p.norm(dim=1).max() * q.norm(dim=1).max())
        if self.spec.bits == 16:
            top = float(approx.abs().max()) + cross * 3 * _FACTOR_ROUNDING
            return residual * (1 + 1e-5) + cross * (3 * _FACTOR_ROUNDING) + top * unit_roundoff(t.dtype) + 1e-30
        # each entry of P off by at most half its row's step dp_i, of Q' half its column's dq_j:
        # |P^ Q^'T - P Q'T|_ic <= sum_j dp_i |Q'_cj| + |P_ij| dq_j + dp_i dq_j
        _, ps = self._quantize(p, 1)
        _, qs = self._quantize(q, 0)
        dp, dq = ps.float() / 2, qs.float() / 2
        quant = float(dp.max() * q.abs().sum(1).max() + (p.abs() @ dq).max() + dp.max() * dq.sum())
        top = float(approx.abs().max()) + quant
        return (residual + quant) * (1 + 1e-4) + top * unit_roundoff(t.dtype) + 1e-30

    @property
    def expected_error(self) -> float:
        # Gaussian data have no low-rank structure: a rank-r factorisation keeps about r of its cols directions,
        # which for any width worth compressing is close to nothing. Its loss cost (LOSS_COST) is what counts.
        return 1.0


class LowRankLink:
    """PowerSGD on one link and direction: warm-started Q, and (with `error_feedback`, for activation-gradients)
    a residual carried into the next tensor. Not thread-safe: one per sender of a link direction."""

    def __init__(self, spec: CodecSpec, *, error_feedback: bool) -> None:
        if spec.codec != "lowrank" or spec.zstd_level:
            raise ValueError(f"LowRankLink needs a lowrank spec without a zstd stage, got {spec.label()}")
        self.spec, self.codec = spec, LowRankCodec(spec)
        self.error_feedback = error_feedback
        self._q: torch.Tensor | None = None
        self._residual: torch.Tensor | None = None

    def encode(self, t: torch.Tensor) -> EncodedTensor:
        x = t.detach().float()
        if self._residual is not None and self._residual.shape == x.shape:
            x = x + self._residual.to(x.device)
        sent = x.to(t.dtype)
        payload, self._q = self.codec.encode_from(sent, self._q)
        if self.error_feedback:
            self._residual = x - self.codec.decode(payload, tuple(t.shape), t.dtype).float().to(x.device)
        return EncodedTensor(payload=payload, shape=tuple(t.shape), dtype=t.dtype, spec=self.spec,
                             raw_bytes=t.numel() * t.element_size())

    def reset(self) -> None:
        """Forget the warm start and the residual: on a plan change (new epoch, neighbours or shapes)."""
        self._q = self._residual = None
