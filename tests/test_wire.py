"""Tensor <-> chunk stream: round trips, and a clear CodecError for every kind of bad input."""

from __future__ import annotations

import zlib

import pytest
import torch

from atoll.compression import (
    ChunkAssembler,
    CodecError,
    CodecSpec,
    WireLimits,
    decode_tensor,
    encode_tensor,
    tensor_to_chunks,
)
from atoll.v1 import atoll_pb2 as pb

META = {"job_id": "j", "plan_epoch": 3, "step": 7, "micro_batch": 1, "direction": "forward", "name": "act",
        "sender": "n0", "pipeline": 0, "stage": 1, "replica": 0}


def _chunks(x: torch.Tensor, spec: CodecSpec = CodecSpec("int8"), chunk_bytes: int = 1000) -> list[pb.TensorChunk]:
    return list(tensor_to_chunks(x, spec, META, chunk_bytes=chunk_bytes))


def _feed_all(chunks: list[pb.TensorChunk], limits: WireLimits | None = None) -> list:
    asm = ChunkAssembler(limits)
    out = [r for c in chunks if (r := asm.feed(c)) is not None]
    asm.finish()
    return out


@pytest.mark.parametrize("spec", [CodecSpec("identity"), CodecSpec("bf16"), CodecSpec("int8"),
                                  CodecSpec("int4", zstd_level=3), CodecSpec("topk", topk_fraction=0.1)])
def test_stream_of_several_tensors_round_trips(spec: CodecSpec) -> None:
    xs = [torch.randn(33, 17), torch.randn(0, 4), torch.randn(()), torch.randn(5000).to(torch.bfloat16)]
    chunks = [c for x in xs for c in _chunks(x, spec, chunk_bytes=512)]
    assert all(c.HasField("meta") == (c.data == b"" or i == 0 or c.HasField("meta"))
               for i, c in enumerate(chunks))
    got = _feed_all(chunks)
    assert len(got) == len(xs)
    for x, a in zip(xs, got):
        enc = encode_tensor(x, spec)
        assert torch.equal(a.tensor, decode_tensor(enc.payload, enc.shape, enc.dtype, spec))
        assert a.wire_bytes == enc.wire_bytes and a.meta.total_bytes == enc.wire_bytes
        assert a.meta.step == 7 and a.meta.direction == pb.DIRECTION_FORWARD and a.meta.name == "act"
        assert a.spec == spec


def test_metadata_only_in_first_chunk_and_chunk_size_respected() -> None:
    chunks = _chunks(torch.randn(10_000), CodecSpec("identity"), chunk_bytes=4096)
    assert [c.HasField("meta") for c in chunks] == [True] + [False] * (len(chunks) - 1)
    assert all(len(c.data) <= 4096 for c in chunks) and sum(len(c.data) for c in chunks) == 40_000
    assert chunks[0].meta.checksum == zlib.crc32(b"".join(c.data for c in chunks))


def test_int_tensors_travel_through_identity() -> None:
    x = torch.arange(100, dtype=torch.int64).view(10, 10)
    (a,) = _feed_all(_chunks(x, CodecSpec("identity")))
    assert torch.equal(a.tensor, x)


def test_unknown_meta_field_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown TensorMeta fields"):
        list(tensor_to_chunks(torch.ones(2), CodecSpec("fp16"), {"epoch": 1}))


# --- corruption: every case of the item 5 -----------------------------------------------------

def _with_meta(chunks: list[pb.TensorChunk], **changes) -> list[pb.TensorChunk]:
    first = pb.TensorChunk()
    first.CopyFrom(chunks[0])
    for k, v in changes.items():
        if k == "shape":
            del first.meta.shape[:]
            first.meta.shape.extend(v)
        elif k == "block_size":
            first.meta.codec_params.block_size = v
        elif k == "codec_params":
            first.meta.codec_params.CopyFrom(v)
        else:
            setattr(first.meta, k, v)
    return [first, *chunks[1:]]


def test_unknown_codec_id() -> None:
    with pytest.raises(CodecError, match="unknown codec id 42"):
        _feed_all(_with_meta(_chunks(torch.randn(100)), codec=42))


def test_unknown_dtype() -> None:
    with pytest.raises(CodecError, match="DTYPE_UNSPECIFIED"):
        _feed_all(_with_meta(_chunks(torch.randn(100)), dtype=pb.DTYPE_UNSPECIFIED))
    with pytest.raises(CodecError, match="unknown or unspecified tensor dtype 17"):
        _feed_all(_with_meta(_chunks(torch.randn(100)), dtype=17))


def test_dtype_the_codec_cannot_carry() -> None:
    with pytest.raises(CodecError, match="cannot carry dtype torch.int64"):
        _feed_all(_with_meta(_chunks(torch.randn(100)), dtype=pb.DTYPE_INT64))


