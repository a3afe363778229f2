"""Memory benchmark: each stage's measured peak memory against the planner's prediction, for ZeRO 0/1/2
with recomputation off, on some blocks and on every block, and a few of them again with deferred weight
gradients (zero-bubble: stage s holds back s + 1 micro-batches' linear-layer inputs and output gradients),
one of them with only half of each stage's layers deferring and the first stage's warm-up one deeper (the
planner's partial deferral and filled warm-up).

    .venv/bin/python -m bench.memory [--model 125m --seq 128 --vocab 256 --steps 2 --only 0,1,2]

The model is the 125M GPT shape with atoll's byte-level vocabulary (as the demo trains it) at a short
sequence, cut in two stages where its FLOPs balance, each stage on two replicas: a pipeline micro-batch of
4 sequences (2 per replica) times 4 micro-batches. Every configuration is trained by the real runtime for
`--steps` steps: nodes as threads of this process with real gRPC peers and gloo groups (`PlanRunner` on a
fixed plan, as `atoll node` runs one), the plan's stages carrying the ZeRO stage and the recomputed blocks.

Measured: the highest `StepMetrics.peak_memory_bytes` each node reports. On a CPU that is the bytes of the
stage's real tensors: its parameters, its gradients at their most (ZeRO-2: the shard accumulators and the
buckets staged at once), its optimizer states (ZeRO: the owned chunks), plus the most bytes autograd held
for backward at once (saved-tensor hooks over every micro-batch in flight, each storage once, with the
stage's input and output). It does not see transients (the recomputation's working set in backward, a
kernel's scratch); on CUDA the runtime reports the allocator's peak instead.
Predicted: the planner's cost model for the same stage, ZeRO stage and recomputed blocks
(`DefaultParallelizer.evaluate`: what a plan's `memory_gb_per_device` says), in-flight micro-batches as
1F1B holds them (stage i of p: min(p - i, m)).

Target: every stage within 15% of its prediction. The step time of each configuration (the slowest
node's, after the first step) is printed beside it: wall time on whatever else the machine runs, so only
indicative (recomputation adds a forward of the recomputed blocks, ZeRO-2 a reduce-scatter per
micro-batch).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from tempfile import TemporaryDirectory

import torch
import torch.distributed as dist

from atoll.coordinator.planner import PlannerOptions, TrainSpec, parse_cluster
from atoll.coordinator.planner.costmodel import CostModel
from atoll.coordinator.planner.parallelizer import DefaultParallelizer, SliceQuery
from atoll.job import JobSpec
from atoll.models import preset
from atoll.modelspec import ModelSpec
from atoll.node.peer import PeerServer
from atoll.node.runner import PlanRunner, RunContext
from atoll.plan import GB, PipelinePlan, Plan, StagePlan
from atoll.types import StepMetrics

JOB = Path(__file__).resolve().parent.parent / "examples" / "tiny.toml"
TARGET = 0.15


@dataclass(frozen=True)
class Config:
    zero: int
    recompute: str
    """"off", "some" (the first half of each stage's blocks) or "all"."""
    zero_bubble: bool = False
    """Stage s defers its weight gradients s + 1 micro-batches (`StagePlan.defer_weights`)."""
    part: bool = False
    """With `zero_bubble`: only the first half of each stage's layers with weight gradients defer
    (`StagePlan.defer_layers`), as the planner chooses where memory holds only part of them."""
    fill: bool = False
    """Stage s of p runs p - s - 1 extra warm-up forwards (`StagePlan.in_flight`), as the planner fills the
    wait for the first gradient where memory allows."""

    @property
    def name(self) -> str:
        extra = [x for x, on in (("zero-bubble", self.zero_bubble), ("half the layers", self.part),
                                 ("filled warm-up", self.fill)) if on]
        return f"zero {self.zero} recompute {self.recompute}" + "".join(f" {x}" for x in extra)


@dataclass
class Row:
    config: Config
    layers: list[tuple[int, int]]
    recomputed: list[int]
    """Blocks each stage recomputed."""
    measured: list[int]
    """Per stage, the highest peak memory its replicas reported."""
    predicted: list[float]
    step_seconds: float


def balanced_cut(spec: ModelSpec) -> int:
    cost = [x.flops_fwd_per_token + x.flops_bwd_per_token for x in spec.layers]
    total, run, best = sum(cost), 0.0, (float("inf"), 1)
    for i, c in enumerate(cost[:-1]):
        run += c
        best = min(best, (abs(total - 2 * run), i + 1))
    return best[1]


def _run_plan(job: JobSpec, stages: list[StagePlan], micro_batch: int, micro_batches: int,
              folder: Path) -> list[StepMetrics]:
    """Train `job` on one pipeline of `stages`, nodes as threads; every node's step reports."""
    nodes = [n for s in stages for n in s.nodes]
    servers = {n: PeerServer(node_id=n, listen="127.0.0.1:0", token="bench") for n in nodes}
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    plan = Plan(model=job.model.name, global_batch=job.train.global_batch, seq_len=job.train.seq_len,
                pipelines=[PipelinePlan(micro_batch=micro_batch, num_micro_batches=micro_batches, stages=stages)],
                epoch=1, job_id="bench", node_addresses={n: s.address for n, s in servers.items()},
                rendezvous=f"127.0.0.1:{store.port}")
    reports: list[StepMetrics] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def report(m: StepMetrics) -> bool:
        with lock:
            reports.append(m)
        return False

    def node(n: str) -> None:
        ctx = RunContext(node_id=n, job=job, peer_server=servers[n], checkpoint_dir=folder, report_step=report,
                         report_checkpoint=lambda c: None, token="bench", timeout=timedelta(seconds=120))
        try:
            PlanRunner(ctx, plan).run(threading.Event())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=node, args=(n,), name=f"node-{n}") for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in servers.values():
        s.stop()
    if errors:
        raise RuntimeError(f"{len(errors)} node(s) failed: " + "; ".join(map(str, errors))) from errors[0]
    return reports


