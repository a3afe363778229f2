"""ZeRO-1 and ZeRO-2 over the data-parallel replicas of one stage.

`ZeroOptimizer(params, group, stage=1 | 2, ...)` replaces the stage's AdamW and its gradient all-reduce.
The group is the stage's own torch.distributed backend (gloo on CPU, NCCL on CUDA), made from the epoch's
rendezvous store as every Atoll group is; the collectives are c10d's reduce-scatter, all-gather, gather
and all-reduce on it.

Layout. The stage's trainable parameters (one dtype, one device) are laid end to end in one flat buffer,
in buckets of about `bucket_bytes` (last parameters first, the order backward produces their gradients);
each bucket is padded to a multiple of the group size N and cut into N equal chunks, and replica r owns
chunk r of every bucket. Every parameter becomes a view of the flat buffer (its storage moves there once,
at construction; the Parameter objects stay the same), and AdamW steps only the owned chunks (views as
well), so a replica holds 1/N of the optimizer states; after the step each bucket is all-gathered in
place, which leaves every replica with the whole updated parameters. AdamW is element-wise and every
parameter shares one group, so this is the same update as AdamW over the whole parameters.

Gradients. Each replica's gradients are first scaled by its own `grad_scale` (the stage's rows over the
global batch, as `_SegmentAverager` weights them), so the reduced sum is the gradient of the batch's mean
loss even when the replicas train different numbers of rows.
- ZeRO-1 keeps whole gradients: they accumulate over the micro-batches in a flat buffer of the stage's
  size (each `.grad` is a view of it), and every bucket is reduce-scattered in place; replica r keeps the sum
  of its chunks. The reduction overlaps the last micro-batch's backward: the stage calls `last_backward()`
  before it, a post-accumulate-grad hook (or `grad_final` for a deferred weight gradient, `atoll.node.wgrad`)
  marks each parameter whose gradient is then complete, and each bucket goes out as soon as it and every
  bucket before it are complete (the same order on every replica), while backward goes on; `reduce_gradients`
  sends what is left and waits. gloo runs a reduce-scatter inside the call that starts it, so on the CPU the
  buckets are started (and waited for) on a thread of the optimizer's own, in order (also on CUDA where the
  group is gloo: ranks sharing one GPU).
- ZeRO-2 never holds the whole gradient: a post-accumulate-grad hook copies each parameter's gradient into
  its bucket's staging buffer and drops it; a bucket whose parameters have all arrived is reduce-scattered
  (asynchronously, while backward goes on) and the owned chunk is added to a gradient accumulator of 1/N
  of the stage. That is one reduce-scatter per bucket per micro-batch (m per step against ZeRO-1's one),
  the price of sharding gradients while accumulating micro-batches. Buckets go out strictly in bucket
  order, which is the same on every replica, and `backward_done` sends what a micro-batch left (gradients
  a parameter did not get count as zeros), so the collectives always match.

Clipping stays exact: `squared_norm` sums the owned chunks' squares over the group (every replica gets the
stage's whole squared norm) for the pipeline's norm exchange to add up across stages.

Tensor parallelism (`atoll.node.tp`). A tp rank's parameters are DTensors: the flat buffer holds their local
shards (each shard's storage moves there, so the DTensor's ops read the buffer), and the group is the stage's
replicas of the same tp rank, which hold the same shards. A DTensor's gradient is accumulated as autograd leaves
it, in the parameter's own placement, and copied into a bucket's staging buffer: ZeRO-1 after the last
micro-batch, bucket by bucket, each gradient freed once copied and each bucket reduce-scattered into the owned
chunk's gradient (so a replica holds about one whole gradient at its most, as plain ZeRO-1 does); ZeRO-2 as it
arrives. A replicated parameter (norms, biases of row-wise layers) is on every tp rank: with
`count_replicated=False` (every tp rank but 0) its elements stay out of `squared_norm`, so the sum over the tp
group counts each element once, as `TensorParallel.squared_norm` does without ZeRO.

Checkpoints keep the per-parameter AdamW format of `atoll.node.slice_state`: `consolidated_state(to=r)`
gathers every replica's chunk states to replica r, which writes them; `from_adamw` starts from a whole
AdamW (fresh or loaded from a checkpoint of any cut) and keeps only the owned chunks of its states.

Why not `torch.distributed.optim.ZeroRedundancyOptimizer`: it needs the process-global default group
(`dist.get_rank(group)` reads it, and `consolidate_state_dict` compares global ranks), while Atoll's groups
are standalone backends made per plan epoch from the rendezvous store, with several nodes per process in
the thread-level tests and no global world. It also partitions whole parameters (uneven shards) and has no
ZeRO-2.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from atoll.node.dataparallel import CollectiveError, collective_failed, wait_collective, wait_done

ZERO2_BUCKETS = 32
"""ZeRO-2 cuts a stage into at least this many buckets (of at most `bucket_bytes`): it holds the staged
gradients of about three at a time (one in flight, one or two filling), ~10% of a whole gradient."""
ZERO2_MIN_BUCKET_BYTES = 2**16


def _storage(p: torch.Tensor) -> torch.Tensor:
    """The tensor that holds `p`'s elements in this process: `p` itself, or a tensor-parallel parameter's local
    shard (the very tensor the DTensor's ops read, so moving its storage moves the parameter's)."""
    return p._local_tensor if isinstance(p, DTensor) else p


def _local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """`p`'s gradient as this process holds it: a DTensor's in the parameter's own placement, local part."""
    g = p.grad
    if isinstance(g, DTensor):
        assert isinstance(p, DTensor)
        with torch.no_grad():
            if tuple(g.placements) != tuple(p.placements):  # the vocab-parallel embedding's comes back replicated
                g = g.redistribute(p.device_mesh, p.placements)
            return g.to_local()
    return g


