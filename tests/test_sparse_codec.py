"""sparse2 (SparseLoCo's chunked top-k at 2 bits): what it keeps, its size, its error under error feedback,
and a CodecError for every malformed payload."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atoll.compression import (
    ChunkAssembler,
    CodecError,
    CodecSpec,
    ErrorFeedback,
    decode_tensor,
    encode_tensor,
    get_codec,
    registered,
    tensor_to_chunks,
)
from atoll.compression.sparse import CHUNK, DEFAULT_FRACTION, _group_bytes, _groups
from atoll.compression.topk import topk_count
from atoll.v1 import atoll_pb2 as pb

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
SPEC = CodecSpec("sparse2", topk_fraction=DEFAULT_FRACTION)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _roundtrip(x: torch.Tensor, spec: CodecSpec = SPEC) -> torch.Tensor:
    enc = encode_tensor(x, spec)
    assert enc.wire_bytes == get_codec(spec).payload_size(x.numel(), x.dtype)
    y = decode_tensor(bytes(enc.payload), enc.shape, enc.dtype, spec)
    assert y.shape == x.shape and y.dtype == x.dtype
    return y


def test_registered_under_its_own_enum_value() -> None:
    assert registered()[pb.CODEC_SPARSE2].name == "sparse2"
    assert set(registered()) == set(pb.Codec.values())
    cid, params = SPEC.to_proto()
    assert cid == pb.CODEC_SPARSE2
    assert CodecSpec.from_proto(cid, pb.CodecParams.FromString(params.SerializeToString())) == SPEC
    assert SPEC.label() == "sparse2/0.0156"


@SETTINGS
@given(dtype=st.sampled_from(FLOATS),
       n=st.one_of(st.integers(0, 70), st.sampled_from([CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 77])),
       fraction=st.sampled_from([DEFAULT_FRACTION, 0.01, 0.3, 1.0]), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-6, 1.0, 300.0]))
def test_roundtrip_within_bound_and_keeps_the_largest_of_each_chunk(dtype: torch.dtype, n: int, fraction: float,
                                                                     seed: int, scale: float) -> None:
    spec = CodecSpec("sparse2", topk_fraction=fraction)
    x = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)
    y = _roundtrip(x, spec)
    if n == 0:
        return
    assert (y.float() - x.float()).abs().max().item() <= get_codec(spec).error_bound(x)
    start = 0
    for c, length, k in _groups(n, spec.topk_fraction):
        xs = x[start: start + c * length].float().view(c, length)
        ys = y[start: start + c * length].float().view(c, length)
        for row in range(c):
            kept = ys[row] != 0
            assert int(kept.sum()) <= k  # a kept value may round to zero only if its level is zero
            # what was dropped is never larger than what was kept, and signs survive
            if kept.any() and (~kept).any():
                assert xs[row][~kept].abs().max() <= xs[row][kept].abs().min()
            assert torch.equal(torch.sign(ys[row][kept]), torch.sign(xs[row][kept]) + (xs[row][kept] == 0))
            # two magnitudes per chunk at most
            assert ys[row][kept].abs().unique().numel() <= 2
        start += c * length


@pytest.mark.parametrize("shape", [(), (1,), (0,), (0, 5), (3, 0), (1, 1, 1)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_empty_and_scalar_tensors(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = torch.full(shape, -2.5, dtype=dtype)
    y = _roundtrip(x)
    assert torch.equal(y, x)  # one value per chunk is kept, and a single magnitude is exact


def test_size_and_ratio() -> None:
    # 64 of 4,096: 4 bytes of scales, 16 of upper bitmap (64 + 64 bits), 48 of low bits (6 each), 16 of codes
    assert _group_bytes(1, CHUNK, 64) == (4, 16, 48, 16)
    codec = get_codec(SPEC)
    assert codec.payload_size(CHUNK, torch.float32) == 84
    assert codec.expected_ratio() == pytest.approx(4 * CHUNK / 84)
    assert codec.expected_ratio() > 146 * 1.3  # beyond 12-bit indices + 2-bit values (146x)
    assert codec.expected_ratio() > 40 * get_codec(CodecSpec("int8")).expected_ratio()
    # a 1.3B-parameter model's worth of pseudo-gradient crosses in under 30 MB
    assert codec.payload_size(1_300_000_000, torch.float32) < 30e6
    # a tensor smaller than a chunk is one short chunk
    assert _groups(100, DEFAULT_FRACTION) == [(1, 100, 2)] and _groups(CHUNK, DEFAULT_FRACTION) == [(1, CHUNK, 64)]


def test_expected_error_describes_gaussian_data() -> None:
    x = torch.randn(64 * CHUNK, generator=torch.Generator().manual_seed(0))
    for fraction in (DEFAULT_FRACTION, 0.03):
        spec = CodecSpec("sparse2", topk_fraction=fraction)
        y = _roundtrip(x, spec)
        rel = ((y - x).norm() / x.norm()).item()
        assert rel == pytest.approx(get_codec(spec).expected_error, rel=0.02)
        # against top-k of the same density with exact float32 values, 2-bit values cost under 1% more error
        exact = _roundtrip(x, CodecSpec("topk", topk_fraction=topk_count(CHUNK, fraction) / CHUNK))
        assert rel <= 1.01 * ((exact - x).norm() / x.norm()).item()


def test_non_finite_values_are_refused_at_encoding() -> None:
    for bad in (float("inf"), float("nan")):
        x = torch.randn(3 * CHUNK)
        x[CHUNK + 5] = bad
        with pytest.raises(CodecError, match=r"elements \[4096, 8192\) hold inf or NaN"):
            encode_tensor(x, SPEC)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_feedback_keeps_the_sum_and_a_bounded_residual(dtype: torch.dtype) -> None:
    """Over rounds, the decoded pseudo-gradients add up to the true ones less the residual, which stays
    bounded: the sum's relative error falls as rounds accumulate."""
    g = torch.Generator().manual_seed(0)
    n = 2 * CHUNK + 333
    drift = torch.randn(n, generator=g) * 0.3  # a steady direction under the noise, as training has
    ef = ErrorFeedback(SPEC)
    true_sum, sent_sum = torch.zeros(n), torch.zeros(n)
    residuals, rel = [], []
    for _ in range(400):
        d = (drift + torch.randn(n, generator=g)).to(dtype)
        enc = ef.encode("w", d)
        sent_sum += decode_tensor(enc.payload, enc.shape, enc.dtype, SPEC).float()
        true_sum += d.float()
        assert torch.allclose(true_sum - sent_sum, ef.residual("w"), atol=1e-2, rtol=1e-3)
        residuals.append(ef.residual("w").norm().item() / d.float().norm().item())
        rel.append(((true_sum - sent_sum).norm() / true_sum.norm()).item())
    # the residual stops growing (measured: about 7 rounds' worth of input, flat from round 100 on)
    assert max(residuals[200:]) < 1.2 * max(residuals[100:200])
    assert max(residuals) < 20
    # so the sum converges: its relative error shrinks like 1 / rounds
    assert rel[-1] < 0.1 and rel[-1] < 0.5 * rel[99]


