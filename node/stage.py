"""The runtime of one pipeline stage replica: runs a schedule over micro-batches and steps AdamW.

`PipelineStage` needs only its module (layers [a, b)), its place in the pipeline, a `Transport` to its
neighbours, a `NormExchange` across the stages of its pipeline (for global gradient clipping) and,
with data parallelism, a `GradientAverager` over the replicas of its stage. Whether the neighbours are
threads or other processes makes no difference to it. The node agent calls `train_step` once per step.

Per step: forward/backward of every micro-batch in schedule order (the loss of each micro-batch is
divided by the number of micro-batches, so the accumulated gradient is that of the mean loss over the
whole batch, as the unsplit model would compute), then average gradients over replicas, then exchange
squared norms and clip, then step the optimizer. With a `ZeroOptimizer` (`atoll.node.zero`) in place of
AdamW the optimizer reduces the gradients itself (ZeRO-2: after every micro-batch's backward), the
squared norm is that of the owned shards summed over the replicas, and its step all-gathers the
parameters. With a `TensorParallel` (`atoll.node.tp`) the module is this rank's shard of the stage: tp rank
0 alone receives (and broadcasts what it received to the other ranks) and sends, and the squared norm is
this rank's share.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from atoll.node.dataparallel import GradientAverager
from atoll.node.door import Door, Offence
from atoll.node.faults import injected
from atoll.modelspec import ModelConfig
from atoll.node.model import StageModule, build_slice, lm_loss
from atoll.node.norm_exchange import LocalNormExchange, NormExchange
from atoll.node.tied import WithTiedGradients
from atoll.node.precision import LossScaleConfig, LossScaler, overflow_contribution
from atoll.node.schedule import SCHEDULES, Action, ScheduleKind, lane_actions, schedule
from atoll.node.storage import storage, storage_bytes
from atoll.node.transport import TensorKey, Transport
from atoll.node.verify import StageVerifier
from atoll.node.wgrad import DeferrableLinear, WeightGradients, attach
from atoll.node.zero import ZeroOptimizer

if TYPE_CHECKING:
    from atoll.node.tp import TensorParallel


@dataclass(frozen=True, kw_only=True)
class StageConfig:
    """How a stage trains: schedule, optimizer, clipping, precision and timeouts."""

    micro_batches: int = 4
    """Micro-batches per step of the pipeline; the batch given to `train_step` is split into this many equal
    parts (a laned replica's into `local_micro_batches`: its lane's)."""
    lanes: int = 1
    """Lanes of the stage (`atoll.plan`): this replica trains pipeline micro-batches i with i % lanes == lane."""
    lane: int = 0
    """This replica's lane (0 without lanes)."""
    grad_in_scale: float = 1.0
    """Factor on the activation-gradients received from the next stage: this stage's lanes over the next
    stage's. Every replica trains the mean loss over its own micro-batches, so a replica of a
    stage of L lanes divides each micro-batch's loss by m / L; a gradient computed for the next stage's mean is
    made one for this replica's (the transport scales for the rows, `atoll.node.grpc_transport`)."""
    schedule: ScheduleKind = "1f1b"
    """``1f1b`` (bounded activation memory) or ``gpipe`` (all forwards, then all backwards)."""
    in_flight: int = 0
    """Extra micro-batches in flight beyond strict 1F1B (a deep window behind a slow link, or a filled wait for
    the first gradient; the plan's)."""
    defer_weights: int = 0
    """Zero-bubble: backward computes the input's gradient first and the linear layers' weight gradients wait
    this many micro-batches for a ``weight`` action of their own (`atoll.node.schedule`, `atoll.node.wgrad`;
    the plan's); 0: backward computes them at once."""
    defer_layers: tuple[int, ...] = ()
    """With `defer_weights`, the global indices of the layers whose weight gradients wait (the others compute
    theirs in backward, as memory allows: the plan's `StagePlan.defer_layers`); empty: every layer."""
    lr: float = 1e-3
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW moment decay rates."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    max_grad_norm: float | None = 1.0
    """Clip the global (all stages) gradient norm to this; None disables clipping and the exchange."""
    bf16_autocast: bool = False
    """Run forward passes under bf16 autocast (weights, gradients and optimizer stay fp32)."""
    fp16_loss_scale: LossScaleConfig | None = None
    """Run forward passes under fp16 autocast with this dynamic loss scale (weights, gradients and optimizer
    stay fp32; an overflow anywhere skips the step everywhere: `atoll.node.precision`); None: no fp16."""
    recv_timeout: timedelta = timedelta(seconds=60)
    """Longest wait for one activation or activation-gradient from a neighbour."""
    collective_timeout: timedelta = timedelta(seconds=60)
    """Longest wait for the gradient all-reduce and the norm exchange."""
    track_memory: bool = False
    """Count the bytes autograd saves for backward per micro-batch (reported as peak_activation_bytes)."""

    @property
    def wire_dtype(self) -> torch.dtype:
        """Dtype of the activations and activation gradients sent to neighbours: under bf16 or fp16 that dtype
        (half of fp32's bytes, as the planner prices the boundaries), else fp32. A stage computes in fp32
        between its boundaries whatever crosses them."""
        if self.fp16_loss_scale is not None:
            return torch.float16
        return torch.bfloat16 if self.bf16_autocast else torch.float32

    def __post_init__(self) -> None:
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, got {self.micro_batches}")
        if not self.grad_in_scale > 0:
            raise ValueError(f"grad_in_scale must be positive, got {self.grad_in_scale}")
        if self.lanes < 1 or self.micro_batches % self.lanes or not 0 <= self.lane < self.lanes:
            raise ValueError(f"lanes must divide micro_batches ({self.micro_batches}) and lane be one of them; got "
                             f"lane {self.lane} of {self.lanes}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.in_flight < 0:
            raise ValueError(f"in_flight (extra micro-batches in flight) must be >= 0, got {self.in_flight}")
        if self.defer_weights < 0:
            raise ValueError(f"defer_weights (micro-batches whose weight gradients wait) must be >= 0, got "
                             f"{self.defer_weights}")
        if self.defer_layers and (not self.defer_weights or min(self.defer_layers) < 0):
            raise ValueError(f"defer_layers {list(self.defer_layers)} must be layer indices (>= 0) of a stage that "
                             f"defers its weight gradients (defer_weights >= 1, got {self.defer_weights})")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not all(0.0 <= b < 1.0 for b in self.betas) or len(self.betas) != 2:
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"eps must be positive and weight_decay non-negative, got {self.eps}, {self.weight_decay}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {self.max_grad_norm}")
        if self.bf16_autocast and self.fp16_loss_scale is not None:
            raise ValueError("bf16_autocast and fp16_loss_scale exclude each other: pick one precision")
        for name in ("recv_timeout", "collective_timeout"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be a positive timedelta, got {getattr(self, name)}")

    @property
    def local_micro_batches(self) -> int:
        """The micro-batches this replica trains per step: all of them, or its lane's (pipeline micro-batch i is
        its local micro-batch i // lanes)."""
        return self.micro_batches // self.lanes


def build_optimizer(module: nn.Module, config: StageConfig) -> torch.optim.AdamW:
    """The AdamW every stage (and the single-process reference) uses."""
    return torch.optim.AdamW(module.parameters(), lr=config.lr, betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay, foreach=False)


class StageData(Protocol):
    """A step's data for one pipeline replica (`atoll.node.data.Batch` is one).

    `inputs`, (batch, seq) int64 token ids, is read by the first stage only; `targets`, the (batch, seq)
    next-token ids, by the last stage only; a stage ignores the other and middle stages need neither.
    """

    @property
    def inputs(self) -> torch.Tensor | None: ...

    @property
    def targets(self) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class OpTiming:
    """One action of the schedule: when it started and ended (seconds from the start of the step)."""

    op: str
    micro_batch: int
    start: float
    end: float
    wait: float
    """Of [start, end), the seconds spent blocked on the transport for this action's input."""
    compute: float
    """Of [start, end), the seconds of forward or backward compute (wall clock)."""
    cpu: float
    """CPU seconds of the compute on the stage's own thread (all of it when torch runs one thread)."""


@dataclass(kw_only=True)
class StepResult:
    """What one stage replica did in one step."""

    step: int
    loss: float | None
    """Mean loss over the micro-batches (last stage only; None elsewhere)."""
    grad_norm: float | None
    """Global gradient norm before clipping (None when clipping is off and the precision is not fp16; inf
    when an fp16 step overflowed)."""
    skipped: bool = False
    """The pipeline's gradient-norm total was not finite, so no stage of any replica stepped: an fp16 overflow (the
    loss scale was lowered), or a tensor rejected at some stage's door, or a bad loss (`atoll.node.door`)."""
    offences: list[Offence] = field(default_factory=list)
    """What this stage rejected in this step (tensors at its door, its own loss): the step was skipped everywhere."""
    loss_scale: float | None = None
    """fp16: the loss scale this step's gradients carried (None under other precisions)."""
    tokens: int
    step_seconds: float
    pipeline_seconds: float
    """From the start of the step to the end of the norm exchange: the pipelined part, before the optimizer."""
    compute_seconds: float
    """Forward and backward compute."""
    wait_seconds: float
    """Blocked on neighbours (receives) and on the norm exchange."""
    sync_seconds: float = 0.0
    """Data-parallel gradient all-reduce."""
    optimizer_seconds: float = 0.0
    peak_activation_bytes: int = 0
    """Most bytes saved for backward at once (only with track_memory)."""
    peak_memory_bytes: int = 0
    """The step's peak memory: on CUDA the allocator's peak (`torch.cuda.max_memory_allocated`, reset at
    the step's start); elsewhere, with track_memory, the bytes of the parameters, the gradients (their
    most at once), the optimizer states and `peak_activation_bytes`, plus with recomputation what one
    recomputed block rebuilds in backward; else 0."""
    timeline: list[OpTiming] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the pipelined part: 1 - compute / pipeline_seconds."""
        return max(0.0, 1.0 - self.compute_seconds / self.pipeline_seconds) if self.pipeline_seconds > 0 else 0.0


class SavedBytesCounter:
    """Bytes of non-parameter tensors autograd saves for backward, counted once per storage."""

    def __init__(self, params: set[int]):
        self.params = params
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = storage(t)
        ptr = st.data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            self.bytes += st.nbytes()
        return t


class PipelineStage:
    """One replica of one stage of a pipeline: `train_step(step, batch)` runs a whole training step."""

    def __init__(self, module: StageModule, *, stage: int, num_stages: int, transport: Transport,
                 config: StageConfig, norm_exchange: NormExchange | None = None,
                 grad_averager: GradientAverager | None = None,
                 optimizer: torch.optim.Optimizer | ZeroOptimizer | None = None,
                 tp: TensorParallel | None = None, door: Door | None = None,
                 verifier: StageVerifier | None = None):
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} is outside a pipeline of {num_stages} stages")
        if module.is_first != (stage == 0) or module.is_last != (stage == num_stages - 1):
            raise ValueError(f"stage {stage} of {num_stages} holds layers [{module.start}, {module.end}): the first "
                             "stage must start at layer 0 and the last must end with the head")
        if norm_exchange is None:
            if (num_stages > 1 or (tp is not None and tp.size > 1)) and config.max_grad_norm is not None:
                raise ValueError("global gradient clipping across stages (or a stage's tp ranks) needs a "
                                 "norm_exchange; pass one or set max_grad_norm=None")
            if (num_stages > 1 or (tp is not None and tp.size > 1)) and config.fp16_loss_scale is not None:
                raise ValueError("fp16's global overflow check across stages (or a stage's tp ranks) needs a "
                                 "norm_exchange; pass one")
            norm_exchange = LocalNormExchange()
        self.module, self.stage, self.num_stages = module, stage, num_stages
        self.transport, self.config = transport, config
        self.norm_exchange, self.grad_averager = norm_exchange, grad_averager
        self.optimizer = optimizer if optimizer is not None else build_optimizer(module, config)
        self.zero = optimizer if isinstance(optimizer, ZeroOptimizer) else None
        """With ZeRO the optimizer also reduces the gradients over the replicas (no separate averager)."""
        self.tp = tp
        """Tensor parallelism: `module` is this rank's shard; only tp rank 0 uses the transport."""
        self.door = door
        """Judges this stage's loss and hands over the offences of the tensors its transport rejected (the same
        `Door` as the transport's): any of them skips the step on every node (`train_step`). None: no checks."""
        self.verifier = verifier
        """This stage's replicas recomputing one another's sampled micro-batches (`atoll.node.verify`); None: none."""
        self._last_grad_sent: torch.Tensor | None = None
        """A last stage's newest activation-gradient sent upstream for a loss its door accepted."""
        if self.zero is not None and grad_averager is not None:
            raise ValueError("a ZeRO optimizer reduces the gradients over the stage's replicas itself; pass no "
                             "grad_averager with it")
        tied = getattr(module, "tied_copy", None) is not None or getattr(module, "ties_embedding", False)
        if tied and not isinstance(grad_averager, WithTiedGradients):
            raise ValueError(f"stage {stage} holds a copy of a tied embedding weight (layers [{module.start}, "
                             f"{module.end}) of a tied model cut into stages): its gradient must be summed with the "
                             "other copy's; pass grad_averager=WithTiedGradients(...) (atoll.node.tied), or keep "
                             "the embedding and head on one stage")
        self.weight_grads: WeightGradients | None = None
        """Zero-bubble: where backward leaves the linear layers' weight-gradient products for the weight actions
        (under tensor parallelism each rank's products of its shards, as DTensors). Not with ZeRO-2 (its hooks
        reduce each gradient as backward produces it): its stages compute them in backward."""
        attach(module, None)  # a module kept from an earlier stage of another plan computes them in backward again
        if config.defer_weights and (self.zero is None or self.zero.stage < 2):
            sink = WeightGradients()
            if config.defer_layers:
                layers = getattr(module, "layers", None)
                missing = [i for i in config.defer_layers if layers is None or str(i) not in layers]
                if missing:
                    raise ValueError(f"defer_layers {missing} are not layers of stage {stage}'s module "
                                     f"(layers [{getattr(module, 'start', '?')}, {getattr(module, 'end', '?')}))")
                reached = sum(attach(layers[str(i)], sink) for i in config.defer_layers)  # type: ignore[index]
            else:
                reached = attach(module, sink)
            if reached:
                self.weight_grads = sink
                if self.zero is not None:  # their gradients complete in the weight actions, not in backward
                    self.zero.deferred_weights(m.weight for m in module.modules()
                                               if isinstance(m, DeferrableLinear) and m.deferred is sink)
        self.actions: list[Action] = lane_actions(
            schedule(config.schedule, stage=stage, num_stages=num_stages, micro_batches=config.micro_batches,
                     extra_in_flight=config.in_flight, defer_weights=config.defer_weights if self.weight_grads else 0),
            lane=config.lane, lanes=config.lanes)
        self.device = next(module.parameters()).device
        self._working_set: tuple[tuple[int, int], int] | None = None
        """((rows, seq), bytes) of a recomputed block's working set, measured once per micro-batch shape."""
        self.scaler = LossScaler(config.fp16_loss_scale) if config.fp16_loss_scale is not None else None
        """fp16: the dynamic loss scale, equal on every stage and replica (they apply the same overflow flags)."""
        self.exchanged: tuple[int, float] | None = None
        """(step, total) of the last norm exchange this stage completed."""
        self.unexchanged: int | None = None
        """The step whose norm exchange failed here, its final gradients still on the parameters: other stages
        may have completed that exchange and stepped (`atoll.node.roll_forward`)."""
        self.unexchanged_loss: float | None = None
        """A last stage's mean loss over the micro-batches of the `unexchanged` step (the step was computed; the
        node that finishes it reports the loss, `atoll.node.roll_forward`)."""

    @classmethod
    def create(cls, model: ModelConfig, *, start: int, end: int, stage: int, num_stages: int,
               transport: Transport, config: StageConfig, norm_exchange: NormExchange | None = None,
               grad_averager: GradientAverager | None = None, seed: int = 0,
               device: torch.device | str | None = None) -> "PipelineStage":
        """Build layers [start, end) of `model` (seeded by layer) and the stage that trains them."""
        module = build_slice(model, start, end, seed=seed, device=device)
        return cls(module, stage=stage, num_stages=num_stages, transport=transport, config=config,
                   norm_exchange=norm_exchange, grad_averager=grad_averager)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def train_step(self, step: int, batch: StageData | None = None) -> StepResult:
        """Forward and backward every micro-batch, reduce and clip gradients, step the optimizer."""
        cfg, m = self.config, self.config.local_micro_batches
        lanes = cfg.lanes
        inputs = self._split(batch.inputs if batch else None, "inputs", self.is_first)
        targets = self._split(batch.targets if batch else None, "targets", self.is_last)
        t0 = time.perf_counter()
        self.module.train()
        zero = self.zero
        if zero is not None:
            zero.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        sync = 0.0
        mb_shape = (0, 0)  # (rows, seq) of a micro-batch
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # micro-batch -> (input, output)
        deferred: dict[int, list] = {}  # micro-batch -> its weight-gradient products (zero-bubble)
        wg = self.weight_grads
        if wg is not None:
            wg.clear()
        mb_bytes: dict[int, int] = {}
        live_bytes = peak_bytes = 0
        losses: list[float] = []
        bad_loss: set[int] = set()  # micro-batches whose loss this (last) stage's door rejected
        tokens = 0
        compute = wait = 0.0
        timeline: list[OpTiming] = []
        param_ptrs = {storage(p).data_ptr() for p in self.module.parameters()} if cfg.track_memory else set()
        kept = self.verifier.wanted(step) if self.verifier is not None else None  # the micro-batch checked here

        # the last backward, and the last weight action after it, complete every parameter's gradient
        last_backward = max((n for n, a in enumerate(self.actions) if a.op == "backward"), default=-1)
        last_weight = max((n for n, a in enumerate(self.actions) if a.op == "weight"), default=-1)
        for n, action in enumerate(self.actions):
            a_start = time.perf_counter()
            i = action.micro_batch
            if action.op == "weight":
                c0, cpu0 = time.perf_counter(), time.thread_time()
                pending = deferred.pop(i)
                # the last micro-batch's products complete their weights' gradients: ZeRO-1 starts reducing them
                WeightGradients.apply(pending, zero.grad_final if zero is not None and n == last_weight else None)
                self._sync()
                a_wait, a_compute, a_cpu = 0.0, time.perf_counter() - c0, time.thread_time() - cpu0
                compute += a_compute
                if cfg.track_memory:
                    live_bytes -= mb_bytes.pop(i)
            elif action.op == "forward":
                if self.is_first:
                    x: torch.Tensor | None = None
                    h_in = inputs[i // lanes].to(self.device)
                    a_wait = 0.0
                else:
                    w0 = time.perf_counter()
                    x = self._recv(TensorKey(step, i, "forward")).to(self.device)
                    a_wait = time.perf_counter() - w0
                    x.requires_grad_(True)
                    h_in = x
                mb_shape = (h_in.shape[0], h_in.shape[1])
                c0, cpu0 = time.perf_counter(), time.thread_time()
                counter = SavedBytesCounter(param_ptrs)
                hooks = torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t) if cfg.track_memory \
                    else contextlib.nullcontext()
                with hooks, self._autocast():
                    out = self.module(h_in)
                    if i == kept and self.is_last:  # (a last stage's check compares the logits of its loss)
                        self.verifier.keep(h_in, out)  # type: ignore[union-attr]
                    if self.is_last:
                        tgt = targets[i // lanes].to(self.device)
                        loss = lm_loss(out, tgt)
                        tokens += tgt.numel()
                        out = loss / m if self.scaler is None else loss * (self.scaler.scale / m)
                self._sync()
                if (fault := injected()) is not None:
                    fault.slow_down(step, time.perf_counter() - c0)
                a_compute, a_cpu = time.perf_counter() - c0, time.thread_time() - cpu0
                compute += a_compute
                if self.is_last:
                    losses.append(float(loss.detach()))
                    if self.door is not None and self.door.check_loss(step, losses[-1], i) is not None:
                        bad_loss.add(i)
                else:
                    sent = self._send(TensorKey(step, i, "forward"), out.detach())
                    if i == kept:
                        self.verifier.keep(h_in, sent)  # type: ignore[union-attr]
                saved[i] = (x, out)
                if cfg.track_memory:
                    for t in (x, out):  # held until backward; once, when a layer saved the same storage
                        if t is not None:
                            counter.pack(t)
                    mb_bytes[i] = counter.bytes
                    live_bytes += mb_bytes[i]
                    peak_bytes = max(peak_bytes, live_bytes)
            else:
                x, out = saved.pop(i)
                if self.is_last:
                    grad = None
                    a_wait = 0.0
                else:
                    w0 = time.perf_counter()
                    grad = self._recv(TensorKey(step, i, "backward")).to(self.device)
                    if cfg.grad_in_scale != 1.0:
                        grad.mul_(cfg.grad_in_scale)
                    a_wait = time.perf_counter() - w0
                c0, cpu0 = time.perf_counter(), time.thread_time()
                if zero is not None and n == last_backward:  # the step's last gradients: reduced as they complete
                    zero.last_backward()
                out.backward(grad)
                if wg is not None:
                    deferred[i] = wg.take()
                self._sync()
                if (fault := injected()) is not None:
                    fault.slow_down(step, time.perf_counter() - c0)
                a_compute, a_cpu = time.perf_counter() - c0, time.thread_time() - cpu0
                compute += a_compute
                if x is not None:
                    if x.grad is None:
                        raise RuntimeError(f"stage {self.stage} produced no gradient for its input of micro-batch {i}")
                    self._send(TensorKey(step, i, "backward"), self._grad_to_send(x.grad, i in bad_loss))
                if zero is not None:  # ZeRO-2 reduce-scatters this micro-batch's gradients (after the send)
                    s0 = time.perf_counter()
                    zero.backward_done()
                    sync += time.perf_counter() - s0
                if cfg.track_memory:
                    live_bytes -= mb_bytes.pop(i)
                    if wg is not None:  # the deferred products live on until the weight action
                        mb_bytes[i] = WeightGradients.nbytes(deferred[i])
                        live_bytes += mb_bytes[i]
                        peak_bytes = max(peak_bytes, live_bytes)
            wait += a_wait
            timeline.append(OpTiming(action.op, i, a_start - t0, time.perf_counter() - t0, a_wait,
                                     a_compute, a_cpu))

        params = [p for p in self.module.parameters() if p.requires_grad]
        offences = self.door.take(step) if self.door is not None else []
        if self.verifier is not None:  # before the average: a mismatch skips the step like a rejected tensor
            offences += self.verifier.check(step, self.module, self._autocast)
        if offences and zero is None:
            # the step is skipped everywhere through fp16's agreement path (`atoll.node.precision`): +inf in every
            # gradient rides the data-parallel average to every replica of this stage (of every pipeline sharing
            # its layers), and makes this stage's share of the norm exchange non-finite for its whole pipeline
            for p in params:
                if p.grad is not None:
                    p.grad.fill_(math.inf)
        s0 = time.perf_counter()
        if zero is not None:
            zero.reduce_gradients()
        elif self.grad_averager is not None:
            self.grad_averager.average_(params, cfg.collective_timeout)
        self._sync()  # an NCCL wait only orders the stream: the reduction's time counts here, not in what follows
        sync += time.perf_counter() - s0
        grad_bytes = zero.peak_grad_bytes if zero is not None else _grad_bytes(params)

        scaler, found_inf = self.scaler, False
        loss_scale = scaler.scale if scaler is not None else None
        if offences and zero is not None:  # (its shards, reduced already: their squared norm sums over the replicas)
            zero.scale_gradients(math.inf)
        if scaler is not None:  # the averaged gradients carry the loss scale: take it off before norms and steps
            if zero is not None:
                zero.scale_gradients(1.0 / scaler.scale)
            else:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(1.0 / scaler.scale)
        grad_norm = None
        if cfg.max_grad_norm is not None or scaler is not None or self.door is not None:
            # with ZeRO: the owned shards' squares summed over the replicas, the stage's whole norm
            # a tied head's copy of the embedding weight counts once: on the embedding's stage (`atoll.node.tied`)
            copy = getattr(self.module, "tied_copy", None)
            counted = [p for p in params if p is not copy]
            local = zero.squared_norm() if zero is not None else \
                self.tp.squared_norm(counted) if self.tp is not None else _squared_norm(counted)
            if scaler is not None:  # +inf from an overflowed stage makes the pipeline's total non-finite
                local = overflow_contribution(local)
            w0 = time.perf_counter()
            try:
                total = self.norm_exchange.all_sum(local, cfg.collective_timeout)
            except BaseException:
                self.unexchanged = step
                self.unexchanged_loss = sum(losses) / m if self.is_last and losses else None
                raise
            self.exchanged, self.unexchanged, self.unexchanged_loss = (step, total), None, None
            wait += time.perf_counter() - w0
            # non-finite: an fp16 overflow, a rejected tensor or a bad loss somewhere: no node steps, in any precision
            found_inf = not math.isfinite(total)
            grad_norm = math.sqrt(total)
        if grad_norm is not None and cfg.max_grad_norm is not None and not found_inf:
            # same coefficient as torch.nn.utils.clip_grad_norm_
            coef = min(cfg.max_grad_norm / (grad_norm + 1e-6), 1.0)
            if coef < 1.0:
                if zero is not None:
                    zero.scale_gradients(coef)
                else:
                    for p in params:
                        if p.grad is not None:
                            p.grad.mul_(coef)
        pipeline_end = time.perf_counter()
        if not found_inf:  # an overflow or a rejection anywhere: no stage of any replica steps (atoll.node.precision)
            self.optimizer.step()
            self._sync()  # the step's kernels (and ZeRO's all-gather) run asynchronously on a GPU
        if scaler is not None:
            scaler.update(found_inf)
        end = time.perf_counter()
        if self.device.type == "cuda":
            peak_memory = torch.cuda.max_memory_allocated(self.device)
        elif cfg.track_memory:
            peak_memory = (self.state_bytes(grad_bytes) + peak_bytes
                           + self._recompute_working_set(mb_shape, param_ptrs))
        else:
            peak_memory = 0
        return StepResult(
            step=step, loss=sum(losses) / m if self.is_last else None, grad_norm=grad_norm, tokens=tokens,
            step_seconds=end - t0, pipeline_seconds=pipeline_end - t0,
            compute_seconds=compute, wait_seconds=wait, sync_seconds=sync, optimizer_seconds=end - pipeline_end,
            peak_activation_bytes=peak_bytes, peak_memory_bytes=peak_memory, timeline=timeline,
            skipped=found_inf, loss_scale=loss_scale, offences=offences)

    def _recompute_working_set(self, shape: tuple[int, int], params: set[int]) -> int:
        """Bytes a recomputed block rebuilds in backward while the step's activations are live (0 without
        recomputation): the saved activations of the first recomputed block at this micro-batch's (rows, seq),
        counted once by running its forward outside the step's graph (blocks are alike)."""
        if not self.module.recompute:
            return 0
        if self._working_set is None or self._working_set[0] != shape:
            counter = SavedBytesCounter(params)
            x = torch.zeros(*shape, self.module.config.d_model, device=self.device, requires_grad=True)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), \
                    self._autocast():
                self.module.layers[str(min(self.module.recompute))](x)
            self._working_set = (shape, counter.bytes)
        return self._working_set[1]

    def state_bytes(self, grad_bytes: int) -> int:
        """Bytes of the stage's parameters and optimizer states (each storage once) plus `grad_bytes`."""
        if self.zero is not None:
            params = self.zero.flat.numel() * self.zero.flat.element_size()
            return params + grad_bytes + self.zero.optimizer_state_bytes()
        params = storage_bytes(self.module.parameters())
        opt = storage_bytes(v for st in self.optimizer.state.values() for v in st.values()
                             if torch.is_tensor(v) and v.ndim > 0)
        return params + grad_bytes + opt

    def _recv(self, key: TensorKey) -> torch.Tensor:
        # a tp stage receives on its rank 0 and broadcasts to its other ranks (same order on every rank); what
        # arrives in the wire dtype is widened back to fp32 first
        if self.tp is None:
            return _widen(self.transport.recv(key, self.config.recv_timeout))
        return self.tp.share(_widen(self.transport.recv(key, self.config.recv_timeout)) if self.tp.is_leader
                             else None)

    def _send(self, key: TensorKey, t: torch.Tensor) -> torch.Tensor:
        """Send `t` (in the wire's dtype); what was sent."""
        t = t.to(self.config.wire_dtype)
        fault = injected()
        if fault is not None and key.direction == "forward":  # test-only (`atoll.node.faults`), off by default
            t = fault.damage(key.step, key.micro_batch, t)
        if self.tp is None or self.tp.is_leader:  # every tp rank holds the same replicated tensor
            self.transport.send(key, t)
        return t

    def _grad_to_send(self, grad: torch.Tensor, bad: bool) -> torch.Tensor:
        """The activation-gradient a last stage sends upstream: `grad`, or where its micro-batch's loss was rejected
        (the step is skipped anyway) the last one it sent, so that the stage upstream does not take this stage's
        own bad loss for a bad tensor of its neighbour's."""
        if not bad:
            self._last_grad_sent = grad
            return grad
        last = self._last_grad_sent
        return last.clone() if last is not None and last.shape == grad.shape else torch.zeros_like(grad)

    def _split(self, t: torch.Tensor | None, name: str, needed: bool) -> list[torch.Tensor]:
        if not needed:
            return []
        if t is None:
            role = "first" if name == "inputs" else "last"
            raise ValueError(f"stage {self.stage} is the {role} stage of its pipeline: train_step needs batch.{name}")
        m = self.config.local_micro_batches
        if t.ndim != 2 or t.shape[0] % m:
            raise ValueError(f"batch.{name} must be (batch, seq) with batch divisible by the {m} micro-batches this "
                             f"replica trains; "
                             f"got shape {tuple(t.shape)}")
        if t.shape[1] > self.module.config.seq_len:
            raise ValueError(f"batch.{name} has {t.shape[1]} tokens per sequence; the model allows "
                             f"{self.module.config.seq_len}")
        return list(t.chunk(m, dim=0))

    def _sync(self) -> None:
        if self.device.type == "cuda":  # kernels run asynchronously; time them to completion
            torch.cuda.synchronize(self.device)

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.config.fp16_loss_scale is not None:
            return torch.autocast(device_type=self.device.type, dtype=torch.float16)
        if not self.config.bf16_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)


def _widen(t: torch.Tensor) -> torch.Tensor:
    """A received 16-bit activation or gradient as fp32 (the stage's compute between boundaries)."""
    return t.float() if t.is_floating_point() and t.dtype != torch.float32 else t


def _grad_bytes(params: list[nn.Parameter]) -> int:
    return storage_bytes(p.grad for p in params if p.grad is not None)


def _squared_norm(params: list[nn.Parameter]) -> float:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), 2.0, dtype=torch.float32) for g in grads])
    return float(torch.sum(norms.double() ** 2))