def test_truncated_stream() -> None:
    chunks = _chunks(torch.randn(2000))
    asm = ChunkAssembler()
    for c in chunks[:-1]:
        assert asm.feed(c) is None
    assert asm.pending
    with pytest.raises(CodecError, match="stream ended inside tensor 'act'.*truncated"):
        asm.finish()


def test_next_tensor_starting_before_the_previous_completes() -> None:
    a, b = _chunks(torch.randn(2000)), _chunks(torch.randn(10))
    with pytest.raises(CodecError, match="previous one: that tensor was truncated"):
        _feed_all(a[:-1] + b)


def test_chunk_without_metadata_first() -> None:
    chunks = _chunks(torch.randn(2000))
    with pytest.raises(CodecError, match="first chunk must carry `meta`"):
        _feed_all(chunks[1:])


def test_overflowing_chunks() -> None:
    chunks = _chunks(torch.randn(2000))
    extra = pb.TensorChunk(data=chunks[-1].data + b"xx")
    with pytest.raises(CodecError, match="overflow"):
        _feed_all(chunks[:-1] + [extra])


def test_corrupt_payload_fails_the_checksum() -> None:
    chunks = _chunks(torch.randn(2000))
    bad = bytearray(chunks[1].data)
    bad[5] ^= 0x40
    chunks[1] = pb.TensorChunk(data=bytes(bad))
    with pytest.raises(CodecError, match="checksum mismatch"):
        _feed_all(chunks)


def test_shape_disagreeing_with_total_bytes() -> None:
    with pytest.raises(CodecError, match="must be .* bytes, the metadata says"):
        _feed_all(_with_meta(_chunks(torch.randn(2000)), shape=[2100]))
    with pytest.raises(CodecError, match="must be .* bytes, the metadata says"):
        _feed_all(_with_meta(_chunks(torch.randn(2000)), block_size=32))
    with pytest.raises(CodecError, match="negative dimension"):
        _feed_all(_with_meta(_chunks(torch.randn(2000)), shape=[-2000]))


def test_sizes_beyond_limits_are_refused_before_allocating() -> None:
    chunks = _chunks(torch.randn(2000))
    # an absurd claimed size must fail on the metadata, not by allocating
    with pytest.raises(CodecError, match="more than the limit"):
        _feed_all(_with_meta(chunks, shape=[1 << 40], total_bytes=1 << 40))
    with pytest.raises(CodecError, match="exceeds the limit"):
        _feed_all(_with_meta(chunks, shape=[1 << 20], total_bytes=1 << 40, codec_params=pb.CodecParams(zstd_level=3)))
    with pytest.raises(CodecError, match="more than the limit of 1000"):
        _feed_all(chunks, WireLimits(max_elements=1000))
    with pytest.raises(CodecError, match="dimensions"):
        _feed_all(_chunks(torch.randn([1] * 9)))
    with pytest.raises(CodecError, match="chunk of 1000 bytes exceeds"):
        _feed_all(chunks, WireLimits(max_chunk_bytes=999))


def test_corrupt_zstd_frame() -> None:
    spec = CodecSpec("int8", zstd_level=3)
    enc = encode_tensor(torch.randn(2000), spec)
    bad = bytearray(enc.payload)
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(CodecError, match="zstd stage"):
        decode_tensor(bytes(bad), enc.shape, enc.dtype, spec)
    with pytest.raises(CodecError, match="zstd stage"):
        decode_tensor(bytes(enc.payload)[:10], enc.shape, enc.dtype, spec)
    with pytest.raises(CodecError, match="zstd stage: frame holds"):
        decode_tensor(enc.payload, (1000,), enc.dtype, spec)


@pytest.mark.parametrize("spec", [CodecSpec("identity"), CodecSpec("fp16"), CodecSpec("int8"), CodecSpec("int4"),
                                  CodecSpec("topk"), CodecSpec("sparse2")])
def test_truncated_payload_for_every_codec(spec: CodecSpec) -> None:
    enc = encode_tensor(torch.randn(3000), spec)
    with pytest.raises(CodecError, match="must be .* bytes"):
        decode_tensor(bytes(enc.payload)[:-1], enc.shape, enc.dtype, spec)


def test_topk_index_out_of_range() -> None:
    spec = CodecSpec("topk", topk_fraction=0.5)
    enc = encode_tensor(torch.randn(10), spec)
    bad = bytearray(enc.payload)
    bad[0:4] = (1 << 30).to_bytes(4, "little")
    with pytest.raises(CodecError, match="outside a tensor of 10 elements"):
        decode_tensor(bytes(bad), enc.shape, enc.dtype, spec)


def test_assembler_recovers_after_an_error() -> None:
    asm = ChunkAssembler()
    bad = _with_meta(_chunks(torch.randn(100)), codec=42)
    with pytest.raises(CodecError):
        asm.feed(bad[0])
    (good,) = _chunks(torch.randn(100))
    assert asm.feed(good) is not None