@pytest.mark.parametrize("dtype", FLOATS)
def test_encoding_on_a_gpu_keeps_the_same_positions_and_values(dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x = torch.randn(5 * CHUNK + 17, generator=torch.Generator().manual_seed(4)).to(dtype)
    cpu = decode_tensor(encode_tensor(x, SPEC).payload, x.shape, dtype, SPEC)
    gpu_enc = encode_tensor(x.cuda(), SPEC)
    assert gpu_enc.wire_bytes == get_codec(SPEC).payload_size(x.numel(), dtype)
    gpu = decode_tensor(gpu_enc.payload, x.shape, dtype, SPEC)
    assert torch.equal(gpu != 0, cpu != 0)
    # the levels are means summed in another order: equal up to a bfloat16 rounding
    torch.testing.assert_close(gpu.float(), cpu.float(), rtol=2 ** -7, atol=0)


# --- malformed payloads ----------------------------------------------------------------------------------

def _payload(n: int = 2 * CHUNK + 100, fraction: float = DEFAULT_FRACTION) -> tuple[bytearray, CodecSpec, int]:
    spec = CodecSpec("sparse2", topk_fraction=fraction)
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    return bytearray(encode_tensor(x, spec).payload), spec, n


def _offsets(n: int, spec: CodecSpec) -> list[dict[str, int]]:
    """Byte offsets of each group's parts."""
    out, pos = [], 0
    for c, length, k in _groups(n, spec.topk_fraction):
        part = {}
        for name, size in zip(("scales", "upper", "low", "codes"), _group_bytes(c, length, k)):
            part[name] = pos
            pos += size
        part["end"] = pos
        out.append(part)
    return out


def _decode(payload: bytes | bytearray, n: int, spec: CodecSpec) -> torch.Tensor:
    return decode_tensor(bytes(payload), (n,), torch.float32, spec)


def test_a_scale_that_is_not_finite_or_negative() -> None:
    payload, spec, n = _payload()
    for raw in (0x7F80, 0x7FC0, 0xBF80):  # bfloat16 inf, NaN, -1
        bad = bytearray(payload)
        bad[2:4] = raw.to_bytes(2, "little")
        with pytest.raises(CodecError, match=r"chunks at elements \[0, 8192\): a scale is negative, inf or NaN"):
            _decode(bad, n, spec)


def test_a_bitmap_with_the_wrong_count_of_positions() -> None:
    payload, spec, n = _payload()
    at = _offsets(n, spec)[0]["upper"]
    bad = bytearray(payload)
    bad[at] ^= 0x01  # one bit more or less
    with pytest.raises(CodecError, match="chunk 0 names .* positions, the spec keeps 64"):
        _decode(bad, n, spec)
    # the payload of another density has the same size only by chance; a different count is caught
    with pytest.raises(CodecError):
        _decode(payload, n, CodecSpec("sparse2", topk_fraction=0.01))


def test_a_position_beyond_the_last_short_chunk() -> None:
    # the short chunk of 100 elements keeps 2 (l = 5, 2 + 4 upper bits): moving its last one-bit up puts a
    # position at 128 or more
    payload, spec, n = _payload()
    tail = _offsets(n, spec)[1]
    bits = int.from_bytes(payload[tail["upper"]: tail["low"]], "little")
    top = bits.bit_length() - 1
    bad = bytearray(payload)
    bad[tail["upper"]: tail["low"]] = (bits ^ (1 << top) ^ (1 << 5)).to_bytes(tail["low"] - tail["upper"], "little")
    with pytest.raises(CodecError, match=r"beyond its chunk of 100 elements"):
        _decode(bad, n, spec)


def test_positions_that_repeat() -> None:
    # one chunk, 2 kept: upper bits "11" (both high parts 0) and equal low bits name one position twice
    spec = CodecSpec("sparse2", topk_fraction=0.02)
    n = 100
    assert _groups(n, spec.topk_fraction) == [(1, 100, 2)]
    x = torch.zeros(n)
    x[3], x[7] = 1.0, -2.0
    payload = bytearray(encode_tensor(x, spec).payload)
    at = _offsets(n, spec)[0]
    payload[at["upper"]] = 0b11
    payload[at["low"]: at["codes"]] = (5 | 5 << 5).to_bytes(at["codes"] - at["low"], "little")
    with pytest.raises(CodecError, match="not strictly ascending"):
        _decode(payload, n, spec)


@pytest.mark.parametrize("part", ["upper", "low", "codes"])
def test_padding_bits_that_are_set(part: str) -> None:
    spec = CodecSpec("sparse2", topk_fraction=0.02)
    n = 100  # upper: 2 + 4 bits, low: 2 x 5 bits, codes: 2 x 2 bits: each part has padding
    payload = bytearray(encode_tensor(torch.randn(n), spec).payload)
    at = _offsets(n, spec)[0]
    end = {"upper": at["low"], "low": at["codes"], "codes": at["end"]}[part]
    payload[end - 1] |= 0x80
    with pytest.raises(CodecError, match="padding bits"):
        _decode(payload, n, spec)


def test_sizes_that_disagree_with_the_metadata() -> None:
    payload, spec, n = _payload()
    with pytest.raises(CodecError, match="must be .* bytes"):
        _decode(payload[:-1], n, spec)
    with pytest.raises(CodecError, match="must be .* bytes"):
        _decode(payload + b"\0", n, spec)
    with pytest.raises(CodecError, match="must be .* bytes"):
        _decode(payload, n + CHUNK, spec)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.sampled_from([1, 7, 100, CHUNK, CHUNK + 100]), flips=st.lists(st.tuples(st.integers(0, 10**6),
       st.integers(1, 255)), min_size=1, max_size=4), fraction=st.sampled_from([DEFAULT_FRACTION, 0.3]))
