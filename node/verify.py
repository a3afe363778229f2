"""A stage's work verified by sampling: its data-parallel replicas recompute one another's micro-batches.

The replicas of one stage hold equal weights during a step (the previous step's averaged update, applied alike).
On a sampled step, one replica (the checked one) keeps the input rows of one sampled micro-batch and the output it
sent downstream for them (on a last stage, the logits its loss came from); after the schedule, before the gradients
are averaged, it broadcasts both over the stage's own gloo group, and every other replica runs that micro-batch's
forward again on its own copy of the weights (no gradient) and compares. A mismatch is an offence (kind "verify")
naming the checked replica, handled as the door's are: the step is skipped on every node (+inf gradients through
the average and the norm exchange, `PipelineStage.train_step`), the node reports it with its step, and the
coordinator counts it towards the checked node's quarantine (`atoll.coordinator.quarantine`).

Sampling: step s is checked when a keyed hash of s (BLAKE2b, keyed by the job's seed, which the coordinator's job
file sets and no node chooses) falls in 1/`every` of its range; the same hash picks the micro-batch and the checked
replica, so every replica agrees without a message, and each replica is checked about once in `every` x dp steps.
A member that reads the job file can predict the checked steps; a commitment to every micro-batch's output each
step (so that the choice could come after it) would cost a digest of every activation on every step, which the
3% budget rules out. Against faulty hardware and a stage that perturbs every step, the schedule need not be secret.

Tolerance (`tolerance`): two honest computations of the same rows with the same weights differ only by rounding.
In fp32 the output's norm-wise relative error of one computation is about sqrt(n) x eps for reductions of length n
(random-walk rounding), compounded over a stage's few layers; we allow 2^8 x eps (3.1e-5 in fp32), enough for
reductions of 2^16 in a different order (another kernel or device) and still 300x below the 1% noise to catch. In
bf16/fp16 the matmuls accumulate in fp32 and the output is rounded once to the compute dtype, at most eps/2
relative per element, so two honest results differ by at most eps in norm (7.8e-3 in bf16, 9.8e-4 in fp16):
tolerance eps x ||y||, below the 1% noise in both. An absolute floor of eps x sqrt(numel) x 1e-6 keeps an all-zero
output from being judged at 0. Each figure is computed from `torch.finfo(dtype).eps` and the tensor's own norm.

Detection: a replica whose sent outputs differ from its weights' by more than the tolerance (1% noise, a layer's
sign flipped, weights a step stale) is caught at every check of it: per check, rate 1 (tests/test_verify.py); per
N steps with dp replicas, 1 - (1 - 1/(every x dp))^N, with every=8 and dp=2: 95% within 47 steps, and the
quarantine (3 offences) after 48 steps on average. Limits: with two replicas, a replica whose *weights* are wrong
(sign flip, stale) also recomputes its peer's rows wrongly and names it; the coordinator cannot tell which of two
is right, and both are named (three replicas make the honest majority visible in status). The checked node reports
its own output: a node that sends one tensor and reports another is not caught here (the receiver's door sees
only norms).

Cost: one forward of one micro-batch's rows on each other replica per checked step, plus the broadcast of that
micro-batch's input and output: about 1/(3m) of a step of m micro-batches (a forward is about a third of a forward
and backward) per checked step, 1/`every` of that on average. Measured on the tiny job (two stages of two replicas,
4 micro-batches of 2 rows each a replica, two loaded CPU cores, every step checked): 17 ms a check against a
median step of 223 ms, 7.7% of a checked step (the check's time includes the wait for the checked replica's
broadcast), so 1.0% of a step at `every` = 8.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from atoll.node.dataparallel import wait_collective
from atoll.node.door import Offence

VERIFY = "verify"
VERIFY_EVERY = 8
"""Steps between checks on average (see the detection and cost figures above)."""
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.float64]
_HEADER = 12  # int64s: per tensor (x, y) its dtype code, ndim and up to 4 dims


def tolerance(dtype: torch.dtype, norm: float, numel: int) -> float:
    """The largest norm of the difference between two honest computations of an output of `norm` computed in
    `dtype` (see the module docstring for why)."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    rel = 256 * eps if dtype in (torch.float32, torch.float64) else eps
    return rel * norm + eps * math.sqrt(max(numel, 1)) * 1e-6


@dataclass(frozen=True)
class Sample:
    """Which replica and micro-batch a checked step checks."""

    replica: int
    micro_batch: int


