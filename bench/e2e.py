"""End-to-end benchmark: the distributed demo against the same job trained in one process.

Runs the demo topology (a coordinator and N nodes on this machine, gRPC over loopback, each node with
cores / N torch threads), then the same job in one process with all cores, and prints
- tokens/s of both (the distributed figure from the steady-state step times the nodes reported);
- the planner's predicted step time against the measured median step time, and their ratio;
- the loss at the last step of both.
It ends with `targets met: N/M` (targets: predicted within 25% of measured; the distributed run's last
loss within 2% of the one-process run's).

Usage: python bench/e2e.py [--job examples/tiny.toml] [--nodes 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from atoll.job import JobSpec
from atoll.launch.localcluster import LocalCluster
from atoll.node.local import train_local
from atoll.serde import plan_from_proto


def distributed(job_path: Path, nodes: int, out: Path, timeout: float) -> dict:
    job = JobSpec.load(job_path)
    threads = max(1, (os.cpu_count() or 1) // nodes)
    with LocalCluster(job_path=job_path, out=out, threads_per_node=threads) as cluster:
        cluster.start_coordinator()
        for i in range(nodes):
            cluster.start_node(f"node{i + 1}")
        t0 = time.monotonic()
        while len(cluster.losses()) < job.train.steps:
            cluster.check_alive()
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"the distributed run did not finish in {timeout:.0f}s; logs in {out}")
            time.sleep(0.5)
        wall = time.monotonic() - t0
        status = cluster.status()
        with cluster.read_store() as store:
            steps = store.recent_steps(limit=1_000_000)
    plan = plan_from_proto(status.plan)
    # step time: the interval between consecutive losses reported by the loss-reporting node, steady state
    reports = sorted((s for s in steps if s.loss is not None and s.plan_epoch == plan.epoch), key=lambda s: s.step)
    gaps = [b.unix_time - a.unix_time for a, b in zip(reports, reports[1:]) if b.step == a.step + 1]
    warm = gaps[len(gaps) // 5:]  # leave out the first fifth: connections, allocator, caches
    step_s = statistics.median(warm)
    losses = {s.step: s.loss for s in reports}
    return {"plan": plan, "step_s": step_s, "tokens_per_s": job.train.global_batch * job.train.seq_len / step_s,
            "last_loss": losses[max(losses)], "wall_s": wall}


def one_process(job_path: Path) -> dict:
    job = JobSpec.load(job_path)
    torch.set_num_threads(os.cpu_count() or 1)
    times: list[float] = []
    last = [time.perf_counter()]

    def tick(step, result) -> None:
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    losses, _ = train_local(job, on_step=tick)
    step_s = statistics.median(times[len(times) // 5:])
    return {"step_s": step_s, "tokens_per_s": job.train.global_batch * job.train.seq_len / step_s,
            "last_loss": losses[-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", type=Path, default=Path("examples/tiny.toml"))
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()
    job = JobSpec.load(args.job)
    print(f"end-to-end benchmark: job {job.name} ({job.model.name}, {job.train.steps} steps, global batch "
          f"{job.train.global_batch} x {job.train.seq_len} tokens), {args.nodes} nodes on {os.cpu_count()} cores, "
          f"torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="atoll-bench-e2e-") as tmp:
        d = distributed(args.job, args.nodes, Path(tmp), args.timeout)
    o = one_process(args.job)
    plan = d["plan"]
    layout = "; ".join(f"pipeline {k}: " + " -> ".join(f"{s.island}[{s.layers[0]},{s.layers[1]})x{s.dp}"
                                                      for s in p.stages) for k, p in enumerate(plan.pipelines))
    print(f"plan epoch {plan.epoch}: {layout}")
    print(f"{'run':<28}{'step s':>10}{'tokens/s':>12}{'last loss':>12}")
    print(f"{'one process (all cores)':<28}{o['step_s']:>10.4f}{o['tokens_per_s']:>12,.0f}{o['last_loss']:>12.4f}")
    print(f"{'distributed (measured)':<28}{d['step_s']:>10.4f}{d['tokens_per_s']:>12,.0f}{d['last_loss']:>12.4f}")
    print(f"{'distributed (predicted)':<28}{plan.predicted.step_time_s:>10.4f}{plan.predicted.tokens_per_s:>12,.0f}"
          f"{'':>12}")
    ratio = plan.predicted.step_time_s / d["step_s"]
    loss_gap = abs(d["last_loss"] - o["last_loss"]) / o["last_loss"]
    print(f"distributed / one process tokens/s: {d['tokens_per_s'] / o['tokens_per_s']:.2f}x; "
          f"predicted / measured step time: {ratio:.2f}; last-loss gap {loss_gap:.2%}; "
          f"distributed wall time {d['wall_s']:.1f}s (start-up, profiling and planning included)")
    targets = [
        (f"predicted step time within 25% of measured (ratio {ratio:.2f})", abs(ratio - 1) <= 0.25),
        (f"distributed last loss within 2% of one process ({loss_gap:.2%})", loss_gap <= 0.02),
    ]
    met = sum(ok for _, ok in targets)
    for name, ok in targets:
        print(f"  [{'ok' if ok else 'MISSED'}] {name}")
    missed = [name for name, ok in targets if not ok]
    print(f"targets met: {met}/{len(targets)}" + (f" (missed: {'; '.join(missed)})" if missed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
