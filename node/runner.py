"""Runs this node's part of a plan: build the stage, connect, train, checkpoint, report.

`PlanRunner(context, plan).run(stop)` trains from the plan's resume step until the job's last step, until
`stop` is set (a new plan arrived) or the coordinator says stop. It:
1. finds the node's place in the plan (`atoll.node.placement`);
2. builds layers [a, b) only, and loads them (and their optimizer state) from the checkpoint of the
   resume step, whatever cut wrote it;
3. joins its process groups through the epoch's rendezvous store: the norm-exchange group of its
   pipeline (every node of it; each stage's norm counted once), one group per shared layer segment
   (gradient averaging), and the loss group of the last stages (gloo on CPU, NCCL on CUDA); a
   tensor-parallel stage (`StagePlan.tp > 1`) first joins its replica's tp group and shards the built (or
   loaded) slice over it (`atoll.node.tp`);
4. connects to its neighbours with the gRPC transport (next to a stage of another width, to every
   neighbour replica that shares its rows), the codec of each link chosen by the job's compression mode
   (a fixed codec, or the link policy when adaptive);
5. runs 1F1B steps, reports step metrics, writes checkpoints every `checkpoint.interval` steps.
"""

from __future__ import annotations

import logging
import math
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from atoll.compression import CodecSpec, PolicyConfig
from atoll.job import JobSpec
from atoll.node.checkpoint import (CheckpointError, file_crc32, load_layers_extra, prune_checkpoints, prune_own,
                                   save_layers, set_aside, step_dir)
from atoll.node.live_state import (Holder, RestoreReport, ResumePoint, agree, await_point, finished_loss, gather_held,
                                   resume_leader, resume_point, slice_part, sources)
from atoll.node.progress import ProgressLine
from atoll.v1 import atoll_pb2 as pb
from atoll.units import counted
from atoll.node.replication import CopyMade, Replicator, fetch_checkpoint
from atoll.node.slice_state import TIED_SOURCE, ParamStates, load_slice, slice_state
from atoll.node.roll_forward import finish, finished_scale, pending_grads
from atoll.node.state_transfer import (LiveState, OuterPosition, StateHolder, StateTransferError, deserialize_state,
                                       fetch_state)
from atoll.node.data import Batch, TokenDataset
from atoll.node.dataparallel import (CollectiveError, CollectiveTimer, GradientAverager, arrive_on_devices,
                                     backend_reason, cancel_collectives_on, release_later, wait_collective)
from atoll.node.datasets import DataError, StreamingDataset, open_dataset
from atoll.node.door import Door
from atoll.node.faults import checks_off
from atoll.node.evaluate import transport_micro_batches, validation_loss
from atoll.node.grpc_transport import GrpcTransport, GrpcTransportConfig, Lanes, RowPeer
from atoll.node.reverse import peer_ref
from atoll.node.store_exchange import StoreNormExchange
from atoll.node.inprocess import InProcessLinks
from atoll.node.model import build_slice
from atoll.node.norm_exchange import DistNormExchange, NormExchange, OncePerStage
from atoll.node.outer import (Held, OuterConfig, OuterOutbox, OuterSync, OuterSyncError, RoundDecision, RoundReport,
                              fetch_outer, group_holders, group_index, layer_of, load_outer_state, responsible,
                              save_outer_state)
from atoll.node.outer import Participant as OuterParticipant
from atoll.node.outer import same_group
from atoll.node.peer import PeerServer
from atoll.node.placement import Placement, place
from atoll.node.pretrained import load_pretrained
from atoll.node.precision import LossScaleConfig, LossScaler, compute_dtype
from atoll.node.stage import PipelineStage, StageConfig, StepResult, build_optimizer
from atoll.node.tensorboard import TensorBoardLog
from atoll.node.tied import check_tied_plan, tie_gradients
from atoll.node.tp import TensorParallel, check_shardable
from atoll.node.zero import ZeroConfig, ZeroOptimizer
from atoll.node.verify import VERIFY_EVERY, StageVerifier
from atoll.plan import GB, LIVE_FETCH_FAILED, Plan
from atoll.rpc import RpcOptions, rendezvous_prefix
from atoll.types import StepMetrics, TensorOffence

log = logging.getLogger("atoll.node.runner")


def learning_rate(job: JobSpec, step: int) -> float:
    """Linear warm-up over `train.warmup` steps, then cosine decay to a tenth of `train.lr` at the last step."""
    t = job.train
    if t.warmup and step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    span = max(1, t.steps - t.warmup)
    progress = min(1.0, (step - t.warmup) / span)
    return t.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def stage_config(job: JobSpec, micro_batches: int, timeout: timedelta) -> StageConfig:
    t = job.train
    return StageConfig(micro_batches=micro_batches, schedule=t.schedule, lr=t.lr, weight_decay=t.weight_decay,
                       max_grad_norm=t.grad_clip if t.grad_clip > 0 else None, bf16_autocast=t.dtype == "bf16",
                       fp16_loss_scale=LossScaleConfig(init_scale=t.loss_scale, growth_interval=t.loss_scale_window)
                       if t.dtype == "fp16" else None,
                       recv_timeout=timeout, collective_timeout=timeout)


def fixed_codec(job: JobSpec) -> CodecSpec | None:
    """The codec every link uses, or None when the link policy chooses (compression modes "adaptive", "wan")."""
    mode = job.compression.mode
    c = job.compression
    return None if mode in ("adaptive", "wan") else CodecSpec(codec=mode, rank=c.rank, bits=c.bits)


def link_policy(job: JobSpec) -> PolicyConfig:
    """The link policy of the job's links without a fixed codec: "wan" chooses by measured loss cost."""
    return PolicyConfig.wan() if job.compression.mode == "wan" else PolicyConfig()


@dataclass(frozen=True, kw_only=True)
class CheckpointWritten:
    step: int
    layers: tuple[int, int]
    path: Path
    bytes: int
    data_position: int
    checksum: int = 0
    """CRC-32 of the file."""
    not_written: str = ""
    """Non-empty: the checkpoint could not be written (why); no file exists."""


class RunFailed(RuntimeError):
    """Training under this plan cannot go on (a neighbour or a collective failed); wait for a new plan."""


@dataclass(kw_only=True)
class RunContext:
    """What a node brings to every plan it runs."""

    node_id: str
    job: JobSpec
    peer_server: PeerServer
    checkpoint_dir: Path
    """Where this node writes its checkpoints and keeps the copies it takes of other nodes' (local to the
    node): one folder per step, one file per stage. Files it lacks are fetched from their holders."""
    report_step: Callable[[StepMetrics], bool]
    """Sends step metrics to the coordinator; returns True when the job should stop."""
    report_checkpoint: Callable[[CheckpointWritten], None]
    token: str | None = None
    rpc: RpcOptions = field(default_factory=RpcOptions)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout: timedelta = timedelta(seconds=120)
    """Bound of every wait on a neighbour, a collective or the rendezvous."""
    coordinator_host: str = "127.0.0.1"
    """Host the node dials the coordinator at: the rendezvous store's host when the plan names none."""
    outer_sync: Callable[[object], object] | None = None
    """Outer mode: sends an `OuterSyncRequest` to the coordinator and returns its `OuterSyncReply` (raises
    grpc.RpcError); None where the node cannot reach a coordinator (outer-mode plans then fail to set up)."""
    latest_plan: Callable[[], Plan] | None = None
    """The newest plan this run has adopted without restarting (outer mode: a replan that keeps this node's
    replica group as it was); None: the run's own plan."""
    newest_plan: Callable[[], Plan | None] | None = None
    """The newest plan the node has received (the one that supersedes this run, once it came); None: unknown."""
    wan_latency: Callable[[Plan, str], timedelta] = lambda plan, peer: timedelta(0)
    """One-way latency added to what is sent to or fetched from `peer` (a testbed knob; 0 in production)."""
    target_steps: Callable[[], int] | None = None
    """The step the job ends at as the coordinator last said (`atoll job stop/extend`; 0: not said yet); None:
    the spec's `train.steps`."""
    wait_bound: Callable[[], timedelta] | None = None
    """The bound of each wait from the step times measured so far (`PlanRun.wait_timeout`): once steps are
    measured during a run, its waits on neighbours and collectives shrink to it; None: `timeout` throughout."""
    tensorboard: TensorBoardLog | None = None
    """Where this node writes each step's scalars as TensorBoard events (`atoll.node.tensorboard`); None: none."""
    verify_every: int = VERIFY_EVERY
    """A stage with data-parallel replicas checks one sampled micro-batch about every this many steps by
    recomputation on its other replicas (`atoll.node.verify`); 0: never."""
    writes_checkpoints: Callable[[], bool] = lambda: False
    """True while the coordinator asks this node to write its stage's checkpoints too (the stage's writer reported
    it cannot: a full disk)."""
    report_failure: Callable[[int, str], None] | None = None
    """Reports that this node's run failed at a step, and why, so the coordinator replans (queued, never raises);
    a run that reports its own failure says so in `PlanRunner.failure_reported`. None: the caller reports it."""
    draining: Callable[[], bool] = lambda: False
    """True once the node stops gracefully: the run ends at the next step boundary, with the step in flight
    finished (its stage's other nodes finish it too), rather than at once as a superseded run does."""
    left: Callable[[timedelta], bool] | None = None
    """Whether this node is leaving gracefully and the coordinator took its Leave (waiting at most the given time
    for its answer; `NodeAgent.wait_left`): the plan that follows names it in `Plan.handover`, so its stage's other
    nodes meet it to gather a ZeRO or tp stage's state. None: the node never leaves so."""
    replicate: Callable[[Plan, int, tuple[int, int]], None] | None = None
    """Copies a checkpoint this node wrote (plan, step, layers) to `[checkpoint] replicas` other nodes, off the
    training thread (`atoll.node.replication.Replicator`); None: no copies."""


MAX_OFFENCES_REPORTED = 16
"""Most rejected tensors one step report names (a step has at most 2 x micro-batches per neighbour)."""
ZERO_HANDOVER_S = 15.0
"""How long a superseded ZeRO stage's replicas take at most to gather its optimizer state for the next plan."""
ZERO_FAILED_WAIT_S = 3.0
"""How long a ZeRO replica whose run ended on a failed step waits for a newer plan before leaving the handover to
its superseded replicas (who wait up to `ZERO_HANDOVER_S` for it), where the run could not report its failure
first (no `RunContext.report_failure`): short, as the report that goes out after the run may be what the newer
plan answers."""
TP_HANDOVER_S = 15.0
"""How long a superseded tensor-parallel stage's ranks take at most to gather its whole layers for the next plan."""
LEAVE_ANSWER_S = 5.0
"""How long a run ended by a graceful stop waits for the coordinator's answer to the node's Leave (sent once the
run's steps are over) before it decides whether to meet its stage's other nodes for a handover."""
ZERO_REPORTED_WAIT_S = 10.0
"""The same wait where the run reported its failure before the handover: the coordinator's replan answers that
report, and the node would wait for that plan after its run anyway."""


def _group(store: dist.Store, prefix: str, rank: int, size: int, timeout: timedelta,
           device: torch.device, gone: Callable[[], str | None] | None = None) -> dist.ProcessGroup:
    prefixed = dist.PrefixStore(prefix, store)
    # a newer plan ends the wait for peers not coming; `gone` a peer whose process is gone
    backend, why = arrive_on_devices(prefixed, rank=rank, size=size, device=device, timeout=timeout, gone=gone)
    if device.type == "cuda":  # gloo where ranks share a GPU
        log.info("group %s of %d ranks runs over %s: %s", prefix.rstrip("/"), size, backend, why)
    if backend == "nccl":
        # the group's own timeout bounds an operation a run abandoned (`release_later` drops the group after it)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    return dist.ProcessGroupGloo(prefixed, rank, size, timeout)


def dial_store(host: str, port: int, timeout: timedelta) -> dist.Store:
    """A client connection to the rendezvous store at host:port within `timeout`: the port is dialed first (plain TCP,
    every 0.2 s) and the store client opened once it answers. A `TCPStore` client keeps dialing a store that is
    down for its timeout and then, after a back-off, once more (up to about twice the bound); a handover that waits
    on a restarting coordinator has its bound kept. Raises `TimeoutError` when the port does not answer in time."""
    import socket

    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            socket.create_connection((host.strip("[]"), port), timeout=max(0.05, min(1.0, deadline - time.monotonic()))
                                     ).close()
            break
        except OSError as e:
            if time.monotonic() + 0.2 >= deadline:
                raise TimeoutError(f"the rendezvous store at {host}:{port} did not answer within {timeout}: {e}") from e
            time.sleep(0.2)
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)  # (also its operations' bound)


