"""Pipeline benchmark: tokens/s, bubble fraction and peak memory per stage of 1, 2 and 4 stages.

    .venv/bin/python -m bench.pipeline [--steps 2] [--micro-batches 4] [--big 125m --big-seq 128]

For each model (the tiny preset, and the 125M GPT shape with atoll's byte-level vocabulary of 256,
as the demo trains it, at a short sequence so it fits a minute on a small CPU; with GPT-2's 50257-token
vocabulary the LM head alone costs five blocks and no 4-stage cut can balance, see `--big-vocab`) it trains the same global batch as one process (the baseline: the unsplit model with the
same micro-batches accumulated) and as 2 and 4 in-process stages (threads, 1F1B), cut where the
ModelSpec's FLOPs balance best. Each stage stands for one device: torch runs one thread per stage, so
the baseline has one core and p stages have p. The first step of each run is a warm-up.

What is measured and how:
- tokens/s: tokens of a step over the slowest stage's wall-clock step time, mean over measured steps.
- bubble: per stage, the idle share of the pipelined part of a step (from the step's start to the end
  of the gradient-norm exchange, which waits for every stage): 1 - compute / that time, from the
  stage's own per-action timings; the table shows the mean over stages next to (p-1)/(m+p-1).
  Two readings. `live`: wall clock, as the run went. `replay`: each action keeps the time it took and
  the stages' schedules are replayed against each other, one core per stage, with the same
  send/receive dependencies. When stage threads must time-share cores (fewer than two cores per stage,
  or a machine others are using), compute is inflated while stages overlap and idle time hides, so
  the live reading understates the bubble; there each action's time is the CPU time of its own
  thread (with one torch thread, all of its compute) and the replay is the reading the targets use.
  With two or more cores per stage the live reading is used. The `used` column says which.
- peak memory per stage: bytes of the stage's weights, gradients and AdamW moments (the real tensors
  after the step) plus the most bytes autograd held for backward at once (saved-tensor hooks count
  every non-parameter tensor saved per micro-batch, plus the stage's input and output, while the
  micro-batch is in flight). Process-wide counters cannot separate threads, and this is what differs
  between stages; the baseline is the unsplit model under the same accounting.

Zero-bubble: every multi-stage configuration runs again with each stage's weight gradients deferred (stage s
holds back s + 1 micro-batches', `atoll.node.schedule`), and a second table sets its replayed step against
1F1B's beside what the planner's simulator predicts from the run's own mean action times, with the peak
memory per stage (the deferred products included).

Deeper warm-ups: each zero-bubble configuration runs a third time with stage s running p - s - 1 extra forwards
before its first backward (`StageConfig.in_flight`), the deepest the planner fills a pipeline's wait for its
first gradient with; a third table sets its replayed step against zero-bubble's beside the simulator's
prediction. Whether it gains depends on the stages' times and the micro-batch count (the planner keeps it only
where the simulator says so), so its target is the prediction's truth, not a gain: the same sign, within 10 points
(the prediction takes each action's mean time, the replay each action's own, and with 4 stage threads on 2 cores
those vary from one micro-batch to the next).

Targets: the 2- and 4-stage bubble fractions of the 125M-class model within 20% of the theoretical
ones, and no stage's peak memory above that of the unsplit model (both models); the 125M-class model's
zero-bubble step shorter than its 1F1B step by at least half of what the simulator predicts; its filled
step's gain over zero-bubble within 5 points of what the simulator predicts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace

import torch

from atoll.models import preset
from atoll.modelspec import ModelConfig, ModelSpec
from atoll.node.inprocess import ThreadedRun, train_threaded
from atoll.coordinator.planner.simulator import LinkTimes, PipelineTimes, StageTimes, simulate
from atoll.node.schedule import schedule, theoretical_bubble, zero_bubble_depths
from atoll.node.stage import PipelineStage, StageConfig, StepResult
from atoll.node.synthetic import synthetic_batch


def balanced_cuts(spec: ModelSpec, num_stages: int) -> list[int]:
    """Contiguous cut of the layers minimising the largest stage's forward+backward FLOPs."""
    cost = [x.flops_fwd_per_token + x.flops_bwd_per_token for x in spec.layers]
    n = len(cost)
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    arg = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], prefix[j] - prefix[i])
                if v < best[k][j]:
                    best[k][j], arg[k][j] = v, i
    cuts = [n]
    for k in range(num_stages, 0, -1):
        cuts.append(arg[k][cuts[-1]])
    return cuts[::-1]


