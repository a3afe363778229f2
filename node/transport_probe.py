"""Link probes through the pipeline's own transport: what one activation message really costs.

An empty gRPC call and one large timed transfer (`atoll.node.probe.probe_peer`) miss what every tensor a
stage sends pays on top: serialising it, the codec, the chunked Transfer call, the receiver's checks and
decode, the mailbox. At activation sizes of a few hundred kilobytes that per-message cost dominates. This
probe sends real tensors through two `GrpcTransport`s, a stage and its downstream neighbour, as the runtime
does: the upstream side sends an activation, the downstream side returns it as the activation-gradient, and
the upstream side times the round trip (two messages). Every size is timed `repeats` times and its median
round trip kept; a line latency + size / bandwidth is then fitted to the one-way times (least squares), the
message-size curve the planner's cost model prices a transfer with (`CostModel.transfer_seconds`).

`fit_transfer_curve` (`atoll.node.probe`) is the pure part (tested without a network). `probe_transport` needs both ends' peer
servers in this process: testbeds, benchmarks and a node probing its own loopback; a link between two
machines is measured by `probe_peer`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from datetime import timedelta

import torch

from atoll.compression import CodecSpec
from atoll.node.grpc_transport import GrpcTransport, GrpcTransportConfig, PeerRef
from atoll.node.peer import PeerServer
from atoll.node.probe import TransferCurve, fit_transfer_curve
from atoll.node.transport import TensorKey

__all__ = ["DEFAULT_SIZES", "TransferCurve", "fit_transfer_curve", "probe_transport"]

DEFAULT_SIZES = (256 * 1024, 1024 * 1024, 4 * 1024 * 1024)
"""Payload bytes timed by default: from a small activation to a large one (a curve needs two at least; on a
loopback link the per-message cost hides the size's effect below about a megabyte)."""


def probe_transport(upstream: PeerServer, downstream: PeerServer, *, sizes: Sequence[int] = DEFAULT_SIZES,
                    repeats: int = 7, warmup: int = 2, token: str | None = None,
                    timeout: timedelta = timedelta(seconds=20), dtype: torch.dtype = torch.float32) -> TransferCurve:
    """Time round trips of real tensors from `upstream`'s node to `downstream`'s and back through the
    pipeline transport (identity codec, as a stage with a fixed codec sends), and fit the one-way curve.

    Each size is sent `warmup` times untimed (connections, first allocations), then `repeats` times; the
    median round trip over two is its one-way time. `timeout` bounds every message. The servers' Transfer
    receivers are replaced for the probe's duration and detached after it (do not probe a running stage's
    server)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    elem = torch.empty((), dtype=dtype).element_size()
    if not sizes or min(sizes) < elem:
        raise ValueError(f"sizes must be payload bytes of at least one {dtype} element, got {list(sizes)}")
    codec = CodecSpec("identity")
    common = dict(job_id="transport-probe", plan_epoch=0, shape=None, dtype=dtype, token=token,
                  forward_codec=codec, backward_codec=codec, call_timeout=timeout, send_timeout=timeout,
                  delivery_timeout=timeout)
    up_ref = PeerRef(node_id=upstream.node_id, address=upstream.address)
    down_ref = PeerRef(node_id=downstream.node_id, address=downstream.address)
    sender = GrpcTransport(GrpcTransportConfig(node_id=upstream.node_id, stage=0, upstream=None,
                                               downstream=down_ref, **common), upstream)
    try:
        echo = GrpcTransport(GrpcTransportConfig(node_id=downstream.node_id, stage=1, upstream=up_ref,
                                                 downstream=None, **common), downstream)
        try:
            tensors = [torch.randn(max(1, n // elem)).to(dtype) for n in sizes]
            times: list[list[float]] = [[] for _ in sizes]
            step = 0
            # the sizes take turns, so a change of the machine's load falls on all of them alike
            for k in range(warmup + repeats):
                for tensor, got in zip(tensors, times):
                    fwd, bwd = TensorKey(step, 0, "forward"), TensorKey(step, 0, "backward")
                    t0 = time.perf_counter()
                    sender.send(fwd, tensor)
                    echo.send(bwd, echo.recv(fwd, timeout))
                    sender.recv(bwd, timeout)
                    if k >= warmup:
                        got.append(time.perf_counter() - t0)
                    step += 1
            samples = [(t.numel() * elem, statistics.median(got) / 2) for t, got in zip(tensors, times)]
            echo.flush(timeout)  # the last reply's call completes before the links close
            sender.flush(timeout)
            return fit_transfer_curve(samples)
        finally:
            echo.close()
    finally:
        sender.close()
