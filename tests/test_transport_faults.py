"""A sender process killed in the middle of a tensor: the receiving node frees what it held and goes on."""

from __future__ import annotations

import struct
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from atoll.compression import CodecSpec, tensor_to_chunks
from atoll.node.grpc_transport import GrpcTransport, GrpcTransportConfig, PeerRef
from atoll.node.peer import PeerServer
from atoll.node.transport import TensorKey

SHAPE = (4, 64, 256)  # 256 KiB

# streams the chunks it is given, then stalls mid-tensor until it is killed
_SENDER = """
import struct, sys, time
from atoll.rpc import make_channel
from atoll.v1 import atoll_pb2 as pb, atoll_pb2_grpc as pb_grpc
data = open(sys.argv[2], "rb").read()
chunks, at = [], 0
while at < len(data):
    (n,) = struct.unpack_from("<I", data, at)
    chunks.append(pb.TensorChunk.FromString(data[at + 4:at + 4 + n]))
    at += 4 + n
def stream():
    yield from chunks
    print("sent", flush=True)
    time.sleep(60)
channel = make_channel(sys.argv[1], token="tok")
pb_grpc.PeerStub(channel).Transfer(stream(), timeout=60)
"""


def _wait(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_sender_killed_mid_tensor_leaves_the_receiver_working(tmp_path: Path) -> None:
    with PeerServer(node_id="n0", listen="127.0.0.1:0", token="tok") as s0, \
            PeerServer(node_id="n1", listen="127.0.0.1:0", token="tok") as s1:
        peers = {0: PeerRef(node_id="n0", address=s0.address), 1: PeerRef(node_id="n1", address=s1.address)}
        ident = CodecSpec("identity")
        cfg = dict(job_id="job", plan_epoch=1, token="tok", shape=SHAPE, forward_codec=ident, backward_codec=ident)
        receiver = GrpcTransport(GrpcTransportConfig(node_id="n1", stage=1, upstream=peers[0], downstream=None, **cfg),
                                 s1)
        sender = GrpcTransport(GrpcTransportConfig(node_id="n0", stage=0, upstream=None, downstream=peers[1], **cfg),
                               s0)
        try:
            meta = dict(job_id="job", plan_epoch=1, step=0, micro_batch=0, direction="forward", name="act",
                        sender="n0", pipeline=0, stage=0)
            half = list(tensor_to_chunks(torch.randn(SHAPE), ident, meta, 16 * 1024))[:8]
            blob = tmp_path / "chunks.bin"
            blob.write_bytes(b"".join(struct.pack("<I", len(b)) + b for b in (c.SerializeToString() for c in half)))
            proc = subprocess.Popen([sys.executable, "-c", _SENDER, s1.address, str(blob)], stdout=subprocess.PIPE,
                                    text=True)
            try:
                assert proc.stdout is not None and proc.stdout.readline().strip() == "sent"
                assert _wait(lambda: receiver.mailbox.buffered_bytes > 0, 10)  # room held for the tensor
                proc.kill()
                proc.wait(10)
            finally:
                if proc.poll() is None:
                    proc.kill()
            assert _wait(lambda: receiver.mailbox.buffered_bytes == 0, 10), receiver.mailbox.buffered_bytes
            assert receiver.mailbox.pending() == []
            a = torch.randn(SHAPE)  # the same key, now from the real sender
            sender.send(TensorKey(0, 0, "forward"), a)
            assert torch.equal(receiver.recv(TensorKey(0, 0, "forward"), timedelta(seconds=10)), a)
            sender.flush(timedelta(seconds=10))
        finally:
            sender.close()
            receiver.close()