def sample(seed: int, step: int, *, every: int, replicas: int, micro_batches: int) -> Sample | None:
    """The check of `step` (None: not checked), the same on every replica: a BLAKE2b of the step keyed by the job's
    seed."""
    if every < 1 or replicas < 2 or micro_batches < 1:
        return None
    key = hashlib.blake2b(f"atoll-verify-{seed}".encode(), digest_size=32).digest()
    u = int.from_bytes(hashlib.blake2b(step.to_bytes(8, "big", signed=True), key=key, digest_size=8).digest(), "big")
    if u % every:
        return None
    u //= every
    return Sample(replica=(u // micro_batches) % replicas, micro_batch=u % micro_batches)


class StageVerifier:
    """The replicas of one stage checking one another (`every` > 0), over `group` (gloo, CPU tensors) whose rank
    r is `nodes[r]`."""

    def __init__(self, group: dist.ProcessGroup, *, nodes: list[str], rank: int, seed: int, every: int,
                 micro_batches: int, dtype: torch.dtype, timeout: timedelta):
        if every < 1:
            raise ValueError(f"verify every {every} steps: must be >= 1 (0 turns verification off: pass no verifier)")
        self.group, self.nodes, self.rank, self.seed = group, nodes, rank, seed
        self.every, self.micro_batches, self.dtype, self.timeout = every, micro_batches, dtype, timeout
        self.kept: tuple[torch.Tensor, torch.Tensor] | None = None
        self.checks = 0
        """Checks this replica ran on another's micro-batch."""
        self.check_seconds = 0.0
        """Their time (recompute and exchange)."""

    def wanted(self, step: int) -> int | None:
        """The micro-batch of `step` this replica must keep (None: none)."""
        s = sample(self.seed, step, every=self.every, replicas=len(self.nodes), micro_batches=self.micro_batches)
        return s.micro_batch if s is not None and s.replica == self.rank else None

    def keep(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The checked micro-batch's input rows and the output this replica sent for them."""
        self.kept = (x.detach().to("cpu", copy=True).contiguous(), y.detach().to("cpu", torch.float32).contiguous())

    def check(self, step: int, module: nn.Module, autocast: Callable[[], contextlib.AbstractContextManager[None]]
              ) -> list[Offence]:
        """Run `step`'s check (a collective of every replica): the offence naming the checked replica when this
        replica's recomputation of its micro-batch differs beyond `tolerance`."""
        s = sample(self.seed, step, every=self.every, replicas=len(self.nodes), micro_batches=self.micro_batches)
        if s is None:
            return []
        t0 = time.perf_counter()
        header = torch.zeros(_HEADER, dtype=torch.int64)
        if s.replica == self.rank:
            if self.kept is None:
                raise RuntimeError(f"step {step}: the checked micro-batch {s.micro_batch} was not kept")
            for j, t in enumerate(self.kept):
                if t.dim() > 4 or t.dtype not in _DTYPES:
                    raise ValueError(f"cannot verify a tensor of shape {tuple(t.shape)} and dtype {t.dtype}")
                header[6 * j] = _DTYPES.index(t.dtype)
                header[6 * j + 1] = t.dim()
                header[6 * j + 2:6 * j + 2 + t.dim()] = torch.tensor(t.shape)
        self._broadcast(header, s.replica, step)
        if s.replica == self.rank:
            x, y = self.kept  # type: ignore[misc]
        else:
            x, y = (torch.empty([int(d) for d in header[6 * j + 2:6 * j + 2 + int(header[6 * j + 1])]],
                                dtype=_DTYPES[int(header[6 * j])]) for j in (0, 1))
        self._broadcast(x, s.replica, step)
        self._broadcast(y, s.replica, step)
        self.kept = None
        if s.replica == self.rank:
            return []
        device = next(module.parameters()).device
        with torch.no_grad(), autocast():
            again = module(x.to(device))
        diff = float(torch.linalg.vector_norm(again.float().cpu() - y))
        norm = float(torch.linalg.vector_norm(y))
        bound = tolerance(self.dtype, norm, y.numel())
        self.checks += 1
        self.check_seconds += time.perf_counter() - t0
        if diff <= bound:  # (a NaN difference is no pass)
            return []
        return [Offence(sender=self.nodes[s.replica], step=step, micro_batch=s.micro_batch, direction="forward",
                        kind=VERIFY, norm=diff if math.isfinite(diff) else math.inf,
                        detail=f"(its output differs from this replica's recomputation by {diff:.3g}, over the "
                               f"tolerance {bound:.3g} of an output of norm {norm:.4g})")]

    def _broadcast(self, t: torch.Tensor, root: int, step: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        wait_collective(self.group.broadcast([t], opts), self.timeout,
                        f"the verification of step {step} over {len(self.nodes)} replicas")
