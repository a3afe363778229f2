"""Runs this node's part of a plan: build the stage, connect, train, checkpoint, report.

`PlanRunner(context, plan).run(stop)` trains from the plan's resume step until the job's last step, until
`stop` is set (a new plan arrived) or the coordinator says stop. It:
1. finds the node's place in the plan (`atoll.node.placement`);
2. builds layers [a, b) only, and loads them (and their optimizer state) from the checkpoint of the
   resume step, whatever cut wrote it;
3. joins its process groups through the epoch's rendezvous store: the norm-exchange group of its
   pipeline replica, one group per shared layer segment (gradient averaging), and the loss group
   of the last stages (gloo on CPU, NCCL on CUDA);
4. connects to its neighbours with the gRPC transport, the codec of each link chosen by the job's
   compression mode (a fixed codec, or the link policy when adaptive);
5. runs 1F1B steps, reports step metrics, writes checkpoints every `checkpoint.interval` steps.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from atoll.compression import CodecSpec
from atoll.job import JobSpec
from atoll.node.checkpoint import load_layers, prune_checkpoints, save_layers
from atoll.node.data import TokenDataset
from atoll.node.dataparallel import GradientAverager
from atoll.node.grpc_transport import GrpcTransport, GrpcTransportConfig, PeerRef
from atoll.node.inprocess import InProcessLinks
from atoll.node.model import build_slice
from atoll.node.norm_exchange import DistNormExchange, NormExchange
from atoll.node.peer import PeerServer
from atoll.node.placement import Placement, place
from atoll.node.stage import PipelineStage, StageConfig, StepResult, build_optimizer
from atoll.plan import Plan
from atoll.rpc import RpcOptions
from atoll.types import StepMetrics

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
                       recv_timeout=timeout, collective_timeout=timeout)


def fixed_codec(job: JobSpec) -> CodecSpec | None:
    """The codec every link uses, or None when the link policy chooses (compression mode "adaptive")."""
    mode = job.compression.mode
    return None if mode == "adaptive" else CodecSpec(codec=mode)


@dataclass(frozen=True, kw_only=True)
class CheckpointWritten:
    step: int
    layers: tuple[int, int]
    path: Path
    bytes: int
    data_position: int


class RunFailed(RuntimeError):
    """Training under this plan cannot go on (a neighbour or a collective failed); wait for a new plan."""


@dataclass(kw_only=True)
class RunContext:
    """What a node brings to every plan it runs."""

    node_id: str
    job: JobSpec
    peer_server: PeerServer
    checkpoint_dir: Path
    """Where checkpoints are written and read: one folder per step, one file per layer. Nodes that may
    take over each other's layers need the same folder (a shared file system)."""
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


def _group(store: dist.Store, prefix: str, rank: int, size: int, timeout: timedelta,
           device: torch.device) -> dist.ProcessGroup:
    prefixed = dist.PrefixStore(prefix, store)
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(prefixed, rank, size)
    return dist.ProcessGroupGloo(prefixed, rank, size, timeout)


