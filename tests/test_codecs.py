"""Every codec round-trips within its stated bound over dtypes, shapes and block sizes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atoll.compression import CodecError, CodecSpec, decode_tensor, encode_tensor, get_codec, registered
from atoll.compression.topk import topk_count
from atoll.serde import CODEC_BY_NAME
from atoll.v1 import atoll_pb2 as pb

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
LOSSY = ["fp16", "bf16", "int8", "int4", "topk", "sparse2"]
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 5), min_size=1, max_size=1).map(tuple),
    st.lists(st.integers(1, 70), min_size=1, max_size=3).map(tuple),
)


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _roundtrip(x: torch.Tensor, spec: CodecSpec) -> torch.Tensor:
    enc = encode_tensor(x, spec)
    assert enc.wire_bytes == get_codec(spec).payload_size(x.numel(), x.dtype) or spec.zstd_level
    y = decode_tensor(bytes(enc.payload), enc.shape, enc.dtype, spec)
    assert y.shape == x.shape and y.dtype == x.dtype
    return y


def test_every_enum_value_has_a_codec() -> None:
    assert set(registered()) == set(pb.Codec.values())
    for name, cid in CODEC_BY_NAME.items():
        assert registered()[cid].name == name


@SETTINGS
@given(name=st.sampled_from(["identity", *LOSSY]), dtype=st.sampled_from(FLOATS), shape=shapes,
       block=st.sampled_from([1, 2, 5, 64, 100]), fraction=st.sampled_from([0.01, 0.3, 1.0]),
       seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 300.0]))
def test_roundtrip_within_bound(name: str, dtype: torch.dtype, shape: tuple[int, ...], block: int,
                                fraction: float, seed: int, scale: float) -> None:
    spec = CodecSpec(name, block_size=block, topk_fraction=fraction)
    x = _tensor(shape, dtype, seed, scale)
    y = _roundtrip(x, spec)
    err = (y.float() - x.float()).abs().max().item() if x.numel() else 0.0
    assert err <= get_codec(spec).error_bound(x)


@SETTINGS
@given(name=st.sampled_from(["identity", *LOSSY]), dtype=st.sampled_from(FLOATS), shape=shapes,
       level=st.sampled_from([1, 3, 9]), seed=st.integers(0, 2**16))
def test_zstd_stage_is_lossless(name: str, dtype: torch.dtype, shape: tuple[int, ...], level: int, seed: int) -> None:
    x = _tensor(shape, dtype, seed, 1.0)
    plain = _roundtrip(x, CodecSpec(name))
    zstd = _roundtrip(x, CodecSpec(name, zstd_level=level))
    assert torch.equal(plain, zstd)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, *FLOATS])
def test_identity_is_exact_for_every_wire_dtype(dtype: torch.dtype) -> None:
    x = (torch.randn(3, 7) * 1000).to(dtype)
    assert torch.equal(_roundtrip(x, CodecSpec("identity")), x)


@pytest.mark.parametrize("name", LOSSY)
def test_lossy_codecs_refuse_integer_tensors(name: str) -> None:
    with pytest.raises(CodecError, match="cannot encode dtype torch.int64"):
        encode_tensor(torch.arange(4), CodecSpec(name))


def test_decoded_tensors_are_writable_and_independent_of_the_payload() -> None:
    x = torch.randn(10)
    enc = encode_tensor(x, CodecSpec("identity"))
    payload = bytes(enc.payload)
    y = decode_tensor(payload, enc.shape, enc.dtype, CodecSpec("identity"))
    y.zero_()
    assert torch.equal(decode_tensor(payload, enc.shape, enc.dtype, CodecSpec("identity")), x)


def test_fp16_clamps_out_of_range_values_and_keeps_non_finite() -> None:
    x = torch.tensor([1e6, -1e6, 1.5, float("inf"), float("-inf"), float("nan")])
    y = _roundtrip(x, CodecSpec("fp16"))
    assert y[:3].tolist() == [65504.0, -65504.0, 1.5]
    assert y[3] == math.inf and y[4] == -math.inf and math.isnan(y[5])


def test_int8_and_int4_error_on_gaussian_data() -> None:
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    for name, bound, ratio in [("int8", 0.01, 3.8), ("int4", 0.12, 7.0)]:
        enc = encode_tensor(x, CodecSpec(name))
        y = decode_tensor(enc.payload, enc.shape, enc.dtype, CodecSpec(name))
        rel = ((y - x).norm() / x.norm()).item()
        assert rel <= bound and enc.ratio >= ratio, (name, rel, enc.ratio)
        # the policy budgets with the expected error: it must describe the real one
        assert rel == pytest.approx(get_codec(CodecSpec(name)).expected_error, rel=0.25)


def test_int_block_codecs_poison_only_the_block_with_non_finite_values() -> None:
    x = torch.randn(128)
    x[3] = float("inf")
    for name in ("int8", "int4"):
        y = _roundtrip(x, CodecSpec(name, block_size=64))
        assert not torch.isfinite(y[:64]).any() and torch.isfinite(y[64:]).all()


@pytest.mark.parametrize("n", [1000, 300_000])
def test_topk_keeps_exactly_the_largest_magnitudes(n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    spec = CodecSpec("topk", topk_fraction=0.01)
    y = _roundtrip(x, spec)
    k = topk_count(n, spec.topk_fraction)
    kept = y != 0
    assert int(kept.sum()) == k
    assert set(torch.nonzero(kept).squeeze(1).tolist()) == set(torch.topk(x.abs(), k).indices.tolist())
    assert torch.equal(y[kept], x[kept])


def test_topk_handles_ties_and_constant_tensors() -> None:
    x = torch.ones(200_000)
    y = _roundtrip(x, CodecSpec("topk", topk_fraction=0.01))
    assert int((y != 0).sum()) == topk_count(x.numel(), 0.01)


def test_topk_fraction_survives_the_wire_unchanged() -> None:
    spec = CodecSpec("topk", topk_fraction=0.01)
    cid, params = spec.to_proto()
    assert CodecSpec.from_proto(cid, pb.CodecParams.FromString(params.SerializeToString())) == spec


def test_expected_ratios() -> None:
    assert get_codec(CodecSpec("int8")).expected_ratio() >= 3.8
    assert get_codec(CodecSpec("int4")).expected_ratio() >= 7.0
    assert get_codec(CodecSpec("topk", topk_fraction=0.01)).expected_ratio() >= 40
    assert get_codec(CodecSpec("fp16")).expected_ratio(torch.bfloat16) == 1.0


@pytest.mark.parametrize("kwargs, match", [
    ({"codec": "int2"}, "unknown codec 'int2'"),
    ({"codec": "int8", "block_size": 0}, "block_size must be"),
    ({"codec": "topk", "topk_fraction": 0.0}, "topk_fraction must be in"),
    ({"codec": "topk", "topk_fraction": 1.5}, "topk_fraction must be in"),
    ({"codec": "fp16", "zstd_level": 23}, "zstd_level must be"),
])
def test_spec_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        CodecSpec(**kwargs)


def test_spec_from_proto_defaults_and_unknown_id() -> None:
    spec = CodecSpec.from_proto(pb.CODEC_INT8_BLOCK, pb.CodecParams())
    assert spec.block_size == 64 and spec.zstd_level == 0
    with pytest.raises(CodecError, match="unknown codec id 99"):
        CodecSpec.from_proto(99, pb.CodecParams())
    with pytest.raises(CodecError, match="zstd_level"):
        CodecSpec.from_proto(pb.CODEC_FP16, pb.CodecParams(zstd_level=40))


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("block", [1, 7, 64])
@pytest.mark.parametrize("dtype", FLOATS)
def test_block_codecs_give_the_same_payload_whatever_the_slice_size(monkeypatch: pytest.MonkeyPatch, name: str,
                                                                     block: int, dtype: torch.dtype) -> None:
    from atoll.compression import blockquant

    x = _tensor((1001,), dtype, 3, 1.0)
    spec = CodecSpec(name, block_size=block)
    whole = bytes(encode_tensor(x, spec).payload)
    monkeypatch.setattr(blockquant, "_SLICE", 50)  # many slices, the last one partial
    sliced = encode_tensor(x, spec).payload
    assert bytes(sliced) == whole
    y = decode_tensor(sliced, x.shape, x.dtype, spec)
    monkeypatch.setattr(blockquant, "_SLICE", 1 << 19)
    assert torch.equal(y, decode_tensor(whole, x.shape, x.dtype, spec))


@pytest.mark.parametrize("dtype", FLOATS)
def test_topk_on_large_half_precision_tensors(dtype: torch.dtype) -> None:
    x = _tensor((300_000,), dtype, 5, 1.0)
    y = _roundtrip(x, CodecSpec("topk", topk_fraction=0.01))
    kept = y != 0
    assert int(kept.sum()) == topk_count(x.numel(), CodecSpec("topk").topk_fraction)
    assert x.float().abs()[~kept].max() <= x.float().abs()[kept].min()
