"""The receive mailbox: validation of every message, bounded buffering, and the step window (no gRPC)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from atoll.compression.spec import CodecSpec
from atoll.compression.wire import tensor_to_chunks
from atoll.node.mailbox import (InvalidTransfer, Mailbox, MailboxClosed, NotReady, ReceiverBusy, ReceiveSpec,
                                UnexpectedTransfer)
from atoll.node.transport import TensorKey
from atoll.v1 import atoll_pb2 as pb

SHAPE = (2, 8, 16)
RAW = 2 * 8 * 16 * 4


def _spec(**kw) -> ReceiveSpec:
    base = dict(job_id="job", plan_epoch=3, pipeline=0, stage=1, upstream="up", downstream="down", shape=SHAPE,
                micro_batches=4, max_tensor_bytes=64 * 1024, max_buffered_bytes=256 * 1024)
    base.update(kw)
    return ReceiveSpec(**base)


def _meta(**kw) -> dict:
    base = dict(job_id="job", plan_epoch=3, step=0, micro_batch=0, direction="forward", name="act", sender="up",
                pipeline=0, stage=0, replica=0)
    base.update(kw)
    return base


def _chunks(t: torch.Tensor | None = None, codec: str = "identity", chunk_bytes: int = 256, **meta):
    t = torch.randn(SHAPE) if t is None else t
    return list(tensor_to_chunks(t, CodecSpec(codec), _meta(**meta), chunk_bytes))


def _receive(box: Mailbox, chunks, deadline: float = 2.0) -> pb.TransferAck:
    return box.receive(iter(chunks), peer="ipv4:127.0.0.1:1", deadline_seconds=deadline)


def test_identity_tensor_arrives_exactly_and_is_counted() -> None:
    box = Mailbox(_spec())
    t = torch.randn(SHAPE)
    ack = _receive(box, _chunks(t, step=0, micro_batch=2))
    assert ack.tensors == 1 and ack.bytes == RAW
    assert box.pending() == [TensorKey(0, 2, "forward")]
    assert torch.equal(box.take(TensorKey(0, 2, "forward"), timeout=1), t)
    assert box.buffered_bytes == 0
    assert (box.stats["forward"].tensors, box.stats["forward"].bytes_wire) == (1, RAW)


def test_gradient_from_downstream_and_several_tensors_in_one_stream() -> None:
    box = Mailbox(_spec())
    g1, g2 = torch.randn(SHAPE), torch.randn(SHAPE)
    grads = [dict(direction="backward", sender="down", stage=2, name="grad")]
    chunks = _chunks(g1, micro_batch=0, **grads[0]) + _chunks(g2, micro_batch=1, **grads[0])
    assert _receive(box, chunks).tensors == 2
    assert torch.equal(box.take(TensorKey(0, 1, "backward"), timeout=1), g2)
    assert torch.equal(box.take(TensorKey(0, 0, "backward"), timeout=1), g1)


def test_int8_payload_is_decoded() -> None:
    box = Mailbox(_spec())
    t = torch.randn(SHAPE)
    ack = _receive(box, _chunks(t, codec="int8"))
    assert ack.bytes < RAW / 3
    got = box.take(TensorKey(0, 0, "forward"), timeout=1)
    assert got.shape == t.shape and (got - t).abs().max() < 0.05


@pytest.mark.parametrize("change, error, words", [
    (dict(plan_epoch=2), UnexpectedTransfer, "epoch 2, which is over"),
    (dict(plan_epoch=4), NotReady, "epoch 4, which has not started"),
    (dict(job_id="other"), UnexpectedTransfer, "job 'other'"),
    (dict(sender="mallory"), UnexpectedTransfer, "come from up"),
    (dict(stage=2), UnexpectedTransfer, "claims pipeline 0 stage 2"),
    (dict(pipeline=1), UnexpectedTransfer, "claims pipeline 1"),
    (dict(micro_batch=4), InvalidTransfer, "micro-batch 4 is out of range"),
    (dict(direction=0), InvalidTransfer, "names no direction"),
])
def test_meta_that_does_not_match_the_stage_is_refused(change, error, words) -> None:
    box = Mailbox(_spec())
    with pytest.raises(error, match=words):
        _receive(box, _chunks(**change))
    assert box.buffered_bytes == 0 and box.pending() == []


def test_wrong_shape_and_dtype_are_invalid() -> None:
    box = Mailbox(_spec())
    with pytest.raises(InvalidTransfer, match=r"shape \[2, 8, 8\]; stage 1 expects \[2, 8, 16\]"):
        _receive(box, _chunks(torch.randn(2, 8, 8)))
    with pytest.raises(InvalidTransfer, match="dtype torch.float16; stage 1 expects torch.float32"):
        _receive(box, _chunks(torch.randn(SHAPE).half()))


def test_first_stage_takes_no_activations_and_last_no_gradients() -> None:
    with pytest.raises(UnexpectedTransfer, match="first stage"):
        _receive(Mailbox(_spec(stage=0, upstream=None)), _chunks())
    with pytest.raises(UnexpectedTransfer, match="last stage"):
        _receive(Mailbox(_spec(downstream=None)), _chunks(direction="backward", sender="down", stage=2))


def test_oversized_tensor_is_refused_before_anything_is_buffered() -> None:
    box = Mailbox(_spec(shape=None, max_tensor_bytes=4096, max_buffered_bytes=8192))
    first = _chunks(torch.randn(64, 64))[0]  # 16 KiB
    consumed = []

    def stream():
        consumed.append(1)
        yield first
        raise AssertionError("the receiver read past the meta chunk of an oversized tensor")

    with pytest.raises(InvalidTransfer, match="too large: 16384 bytes decoded.*limit is 4096"):
        _receive(box, stream())
    assert box.buffered_bytes == 0


def test_lying_meta_cannot_make_the_receiver_allocate() -> None:
    box = Mailbox(_spec(shape=None))
    chunk = _chunks()[0]
    chunk.meta.shape[:] = [1 << 20, 1 << 20]
    with pytest.raises(InvalidTransfer, match="too large"):
        _receive(box, [chunk])
    chunk = _chunks()[0]
    chunk.meta.total_bytes = 1 << 40
    with pytest.raises(InvalidTransfer, match="too large"):
        _receive(box, [chunk])
    assert box.buffered_bytes == 0


def test_corrupt_chunk_fails_the_checksum_and_releases_its_room() -> None:
    box = Mailbox(_spec())
    chunks = _chunks()
    chunks[2].data = bytes([chunks[2].data[0] ^ 0xFF]) + chunks[2].data[1:]
    with pytest.raises(InvalidTransfer, match="checksum mismatch"):
        _receive(box, chunks)
    assert box.buffered_bytes == 0 and box.pending() == []


def test_truncated_overlong_and_headless_streams_are_invalid() -> None:
    box = Mailbox(_spec())
    with pytest.raises(InvalidTransfer, match="stream ended before"):
        _receive(box, _chunks()[:-1])
    extra = _chunks()
    extra[-1].data += b"xx"
    with pytest.raises(InvalidTransfer, match="overflow"):
        _receive(box, extra)
    with pytest.raises(InvalidTransfer, match="before any meta chunk"):
        _receive(box, _chunks()[1:])
    second = _chunks(micro_batch=1)
    with pytest.raises(InvalidTransfer, match="began before"):
        _receive(box, _chunks()[:2] + second)
    assert box.buffered_bytes == 0 and box.pending() == []


def test_full_mailbox_answers_busy_at_the_deadline_then_takes_again() -> None:
    box = Mailbox(_spec(max_tensor_bytes=RAW, max_buffered_bytes=3 * RAW))
    _receive(box, _chunks(micro_batch=0))
    _receive(box, _chunks(micro_batch=1))
    t0 = time.monotonic()
    with pytest.raises(ReceiverBusy, match="buffered bytes are taken"):
        _receive(box, _chunks(micro_batch=2), deadline=0.3)
    assert 0.25 < time.monotonic() - t0 < 2
    box.take(TensorKey(0, 0, "forward"), timeout=1)
    box.take(TensorKey(0, 1, "forward"), timeout=1)
    _receive(box, _chunks(micro_batch=2))


def test_a_sender_waiting_for_room_gets_in_once_the_stage_takes() -> None:
    box = Mailbox(_spec(max_tensor_bytes=RAW, max_buffered_bytes=3 * RAW))
    _receive(box, _chunks(micro_batch=0))
    _receive(box, _chunks(micro_batch=1))
    acks = []
    th = threading.Thread(target=lambda: acks.append(_receive(box, _chunks(micro_batch=2), deadline=5)))
    th.start()
    time.sleep(0.2)
    assert not acks
    box.take(TensorKey(0, 0, "forward"), timeout=1)
    th.join(5)
    assert acks and acks[0].tensors == 1


def test_step_window_past_steps_refused_future_steps_wait() -> None:
    box = Mailbox(_spec(step_window=2))
    box.advance(5)
    with pytest.raises(UnexpectedTransfer, match="step 4, which this stage has finished"):
        _receive(box, _chunks(step=4))
    _receive(box, _chunks(step=6))
    with pytest.raises(ReceiverBusy, match="more than 2 steps ahead"):
        _receive(box, _chunks(step=7), deadline=0.2)
    box.advance(6)
    _receive(box, _chunks(step=7))
    assert box.pending() == [TensorKey(6, 0, "forward"), TensorKey(7, 0, "forward")]


def test_advance_drops_what_nobody_will_take() -> None:
    box = Mailbox(_spec())
    _receive(box, _chunks(step=0, micro_batch=3))
    assert box.buffered_bytes == RAW
    box.advance(1)
    assert box.buffered_bytes == 0 and box.pending() == []


def test_a_retried_copy_is_dropped() -> None:
    box = Mailbox(_spec())
    t = torch.randn(SHAPE)
    _receive(box, _chunks(t))
    _receive(box, _chunks(torch.zeros(SHAPE)))  # in the box already
    assert torch.equal(box.take(TensorKey(0, 0, "forward"), timeout=1), t)
    _receive(box, _chunks(t))  # taken already
    assert box.pending() == [] and box.buffered_bytes == 0


def test_take_times_out_with_what_is_waiting_and_close_wakes_it() -> None:
    box = Mailbox(_spec())
    _receive(box, _chunks(micro_batch=1))
    with pytest.raises(TimeoutError, match=r"step 0 micro-batch 0 \(forward\).*waiting here: \[0/1/forward\]"):
        box.take(TensorKey(0, 0, "forward"), timeout=0.1)
    errors = []

    def wait():
        try:
            box.take(TensorKey(0, 2, "forward"), timeout=10)
        except MailboxClosed as e:
            errors.append(e)

    th = threading.Thread(target=wait)
    th.start()
    time.sleep(0.1)
    box.close()
    th.join(2)
    assert errors
    with pytest.raises(UnexpectedTransfer, match="shutting down"):
        _receive(box, _chunks(micro_batch=3))


def test_spec_is_validated() -> None:
    with pytest.raises(ValueError, match="max_buffered_bytes"):
        _spec(max_tensor_bytes=100, max_buffered_bytes=150)
    with pytest.raises(ValueError, match="step_window"):
        _spec(step_window=0)
    with pytest.raises(ValueError, match="no wire form"):
        _spec(dtype=torch.uint8)
