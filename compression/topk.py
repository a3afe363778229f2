"""Top-k magnitude sparsification: the k = ceil(fraction * n) largest |x| are kept, the rest sent as zero.

Payload layout: `[indices: int32 x k, ascending][values: k in the tensor's own dtype]`. Meant for gradients
under error feedback (atoll.compression.feedback), which carries what is dropped into the next step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

import torch

from atoll.compression.codec import Codec, Payload, register, tensor_bytes
from atoll.compression.dtypes import element_size
from atoll.compression.errors import CodecError
from atoll.v1 import atoll_pb2 as pb

_SAMPLE = 1 << 16        # elements sampled to estimate the selection threshold
_DIRECT_BELOW = 1 << 17  # below this many elements torch.topk on everything is fast enough
_MARGIN = 1.25           # aim the sampled threshold at this many times k candidates


def topk_count(numel: int, fraction: float) -> int:
    """Elements kept of `numel`: ceil(fraction * numel), at least 1 of a non-empty tensor."""
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(fraction * numel)))


def select_topk(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64, ascending) of the k largest entries of the 1-D `magnitude`.

    torch.topk over millions of elements with a k in the tens of thousands is slow on CPU, so the k-th
    largest is first estimated from a strided sample, everything above a slightly lower threshold becomes a
    candidate (one compare and one nonzero pass), and topk runs on the candidates only. When the estimate
    keeps too few candidates (adversarial data), it falls back to topk on everything: always exact.
    """
    n = magnitude.numel()
    if k >= n:
        return torch.arange(n, device=magnitude.device)
    if n >= _DIRECT_BELOW and k * 8 <= n:
        stride = n // _SAMPLE
        sample = magnitude[::stride].contiguous()
        s = sample.numel()
        above = min(s, math.ceil(s * k / n * _MARGIN) + 16)
        threshold = torch.kthvalue(sample, s - above + 1).values
        candidates = torch.nonzero(magnitude >= threshold).squeeze(1)
        if k <= candidates.numel() <= 4 * k:
            pick = torch.topk(magnitude[candidates], k, sorted=False).indices
            return candidates[pick].sort().values
    return torch.topk(magnitude, k, sorted=False).indices.sort().values


@register
class TopKCodec(Codec):
    """Keeps the `topk_fraction` largest magnitudes with their int32 positions (1%: 50x smaller than fp32)."""

    id = pb.CODEC_TOPK
    name = "topk"

    @property
    def fraction(self) -> float:
        return self.spec.topk_fraction

    def payload_size(self, numel: int, dtype: torch.dtype) -> int:
        return topk_count(numel, self.fraction) * (4 + element_size(dtype))

    def encode(self, t: torch.Tensor) -> Payload:
        flat = self._flat(t)
        n = flat.numel()
        if n == 0:
            return b""
        if n >= 2 ** 31:
            raise CodecError(f"topk carries int32 indices: a tensor of {n} elements is too large; split it")
        k = topk_count(n, self.fraction)
        magnitude = flat.abs()  # in the tensor's own dtype: order is all that matters, and no upcast copy
        idx = select_topk(magnitude, k)
        out = torch.empty(self.payload_size(n, flat.dtype), dtype=torch.uint8, device=flat.device)
        out[: 4 * k].view(torch.int32).copy_(idx)
        out[4 * k:].view(flat.dtype).copy_(flat[idx])
        return tensor_bytes(out)

    def decode(self, payload: Payload, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        buf, n = self._check_decode(payload, shape, dtype)
        out = torch.zeros(n, dtype=dtype)
        if n == 0:
            return out.view(tuple(shape))
        k = topk_count(n, self.fraction)
        idx = buf[: 4 * k].view(torch.int32)
        lo, hi = torch.aminmax(idx)
        if int(lo) < 0 or int(hi) >= n:
            raise CodecError(f"topk payload holds index {int(lo) if int(lo) < 0 else int(hi)} outside a tensor of "
                             f"{n} elements (corrupt payload or wrong shape in the metadata)")
        out[idx.long()] = buf[4 * k:].view(dtype)
        return out.view(tuple(shape))

    def error_bound(self, t: torch.Tensor) -> float:
        n = t.numel()
        k = topk_count(n, self.fraction)
        if k >= n:
            return 0.0
        # every dropped magnitude is at most the smallest kept one
        return float(torch.topk(t.detach().reshape(-1).float().abs(), k).values.min())

    @property
    def expected_error(self) -> float:
        # N(0, 1): keeping |x| > a (a fraction f) keeps energy f + 2 a phi(a); the rest is the error
        f = self.fraction
        if f >= 1.0:
            return 0.0
        a = NormalDist().inv_cdf(1 - f / 2)
        kept = f + 2 * a * math.exp(-a * a / 2) / math.sqrt(2 * math.pi)
        return math.sqrt(max(0.0, 1 - kept))