def replay_bubble(results: list[StepResult], num_stages: int, micro_batches: int, *, cpu: bool = True,
                  defer: list[int] | None = None, in_flight: list[int] | None = None) -> list[float]:
    """Per-stage idle fraction of one step replayed with each action's measured time, one core per stage."""
    return replay(results, num_stages, micro_batches, cpu=cpu, defer=defer, in_flight=in_flight)[1]


def replay(results: list[StepResult], num_stages: int, micro_batches: int, *, cpu: bool = True,
           defer: list[int] | None = None, in_flight: list[int] | None = None) -> tuple[float, list[float]]:
    """(makespan, per-stage idle fraction) of one step replayed with each action's measured time, one core per
    stage; `defer`: the stages' zero-bubble depths (their weight actions need no neighbour); `in_flight`: their
    extra warm-up forwards."""
    acts = [schedule("1f1b", stage=s, num_stages=num_stages, micro_batches=micro_batches,
                     defer_weights=defer[s] if defer else 0, extra_in_flight=in_flight[s] if in_flight else 0)
            for s in range(num_stages)]
    dur = [{(t.op, t.micro_batch): (t.cpu if cpu else t.compute) for t in r.timeline} for r in results]
    done: dict[tuple[str, int, int], float] = {}
    pos, clock = [0] * num_stages, [0.0] * num_stages
    busy = [0.0] * num_stages
    while any(pos[s] < len(acts[s]) for s in range(num_stages)):
        moved = False
        for s in range(num_stages):
            if pos[s] == len(acts[s]):
                continue
            a = acts[s][pos[s]]
            if a.op == "forward":
                dep = ("forward", s - 1, a.micro_batch) if s > 0 else None
            elif a.op == "weight":
                dep = None
            else:
                dep = ("backward", s + 1, a.micro_batch) if s < num_stages - 1 else None
            if dep is not None and dep not in done:
                continue
            d = dur[s][(a.op, a.micro_batch)]
            clock[s] = max(clock[s], done[dep] if dep else 0.0) + d
            busy[s] += d
            done[(a.op, s, a.micro_batch)] = clock[s]
            pos[s] += 1
            moved = True
        if not moved:
            raise RuntimeError("replayed schedules deadlock")
    makespan = max(clock)  # every stage waits for the last one in the norm exchange
    return makespan, [1.0 - b / makespan for b in busy]


def state_bytes(stage: PipelineStage) -> int:
    params = list(stage.module.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    total += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    for st in stage.optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v) and v.ndim > 0)
    return total


@dataclass
class Row:
    model: str
    stages: int
    cuts: list[int]
    tokens_per_s: float
    bubble: float
    bubble_theory: float
    bubble_live: float
    bubble_replay: float
    mode: str
    peak_mem: list[int]
    schedule: str = "1f1b"
    replay_s: float = 0.0
    """The replayed step (one core per stage, each action's own CPU time), mean over measured steps."""
    predicted_s: float = 0.0
    """The planner's simulator on the same measured action times (means over micro-batches and steps)."""


def _mean_op(results: list[StepResult], op: str) -> float:
    times = [t.cpu for r in results for t in r.timeline if t.op == op]
    return sum(times) / len(times) if times else 0.0


def predicted_step(per_stage: list[list[StepResult]], measured: range, micro_batches: int,
                   defer: list[int] | None, in_flight: list[int] | None = None) -> float:
    """The simulator's pipelined step (no links, no all-reduce) on each stage's mean measured action times."""
    stages = []
    for results in per_stage:
        rs = [results[k] for k in measured]
        w = _mean_op(rs, "weight")
        stages.append(StageTimes(forward_s=_mean_op(rs, "forward"), backward_s=_mean_op(rs, "backward") + w,
                                 weight_s=w))
    p = len(stages)
    return simulate(PipelineTimes(stages=tuple(stages), links=(LinkTimes(forward_s=0, backward_s=0),) * (p - 1),
                                  num_micro_batches=micro_batches, defer=tuple(defer) if defer else (),
                                  in_flight=tuple(in_flight) if in_flight else ())
                    ).pipeline_time_s


