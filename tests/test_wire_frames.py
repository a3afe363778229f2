"""The transport's fast path writes and reads exactly what protobuf would."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.compression import CodecSpec, encode_tensor
from atoll.compression.wire import WireChunk, chunk_frames, encoded_to_chunks, parse_chunk, tensor_meta
from atoll.v1 import atoll_pb2 as pb

META = dict(job_id="j", plan_epoch=3, step=7, micro_batch=1, direction="forward", name="act", sender="n1",
            pipeline=0, stage=1, replica=0)


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(0, 5000), chunk=st.integers(1, 9000), codec=st.sampled_from(["identity", "int8", "fp16"]))
def test_frames_equal_protobuf_serialisation(numel: int, chunk: int, codec: str) -> None:
    enc = encode_tensor(torch.randn(numel), CodecSpec(codec=codec))
    expected = [c.SerializeToString() for c in encoded_to_chunks(enc, META, chunk)]
    got = list(chunk_frames(tensor_meta(enc, META), enc.payload, chunk))
    assert got == expected


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(0, 3000), chunk=st.integers(1, 5000))
def test_parse_chunk_reads_what_protobuf_reads(numel: int, chunk: int) -> None:
    enc = encode_tensor(torch.randn(numel), CodecSpec(codec="identity"))
    for frame in chunk_frames(tensor_meta(enc, META), enc.payload, chunk):
        fast, ref = parse_chunk(frame), pb.TensorChunk.FromString(frame)
        assert fast.HasField("meta") == ref.HasField("meta")
        if ref.HasField("meta"):
            assert fast.meta == ref.meta
        assert bytes(fast.data) == ref.data


def test_unusual_layouts_go_to_protobuf() -> None:
    # data before meta, and a repeated field: valid protobuf, not the fast layout
    odd = pb.TensorChunk(data=b"xyz").SerializeToString() + pb.TensorChunk(meta=pb.TensorMeta(step=2)).SerializeToString()
    parsed = parse_chunk(odd)
    assert not isinstance(parsed, WireChunk)
    assert parsed.meta.step == 2 and parsed.data == b"xyz"


def test_malformed_messages_fail_as_protobuf_fails() -> None:
    import pytest
    from google.protobuf.message import DecodeError

    for bad in (b"\x0a\xff", b"\x12\x05ab", b"\x0a\x02\xff\xff"):
        with pytest.raises(DecodeError):
            pb.TensorChunk.FromString(bad)
        with pytest.raises(DecodeError):
            parse_chunk(bad)
