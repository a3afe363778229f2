"""Data parallelism within a stage: the replicas of one stage average their gradients.

`GradientAverager(group)` all-reduces the gradients of a stage's parameters over a torch.distributed
process group (gloo on CPU, NCCL on CUDA) in flat buckets, with a timeout on every collective. The
group spans the replicas of one stage; how it was made is the caller's business:

- separate processes: `init_distributed(...)` then `torch.distributed.new_group(ranks, timeout=...)`;
- threads of one process (tests): `gloo_group(store, prefix, rank, size, timeout)` over a shared
  `TCPStore(port=0)` or `HashStore`, which needs no process-global state.

Every wait on a collective goes through `wait_collective`: inside `cancel_collectives_on(event)` a wait ends as
soon as the event is set (a newer plan arrived), instead of waiting out its timeout on a peer that will never
come. gloo cannot abort an operation in flight, and destroying its group blocks until the operation times out,
so a run that abandons a collective hands its groups to `release_later`, which drops them on a thread of its own
once their timeout has passed.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from atoll.types import CollectiveStats


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names it and the group size."""


class CollectiveCancelled(CollectiveError):
    """A collective was abandoned because the plan it belonged to was superseded."""


_cancel = threading.local()


@contextmanager
def cancel_collectives_on(event: threading.Event) -> Iterator[None]:
    """Within the block, `wait_collective` on this thread ends (CollectiveCancelled) once `event` is set."""
    outer = getattr(_cancel, "event", None)
    _cancel.event = event
    try:
        yield
    finally:
        _cancel.event = outer


def cancel_event() -> threading.Event | None:
    """The event `cancel_collectives_on` set for this thread (None outside it): waits that are not collectives
    (the resume agreement) end on it too."""
    return getattr(_cancel, "event", None)


CANCEL_POLL_S = 0.05
"""How often a wait looks at its cancel event; the wait itself wakes the moment the collective completes."""


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")


def collective_failed(what: str, started: float, timeout: timedelta, error: BaseException) -> str:
    """A collective's failure as one line: how long it ran (time.monotonic() since `started`) against its limit,
    and the backend's reason without its source-file prefix or further lines ("failed after 0.8 s (limit 120 s):
    Connection closed by peer [10.0.0.2]:41234")."""
    elapsed = time.monotonic() - started
    how = "timed out" if elapsed >= 0.99 * timeout.total_seconds() else "failed"
    return f"{what} {how} after {elapsed:.1f} s (limit {timeout.total_seconds():g} s): {backend_reason(error)}"


_BACKEND_ADVICE = (" This may indicate", " Check the logs of the remote worker")
"""Where gloo's and NCCL's general advice starts in their messages (cut: the run's own line says what failed)."""


def backend_reason(error: BaseException) -> str:
    """A torch.distributed backend's error as one line: its first, without the source-file prefix or the general
    advice that follows ("Connection closed by peer [10.0.0.2]:41234")."""
    lines = str(error).strip().splitlines()
    reason = _SOURCE_PREFIX.sub("", lines[0]) if lines else type(error).__name__
    for advice in _BACKEND_ADVICE:
        reason = reason.split(advice, 1)[0]
    return reason.rstrip(" .") or type(error).__name__


def wait_collective(work: dist.Work, timeout: timedelta, what: str) -> None:
    """Wait for `work` at most `timeout`, and raise what it raised. Inside `cancel_collectives_on(event)` the wait
    ends as soon as `event` is set: CollectiveCancelled, the operation left to its group's own timeout.

    An operation without a future (gloo's reduce-scatter runs inside `wait()`) is waited for on a thread of its
    own, so that it can be abandoned too: that thread ends when the operation does, or at its timeout."""
    event: threading.Event | None = getattr(_cancel, "event", None)
    if event is None:
        work.wait(timeout)
        return
    done = threading.Event()
    failed: list[BaseException] = []
    try:
        work.get_future().add_done_callback(lambda _: done.set())
        waiter = None
    except RuntimeError:
        def wait_here() -> None:
            try:
                work.wait(timeout)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                failed.append(e)
            finally:
                done.set()

        waiter = threading.Thread(target=wait_here, name=f"wait: {what}", daemon=True)
        waiter.start()
    wait_done(done, timeout, what)
    if waiter is not None:
        if failed:
            raise failed[0]
        return
    work.wait(timeout)  # done: returns at once, or raises the collective's error


def wait_done(done: threading.Event, timeout: timedelta, what: str) -> None:
    """Wait at most `timeout` for `done`, a collective's completion; inside `cancel_collectives_on(event)` the wait
    ends (CollectiveCancelled) as soon as `event` is set."""
    event: threading.Event | None = getattr(_cancel, "event", None)
    deadline = time.monotonic() + timeout.total_seconds()
    while not done.is_set():
        if event is not None and event.is_set():
            raise CollectiveCancelled(f"{what} abandoned: the plan it belongs to was superseded")
        left = deadline - time.monotonic()
        if left <= 0:
            raise CollectiveError(f"{what} timed out after {timeout}")
        done.wait(min(CANCEL_POLL_S, left))