def run_config(config: ModelConfig, stages: int, *, micro_batches: int, rows_per_mb: int, steps: int,
               cores: int, zero_bubble: bool = False, fill: bool = False) -> Row:
    spec = ModelSpec.from_config(config)
    cuts = balanced_cuts(spec, stages)
    live = cores >= 2 * stages
    torch.set_num_threads(1)
    cfg = StageConfig(micro_batches=micro_batches, lr=1e-4, max_grad_norm=1.0, track_memory=True,
                      recv_timeout=StageConfig().recv_timeout * 10)
    batches = [synthetic_batch(vocab_size=config.vocab_size, batch=micro_batches * rows_per_mb,
                               seq_len=config.seq_len, seed=0, step=i) for i in range(steps + 1)]
    defer = zero_bubble_depths(stages) if zero_bubble else None
    extra = [stages - 1 - s for s in range(stages)] if fill else None  # the planner's deepest fill
    run: ThreadedRun = train_threaded(config, cuts=cuts, stage_config=cfg, batches=batches, defer_weights=defer,
                                      in_flight=extra)
    per_stage = run.results[0]
    measured = range(1, steps + 1)
    tokens = micro_batches * rows_per_mb * config.seq_len
    step_times = [max(per_stage[s][k].step_seconds for s in range(stages)) for k in measured]
    live_bubbles = [sum(per_stage[s][k].bubble_fraction for s in range(stages)) / stages for k in measured]
    replays = [replay([per_stage[s][k] for s in range(stages)], stages, micro_batches, cpu=True, defer=defer,
                      in_flight=extra) for k in measured]
    replayed = [sum(idle) / stages for _, idle in replays]
    peak = [state_bytes(run.stages[0][s]) + max(per_stage[s][k].peak_activation_bytes for k in measured)
            for s in range(stages)]
    bubble_live = sum(live_bubbles) / len(live_bubbles)
    return Row(model=config.name, stages=stages, cuts=cuts, tokens_per_s=tokens * len(step_times) / sum(step_times),
               bubble=bubble_live if live else sum(replayed) / len(replayed),
               bubble_theory=theoretical_bubble(stages, micro_batches), bubble_live=bubble_live,
               bubble_replay=sum(replayed) / len(replayed), mode="live" if live else "replay", peak_mem=peak,
               schedule=("zb+fill" if fill else "zb") if zero_bubble else "1f1b",
               replay_s=sum(t for t, _ in replays) / len(replays),
               predicted_s=predicted_step(per_stage, measured, micro_batches, defer, extra))


