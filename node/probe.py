"""Link probes: round-trip time from empty probes, bandwidth from timed chunked transfers.

A probe of at least `CURVE_MIN_BYTES` times transfers of three sizes and fits latency + size / bandwidth to
them (`fit_transfer_curve`): the link's figures are then those of messages carrying data, the per-message
cost included, as the planner prices a transfer; a smaller probe times one transfer.

`probe_peer` is the client the node agent calls when the coordinator asks it to measure a link;
`receive_probe` is the plain function behind the Peer server's Probe RPC.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Iterator, Sequence
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
CURVE_MIN_BYTES = 64 * 1024
"""Probes of at least this many bytes time three sizes (1/16, 1/4 and all of them) and fit latency + size /
bandwidth to the calls, so the link's round trip is that of a message carrying data, with the per-message
cost every transfer pays, rather than an empty call's."""
CURVE_REPEATS = 2
"""Timed calls per size on the curve; the quickest counts, as for the empty probes."""


@dataclass(frozen=True, kw_only=True)
class TransferCurve:
    """One message's time on a link as latency + bytes / bandwidth, and the medians it was fitted to."""

    latency_s: float
    """Fixed seconds of one message (network latency plus the transport's per-message work)."""
    bandwidth_bytes_per_s: float
    """Bytes per second of a message's size-dependent part."""
    samples: tuple[tuple[int, float], ...] = ()
    """(payload bytes, median one-way seconds) per size timed."""

    def seconds(self, nbytes: float) -> float:
        """Predicted one-way time of a message of `nbytes`."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def measurement(self, *, src: str, dst: str) -> LinkMeasurement:
        """A curve of one-way times as the link record the planner reads (`rtt_seconds` twice the latency)."""
        largest = max((n for n, _ in self.samples), default=0)
        return LinkMeasurement(src=src, dst=dst, bandwidth_bytes_per_s=self.bandwidth_bytes_per_s,
                               rtt_seconds=2 * self.latency_s, probe_bytes=largest, measured_unix=time.time())


def fit_transfer_curve(samples: Sequence[tuple[int, float]]) -> TransferCurve:
    """Least-squares latency + size / bandwidth through (payload bytes, one-way seconds) samples of at least
    two distinct sizes. A fitted negative latency is taken as zero (the line refitted through the origin).
    Where the times do not grow with size (the per-message cost and the machine's noise hide the size's
    effect over the sizes timed), the latency is their mean and the bandwidth the largest size over the
    quickest time, a rate the link at least reached (time larger sizes for a better figure)."""
    sizes = sorted({n for n, _ in samples})
    if len(sizes) < 2:
        raise ValueError(f"a transfer curve needs samples of at least two sizes, got {sizes}")
    if any(n <= 0 or s <= 0 for n, s in samples):
        raise ValueError("samples need positive sizes and times")
    xs = [float(n) for n, _ in samples]
    ys = [s for _, s in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    latency = my - slope * mx
    if latency < 0:
        latency, slope = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    if slope <= 0:
        latency, slope = my, min(ys) / max(xs)
    return TransferCurve(latency_s=latency, bandwidth_bytes_per_s=1.0 / slope,
                         samples=tuple(sorted((int(n), s) for n, s in samples)))


class ProbeError(RuntimeError):
    """A probe could not complete; the message names the peer and the reason."""


class ProbeTooLarge(ValueError):
    """A probe carried more bytes than the receiving node accepts."""


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """What one probe of a peer measured."""

    bandwidth_bytes_per_s: float
    """Bytes per second of a transfer's size-dependent part: the slope of the fitted curve (probes of at least
    `CURVE_MIN_BYTES`), else payload bytes over the seconds the timed transfer took, less one round trip."""
    rtt_seconds: float
    """Round trip of a message: the fitted curve's intercept (probes of at least `CURVE_MIN_BYTES`; never below
    an empty probe's), else the smallest round-trip time of an empty probe."""
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
               timeout: timedelta, sender: str = "", node: str | None = None, start_unix: float | None = None,
               curve: bool = True) -> ProbeResult:
    """Measure the link to the Peer server at `address`: RTT, then timed transfers of `nbytes` (and of 1/16 and
    1/4 of it, fitted to latency + size / bandwidth, from `CURVE_MIN_BYTES` up; `curve=False`: one transfer of
    `nbytes`).

    With mutual TLS and `node`, the server's certificate must be that node's (not only any node's of the job).
    `start_unix` (this machine's clock): connect and take the RTT first, then wait until then to transfer (the
    flows of a machine probe, which must run at one moment).

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
        if start_unix is not None:
            time.sleep(min(max(0.0, start_unix - time.time()), left()))
        sizes = [nbytes // 16, nbytes // 4, nbytes] if curve and nbytes >= CURVE_MIN_BYTES else [nbytes]
        calls: list[tuple[int, float]] = []
        for size in sizes:
            quickest = math.inf
            for _ in range(CURVE_REPEATS if len(sizes) > 1 else 1):
                t0 = time.perf_counter()
                reply = stub.Probe(_payload(size, chunk_bytes, sender), timeout=left())
                quickest = min(quickest, time.perf_counter() - t0)
                if reply.bytes != size:
                    raise ProbeError(f"peer {address} counted {reply.bytes} probe bytes, {size} were sent")
            calls.append((size, quickest))
    except grpc.RpcError as e:
        raise ProbeError(f"probe of {address} failed: {e.code().name}: {e.details()}") from None
    finally:
        channel.close()
    if len(calls) > 1:
        # each call: a round trip (with the per-message cost of data) + size / bandwidth
        curve = fit_transfer_curve(calls)
        return ProbeResult(bandwidth_bytes_per_s=curve.bandwidth_bytes_per_s, rtt_seconds=max(rtt, curve.latency_s),
                           bytes=nbytes, node_id=reply.node_id)
    elapsed = calls[0][1]
    # elapsed = half a round trip to the first byte + the transfer + half a round trip for the reply
    seconds = max(elapsed - rtt, reply.receive_seconds, 1e-9)
    bandwidth = nbytes / seconds if nbytes else 0.0
    return ProbeResult(bandwidth_bytes_per_s=bandwidth, rtt_seconds=rtt, bytes=reply.bytes, node_id=reply.node_id)
