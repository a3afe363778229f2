"""GPU check: the CUDA and NCCL paths of atoll, run on one machine with a GPU in one command.

    python -m bench.gpu [--steps 5] [--out DIR]        (or python bench/gpu.py, from any folder)
    python -m bench.gpu --device cpu                   (the same checks on the CPU, the CUDA-only ones skipped)

Where torch sees no CUDA device it prints one line saying why and exits 0. Otherwise, each through the project's
own entry points:
- profile: `atoll.node.profiler.profile_node` on the device (what `atoll node --device cuda` measures before it
  joins): every layer timing positive and finite, the device's kind and memory reported;
- precision: `atoll.node.local.train_local` on the device in fp32, bf16 (autocast) and fp16 (autocast with
  dynamic loss scaling), from the same seed: every loss finite, and bf16's and fp16's loss at the end (mean of
  the last 5 steps) within 3% of fp32's;
- pipeline: a real coordinator (`atoll coordinator`, pinned two-stage plan cut where the model's FLOPs balance)
  and two `atoll node --device cuda` processes on the one GPU (`atoll.launch.localcluster.LocalCluster`),
  trained `--steps` steps: the losses equal one process's (`train_local` on the same device) within 1e-3, and
  the nodes' cross-process groups run over gloo with the reason logged (NCCL refuses two ranks on one device;
  `atoll.node.dataparallel.collective_backend`);
- memory: each stage's peak as the runtime reports it (`StepMetrics.peak_memory_bytes`: on CUDA the allocator's
  peak, `torch.cuda.max_memory_allocated`, reset each step; on a CPU the bytes of the stage's tensors) against
  the planner's cost model for that stage (`DefaultParallelizer.evaluate`, as `bench.memory` compares), the
  plan's `memory_gb_per_device`: within 15%;
- tp and ZeRO: `bench.tp` on the device (tp = 1, tp = 2, tp = 2 x dp = 2 with ZeRO-1, one process per rank,
  rank r on GPU r mod the GPUs: gloo between ranks that share one), its own targets (losses as one process's
  within 1e-4, each rank's share of the stage's state);
- NCCL, where two or more GPUs exist: the pipeline again with its nodes on cuda:0 and cuda:1 (their groups over
  NCCL, said in their logs), and `bench.tp`'s ranks then sit on separate GPUs (NCCL); with one GPU, a line says
  it was skipped.
With `--device cpu` every check that means something on a CPU runs through the same code (profiling, the
precisions under CPU autocast, the two-process pipeline over gloo, memory from the runtime's reported peaks,
tp and ZeRO over gloo) with a smaller model, and the CUDA-only ones are listed as skipped.

Printed: a table (check, figure, target, met), then `targets met: N/M` (skipped checks do not count); the exit
code is 0 when every target is met. The whole run is a target too: under 10 minutes (one H100: about 2).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a path (python bench/gpu.py): imports resolve from the checkout
    sys.path.insert(0, str(ROOT))

WALL_TARGET_S = 600.0
LOSS_RTOL = 1e-3
PRECISION_RTOL = 0.03
MEMORY_TARGET = 0.15
PRECISION_STEPS = {"cuda": 30, "cpu": 20}
"""Steps each precision trains (at least --steps): fewer on a CPU, whose bf16 and fp16 autocast run slowly."""

# the model each device trains: on a GPU large enough that the allocator's own rounding and cuBLAS's workspace
# are a small part of a stage's memory (the 125M shape with a byte-level vocabulary, as bench.memory); on a CPU
# the demo's tiny model, so the run stays short
JOB = """
[job]
name = "gpu-check"
[model]
preset = "{preset}"
{model_extra}
[data]
source = "builtin"
tokenizer = "bytes"
[train]
global_batch = 16
seq_len = {seq}
micro_batch = 4
steps = {steps}
lr = 3e-3
weight_decay = 0.1
warmup = 2
grad_clip = 1.0
precision = "fp32"
seed = 0
[checkpoint]
interval = 0
[compression]
mode = "identity"
[cluster]
expected_nodes = 2
min_nodes = 2
[outer]
mode = "sync"
"""
MODELS = {"cuda": ("125m", "vocab_size = 256\nseq_len = 128", 128), "cpu": ("tiny", "", 64)}
TP_ARGS = {"cuda": ["--model", "small", "--seq", "128", "--batch", "8", "--micro-batches", "2", "--steps", "4"],
           "cpu": ["--model", "tiny", "--seq", "64", "--batch", "8", "--micro-batches", "2", "--steps", "3"]}


@dataclass(frozen=True)
class Check:
    """One row of the table: what was checked, the figure measured, the target, and whether it was met (None:
    skipped, the figure saying why)."""

    name: str
    figure: str
    target: str
    met: bool | None


def skipped(name: str, why: str, target: str = "-") -> Check:
    return Check(name, f"skipped: {why}", target, None)


def report(checks: list[Check]) -> tuple[list[str], int, int]:
    """The table's lines and (targets met, targets counted); skipped checks are listed but not counted."""
    cols = [("check", [c.name for c in checks]), ("figure", [c.figure for c in checks]),
            ("target", [c.target for c in checks]),
            ("met", ["-" if c.met is None else "yes" if c.met else "NO" for c in checks])]
    widths = [max(len(head), *(len(v) for v in values)) if values else len(head) for head, values in cols]
    lines = ["  ".join(head.ljust(w) for (head, _), w in zip(cols, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in zip(*(v for _, v in cols))]
    counted = [c for c in checks if c.met is not None]
    return lines, sum(bool(c.met) for c in counted), len(counted)


def cuda_missing() -> str | None:
    """Why this machine cannot run the CUDA checks (None: it can)."""
    import torch

    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"no CUDA device: torch {torch.__version__} is a CPU-only build"
    return (f"no CUDA device: torch {torch.__version__} is built for CUDA {torch.version.cuda}, but it finds no GPU "
            f"(no driver, or CUDA_VISIBLE_DEVICES hides them)")


def guarded(name: str, target: str, fn: Callable[[], list[Check]]) -> list[Check]:
    """`fn`'s checks, or one unmet check saying what it raised (the other checks still run)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported as a missed target, with its first line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"  {name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return [Check(name, f"failed: {type(e).__name__}: {first[:160]}", target, False)]


def _say(what: str) -> None:
    print(f"  {what}", file=sys.stderr, flush=True)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


# --- profile ---------------------------------------------------------------------------------------------------


def check_profile(job, device: str) -> list[Check]:
    from atoll.node.profiler import ProfileOptions, profile_node

    t0 = time.perf_counter()
    p = profile_node(job, device, ProfileOptions(budget=timedelta(seconds=3)))
    took = time.perf_counter() - t0
    sizes = sorted({t.micro_batch for t in p.layer_timings})
    values = [x for t in p.layer_timings for x in (t.forward_seconds, t.backward_seconds)]
    finite = all(math.isfinite(x) and x > 0 for x in values) and math.isfinite(p.optimizer_step_seconds) \
        and p.optimizer_step_seconds > 0
    block = {t.micro_batch: t.forward_seconds + t.backward_seconds for t in p.layer_timings if t.layer_kind == "block"}
    mb = job.train.micro_batch
    kind = device.split(":")[0]
    return [
        Check(f"profile: layer timings on {kind}",
              f"{len(p.layer_timings)} timings (3 kinds x sizes {sizes}) in {took:.1f} s; block fwd+bwd "
              f"{1e3 * block.get(mb, float('nan')):.2f} ms at {mb}, AdamW {1e3 * p.optimizer_step_seconds:.2f} ms",
              "all > 0 and finite, 3 kinds x 3 sizes", finite and len(p.layer_timings) == 3 * len(sizes) == 9),
        Check(f"profile: the device as reported on {kind}",
              f"{p.device_kind} {p.device_name!r} x{p.device_count}, {p.memory_total_bytes / 2**30:.1f} GiB "
              f"({p.memory_free_bytes / 2**30:.1f} free)", f"kind {kind}, memory > 0",
              p.device_kind == kind and 0 < p.memory_free_bytes <= p.memory_total_bytes),
    ]


# --- precision -------------------------------------------------------------------------------------------------


def check_precision(job, device: str, steps: int) -> list[Check]:
    from atoll.node.local import train_local

    losses = {}
    for precision in ("fp32", "bf16", "fp16"):
        t0 = time.perf_counter()
        # the job's own length, so that the learning-rate schedule spans the steps trained
        trained = replace(job, train=replace(job.train, dtype=precision, steps=steps))
        losses[precision], _ = train_local(trained, device=device)
        _say(f"trained {steps} steps in {precision} on {device} in {time.perf_counter() - t0:.1f} s")
    base = statistics.fmean(losses["fp32"][-5:])
    out = []
    for precision in ("bf16", "fp16"):
        ls = losses[precision]
        finite = sum(math.isfinite(x) for x in ls)
        end = statistics.fmean(ls[-5:])
        rel = (end - base) / base
        out.append(Check(f"{precision} training on {device.split(':')[0]} ({steps} steps)",
                         f"loss at end {end:.4f} vs fp32 {base:.4f} ({rel:+.2%}); {finite}/{len(ls)} finite",
                         f"all finite, within {PRECISION_RTOL:.0%} of fp32",
                         finite == len(ls) and abs(rel) <= PRECISION_RTOL))
    return out


# --- the two-process pipeline and its memory -------------------------------------------------------------------


def stage_predictions(job, layers: list[tuple[int, int]]) -> list[float]:
    """The planner's cost model: bytes per device of each stage of a one-replica pipeline of `layers`, fp32
    AdamW, ZeRO 0, no recomputation, in-flight micro-batches as 1F1B holds them (stage s of p: min(p - s, m))."""
    from atoll.coordinator.planner import PlannerOptions, TrainSpec, parse_cluster
    from atoll.coordinator.planner.costmodel import CostModel
    from atoll.coordinator.planner.parallelizer import DefaultParallelizer, SliceQuery
    from atoll.modelspec import ModelSpec

    t = job.train
    cm = CostModel(ModelSpec.from_config(job.model), TrainSpec(global_batch=t.global_batch, seq_len=t.seq_len,
                                                               dtype=t.dtype), options=PlannerOptions())
    # memory depends on the model and the stage, not on the device's speed: any island of one device answers
    island = parse_cluster('[[group]]\nname = "one"\ntflops = 100\nmemory_gb = 80\ncount = 1\n').islands[0]
    par = DefaultParallelizer(cm)
    m = t.global_batch // t.micro_batch
    return [par.evaluate(SliceQuery(start=a, end=b, micro_batch=t.micro_batch, dp=1,
                                    in_flight=min(len(layers) - s, m)), island, zero=0).memory_bytes
            for s, (a, b) in enumerate(layers)]


def run_pipeline(job, devices: list[str], out: Path, steps: int, reference: list[float]) -> dict:
    """A coordinator and one node process per device of `devices`, each running one stage of a pinned plan
    cut where the FLOPs balance; returns the losses, each stage's peak and predicted memory and the nodes' logs."""
    from atoll.launch.localcluster import LocalCluster
    from atoll.modelspec import ModelSpec
    from atoll.plan import GB, PipelinePlan, Plan, StagePlan
    from bench.memory import balanced_cut

    total = job.model.n_layers + 2
    cut = balanced_cut(ModelSpec.from_config(job.model))
    layers = [(0, cut), (cut, total)]
    predicted = stage_predictions(job, layers)
    t = job.train
    names = [f"stage{s}" for s in range(len(layers))]
    plan = Plan(model=job.model.name, global_batch=t.global_batch, seq_len=t.seq_len, pipelines=[PipelinePlan(
        micro_batch=t.micro_batch, num_micro_batches=t.global_batch // t.micro_batch,
        stages=[StagePlan(island="gpu", layers=ab, nodes=[n], memory_gb_per_device=p / GB)
                for ab, n, p in zip(layers, names, predicted)])])
    plan.validate(total)
    out.mkdir(parents=True, exist_ok=True)
    job_path, plan_path = out / "job.toml", out / "plan.json"
    job_path.write_text(job.to_toml())
    plan.save(plan_path)
    t0 = time.perf_counter()
    with LocalCluster(job_path=job_path, out=out / "cluster", profile_seconds=2.0) as cluster:
        cluster.start_coordinator(extra=["--plan", str(plan_path)])
        for name, device in zip(names, devices):
            cluster.start_node(name, node_id=name, extra=["--device", device])
        losses = cluster.wait_losses(steps, timeout=400)
        with cluster.read_store() as store:
            reports = store.recent_steps(limit=store.recent_steps_kept)
    took = time.perf_counter() - t0
    peaks = [max((r.peak_memory_bytes for r in reports if r.stage == s), default=0) for s in range(len(layers))]
    worst = max(abs(losses[k] - reference[k]) / abs(reference[k]) for k in range(steps))
    logs = [(out / "cluster" / f"{n}.log").read_text(errors="replace") for n in names]
    _say(f"pipeline on {', '.join(devices)}: {steps} steps in {took:.0f} s, losses "
         f"{', '.join(f'{losses[k]:.4f}' for k in range(steps))}")
    return {"worst": worst, "took": took, "layers": layers, "peaks": peaks, "predicted": predicted, "logs": logs}


GROUP_LINE = re.compile(r"\bgroup \S+ of (\d+ ranks runs over \w+: .*)$")
"""What `atoll.node.runner._group` logs of a CUDA group (its name, a secret of the job's, left out)."""


def group_lines(logs: list[str]) -> list[str]:
    """Each group's backend and why, as the nodes logged them ("2 ranks runs over gloo: ranks 0 and 1 ...")."""
    return [m.group(1).strip() for log in logs for line in log.splitlines() if (m := GROUP_LINE.search(line))]


def check_pipeline(job, device: str, out: Path, steps: int) -> list[Check]:
    from atoll.node.local import train_local

    reference, _ = train_local(job, steps=steps, device=device)
    kind = device.split(":")[0]
    r = run_pipeline(job, [device, device], out, steps, reference)
    where = "one GPU" if kind == "cuda" else "the CPU"
    checks = [Check(f"pipeline: 2 node processes on {where}",
                    f"{steps} steps in {r['took']:.0f} s; losses at most {r['worst']:.1e} from one process's",
                    f"losses within {LOSS_RTOL:g} of train_local", r["worst"] <= LOSS_RTOL)]
    if kind == "cuda":
        lines = group_lines(r["logs"])
        gloo = [x for x in lines if "runs over gloo" in x and "share one GPU" in x]
        checks.append(Check("pipeline: groups of two ranks on one GPU", (gloo or lines or ["no group line logged"])[0],
                            "gloo, with the reason logged", bool(gloo) and len(gloo) == len(lines)))
    else:
        checks.append(skipped("pipeline: groups of two ranks on one GPU", "CUDA only (a CPU's groups are gloo)"))
    source = "max_memory_allocated" if kind == "cuda" else "tensors' bytes"
    for s, ((a, b), peak, pred) in enumerate(zip(r["layers"], r["peaks"], r["predicted"])):
        err = peak / pred - 1
        checks.append(Check(f"memory: stage {s} (layers {a}-{b}) on {kind}",
                            f"{_mib(peak)} peak ({source}) vs {_mib(pred)} predicted ({err:+.1%})",
                            f"within {MEMORY_TARGET:.0%} of the cost model", peak > 0 and abs(err) <= MEMORY_TARGET))
    return checks


def check_nccl_pipeline(job, out: Path, steps: int) -> list[Check]:
    from atoll.node.local import train_local

    reference, _ = train_local(job, steps=steps, device="cuda:0")
    r = run_pipeline(job, ["cuda:0", "cuda:1"], out, steps, reference)
    lines = group_lines(r["logs"])
    nccl = [x for x in lines if "runs over nccl" in x]
    return [Check("NCCL: pipeline on cuda:0 and cuda:1",
                  f"{steps} steps in {r['took']:.0f} s; losses at most {r['worst']:.1e} from one process's",
                  f"losses within {LOSS_RTOL:g} of train_local", r["worst"] <= LOSS_RTOL),
            Check("NCCL: the pipeline's groups", (nccl or lines or ["no group line logged"])[0],
                  "NCCL on two GPUs", bool(nccl) and len(nccl) == len(lines))]


# --- tp and ZeRO -------------------------------------------------------------------------------------------------


def parse_targets(text: str) -> list[tuple[str, str, bool]]:
    """(what, detail, met) of each `  [met] what: detail` / `  [MISSED] what: detail` line a bench script printed."""
    out = []
    for line in text.splitlines():
        s = line.strip()
        for mark, met in (("[met] ", True), ("[MISSED] ", False)):
            if s.startswith(mark):
                what, _, detail = s[len(mark):].partition(": ")
                out.append((what, detail, met))
    return out


def check_tp(device: str, gpus: int) -> list[Check]:
    argv = [sys.executable, str(ROOT / "bench" / "tp.py"), "--device", device.split(":")[0], *TP_ARGS[device]]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=420)
    took = time.perf_counter() - t0
    targets = parse_targets(proc.stdout)
    if not targets:
        tail = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"bench.tp exited with {proc.returncode} and no targets: {tail}")
    _say(f"bench.tp on {device} in {took:.0f} s, exit {proc.returncode}")
    if device == "cpu":
        where = "gloo on the CPU"
    elif gpus == 1:
        where = "ranks share 1 GPU: gloo"
    else:
        where = f"ranks on {gpus} GPUs: NCCL"
    return [Check(f"tp/ZeRO: {what}", f"{detail} ({where})", "bench.tp's target", met) for what, detail, met in targets]


# --- main --------------------------------------------------------------------------------------------------------


def run_checks(device: str, steps: int, out: Path) -> list[Check]:
    import torch

    from atoll.job import JobSpec

    preset, extra, seq = MODELS[device]
    job = JobSpec.from_toml(JOB.format(preset=preset, model_extra=extra, seq=seq, steps=steps))
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if device == "cpu":  # one thread, as each node process runs (--threads 1): a shared CPU's cores stay free
        torch.set_num_threads(1)
    if device == "cuda":
        # as the nodes train: profile_node turns TF32 on process-wide, so the one-process reference does too
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    checks: list[Check] = []
    checks += guarded(f"profile on {device}", "all > 0 and finite", lambda: check_profile(job, device))
    checks += guarded(f"precision on {device}", f"within {PRECISION_RTOL:.0%} of fp32",
                      lambda: check_precision(job, device, max(PRECISION_STEPS[device], steps)))
    checks += guarded(f"pipeline on {device}", f"losses within {LOSS_RTOL:g} of train_local",
                      lambda: check_pipeline(job, device, out / "pipeline", steps))
    checks += guarded(f"tp/ZeRO on {device}", "bench.tp's targets", lambda: check_tp(device, gpus))
    if device == "cpu":
        checks.append(skipped("NCCL", "CUDA only"))
    elif gpus < 2:
        checks.append(skipped("NCCL", f"{gpus} GPU on this machine; NCCL's checks need two"))
    else:
        checks += guarded("NCCL: pipeline on cuda:0 and cuda:1", "NCCL on two GPUs",
                          lambda: check_nccl_pipeline(job, out / "nccl", steps))
    return checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default; skips with one line where there is none), or cpu: the same checks on the "
                         "CPU, the CUDA-only ones skipped")
    ap.add_argument("--steps", type=int, default=5,
                    help="pipeline steps (default: 5; each precision trains at least 30 on a GPU, 20 on a CPU)")
    ap.add_argument("--out", help="keep the pipeline's logs and state here (default: a temporary folder)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if args.device == "cuda" and (why := cuda_missing()) is not None:
        print(f"bench.gpu: skipped: {why}")
        return 0

    import torch
    import torch.distributed

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="atoll-gpu-check-") as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        checks = run_checks(args.device, args.steps, out)
    took = time.perf_counter() - t0
    checks.append(Check("the whole check", f"{took:.0f} s", f"under {WALL_TARGET_S / 60:.0f} min",
                        took < WALL_TARGET_S))
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        where = f"{gpus} x {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
    else:
        where = "cpu"
    print(f"bench.gpu on {where}: torch {torch.__version__}, NCCL "
          f"{'available' if torch.distributed.is_nccl_available() else 'not built'}")
    lines, met, total = report(checks)
    print("\n".join(lines))
    print(f"targets met: {met}/{total}")
    return 0 if met == total else 1


if __name__ == "__main__":
    sys.exit(main())