def test_fuzzed_payloads_decode_in_range_or_raise_codec_error(n: int, flips: list[tuple[int, int]],
                                                              fraction: float) -> None:
    spec = CodecSpec("sparse2", topk_fraction=fraction)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    payload = bytearray(encode_tensor(x, spec).payload)
    for at, mask in flips:
        payload[at % len(payload)] ^= mask
    try:
        y = _decode(payload, n, spec)
    except CodecError:
        return
    # what decodes is a tensor of the right shape, finite, at most k values a chunk
    assert y.shape == (n,) and bool(torch.isfinite(y).all())
    start = 0
    for c, length, k in _groups(n, spec.topk_fraction):
        assert int((y[start: start + c * length].view(c, length) != 0).sum(1).max()) <= k
        start += c * length


@settings(max_examples=100, deadline=None)
@given(data=st.binary(min_size=0, max_size=400), n=st.sampled_from([0, 1, 100, CHUNK]))
def test_random_bytes_of_any_length_never_crash(data: bytes, n: int) -> None:
    size = get_codec(SPEC).payload_size(n, torch.float32)
    payload = (data * (size // max(1, len(data)) + 1))[:size] if data else bytes(size)
    for candidate in (data, payload):
        try:
            y = _decode(candidate, n, SPEC)
        except CodecError:
            continue
        assert y.shape == (n,) and bool(torch.isfinite(y).all())


def test_through_the_chunk_stream() -> None:
    x = torch.randn(3, CHUNK + 5).to(torch.bfloat16)
    meta = {"job_id": "j", "plan_epoch": 1, "step": 4, "direction": "outer", "name": "w", "sender": "a"}
    chunks = list(tensor_to_chunks(x, SPEC, meta, chunk_bytes=64))
    asm = ChunkAssembler()
    got = [r for c in chunks if (r := asm.feed(c)) is not None]
    asm.finish()
    assert len(got) == 1 and got[0].spec == SPEC
    assert torch.equal(got[0].tensor, _roundtrip(x))
    # a claimed shape that disagrees with the payload's size is refused before decoding
    chunks[0].meta.shape[:] = [4, CHUNK + 5]
    asm = ChunkAssembler()
    with pytest.raises(CodecError, match="must be .* bytes, the metadata says"):
        for c in chunks:
            asm.feed(c)
