"""Checkpoint copies on other nodes: checkpoint folders are local, so each stage's checkpoint is copied to k
other nodes (`[checkpoint] replicas = k`) and a node that needs layers fetches them from a holder.

- `replica_targets`: which nodes take the copies of a writer's file (a pure function of the plan): nodes of
  another region first, then of another island, then nodes that do not already hold these layers.
- `take_copy`: the asked node's side of `Peer.Replicate`: it fetches the file from the writer with
  `Peer.FetchState` (checksummed, resumable) into its own checkpoint folder, and reports the copy to the
  coordinator itself, with its size and CRC-32 (`PeerServer.copy_taken`), which indexes who holds which (step,
  layers) once the copy matches the writer's own record.
- `Replicator`: the writer's side, on a thread of its own (never on a step's path): asks each target to take
  a copy.
- `fetch_checkpoint`: a node resuming from a checkpoint whose files it lacks fetches them from the nearest
  holder the plan names (`Plan.checkpoint_copies`: its own region first).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import grpc

from atoll.node.checkpoint import file_crc32
from atoll.node.state_transfer import FetchStats, StateTransferError, checkpoint_file, fetch_state_to_file
from atoll.plan import Plan
from atoll.rpc import RpcOptions, make_channel
from atoll.tls import node_dns_name
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc

log = logging.getLogger("atoll.node.replication")


def replica_targets(plan: Plan, writer: str, layers: tuple[int, int], k: int) -> list[str]:
    """The `k` nodes (fewer when the plan has fewer) that take copies of `writer`'s checkpoint of `layers`.

    Ranked by: another region than the writer's (a site lost whole loses no checkpoint), another island,
    not already running these layers (their replicas would lose them with the same failure less often than
    the writer, but a copy elsewhere adds more), then node id. Nodes without a Peer address (behind NAT)
    cannot be dialled and take no copies.
    """
    if k < 1:
        return []
    island_of = {n: i.id for i in plan.islands for n in i.nodes}
    holders = {n for p in plan.pipelines for st in p.stages if st.layers[0] < layers[1] and layers[0] < st.layers[1]
               for n in st.nodes}
    region = plan.region_of(writer)
    candidates = [n for n, addr in plan.node_addresses.items() if n != writer and addr]
    candidates.sort(key=lambda n: (plan.region_of(n) == region, island_of.get(n) == island_of.get(writer),
                                   n in holders, n))
    return candidates[:k]


def take_copy(request: pb.ReplicateRequest, *, checkpoint_dir: Path | None, node_id: str, token: str | None,
              rpc: RpcOptions, timeout: timedelta) -> pb.ReplicateReply:
    """Fetch the writer's checkpoint file into this node's checkpoint folder. Raises ValueError for a bad
    request, LookupError when this node keeps no checkpoints, StateTransferError when the fetch failed."""
    layers = (request.layer_start, request.layer_end)
    if not request.source_address or not request.source:
        raise ValueError("Replicate needs the writer's node id and Peer address")
    if not layers[0] < layers[1]:
        raise ValueError(f"layers [{layers[0]}, {layers[1]}) are empty")
    if checkpoint_dir is None:
        raise LookupError(f"node {node_id} keeps no checkpoint folder; it cannot take copies")
    dest = checkpoint_file(checkpoint_dir, request.step, layers)
    started = time.monotonic()
    if dest.is_file():  # taken before (a repeated request)
        return pb.ReplicateReply(bytes=0, seconds=0.0, path=str(dest), file_bytes=dest.stat().st_size,
                                 checksum=file_crc32(dest))
    stats = fetch_state_to_file(request.source_address, pb.StateFetchRequest(
        job_id=request.job_id, kind="checkpoint", step=request.step, layer_start=layers[0], layer_end=layers[1],
        sender=node_id), dest, source=request.source, token=token, rpc=rpc, timeout=timeout)
    log.info("state transfer: %d bytes from %s in %.2f s (checkpoint copy of step %d, layers [%d, %d))",
             stats.bytes, request.source, stats.seconds, request.step, *layers)
    return pb.ReplicateReply(bytes=stats.bytes, seconds=time.monotonic() - started, path=str(dest),
                             file_bytes=dest.stat().st_size, checksum=file_crc32(dest))


@dataclass(frozen=True, kw_only=True)
class CopyMade:
    """A copy of a checkpoint file taken by `node_id` (reported to the coordinator as that node's)."""

    node_id: str
    step: int
    layers: tuple[int, int]
    path: str
    bytes: int
    seconds: float


class Replicator:
    """The writer's side: copies each checkpoint it wrote to `replica_targets`, off the training thread.

    `report(copy)` is called for each copy a target took (the target reports it to the coordinator itself).
    A target that cannot take a copy is logged and skipped: the checkpoint has fewer copies, which status
    shows, and training goes on.
    """

    def __init__(self, *, node_id: str, address: str, job_id: str, token: str | None, rpc: RpcOptions,
                 report: Callable[[CopyMade], None], timeout: timedelta = timedelta(minutes=2),
                 grant: Callable[[str, int, tuple[int, int]], None] | None = None):
        self.node_id, self.address, self.job_id = node_id, address, job_id
        self.grant = grant
        """`StateAccess.grant` of this node's Peer server: lets each target fetch the file it is asked to copy."""
        self.token, self.rpc, self.report, self.timeout = token, rpc, report, timeout
        self._queue: queue.Queue[tuple[Plan, int, tuple[int, int], int] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="atoll-replicator", daemon=True)
        self._thread.start()

    def submit(self, plan: Plan, step: int, layers: tuple[int, int], k: int) -> None:
        self._queue.put((plan, step, layers, k))

    def close(self, timeout: timedelta = timedelta(seconds=30)) -> None:
        """Finish the copies queued (bounded by `timeout`), then end the thread."""
        self._queue.put(None)
        self._thread.join(timeout.total_seconds())

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            plan, step, layers, k = item
            for target in replica_targets(plan, self.node_id, layers, k):
                try:
                    made = self.copy_to(target, plan.node_addresses[target], plan.epoch, step, layers)
                except (grpc.RpcError, StateTransferError) as e:
                    detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
                    log.warning("node %s could not take a copy of the checkpoint of step %d (layers [%d, %d)): %s; "
                                "the checkpoint has one copy fewer", target, step, *layers, detail)
                    continue
                try:
                    self.report(made)
                except Exception as e:  # noqa: BLE001 - the copy exists; a lost report costs an index entry
                    log.error("copy of the checkpoint of step %d on %s not reported: %s", step, target, e)

    def copy_to(self, target: str, address: str, epoch: int, step: int, layers: tuple[int, int]) -> CopyMade:
        if self.grant is not None:  # the target may now fetch this file from this node's Peer server
            self.grant(target, step, layers)
        channel = make_channel(address, self.rpc, token=self.token, server_name=node_dns_name(target))
        try:
            reply = pb_grpc.PeerStub(channel).Replicate(pb.ReplicateRequest(
                job_id=self.job_id, step=step, layer_start=layers[0], layer_end=layers[1], source=self.node_id,
                source_address=self.address, plan_epoch=epoch), timeout=self.timeout.total_seconds())
        finally:
            channel.close()
        if reply.bytes:
            log.info("checkpoint of step %d (layers [%d, %d)) copied to %s: %d bytes in %.2f s", step, *layers, target,
                     reply.bytes, reply.seconds)
        else:  # nothing moved: the target's folder holds that file already
            log.info("checkpoint of step %d (layers [%d, %d)): %s holds it already (it took it before, or its "
                     "checkpoint folder is this node's own, shared)", step, *layers, target)
        return CopyMade(node_id=target, step=step, layers=layers, path=reply.path, bytes=reply.bytes,
                        seconds=reply.seconds)


def fetch_checkpoint(plan: Plan, root: Path, layers: tuple[int, int], *, node_id: str, token: str | None,
                     rpc: RpcOptions, timeout: timedelta) -> list[FetchStats]:
    """Make sure this node's checkpoint folder holds files of the plan's resume step covering `layers`,
    fetching the missing ones from the holders the plan names, nearest first (same region, then others).
    Returns the fetches made. Raises StateTransferError naming the layers no holder could give."""
    step = plan.resume_step
    region = plan.region_of(node_id)
    # ranges to get: the copies' ranges overlapping ours, from a covering chain (the files of one cut)
    ranges = sorted({c.layers for c in plan.checkpoint_copies if c.layers[0] < layers[1] and layers[0] < c.layers[1]})
    fetched: list[FetchStats] = []
    for rng in ranges:
        dest = checkpoint_file(root, step, rng)
        if dest.is_file():  # (what is on disk counts, not what the index credits this node with: a file may be gone)
            continue
        holders = sorted((c for c in plan.checkpoint_copies if c.layers == rng and c.node_id != node_id and c.address),
                         key=lambda c: (plan.region_of(c.node_id) != region, c.node_id))
        errors = []
        for c in holders:
            try:
                stats = fetch_state_to_file(c.address, pb.StateFetchRequest(
                    job_id=plan.job_id, kind="checkpoint", step=step, layer_start=rng[0], layer_end=rng[1],
                    sender=node_id), dest, source=c.node_id, token=token, rpc=rpc, timeout=timeout)
            except StateTransferError as e:
                errors.append(str(e))
                continue
            log.info("state transfer: %d bytes from %s in %.2f s (checkpoint of step %d, layers [%d, %d))",
                     stats.bytes, c.node_id, stats.seconds, step, *rng)
            fetched.append(stats)
            break
        else:
            if holders:
                raise StateTransferError(f"no holder could give layers [{rng[0]}, {rng[1]}) of the checkpoint of step "
                                         f"{step}: {'; '.join(errors)}")
    return fetched
