"""A stage's state between nodes over gRPC: what a node holds and serves, and how another fetches it.

A node holds two kinds of stage state (`StateHolder`, attached to its Peer server):
- its **live state**: the weights and AdamW state of its layers as its last run left them, after `step` steps,
  snapshotted when the run ended (`atoll.node.slice_state` format, serialized once; later runs never change
  the snapshot, so a fetch in flight stays consistent);
- its **checkpoint folder** (local to the node): step folders of its own writes and of the copies it took
  for other writers (`Peer.Replicate`).

`Peer.FetchState` streams either as `pb.StateChunk`s from a byte offset: every chunk carries the whole
file's size and CRC-32 and its own CRC-32, so the fetcher checks each chunk as it lands and the whole at the
end, and a broken stream is resumed from the bytes already received (`fetch_state`, `fetch_state_to_file`,
which keeps a `.part` file so even a restarted node resumes).
`Peer.HeldState` says which live state a node holds, answering once its runs of older plans have ended.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import torch
from zlib_ng.zlib_ng import crc32

from atoll.node.checkpoint import step_dir
from atoll.node.slice_state import FORMAT, SliceStateError
from atoll.rpc import RpcOptions, make_channel
from atoll.tls import node_dns_name
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc

log = logging.getLogger("atoll.node.state_transfer")

CHUNK_BYTES = 1 << 20
"""Payload bytes per StateChunk (well under gRPC's message limit)."""

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS)
"""Codes after which a fetch is resumed from the bytes it has (a dropped stream, an overloaded peer)."""


class StateTransferError(RuntimeError):
    """A state could not be fetched or does not check out; the message says from whom and what to do."""


@dataclass(frozen=True, kw_only=True)
class OuterPosition:
    """Outer mode: where a live state stands in its replica group's rounds (`HeldStateReply.replica_group`...)."""

    group: str
    """The name of the replica group whose run left the state."""
    round: int
    """The round the state is in: the next to end."""
    steps_in_round: int
    """Inner steps of that round the state has trained."""
    inner_steps: int
    """The group's inner steps a round."""
    landed: bool
    """Every earlier round's outer update is applied to the parameters (no exchange was in flight)."""


@dataclass(frozen=True, kw_only=True)
class LiveState:
    """A stage's weights and optimizer state after `step` steps, serialized (the checkpoint file format)."""

    step: int
    layers: tuple[int, int]
    data: bytes
    checksum: int
    epoch: int
    """The plan epoch whose run left this state."""
    pending: bool = False
    """`data` also holds the gradients of step `step`, whose norm exchange failed on this node before its
    optimizer ran (`atoll.node.roll_forward`)."""
    norm_total: float | None = None
    """The norm exchange's total of step `step` - 1 (the last step this state took), when its run had one."""
    pending_loss: tuple[float, float] | None = None
    """A pending last stage's (loss share, row weight) of step `step`: its mean loss over its rows times their
    share of the global batch, and that share (the shares of all last-stage replicas add up to the batch's loss)."""
    outer: OuterPosition | None = None
    """Outer mode: the replica group and the round the state is in; None: a synchronous plan's state."""

    @classmethod
    def of(cls, state: dict[str, Any], *, step: int, epoch: int, norm_total: float | None = None,
           pending_loss: tuple[float, float] | None = None, outer: OuterPosition | None = None) -> LiveState:
        data = serialize_state(state)
        return cls(step=step, layers=(int(state["start"]), int(state["end"])), data=data, checksum=crc32(data),
                   epoch=epoch, pending="grads" in state, norm_total=norm_total,
                   pending_loss=pending_loss if "grads" in state else None, outer=outer)


