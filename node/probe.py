"""Link probes: round-trip time from empty probes, bandwidth from a timed chunked transfer.

`probe_peer` is the client the node agent calls when the coordinator asks it to measure a link;
`receive_probe` is the plain function behind the Peer server's Probe RPC.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import grpc

from atoll.rpc import RpcOptions, make_channel, wait_ready
from atoll.tls import node_dns_name
from atoll.types import LinkMeasurement
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc

PROBE_CHUNK_BYTES = 1024 * 1024
"""Payload per probe message: large enough that per-message overhead does not skew the bandwidth."""
RTT_SAMPLES = 3
"""Empty probes sent; the smallest round trip counts (the others caught scheduling noise)."""


class ProbeError(RuntimeError):
    """A probe could not complete; the message names the peer and the reason."""


class ProbeTooLarge(ValueError):
    """A probe carried more bytes than the receiving node accepts."""


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """What one probe of a peer measured."""

    bandwidth_bytes_per_s: float
    """Payload bytes over the seconds the timed transfer took, less one round trip."""
    rtt_seconds: float
    """Smallest round-trip time of an empty probe."""
    bytes: int
    """Payload bytes of the timed transfer, as the peer counted them."""
    node_id: str
    """The node id the peer answered with."""

    def measurement(self, *, src: str, dst: str | None = None) -> LinkMeasurement:
        """This result as the link record the coordinator stores (`dst` defaults to the peer's id)."""
        return LinkMeasurement(src=src, dst=dst or self.node_id, bandwidth_bytes_per_s=self.bandwidth_bytes_per_s,
                               rtt_seconds=self.rtt_seconds, probe_bytes=self.bytes, measured_unix=time.time())


def receive_probe(chunks: Iterator[pb.ProbeChunk], *, node_id: str, max_bytes: int) -> pb.ProbeReply:
    """Count the payload of a probe stream and time it from its first to its last chunk.

    Raises ProbeTooLarge once more than `max_bytes` arrive; nothing is kept, so a probe never allocates
    more than one message.
    """
    received = 0
    first: float | None = None
    last = time.perf_counter()
    for chunk in chunks:
        last = time.perf_counter()
        if first is None:
            first = last
        received += len(chunk.payload)
        if received > max_bytes:
            raise ProbeTooLarge(f"probe carried more than {max_bytes} bytes; probe with fewer bytes")
    return pb.ProbeReply(bytes=received, receive_seconds=0.0 if first is None else last - first, node_id=node_id)


def _payload(nbytes: int, chunk_bytes: int, sender: str) -> Iterator[pb.ProbeChunk]:
    block = os.urandom(min(chunk_bytes, nbytes))  # random, so no layer can compress it away
    yield pb.ProbeChunk(sender=sender)
    left = nbytes
    while left > 0:
        n = min(left, len(block))
        yield pb.ProbeChunk(payload=block if n == len(block) else block[:n])
        left -= n


def probe_peer(address: str, *, nbytes: int, token: str | None, rpc: RpcOptions | None = None,
               timeout: timedelta, sender: str = "", node: str | None = None) -> ProbeResult:
    """Measure the link to the Peer server at `address`: RTT, then a timed transfer of `nbytes`.

    With mutual TLS and `node`, the server's certificate must be that node's (not only any node's of the job).

    `timeout` bounds the whole probe, connecting included. Raises ProbeError on any failure.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if timeout <= timedelta(0):
        raise ValueError(f"timeout must be positive, got {timeout}")
    rpc = rpc or RpcOptions()
    chunk_bytes = min(PROBE_CHUNK_BYTES, rpc.max_message_bytes - 1024)
    deadline = time.monotonic() + timeout.total_seconds()

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ProbeError(f"probe of {address} ran past its timeout of {timeout.total_seconds():.1f}s")
        return remaining

    channel = make_channel(address, rpc, token=token, server_name=node_dns_name(node) if node else None)
    try:
        try:
            wait_ready(channel, timedelta(seconds=left()))
        except TimeoutError:
            raise ProbeError(f"peer {address} did not accept a connection within "
                             f"{timeout.total_seconds():.1f}s") from None
        stub = pb_grpc.PeerStub(channel)
        rtt = float("inf")
        for _ in range(RTT_SAMPLES):
            t0 = time.perf_counter()
            stub.Probe(iter([pb.ProbeChunk(sender=sender)]), timeout=left())
            rtt = min(rtt, time.perf_counter() - t0)
        t0 = time.perf_counter()
        reply = stub.Probe(_payload(nbytes, chunk_bytes, sender), timeout=left())
        elapsed = time.perf_counter() - t0
    except grpc.RpcError as e:
        raise ProbeError(f"probe of {address} failed: {e.code().name}: {e.details()}") from None
    finally:
        channel.close()
    if reply.bytes != nbytes:
        raise ProbeError(f"peer {address} counted {reply.bytes} probe bytes, {nbytes} were sent")
    # elapsed = half a round trip to the first byte + the transfer + half a round trip for the reply
    seconds = max(elapsed - rtt, reply.receive_seconds, 1e-9)
    bandwidth = nbytes / seconds if nbytes else 0.0
    return ProbeResult(bandwidth_bytes_per_s=bandwidth, rtt_seconds=rtt, bytes=reply.bytes, node_id=reply.node_id)
