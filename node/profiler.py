"""What a node measures of itself before joining: its device, memory, CPUs, and how fast it runs the job's
own layers (embedding, one block, head) forward and backward at a few micro-batch sizes, plus one AdamW
step over a block's parameters. Short by design: the tiny job profiles in well under a second or two.

A node process drives one device (`device_count` records how many the machine has), so the timings are one
device's. They are not timed under tensor parallelism: that takes several processes on one machine. Where the
planner plans tp (cluster files, and live nodes of one machine under `[cluster] host_tp`) it derives it from
one device's timings and the links measured between the machine's nodes, each all-reduce priced by its size.
"""

from __future__ import annotations

import math
import platform
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import psutil
import torch

from atoll import __version__
from atoll.job import JobSpec
from atoll.node.model import build_layer, lm_loss
from atoll.node.precision import autocast
from atoll.node.wgrad import WeightGradients, attach
from atoll.types import MAX_SPLIT_OVERHEAD, LayerTiming, NodeProfile


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """How much measuring to do."""

    micro_batches: tuple[int, ...] | None = None
    """Micro-batch sizes to time; None: half, one and two times the job's micro_batch (distinct, >= 1)."""
    repeats: int = 7
    """Timed runs per (layer, micro-batch); the median counts. One untimed warm-up run precedes them."""
    budget: timedelta = timedelta(seconds=3)
    """Stop repeating once the profile has taken this long (every size is still timed at least once)."""

    def __post_init__(self) -> None:
        if self.micro_batches is not None and (not self.micro_batches or min(self.micro_batches) < 1):
            raise ValueError(f"micro_batches must be positive sizes, got {self.micro_batches}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.budget <= timedelta(0):
            raise ValueError(f"budget must be positive, got {self.budget}")


def parse_device(device: str) -> torch.device:
    """`cpu`, `cuda` or `cuda:N`, checked against what this machine has."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: this machine has no CUDA device; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: there are {torch.cuda.device_count()} CUDA devices")
    elif dev.type != "cpu":
        raise ValueError(f"--device {device}: use cpu, cuda or cuda:N")
    return dev


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def describe_device(dev: torch.device) -> NodeProfile:
    """Device kind, name, count and memory; no timings."""
    cpu_count = psutil.cpu_count(logical=True) or 1
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        count = torch.cuda.device_count() if dev.index is None else 1
        name = torch.cuda.get_device_name(index)
    else:
        vm = psutil.virtual_memory()
        free, total, count, name = vm.available, vm.total, 1, _cpu_name()
    return NodeProfile(hostname=socket.gethostname(), device_kind=dev.type, device_name=name, device_count=count,
                       memory_total_bytes=int(total), memory_free_bytes=int(min(free, total)), cpu_count=cpu_count,
                       torch_version=torch.__version__, atoll_version=__version__)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def cpu_share(proc: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> float:
    """The cores this process may use under its cgroup's CPU quota (cgroup v1 `cpu.cfs_quota_us` over
    `cpu.cfs_period_us`, or v2 `cpu.max`), or inf when it has none (or it cannot be read)."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return math.inf
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        try:
            if "cpu" in controllers.split(","):  # v1
                for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                    base = root / mount / rel
                    if (base / "cpu.cfs_quota_us").is_file():
                        quota = int((base / "cpu.cfs_quota_us").read_text())
                        period = int((base / "cpu.cfs_period_us").read_text())
                        return quota / period if quota > 0 and period > 0 else math.inf
            elif controllers == "" and (root / rel / "cpu.max").is_file():  # v2
                quota, period = (root / rel / "cpu.max").read_text().split()[:2]
                return int(quota) / int(period) if quota != "max" and int(period) > 0 else math.inf
        except (OSError, ValueError):
            return math.inf
    return math.inf


def _forward(layer: torch.nn.Module, x: torch.Tensor, precision: str, dev: torch.device) -> torch.Tensor:
    with autocast(precision, dev):
        return layer(x)


def _forward_as_run(layer: torch.nn.Module, kind: str, x: torch.Tensor, ids: torch.Tensor, precision: str,
                    dev: torch.device) -> torch.Tensor:
    """The layer's forward as a stage runs it: the head's includes the loss (its logits cast to fp32 and the
    cross entropy over the vocabulary, which the last stage computes in its forward action: with a large
    vocabulary a sizeable part of it)."""
    out = _forward(layer, x, precision, dev)
    if kind != "head":
        return out
    with autocast(precision, dev):
        return lm_loss(out, ids)