class _SegmentAverager:
    """Averages each shared layer segment's gradients over the nodes that hold it, weighted by rows.

    Each holder's gradient is of the mean loss over its own rows; scaling it by rows x holders / batch
    before the plain average gives the gradient of the mean loss over the whole batch.
    """

    def __init__(self, parts: list[tuple[set[int], GradientAverager]], weight: float):
        self.parts, self.weight = parts, weight

    def average_(self, params, timeout: timedelta) -> None:
        params = list(params)
        for ids, averager in self.parts:
            mine = [p for p in params if id(p) in ids]
            scale = self.weight * averager.world_size
            if scale != 1.0:
                for p in mine:
                    if p.grad is not None:
                        p.grad.mul_(scale)
            averager.average_(mine, timeout)


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

    def run(self, stop: threading.Event, until_step: int | None = None) -> int:
        """Train until the job's last step (or `until_step`); return the next step to run."""
        pl = self.placement
        if pl is None:
            log.info("plan epoch %d gives this node no stage; standing by", self.plan.epoch)
            stop.wait()
            return self.plan.resume_step
        job, ctx = self.job, self.ctx
        cfg = stage_config(job, pl.num_micro_batches, ctx.timeout)
        module = build_slice(job.model, *pl.layers, seed=job.train.seed, device=ctx.device)
        optimizer = build_optimizer(module, cfg)
        step = self.plan.resume_step
        try:
            if step > 0:
                load_layers(module, optimizer, ctx.checkpoint_dir, step)
                log.info("loaded layers [%d, %d) from the checkpoint of step %d", *pl.layers, step)
            store = self._store() if (pl.num_stages > 1 or pl.segments or len(pl.loss_group) > 1) else None
            norm, averager, loss_group = self._groups(store, module)
            transport = self._transport(pl)
        except Exception as e:  # a missing checkpoint, a peer that never came to the rendezvous, ...
            raise RunFailed(f"setting up pipeline {pl.pipeline} stage {pl.stage} of epoch {self.plan.epoch} "
                            f"failed: {e}") from e
        stage = PipelineStage(module, stage=pl.stage, num_stages=pl.num_stages, transport=transport, config=cfg,
                              norm_exchange=norm, grad_averager=averager, optimizer=optimizer)
        data = TokenDataset.from_source(job.data.source, job.train.seq_len, seed=job.train.seed) \
            if (pl.is_first or pl.is_last) else None
        log.info("epoch %d: pipeline %d stage %d/%d replica %d, layers [%d, %d), %d micro-batches of %d, from step %d",
                 self.plan.epoch, pl.pipeline, pl.stage, pl.num_stages, pl.replica, *pl.layers,
                 pl.num_micro_batches, pl.micro_batch, step)
        reporter = _Reporter(ctx.report_step)
        last = job.train.steps if until_step is None else min(until_step, job.train.steps)
        finished = threading.Event()

        def close_when_superseded() -> None:
            # a newer plan ends this one at once: closing the transport wakes a stage blocked on a neighbour
            while not finished.is_set():
                if stop.wait(0.2):
                    transport.close()
                    return

        watcher = threading.Thread(target=close_when_superseded, name="atoll-plan-watch", daemon=True)
        watcher.start()
        try:
            while step < last and not stop.is_set() and not reporter.stop_requested.is_set():
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(job, step)
                batch = data.rows(step, job.train.global_batch, *pl.rows) if data is not None else None
                try:
                    result = stage.train_step(step, batch)
                    loss = self._mean_loss(result, loss_group, pl)
                except Exception as e:  # a neighbour or a collective failed: this epoch cannot go on
                    if stop.is_set():
                        log.info("plan epoch %d superseded during step %d", self.plan.epoch, step)
                        break
                    raise RunFailed(f"step {step} failed on pipeline {pl.pipeline} stage {pl.stage}: {e}") from e
                step += 1
                reporter.put(self._metrics(step - 1, result, loss, transport))
                interval = job.checkpoint.interval
                if interval and (step % interval == 0 or step == job.train.steps):
                    self._checkpoint(module, optimizer, step)
        finally:
            finished.set()
            transport.close()
            reporter.close(timedelta(seconds=10))
            watcher.join(1.0)
        if reporter.stop_requested.is_set() and step < job.train.steps:
            log.info("the coordinator stopped the job after step %d", step - 1)
        return step

    # --- set-up -----------------------------------------------------------------------------------

    def _store(self) -> dist.Store:
        if not self.plan.rendezvous:
            raise RunFailed("the plan names no rendezvous store; the coordinator must publish one")
        host, port = self.plan.rendezvous.rsplit(":", 1)
        return dist.TCPStore(host or self.ctx.coordinator_host, int(port), is_master=False, timeout=self.ctx.timeout)

    def _groups(self, store: dist.Store | None, module: torch.nn.Module
                ) -> tuple[NormExchange | None, _SegmentAverager | None, dist.ProcessGroup | None]:
        pl, ctx = self.placement, self.ctx
        assert pl is not None
        base = f"atoll/{self.plan.job_id}/epoch-{self.plan.epoch}"
        norm = None
        if store is not None and pl.num_stages > 1:
            g = _group(store, f"{base}/chain-{pl.pipeline}-{pl.replica}/", pl.stage, pl.num_stages, ctx.timeout,
                       ctx.device)
            norm = DistNormExchange(g, device=ctx.device)
        averager = None
        if store is not None and pl.segments:
            parts = []
            for seg in pl.segments:
                g = _group(store, f"{base}/segment-{seg.start}-{seg.end}/", seg.holders.index(ctx.node_id),
                           len(seg.holders), ctx.timeout, ctx.device)
                ids = {id(p) for i in range(seg.start, seg.end) for p in module.layers[str(i)].parameters()}
                parts.append((ids, GradientAverager(g)))
            averager = _SegmentAverager(parts, weight=self._row_weight())
        loss_group = None
        if store is not None and pl.is_last and len(pl.loss_group) > 1:
            loss_group = _group(store, f"{base}/loss/", pl.loss_group.index(ctx.node_id), len(pl.loss_group),
                                ctx.timeout, ctx.device)
        return norm, averager, loss_group

    def _row_weight(self) -> float:
        pl = self.placement
        assert pl is not None
        return (pl.rows[1] - pl.rows[0]) / self.plan.global_batch

    def _transport(self, pl: Placement):
        if pl.num_stages == 1:
            return InProcessLinks(1).transport(0)  # a one-stage pipeline sends nothing
        addr = self.plan.node_addresses

        def ref(node: str | None) -> PeerRef | None:
            if node is None:
                return None
            if node not in addr:
                raise RunFailed(f"the plan has no peer address for node {node}")
            return PeerRef(node_id=node, address=addr[node])

        stage_plan = self.plan.pipelines[pl.pipeline].stages[pl.stage]
        send = stage_plan.send
        bandwidth = send.bytes / send.seconds if send and send.seconds > 0 else None
        codec = fixed_codec(self.job)
        m = self.job.model
        return GrpcTransport(GrpcTransportConfig(
            job_id=self.plan.job_id, node_id=self.ctx.node_id, plan_epoch=self.plan.epoch,
            pipeline=pl.pipeline, stage=pl.stage, replica=pl.replica,
            upstream=ref(pl.upstream), downstream=ref(pl.downstream),
            shape=(pl.replica_micro_batch, self.job.train.seq_len, m.d_model), micro_batches=pl.num_micro_batches,
            token=self.ctx.token, rpc=self.ctx.rpc, forward_codec=codec, backward_codec=codec,
            initial_bandwidth_bytes_per_s=bandwidth, overlap=timedelta(seconds=stage_plan.compute_s),
            call_timeout=self.ctx.timeout, send_timeout=self.ctx.timeout, delivery_timeout=self.ctx.timeout,
        ), self.ctx.peer_server)

    # --- per step ---------------------------------------------------------------------------------

    def _mean_loss(self, result: StepResult, group: dist.ProcessGroup | None, pl: Placement) -> float | None:
        if result.loss is None:
            return None
        if group is None:
            return result.loss
        # the batch's mean loss: each last stage's mean over its rows, weighted by its rows
        t = torch.tensor([result.loss * self._row_weight()], dtype=torch.float64, device=self.ctx.device)
        group.allreduce([t]).wait(self.ctx.timeout)
        return float(t.item())

    def _metrics(self, step: int, result: StepResult, loss: float | None, transport) -> StepMetrics:
        pl = self.placement
        assert pl is not None
        reports_loss = loss is not None and pl.loss_group and pl.loss_group[0] == self.ctx.node_id
        links = transport.link_stats() if isinstance(transport, GrpcTransport) else []
        return StepMetrics(
            job_id=self.plan.job_id, node_id=self.ctx.node_id, plan_epoch=self.plan.epoch, step=step,
            pipeline=pl.pipeline, stage=pl.stage, loss=loss if reports_loss else None,
            tokens=(pl.rows[1] - pl.rows[0]) * self.job.train.seq_len,
            step_seconds=result.step_seconds, compute_seconds=result.compute_seconds,
            wait_seconds=result.wait_seconds, links=links, unix_time=time.time(),
        )

    def _checkpoint(self, module, optimizer, step: int) -> None:
        """Write this stage's checkpoint of `step` and queue its report.

        A checkpoint that cannot be written (a full disk, no permission) fails alone: the log says why and
        training goes on; the coordinator resumes from the last complete checkpoint it knows. The report
        never blocks: `ctx.report_checkpoint` only queues it.
        """
        pl = self.placement
        assert pl is not None
        # pipeline 0 covers every layer once; its replica 0 writes, the other holders have the same weights
        if pl.pipeline != 0 or pl.replica != 0:
            return
        position = step * self.job.train.global_batch
        try:
            path, nbytes = save_layers(module, optimizer, self.ctx.checkpoint_dir, step, data_position=position)
        except OSError as e:
            log.error("checkpoint of step %d (layers [%d, %d)) could not be written under %s: %s; training goes "
                      "on without it", step, *pl.layers, self.ctx.checkpoint_dir, e)
            return
        try:
            self.ctx.report_checkpoint(CheckpointWritten(step=step, layers=pl.layers, path=path, bytes=nbytes,
                                                         data_position=position))
        except Exception as e:  # noqa: BLE001 - the checkpoint is on disk; a lost report must not stop training
            log.error("checkpoint of step %d written to %s but not reported: %s", step, path, e)
        log.info("checkpoint of step %d: layers [%d, %d) -> %s", step, *pl.layers, path)


