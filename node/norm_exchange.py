"""Summing one number across the stages of a pipeline (per-stage squared gradient norms).

Global gradient-norm clipping needs the norm of the whole model's gradient while each stage holds only
its own slice; the stages exchange one scalar each (their squared norm), never tensors.

- `LocalNormExchange`: a pipeline of one stage.
- `InProcessNormGroup(n).member(i)`: stages running as threads of one process.
- `DistNormExchange(group)`: stages in separate processes, an all-reduce of one float64 over a
  torch.distributed process group spanning the stages of one pipeline (gloo or NCCL).
- `OncePerStage(exchange, counts=...)`: a group over every replica of every stage of a pipeline (stages
  may differ in width): one replica per stage adds its value, the others add 0, so each stage counts once.
"""

from __future__ import annotations

import math
import threading
import time
from abc import ABC, abstractmethod
from datetime import timedelta

import torch
import torch.distributed as dist

from atoll.node.dataparallel import CollectiveCancelled, collective_failed, wait_collective


class NormExchangeError(RuntimeError):
    """The exchange did not complete in time (a stage died or is stuck); the message says which."""


class NormExchange(ABC):
    """One stage's handle on the exchange of its pipeline."""

    @abstractmethod
    def all_sum(self, value: float, timeout: timedelta) -> float:
        """The sum of `value` over every stage of the pipeline; every stage must call it once per step."""


class LocalNormExchange(NormExchange):
    """The exchange of a single-stage pipeline: the sum is the value itself."""

    def all_sum(self, value: float, timeout: timedelta) -> float:
        return float(value)


class InProcessNormGroup:
    """A reusable barrier that sums one float from each of `size` threads, round after round."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"a norm exchange group needs at least one member, got {size}")
        self.size = size
        self._cond = threading.Condition()
        self._values: list[float | None] = [None] * size
        self._round = 0
        self._result = 0.0

    def member(self, rank: int) -> "InProcessNormExchange":
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a norm exchange group of {self.size}")
        return InProcessNormExchange(self, rank)

    def _all_sum(self, rank: int, value: float, timeout: timedelta) -> float:
        with self._cond:
            if self._values[rank] is not None:
                raise NormExchangeError(f"rank {rank} entered the norm exchange twice in round {self._round}")
            self._values[rank] = float(value)
            my_round = self._round
            if all(v is not None for v in self._values):
                # summed in rank order so every run adds the same floats in the same order
                self._result = sum(v for v in self._values if v is not None)
                self._values = [None] * self.size
                self._round += 1
                self._cond.notify_all()
                return self._result
            if not self._cond.wait_for(lambda: self._round != my_round, timeout.total_seconds()):
                missing = [i for i, v in enumerate(self._values) if v is None]
                self._values[rank] = None
                raise NormExchangeError(f"norm exchange timed out after {timeout}: stage(s) {missing} did not "
                                        "report their gradient norm")
            return self._result


class InProcessNormExchange(NormExchange):
    def __init__(self, group: InProcessNormGroup, rank: int):
        self.group, self.rank = group, rank

    def all_sum(self, value: float, timeout: timedelta) -> float:
        return self.group._all_sum(self.rank, value, timeout)


class DistNormExchange(NormExchange):
    """All-reduce of one float64 over `group`, a process group of the stages of one pipeline.

    `group` is a `torch.distributed.ProcessGroup` (from `dist.new_group(ranks, timeout=...)` or built
    directly, e.g. `ProcessGroupGloo(store, rank, size, timeout)`); `device` is where the scalar lives
    (cuda for NCCL).
    """

    def __init__(self, group: dist.ProcessGroup, *, device: torch.device | str = "cpu"):
        self.group = group
        self.device = torch.device(device)

    def all_sum(self, value: float, timeout: timedelta) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        started = time.monotonic()
        work = self.group.allreduce([t])
        try:
            wait_collective(work, timeout, "norm exchange all-reduce")
        except CollectiveCancelled:
            raise
        except RuntimeError as e:
            raise NormExchangeError(collective_failed("norm exchange all-reduce", started, timeout, e)) from e
        return float(t.item())


class OncePerStage(NormExchange):
    """Sums one value per stage over a group holding every replica of every stage of a pipeline.

    After gradient averaging the replicas of a stage hold the same gradients, hence the same squared norm;
    the replica with `counts` adds it and the others add exactly 0, so the sum counts each stage once and
    is exact whatever the stages' widths. A replica whose value is not finite adds +inf whether it counts or
    not: the flag of a step to skip (`atoll.node.door`) may be raised on one replica alone.
    """

    def __init__(self, exchange: NormExchange, *, counts: bool):
        self.exchange, self.counts = exchange, counts

    def all_sum(self, value: float, timeout: timedelta) -> float:
        value = float(value)
        return self.exchange.all_sum(value if self.counts else 0.0 if math.isfinite(value) else math.inf, timeout)
