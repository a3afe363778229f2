"""Tensor-parallel benchmark: one stage sharded over tp = 2 processes against the same stage unsharded.

    python -m bench.tp [--model small --seq 128 --batch 8 --micro-batches 2 --steps 4]
    (or python bench/tp.py, from any folder)

Runs, each in its own OS processes (torch.distributed over gloo on CPU, NCCL with --device cuda: gloo between
ranks that share a GPU), the whole model as one stage, the same global batch, micro-batches, seed and AdamW
with clipping:
- tp=1: one process, unsharded, one torch thread;
- tp=2: two processes, one torch thread each, the stage sharded by `atoll.node.tp` (Megatron layout with
  DTensor; vocab-parallel embedding and head);
- tp=2 x dp=2 with ZeRO-1: four processes, two replicas of the tp=2 stage, each on half the batch, each tp rank's
  AdamW states sharded over the two replicas of its tp rank (`atoll.node.zero`), the clipping norm summed over
  all four (each stage counted once).
The first step of each run is a warm-up; figures are means over the others.

Printed: per-step losses of both; per step, the wall time and the CPU seconds of the stage's own thread
(forward and backward compute: a rank's share of the work, ideally half of tp=1's, and unlike wall time
unaffected by other processes on the machine; gloo's transfers run on threads of their own); what each tp
rank holds (parameters, gradients and AdamW moments, against the unsharded stage); and the bytes the tp
collectives move per step (counted from the sharding plan: two all-reduces of the residual stream per
block forward and two backward, the vocab-parallel embedding's all-reduce and the head's logits
all-gather). A multi-threaded one-process baseline is left out: on a busy shared CPU its threads wait on
each other's time slices and its wall time says more about the machine than about tensor parallelism.

Targets: the tp=2 losses (and the ZeRO run's, the mean of its two replicas') equal the one-process losses within
1e-4 relative (DTensor reorders float sums); each tp rank holds at most 60% of the unsharded stage's parameter,
gradient and optimizer bytes, and at most 47% with ZeRO-1 over two replicas (its AdamW moments halved again,
its gradient's owned chunk held beside the whole gradient while it is reduced: 1/2 + 1/2 + 1/4 + 2/4 of the
unsharded parameter, gradient and two moments, 44%, plus the buckets staged at once). Speed is
reported, not a target: on a CPU the two ranks share a memory bus and their all-reduces are loopback gloo,
so tp=2 brings no speed-up over one process with the same cores; the speed claim needs GPUs joined by
NVLink (run with --device cuda on a machine with two GPUs). Ends with `targets met: N/M`.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a path (python bench/tp.py): imports resolve from the checkout
    sys.path.insert(0, str(ROOT))

RTOL = 1e-4
MEMORY_TARGET = 0.6
ZERO_MEMORY_TARGET = 0.47


def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _worker(args: dict) -> None:
    """One rank: train the whole model as one stage (sharded when tp > 1) and report losses, times, bytes."""
    import torch
    import torch.distributed as dist

    from atoll.models import preset
    from atoll.node.inprocess import InProcessLinks
    from atoll.node.model import build_slice
    from atoll.node.norm_exchange import DistNormExchange
    from atoll.node.stage import PipelineStage, StageConfig, build_optimizer
    from atoll.node.synthetic import synthetic_batch
    from atoll.node.dataparallel import gloo_group
    from atoll.node.norm_exchange import OncePerStage
    from atoll.node.tp import TensorParallel
    from atoll.node.zero import ZeroConfig, ZeroOptimizer

    torch.set_num_threads(args["threads"])
    tp_size, dp = args["tp"], args.get("dp", 1)
    rank, replica = args["rank"] % tp_size, args["rank"] // tp_size  # rank: the tp rank; processes replica-major
    # rank r on GPU r, round robin where there are fewer GPUs than ranks (ranks sharing one meet over gloo)
    device = torch.device("cpu") if args["device"] == "cpu" else \
        torch.device("cuda", args["rank"] % torch.cuda.device_count())
    config = replace(preset(args["model"]), seq_len=args["seq"])
    cfg = StageConfig(micro_batches=args["micro_batches"], lr=3e-3, max_grad_norm=1.0,
                      recv_timeout=timedelta(seconds=120), collective_timeout=timedelta(seconds=120))
    module = build_slice(config, 0, config.n_layers + 2, seed=args["seed"], device=device)
    optimizer = build_optimizer(module, cfg)
    tp = None
    norm = None
    timeout = timedelta(seconds=120)
    if tp_size > 1:
        store = dist.TCPStore("127.0.0.1", args["store_port"], is_master=False, timeout=timedelta(seconds=60))
        tp = TensorParallel.join(store, f"bench-tp-{replica}/", rank=rank, size=tp_size, device=device,
                                 timeout=timeout)
        optimizer = tp.shard(module, optimizer, lambda m: build_optimizer(m, cfg))
        if dp == 1:  # a one-stage pipeline: the norm group is the tp group
            norm = DistNormExchange(tp.group, device=tp.device)
        else:  # every process of the stage; the replicas' ZeRO norms are equal, replica 0's count
            norm = OncePerStage(DistNormExchange(gloo_group(store, "bench-norm/", rank=args["rank"], size=dp * tp_size,
                                                            timeout=timeout), device=tp.device), counts=replica == 0)
            peers = gloo_group(store, f"bench-zero-{rank}/", rank=replica, size=dp, timeout=timeout)
            optimizer = ZeroOptimizer.from_adamw(optimizer, peers, ZeroConfig(
                stage=1, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, grad_scale=1 / dp),
                timeout=timeout, count_replicated=rank == 0)
    stage = PipelineStage(module, stage=0, num_stages=1, transport=InProcessLinks(1).transport(0), config=cfg,
                          optimizer=optimizer, norm_exchange=norm, tp=tp)
    losses, times, cpu = [], [], []
    rows = args["batch"] // dp
    for step in range(args["steps"]):
        batch = synthetic_batch(vocab_size=config.vocab_size, batch=args["batch"], seq_len=config.seq_len,
                                seed=args["seed"], step=step)
        if dp > 1:  # this replica's rows of the batch
            batch = replace(batch, inputs=batch.inputs[replica * rows:(replica + 1) * rows],
                            targets=batch.targets[replica * rows:(replica + 1) * rows])
        r = stage.train_step(step, batch)
        losses.append(r.loss)
        times.append(r.step_seconds)
        cpu.append(sum(op.cpu for op in r.timeline))
    params = list(module.parameters())
    if isinstance(optimizer, ZeroOptimizer):  # the flat gradient is freed after each step: its peak counts
        state = {"params": _local_bytes(params), "grads": optimizer.peak_grad_bytes,
                 "optimizer": optimizer.optimizer_state_bytes()}
    else:
        state = {"params": _local_bytes(params), "grads": _local_bytes(p.grad for p in params if p.grad is not None),
                 "optimizer": _local_bytes(v for st in stage.optimizer.state.values() for v in st.values()
                                           if torch.is_tensor(v) and v.ndim > 0)}
    if tp is not None:
        tp.close()
    _say({"rank": args["rank"], "losses": losses, "times": times, "cpu": cpu, "bytes": state})


def _read(proc: subprocess.Popen, deadline: float) -> dict:
    assert proc.stdout is not None
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"worker {proc.pid} said nothing in time")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {proc.pid} exited with {proc.wait(5)}")
        if line.startswith("{"):
            return json.loads(line)


def _run(common: dict, tp: int, threads: int, timeout: float, dp: int = 1) -> list[dict]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(
        {**common, "tp": tp, "dp": dp, "rank": r, "threads": threads, "store_port": store.port})],
        stdout=subprocess.PIPE, text=True, env=env) for r in range(tp * dp)]
    try:
        deadline = time.monotonic() + timeout
        out = sorted((_read(p, deadline) for p in procs), key=lambda o: o["rank"])
        for p in procs:
            p.wait(30)
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)


def collective_bytes(config, *, batch: int, seq: int, micro_batches: int, tp: int, dtype_bytes: int = 4) -> int:
    """Bytes one rank sends and receives in the tp collectives of one step (ring all-reduce: 2 (t-1)/t of the
    tensor each way; all-gather: (t-1)/t of the whole)."""
    rows = batch // micro_batches * seq  # tokens per micro-batch
    residual = rows * config.d_model * dtype_bytes
    reduce, gather = 2 * (tp - 1) / tp, (tp - 1) / tp
    per_mb = config.n_layers * 4 * reduce * residual  # proj + out forward, qkv + fc input gradients backward
    if not config.tied_head:
        per_mb += reduce * residual  # the vocab-parallel embedding's lookup
        per_mb += gather * rows * config.vocab_size * dtype_bytes * 2  # the head's logits, and their gradient's
    return int(per_mb * micro_batches)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", help="model preset (default: small)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length (default: 128)")
    ap.add_argument("--batch", type=int, default=8, help="global batch, sequences (default: 8)")
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (default: 2)")
    ap.add_argument("--steps", type=int, default=4, help="steps, the first a warm-up (default: 4)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu (gloo), or cuda: rank r on GPU r (NCCL), round robin where there are fewer GPUs "
                         "(ranks sharing one GPU meet over gloo)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _worker(json.loads(a.worker))
        return 0
    if a.steps < 2:
        ap.error("--steps must be at least 2 (the first is a warm-up)")

    from atoll.models import preset

    config = replace(preset(a.model), seq_len=a.seq)
    common = {"model": a.model, "seq": a.seq, "batch": a.batch, "micro_batches": a.micro_batches,
              "steps": a.steps, "seed": 0, "device": a.device}
    print(f"model {config.name} ({config.style}): d_model {config.d_model}, {config.n_layers} blocks, "
          f"{config.n_heads} heads, vocab {config.vocab_size}; batch {a.batch} x {a.seq} tokens in "
          f"{a.micro_batches} micro-batches, {a.steps} steps (first a warm-up), device {a.device}")
    if a.batch % (2 * a.micro_batches):
        ap.error("--batch must split into two replicas of --micro-batches micro-batches (the ZeRO run)")
    runs = {}
    for name, tp, dp in (("tp=1, 1 process", 1, 1), ("tp=2, 2 processes", 2, 1),
                         ("tp=2 x dp=2 with ZeRO-1, 4 processes", 2, 2)):
        t0 = time.monotonic()
        runs[name] = _run(common, tp, threads=1, timeout=600, dp=dp)
        print(f"  ran {name} (1 torch thread each) in {time.monotonic() - t0:.1f} s")
    base, sharded, zeroed = runs.values()

    print("\nlosses per step (tp=1 | tp=2 rank 0 | relative difference)")
    worst = 0.0
    for k, (x, y) in enumerate(zip(base[0]["losses"], sharded[0]["losses"])):
        rel = abs(y - x) / abs(x)
        worst = max(worst, rel)
        print(f"  step {k}: {x:.6f} | {y:.6f} | {rel:.1e}")
    ranks_agree = all(r["losses"] == sharded[0]["losses"] for r in sharded)
    # the ZeRO run's loss: the mean of its two replicas' (each on half the batch), as one process sees the batch
    zero_losses = [(x + y) / 2 for x, y in zip(zeroed[0]["losses"], zeroed[2]["losses"])]
    zero_worst = max(abs(y - x) / abs(x) for x, y in zip(base[0]["losses"], zero_losses))
    zero_agree = all(r["losses"] == zeroed[2 * (r["rank"] // 2)]["losses"] for r in zeroed)
    print(f"  tp=2 x dp=2 with ZeRO-1 (the replicas' mean): worst relative difference {zero_worst:.1e}")

    def mean(out: list[dict], key: str) -> float:  # the slowest rank's mean over the measured steps
        return max(sum(r[key][1:]) / (len(r[key]) - 1) for r in out)

    t1, t2 = mean(base, "times"), mean(sharded, "times")
    c1, c2 = mean(base, "cpu"), mean(sharded, "cpu")
    print("\nper step (mean over the measured steps; tp=2: its slowest rank)")
    print(f"  tp=1: wall {t1 * 1e3:8.1f} ms, compute CPU {c1 * 1e3:8.1f} ms")
    print(f"  tp=2: wall {t2 * 1e3:8.1f} ms, compute CPU {c2 * 1e3:8.1f} ms per rank")
    print(f"  speed-up {t1 / t2:.2f}x (ideal 2x); a rank's compute is {c2 / c1:.0%} of tp=1's (ideal 50%)")
    comm = collective_bytes(config, batch=a.batch, seq=a.seq, micro_batches=a.micro_batches, tp=2)
    print(f"  tp collectives: {comm / 2**20:.1f} MiB per rank per step, over loopback gloo")
    print("  speed is not a target here: two CPU processes share the machine's cores and memory bus (and this "
          "one is shared with others); the speed claim needs GPUs joined by NVLink (--device cuda, two GPUs)")

    whole = base[0]["bytes"]
    total = sum(whole.values())
    print("\nper rank: parameters + gradients + AdamW moments")
    print(f"  tp=1      : {total / 2**20:7.2f} MiB ({', '.join(f'{k} {v / 2**20:.2f}' for k, v in whole.items())})")
    share = 0.0
    for r in sharded:
        mine = sum(r["bytes"].values())
        share = max(share, mine / total)
        print(f"  tp=2 rank {r['rank']}: {mine / 2**20:7.2f} MiB ({mine / total:.0%} of tp=1)")

    zero_share = 0.0
    for r in zeroed:
        mine = sum(r["bytes"].values())
        zero_share = max(zero_share, mine / total)
        print(f"  tp=2 x dp=2 ZeRO-1 process {r['rank']} (replica {r['rank'] // 2}, tp rank {r['rank'] % 2}): "
              f"{mine / 2**20:7.2f} MiB ({mine / total:.0%} of tp=1; "
              f"{', '.join(f'{k} {v / 2**20:.2f}' for k, v in r['bytes'].items())})")

    targets = [
        (f"tp=2 losses within {RTOL:g} of one process", worst <= RTOL and ranks_agree,
         f"worst relative difference {worst:.1e}" + ("" if ranks_agree else ", ranks disagree")),
        (f"each tp rank holds <= {MEMORY_TARGET:.0%} of the stage's state", share <= MEMORY_TARGET, f"{share:.0%}"),
        (f"tp=2 x dp=2 ZeRO-1 losses within {RTOL:g} of one process", zero_worst <= RTOL and zero_agree,
         f"worst relative difference {zero_worst:.1e}" + ("" if zero_agree else ", tp ranks disagree")),
        (f"with ZeRO-1 over 2 replicas each tp rank holds <= {ZERO_MEMORY_TARGET:.0%} of the stage's state",
         zero_share <= ZERO_MEMORY_TARGET, f"{zero_share:.0%}"),
    ]
    print()
    for what, ok, detail in targets:
        print(f"  [{'met' if ok else 'MISSED'}] {what}: {detail}")
    met = sum(ok for _, ok, _ in targets)
    missed = [what for what, ok, _ in targets if not ok]
    print(f"targets met: {met}/{len(targets)}" + (f" (missed: {'; '.join(missed)})" if missed else ""))
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