def _counts_everywhere(p: torch.Tensor) -> bool:
    """Whether every tp rank holds a different part of `p` (a shard), rather than the same whole tensor."""
    return isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)


def _weak_hook(owner: object, method: str):
    """A post-accumulate-grad hook calling `owner.method(p)` while `owner` lives. A hook bound to its owner would
    keep it, its flat buffers and its optimizer states alive as long as the parameters are (the parameters hold
    their hooks where the garbage collector does not look), across every plan epoch that made one."""
    ref = weakref.ref(owner)

    def hook(p: torch.Tensor) -> None:
        got = ref()
        if got is not None:
            getattr(got, method)(p)

    return hook


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """How a stage's replicas shard their optimizer (and, with stage 2, their gradients)."""

    stage: int
    """1: shard the AdamW states; 2: shard the gradients too."""
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    bucket_bytes: int = 25 * 2**20
    """Largest bucket of parameters reduce-scattered and all-gathered at once (a parameter bigger than this
    is a bucket of its own). ZeRO-2, and ZeRO-1 over tensor-parallel shards (both stage gradients bucket by
    bucket), take buckets of at most 1/`ZERO2_BUCKETS` of the stage."""
    grad_scale: float = 1.0
    """Factor applied to this replica's gradients before they are summed over the group (its rows over the
    rows of all the replicas together, for the gradient of the mean loss)."""

    def __post_init__(self) -> None:
        if self.stage not in (1, 2):
            raise ValueError(f"ZeRO stage must be 1 or 2, got {self.stage}")
        if self.lr <= 0 or self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"lr and eps must be positive and weight_decay non-negative, got {self.lr}, "
                             f"{self.eps}, {self.weight_decay}")
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        if not self.grad_scale > 0:
            raise ValueError(f"grad_scale must be positive, got {self.grad_scale}")


@dataclass(frozen=True)
class _Bucket:
    params: tuple[nn.Parameter, ...]
    offsets: tuple[int, ...]
    """Each parameter's first element, relative to the bucket's start."""
    start: int
    """The bucket's first element in the flat buffer."""
    size: int
    """Elements, padded to a multiple of the group size."""
    chunk: int
    """Elements per replica: size / group size."""


