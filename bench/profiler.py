"""Profiler benchmark: how steady a node's profile is from one join to the next.

    python -m bench.profiler [--profiles 16] [--budget 2] [--d-model 128 --layers 4 --seq 128]

The planner balances stages by the ratios between a node's layer times (the head against a block, a block at
one micro-batch size against another), so a profile whose ratios move from one measurement to the next makes
plans that move with them: a stage that looked cheap gets layers it cannot carry. This script takes
`--profiles` profiles of a small GPT on this machine's CPU (one torch thread, `atoll.node.profiler.profile_node`)
and as many of a baseline in the same run, alternating, so both see the same machine:
- interleaved (the profiler): round by round, every (micro-batch size, layer kind) timed once a round, the
  median over the rounds;
- grouped (the baseline, the profiler's former order): all repeats of one (size, layer kind) back to back,
  then the next, each stopping once the budget is spent (every pair still timed once).
Printed, for each: the median and the relative standard deviation over the profiles of three ratios
(a block at micro-batch 8 over 4, the head over a block at 4, a block at 2 over 4) and of the whole model's
time at 4 (that one moves with the machine's speed itself, which no order of measuring removes).

Target: the ratios' relative standard deviation under the interleaved order, the mean over the three ratios, is
below the grouped order's. (One ratio's spread over a dozen profiles moves with the machine's load; their
mean is the steadier reading.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from atoll.job import JobSpec  # noqa: E402
from atoll.node.model import build_layer  # noqa: E402
from atoll.node.profiler import (ProfileOptions, _forward_as_run, _start_of_backward, _timed,  # noqa: E402
                                 profile_node)

JOB = """
[job]
name = "profile"
[model]
preset = "tiny"
d_model = {d}
n_heads = 4
n_layers = {layers}
ffn_hidden = {ffn}
seq_len = {seq}
[data]
source = "builtin"
tokenizer = "bytes"
[train]
global_batch = 32
seq_len = {seq}
micro_batch = 4
steps = 1
dtype = "fp32"
"""

SIZES = (2, 4, 8)
RATIOS = (("block 8 / block 4", ("block", 8), ("block", 4)), ("head 4 / block 4", ("head", 4), ("block", 4)),
          ("block 2 / block 4", ("block", 2), ("block", 4)))


def grouped(job: JobSpec, options: ProfileOptions) -> dict[tuple[str, int], float]:
    """The baseline: every repeat of one (size, layer kind) back to back; seconds (forward + backward, median)."""
    cfg, seq = job.model, job.train.seq_len
    deadline = time.perf_counter() + options.budget.total_seconds()
    layers = {kind: build_layer(cfg, index) for kind, index in
              (("embedding", 0), ("block", 1), ("head", cfg.n_layers + 1))}
    g = torch.Generator().manual_seed(0)
    dev = torch.device("cpu")
    out = {}
    for b in SIZES:
        ids = torch.randint(0, cfg.vocab_size, (b, seq), generator=g)
        hidden = torch.randn(b, seq, cfg.d_model, generator=g)
        for kind, layer in layers.items():
            times = []
            for r in range(options.repeats + 1):
                x = ids if kind == "embedding" else hidden.detach().requires_grad_(True)
                res: list[torch.Tensor] = []
                f = _timed(dev, lambda: res.append(_forward_as_run(layer, kind, x, ids, "fp32", dev)))
                bw = _timed(dev, _start_of_backward(res[0]).backward)
                layer.zero_grad(set_to_none=True)
                if r > 0:
                    times.append(f + bw)
                if r >= 1 and time.perf_counter() > deadline:
                    break
            out[kind, b] = statistics.median(times)
    return out


def interleaved(job: JobSpec, options: ProfileOptions) -> dict[tuple[str, int], float]:
    p = profile_node(job, "cpu", options)
    return {(t.layer_kind, t.micro_batch): t.forward_seconds + t.backward_seconds for t in p.layer_timings}


def spread(xs: list[float]) -> float:
    return statistics.stdev(xs) / statistics.median(xs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", type=int, default=16)
    ap.add_argument("--budget", type=float, default=2.0, help="seconds per profile")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args(argv)
    if args.profiles < 3:
        ap.error("--profiles must be at least 3")
    torch.set_num_threads(1)
    job = JobSpec.from_toml(JOB.format(d=args.d_model, layers=args.layers, ffn=4 * args.d_model, seq=args.seq))
    options = ProfileOptions(micro_batches=SIZES, budget=timedelta(seconds=args.budget))
    runs: dict[str, list[dict]] = {"interleaved": [], "grouped": []}
    order = (("interleaved", interleaved), ("grouped", grouped))
    for i in range(args.profiles):
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            runs[name].append(fn(job, options))
        print(f"  profile {i + 1}/{args.profiles} of each", file=sys.stderr, flush=True)
    print(f"profiles of a GPT block (d_model {args.d_model}, seq {args.seq}) on one CPU thread, "
          f"{args.profiles} of each order alternating, {args.budget:g} s budget each")
    print(f"{'reading':<22}{'interleaved':>22}{'grouped':>22}")
    spreads: dict[str, list[float]] = {name: [] for name in runs}
    for label, a, b in RATIOS:
        cells = {}
        for name, rs in runs.items():
            xs = [r[a] / r[b] for r in rs]
            cells[name] = (statistics.median(xs), spread(xs))
            spreads[name].append(spread(xs))
        print(f"{label:<22}" + "".join(f"{m:>10.3f} +-{s:>6.1%}    " for m, s in cells.values()))
    mean = {name: statistics.mean(v) for name, v in spreads.items()}
    print(f"{'mean spread':<22}" + "".join(f"{'':>10}   {m:>6.1%}    " for m in mean.values()))
    for name, rs in runs.items():
        whole = [r["embedding", 4] + args.layers * r["block", 4] + r["head", 4] for r in rs]
        print(f"whole model at 4, {name}: median {statistics.median(whole) * 1e3:.1f} ms +-{spread(whole):.1%} "
              f"(the machine's own speed moves this one)")
    met = mean["interleaved"] < mean["grouped"]
    print(f"targets met: {int(met)}/1 (the ratios' mean spread: interleaved {mean['interleaved']:.1%} below "
          f"grouped {mean['grouped']:.1%})")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