def follow_plan(run, *, checkpoint_dir: Path, device: torch.device, coordinator_host: str, token: str | None,
                rpc: RpcOptions | None = None, timeout: timedelta = timedelta(seconds=120)) -> bool:
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

    def report_step(m: StepMetrics) -> bool:
        last_step[0] = max(last_step[0], m.step)
        return bool(run.report_step(m).stop)

    def prune(step: int) -> None:
        removed = prune_checkpoints(Path(checkpoint_dir), total_layers=job.model.n_layers + 2,
                                    keep=job.checkpoint.keep, upto=step, protect={plan.resume_step})
        if removed:
            log.info("pruned the checkpoints of steps %s (keeping the newest %d complete)",
                     ", ".join(map(str, removed)), job.checkpoint.keep)

    def report_checkpoint(c: CheckpointWritten) -> None:
        run.report_checkpoint(pb.CheckpointReport(
            job_id=plan.job_id, node_id=run.node_id, plan_epoch=plan.epoch, step=c.step,
            layer_start=c.layers[0], layer_end=c.layers[1], path=str(c.path), bytes=c.bytes,
            data_position=c.data_position), on_delivered=lambda: prune(c.step))

    ctx = RunContext(node_id=run.node_id, job=job, peer_server=run.peer, checkpoint_dir=Path(checkpoint_dir),
                     report_step=report_step, report_checkpoint=report_checkpoint,
                     token=token, rpc=rpc or RpcOptions(), device=device, timeout=run.wait_timeout(timeout),
                     coordinator_host=coordinator_host)
    try:
        next_step = PlanRunner(ctx, plan).run(run.superseded)
    except RunFailed as e:
        if run.superseded.is_set():
            log.info("plan epoch %d ended (%s); a newer plan has arrived", plan.epoch, e)
            return False
        log.error("%s; reporting it and waiting for a new plan", e)
        run.report_failure(step=max(plan.resume_step, last_step[0] + 1), reason=str(e))
        run.superseded.wait()
        return False
    if next_step >= job.train.steps:
        log.info("the job has finished its %d steps", job.train.steps)
        return True
    return False