def serialize_state(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def deserialize_state(data: bytes, source: str) -> dict[str, Any]:
    """A saved slice from its bytes, checked for its format."""
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise SliceStateError(f"the state from {source} is not a saved slice of format {FORMAT}")
    return state


def checkpoint_file(root: Path, step: int, layers: tuple[int, int]) -> Path:
    return step_dir(root, step) / f"layers-{layers[0]:04d}-{layers[1]:04d}.pt"


# --- the serving side -------------------------------------------------------------------------------------


class StateHolder:
    """What this node serves over FetchState and HeldState: its live state and its checkpoint folder.

    The runner calls `begin_run(epoch)` before it changes its state, `steps_over(epoch)` once it trains no more
    steps (only handovers among the stage's nodes are left) and `end_run(epoch, live)` when the run is over
    (`keep=True`: the run never touched the state, so the one held before stays valid). HeldState
    for epoch e waits until no run of an epoch before e is active, so every node of plan e sees the state
    the previous plan left.
    """

    def __init__(self, *, node_id: str, checkpoint_dir: Path | None = None):
        self.node_id = node_id
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self._cond = threading.Condition()
        self._live: LiveState | None = None
        self._running: set[int] = set()
        self._stepping: set[int] = set()
        self.served_live = 0
        """Complete serves of the live state (a leaving node waits for one: `wait_handed_over`)."""
        self._last_asked = 0.0
        self._last_served = 0.0
        self._asked = False

    @property
    def live(self) -> LiveState | None:
        with self._cond:
            return self._live

    def begin_run(self, epoch: int) -> None:
        with self._cond:
            self._running.add(epoch)
            self._stepping.add(epoch)

    @property
    def stepping(self) -> bool:
        """A run is training steps (`begin_run` and no `steps_over` or `end_run` since)."""
        with self._cond:
            return bool(self._stepping)

    def steps_over(self, epoch: int) -> None:
        with self._cond:
            self._stepping.discard(epoch)
            self._cond.notify_all()

    def end_run(self, epoch: int, live: LiveState | None = None, *, keep: bool = False) -> None:
        with self._cond:
            self._running.discard(epoch)
            self._stepping.discard(epoch)
            if not keep:
                self._live = live
            self._cond.notify_all()

    def held(self, epoch: int, wait: float) -> pb.HeldStateReply:
        """This node's live state once no run older than `epoch` is active (at most `wait` seconds)."""
        deadline = time.monotonic() + wait
        with self._cond:
            self._asked, self._last_asked = True, time.monotonic()
            while any(e < epoch for e in self._running):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LookupError(f"node {self.node_id} is still running plan epoch "
                                      f"{min(self._running)}; ask again")
                self._cond.wait(min(left, 0.5))
            live = self._live
        if live is None:
            return pb.HeldStateReply(holds=False, node_id=self.node_id)
        return pb.HeldStateReply(holds=True, step=live.step, layer_start=live.layers[0], layer_end=live.layers[1],
                                 bytes=len(live.data), plan_epoch=live.epoch, node_id=self.node_id,
                                 pending=live.pending, has_norm_total=live.norm_total is not None,
                                 norm_total=live.norm_total or 0.0, has_pending_loss=live.pending_loss is not None,
                                 pending_loss=live.pending_loss[0] if live.pending_loss else 0.0,
                                 pending_weight=live.pending_loss[1] if live.pending_loss else 0.0,
                                 **(_outer_fields(live.outer) if live.outer is not None else {}))

    def chunks(self, request: pb.StateFetchRequest) -> Iterator[pb.StateChunk]:
        """The chunks answering `request`. Raises KeyError (not held here), ValueError (a bad request)."""
        layers = (request.layer_start, request.layer_end)
        if request.kind == "live":
            with self._cond:
                live = self._live
                self._last_asked = time.monotonic()
            if live is None or live.step != request.step or live.layers != layers:
                held = "nothing" if live is None else f"layers [{live.layers[0]}, {live.layers[1]}) at step {live.step}"
                raise KeyError(f"node {self.node_id} holds no live state of layers [{layers[0]}, {layers[1]}) at step "
                               f"{request.step} (it holds {held})")
            if request.offset > len(live.data):
                raise ValueError(f"offset {request.offset} is past the state's {len(live.data)} bytes")
            return self._live_chunks(live, request.offset)
        if request.kind == "checkpoint":
            if self.checkpoint_dir is None:
                raise KeyError(f"node {self.node_id} keeps no checkpoints")
            path = checkpoint_file(self.checkpoint_dir, request.step, layers)
            if not path.is_file():
                raise KeyError(f"node {self.node_id} holds no checkpoint of layers [{layers[0]}, {layers[1]}) at step "
                               f"{request.step}")
            try:
                return _file_chunks(path, request)
            except FileNotFoundError:  # pruned between the check and the read
                raise KeyError(f"node {self.node_id} pruned its checkpoint of layers [{layers[0]}, {layers[1]}) at "
                               f"step {request.step} just now") from None
        raise ValueError(f"kind must be 'live' or 'checkpoint', got {request.kind[:40]!r}")

    def _live_chunks(self, live: LiveState, offset: int) -> Iterator[pb.StateChunk]:
        total = len(live.data)
        view = memoryview(live.data)
        pos = offset
        while True:
            data = bytes(view[pos:pos + CHUNK_BYTES])
            yield pb.StateChunk(total_bytes=total, checksum=live.checksum, offset=pos, data=data,
                                chunk_checksum=crc32(data), step=live.step, layer_start=live.layers[0],
                                layer_end=live.layers[1])
            pos += len(data)
            if pos >= total:
                break
        with self._cond:
            self.served_live += 1
            self._last_served = time.monotonic()
            self._cond.notify_all()

    def wait_steps_over(self, timeout: timedelta) -> bool:
        """Wait until no run trains a step (a stopping node's run ends at its next step boundary; its handovers
        may still be under way); False on timeout."""
        end = time.monotonic() + timeout.total_seconds()
        with self._cond:
            while self._stepping:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(0.5, left))
            return True

    def forget_live(self) -> None:
        """Drop the live state (the job has finished: nobody will need it)."""
        with self._cond:
            self._live = None

    def wait_handed_over(self, *, most: timedelta, idle: timedelta,
                         unasked: timedelta = timedelta(seconds=10)) -> HandOver:
        """A leaving node's wait: until its live state was served in full and nobody asked about it or fetched it
        for `idle` since (several of the new plan's nodes may take the same layers: a ZeRO stage's replicas), or
        nobody asked about it for `idle` after the new plan's nodes asked (they took it from a replica), or nobody
        asked at all within `unasked` (no new plan needs it: the job is stopping), or `most` passed; says which."""
        start = time.monotonic()
        end = start + most.total_seconds()
        with self._cond:
            while self._running and time.monotonic() < end:  # the run ends at its next step boundary
                self._cond.wait(min(0.5, max(0.0, end - time.monotonic())))
            if self._live is None:
                return HandOver(False, "no live state to hand over")
            served, self._asked = self.served_live, False  # only the questions of the plan after this leave count
            while True:
                now, took = time.monotonic(), self.served_live - served
                fetches = f"{took} fetch{'es' if took > 1 else ''}"
                if took and now - max(self._last_asked, self._last_served) >= idle.total_seconds():
                    return HandOver(True, f"the live state was handed over ({fetches})")
                if now >= end:
                    return HandOver(True, f"the live state was handed over ({fetches}); stopped serving it after "
                                          f"{most.total_seconds():.0f}s") if took else \
                        HandOver(False, f"nobody took the live state within {most.total_seconds():.0f}s")
                if not took and self._asked and now - self._last_asked >= idle.total_seconds():
                    return HandOver(True, "the new plan's nodes took the state from another holder")
                if not self._asked and now - start >= unasked.total_seconds():
                    return HandOver(False, f"no node asked for the live state within {unasked.total_seconds():.0f}s")
                self._cond.wait(min(0.5, max(0.01, end - now)))