def run_config(job: JobSpec, config: Config, cut: int, par: DefaultParallelizer, island, *, micro_batch: int,
               micro_batches: int) -> Row:
    total = job.model.n_layers + 2
    layers = [(0, cut), (cut, total)]
    dp = 2
    stages, predicted, recomputed = [], [], []
    for s, (a, b) in enumerate(layers):
        blocks = [i for i in range(a, b) if 0 < i < total - 1]
        chosen = {"off": [], "some": blocks[:len(blocks) // 2], "all": blocks}[config.recompute]
        extra = len(layers) - s - 1 if config.fill else 0
        q = SliceQuery(start=a, end=b, micro_batch=micro_batch // dp, dp=dp,
                       in_flight=min(len(layers) - s + extra, micro_batches))
        cost = par.evaluate(q, island, zero=config.zero, recompute_blocks=len(chosen))
        assert list(cost.recompute_layers) == chosen
        defer = min(s + 1, micro_batches) if config.zero_bubble else 0
        t = par.cm.table(island, cost.micro_batch)
        with_w = [i for i in range(a, b) if t.stash(i, i + 1) > 0]
        part = with_w[:max(1, len(with_w) // 2)] if defer and config.part else []
        memory = cost.memory_bytes + par.cm.deferred_bytes(t, a, b, cost.recompute_layers, defer, part)
        predicted.append(memory)
        recomputed.append(len(chosen))
        stages.append(StagePlan(island=island.id, layers=(a, b), dp=dp, zero=config.zero,
                                recompute_layers=chosen, nodes=[f"s{s}r{r}" for r in range(dp)],
                                compute_s=cost.time_s, memory_gb_per_device=memory / GB, defer_weights=defer,
                                defer_layers=part, in_flight=extra))
    with TemporaryDirectory() as folder:
        reports = _run_plan(job, stages, micro_batch, micro_batches, Path(folder))
    measured = [max(m.peak_memory_bytes for m in reports if m.stage == s) for s in range(len(layers))]
    steps = sorted({m.step for m in reports})[1:] or sorted({m.step for m in reports})  # the first warms up
    step_s = sum(max(m.step_seconds for m in reports if m.step == k) for k in steps) / len(steps)
    return Row(config=config, layers=layers, recomputed=recomputed, measured=measured, predicted=predicted,
               step_seconds=step_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="125m", help="model preset")
    ap.add_argument("--seq", type=int, default=128, help="sequence length")
    ap.add_argument("--vocab", type=int, default=256, help="vocabulary (0: the preset's; the data is byte-level)")
    ap.add_argument("--steps", type=int, default=2, help="steps per configuration (the first is a warm-up for time)")
    ap.add_argument("--only", default="0,1,2", help="ZeRO stages to run, comma-separated")
    ap.add_argument("--recompute", default="off,some,all", help="recomputation settings to run: off, some, all")
    ap.add_argument("--zero-bubble", default="0/off,1/off,0/all,1/off/part+fill",
                    help="ZeRO stage/recomputation pairs to run again with deferred weight gradients, each with an "
                         "optional third field of part (half the layers defer) and fill (deeper warm-ups) joined by "
                         "+ (\"\": none)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)  # one core per node thread, as nodes of their own

    model = replace(preset(args.model), seq_len=args.seq)
    if args.vocab:
        model = replace(model, name=f"{model.name}-v{args.vocab}", vocab_size=args.vocab)
    micro_batch, micro_batches = 4, 4
    base = JobSpec.load(JOB)
    job = replace(base, model=model,
                  train=replace(base.train, global_batch=micro_batch * micro_batches, seq_len=args.seq,
                                micro_batch=micro_batch, steps=args.steps, warmup=1, dtype="fp32"),
                  checkpoint=replace(base.checkpoint, interval=0),
                  compression=replace(base.compression, mode="identity"))
    spec = ModelSpec.from_config(model)
    cut = balanced_cut(spec)
    cm = CostModel(spec, TrainSpec(global_batch=job.train.global_batch, seq_len=args.seq, dtype="fp32"),
                   options=PlannerOptions())
    island = parse_cluster("[[group]]\nname = \"cpu\"\ntflops = 0.4\ntflops_fp32 = 0.05\nmemory_gb = 64\ncount = 4\n"
                           "gpus_per_node = 4\n").islands[0]
    par = DefaultParallelizer(cm)
    configs = [Config(int(z), rc) for rc in args.recompute.split(",") for z in args.only.split(",")]
    for x in (x for x in args.zero_bubble.split(",") if x):
        z, rc, *more = x.split("/")
        flags = set(more[0].split("+")) if more else set()
        if flags - {"part", "fill"}:
            ap.error(f"--zero-bubble {x}: the third field takes part and fill, got {more[0]}")
        configs.append(Config(int(z), rc, zero_bubble=True, part="part" in flags, fill="fill" in flags))
    t0 = time.perf_counter()
    rows = []
    for c in configs:
        rows.append(run_config(job, c, cut, par, island, micro_batch=micro_batch, micro_batches=micro_batches))
        r = rows[-1]
        print(f"  ran {c.name}: {', '.join(f'{m / 2**20:.0f}' for m in r.measured)} "
              f"MiB measured, {', '.join(f'{p / 2**20:.0f}' for p in r.predicted)} MiB predicted, "
              f"{r.step_seconds:.1f} s/step", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - t0

    print(f"memory benchmark: {model.name} ({spec.total_params / 1e6:.0f}M parameters), seq {args.seq}, 2 stages "
          f"cut at layer {cut} x 2 replicas, micro-batches of {micro_batch} x {micro_batches}, fp32 AdamW, "
          f"{args.steps} steps each, {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}, {elapsed:.0f} s")
    print("measured: each stage's reported peak (CPU: its tensors' bytes); predicted: the planner's cost model")
    print("zb: the stage's zero-bubble depth; h: half its layers defer (defer_layers); f: its warm-up filled "
          "(in_flight p - s - 1)")
    hdr = (f"{'zero':>4} {'recompute':<9} {'zb':>3} {'stage':>5} {'layers':<9} {'blocks rc':>9} {'measured MiB':>12} "
           f"{'predicted MiB':>13} {'error':>7} {'step s':>7}")
    print(hdr)
    print("-" * len(hdr))
    checks: list[tuple[str, bool]] = []
    for r in rows:
        for s, (layers, m, p) in enumerate(zip(r.layers, r.measured, r.predicted)):
            err = m / p - 1
            zb = f"{s + 1}{'h' if r.config.part else ''}{'f' if r.config.fill else ''}" if r.config.zero_bubble else "-"
            print(f"{r.config.zero:>4} {r.config.recompute:<9} {zb:>3} {s:>5} {str(list(layers)):<9} {r.recomputed[s]:>9} "
                  f"{m / 2**20:>12.1f} {p / 2**20:>13.1f} {100 * err:>+6.1f}% "
                  + (f"{r.step_seconds:>7.2f}" if s == 0 else ""))
            checks.append((f"{r.config.name} stage {s}: measured "
                           f"{m / 2**20:.1f} MiB within {TARGET:.0%} of predicted {p / 2**20:.1f} MiB",
                           abs(err) <= TARGET))
    for name, ok in checks:
        if not ok:
            print(f"  [MISSED] {name}")
    met = sum(ok for _, ok in checks)
    print(f"targets met: {met}/{len(checks)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
