"""Data parallelism within a stage: the replicas of one stage average their gradients.

`GradientAverager(group)` all-reduces the gradients of a stage's parameters over a torch.distributed
process group (gloo on CPU, NCCL on CUDA) in flat buckets, with a timeout on every collective. The
group spans the replicas of one stage; how it was made is the caller's business:

- separate processes: `init_distributed(...)` then `torch.distributed.new_group(ranks, timeout=...)`;
- threads of one process (tests): `gloo_group(store, prefix, rank, size, timeout)` over a shared
  `TCPStore(port=0)` or `HashStore`, which needs no process-global state.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names it and the group size."""


@dataclass(frozen=True, kw_only=True)
class DataParallelConfig:
    """How a stage's replicas average gradients."""

    bucket_bytes: int = 25 * 2**20
    """Largest flat buffer reduced in one all-reduce; bigger buckets mean fewer, larger collectives."""

    def __post_init__(self) -> None:
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")


class GradientAverager:
    """Averages the gradients of parameters across the `group.size()` replicas of a stage."""

    def __init__(self, group: dist.ProcessGroup, *, config: DataParallelConfig | None = None):
        self.group = group
        self.config = config or DataParallelConfig()

    @property
    def world_size(self) -> int:
        return self.group.size()

    def average_(self, params: Iterable[nn.Parameter], timeout: timedelta) -> None:
        """Replace each parameter's gradient by its mean over the replicas (missing grads count as 0)."""
        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.world_size == 1:
            return
        for bucket in self._buckets(params):
            grads = [p.grad for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])  # type: ignore[union-attr]
            self._all_reduce(flat, timeout)
            flat.div_(self.world_size)
            offset = 0
            for g in grads:
                n = g.numel()  # type: ignore[union-attr]
                g.copy_(flat[offset:offset + n].view_as(g))  # type: ignore[union-attr]
                offset += n

    def _buckets(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        buckets: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        size = 0
        key = None
        for p in params:
            nbytes = p.numel() * p.element_size()
            k = (p.dtype, p.device)
            if current and (size + nbytes > self.config.bucket_bytes or k != key):
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
            key = k
        if current:
            buckets.append(current)
        return buckets

    def _all_reduce(self, t: torch.Tensor, timeout: timedelta) -> None:
        work = self.group.allreduce([t])
        try:
            work.wait(timeout)
        except RuntimeError as e:
            raise CollectiveError(f"gradient all-reduce over {self.world_size} replicas failed or timed out "
                                  f"after {timeout}: {e}") from e


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free now (for an `init_method=tcp://host:port` rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_distributed(*, rank: int, world_size: int, init_method: str, timeout: timedelta,
                     backend: str | None = None) -> None:
    """Join the process-global torch.distributed world (gloo on CPU, NCCL when CUDA is available)."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timeout)


def gloo_group(store: dist.Store, prefix: str, *, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A gloo process group of `size` members named `prefix` over `store`, without the global world.

    Lets several ranks live in one process as threads; each member calls it with the same prefix.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a group of {size}")
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timeout)
