"""Precision benchmark: the same model trained in fp32, bf16 and fp16 (dynamic loss scale), and the loss history.

    .venv/bin/python -m bench.precision [--model tiny --steps 60 --replicas 2 --history-steps 100000]

Part 1. A two-stage pipeline (threads, in-process links; with --replicas 2 each stage's replicas average
gradients over gloo) trains `--steps` steps of the synthetic data in each precision, from the same seed. fp32 is
the baseline. Printed per precision: tokens/s (wall time of the whole run, so only indicative on a shared
machine: CPU autocast is not faster than fp32 everywhere), the loss at the end (mean of the last 5 steps), the
bytes of activations and activation gradients sent between the stages per step, the steps fp16 skipped for an
overflow and its final loss scale.
Targets: bf16's and fp16's loss at the end within 3% of fp32's; their boundary bytes half of fp32's; fp16 skips
at most 10% of its steps after the first overflow-free step.

Part 2. `--history-steps` samples (one per step) into the coordinator's SQLite store with its default bounds
(2000 steps at full resolution, at most 1000 buckets). Printed: rows held, the median and 99th-percentile time
of one `add_history` (a transaction each, compactions included), the time to read the whole history.
Targets: rows at most 2000 x 1.25 + 1000 + 1; the first and the last step present and every sample counted;
the median add under 2 ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from tempfile import TemporaryDirectory

if __package__ in (None, ""):  # run as a path: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _train(model, precision: str, steps: int, replicas: int, batch: int) -> dict:
    from atoll.node.inprocess import InProcessTransport, even_cuts, train_threaded
    from atoll.node.precision import LossScaleConfig
    from atoll.node.stage import StageConfig
    from atoll.node.synthetic import synthetic_batch

    cfg = StageConfig(micro_batches=4, lr=3e-3, max_grad_norm=1.0, bf16_autocast=precision == "bf16",
                      fp16_loss_scale=LossScaleConfig(growth_interval=20) if precision == "fp16" else None)
    batches = [synthetic_batch(vocab_size=model.vocab_size, batch=batch, seq_len=model.seq_len, seed=7, step=i)
               for i in range(steps)]
    sent = [0]
    lock = threading.Lock()
    send = InProcessTransport.send

    def counting(self, key, tensor):
        with lock:
            sent[0] += tensor.numel() * tensor.element_size()
        return send(self, key, tensor)

    InProcessTransport.send = counting  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        run = train_threaded(model, cuts=even_cuts(model.n_layers + 2, 2), stage_config=cfg, batches=batches,
                             replicas=replicas)
        wall = time.perf_counter() - t0
    finally:
        InProcessTransport.send = send  # type: ignore[method-assign]
    last = run.results[0][-1]
    first_good = next((k for k, r in enumerate(last) if not r.skipped), len(last))
    losses = run.losses()
    return {"tokens_per_s": steps * batch * model.seq_len / wall, "loss": statistics.fmean(losses[-5:]),
            "bytes_per_step": sent[0] / steps, "skipped": sum(r.skipped for r in last),
            "skipped_after_first_good": sum(r.skipped for r in last[first_good:]),
            "steps_after_first_good": len(last) - first_good, "scale": last[-1].loss_scale}


def _history(steps: int) -> dict:
    from atoll.coordinator.history import KEEP_FULL, MAX_BUCKETS, Sample
    from atoll.coordinator.store import SqliteStore

    with TemporaryDirectory() as tmp:
        store = SqliteStore(Path(tmp) / "state.db")
        times = []
        for k in range(steps):
            t0 = time.perf_counter()
            store.add_history(Sample(step=k, epoch=1, loss=5.0 / (1 + k / 1000), tokens_per_second=1000.0))
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        rows = store.history()
        read = time.perf_counter() - t0
        store.close()
    times.sort()
    return {"rows": len(rows), "bound": int(KEEP_FULL * 1.25) + MAX_BUCKETS + 1,
            "whole": rows[0].first == 0 and rows[-1].first == steps - 1 and sum(r.count for r in rows) == steps,
            "median_ms": 1e3 * times[len(times) // 2], "p99_ms": 1e3 * times[int(len(times) * 0.99)],
            "read_ms": 1e3 * read}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="model preset (default: tiny)")
    ap.add_argument("--steps", type=int, default=60, help="training steps per precision (default: 60)")
    ap.add_argument("--replicas", type=int, default=2, help="data-parallel replicas of each stage (default: 2)")
    ap.add_argument("--batch", type=int, default=16, help="global batch in sequences (default: 16)")
    ap.add_argument("--history-steps", type=int, default=100_000,
                    help="samples written into the history store (default: 100000)")
    args = ap.parse_args(argv)

    import torch

    from atoll.models import preset

    torch.manual_seed(0)
    model = preset(args.model)
    checks: list[tuple[str, bool]] = []
    print(f"part 1: {args.model}, 2 stages x {args.replicas} replicas, {args.steps} steps of {args.batch} x "
          f"{model.seq_len} tokens, torch {torch.__version__}, {torch.get_num_threads()} threads")
    results = {p: _train(model, p, args.steps, args.replicas, args.batch) for p in ("fp32", "bf16", "fp16")}
    base = results["fp32"]
    print(f"  {'PRECISION':9}  {'TOKENS/S':>9}  {'VS-FP32':>7}  {'LOSS-AT-END':>11}  {'BOUNDARY-BYTES/STEP':>19}  "
          f"{'SKIPPED':>7}  {'LOSS-SCALE':>10}")
    for p, r in results.items():
        scale = f"{r['scale']:g}" if r["scale"] is not None else "-"
        print(f"  {p:9}  {r['tokens_per_s']:9,.0f}  {r['tokens_per_s'] / base['tokens_per_s']:6.2f}x  "
              f"{r['loss']:11.4f}  {r['bytes_per_step']:19,.0f}  {r['skipped']:7d}  {scale:>10}")
    for p in ("bf16", "fp16"):
        r = results[p]
        rel = abs(r["loss"] - base["loss"]) / base["loss"]
        checks.append((f"{p} loss at the end within 3% of fp32's ({100 * rel:.2f}%)", rel <= 0.03))
        ratio = r["bytes_per_step"] / base["bytes_per_step"]
        checks.append((f"{p} boundary bytes half of fp32's ({ratio:.3f}x)", abs(ratio - 0.5) < 1e-6))
    f16 = results["fp16"]
    share = f16["skipped_after_first_good"] / max(1, f16["steps_after_first_good"])
    checks.append((f"fp16 skips at most 10% of its steps after the first good one ({100 * share:.1f}%)",
                   share <= 0.10))

    h = _history(args.history_steps)
    print(f"\npart 2: {args.history_steps:,} steps into the SQLite history: {h['rows']} rows held (bound {h['bound']}), "
          f"add median {h['median_ms']:.3f} ms, p99 {h['p99_ms']:.3f} ms; whole history read in {h['read_ms']:.1f} ms")
    checks.append((f"history rows within the bound ({h['rows']} <= {h['bound']})", h["rows"] <= h["bound"]))
    checks.append(("history holds the first and last steps and every sample", h["whole"]))
    checks.append((f"median add under 2 ms ({h['median_ms']:.3f} ms)", h["median_ms"] < 2.0))

    print()
    for what, ok in checks:
        print(f"  [{'x' if ok else ' '}] {what}")
    met = sum(ok for _, ok in checks)
    print(f"targets met: {met}/{len(checks)}")
    return 0 if met == len(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