class ZeroOptimizer:
    """AdamW whose states (ZeRO-1) and gradients (ZeRO-2) are sharded over a stage's replicas.

    The stage calls, per step: `zero_grad()`; forward/backward of every micro-batch with `backward_done()`
    after each backward; `reduce_gradients()`; `squared_norm()` and `scale_gradients()` to clip; `step()`.
    `param_groups` is the inner AdamW's (set the learning rate there).
    """

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup, config: ZeroConfig,
                 timeout: timedelta = timedelta(seconds=60), *, count_replicated: bool = True):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("ZeRO needs at least one trainable parameter")
        kinds = {(_storage(p).dtype, _storage(p).device) for p in self.params}
        if len(kinds) != 1:
            raise ValueError(f"ZeRO flattens the stage's parameters into one buffer; they must share one dtype and "
                             f"device, got {sorted(map(str, kinds))}")
        self.group, self.config, self.timeout = group, config, timeout
        self.world, self.rank = group.size(), group.rank()
        self.sharded = any(isinstance(p, DTensor) for p in self.params)
        """Tensor-parallel parameters (DTensors): their local shards are flattened, their gradients copied in."""
        dtype, device = _storage(self.params[0]).dtype, _storage(self.params[0]).device
        self._numel = {id(p): _storage(p).numel() for p in self.params}
        bucket_bytes = config.bucket_bytes
        if config.stage == 2 or self.sharded:  # staged gradients are a few buckets: a small part of the gradient
            total = sum(self._numel.values()) * _storage(self.params[0]).element_size()
            bucket_bytes = min(bucket_bytes, max(ZERO2_MIN_BUCKET_BYTES, math.ceil(total / ZERO2_BUCKETS)))
        self.buckets = self._layout(self.params, [self._numel[id(p)] for p in self.params],
                                    _storage(self.params[0]).element_size(), bucket_bytes, self.world)
        total = sum(b.size for b in self.buckets)
        self.flat = torch.zeros(total, dtype=dtype, device=device)
        with torch.no_grad():
            for b in self.buckets:
                for p, off in zip(b.params, b.offsets):
                    local = _storage(p)
                    view = self.flat[b.start + off:b.start + off + local.numel()].view_as(local)
                    view.copy_(local)
                    local.data = view  # the Parameter (or shard) object stays; its storage is now the flat buffer's
        # the owned elements the squared norm counts: all of them, or (a tp rank but 0) all but replicated ones
        self._counted: list[list[tuple[int, int]]] = []
        for b in self.buckets:
            lo, hi = self.rank * b.chunk, (self.rank + 1) * b.chunk
            spans, at = [], lo
            for p, off in zip(b.params, b.offsets):
                if count_replicated or _counts_everywhere(p):
                    continue
                a, e = max(lo, off), min(hi, off + self._numel[id(p)])
                if a < e:
                    if a > at:
                        spans.append((at - lo, a - lo))
                    at = e
            if at < hi:
                spans.append((at - lo, hi - lo))
            self._counted.append(spans)
        self.place = {id(p): (i, off) for i, b in enumerate(self.buckets) for p, off in zip(b.params, b.offsets)}
        """Parameter -> (its bucket, its first element in the bucket)."""
        # the owned chunk of every bucket: AdamW steps these views of the flat buffer in place
        self.chunks = [nn.Parameter(self._own(self.flat, b)) for b in self.buckets]
        self.optimizer = torch.optim.AdamW(self.chunks, lr=config.lr, betas=config.betas, eps=config.eps,
                                           weight_decay=config.weight_decay, foreach=False)
        self.torn = False
        """A step abandoned between the AdamW update and the end of the parameters' all-gather: the parameters
        are part updated, part not (no state to hand over)."""
        self.peak_grad_bytes = 0
        """Most gradient bytes this replica held at once in the last step (whole buffer, or ZeRO-2's shard
        accumulators and staging buffers)."""
        self._elem = self.flat.element_size()
        self.flat_grad: torch.Tensor | None = None
        """ZeRO-1's whole gradient, each parameter's `.grad` a view of it (not with tensor-parallel parameters)."""
        self._staging: dict[int, torch.Tensor] = {}
        self._staged_bytes = 0
        self._inflight: list[tuple[int, torch.Tensor, object]] = []
        if config.stage == 1 and not self.sharded:
            self.flat_grad = torch.zeros_like(self.flat)
            for c, b in zip(self.chunks, self.buckets):
                c.grad = self._own(self.flat_grad, b)
        else:  # the owned chunks' gradients: reduce-scattered into from staging buffers
            for c, b in zip(self.chunks, self.buckets):
                c.grad = torch.zeros(b.chunk, dtype=dtype, device=device)
        if config.stage == 2:
            self._arrived = [0] * len(self.buckets)
            self._next = 0  # the next bucket to send, in bucket order
            self._hooks = [p.register_post_accumulate_grad_hook(_weak_hook(self, "_grad_ready")) for p in self.params]
        self.overlaps = self.flat_grad is not None and self.world > 1
        """ZeRO-1 over whole parameters with replicas: the reduction overlaps the last micro-batch's backward."""
        self._final = False  # between last_backward() and reduce_gradients()
        self._complete: list[set[int]] = [set() for _ in self.buckets]
        self._sent = 0
        self._sending: list[tuple[int, Future]] = []
        self._launcher: queue.Queue | None = None
        self._from_weights: set[int] = set()
        self.reduced_in_backward = 0
        """Buckets of the last step whose reduce-scatter started while the last micro-batch's backward ran."""
        if self.overlaps:
            self._hooks = [p.register_post_accumulate_grad_hook(_weak_hook(self, "_accumulated")) for p in self.params]

    # --- layout --------------------------------------------------------------------------------------

    @staticmethod
    def _layout(params: list[nn.Parameter], numels: list[int], elem_bytes: int, bucket_bytes: int,
                world: int) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        sizes: list[int] = []
        start = used = 0

        def close() -> None:
            nonlocal start, current, sizes, used
            offsets, n = [], 0
            for k in sizes:
                offsets.append(n)
                n += k
            size = max(world, math.ceil(n / world) * world)
            buckets.append(_Bucket(tuple(current), tuple(offsets), start, size, size // world))
            start += size
            current, sizes, used = [], [], 0

        for p, k in zip(reversed(params), reversed(numels)):  # backward produces the last layers' gradients first
            nbytes = k * elem_bytes
            if current and used + nbytes > bucket_bytes:
                close()
            current.append(p)
            sizes.append(k)
            used += nbytes
        if current:
            close()
        return buckets

    def _own(self, flat: torch.Tensor, b: _Bucket) -> torch.Tensor:
        a = b.start + self.rank * b.chunk
        return flat[a:a + b.chunk]

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def stage(self) -> int:
        return self.config.stage

    # --- per step ------------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Start a step: no gradient accumulated yet."""
        self._final, self._sending = False, []
        if self.config.stage == 1 and self.sharded:  # DTensor gradients accumulate as autograd leaves them
            for p in self.params:
                p.grad = None
            self.peak_grad_bytes = 0  # counted as the gradients are reduced
        elif self.flat_grad is not None:
            self.flat_grad.zero_()
            for b in self.buckets:  # whatever happened to .grad, it accumulates into the flat buffer again
                for p, off in zip(b.params, b.offsets):
                    p.grad = self.flat_grad[b.start + off:b.start + off + p.numel()].view_as(p)
            self.peak_grad_bytes = self.flat_grad.numel() * self._elem
        else:
            for c in self.chunks:
                c.grad.zero_()
            for p in self.params:
                p.grad = None
            self._arrived = [0] * len(self.buckets)
            self._next = 0
            self.peak_grad_bytes = self._accumulator_bytes()

    def backward_done(self) -> None:
        """After each micro-batch's backward: ZeRO-2 sends the buckets still open and adds every reduced chunk
        to its accumulator (a parameter without a gradient in this micro-batch contributes zeros)."""
        if self.config.stage != 2:
            return
        for i in range(len(self.buckets)):
            if self._arrived[i] < len(self.buckets[i].params):
                self._stage_buffer(i)
                self._arrived[i] = len(self.buckets[i].params)
        self._send_ready()
        self._drain()
        for p in self.params:  # gradients that arrived after their bucket went out (none in a normal graph)
            p.grad = None
        self._arrived = [0] * len(self.buckets)
        self._next = 0

    def last_backward(self) -> None:
        """Before the last micro-batch's backward: from here on a parameter whose gradient accumulates is
        complete, and ZeRO-1 reduce-scatters each bucket once it is (a no-op where nothing overlaps)."""
        if not self.overlaps:
            return
        self._final = True
        self._complete = [set() for _ in self.buckets]
        self._sent = 0
        self._sending = []

    def grad_final(self, p: torch.Tensor) -> None:
        """`p`'s gradient is complete for this step (a deferred weight gradient added after `last_backward`)."""
        if not self._final:
            return
        i = self.place[id(p)][0]
        if i < self._sent:
            raise RuntimeError(f"a gradient of bucket {i} ({tuple(p.shape)}) was completed after the bucket was "
                               "reduce-scattered: only the last micro-batch's backward and weight gradients may "
                               "follow last_backward()")
        self._complete[i].add(id(p))
        while (self._sent < len(self.buckets)
               and len(self._complete[self._sent]) == len(self.buckets[self._sent].params)):
            self._send(self._sent)

    def deferred_weights(self, params: Iterable[nn.Parameter]) -> None:
        """Weights whose gradients the stage's weight actions add (zero-bubble): complete only at `grad_final`.
        Backward still runs their post-accumulate-grad hooks, without a gradient."""
        self._from_weights = {id(p) for p in params}

    def _accumulated(self, p: torch.Tensor) -> None:
        if self._final and id(p) not in self._from_weights:
            self.grad_final(p)

    def _send(self, i: int) -> None:
        """Scale bucket i's gradient and start its reduce-scatter (on the launcher thread where gloo would run it
        in this call)."""
        assert self.flat_grad is not None
        b = self.buckets[i]
        whole, own = self.flat_grad[b.start:b.start + b.size], self._own(self.flat_grad, b)
        if self.config.grad_scale != 1.0:
            whole.mul_(self.config.grad_scale)
        fut: Future = Future()
        if self.group.name() == "nccl":  # NCCL works asynchronously on its own stream
            fut.set_result(self.group._reduce_scatter_base(own, whole))
        else:
            if self._launcher is None:
                self._launcher = queue.Queue()
                threading.Thread(target=self._launch_loop, args=(self._launcher,), daemon=True,
                                 name="atoll-zero1-reduce").start()
                weakref.finalize(self, self._launcher.put, None)  # the thread ends with the optimizer

            def reduce() -> None:  # started and finished on the launcher thread: nothing left to wait for
                self.group._reduce_scatter_base(own, whole).wait(self.timeout)

            self._launcher.put((fut, reduce))
        self._sending.append((i, fut))
        self._sent = i + 1

    @staticmethod
    def _launch_loop(jobs: queue.Queue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            fut, call = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(call())
                except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                    fut.set_exception(e)
            job = fut = call = None  # hold nothing of the optimizer while waiting for its next bucket

    def _await(self, i: int, fut: Future) -> None:
        what = f"ZeRO-1 gradient reduce-scatter of bucket {i} over {self.world} replicas"
        done = threading.Event()
        fut.add_done_callback(lambda _: done.set())
        started = time.monotonic()
        wait_done(done, self.timeout, what)
        try:
            got = fut.result()
        except RuntimeError as e:
            raise CollectiveError(collective_failed(what, started, self.timeout, e)) from e
        if got is not None:  # an NCCL work started on this thread
            self._wait(got, f"gradient reduce-scatter of bucket {i}")

    def reduce_gradients(self) -> None:
        """After the last micro-batch: leave the owned chunks holding the sum over the group of the replicas'
        scaled gradients (ZeRO-1 reduce-scatters here what the last backward did not send; ZeRO-2 has done it
        micro-batch by micro-batch)."""
        if self.config.stage != 1:
            return
        if self.sharded:
            self._reduce_sharded()
            return
        assert self.flat_grad is not None
        if self._final:
            self._final = False
            self.reduced_in_backward = self._sent
            while self._sent < len(self.buckets):  # parameters the last micro-batch gave no gradient
                self._send(self._sent)
            sending, self._sending = self._sending, []
            for i, fut in sending:
                self._await(i, fut)
            return
        if self.config.grad_scale != 1.0:
            self.flat_grad.mul_(self.config.grad_scale)
        if self.world == 1:
            return
        works = [(i, self.group._reduce_scatter_base(self._own(self.flat_grad, b),
                                                     self.flat_grad[b.start:b.start + b.size]))
                 for i, b in enumerate(self.buckets)]
        for i, w in works:
            self._wait(w, f"gradient reduce-scatter of bucket {i}")

    def _reduce_sharded(self) -> None:
        """ZeRO-1 over tensor-parallel shards: bucket by bucket, the gradients copied into a staging buffer (each
        freed once copied) and reduce-scattered into the owned chunk's gradient, one bucket in flight while the
        next is staged."""
        held = sum(_storage(p).numel() for p in self.params if p.grad is not None) * self._elem
        self.peak_grad_bytes = held + self._accumulator_bytes()
        with torch.no_grad():
            for i, b in enumerate(self.buckets):
                buf = self._stage_buffer(i)
                self.peak_grad_bytes = max(self.peak_grad_bytes, held + self._accumulator_bytes() + self._staged_bytes)
                for p, off in zip(b.params, b.offsets):
                    g = _local_grad(p)
                    if g is not None:
                        buf[off:off + self._numel[id(p)]].copy_(g.reshape(-1))
                        held -= _storage(p).numel() * self._elem
                    p.grad = None
                if self.config.grad_scale != 1.0:
                    buf.mul_(self.config.grad_scale)
                self.chunks[i].grad.zero_()
                if self.world > 1:
                    out = buf[self.rank * b.chunk:(self.rank + 1) * b.chunk]
                    self._inflight.append((i, out, self.group._reduce_scatter_base(out, buf)))
                else:
                    self._inflight.append((i, buf, None))
                if len(self._inflight) > 1:
                    self._drain(keep=1)
            self._drain()

    def squared_norm(self) -> float:
        """The squared L2 norm of the stage's whole reduced gradient (the owned chunks' summed over the group)."""
        local = torch.zeros((), dtype=torch.float64, device=self.flat.device)
        for c, spans in zip(self.chunks, self._counted):
            for a, e in spans:
                local += torch.linalg.vector_norm(c.grad[a:e], 2.0, dtype=torch.float32).double() ** 2
        t = local.reshape(1)
        if self.world > 1:
            self._wait(self.group.allreduce([t]), "squared gradient norm all-reduce")
        return float(t.item())

    def scale_gradients(self, coef: float) -> None:
        for c in self.chunks:
            c.grad.mul_(coef)

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the owned chunks, then every bucket all-gathered in place into the parameters."""
        self.torn = True  # until the all-gather is done, only the owned chunks hold the updated parameters
        self.optimizer.step()
        if self.world > 1:
            works = [(i, self.group._allgather_base(self.flat[b.start:b.start + b.size], self._own(self.flat, b)))
                     for i, b in enumerate(self.buckets)]
            for i, w in works:
                self._wait(w, f"parameter all-gather of bucket {i}")
        self.torn = False

    # --- ZeRO-2 gradient staging ---------------------------------------------------------------------

    def _accumulator_bytes(self) -> int:
        return sum(b.chunk for b in self.buckets) * self._elem

    def _stage_buffer(self, i: int) -> torch.Tensor:
        buf = self._staging.get(i)
        if buf is None:
            b = self.buckets[i]
            buf = self._staging[i] = torch.zeros(b.size, dtype=self.flat.dtype, device=self.flat.device)
            self._staged_bytes += b.size * self._elem
            self.peak_grad_bytes = max(self.peak_grad_bytes, self._accumulator_bytes() + self._staged_bytes)
        return buf

    def _grad_ready(self, p: torch.Tensor) -> None:
        i, off = self.place[id(p)]
        if i < self._next:  # one backward pass gives each parameter one gradient, so this means a second pass
            raise RuntimeError(f"a gradient of bucket {i} arrived after the bucket was reduced; call backward_done() "
                               "after each micro-batch's backward, once")
        g = _local_grad(p)
        assert g is not None
        with torch.no_grad():
            self._stage_buffer(i)[off:off + self._numel[id(p)]].copy_(g.reshape(-1))
        p.grad = None
        self._arrived[i] += 1
        self._send_ready()

    def _send_ready(self) -> None:
        while self._next < len(self.buckets) and self._arrived[self._next] == len(self.buckets[self._next].params):
            i = self._next
            buf = self._staging[i]
            if self.config.grad_scale != 1.0:
                buf.mul_(self.config.grad_scale)
            b = self.buckets[i]
            if self.world > 1:
                out = buf[self.rank * b.chunk:(self.rank + 1) * b.chunk]
                self._inflight.append((i, out, self.group._reduce_scatter_base(out, buf)))
            else:
                self._inflight.append((i, buf, None))
            self._next += 1
            # one bucket in flight at a time: the one just sent overlaps the backward that follows
            if len(self._inflight) > 1:
                self._drain(keep=1)

    def _drain(self, keep: int = 0) -> None:
        """Wait for the buckets in flight but the newest `keep`, add their chunks to the accumulators, free them."""
        done, self._inflight = self._inflight[:len(self._inflight) - keep], self._inflight[len(self._inflight) - keep:]
        for i, out, work in done:
            if work is not None:
                self._wait(work, f"gradient reduce-scatter of bucket {i}")
            self.chunks[i].grad.add_(out)
            buf = self._staging.pop(i)
            self._staged_bytes -= buf.numel() * self._elem

    # --- state ---------------------------------------------------------------------------------------

    def optimizer_state_bytes(self) -> int:
        """Bytes of this replica's AdamW states (its chunks' moments)."""
        return sum(v.numel() * v.element_size() for st in self.optimizer.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.ndim > 0)

    def consolidated_state(self, to: int, group: dist.ProcessGroup | None = None,
                           timeout: timedelta | None = None) -> dict[nn.Parameter, dict[str, torch.Tensor]] | None:
        """The whole AdamW state per parameter (`step`, `exp_avg`, `exp_avg_sq`, as torch.optim.AdamW keeps
        it), gathered on replica `to` (None on the others, and everywhere before the first step). Every
        replica of the group must call it. `group`: another group of the same replicas in the same ranks (a
        fresh one where the stage's own may hold an abandoned collective), each wait bounded by `timeout`."""
        if not 0 <= to < self.world:
            raise ValueError(f"replica {to} is outside a group of {self.world}")
        own = (self.group, self.timeout)
        if group is not None:
            self.group, self.timeout = group, timeout or self.timeout
        try:
            return self._consolidated(to)
        finally:
            self.group, self.timeout = own

    def _consolidated(self, to: int) -> dict[nn.Parameter, dict[str, torch.Tensor]] | None:
        stepped = torch.tensor([1.0 if self.optimizer.state else 0.0], device=self.flat.device)
        if self.world > 1:
            self._wait(self.group.allreduce([stepped]), "optimizer state check")
        if stepped.item() < self.world:
            return None  # no step yet (on some replica): nothing to save
        out: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        step = self.optimizer.state[self.chunks[0]]["step"].detach().cpu().clone()
        for i, (b, c) in enumerate(zip(self.buckets, self.chunks)):
            full: dict[str, torch.Tensor] = {}
            for key in ("exp_avg", "exp_avg_sq"):
                mine = self.optimizer.state[c][key]
                if self.world > 1:
                    parts = [torch.empty_like(mine) for _ in range(self.world)] if self.rank == to else []
                    opts = dist.GatherOptions()
                    opts.rootRank = to
                    self._wait(self.group.gather([parts] if self.rank == to else [], [mine], opts),
                               f"optimizer state gather of bucket {i}")
                else:
                    parts = [mine]
                if self.rank == to:
                    full[key] = torch.cat(parts)
            if self.rank == to:
                for p, off in zip(b.params, b.offsets):
                    n, local = self._numel[id(p)], _storage(p)  # a DTensor's state is of its local shard
                    out[p] = {"step": step.clone(),
                              **{k: v[off:off + n].view_as(local).detach().cpu().clone() for k, v in full.items()}}
        return out if self.rank == to else None

    def load_param_states(self, states: Mapping[nn.Parameter, Mapping[str, torch.Tensor]]) -> None:
        """Keep the owned chunks of whole per-parameter AdamW states (every parameter's, or none)."""
        if not states:
            return
        missing = [i for i, p in enumerate(self.params) if p not in states]
        if missing:
            raise ValueError(f"AdamW state is given for {len(states)} of the stage's {len(self.params)} parameters; "
                             "load all of them or none")
        step = next(iter(states.values()))["step"]
        for b, c in zip(self.buckets, self.chunks):
            st: dict[str, torch.Tensor] = {"step": torch.as_tensor(step).detach().clone().float().cpu()}
            for key in ("exp_avg", "exp_avg_sq"):
                whole = torch.zeros(b.size, dtype=self.flat.dtype, device=self.flat.device)
                for p, off in zip(b.params, b.offsets):
                    v = states[p][key]
                    if isinstance(v, DTensor):  # a tp shard's state, cut as its parameter is (`TensorParallel.shard`)
                        v = v.to_local()
                    whole[off:off + self._numel[id(p)]].copy_(v.reshape(-1))
                a = self.rank * b.chunk
                st[key] = whole[a:a + b.chunk].clone()
            self.optimizer.state[c] = st

    @classmethod
    def from_adamw(cls, adamw: torch.optim.Optimizer, group: dist.ProcessGroup, config: ZeroConfig,
                   timeout: timedelta = timedelta(seconds=60), *, count_replicated: bool = True) -> "ZeroOptimizer":
        """Shard a whole AdamW (fresh, or with states loaded from a checkpoint) over the group; the AdamW's
        states are released."""
        params = [p for g in adamw.param_groups for p in g["params"]]
        states = {p: dict(adamw.state[p]) for p in params if adamw.state.get(p)}
        adamw.state.clear()
        zero = cls(params, group, config, timeout, count_replicated=count_replicated)
        zero.load_param_states(states)
        return zero

    def close(self) -> None:
        """Remove ZeRO-2's gradient hooks (the parameters then train with plain AdamW again)."""
        if self.config.stage == 2:
            for h in self._hooks:
                h.remove()
            self._hooks = []

    def _wait(self, work, what: str) -> None:
        try:  # a collective this replica waits on ends when a newer plan arrives (`cancel_collectives_on`)
            wait_collective(work, self.timeout, f"ZeRO-{self.config.stage} {what} over {self.world} replicas")
        except CollectiveError:
            raise
        except RuntimeError as e:
            raise CollectiveError(f"ZeRO-{self.config.stage} {what} over {self.world} replicas failed or timed out "
                                  f"after {self.timeout}: {e}") from e