@dataclass(frozen=True)
class HandOver:
    """How a leaving node's wait for its live state to be taken ended (`StateHolder.wait_handed_over`)."""

    taken: bool
    """The next plan's nodes have the state: this node served it, or they took it from another holder. False: nobody
    took it (the job is stopping, or no plan came), so the leaving node keeps it as a checkpoint."""
    said: str
    """What happened, for the log."""

    def __str__(self) -> str:
        return self.said


def _outer_fields(o: OuterPosition) -> dict[str, Any]:
    return {"replica_group": o.group, "outer_round": o.round, "steps_in_round": o.steps_in_round,
            "inner_steps": o.inner_steps, "outer_landed": o.landed}


def outer_position(reply: pb.HeldStateReply) -> OuterPosition | None:
    """The place in its replica group's rounds a held state stands at (`_outer_fields` read back); None: a
    synchronous plan's state."""
    if not reply.replica_group:
        return None
    return OuterPosition(group=reply.replica_group, round=reply.outer_round, steps_in_round=reply.steps_in_round,
                         inner_steps=reply.inner_steps, landed=reply.outer_landed)


def _file_chunks(path: Path, request: pb.StateFetchRequest) -> Iterator[pb.StateChunk]:
    data = path.read_bytes()  # checkpoint files are a stage's state: small next to memory; read once, consistent
    total, checksum = len(data), crc32(data)
    if request.offset > total:
        raise ValueError(f"offset {request.offset} is past the file's {total} bytes")

    def gen() -> Iterator[pb.StateChunk]:
        pos = request.offset
        while True:
            chunk = data[pos:pos + CHUNK_BYTES]
            yield pb.StateChunk(total_bytes=total, checksum=checksum, offset=pos, data=chunk,
                                chunk_checksum=crc32(chunk), step=request.step, layer_start=request.layer_start,
                                layer_end=request.layer_end)
            pos += len(chunk)
            if pos >= total:
                return
    return gen()