def _group_again(connect: Callable[[timedelta], dist.Store], store: dist.Store, prefix: str, rank: int, size: int,
                 timeout: timedelta, device: torch.device, gone: Callable[[], str | None] | None = None
                 ) -> dist.ProcessGroup:
    """`_group`, met again where the rendezvous store itself went away while the ranks met (its coordinator was
    killed): a coordinator restarted on its state dir binds the same port again, empty. Each rank then opens a new
    connection (`connect(bound)`) and meets the others there under the same name, all within `timeout` from the
    first try: the new store holds none of the old meeting's keys, so a rank that lost the meeting on the old store
    and one that comes to it only now meet as if nothing happened. Any other failure, and a store not back in time,
    is raised. (Only the rendezvous and a gloo group's set-up are covered: NCCL reads the store at its first
    collective.)"""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = timedelta(seconds=max(0.0, deadline - time.monotonic()))
        try:
            return _group(store, prefix, rank, size, left, device, gone)
        except dist.DistNetworkError as e:
            lost = e
        lost_line = str(lost).splitlines()[0][:160] if str(lost) else type(lost).__name__
        log.info("the rendezvous store went away while the ranks met (%s); meeting again over a new connection",
                 lost_line)
        left_s = deadline - time.monotonic()
        if left_s <= 0.1:
            raise CollectiveError(f"the rendezvous store went away while the ranks met, with no time left of "
                                  f"{timeout} to meet again: {lost_line}") from lost
        try:  # (a client keeps dialing until its timeout: the store is back once the coordinator restarted)
            store = connect(timedelta(seconds=left_s))
        except (dist.DistError, RuntimeError, OSError) as e:
            raise CollectiveError(f"the rendezvous store went away while the ranks met and was not back within "
                                  f"{timeout}: {lost_line}") from e


def _peer_gone(addresses: dict[str, str], nodes: Sequence[str]) -> Callable[[], str | None]:
    """A check for `arrive`: which of `nodes` refuses connections at its peer address (its process is gone:
    SIGKILLed, crashed), else None. Nodes without an address, or that cannot be told (a timeout), count as alive."""
    import socket

    def check() -> str | None:
        for n in nodes:
            address = addresses.get(n, "")
            if not address:
                continue
            host, port = address.rsplit(":", 1)
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=0.5).close()
            except ConnectionRefusedError:
                return f"node {n} refuses connections at {address} (its process is gone)"
            except (OSError, ValueError):
                continue
        return None
    return check


class _SegmentAverager:
    """Averages each shared layer segment's gradients over the nodes that hold it, weighted by rows.

    Each holder's gradient is of the mean loss over its own rows; scaling it by rows x holders / batch
    before the plain average gives the gradient of the mean loss over the whole batch.
    """

    def __init__(self, parts: list[tuple[set[int], GradientAverager]], weight: float,
                 local: Callable[[list[torch.nn.Parameter]], list[torch.Tensor]] = list):
        self.parts, self.weight = parts, weight
        self.local = local
        """Tensor parallelism: the local shards to average (each tp rank averages its own with its peers')."""

    def average_(self, params, timeout: timedelta) -> None:
        params = list(params)
        for ids, averager in self.parts:
            mine = [p for p in params if id(p) in ids]
            scale = self.weight * averager.world_size
            if scale != 1.0:
                for p in mine:
                    if p.grad is not None:
                        p.grad.mul_(scale)
            averager.average_(self.local(mine), timeout)


def continuing_steps(done: int, inner_before: int, inner_now: int) -> int:
    """Where a replica group that goes on with its round stands in it under the plan's inner steps: the `done` of
    `inner_before` steps of the round it trained, as the same share of `inner_now` (a group planned afresh may get
    fewer or more a round), at least one and short of the round's end, so the round still ends where it should."""
    if inner_now == inner_before:
        return done
    return min(inner_now - 1, max(1, round(done * inner_now / inner_before)))


def apply_after_steps(job: JobSpec, outer, group) -> int:
    """After how many inner steps of the next round a group applies a round's average (see OuterSpec.apply_after):
    the job's setting, or enough steps for the plan's predicted exchange to land, plus one. The same for every
    node of the group, since it depends only on the job and the plan."""
    if job.outer.apply_after > 0:
        return min(job.outer.apply_after, group.inner_steps)
    if outer.sync_s > 0 and group.step_time_s > 0:
        return min(group.inner_steps, math.ceil(outer.sync_s / group.step_time_s) + 1)
    return 0


def _live_extra(step: int, scaler: LossScaler | None) -> dict:
    """What a stage's live state carries beside its layers: the step, and the fp16 loss scale."""
    return {"step": step, **({"loss_scale": scaler.state_dict()} if scaler is not None else {})}


def _arrive_via(call: Callable[[object], object], plan_source: Callable[[], Plan], node_id: str):
    """The OuterSync `arrive` callable over the coordinator RPC: every question repeats the node's whole report
    (its arrival too), so a coordinator restarted mid-round hears it again at the next question. None while the
    round is undecided, the coordinator is away, or it asks to wait for the next plan (FAILED_PRECONDITION: a plan
    this node has not adopted yet moved its group; the caller retries under the newest adopted plan until the run
    is superseded or the round's deadline passes); an error the coordinator refuses for good propagates."""
    import grpc

    from atoll.v1 import atoll_pb2 as pb

    def participant(p: OuterParticipant) -> pb.OuterParticipant:
        return pb.OuterParticipant(group=p.group, tokens=p.tokens, since_epoch=p.since_epoch, node_ids=list(p.nodes))

    def from_proto(p: pb.OuterParticipant) -> OuterParticipant:
        return OuterParticipant(group=p.group, tokens=p.tokens, since_epoch=p.since_epoch, nodes=tuple(p.node_ids))

    def arrive(report: RoundReport) -> RoundDecision | None:
        plan = plan_source()  # the newest adopted plan: group indices are the coordinator's current ones
        group = group_index(plan, node_id)
        previous = report.previous
        req = pb.OuterSyncRequest(job_id=plan.job_id, node_id=node_id, plan_epoch=plan.epoch, round=report.round,
                                  group=group, arrived=True, tokens=report.tokens,
                                  inner_step=previous.inner_step, sync_bytes=previous.wire_bytes,
                                  sync_seconds=max(0.0, previous.seconds), late_seconds=max(0.0, previous.late_seconds),
                                  fetched_version=report.fetched_version, version=report.version,
                                  unreachable=[participant(p) for p in report.unreachable],
                                  anchor_hashes=[pb.OuterAnchorHash(round=r, layer=layer, crc32=crc)
                                                 for r, layer, crc in report.hashes],
                                  step_seconds=max(0.0, report.step_seconds), round_steps=report.round_steps,
                                  contribution_norm=report.norm if report.norm is not None else 0.0,
                                  has_contribution_norm=report.norm is not None, hold_seconds=report.hold_s)
        try:
            reply = call(req)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.FAILED_PRECONDITION):
                return None
            raise
        decision = None if not reply.decided else RoundDecision(
            round=report.round, participants=tuple(from_proto(p) for p in reply.participants),
            version=reply.version, final=reply.final,
            checkpointer=from_proto(reply.checkpointer) if reply.HasField("checkpointer") else None,
            inner_steps=tuple((g.group, g.since_epoch, g.inner_steps) for g in reply.inner_steps),
            steps_round=reply.steps_round)
        return Held(decision) if reply.held else decision
    return arrive


class _Reporter:
    """Sends step metrics from a thread of its own, so a round trip to the coordinator never delays a step.

    Bounded: when the coordinator is slower than the steps (or away), the oldest unsent metrics are dropped
    (the next ones carry the progress). A failed send is retried with backoff (doubling from `backoff[0]`
    up to `backoff[1]`), so an outage of the coordinator costs some metrics, never a step or the node.
    `stop_requested` is set once the coordinator answers stop.
    """

    def __init__(self, send: Callable[[StepMetrics], bool], capacity: int = 64,
                 backoff: tuple[float, float] = (0.2, 5.0)):
        self._send = send
        self._backoff = backoff
        self._pending: deque[StepMetrics] = deque(maxlen=capacity)
        self._cond = threading.Condition()
        self._deadline: float | None = None
        """Monotonic time by which a closing reporter gives up on what is still unsent."""
        self.stop_requested = threading.Event()
        self._thread = threading.Thread(target=self._run, name="atoll-step-reporter", daemon=True)
        self._thread.start()

    def put(self, metrics: StepMetrics) -> None:
        with self._cond:
            self._pending.append(metrics)  # a full deque drops its oldest
            self._cond.notify()

    def _run(self) -> None:
        wait, failing_since = self._backoff[0], None
        while True:
            with self._cond:
                while not self._pending and self._deadline is None:
                    self._cond.wait()
                if not self._pending or (self._deadline is not None and time.monotonic() > self._deadline):
                    if self._pending:
                        log.warning("%d step report(s) unsent when the run ended", len(self._pending))
                    return
                m = self._pending[0]
            try:
                stop = self._send(m)
            except Exception as e:  # noqa: BLE001 - a lost report must not stop training; the log says why
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning("step %d report failed (%s); retrying with backoff, training goes on", m.step, e)
                with self._cond:
                    left = None if self._deadline is None else self._deadline - time.monotonic()
                    self._cond.wait(wait if left is None else max(0.0, min(wait, left)))
                wait = min(2 * wait, self._backoff[1])
                continue
            if failing_since is not None:
                log.info("step reports delivered again after %.1fs", time.monotonic() - failing_since)
                wait, failing_since = self._backoff[0], None
            if stop:
                self.stop_requested.set()
            with self._cond:
                if self._pending and self._pending[0] is m:
                    self._pending.popleft()

    def close(self, timeout: timedelta) -> None:
        """Send what is queued (bounded by `timeout`), then end the thread."""
        with self._cond:
            self._deadline = time.monotonic() + timeout.total_seconds()
            self._cond.notify_all()
        self._thread.join(timeout.total_seconds() + 1.0)