def arrive(store: dist.Store, *, rank: int, size: int, timeout: timedelta,
           gone: Callable[[], str | None] | None = None) -> None:
    """Say that `rank` has come to the group meeting at `store` and wait until all `size` ranks have, at most
    `timeout`. Inside `cancel_collectives_on(event)` the wait ends (CollectiveCancelled) as soon as `event` is set:
    building a process group waits for its peers in C++ and cannot be interrupted, so the group is built only once
    every rank is known to be there. `gone`: says why a peer will not come (its process is gone), else None;
    asked once a second while waiting and once more when every rank has arrived (a rank that arrived and then
    died would leave the group's constructor waiting for it until `timeout`)."""
    store.set(f"arrived/{rank}", b"1")
    keys = [f"arrived/{r}" for r in range(size)]
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.01
    asked = time.monotonic()

    def ask() -> None:
        reason = gone() if gone is not None else None
        if reason is not None:
            raise CollectiveError(f"the rendezvous was abandoned: {reason}")

    while not store.check(keys):
        if gone is not None and time.monotonic() - asked >= 1.0:
            ask()
            asked = time.monotonic()
        event: threading.Event | None = getattr(_cancel, "event", None)
        if event is not None and event.is_set():
            raise CollectiveCancelled("the rendezvous was abandoned: the plan it belongs to was superseded")
        if time.monotonic() >= deadline:
            missing = [r for r in range(size) if not store.check([f"arrived/{r}"])]
            raise CollectiveError(f"ranks {missing} of a group of {size} did not come to the rendezvous within "
                                  f"{timeout}")
        time.sleep(pause)
        pause = min(2 * pause, 0.2)
    ask()


def device_identity(device: torch.device) -> str:
    """What tells this rank's device apart from other ranks' in a group: the host and, on CUDA, the GPU's UUID
    (the same GPU under any CUDA_VISIBLE_DEVICES numbering), else its index; on a CPU the host alone."""
    host = socket.gethostname()
    if device.type != "cuda":
        return f"{host}/{device.type}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"{host}/cuda/{uuid if uuid is not None else index}"


def collective_backend(device_type: str, devices: list[str], *, nccl_available: bool) -> tuple[str, str]:
    """The torch.distributed backend of a group whose rank r computes on `devices[r]` (`device_identity`), and
    why. NCCL where every rank has a CUDA device of its own; gloo on CPUs, and on CUDA where two ranks share one
    GPU (NCCL refuses a group with two ranks on one device) or this torch has no NCCL."""
    if device_type != "cuda":
        return "gloo", f"{device_type} tensors"
    if not nccl_available:
        return "gloo", "this torch has no NCCL"
    first: dict[str, int] = {}
    for r, d in enumerate(devices):
        if d in first:
            return "gloo", (f"ranks {first[d]} and {r} share one GPU ({d}), and NCCL needs a device per rank: "
                            f"gloo carries the group's collectives")
        first[d] = r
    return "nccl", f"{len(devices)} ranks on {len(devices)} GPUs"


def arrive_on_devices(store: dist.Store, *, rank: int, size: int, device: torch.device, timeout: timedelta,
                      gone: Callable[[], str | None] | None = None) -> tuple[str, str]:
    """`arrive`, telling the group which device this rank computes on; returns the group's backend and why
    (`collective_backend`), the same on every rank. On a CPU nothing is exchanged: gloo."""
    if device.type == "cuda":  # before arriving: once every rank has arrived, every rank's device is there
        store.set(f"device/{rank}", device_identity(device).encode())
    arrive(store, rank=rank, size=size, timeout=timeout, gone=gone)
    devices = [store.get(f"device/{r}").decode() for r in range(size)] if device.type == "cuda" else []
    return collective_backend(device.type, devices, nccl_available=dist.is_nccl_available())


def release_later(objects: list[object], after: timedelta) -> None:
    """Keep `objects` (process groups, and what holds them) alive for `after`, then drop them on a thread of
    their own: destroying a gloo group with an operation in flight blocks until that operation times out, which
    must not hold up the next plan."""
    held = list(objects)
    objects.clear()

    def drop() -> None:
        time.sleep(after.total_seconds())
        held.clear()

    threading.Thread(target=drop, name="atoll-release-groups", daemon=True).start()


@dataclass(frozen=True, kw_only=True)
class DataParallelConfig:
    """How a stage's replicas average gradients."""

    bucket_bytes: int = 25 * 2**20
    """Largest flat buffer reduced in one all-reduce; bigger buckets mean fewer, larger collectives."""

    def __post_init__(self) -> None:
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")


class CollectiveTimer:
    """The collectives a node ran since it was last asked, timed from call to completion, per kind, size and group
    size (what the coordinator's network fit reads, `atoll.coordinator.netfit`). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[tuple[str, int, int], tuple[float, int]] = {}

    def add(self, kind: str, nbytes: int, participants: int, seconds: float) -> None:
        key = (kind, nbytes, participants)
        with self._lock:
            s, n = self._totals.get(key, (0.0, 0))
            self._totals[key] = (s + seconds, n + 1)

    def take(self) -> list[CollectiveStats]:
        with self._lock:
            got, self._totals = self._totals, {}
        return [CollectiveStats(kind=k, bytes=b, participants=p, seconds=s, count=n)
                for (k, b, p), (s, n) in sorted(got.items())]


class GradientAverager:
    """Averages the gradients of parameters across the `group.size()` replicas of a stage."""

    def __init__(self, group: dist.ProcessGroup, *, config: DataParallelConfig | None = None,
                 timer: CollectiveTimer | None = None):
        self.group = group
        self.config = config or DataParallelConfig()
        self.timer = timer

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
        start = time.perf_counter()
        work = self.group.allreduce([t])
        try:
            wait_collective(work, timeout, f"gradient all-reduce over {self.world_size} replicas")
            if self.timer is not None:
                self.timer.add("all_reduce", t.numel() * t.element_size(), self.world_size,
                               time.perf_counter() - start)
        except CollectiveCancelled:
            raise
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