def _start_of_backward(out: torch.Tensor) -> torch.Tensor:
    """What a timed backward starts from: the head's loss, or a stand-in scalar of another layer's output (its
    mean square, next to nothing beside the layer's backward)."""
    return out if out.dim() == 0 else out.float().square().mean()


def _timed(dev: torch.device, fn: Callable[[], None], share: float = math.inf) -> float:
    """Seconds `fn` takes on `dev`.

    A single-threaded CPU node counts its thread's CPU time: nodes that share a machine profile at the
    same moment, and wall time would charge each with the others' work (the plan would then predict
    steps several times slower than they run). Otherwise wall time, synchronised on GPUs.
    """
    if dev.type == "cpu" and torch.get_num_threads() == 1:
        t0 = time.thread_time()
        fn()
        # under a CPU quota below one core the thread gets only that share of each second
        return (time.thread_time() - t0) / min(1.0, share)
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t0


def _split_backward(layer: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor, kind: str, precision: str,
                    dev: torch.device, share: float) -> tuple[float, float]:
    """Seconds of the layer's backward as a zero-bubble stage runs it: (input gradients with the weight-gradient
    products deferred, then those products: `atoll.node.wgrad`)."""
    sink = WeightGradients()
    attach(layer, sink)
    try:
        x = x.detach().requires_grad_(x.is_floating_point())
        b_in = _timed(dev, _start_of_backward(_forward_as_run(layer, kind, x, ids, precision, dev)).backward, share)
        pending = sink.take()
        w = _timed(dev, lambda: WeightGradients.apply(pending), share)
    finally:
        attach(layer, None)
        layer.zero_grad(set_to_none=True)
    return b_in, w