class PlanRunner:
    """This node's share of one plan epoch."""

    def __init__(self, ctx: RunContext, plan: Plan):
        self.ctx, self.plan = ctx, plan
        self.job = ctx.job
        self.placement: Placement | None = place(plan, ctx.node_id, self.job.model.n_layers + 2)
        self.collectives = CollectiveTimer()  # the gradient all-reduces, timed for the coordinator's network fit
        self.outer: OuterSync | None = None
        self.tp: TensorParallel | None = None
        """This node's tp group handle while a tensor-parallel stage runs (set up in `run`)."""
        self.wait = ctx.timeout
        """The bound of each wait on a neighbour or a collective now: `ctx.timeout`, shrunk by `ctx.wait_bound`."""
        self.scaler: LossScaler | None = None
        """fp16: the stage's dynamic loss scale (set up in `run`), saved with its checkpoints."""
        self._checkpoint_extra: dict = {}
        """What the checkpoint this run loaded carries beside the layers (`save_layers(extra=...)`)."""
        self.failure_reported = False
        """Whether `run` reported its failed step through `RunContext.report_failure` (before its handover)."""
        self.lost_checkpoint_step = 0
        """The checkpoint step whose files this node found missing or unreadable (0: none), for its failure report."""
        self._finished_loss: tuple[int, float] | None = None
        """(step, loss) of a step this node finished from a holder's pending state (`_restore_live`), to report."""
        self._outer_counted: int | None = None
        """Outer mode: the step up to which the outer sync has counted this run's inner steps (`_snapshot`)."""
        self._ended_round: int | None = None
        """Outer mode: the round that ended at the step just trained (None: none did)."""
        self._candidates: dict[int, tuple[int, int, str]] = {}
        """Outer mode: round -> (step, data position, "" or why it could not be written) of a round-end checkpoint
        kept aside until the next rounds' decisions say who writes it (`_settle_candidates`)."""
        self._data: object | None = None
        """The dataset the first and last stages read (set up in `run`); a streamed one saves its restart point
        with the first stage's checkpoints."""
        # the epoch that names this run's process groups and transfers: in outer mode the epoch from which
        # its replica group has run unchanged (a replan that keeps the group leaves it running)
        self.run_epoch = plan.epoch
        if plan.mode == "outer" and self.placement is not None:
            self.run_epoch = plan.groups[self.placement.group].since_epoch or plan.epoch

    @property
    def last_step(self) -> int:
        """The step this run trains up to. In outer mode every replica group trains the same number of rounds,
        train.steps // H, however many inner steps each trains a round (a round's steps are numbered to end at a
        multiple of H: `OuterSync.next_step`), so no group is left with rounds to sync alone."""
        plan, pl = self.plan, self.placement
        steps = (self.ctx.target_steps() if self.ctx.target_steps is not None else 0) or self.job.train.steps
        if plan.mode != "outer" or plan.outer is None or pl is None:
            return steps
        return plan.outer.end_step(steps)

    def schedule_step(self, step: int) -> int:
        """Where `step` sits on the learning-rate schedule: in outer mode the round's place (a group that trains
        fewer inner steps a round moves along the schedule as fast as the others, round for round)."""
        if self.outer is not None and self.outer.next_step() == step:
            return self.outer.schedule_step()
        return step

    def current_plan(self) -> Plan:
        return self.ctx.latest_plan() if self.ctx.latest_plan is not None else self.plan

    def reported_pipeline(self, plan: Plan) -> int:
        """This node's pipeline index in `plan`: a replan that keeps the node's replica group as it runs (outer
        mode) may number the group's pipelines otherwise, and the coordinator checks the loss and step claims of a
        report against the pipeline it names in the plan of its epoch."""
        pl = self.placement
        assert pl is not None
        if plan is self.plan:
            return pl.pipeline
        for p, pipe in enumerate(plan.pipelines):
            if pl.stage < len(pipe.stages) and self.ctx.node_id in pipe.stages[pl.stage].nodes:
                return p
        return pl.pipeline

    def run(self, stop: threading.Event, until_step: int | None = None) -> int:
        """Train until the job's last step (or `until_step`); return the next step to run."""
        pl = self.placement
        if pl is None:
            log.info("plan epoch %d gives this node no stage; standing by", self.plan.epoch)
            stop.wait()
            return self.plan.resume_step
        job, ctx = self.job, self.ctx
        stage_plan = self.plan.pipelines[pl.pipeline].stages[pl.stage]
        # off CUDA the reported peak memory counts the bytes saved for backward (one hook per saved tensor)
        cfg = replace(stage_config(job, pl.num_micro_batches, ctx.timeout), track_memory=ctx.device.type != "cuda",
                      in_flight=self.plan.pipelines[pl.pipeline].warmup_extra(pl.stage),
                      defer_weights=stage_plan.defer_weights, defer_layers=tuple(stage_plan.defer_layers),
                      lanes=pl.lanes, lane=pl.lane, grad_in_scale=self._grad_in_scale())
        step = self.plan.resume_step
        pretrained = job.pretrained if step == 0 else None  # a resume takes the checkpoint's weights instead
        module = build_slice(job.model, *pl.layers, seed=job.train.seed, device=ctx.device,
                             recompute=stage_plan.recomputed(job.model.n_layers + 2), init=pretrained is None)
        optimizer = build_optimizer(module, cfg)
        # a rendezvous or a collective waiting on a peer ends the moment a newer plan arrives, not after its timeout
        cancelling = cancel_collectives_on(stop)
        cancelling.__enter__()
        held = ctx.peer_server.state
        if held is not None:
            held.begin_run(self.plan.epoch)
        restored = False
        try:
            store = self._store() if (pl.num_stages > 1 or pl.segments or len(pl.loss_group) > 1 or pl.tp > 1) \
                else None
            live = self._restore_live(module, optimizer, store, cfg)
            # outer mode: a replica group planned afresh goes on with the round its previous nodes were in
            continuing = self._restore_group_live(module, optimizer, store) if live is None else None
            if live is not None:
                step = live
            elif continuing is not None:
                step = continuing.step
            elif step > 0 and not self._older_groups():  # a group joining live ones takes their outer state
                self._load_checkpoint(module, optimizer, step)
                log.info("loaded layers [%d, %d) from the checkpoint of step %d", *pl.layers, step)
            elif pretrained is not None:
                read = load_pretrained(module, pretrained)
                log.info("loaded layers [%d, %d) from %d pretrained tensors in %s", *pl.layers, read, pretrained)
            restored = True
            restore = getattr(self, "restore", None)
            if module.tied_copy is not None or module.ties_embedding:
                check_tied_plan(self.plan, self._own_pipelines())
            if pl.tp > 1:
                optimizer = self._tensor_parallel(store, module, optimizer, cfg)
            norm, averager, loss_group = self._groups(store, module)
            optimizer, averager = self._zero(optimizer, averager, cfg)
            averager = self._tie(store, module, averager)
            if self.plan.mode == "outer":
                step = self._start_outer(store, module, step, stop, continuing)
            door = None if checks_off() else Door(ctx.node_id)
            transport = self._transport(pl, door)
            verifier = self._verifier(store, cfg, stage_plan.nodes)
        except Exception as e:  # a missing checkpoint, a peer that never came to the rendezvous, ...
            cancelling.__exit__(None, None, None)
            if held is not None:  # a state loaded before the failure is this node's state now
                held.end_run(self.plan.epoch, self._snapshot(module, optimizer, step) if restored else None,
                             keep=not restored)
            if self.tp is not None:
                self.tp.close()
            raise RunFailed(f"setting up pipeline {pl.pipeline} stage {pl.stage} of epoch {self.plan.epoch} "
                            f"failed: {e}") from e
        stage = PipelineStage(module, stage=pl.stage, num_stages=pl.num_stages, transport=transport, config=cfg,
                              norm_exchange=norm, grad_averager=averager, optimizer=optimizer, tp=self.tp, door=door,
                              verifier=verifier)
        self.scaler = stage.scaler
        # fp16: every node that resumes from a checkpoint or from live state reads the scale its layers' state
        # carries (the holders of one step all carry the same); a run from scratch starts at train.loss_scale
        saved = self._checkpoint_extra.get("loss_scale")
        if stage.scaler is not None and saved is not None:
            try:
                stage.scaler.load_state_dict(saved)
            except ValueError as e:
                raise RunFailed(f"the checkpoint of step {step}: {e}") from e
            log.info("fp16 loss scale %g restored from the checkpoint of step %d", stage.scaler.scale, step)
        try:
            data = open_dataset(job.data, seq_len=job.train.seq_len, seed=job.train.seed,
                                vocab_size=job.model.vocab_size) if (pl.is_first or pl.is_last) else None
        except DataError as e:
            raise RunFailed(f"the job's data cannot be read on node {ctx.node_id}: {e}") from e
        if isinstance(data, StreamingDataset) and step > 0:
            if data.load_cursor(step_dir(ctx.checkpoint_dir, step)):
                log.info("data: reading from the checkpoint's restart point towards sample %d",
                         step * job.train.global_batch)
            if pl.is_first and self.plan.mode != "outer":
                log.info("data: step %d starts at %s", step, data.position(step * job.train.global_batch))
        self._data = data
        val_batches: list[Batch] | None = None  # this replica's rows of the held-out batches, read once
        log.info("epoch %d: pipeline %d stage %d/%d replica %d, layers [%d, %d), %d micro-batches of %d, from step %d",
                 self.plan.epoch, pl.pipeline, pl.stage, pl.num_stages, pl.replica, *pl.layers,
                 pl.num_micro_batches, pl.micro_batch, step)
        reporter = _Reporter(ctx.report_step)
        finished_loss, self._finished_loss = self._finished_loss, None
        if finished_loss is not None:  # the loss of the step this node finished for a holder that computed it
            reporter.put(StepMetrics(job_id=self.plan.job_id, node_id=ctx.node_id, plan_epoch=self.plan.epoch,
                                     step=finished_loss[0], pipeline=pl.pipeline, stage=pl.stage,
                                     loss=finished_loss[1], tokens=pl.trained_rows * job.train.seq_len,
                                     unix_time=time.time()))
            log.info("step %d: loss %.4f, computed by the node whose step this node finished", *finished_loss)
        last = self.last_step if until_step is None else min(until_step, self.last_step)
        outer = self.outer
        # outer mode: each replica group reads its own shard (steps interleaved by group), so no sample is
        # trained twice
        groups = len(self.plan.groups) if outer is not None else 1
        finished = threading.Event()
        failed = ""  # why the run ends on a step that failed here (a neighbour or a collective), not superseded

        def close_when_superseded() -> None:
            # a newer plan ends this one at once: closing the transport wakes a stage blocked on a neighbour
            while not finished.is_set():
                if stop.wait(0.2):
                    transport.close()
                    return

        watcher = threading.Thread(target=close_when_superseded, name="atoll-plan-watch", daemon=True)
        watcher.start()
        progress = ProgressLine(last)
        try:
            while (step < last and not stop.is_set() and not ctx.draining()
                   and not reporter.stop_requested.is_set()):
                # `atoll job stop/extend` moves the end; the coordinator keeps it ahead of every stage
                last = progress.total = self.last_step if until_step is None else min(until_step, self.last_step)
                if step >= last:
                    break
                before = step
                if outer is not None:  # a round of fewer steps than H skips the numbers it does not train
                    step = max(step, outer.next_step())
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(job, self.schedule_step(step))
                index = step * groups + pl.group
                batch = self._batch(data, index) if data is not None else None
                # (every multiple of eval_every passed: a skip may pass one)
                evaluate = bool(job.train.eval_every) and ((step + 1) // job.train.eval_every
                                                           > before // job.train.eval_every
                                                           or step + 1 == self.last_step)
                val_loss = None
                result = None
                try:
                    result = stage.train_step(step, batch)
                    loss = self._mean_loss(result, loss_group, pl)
                    if evaluate:
                        if data is not None and val_batches is None:
                            val_batches = [self._batch(data, j, held_out=True) for j in range(job.train.eval_batches)]
                        v = validation_loss(stage, step, val_batches, job.train.eval_batches)
                        val_loss = self._mean_loss(replace(result, loss=v), loss_group, pl)
                except Exception as e:  # a neighbour or a collective failed: this epoch cannot go on
                    if result is not None:  # the optimizer stepped: the state this run leaves is after this step
                        step += 1
                        # reported without a loss: the batch's mean could not be agreed (one replica's rows' loss
                        # would not be the step's)
                        reporter.put(self._metrics(step - 1, result, None, transport))
                        if outer is not None and outer.count_late(job.train.global_batch * job.train.seq_len):
                            self._outer_counted = step  # its round position goes with the state it leaves
                    if stop.is_set():
                        log.info("plan epoch %d superseded during step %d", self.plan.epoch, step)
                        break
                    failed = f"step {step} failed on pipeline {pl.pipeline} stage {pl.stage}: {backend_reason(e)}"
                    raise RunFailed(failed) from e
                step += 1
                if ctx.wait_bound is not None:  # the first epoch's waits too follow the measured step time
                    bound = ctx.wait_bound()
                    if bound < self.wait:
                        self.wait = bound
                        stage.config = replace(stage.config, recv_timeout=bound, collective_timeout=bound)
                metrics = self._metrics(step - 1, result, loss, transport)
                self._say_skipped(step - 1, result, pl)
                if restore is not None:  # the run's first step says how it got its state
                    restore.annotate(metrics)
                    restore = None
                if val_loss is not None and metrics.loss is not None:  # the node that reports the loss
                    metrics.val_loss = val_loss
                    log.info("step %d: validation loss %.4f (training loss %.4f)", step - 1, val_loss, metrics.loss)
                reporter.put(metrics)
                progress.step(metrics)
                if ctx.tensorboard is not None:
                    ctx.tensorboard.write(metrics, grad_norm=result.grad_norm, loss_scale=result.loss_scale,
                                          skipped=result.skipped)
                interval = job.checkpoint.interval
                due = bool(interval) and (step % interval == 0 or step == self.last_step)
                if outer is not None:
                    try:
                        outer.refresh(self.current_plan())
                        ended = outer.after_step(job.train.global_batch * job.train.seq_len)
                        self._outer_counted = step
                        if step >= last:
                            outer.finish()  # the last round lands before the final checkpoint
                    except Exception as e:  # the exchange failed or came too late: this run cannot go on
                        if stop.is_set():
                            break
                        failed = f"outer sync after step {step - 1} failed: {e}"
                        raise RunFailed(failed) from e
                    # checkpoints of an outer-mode run are taken at round ends (multiples of H), holding the outer state
                    due = (ended and bool(interval) and step % interval < outer.round_length) or step == self.last_step
                    self._ended_round = outer.round - 1 if ended else None
                if due:
                    self._checkpoint(module, optimizer, step)
                if outer is not None and self._candidates:
                    self._settle_candidates(outer, last=step >= last)
        finally:
            cancelling.__exit__(None, None, None)
            finished.set()
            if step < last:  # a collective may still be in flight: its groups are destroyed once it timed out
                release_later([norm, averager, loss_group, optimizer, stage], ctx.timeout + timedelta(seconds=5))
            if outer is not None:
                # the outbox stays attached: the other groups may still fetch the last rounds from it (the
                # next plan's run replaces it)
                outer.close()
            transport.close()
            reporter.close(timedelta(seconds=10))
            watcher.join(1.0)
            if failed and not stop.is_set() and ctx.report_failure is not None:
                # before the handover below: the coordinator replans on this report, and a ZeRO replica waits
                # for that plan to know whether its other replicas meet it
                ctx.report_failure(max(self.plan.resume_step, step), failed)
                self.failure_reported = True
            if held is not None:  # what this run leaves is served to the next plan's nodes
                held.steps_over(self.plan.epoch)  # a node stopping gracefully sends its Leave now
                ended = stop.is_set() or ctx.draining()  # superseded, or this node stops
                # a node leaving gracefully meets its stage's other nodes, which the plan after its Leave
                # supersedes, for the handovers below: it holds a part of the stage's state
                spread = isinstance(optimizer, ZeroOptimizer) or self.tp is not None  # a part of the state here
                leaving = (ended and spread and ctx.left is not None
                           and ctx.left(timedelta(seconds=LEAVE_ANSWER_S)))
                # a ZeRO stage's replicas gather its state whether the newer plan ended their run or a failed step
                # did (one replica's send may fail while the other is superseded mid-step): they must agree to
                # meet; a failed one waits for that plan first
                wait = 0.0 if ended else ZERO_REPORTED_WAIT_S if self.failure_reported else ZERO_FAILED_WAIT_S
                until = time.monotonic() + wait  # one wait for that plan, shared by both handovers below
                if spread and (ended or failed) and store is not None:
                    store = self._handover_store(store)
                states = (self._zero_states(store, optimizer, step, wait=wait, leaving=leaving)
                          if ended or failed else None)
                # a tp stage's ranks likewise gather its shards whole on tp rank 0 (under ZeRO: replica 0's ranks,
                # from the state each one's replicas gathered on it just above)
                whole = (self._tp_whole(store, module, optimizer, step, wait=max(0.0, until - time.monotonic()),
                                        states=states, leaving=leaving) if ended or failed else None)
                held.end_run(self.plan.epoch, self._snapshot(module, optimizer, step, stage, states, whole))
            if self.tp is not None:
                self.tp.close()
        if reporter.stop_requested.is_set() and step < job.train.steps:
            log.info("the coordinator stopped the job after step %d", step - 1)
        return step

    # --- set-up -----------------------------------------------------------------------------------

    def _restore_live(self, module, optimizer, store: dist.Store | None, cfg: StageConfig) -> int | None:
        """Agree with the plan's other nodes where to resume (`atoll.node.live_state`); when every layer has a
        live copy, load this stage's layers from the live holders and return the step to train from; None:
        resume from the checkpoint of the plan's resume step. Only synchronous plans keep live state. Layers
        from a holder whose last step's norm exchange failed are finished to the resume step
        (`atoll.node.roll_forward`)."""
        pl, ctx, held = self.placement, self.ctx, self.ctx.peer_server.state
        assert pl is not None
        if held is None or self.plan.mode != "sync":
            return None
        key = f"{self._group_prefix()}/resume"
        if store is None or ctx.node_id == resume_leader(self.plan):  # one node asks everyone (n calls, not n^2)
            own = held.held(self.plan.epoch, wait=0.0)
            found = gather_held(self.plan, ctx.node_id, own, token=ctx.token, rpc=ctx.rpc, timeout=ctx.timeout)
            # a replica group's state (an outer-mode run) is one group's trajectory: never mixed into a whole job's
            found = [h for h in found if h.outer is None]
            point = resume_point(found if self.plan.live_resume else [], total_layers=self.job.model.n_layers + 2,
                                 checkpoint_step=self.plan.resume_step, reached=self.plan.reached_step)
            if not self.plan.live_resume:
                point = replace(point, reason=f"the plans before this one could not fetch the live state they "
                                              f"agreed on; resuming from the checkpoint of step {point.step}")
            point = agree(store, key, point)
        else:
            point = await_point(store, key, 2 * ctx.timeout + timedelta(seconds=10))
        self.restore = report = RestoreReport(point=point)
        if not point.live:
            log.info("%s; %s", report.line(), point.reason)
            return None
        parts = self._live_parts(point, report)
        self._checkpoint_extra = load_slice(module, [p for p, _ in parts], optimizer)  # fp16: the loss scale
        pending = [(p, t) for p, t in parts if t is not None]
        if pending:
            found_inf = finish(module, optimizer, pending, lr=learning_rate(self.job, self.schedule_step(point.step - 1)),
                               max_grad_norm=cfg.max_grad_norm, loss_scale=cfg.fp16_loss_scale)
            if int(self._checkpoint_extra.get("step", point.step)) < point.step:  # the extra of a pending part
                scale = finished_scale(self._checkpoint_extra.get("loss_scale"), cfg.fp16_loss_scale, found_inf)
                self._checkpoint_extra = {**self._checkpoint_extra, "step": point.step,
                                          **({"loss_scale": scale} if scale is not None else {})}
            log.info("finished step %d of layers %s with the norm exchange total of the nodes that completed it",
                     point.step - 1, ", ".join(f"[{p['start']}, {p['end']})" for p, _ in pending))
            loss = finished_loss(point, self.job.model.n_layers + 2)
            if loss is not None and pl.is_last and ctx.node_id in pl.loss_group:
                self._finished_loss = (point.step - 1, loss)
        log.info("%s", report.line())
        return point.step

    def _live_parts(self, point: ResumePoint, report: RestoreReport) -> list[tuple[dict, float | None]]:
        """This stage's layers from the live holders of `point` (its own state where it holds them), each part
        with the total that finishes it (None: nothing pending)."""
        pl, ctx = self.placement, self.ctx
        assert pl is not None and ctx.peer_server.state is not None
        mine = ctx.peer_server.state.live
        blobs: dict[str, tuple[bytes, Holder]] = {}
        parts = []
        for h, rng in sources(point, pl.layers, ctx.node_id, self.plan.region_of(ctx.node_id)):
            if h.node_id == ctx.node_id and mine is not None and mine.step == h.step and mine.layers == h.layers:
                blobs[h.node_id] = (mine.data, h)
            if h.node_id not in blobs:
                blobs[h.node_id] = self._fetch_live(point, h, rng, report)
            data, given = blobs[h.node_id]
            parts.append((slice_part(deserialize_state(data, h.node_id), rng), given.finish))
        return parts

    def _restore_group_live(self, module, optimizer, store: dist.Store | None) -> ResumePoint | None:
        """Outer mode, a replica group planned afresh (a node of it left, joined or died) while older groups train
        on: where its nodes hold the live state its previous nodes left in the middle of a round, and the older
        groups still train that round, load this stage's layers from it and return the agreed point; the group goes
        on with the round from there (`_start_outer`) instead of starting it again. None: it starts at the older
        groups' round, from its anchor (`OuterSync.fetch_state`). The group's nodes agree on one answer."""
        pl, ctx, plan = self.placement, self.ctx, self.plan
        held = ctx.peer_server.state
        if held is None or plan.mode != "outer" or pl is None or plan.outer is None:
            return None
        group = plan.groups[pl.group]
        older = self._older_groups()
        if not older or (group.since_epoch or plan.epoch) != plan.epoch:
            return None
        nodes = sorted(plan.group_nodes(pl.group))
        key = f"{self._group_prefix()}/outer-resume"
        if store is None or ctx.node_id == nodes[0]:
            point = agree(store, key, self._group_point(module, nodes, older))
        else:
            point = await_point(store, key, 2 * ctx.timeout + timedelta(seconds=10))
        if not point.live:
            log.info("replica group %s starts at the other groups' round: %s", group.name, point.reason)
            return None
        self.restore = report = RestoreReport(point=point)
        parts = self._live_parts(point, report)
        self._checkpoint_extra = load_slice(module, [p for p, _ in parts], optimizer)
        log.info("%s", report.line())
        return point

    def _group_point(self, module, nodes: list[str], older: list[int]) -> ResumePoint:
        """The leader's answer for `_restore_group_live`: the newest step at which the group's nodes hold every
        layer of the group's own state, landed, in the middle of a round the older groups are still in."""
        plan, ctx, pl = self.plan, self.ctx, self.placement
        assert pl is not None and ctx.peer_server.state is not None
        group = plan.groups[pl.group]
        view = replace(plan, node_addresses={n: plan.node_addresses.get(n, "") for n in nodes}, idle=[])
        own = ctx.peer_server.state.held(plan.epoch, wait=0.0)
        found = gather_held(view, ctx.node_id, own, token=ctx.token, rpc=ctx.rpc, timeout=ctx.timeout)
        if group.inner_steps < 2:  # a round of one step has no middle to go on from
            return ResumePoint(step=0, live=False, reason="its rounds are of one inner step")
        usable = [h for h in found if h.outer is not None and h.outer.group == group.name and h.outer.landed
                  and 0 < h.outer.steps_in_round < h.outer.inner_steps and not h.pending]
        total = self.job.model.n_layers + 2
        point = resume_point(usable, total_layers=total, checkpoint_step=0)
        if not point.live:
            return replace(point, reason=f"no state of its own at one step mid-round covers every layer ({point.reason})")
        rounds = {(h.outer.round, h.outer.steps_in_round, h.outer.inner_steps) for h in point.holders if h.outer}
        if len(rounds) != 1:
            return ResumePoint(step=0, live=False, reason=f"its live parts are of different rounds: {sorted(rounds)}")
        (r, k, _), = rounds
        theirs = self._older_round(module, older)
        if theirs != r:
            said = (f"the other groups are at round {theirs}, not the round {r} its state is in"
                    if theirs is not None else "no older group told its round")
            return ResumePoint(step=0, live=False, reason=said)
        return replace(point, reason=f"its nodes hold its state at inner step {k} of round {r}, which the other "
                                     f"groups still train")

    def _older_round(self, module, older: list[int]) -> int | None:
        """The outer round an older group's published state is of (the round it trains), asked of the node that
        exchanges one of this stage's parameters there; None when no older group answers."""
        plan, ctx = self.plan, self.ctx
        name = next(n for n, _ in module.named_parameters())
        for g in older:
            node = responsible(name, group_holders(plan, g))
            try:
                _, round_, _ = fetch_outer(plan.node_addresses[node], pb.OuterFetchRequest(
                    job_id=plan.job_id, plan_epoch=plan.groups[g].since_epoch, kind="state",
                    names=[f"anchor/{name}"], sender=ctx.node_id), token=ctx.token, rpc=ctx.rpc,
                    timeout=min(ctx.timeout, timedelta(seconds=30)), node=node)
                return round_
            except Exception as e:  # noqa: BLE001 - unreachable, restarting, a bad answer: ask the next group
                log.info("could not ask group %d for its round: %s", g, e)
        return None

    def _fetch_live(self, point: ResumePoint, first: Holder, rng: tuple[int, int], report: RestoreReport
                    ) -> tuple[bytes, Holder]:
        """The live state of `first` (or, failing it, of another holder of `rng` at the same step), and the
        holder that gave it."""
        ctx = self.ctx
        others = sorted((h for h in point.holders if h is not first and h.node_id != ctx.node_id
                         and h.layers[0] <= rng[0] and rng[1] <= h.layers[1]),
                        key=lambda h: (h.region != first.region, h.node_id))
        errors = []
        for h in [first, *others]:
            try:
                data, stats = fetch_state(h.address, pb.StateFetchRequest(
                    job_id=self.plan.job_id, kind="live", step=h.step, layer_start=h.layers[0],
                    layer_end=h.layers[1], sender=ctx.node_id), source=h.node_id, token=ctx.token, rpc=ctx.rpc,
                    timeout=ctx.timeout)
            except StateTransferError as e:
                errors.append(str(e))
                continue
            report.transfers.append(stats)
            log.info("state transfer: %d bytes from %s in %.2f s (live state of step %d, layers [%d, %d))",
                     stats.bytes, h.node_id, stats.seconds, h.step, *h.layers)
            return data, h
        raise RunFailed(f"{LIVE_FETCH_FAILED} layers [{rng[0]}, {rng[1]}) at step {point.step}: "
                        f"{'; '.join(errors)}")

    def _load_checkpoint(self, module, optimizer, step: int) -> None:
        """Load the stage's layers from the checkpoint of `step`, first fetching the files this node's own
        checkpoint folder lacks from the nodes holding copies (`Plan.checkpoint_copies`)."""
        pl, ctx = self.placement, self.ctx
        assert pl is not None
        for attempt in range(2):
            try:
                if self.plan.checkpoint_copies:
                    fetched = fetch_checkpoint(self.plan, ctx.checkpoint_dir, pl.layers, node_id=ctx.node_id,
                                               token=ctx.token, rpc=ctx.rpc, timeout=ctx.timeout)
                    if getattr(self, "restore", None) is not None:
                        self.restore.transfers.extend(fetched)
                self._checkpoint_extra = load_layers_extra(module, optimizer, ctx.checkpoint_dir, step)
                return
            except (CheckpointError, StateTransferError) as e:
                # a file deleted or damaged since it was written: set aside what cannot be read and fetch a copy
                # once; failing that, the coordinator hears that this node lost the step (its index forgets this
                # node's files of it, and a plan after this one resumes from a step held whole)
                moved = set_aside(ctx.checkpoint_dir, step, pl.layers) if attempt == 0 else []
                if attempt == 0 and moved and self.plan.checkpoint_copies:
                    log.warning("%s; set aside %s and fetching a copy", e, ", ".join(m.name for m in moved))
                    continue
                self.lost_checkpoint_step = step
                raise

    def _zero_states(self, store: dist.Store | None, optimizer, step: int, wait: float = 0.0,
                     leaving: bool = False) -> ParamStates | None:
        """A ZeRO stage superseded with every replica alive: its optimizer state gathered whole on replica 0
        (None on the others, and where that cannot be done within `ZERO_HANDOVER_S`), so that replica serves
        live state and the next plan rolls nothing back. Over a group of its own: the stage's group may hold a
        collective the supersession abandoned. The replicas agree on the step first. `wait`: seconds to wait for
        the newer plan (a run that ended on a failed step: the coordinator replans after it). `leaving`: this
        node left gracefully; the others meet it when the plan after its Leave keeps them (none reaches it)."""
        pl = self.placement
        if not isinstance(optimizer, ZeroOptimizer) or optimizer.world < 2 or pl is None or store is None:
            return None
        if self.plan.mode != "sync" and self._outer_counted != step:  # no round position: nothing to go on from
            return None
        if not leaving and not self._newer_plan_keeps(self.plan.pipelines[pl.pipeline].stages[pl.stage].nodes, wait):
            return None
        timeout = timedelta(seconds=ZERO_HANDOVER_S)
        try:
            # under tp, each tp rank's replicas gather its shards' state (replica 0's tp ranks then gather the
            # shards whole, `_tp_whole`)
            group = self._handover_group(store, f"zero-handover-{pl.pipeline}-{pl.stage}-{pl.tp_rank}", optimizer.rank,
                                         optimizer.world, step, timeout, device=optimizer.flat.device,
                                         torn=optimizer.torn,
                                         peers=self.plan.pipelines[pl.pipeline].stages[pl.stage].nodes)
            if group is None:
                log.info("the ZeRO replicas of stage %d ended at different steps or inside a parameter update: no "
                         "live state", pl.stage)
                return None
            states = optimizer.consolidated_state(to=0, group=group, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - no live state then: the next plan resumes from a checkpoint
            log.info("the ZeRO state of stage %d could not be gathered for the next plan (%s); it resumes these "
                     "layers from a checkpoint", pl.stage, e)
            return None
        if states is not None:
            log.info("ZeRO state of stage %d gathered whole after step %d for the next plan", pl.stage, step)
        return states

    def _handover_group(self, store: dist.Store, name: str, rank: int, size: int, step: int, timeout: timedelta,
                        *, device: torch.device, torn: bool = False, peers: Sequence[str] = ()
                        ) -> dist.ProcessGroup | None:
        """A group of its own for a handover among a stage's ranks (the stage's groups may hold a collective the
        supersession abandoned), once they agree they ended at the same step (sum and sum of squares) and none
        inside a parameter update (`torn`); None where they do not. A coordinator killed and restarted while they
        meet costs a new meeting, not the handover (`_group_again`)."""
        peers = [n for n in peers if n != self.ctx.node_id]
        group = _group_again(self._store, store, f"{self._group_prefix()}/{name}/", rank, size, timeout,
                             self.ctx.device, gone=_peer_gone(self.plan.node_addresses, peers))
        steps = torch.tensor([float(step), float(step) ** 2, float(torn)], dtype=torch.float64, device=device)
        wait_collective(group.allreduce([steps]), timeout, f"{name} step check")
        if abs(float(steps[1]) * size - float(steps[0]) ** 2) > 0.5 or float(steps[2]) > 0:
            return None
        return group

    def _newer_plan_keeps(self, nodes: Sequence[str], wait: float) -> bool:
        """Whether a plan newer than this run's (waiting up to `wait` s for one) runs or leaves idle every node
        of `nodes`: they are alive and end their runs too, so a handover among them can be met. One that left or
        died would only be waited for; one that left gracefully (`Plan.handover`) meets them (`RunContext.left`).
        A run ending without a newer plan (this node leaving) is told by `RunContext.left` instead."""
        newest = self.ctx.newest_plan
        after = newest() if newest is not None else None
        deadline = time.monotonic() + wait
        while (newest is not None and time.monotonic() < deadline
               and (after is None or after.epoch <= self.plan.epoch)):
            time.sleep(0.2)
            after = newest()
        return (after is not None and after.epoch > self.plan.epoch
                and set(nodes) <= {*after.node_addresses, *(n for i in after.idle for n in i.nodes), *after.handover})

    def _tp_whole(self, store: dist.Store | None, module, optimizer, step: int, wait: float = 0.0,
                  states: ParamStates | None = None, leaving: bool = False) -> dict | None:
        """A tensor-parallel stage superseded with its tp group alive: its whole layers and AdamW state gathered
        on tp rank 0 (None on the others, and where that cannot be done within `TP_HANDOVER_S`), so that rank
        serves live state and the next plan rolls nothing back. Over a group of its own (the tp group may hold a
        collective the supersession abandoned); the ranks agree on the step first. Under ZeRO only replica 0's
        tp ranks gather, from the state their replicas gathered on them (`states`, `_zero_states`), and only when
        every one of them holds it. `leaving`: as for `_zero_states`."""
        pl = self.placement
        zero = isinstance(optimizer, ZeroOptimizer)
        if (self.tp is None or pl is None or store is None or self.plan.mode != "sync" or (zero and pl.replica != 0)
                or not (leaving or self._newer_plan_keeps(pl.tp_group, wait))):
            return None
        timeout = timedelta(seconds=TP_HANDOVER_S)
        try:
            group = self._handover_group(store, f"tp-handover-{pl.pipeline}-{pl.stage}-{pl.replica}", pl.tp_rank,
                                         pl.tp, step, timeout, device=self.ctx.device, torn=zero and states is None,
                                         peers=pl.tp_group)
            if group is None:
                log.info("the tp ranks of stage %d ended at different steps%s: no live state", pl.stage,
                         " or without their replicas' ZeRO state" if zero else "")
                return None
            whole = self.tp.full_state(module, states if zero else optimizer, _live_extra(step, self.scaler),
                                       group=group, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - no live state then: the next plan resumes from a checkpoint
            log.info("the tp shards of stage %d could not be gathered for the next plan (%s); it resumes these "
                     "layers from a checkpoint", pl.stage, e)
            return None
        if whole is not None:
            log.info("tp shards of stage %d gathered whole after step %d for the next plan", pl.stage, step)
        return whole

    def _snapshot(self, module, optimizer, step: int, stage: PipelineStage | None = None,
                  states: ParamStates | None = None, whole: dict | None = None) -> LiveState | None:
        """The stage's state after `step` steps, to serve to the next plan's nodes; None where the state is
        spread over ranks (tensor-parallel shards unless `whole` holds them gathered, `_tp_whole`; ZeRO unless
        `states` holds its optimizer state gathered whole, `_zero_states`) or belongs to a replica group (outer
        mode). When the norm exchange of step `step` failed
        here, the state keeps that step's gradients; it keeps the total of the last exchange it completed
        (`atoll.node.roll_forward`)."""
        pl = self.placement
        total = (stage.exchanged[1] if stage is not None and stage.exchanged is not None
                 and stage.exchanged[0] == step - 1 else None)
        if whole is not None:  # tp: the whole layers its ranks gathered (`_tp_whole`), no pending gradients
            return LiveState.of(whole, step=step, epoch=self.plan.epoch, norm_total=total)
        outer = None
        if self.plan.mode == "outer" and self.outer is not None and pl is not None:
            if self._outer_counted != step:
                return None  # a step the outer sync has not counted: no round position to go on from
            # where the state stands in its group's rounds: the group planned afresh goes on from it mid-round
            o = self.outer
            outer = OuterPosition(group=self.plan.groups[pl.group].name, round=o.round, steps_in_round=o.steps_in_round,
                                  inner_steps=o.cfg.inner_steps, landed=o.landed)
        if (self.plan.mode != "sync" and outer is None) or pl is None or pl.tp > 1 or (
                isinstance(optimizer, ZeroOptimizer) and states is None):
            return None
        if states is None and step == 0 and not optimizer.state:  # nothing trained: the next plan starts afresh
            return None
        extra = _live_extra(step, self.scaler)
        # the total of the last norm exchange it completed (`total`): with it, a holder of another stage whose
        # exchange of that step failed can be finished to this step (`live_state.finishable`)
        if states is not None:  # ZeRO: whole weights and the gathered AdamW state, no pending gradients (sharded)
            return LiveState.of(slice_state(module, states, extra=extra), step=step, epoch=self.plan.epoch,
                                norm_total=total, outer=outer)
        state = slice_state(module, optimizer, extra=extra)
        loss = None
        # (a replica group's state is served at the step it completed: a step half taken there is dropped)
        if stage is not None and outer is None:
            grads = pending_grads(module, stage.unexchanged, step)
            if grads is not None:
                state["grads"] = grads
                if stage.unexchanged_loss is not None:
                    # this replica's share of the batch's loss: whoever finishes the step adds up the shares of
                    # every last-stage replica and reports it (`live_state.finished_loss`)
                    weight = self._row_weight()
                    loss = (stage.unexchanged_loss * weight, weight)
        return LiveState.of(state, step=step, epoch=self.plan.epoch, norm_total=total, pending_loss=loss,
                            outer=outer)

    def _older_groups(self) -> list[int]:
        """Outer mode: the other replica groups that have trained since before this node's group formed."""
        plan, pl = self.plan, self.placement
        if plan.mode != "outer" or pl is None:
            return []
        return [g for g, grp in enumerate(plan.groups) if g != pl.group and 0 < grp.since_epoch < self.run_epoch]

    def _start_outer(self, store: dist.Store | None, module: torch.nn.Module, step: int,
                     stop: threading.Event | None = None, continuing: ResumePoint | None = None) -> int:
        """Set up the outer sync of this node's layers; return the step to train from.

        Its outer state comes from the checkpoint of `step` (a whole-job resume), or, for a group that
        (re)joins while older groups train on, from one of those groups; otherwise the start parameters. A group
        that goes on with its round from its own live state (`continuing`, `_restore_group_live`) takes the anchor
        and momentum of that round from an older group (every group holds the same) and keeps its parameters.
        """
        plan, pl, ctx = self.plan, self.placement, self.ctx
        assert pl is not None and plan.outer is not None
        if ctx.outer_sync is None:
            raise RunFailed("an outer-mode plan needs the coordinator's OuterSync; this node has none")
        group = plan.groups[pl.group]
        o = plan.outer
        codec = CodecSpec(o.codec, **({"block_size": o.block_size} if o.block_size else {}),
                          **({"topk_fraction": o.topk_fraction} if o.topk_fraction else {}))
        deadline = timedelta(seconds=o.fetch_bound_s)  # the bound of each contribution's fetch
        cfg = OuterConfig(job_id=plan.job_id, node_id=ctx.node_id, group=pl.group, inner_steps=group.inner_steps,
                          codec=codec, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, overlap=o.overlap,
                          apply_after=apply_after_steps(self.job, o, group),
                          deadline=deadline, token=ctx.token, rpc=ctx.rpc,
                          latency_to=lambda peer: ctx.wan_latency(self.current_plan(), peer),
                          round_length=max(o.inner_steps, group.inner_steps))
        segment_groups = []
        if store is not None:
            base = self._group_prefix()
            for seg in pl.segments:
                g = _group(store, f"{base}/outer-segment-{seg.start}-{seg.end}/", seg.holders.index(ctx.node_id),
                           len(seg.holders), ctx.timeout, ctx.device)
                names = [n for n, _ in module.named_parameters() if seg.start <= layer_of(n) < seg.end]
                segment_groups.append((names, g))
        outbox = OuterOutbox(job_id=plan.job_id, epoch=self.run_epoch, node_id=ctx.node_id)
        ctx.peer_server.attach_outbox(outbox)
        arrive = _arrive_via(ctx.outer_sync, self.current_plan, ctx.node_id)
        # a tied head's copy of the embedding weight (a stage without the embedding) syncs as the embedding: another
        # group may keep both on one stage, with no copy (`atoll.node.outer`)
        params = dict(module.named_parameters())
        aliases = {n: TIED_SOURCE for n, p in params.items() if p is module.tied_copy}
        self.outer = outer = OuterSync(cfg, plan, params, outbox=outbox, arrive=arrive,
                                       segment_groups=segment_groups, timeout=ctx.timeout,
                                       plan_source=self.current_plan, stop=stop, aliases=aliases)
        older = self._older_groups()
        if older and continuing is not None:
            at = continuing.holders[0].outer
            assert at is not None  # (`_group_point` takes only holders that have one)
            round_ = outer.fetch_state(older, {g: plan.groups[g].since_epoch for g in older}, params_too=False)
            if round_ != at.round:
                raise OuterSyncError(f"the other groups moved on to round {round_} while this group took its state "
                                     f"of round {at.round}; the next plan starts it at their round")
            k = continuing_steps(at.steps_in_round, at.inner_steps, group.inner_steps)
            outer.round, outer.steps_in_round = at.round, k
            outer.tokens_in_round = at.steps_in_round * self.job.train.global_batch * self.job.train.seq_len
            step = outer.next_step()  # (a round's steps end at a multiple of H)
            log.info("replica group %s goes on with round %d at inner step %d of %d (step %d): the %d inner steps "
                     "it had trained of the round%s are kept", group.name, at.round, k, group.inner_steps, step,
                     at.steps_in_round, f" (of {at.inner_steps} a round then)" if at.inner_steps != group.inner_steps
                     else "")
            self._outer_counted = step
            return step
        if older:
            epochs = {g: plan.groups[g].since_epoch for g in older}
            round_ = outer.fetch_state(older, epochs)
            self._outer_counted = max(step, round_ * outer.round_length)
            return self._outer_counted
        state = load_outer_state(ctx.checkpoint_dir, step, pl.layers) if step > 0 else None
        if state is not None:
            outer.load_state_dict(state)
            log.info("outer state of round %d loaded from the checkpoint of step %d", outer.round, step)
        else:
            outer.round = step // outer.round_length
        self._outer_counted = step
        return step

    def _store(self, timeout: timedelta | None = None) -> dist.Store:
        """A connection to the plan's rendezvous store (its operations bounded by `timeout`, else the run's)."""
        if not self.plan.rendezvous:
            raise RunFailed("the plan names no rendezvous store; the coordinator must publish one")
        host, port = self.plan.rendezvous.rsplit(":", 1)
        return dial_store(host or self.ctx.coordinator_host, int(port), timeout or self.ctx.timeout)

    def _handover_store(self, store: dist.Store) -> dist.Store:
        """A connection of its own to the rendezvous store for the handovers at the end of a run. The run's may be
        dead: a coordinator restarted on its state dir binds the same port, so the plan stays current and training
        goes on over groups formed already, but the run's client socket went with the old process, and its first
        use fails with "Broken pipe" (the gather would fail and the next plan roll back). The run's connection is
        kept where no new one opens within the handover's bound."""
        try:
            return self._store(min(self.ctx.timeout, timedelta(seconds=ZERO_HANDOVER_S)))
        except Exception as e:  # noqa: BLE001 - the handover then tries the run's own connection
            log.info("no new connection to the rendezvous store for the handover (%s)", e)
            return store

    def _group_prefix(self) -> str:
        """Where this run's process groups meet in the rendezvous store (under a name only token holders can
        derive, `atoll.rpc.rendezvous_prefix`). In outer mode the replica groups of
        one epoch each have their own loss and segment groups (same names, different members), so the
        group's index in the plan keeps them apart."""
        base = rendezvous_prefix(self.ctx.token, self.plan.job_id, self.run_epoch)
        if self.plan.mode == "outer" and self.placement is not None:
            base += f"/group-{self.placement.group}"
        return base

    def _groups(self, store: dist.Store | None, module: torch.nn.Module
                ) -> tuple[NormExchange | None, _SegmentAverager | None, dist.ProcessGroup | None]:
        pl, ctx = self.placement, self.ctx
        assert pl is not None
        base = self._group_prefix()
        norm = None
        if store is not None and (pl.num_stages > 1 or pl.tp > 1):
            rank, size = pl.pipeline_nodes.index(ctx.node_id), len(pl.pipeline_nodes)
            if any(not self.plan.node_addresses.get(n, "x") for n in pl.pipeline_nodes):
                # a node that accepts no connections cannot be in a gloo group with nodes it cannot reach; all
                # of them reach the coordinator's store
                exchange: NormExchange = StoreNormExchange(store, f"{base}/norm-{pl.pipeline}/", rank=rank,
                                                           size=size)
            else:
                exchange = DistNormExchange(_group(store, f"{base}/norm-{pl.pipeline}/", rank, size, ctx.timeout,
                                                   ctx.device), device=ctx.device)
            norm = OncePerStage(exchange, counts=pl.counts_norm)
        averager = None
        if store is not None and pl.segments:
            parts = []
            for seg in pl.segments:
                tp = f"-tp{seg.tp_rank}" if pl.tp > 1 else ""  # each tp rank averages its shards with its peers
                g = _group(store, f"{base}/segment-{seg.start}-{seg.end}{tp}/", seg.holders.index(ctx.node_id),
                           len(seg.holders), ctx.timeout, ctx.device)
                ids = {id(p) for i in range(seg.start, seg.end) for p in module.layers[str(i)].parameters()}
                parts.append((ids, GradientAverager(g, timer=self.collectives)))
            averager = _SegmentAverager(parts, weight=self._row_weight(),
                                        **({"local": self.tp.local_params} if self.tp is not None else {}))
        loss_group = None
        if store is not None and pl.is_last and len(pl.loss_group) > 1 and pl.tp_rank == 0:
            loss_group = _group(store, f"{base}/loss/", pl.loss_group.index(ctx.node_id), len(pl.loss_group),
                                ctx.timeout, ctx.device)
        return norm, averager, loss_group

    def _verifier(self, store: dist.Store | None, cfg: StageConfig, nodes: list[str]) -> StageVerifier | None:
        """This stage's replicas checking one another's sampled micro-batches, over a gloo group of their own
        (`atoll.node.verify`): where the stage has replicas that hold its whole slice (no tp, no lanes)."""
        pl, ctx = self.placement, self.ctx
        assert pl is not None
        if store is None or ctx.verify_every < 1 or len(nodes) < 2 or pl.tp > 1 or pl.lanes > 1 or checks_off():
            return None
        rank = nodes.index(ctx.node_id)
        prefix = f"{self._group_prefix()}/verify-{pl.pipeline}-{pl.stage}/"
        group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, len(nodes), ctx.timeout)
        # a half-precision wire rounds what is sent: the coarser of the two dtypes sets the tolerance
        dtype = min((compute_dtype(self.job.train.dtype), cfg.wire_dtype), key=lambda d: -torch.finfo(d).eps)
        return StageVerifier(group, nodes=list(nodes), rank=rank, seed=self.job.train.seed, every=ctx.verify_every,
                             micro_batches=cfg.local_micro_batches, dtype=dtype, timeout=ctx.timeout)

    def _own_pipelines(self) -> list[int]:
        """The pipelines this node's gradients meet in: its replica group's (outer mode) or all of them."""
        pl = self.placement
        if self.plan.mode == "outer" and pl is not None:
            return sorted(self.plan.groups[pl.group].pipelines)
        return list(range(len(self.plan.pipelines)))

    def _tie(self, store: dist.Store | None, module: torch.nn.Module, averager):
        """A tied model cut into stages: add the sum of the tied weight's copies to this stage's averaging
        (`atoll.node.tied`)."""
        def make(name: str, rank: int, size: int) -> dist.ProcessGroup:
            assert store is not None
            return _group(store, f"{self._group_prefix()}/{name}/", rank, size, self.ctx.timeout, self.ctx.device)

        return tie_gradients(module, self.plan, self._own_pipelines(), self.ctx.node_id, averager, make)

    def _tensor_parallel(self, store: dist.Store | None, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         cfg: StageConfig) -> torch.optim.Optimizer:
        """Join this stage replica's tp group (`self.tp`) and shard the full slice, seeded or loaded, over it;
        return the optimizer over the shards (carrying a loaded state)."""
        pl = self.placement
        assert pl is not None and store is not None
        if self.plan.mode == "outer":
            raise RunFailed("tensor parallelism (tp > 1) does not run in outer mode yet; plan tp = 1 stages for "
                            "replica groups")
        check_shardable(self.job.model, pl.tp)
        self.tp = TensorParallel.join(store, f"{self._group_prefix()}/tp-{pl.pipeline}-{pl.stage}-{pl.replica}/",
                                      rank=pl.tp_rank, size=pl.tp, device=self.ctx.device, timeout=self.ctx.timeout)
        log.info("pipeline %d stage %d replica %d: tp rank %d of %d (%s)", pl.pipeline, pl.stage, pl.replica,
                 pl.tp_rank, pl.tp, ", ".join(pl.tp_group))
        return self.tp.shard(module, optimizer, lambda m: build_optimizer(m, cfg))

    def _batch(self, data: TokenDataset, index: int, *, held_out: bool = False) -> Batch:
        """This replica's rows of the batch of step `index` (`held_out`: of held-out batch `index`), in
        micro-batch order (see `Placement.batch_order`)."""
        pl = self.placement
        assert pl is not None
        read = data.validation_rows if held_out else data.rows
        batch = read(index, self.job.train.global_batch, *pl.rows)
        order = pl.batch_order()
        if order is None:
            return batch
        idx = torch.tensor(order)
        return Batch(batch.inputs[idx], batch.targets[idx])

    def _grad_in_scale(self) -> float:
        """`StageConfig.grad_in_scale`: this stage's lanes over the next stage's."""
        pl = self.placement
        assert pl is not None
        stages = self.plan.pipelines[pl.pipeline].stages
        return pl.lanes / stages[pl.stage + 1].lanes if pl.stage + 1 < len(stages) else 1.0

    def _row_weight(self) -> float:
        pl = self.placement
        assert pl is not None
        return pl.trained_rows / self.plan.global_batch

    def _transport(self, pl: Placement, door: Door | None = None):
        if pl.num_stages == 1 or pl.tp_rank > 0:
            return InProcessLinks(1).transport(0)  # a one-stage pipeline sends nothing, nor do tp ranks but 0
        addr = self.plan.node_addresses

        # an empty address: the node accepts no connections (`atoll.node.reverse`)
        listening = bool(addr.get(self.ctx.node_id)) and self.ctx.peer_server.listening

        def refs(neighbours) -> tuple[RowPeer, ...] | None:
            for n in neighbours:
                if n.node_id not in addr:
                    raise RunFailed(f"the plan has no peer address for node {n.node_id}")
            return tuple(RowPeer(peer=peer_ref(self.plan, n.node_id, self.ctx.node_id, listening,
                                               self.ctx.wan_latency(self.plan, n.node_id)),
                                 rows=n.rows) for n in neighbours) or None

        def side(neighbours, by_lane) -> Lanes | tuple[RowPeer, ...] | None:
            # a laned neighbour stage: each micro-batch goes to (comes from) its lane's replicas
            return Lanes(tuple(refs(x) for x in by_lane)) if by_lane else refs(neighbours)

        stage_plan = self.plan.pipelines[pl.pipeline].stages[pl.stage]
        send = stage_plan.send
        bandwidth = send.bytes / send.seconds if send and send.seconds > 0 else None
        codec = fixed_codec(self.job)
        m = self.job.model
        return GrpcTransport(GrpcTransportConfig(
            job_id=self.plan.job_id, node_id=self.ctx.node_id, plan_epoch=self.run_epoch,
            pipeline=pl.pipeline, stage=pl.stage, replica=pl.replica,
            upstream=side(pl.upstream, pl.upstream_lanes), downstream=side(pl.downstream, pl.downstream_lanes),
            rows=pl.micro_rows,
            shape=(pl.replica_micro_batch, self.job.train.seq_len, m.d_model),
            micro_batches=transport_micro_batches(pl.num_micro_batches, self.job.train.eval_batches)
            if self.job.train.eval_every else pl.num_micro_batches,
            token=self.ctx.token, rpc=self.ctx.rpc, forward_codec=codec, backward_codec=codec,
            policy=link_policy(self.job), dtype=compute_dtype(self.job.train.dtype),  # the stage's wire dtype (StageConfig.wire_dtype)
            initial_bandwidth_bytes_per_s=bandwidth, overlap=timedelta(seconds=stage_plan.compute_s),
            call_timeout=self.ctx.timeout, send_timeout=self.ctx.timeout, delivery_timeout=self.ctx.timeout,
            accepts_connections=listening,
        ), self.ctx.peer_server, door)

    # --- per step ---------------------------------------------------------------------------------

    def _mean_loss(self, result: StepResult, group: dist.ProcessGroup | None, pl: Placement) -> float | None:
        if result.loss is None:
            return None
        if group is None:
            return result.loss
        # the batch's mean loss: each last stage's mean over its rows, weighted by its rows
        t = torch.tensor([result.loss * self._row_weight()], dtype=torch.float64, device=self.ctx.device)
        wait_collective(group.allreduce([t]), self.wait, "loss all-reduce")
        return float(t.item())

    def _metrics(self, step: int, result: StepResult, loss: float | None, transport) -> StepMetrics:
        pl = self.placement
        assert pl is not None
        self._check_memory(step, result.peak_memory_bytes)
        # a non-finite loss is not reported (the step was skipped everywhere; the offence says so)
        # every replica of the last stage reports the (all-reduced, identical) loss: the coordinator records the
        # median of their reports, so one that lies is outvoted and named (`atoll.coordinator.claims.LossVotes`)
        reports_loss = loss is not None and math.isfinite(loss) and self.ctx.node_id in pl.loss_group
        links = transport.link_stats() if isinstance(transport, GrpcTransport) else []
        plan = self.current_plan()
        return StepMetrics(
            job_id=self.plan.job_id, node_id=self.ctx.node_id, plan_epoch=plan.epoch, step=step,
            pipeline=self.reported_pipeline(plan), stage=pl.stage, loss=loss if reports_loss else None,
            tokens=pl.trained_rows * self.job.train.seq_len,
            step_seconds=result.step_seconds, compute_seconds=result.compute_seconds,
            wait_seconds=result.wait_seconds, links=links, unix_time=time.time(),
            peak_memory_bytes=result.peak_memory_bytes, loss_scale=result.loss_scale, skipped=result.skipped,
            offences=[TensorOffence(sender=o.sender, kind=o.kind, direction=str(o.direction), step=o.step,
                                    micro_batch=max(0, o.micro_batch), norm=o.norm if math.isfinite(o.norm) else 0.0,
                                    finite=math.isfinite(o.norm), detail=o.detail[:200])
                      for o in result.offences[:MAX_OFFENCES_REPORTED]],
            collectives=self.collectives.take(),
        )

    def _say_skipped(self, step: int, result: StepResult, pl: Placement) -> None:
        """Log what this stage rejected in `step` (naming the sender), or that the step was skipped for a flag raised
        elsewhere."""
        if result.offences:
            for o in result.offences[:4]:
                log.warning("pipeline %d stage %d: %s; the step is skipped on every node", pl.pipeline, pl.stage,
                            o.describe())
            if len(result.offences) > 4:
                log.warning("step %d: %d more tensors rejected", step, len(result.offences) - 4)
        elif result.skipped and result.loss_scale is None:
            log.warning("step %d skipped on every node: a stage rejected a tensor or its loss (its node's log and "
                        "`atoll status` name the sender)", step)

    def _zero(self, optimizer: torch.optim.Optimizer, averager: _SegmentAverager | None, cfg: StageConfig
              ) -> tuple[torch.optim.Optimizer | ZeroOptimizer, _SegmentAverager | None]:
        """ZeRO over the stage's replicas when the plan asks for it (`StagePlan.zero` >= 1): (the optimizer, the
        averager) to train with.

        ZeRO needs the replicas of this stage to be exactly the holders of its layers, one segment over its
        whole range: then they share one gradient group and step the same layers. Otherwise (no other replica,
        or other pipelines hold some or all of its layers and average per segment) the stage trains with plain
        AdamW and the segment averager, and says so. ZeRO-3 runs as ZeRO-2 (weights stay whole).
        """
        pl = self.placement
        assert pl is not None
        st = self.plan.pipelines[pl.pipeline].stages[pl.stage]
        if st.zero < 1:
            return optimizer, averager
        segs = pl.segments
        # under tensor parallelism the holders of this node's shards are the replicas' nodes of its tp rank
        peers = {st.nodes[r * st.tp + pl.tp_rank] for r in range(st.dp)} if st.tp > 1 else set(st.nodes)
        why = None
        if self.job.model.tied_head and pl.num_stages > 1 and (pl.is_first or pl.is_last):
            why = "it holds a copy of the tied embedding weight, whose gradient is summed with the other copy's"
        elif averager is None or not segs:
            why = "no other node holds its layers"
        elif len(segs) != 1 or (segs[0].start, segs[0].end) != pl.layers or set(segs[0].holders) != peers:
            why = ("other pipelines' stages hold some of its layers too, and the holders average per layer segment "
                   "(ZeRO needs the stage's replicas to be exactly the holders of its layers)")
        if why is not None:
            log.info("pipeline %d stage %d: the plan asks for ZeRO-%d but %s; training with plain AdamW", pl.pipeline,
                     pl.stage, st.zero, why)
            return optimizer, averager
        stage = min(st.zero, 2)
        if st.zero > 2:
            log.warning("pipeline %d stage %d: the plan asks for ZeRO-%d; this runtime shards optimizer states and "
                        "gradients (ZeRO-2) and keeps whole weights, so it needs more memory than planned", pl.pipeline,
                        pl.stage, st.zero)
        assert averager is not None
        group = averager.parts[0][1].group
        # a tp rank's ZeRO shards its own shards over its peers; replicated parameters count in the clipping
        # norm on tp rank 0 only, as without ZeRO (`atoll.node.tp`)
        zero = ZeroOptimizer.from_adamw(optimizer, group, ZeroConfig(
            stage=stage, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
            grad_scale=self._row_weight()), timeout=cfg.collective_timeout, count_replicated=pl.tp_rank == 0)
        log.info("pipeline %d stage %d: ZeRO-%d over its %d replicas (%s)%s", pl.pipeline, pl.stage, stage,
                 zero.world, counted(len(zero.buckets), "bucket"), f", of tp rank {pl.tp_rank}'s shards" if st.tp > 1 else "")
        return zero, None

    def _check_memory(self, step: int, measured: int) -> None:
        """Warn once per run when the stage's measured peak memory exceeds the plan's prediction by over 10%."""
        pl = self.placement
        assert pl is not None
        predicted = self.plan.pipelines[pl.pipeline].stages[pl.stage].memory_gb_per_device * GB
        if getattr(self, "_memory_warned", False) or predicted <= 0 or measured <= 1.1 * predicted:
            return
        self._memory_warned = True
        log.warning("pipeline %d stage %d, step %d: peak memory %.3f GB is %.0f%% above the plan's %.3f GB per device; "
                    "the planner's memory model underestimates this stage (a device near its limit may run out)",
                    pl.pipeline, pl.stage, step, measured / GB, 100 * (measured / predicted - 1), predicted / GB)

    def _writes_outer_checkpoints(self) -> bool:
        """Outer mode: whether this node's replica group writes the job's checkpoints. The coordinator names the
        group with each round's decision (its newest plan's first group), so the writer follows the current plan:
        a replan that keeps this group running may make it the writer or not. Every node of a group applies the
        same decisions at the same step, so they agree at each checkpoint. Before any round landed: this run's
        plan's first group."""
        pl, outer = self.placement, self.outer
        assert pl is not None
        writer = outer.checkpointer if outer is not None else None
        return pl.group == 0 if writer is None else self._is_outer_writer(writer)

    def _not_written(self, step: int, position: int, error: OSError) -> None:
        """A checkpoint that could not be written (a full disk, no permission): one line, this stage's older files
        pruned (all but its newest and the plan's resume step) to make room for the next, and a report, so the
        coordinator records the stage as under-replicated and asks another node of it to write. Training goes on."""
        pl = self.placement
        assert pl is not None
        root = self.ctx.checkpoint_dir
        partial = step_dir(root, step) / f"layers-{pl.layers[0]:04d}-{pl.layers[1]:04d}.pt"
        try:  # (the folder itself may be what is wrong: a file in its place, no permission)
            partial.unlink(missing_ok=True)
            pruned = prune_own(root, pl.layers, keep={self.plan.resume_step})
        except OSError:
            pruned = []
        log.error("checkpoint of step %d (layers [%d, %d)) could not be written under %s: %s; training goes on "
                  "without it%s, and the coordinator is told so", step, *pl.layers, root, error,
                  f" (pruned this stage's checkpoints of steps {', '.join(map(str, pruned))})" if pruned else "")
        try:
            self.ctx.report_checkpoint(CheckpointWritten(step=step, layers=pl.layers, path=partial, bytes=0,
                                                         data_position=position, not_written=str(error)[:300]))
        except Exception as e:  # noqa: BLE001 - a lost report must not stop training
            log.error("the unwritten checkpoint of step %d was not reported: %s", step, e)

    def _checkpoint(self, module, optimizer, step: int) -> None:
        """Write this stage's checkpoint of `step` and queue its report.

        A checkpoint that cannot be written (a full disk, no permission) fails alone: the log says why and
        training goes on; the coordinator resumes from the last complete checkpoint it knows. The report
        never blocks: `ctx.report_checkpoint` only queues it.
        """
        pl = self.placement
        assert pl is not None
        # pipeline 0 covers every layer once; its replica 0 writes, the other holders have the same weights
        # (outer mode: the first pipeline of the writing group; a whole-job resume starts every group from its state).
        # Outer mode: the checkpoint of round r's end is written by the group the decision of round r + 1 names (one that
        # took part in round r + 1, so alive after round r's end): every group keeps its round-end checkpoint aside
        # until that decision lands, and the named group's is put in place (`_settle_candidates`). Named by an older
        # decision, the writer could be a group killed since: its interval's checkpoint was lost (bench.regions (c):
        # step 360, of a region killed after it arrived at the round). The last step's is written at once, by the
        # last round's decision (landed before it)
        aside = None
        if self.plan.mode == "outer":
            ended, outer = self._ended_round, self.outer
            if ended is not None and outer is not None and step != self.last_step:
                aside = ended
            else:
                writer = outer.writers.get(ended) if outer is not None and ended is not None else None
                if not (self._is_outer_writer(writer) if writer is not None else self._writes_outer_checkpoints()):
                    return
            first = self.plan.groups[pl.group].pipelines[0]
        else:
            first = 0
        # the coordinator may ask another node of the stage to write too: its writer could not (a full disk); a
        # node whose state is sharded (ZeRO, tp) cannot stand in alone, its replicas gather to their own writer
        stand_in = self.ctx.writes_checkpoints() and not (pl.pipeline == first and pl.replica == 0)
        if stand_in and (isinstance(optimizer, ZeroOptimizer) or self.tp is not None):
            stand_in = False
            if not getattr(self, "_stand_in_refused", False):
                self._stand_in_refused = True
                log.warning("the coordinator asks this node to write its stage's checkpoints (their writer cannot), "
                            "but its state is sharded (ZeRO or tp); another node of the stage has to")
        if stand_in:
            self._write_checkpoint(module, optimizer, step, None)
            return
        if pl.pipeline != first:
            return
        if isinstance(optimizer, ZeroOptimizer):  # every replica of the stage sends its shard to replica 0
            try:
                optimizer = optimizer.consolidated_state(to=0)
            except CollectiveError as e:
                raise RunFailed(f"gathering the ZeRO optimizer state for the checkpoint of step {step} failed: "
                                f"{e}") from e
        whole = None
        if self.tp is not None and pl.replica == 0:  # every tp rank sends its shards; tp rank 0 writes whole layers
            try:
                whole = self.tp.full_state(module, optimizer)
            except RuntimeError as e:
                raise RunFailed(f"gathering the tp shards for the checkpoint of step {step} failed: {e}") from e
            if whole is None:
                return
        if pl.replica != 0:
            return
        self._write_checkpoint(module, optimizer, step, whole, aside=aside)

    def _aside_root(self) -> Path:
        """Where this node keeps round-end checkpoints aside (`_checkpoint`): its own folder under the checkpoints'
        (the same file system, so putting one in place is a rename; not a step folder, so never taken for one)."""
        return Path(self.ctx.checkpoint_dir) / ".aside" / self.ctx.node_id

    def _is_outer_writer(self, writer: OuterParticipant) -> bool:
        pl = self.placement
        assert pl is not None
        own = self.plan.groups[pl.group].since_epoch or self.plan.epoch
        return self.ctx.node_id in writer.nodes and writer.since_epoch == own

    def _settle_candidates(self, outer: OuterSync, *, last: bool = False) -> None:
        """Put in place each round-end checkpoint kept aside (of round r) that this node's group is to write, drop the
        others. The writer is the group the decision of round r + 1 names. It puts its copy in place when that
        decision lands, which it does before it arrives at round r + 2: a writer that took part in round r + 2 wrote
        it, and one that did not may have died first, so the group the decision of round r + 2 names stands in
        (where the step folder does not hold the file already: a shared folder). A decision with no writer named
        settles as before (the first group of this run's plan writes). `last`: no round follows (the job's end):
        what is not this node's to write by now is dropped."""
        pl = self.placement
        assert pl is not None
        newest = max(outer.writers, default=-1)
        for round_, (step, position, error) in sorted(self._candidates.items()):
            writer = outer.writers.get(round_ + 1)
            if writer is None and round_ + 1 >= newest and not last:
                continue
            mine = self._is_outer_writer(writer) if writer is not None else pl.group == 0
            stands_in = False
            if not mine and writer is not None:
                later = outer.taking_part.get(round_ + 2)
                if later is None and not last:
                    continue  # whether the writer lived to write it is known with the next decision
                if later is not None and not any(same_group(p, writer) for p in later):
                    stand_in = outer.writers.get(round_ + 2)
                    stands_in = stand_in is not None and self._is_outer_writer(stand_in) and not (
                        step_dir(self.ctx.checkpoint_dir, step) / f"layers-{pl.layers[0]:04d}-{pl.layers[1]:04d}.pt"
                    ).exists()
            folder = step_dir(self._aside_root(), step)
            del self._candidates[round_]
            if stands_in:
                log.warning("checkpoint of step %d: its writer (%s) took no part in round %d and may have died before "
                            "it wrote it; this node's group writes it instead", step, ", ".join(writer.nodes),
                            round_ + 2)
            if (mine or stands_in) and error:
                self._not_written(step, position, OSError(error))
            elif mine or stands_in:
                try:
                    path = self._put_in_place(folder, step)
                except OSError as e:
                    self._not_written(step, position, e)
                else:
                    self._announce(step, path, path.stat().st_size, position)
            shutil.rmtree(folder, ignore_errors=True)

    def _put_in_place(self, folder: Path, step: int) -> Path:
        """Move the files of a checkpoint kept aside into its step folder, the layers' file last (a step folder's
        layers files are what make it a checkpoint); return the layers' file."""
        dest = step_dir(self.ctx.checkpoint_dir, step)
        dest.mkdir(parents=True, exist_ok=True)
        files = sorted((f for f in folder.iterdir() if f.is_file() and not f.name.startswith(".")),
                       key=lambda f: f.name.startswith("layers-"))
        layers = [f for f in files if f.name.startswith("layers-")]
        if len(layers) != 1:
            raise OSError(f"the checkpoint of step {step} kept aside in {folder} holds {len(layers)} layers files")
        for f in files:
            f.replace(dest / f.name)
        return dest / layers[0].name

    def _write_checkpoint(self, module, optimizer, step: int, whole, aside: int | None = None) -> None:
        """Write the checkpoint of `step` and report it; with `aside` (the round it ends), into this node's folder of
        checkpoints kept aside until the next rounds' decisions say who writes it (`_settle_candidates`), unreported."""
        pl = self.placement
        assert pl is not None
        position = step * self.job.train.global_batch
        root = self.ctx.checkpoint_dir if aside is None else self._aside_root()
        if aside is not None and not self._candidates:
            shutil.rmtree(root, ignore_errors=True)  # an earlier run's, never settled
        try:
            path, nbytes = save_layers(module, optimizer, root, step, data_position=position,
                                       state=whole, extra=None if self.scaler is None else
                                       {"loss_scale": self.scaler.state_dict()})
            if self.outer is not None:
                save_outer_state(self.outer.state_dict(), root, step, pl.layers)
            if pl.is_first and isinstance(self._data, StreamingDataset):  # where the stream can be read again from
                self._data.save_cursor(step_dir(root, step), position)
        except OSError as e:
            if aside is not None:
                self._candidates[aside] = (step, position, str(e) or type(e).__name__)
                return
            self._not_written(step, position, e)
            return
        if aside is not None:
            self._candidates[aside] = (step, position, "")
            return
        self._announce(step, path, nbytes, position)

    def _announce(self, step: int, path: Path, nbytes: int, position: int) -> None:
        """Report a checkpoint written (or put in place), ask for its copies, and say so."""
        pl = self.placement
        assert pl is not None
        try:
            self.ctx.report_checkpoint(CheckpointWritten(step=step, layers=pl.layers, path=path, bytes=nbytes,
                                                         data_position=position, checksum=file_crc32(path)))
        except Exception as e:  # noqa: BLE001 - the checkpoint is on disk; a lost report must not stop training
            log.error("checkpoint of step %d written to %s but not reported: %s", step, path, e)
        if self.ctx.replicate is not None:
            self.ctx.replicate(self.current_plan(), step, pl.layers)
        log.info("checkpoint of step %d: layers [%d, %d) -> %s", step, *pl.layers, path)


def follow_plan(run, *, checkpoint_dir: Path, device: torch.device, coordinator_host: str, token: str | None,
                rpc: RpcOptions | None = None, timeout: timedelta = timedelta(seconds=120),
                wan_latency: Callable[[Plan, str], timedelta] | None = None,
                tensorboard: TensorBoardLog | None = None) -> bool:
    """The node agent's plan callback: run this node's share of `run.plan` until done or superseded.

    `run` is the agent's `PlanRun` (plan, job, node_id, peer, superseded, report_step, report_checkpoint,
    report_failure, wait_timeout). Returns True when the job has finished its steps.

    Nothing sent to the coordinator is on a step's critical path: step metrics go through `_Reporter`,
    checkpoint and failure reports through the agent's outbox, which keeps them and retries them through a
    coordinator outage. Once the coordinator has acknowledged a checkpoint, older checkpoint folders are
    pruned (`prune_checkpoints`: the newest `checkpoint.keep` complete ones and this plan's resume step stay).

    A failed run (a neighbour or a collective failed) is reported to the coordinator, which makes a new
    plan even when every node is alive; the node waits for it. `timeout` bounds every wait on a neighbour
    until steps have been measured; then the bound follows the measured step time (`run.wait_timeout`).
    """
    from atoll.v1 import atoll_pb2 as pb

    plan, job = run.plan, run.job
    last_step = [plan.resume_step - 1]

    # the job's end as the coordinator last said: its heartbeats until this run's first step acknowledgement (a
    # run resumed past the spec's train.steps after `atoll job extend` must not end at once)
    target = [getattr(run.agent, "target_steps", 0)]

    def report_step(m: StepMetrics) -> bool:
        last_step[0] = max(last_step[0], m.step)
        ack = run.report_step(m)
        target[0] = ack.target_steps or target[0]
        return bool(ack.stop)

    def prune(step: int) -> None:
        removed = prune_checkpoints(Path(checkpoint_dir), total_layers=job.model.n_layers + 2,
                                    keep=job.checkpoint.keep, upto=step, protect={plan.resume_step})
        if removed:
            log.info("pruned the checkpoints of steps %s (keeping the newest %d complete)",
                     ", ".join(map(str, removed)), job.checkpoint.keep)

    def report_checkpoint(c: CheckpointWritten) -> None:
        run.report_checkpoint(pb.CheckpointReport(
            job_id=plan.job_id, node_id=run.node_id, plan_epoch=run.current.epoch, step=c.step,
            layer_start=c.layers[0], layer_end=c.layers[1], path=str(c.path), bytes=c.bytes,
            data_position=c.data_position, checksum=c.checksum, not_written=c.not_written),
            on_delivered=None if c.not_written else lambda: prune(c.step))

    def report_copy(c: CopyMade) -> None:  # a copy another node took: that node reports it itself
        log.debug("node %s took a copy of the checkpoint of step %d; it reports it", c.node_id, c.step)

    def copy_taken(req: pb.ReplicateRequest, reply: pb.ReplicateReply) -> None:  # a copy this node took, as its own
        run.report_checkpoint(pb.CheckpointReport(
            job_id=plan.job_id, node_id=run.node_id, plan_epoch=req.plan_epoch or run.current.epoch, step=req.step,
            layer_start=req.layer_start, layer_end=req.layer_end, path=reply.path, bytes=reply.file_bytes,
            checksum=reply.checksum, data_position=req.step * job.train.global_batch, copy_of=req.source))

    run.peer.copy_taken = copy_taken

    if run.peer.state is None:  # the live state and checkpoint copies this node serves, kept across plans
        run.peer.state = StateHolder(node_id=run.node_id, checkpoint_dir=Path(checkpoint_dir))
    replicator = None
    if job.checkpoint.replicas > 0 and job.checkpoint.interval > 0:
        replicator = Replicator(node_id=run.node_id, address=plan.node_addresses.get(run.node_id) or run.peer.address,
                                job_id=plan.job_id, token=token, rpc=rpc or RpcOptions(), report=report_copy,
                                grant=run.peer.state_access.grant)
    ctx = RunContext(node_id=run.node_id, job=job, peer_server=run.peer, checkpoint_dir=Path(checkpoint_dir),
                     report_step=report_step, report_checkpoint=report_checkpoint,
                     token=token, rpc=rpc or RpcOptions(), device=device, timeout=run.wait_timeout(timeout),
                     coordinator_host=coordinator_host, outer_sync=run.outer_sync, latest_plan=lambda: run.current,
                     newest_plan=lambda: getattr(run.agent, "plan", None),
                     target_steps=lambda: target[0] or getattr(run.agent, "target_steps", 0),
                     wait_bound=lambda: run.wait_timeout(timeout),
                     report_failure=lambda step, reason: run.report_failure(step=step, reason=reason),
                     left=getattr(run.agent, "wait_left", None),
                     writes_checkpoints=lambda: bool(getattr(run.agent, "write_checkpoints", False)),
                     draining=lambda: bool(getattr(run.agent, "draining", False)),
                     wan_latency=wan_latency or (lambda plan, peer: timedelta(0)), tensorboard=tensorboard,
                     replicate=None if replicator is None else
                     (lambda p, step, layers: replicator.submit(p, step, layers, job.checkpoint.replicas)))
    runner: PlanRunner | None = None
    try:
        runner = PlanRunner(ctx, plan)
        next_step = runner.run(run.superseded)
    except RunFailed as e:
        if run.superseded.is_set():
            log.info("plan epoch %d ended (%s); a newer plan has arrived", plan.epoch, e)
            return False
        log.error("%s; %s and waiting for a new plan", e,
                  "reported it" if runner is not None and runner.failure_reported else "reporting it")
        if runner is None or not runner.failure_reported:
            run.report_failure(step=max(plan.resume_step, last_step[0] + 1), reason=str(e),
                               lost_checkpoint_step=getattr(runner, "lost_checkpoint_step", 0))
        run.superseded.wait()
        return False
    finally:
        if replicator is not None:  # copies still queued finish on its thread, which then ends
            replicator.close(timedelta(0))
    # a node the plan left idle has no last step of its own: the coordinator says when the job is done
    # (`exit_when_idle_and_done`); its run returns the plan's resume step, which may be past the spec's end
    if runner.placement is not None and next_step >= runner.last_step:
        log.info("the job has finished its %d steps", runner.last_step)
        run.peer.state.forget_live()  # a node leaving now has nothing to hand over
        return True
    return False