# --- the fetching side ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class FetchStats:
    source: str
    bytes: int
    """Payload bytes received (a resumed fetch counts only what it still needed; a corrupted chunk counts
    each time it came)."""
    seconds: float
    attempts: int


class _Sink:
    """Where fetched bytes go: memory, or a `.part` file that survives the fetcher."""

    def __init__(self, part: Path | None):
        self.part = part
        self.buf = bytearray()
        self.crc = 0
        if part is not None and part.is_file():
            self.buf = bytearray(part.read_bytes())
        self.crc = crc32(bytes(self.buf))
        self._file = open(part, "ab") if part is not None else None  # noqa: SIM115 - closed in close()

    def __len__(self) -> int:
        return len(self.buf)

    def add(self, data: bytes) -> None:
        self.buf += data
        self.crc = crc32(data, self.crc)
        if self._file is not None:
            self._file.write(data)

    def reset(self) -> None:
        self.buf, self.crc = bytearray(), 0
        if self._file is not None:
            self._file.truncate(0)
            self._file.seek(0)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _fetch(address: str, request: pb.StateFetchRequest, sink: _Sink, *, source: str, token: str | None,
           rpc: RpcOptions, timeout: timedelta, attempts: int) -> FetchStats:
    started, received = time.monotonic(), 0
    total = checksum = None
    last: Exception | None = None
    channel = make_channel(address, rpc, token=token, server_name=node_dns_name(source))  # the holder's own certificate
    attempt = idle = 0
    try:
        stub = pb_grpc.PeerStub(channel)
        # `attempts` bounds the calls in a row that bring less than a chunk: over a slow link a large state outlasts
        # one call's deadline, and a call that moved the fetch on (a chunk or more) is resumed at once, without
        # using a try up
        while idle < attempts:
            attempt += 1
            before = len(sink)
            req = pb.StateFetchRequest()
            req.CopyFrom(request)
            req.offset = len(sink)
            try:
                for chunk in stub.FetchState(req, timeout=timeout.total_seconds()):
                    if total is None:
                        total, checksum = chunk.total_bytes, chunk.checksum
                        if len(sink) > total:  # a stale .part of another file
                            sink.reset()
                            raise _Restart()
                    if (chunk.total_bytes, chunk.checksum) != (total, checksum):
                        sink.reset()  # the source's state changed under us: start over
                        raise _Restart()
                    if chunk.offset != len(sink):
                        raise StateTransferError(f"{source} ({address}) sent bytes from offset {chunk.offset}; "
                                                 f"{len(sink)} were expected")
                    received += len(chunk.data)
                    if crc32(chunk.data) != chunk.chunk_checksum:
                        raise _Restart()  # a corrupted chunk: ask again from what checked out
                    sink.add(chunk.data)
                if total is not None and len(sink) == total:
                    if sink.crc != checksum:
                        sink.reset()
                        raise StateTransferError(f"the state from {source} ({address}) fails its checksum "
                                                 f"(CRC-32 {sink.crc:#010x}, expected {checksum:#010x})")
                    return FetchStats(source=source, bytes=received, seconds=time.monotonic() - started,
                                      attempts=attempt)
                last = StateTransferError(f"the stream from {source} ({address}) ended after {len(sink)} of "
                                          f"{total} bytes")
            except _Restart:
                last = StateTransferError(f"a chunk from {source} ({address}) failed its checksum or the state "
                                          "changed; fetched again")
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE:
                    raise StateTransferError(f"{source} ({address}) refused the state of layers "
                                             f"[{request.layer_start}, {request.layer_end}) at step {request.step}: "
                                             f"{e.code().name}: {e.details()}") from None
                last = StateTransferError(f"{source} ({address}): {e.code().name}: {e.details()}")
                log.info("fetch of layers [%d, %d) from %s broke after %d bytes (%s); resuming",
                         request.layer_start, request.layer_end, source, len(sink), e.code().name)
                if len(sink) - before < CHUNK_BYTES:  # (a call that moved the fetch on is resumed at once)
                    time.sleep(min(2.0, 0.2 * attempt))
            idle = 0 if len(sink) - before >= CHUNK_BYTES else idle + 1
    finally:
        channel.close()
    raise StateTransferError(f"could not fetch layers [{request.layer_start}, {request.layer_end}) at step "
                             f"{request.step} from {source}: {attempts} attempts in a row brought less than "
                             f"{CHUNK_BYTES} bytes ({attempt} in all, {len(sink)} bytes fetched): {last}")