def profile_node(job: JobSpec, device: str = "cpu", options: ProfileOptions | None = None) -> NodeProfile:
    """Measure this node on `job`'s layers; returns the profile to join with."""
    options = options or ProfileOptions()
    share = cpu_share()
    dev = parse_device(device)
    if dev.type == "cuda":
        # fp32 matmuls on TF32 tensor cores where the GPU has them, as the planner's catalog assumes; the
        # setting is process-wide, so the node trains as it was measured
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    profile = describe_device(dev)
    cfg, seq = job.model, job.train.seq_len
    # as the stages train: fp32 weights (the master weights), forwards under the job's autocast (bf16, fp16)
    dtype = torch.float32
    precision = job.train.dtype
    mb = job.train.micro_batch
    sizes = options.micro_batches or tuple(sorted({max(1, mb // 2), mb, 2 * mb}))
    deadline = time.perf_counter() + options.budget.total_seconds()
    # a tied head runs a linear over the vocabulary with the shared weight and computes that weight's gradient in
    # its backward, not deferred, whether it borrows the embedding's weight or holds its own copy: the copy's head
    # times both (built alone, the borrowing head would have no weight)
    layers = {kind: build_layer(cfg, index, tied_copy=kind == "head" and cfg.tied_head).to(dev, dtype)
              for kind, index in (("embedding", 0), ("block", 1), ("head", cfg.n_layers + 1))}
    g = torch.Generator(device="cpu").manual_seed(0)

    inputs = {}
    for b in sizes:
        ids = torch.randint(0, cfg.vocab_size, (b, seq), generator=g).to(dev)
        inputs[b] = (ids, torch.randn(b, seq, cfg.d_model, generator=g).to(dev, dtype))
    # round by round, every (size, layer) once a round: a moment the machine runs slow (another process, a
    # neighbour on the host) falls on every size and layer alike instead of on whichever was being timed, so
    # the ratios between them hold and each median spans the whole profile, not a tenth of a second of it
    fwd: dict[tuple[int, str], list[float]] = {(b, k): [] for b in sizes for k in layers}
    bwd: dict[tuple[int, str], list[float]] = {(b, k): [] for b in sizes for k in layers}
    # the backward as a zero-bubble stage splits it: the input gradients first (B), the deferred weight-gradient
    # products later (W); their share sets how much of the pipeline's fill and drain the deferral fills
    deferrable = {k for k, layer in layers.items() if attach(layer, None)}
    split: dict[tuple[int, str], list[tuple[float, float]]] = {(b, k): [] for b in sizes for k in deferrable}
    for r in range(options.repeats + 1):
        for b in sizes:
            ids, hidden = inputs[b]
            for kind, layer in layers.items():
                x = ids if kind == "embedding" else hidden.detach().requires_grad_(True)
                out: list[torch.Tensor] = []
                f = _timed(dev, lambda: out.append(_forward_as_run(layer, kind, x, ids, precision, dev)), share)
                bw = _timed(dev, _start_of_backward(out[0]).backward, share)
                layer.zero_grad(set_to_none=True)
                if r > 0:  # the first round warms caches and kernels
                    fwd[b, kind].append(f)
                    bwd[b, kind].append(bw)
                if kind in deferrable:
                    split[b, kind].append(_split_backward(layer, x, ids, kind, precision, dev, share))
        if r >= 1 and time.perf_counter() > deadline:
            break
    for b in sizes:
        for kind in layers:
            fraction = overhead = 0.0
            backward = statistics.median(bwd[b, kind])
            if kind in deferrable:
                parts = split[b, kind][1:]  # the first round warms the split path
                b_in, w = (statistics.median(v) for v in zip(*parts))
                fraction = w / (b_in + w) if b_in + w > 0 else 0.0
                # two passes over the layer's graph cost more than one (a second walk, the products' inputs read
                # again): what a deferring stage pays on top of its backward. Each round times both back to back,
                # so the median of the per-round ratios is steadier than a ratio of medians
                ratios = [(x + y) / f for (x, y), f in zip(parts, bwd[b, kind]) if f > 0]
                overhead = statistics.median(ratios) - 1 if ratios else 0.0
            profile.layer_timings.append(LayerTiming(layer_kind=kind, micro_batch=b, seq_len=seq,
                                                     forward_seconds=statistics.median(fwd[b, kind]),
                                                     backward_seconds=backward,
                                                     weight_fraction=min(fraction, 0.95),
                                                     split_overhead=min(max(overhead, 0.0), MAX_SPLIT_OVERHEAD / 2)))

    block = layers["block"]
    for p in block.parameters():
        p.grad = torch.zeros_like(p)
    # as the stages step (`atoll.node.stage.build_optimizer`: one tensor at a time, not foreach)
    opt = torch.optim.AdamW(block.parameters(), lr=job.train.lr, weight_decay=job.train.weight_decay, foreach=False)
    opt.step()  # allocates the moments
    steps = [_timed(dev, opt.step, share) for _ in range(options.repeats)]
    profile.optimizer_step_seconds = statistics.median(steps)
    return profile


PROFILE_CACHE = "profile.json"
"""The newest profile of this node, in its state dir (`cached_profile`, `save_profile`)."""
PROFILE_CACHE_MAX_AGE = timedelta(hours=24)


def profile_key(job: JobSpec, device: str, options: ProfileOptions) -> str:
    """What a profile measured, as a digest: the job's layers, sequence, micro-batch and precision, the device,
    the CPU quota and cores, the library versions and the machine. A profile is reused only where this matches."""
    import hashlib
    import json

    dev = parse_device(device)
    what = {"model": job.model.to_dict(), "seq_len": job.train.seq_len, "micro_batch": job.train.micro_batch,
            "precision": str(job.train.dtype), "sizes": list(options.micro_batches or ()), "device": str(dev),
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor(),
            "cpu_share": cpu_share(), "cpus": psutil.cpu_count(logical=True), "torch": torch.__version__,
            "atoll": __version__, "host": socket.gethostname()}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def cached_profile(state_dir: Path, key: str, now: float | None = None,
                   max_age: timedelta = PROFILE_CACHE_MAX_AGE) -> NodeProfile | None:
    """The profile this node saved under `state_dir` when it measured the same thing (`profile_key`) less than
    `max_age` ago: a node restarted on the same machine joins without measuring again (seconds on a slow device,
    all of them idle for its region). None where there is none, it does not match, or it cannot be read."""
    import dataclasses
    import json

    try:
        saved = json.loads((state_dir / PROFILE_CACHE).read_text())
        if saved.get("key") != key or (now if now is not None else time.time()) - float(saved["saved_unix"]) \
                > max_age.total_seconds():
            return None
        fields = dict(saved["profile"])
        fields["layer_timings"] = [LayerTiming(**t) for t in fields.get("layer_timings", [])]
        names = {f.name for f in dataclasses.fields(NodeProfile)}
        profile = NodeProfile(**{k: v for k, v in fields.items() if k in names})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not profile.layer_timings or any(not (t.forward_seconds > 0 and t.backward_seconds > 0)
                                        for t in profile.layer_timings):
        return None
    return profile


def save_profile(state_dir: Path, key: str, profile: NodeProfile, now: float | None = None) -> None:
    """Keep `profile` for `cached_profile` (written atomically)."""
    import dataclasses
    import json

    from atoll.fsutil import atomic_write_text

    atomic_write_text(state_dir / PROFILE_CACHE, json.dumps(
        {"key": key, "saved_unix": now if now is not None else time.time(),
         "profile": dataclasses.asdict(profile)}, indent=1))
