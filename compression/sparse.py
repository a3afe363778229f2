"""Chunked top-k with 2-bit values: the outer sync's codec for slow wide-area links (SparseLoCo).

Follows SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with
SparseLoCo", 2025), as Covenant-72B trained with it: the flattened tensor is cut into chunks of `CHUNK`
elements (the last one may be shorter); each chunk keeps its k = ceil(fraction * length) largest
magnitudes (`CodecSpec.topk_fraction`; outer mode's default 1/64 keeps 64 of 4,096) as 2-bit values, and
error feedback (atoll.compression.feedback) carries everything else into the next round.

Per chunk:
- positions: the k ascending positions in Elias-Fano form. With l = floor(log2(length / k)), the low l bits
  of each position are stored as they are, the high parts in unary: bit (high_j + j) of an upper bitmap of
  k + ((length - 1) >> l) + 1 bits is set for the j-th position. At 64 of 4,096 that is 8 bits a position
  (16-bit local indices would take 16, a bitmap 64), within 0.6 bit of the entropy of the choice, and a fixed
  size, so the payload's length stays a function of (shape, dtype, spec). As the density rises, l falls to 0
  and the form becomes a bitmap of its own accord. A zstd stage does not pay on top of it: on a round of real
  pseudo-gradients (bench/codecs.py) it grows the payload by 0.6%, on Gaussian data it saves 2%.
- values: 2 bits each, sign and level: bit 1 is set for a negative value, bit 0 for the upper level. The
  two levels are the chunk's scales: the mean magnitude of the kept values at or below their mean, and of
  those above it (one Lloyd step of a two-level quantiser); each value takes the nearer level.

Payload layout, chunks of `CHUNK` elements first, then the shorter last chunk as a group of its own:
`[scales: bfloat16 x 2 per chunk (lower, upper)][upper bitmaps, LSB first][low bits, LSB first]
[2-bit codes, LSB first]`, each part of each group padded with zero bits to a whole byte. Decoding checks
every part before it writes anything: finite non-negative scales, exactly k positions per chunk, each
inside its chunk and strictly ascending, and zero padding.

A chunk holding inf or NaN is refused at encoding (a CodecError that says so): a pseudo-gradient that
overflowed must not be averaged into the other groups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

import torch

from atoll.compression.codec import Codec, Payload, register, tensor_bytes
from atoll.compression.dtypes import unit_roundoff
from atoll.compression.errors import CodecError
from atoll.compression.topk import topk_count
from atoll.v1 import atoll_pb2 as pb

CHUNK = 4096
"""Elements per chunk (SparseLoCo's): a position needs 12 bits before coding."""
DEFAULT_FRACTION = 1 / 64
"""Outer mode's default density: 64 of each 4,096 elements, as SparseLoCo and Covenant-72B send."""
_SCALE_ROUNDING = 2.0 ** -8  # a scale rounded to nearest bfloat16 is off by at most this much, relative
_SLICE = 1 << 19  # elements whose magnitudes are ranked at once
_QUANT_ERROR = 0.07
"""Relative L2 error of the two-level values on the kept tail of N(0, 1) data at 1-3% (measured: 0.067)."""


def _low_bits(length: int, k: int) -> int:
    """Elias-Fano's l: floor(log2(length / k)), 0 when k = length."""
    return (length // k).bit_length() - 1


def _group_bytes(chunks: int, length: int, k: int) -> tuple[int, int, int, int]:
    """Bytes of (scales, upper bitmaps, low bits, codes) of `chunks` chunks of `length` elements, k kept each."""
    low = _low_bits(length, k)
    upper = k + ((length - 1) >> low) + 1
    return 4 * chunks, -(-chunks * upper // 8), -(-chunks * k * low // 8), -(-chunks * k * 2 // 8)


def _groups(numel: int, fraction: float) -> list[tuple[int, int, int]]:
    """(chunks, length, k) of the whole chunks and of the shorter last one, in payload order."""
    out = []
    if numel >= CHUNK:
        out.append((numel // CHUNK, CHUNK, topk_count(CHUNK, fraction)))
    if numel % CHUNK:
        out.append((1, numel % CHUNK, topk_count(numel % CHUNK, fraction)))
    return out


# --- bit packing (LSB first, device-agnostic) ------------------------------------------------------------

def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint8 0/1 values -> bytes, bit i of byte j is bits[8 j + i]; zero-padded to a whole byte."""
    pad = -bits.numel() % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    b = bits.view(-1, 8)
    out = b[:, 0].clone()
    for i in range(1, 8):
        out.bitwise_or_(b[:, i] << i)
    return out


def _unpack_bits(data: torch.Tensor) -> torch.Tensor:
    """bytes -> uint8 0/1 values, 8 per byte, LSB first."""
    shifts = torch.arange(8, dtype=torch.uint8, device=data.device)
    return (data.unsqueeze(1) >> shifts).bitwise_and_(1).view(-1)


def _pack(values: torch.Tensor, width: int) -> torch.Tensor:
    """Integers in [0, 2**width) -> `width` bits each, LSB first, packed."""
    if width == 0:
        return values.new_empty(0, dtype=torch.uint8)
    shifts = torch.arange(width, dtype=values.dtype, device=values.device)
    return _pack_bits(((values.unsqueeze(1) >> shifts) & 1).to(torch.uint8).view(-1))


def _unpack(data: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """The first `count` integers of `width` bits (int64) packed in `data`."""
    if width == 0:
        return torch.zeros(count, dtype=torch.int64, device=data.device)
    bits = _unpack_bits(data)[: count * width].view(count, width).to(torch.int32)
    shifts = torch.arange(width, dtype=torch.int32, device=data.device)
    return (bits << shifts).sum(1)  # int64


@register
class Sparse2Codec(Codec):
    """Per chunk of 4,096, the k largest magnitudes at 2 bits with Elias-Fano positions (1/64: 195x)."""

    id = pb.CODEC_SPARSE2
    name = "sparse2"

    @property
    def fraction(self) -> float:
        return self.spec.topk_fraction

    def payload_size(self, numel: int, dtype: torch.dtype) -> int:
        return sum(sum(_group_bytes(c, length, k)) for c, length, k in _groups(numel, self.fraction))

    # --- encode ------------------------------------------------------------------------------------------

    def encode(self, t: torch.Tensor) -> Payload:
        flat = self._flat(t)
        n = flat.numel()
        if n == 0:
            return b""
        parts: list[torch.Tensor] = []
        start = 0
        for c, length, k in _groups(n, self.fraction):
            parts += self._encode_group(flat[start: start + c * length].view(c, length), k, start)
            start += c * length
        out = torch.cat(parts)
        assert out.numel() == self.payload_size(n, flat.dtype)
        return tensor_bytes(out)

    def _encode_group(self, x: torch.Tensor, k: int, first: int) -> list[torch.Tensor]:
        c, length = x.shape
        low = _low_bits(length, k)
        if k == length:
            idx = torch.arange(length, device=x.device).expand(c, length)
        else:
            # by slices of chunks: the magnitudes (in the tensor's own dtype: order is all that matters) stay
            # a few MiB whatever the tensor's size
            rows = max(1, _SLICE // length)
            idx = torch.cat([torch.topk(x[r: r + rows].abs(), k, dim=1, sorted=False).indices
                             for r in range(0, c, rows)]).sort(dim=1).values
        v = x.gather(1, idx).float()
        a = v.abs()
        mean = a.mean(1, keepdim=True)
        upper = a > mean
        n_up = upper.sum(1, keepdim=True)
        lo = torch.where(upper, 0.0, a).sum(1, keepdim=True) / (k - n_up).clamp(min=1)
        hi = torch.where(upper, a, 0.0).sum(1, keepdim=True) / n_up.clamp(min=1)
        hi = torch.where(n_up > 0, hi, lo)  # all equal: one level
        scales = torch.cat([lo, hi], 1).to(torch.bfloat16)
        finite = torch.isfinite(scales).all(1)
        if not bool(finite.all()):
            bad = int(torch.nonzero(~finite)[0, 0])
            lo_el = first + bad * length
            raise CodecError(f"sparse2 cannot encode non-finite values: elements [{lo_el}, {lo_el + length}) hold "
                             f"inf or NaN (an overflowed pseudo-gradient must not be sent; find where it overflowed)")
        s = scales.float()
        # each value takes the nearer of the two (rounded) levels
        up = (a > (s[:, :1] + s[:, 1:]) * 0.5).to(torch.uint8)
        neg = (v < 0).to(torch.uint8)
        codes = (neg << 1) | up
        high = (idx >> low) + torch.arange(k, device=x.device)
        bitmap = torch.zeros(c, k + ((length - 1) >> low) + 1, dtype=torch.uint8, device=x.device)
        bitmap.scatter_(1, high, 1)
        return [scales.view(-1).view(torch.uint8), _pack_bits(bitmap.view(-1)),
                _pack((idx.reshape(-1) & ((1 << low) - 1)).to(torch.int32), low), _pack(codes.view(-1), 2)]

    # --- decode ------------------------------------------------------------------------------------------

    def decode(self, payload: Payload, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        buf, n = self._check_decode(payload, shape, dtype)
        out = torch.zeros(n, dtype=dtype)
        pos = start = 0
        for c, length, k in _groups(n, self.fraction):
            sizes = _group_bytes(c, length, k)
            parts = []
            for size in sizes:
                parts.append(buf[pos: pos + size])
                pos += size
            idx, values = self._decode_group(parts, c, length, k, start)
            out[start: start + c * length].view(c, length).scatter_(1, idx, values.to(dtype))
            start += c * length
        return out.view(tuple(shape))

    def _decode_group(self, parts: list[torch.Tensor], c: int, length: int, k: int,
                      first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [c, k] within each chunk, values [c, k] float32) of one group; CodecError if malformed."""
        scale_bytes, upper_bytes, low_bytes, code_bytes = parts
        where = f"sparse2 payload, chunks at elements [{first}, {first + c * length})"
        # a group after a short last chunk may start at an odd byte: copy before reading it as 16-bit values
        s = scale_bytes.clone().view(torch.bfloat16).float().view(c, 2)
        if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
            raise CodecError(f"{where}: a scale is negative, inf or NaN (corrupt payload)")
        low = _low_bits(length, k)
        width = k + ((length - 1) >> low) + 1
        bits = _unpack_bits(upper_bytes)
        if bool(bits[c * width:].any()):
            raise CodecError(f"{where}: padding bits of the position bitmaps are set (corrupt payload)")
        bitmap = bits[: c * width].view(c, width)
        counts = bitmap.sum(1, dtype=torch.int64)
        if bool((counts != k).any()):
            bad = int(torch.nonzero(counts != k)[0, 0])
            raise CodecError(f"{where}: chunk {bad} names {int(counts[bad])} positions, the spec keeps {k} "
                             f"(corrupt payload, or a fraction that disagrees with the sender's)")
        high = torch.nonzero(bitmap)[:, 1].view(c, k) - torch.arange(k, device=bitmap.device)
        if low and bool(_unpack_bits(low_bytes)[c * k * low:].any()):
            raise CodecError(f"{where}: padding bits of the low position bits are set (corrupt payload)")
        idx = (high << low) | _unpack(low_bytes, c * k, low).view(c, k)
        if bool((idx[:, -1] >= length).any()):
            raise CodecError(f"{where}: a position lies beyond its chunk of {length} elements (corrupt payload)")
        if k > 1 and bool((idx[:, 1:] <= idx[:, :-1]).any()):
            raise CodecError(f"{where}: positions are not strictly ascending (corrupt payload)")
        codes = _unpack(code_bytes, c * k, 2).view(c, k)
        if bool(_unpack_bits(code_bytes)[c * k * 2:].any()):
            raise CodecError(f"{where}: padding bits of the value codes are set (corrupt payload)")
        level = torch.where((codes & 1).bool(), s[:, 1:], s[:, :1])
        return idx, torch.where((codes >> 1).bool(), -level, level)

    # --- bounds ------------------------------------------------------------------------------------------

    def error_bound(self, t: torch.Tensor) -> float:
        flat = t.detach().reshape(-1).float()
        bound, start = 0.0, 0
        for c, length, k in _groups(flat.numel(), self.fraction):
            mag = flat[start: start + c * length].view(c, length).abs()
            top = torch.topk(mag, k, dim=1).values
            big, small = top[:, 0], top[:, -1]
            # a dropped value is at most the smallest kept one; a kept one lies in [small, big], and so do
            # both levels (means of kept magnitudes) up to their rounding to bfloat16 and to the output dtype
            rounding = big * (2 * _SCALE_ROUNDING + unit_roundoff(t.dtype))
            worst = torch.maximum(small if k < length else torch.zeros_like(small), big - small + rounding)
            bound = max(bound, float(worst.max()))
            start += c * length
        return bound

    @property
    def expected_error(self) -> float:
        # N(0, 1): top-k leaves the energy 1 - kept (as topk's expected_error); the 2-bit levels add
        # _QUANT_ERROR of the kept energy (measured on tails of 1-3%: an estimate, low for much denser ones)
        f = self.fraction
        if f >= 1.0:
            return _QUANT_ERROR
        a = NormalDist().inv_cdf(1 - f / 2)
        kept = min(1.0, f + 2 * a * math.exp(-a * a / 2) / math.sqrt(2 * math.pi))
        return math.sqrt(1 - kept + kept * _QUANT_ERROR ** 2)