class _Restart(Exception):
    pass


def fetch_state(address: str, request: pb.StateFetchRequest, *, source: str, token: str | None,
                rpc: RpcOptions | None = None, timeout: timedelta = timedelta(seconds=60),
                attempts: int = 4) -> tuple[bytes, FetchStats]:
    """Fetch a state into memory: (its bytes, how the fetch went). A broken stream resumes from its offset."""
    sink = _Sink(None)
    stats = _fetch(address, request, sink, source=source, token=token, rpc=rpc or RpcOptions(), timeout=timeout,
                   attempts=attempts)
    return bytes(sink.buf), stats


def fetch_state_to_file(address: str, request: pb.StateFetchRequest, dest: Path, *, source: str,
                        token: str | None, rpc: RpcOptions | None = None,
                        timeout: timedelta = timedelta(seconds=60), attempts: int = 4) -> FetchStats:
    """Fetch a checkpoint file to `dest` (renamed into place once whole and checked). Bytes land in
    `dest` + ".part" first, so a fetch broken off (even by a restart of this node) resumes where it stopped."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    sink = _Sink(part)
    try:
        stats = _fetch(address, request, sink, source=source, token=token, rpc=rpc or RpcOptions(),
                       timeout=timeout, attempts=attempts)
    finally:
        sink.close()
    part.replace(dest)
    return stats


def held_state(address: str, *, job_id: str, epoch: int, sender: str, token: str | None,
               rpc: RpcOptions | None = None, timeout: timedelta = timedelta(seconds=30),
               node: str | None = None) -> pb.HeldStateReply:
    """Ask a node which live state it holds (it answers once its runs of plans before `epoch` ended). With
    mutual TLS and `node`, the server's certificate must be that node's."""
    channel = make_channel(address, rpc or RpcOptions(), token=token, server_name=node_dns_name(node) if node else None)
    try:
        return pb_grpc.PeerStub(channel).HeldState(
            pb.HeldStateRequest(job_id=job_id, plan_epoch=epoch, sender=sender), timeout=timeout.total_seconds())
    finally:
        channel.close()