def compare(pairs: list[tuple[Row, Row]], before: str, after: str) -> list[tuple[Row, Row, float, float]]:
    """Print a table setting each pair's second schedule against its first (replayed steps, the gain, the gain the
    simulator predicts, idle shares, peak memory per stage); return (first, second, gain, predicted gain) per pair."""
    w_before, w_after = len(before) + 7, len(after) + 7  # each column as wide as its "<name> step s" head
    hdr = (f"{'model':<9} {'stages':>6} {before + ' step s':>{w_before}} {after + ' step s':>{w_after}} {'gain':>6} "
           f"{'predicted':>9} {before + ' idle':>{w_before - 2}} {after + ' idle':>{w_after - 2}} "
           f"{after + ' peak MiB per stage':<26} {before + ' peak':<26}")
    print(hdr)
    print("-" * len(hdr))
    out = []
    for a, z in pairs:
        gain, want = 1 - z.replay_s / a.replay_s, 1 - z.predicted_s / a.predicted_s
        print(f"{a.model:<9} {a.stages:>6} {a.replay_s:>{w_before}.3f} {z.replay_s:>{w_after}.3f} {gain:>6.1%} "
              f"{want:>9.1%} {a.bubble_replay:>{w_before - 2}.3f} {z.bubble_replay:>{w_after - 2}.3f} "
              f"{' '.join(f'{x / 2**20:.1f}' for x in z.peak_mem):<26} "
              f"{' '.join(f'{x / 2**20:.1f}' for x in a.peak_mem):<26}")
        out.append((a, z, gain, want))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="measured steps per run (after one warm-up step)")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--big", default="125m", help="the second, larger preset")
    ap.add_argument("--big-seq", type=int, default=64, help="sequence length for the larger preset")
    ap.add_argument("--big-vocab", type=int, default=256, help="vocabulary of the larger preset (0: the preset's)")
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)), help="CPU cores to plan threads for")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.micro_batches < 1:
        ap.error("--steps and --micro-batches must be at least 1")

    big = replace(preset(args.big), seq_len=args.big_seq)
    if args.big_vocab:
        big = replace(big, name=f"{big.name}-v{args.big_vocab}", vocab_size=args.big_vocab)
    models = [(preset("tiny"), 4), (big, 1)]
    rows: list[Row] = []
    zb_rows: list[tuple[Row, Row, Row]] = []  # (1F1B, zero-bubble, zero-bubble filled) of each multi-stage one
    t0 = time.perf_counter()
    run_config(preset("tiny"), 2, micro_batches=2, rows_per_mb=1, steps=1, cores=args.cores)  # warm torch up
    for config, rows_per_mb in models:
        for p in (1, 2, 4):
            rows.append(run_config(config, p, micro_batches=args.micro_batches, rows_per_mb=rows_per_mb,
                                   steps=args.steps, cores=args.cores))
            if p > 1:
                zb_rows.append((rows[-1], *(run_config(config, p, micro_batches=args.micro_batches,
                                                       rows_per_mb=rows_per_mb, steps=args.steps, cores=args.cores,
                                                       zero_bubble=True, fill=fill) for fill in (False, True))))
    elapsed = time.perf_counter() - t0

    m = args.micro_batches
    print(f"pipeline benchmark: 1F1B, {m} micro-batches, {args.steps} measured steps, {args.cores} cores, "
          f"torch {torch.__version__}, {elapsed:.0f} s")
    hdr = (f"{'model':<9} {'stages':>6} {'cuts':<18} {'tokens/s':>9} {'vs 1':>5} {'live':>6} {'replay':>7} "
           f"{'used':<6} {'theory':>7} {'peak MiB per stage':<26} {'unsplit':>8}")
    print("bubble: mean idle fraction over stages of the pipelined part of a step; tokens/s: live")
    print(hdr)
    print("-" * len(hdr))
    base: dict[str, Row] = {}
    for r in rows:
        b = base.setdefault(r.model, r)
        peaks = " ".join(f"{x / 2**20:.1f}" for x in r.peak_mem)
        theory = f"{r.bubble_theory:.3f}" if r.stages > 1 else "-"
        print(f"{r.model:<9} {r.stages:>6} {str(r.cuts):<18} {r.tokens_per_s:>9.0f} {r.tokens_per_s / b.tokens_per_s:>5.2f} "
              f"{r.bubble_live:>6.3f} {r.bubble_replay:>7.3f} {r.mode:<6} {theory:>7} {peaks:<26} "
              f"{b.peak_mem[0] / 2**20:>8.1f}")

    checks: list[tuple[str, bool]] = []
    big = rows[-1].model
    for r in rows:
        if r.stages > 1 and r.model == big:
            ok = abs(r.bubble - r.bubble_theory) <= 0.2 * r.bubble_theory
            checks.append((f"{r.model} {r.stages}-stage bubble {r.bubble:.3f} within 20% of {r.bubble_theory:.3f}", ok))
        if r.stages > 1:
            unsplit = base[r.model].peak_mem[0]
            ok = max(r.peak_mem) <= unsplit
            checks.append((f"{r.model} {r.stages}-stage peak memory {max(r.peak_mem) / 2**20:.1f} MiB <= unsplit "
                           f"{unsplit / 2**20:.1f} MiB", ok))
    print()
    print("zero-bubble (weight gradients deferred s + 1 micro-batches on stage s) against 1F1B, same cuts and batch; "
          "step: replayed (each action's own CPU time, one core per stage), predicted: the planner's simulator on "
          "the run's mean action times")
    for a, z, gain, want in compare([(a, z) for a, z, _ in zb_rows], "1f1b", "zb"):
        if a.model == big:  # the model whose stages are large enough to time
            checks.append((f"{a.model} {a.stages}-stage zero-bubble step {gain:.1%} shorter than 1F1B's, at least half "
                           f"the {want:.1%} the simulator predicts from the run's action times", gain >= want / 2 > 0))
    print()
    print("deeper warm-ups on top (stage s runs p - s - 1 extra forwards before its first backward, as the planner "
          "fills the wait for the first gradient where memory allows) against zero-bubble alone")
    for a, _, gain, want in compare([(z, f) for _, z, f in zb_rows], "zb", "filled"):
        if a.model == big:  # the planner fills only where the simulator says it gains: it must say so truly
            checks.append((f"{a.model} {a.stages}-stage filled step's gain over zero-bubble {gain:.1%} on the same side "
                           f"of zero as, and within 10 points of, the {want:.1%} the simulator predicts from the run's "
                           "mean action times", (gain > 0) == (want > 0) and abs(gain - want) <= 0.10))
    for name, ok in checks:
        print(f"  [{'ok' if ok else 'MISSED'}] {name}")
    met = sum(ok for _, ok in checks)
    missed = [name for name, ok in checks if not ok]
    print(f"targets met: {met}/{len(checks)}" + (f" (missed: {'; '.join(missed)})" if missed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
