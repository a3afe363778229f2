"""Models benchmark: a Llama-shaped model through Atoll's pipeline against plain transformers, and BPE
against bytes.

    .venv/bin/python -m bench.models [--steps 30] [--d-model 256 --layers 8 --seq 128 --batch 16]

1. Speed and parity. A Llama-shaped model (RMSNorm, RoPE, grouped-query attention with 4 heads to 2 kv
   heads' ratio, SwiGLU MLP, untied head; byte vocabulary) is initialised once by `transformers` and saved
   as safetensors. The baseline trains that `LlamaForCausalLM` in one process with plain PyTorch: AdamW,
   clipping and the job's learning-rate schedule, one whole batch per step, torch using every core. Atoll
   trains the same job (`[model] pretrained` = that folder) as a pinned 2-stage plan: two OS processes,
   each one node (a PlanRunner with its own gRPC peer server), cut where the spec's FLOPs balance,
   activations over gRPC (identity codec), 1F1B over 4 micro-batches, each process with half the cores.
   tokens/s: global batch x seq_len over the median step time of the steady state (steps after the first
   fifth): the baseline's own step wall time, Atoll's interval between consecutive steps of its last stage.
   Parity: the loss at every step, Atoll against the baseline.
2. BPE against bytes. `atoll tokenizer train` (node.tokenizer.train_bpe) trains a byte-level BPE on the
   shipped corpus; the same model shape then trains `--steps` steps through Atoll's one-process path
   (node.local.train_local: its dataset, tokenizer, schedule) with the BPE and with bytes. Per-token losses
   are not comparable across tokenizers, so both are shown per byte of UTF-8 text as well: bits per byte =
   loss (nats per token) / ln 2 x tokens per byte of the corpus (1 for bytes). Printed, not a target: after
   the same number of steps the BPE run has seen more text.

Targets: Atoll 2-stage tokens/s >= 0.8x the one-process baseline; Atoll's loss at every step within 1e-3
relative of the baseline's (fp32; measured differences in tests/test_hf_models.py are about 1e-7 over 6
steps, a longer run lets rounding differences of the two summation orders grow). Ends with
`targets met: N/M`. On a shared machine timings are noisy; run it on a quiet one for figures to keep.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

from atoll.job import JobSpec

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "atoll" / "data" / "genesis-exodus.txt"
SPEED_RATIO = 0.8
LOSS_RTOL = 1e-3


def _hf_config(args: argparse.Namespace, vocab: int) -> dict:
    return {"model_type": "llama", "vocab_size": vocab, "hidden_size": args.d_model,
            "intermediate_size": args.ffn or int(8 * args.d_model / 3 / 32 + 1) * 32,
            "num_hidden_layers": args.layers, "num_attention_heads": args.heads, "num_key_value_heads": args.heads // 2,
            "max_position_embeddings": args.seq, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": False}


def _job(args: argparse.Namespace, *, pretrained: Path | None = None, model: str = "", tokenizer: str = "bytes",
         steps: int | None = None) -> JobSpec:
    text = f"""
[job]
name = "models-bench"
[model]
{f'pretrained = "{pretrained}"' if pretrained else model}
[data]
source = "builtin"
tokenizer = "{tokenizer}"
[train]
global_batch = {args.batch}
seq_len = {args.seq}
micro_batch = {args.batch // 4}
steps = {steps or args.steps}
lr = 1e-3
warmup = 2
[compression]
mode = "identity"
"""
    return JobSpec.from_toml(text)


def _median_steady(times: list[float]) -> float:
    return statistics.median(times[len(times) // 5:] or times)


# --- the one-process baseline: plain transformers ------------------------------------------------------


def baseline(job: JobSpec, folder: Path, threads: int) -> tuple[list[float], list[float]]:
    """(losses, step seconds) of the transformers model trained in this process with `threads` torch threads."""
    import torch.nn.functional as F
    import transformers

    from atoll.node.datasets import open_dataset
    from atoll.node.runner import learning_rate, stage_config

    torch.set_num_threads(threads)
    t = job.train
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    cfg = stage_config(job, t.global_batch // t.micro_batch, timedelta(seconds=60))
    opt = torch.optim.AdamW(hf.parameters(), lr=t.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=t.weight_decay,
                            foreach=False)
    data = open_dataset(job.data, seq_len=t.seq_len, seed=t.seed, vocab_size=job.model.vocab_size)
    losses, times = [], []
    for step in range(t.steps):
        b = data.global_batch(step, t.global_batch)
        start = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = learning_rate(job, step)
        opt.zero_grad(set_to_none=True)
        logits = hf(b.inputs).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), b.targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), t.grad_clip)
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    return losses, times


# --- Atoll: two node processes on a pinned plan ------------------------------------------------------


def _node(node_id: str, job_toml: str, threads: int, inbox, outbox) -> None:
    """One node in its own process: a peer server, then the plan it is sent, reporting each step."""
    import threading

    from atoll.node.peer import PeerServer
    from atoll.node.runner import PlanRunner, RunContext
    from atoll.plan import Plan

    torch.set_num_threads(threads)
    job = JobSpec.from_toml(job_toml)
    server = PeerServer(node_id=node_id, listen="127.0.0.1:0", token="bench")
    try:
        outbox.put(("address", node_id, server.address))
        plan = Plan.from_json(inbox.get(timeout=120))

        def report(m) -> bool:
            outbox.put(("step", node_id, (m.step, m.stage, m.loss, m.unix_time, m.step_seconds)))
            return False

        with tempfile.TemporaryDirectory() as ckpt:
            ctx = RunContext(node_id=node_id, job=job, peer_server=server, checkpoint_dir=Path(ckpt),
                             report_step=report, report_checkpoint=lambda c: None, token="bench",
                             timeout=timedelta(seconds=120))
            PlanRunner(ctx, plan).run(threading.Event())
        outbox.put(("done", node_id, ""))
    except BaseException as e:  # reported to the parent, which fails the run with it
        outbox.put(("error", node_id, f"{type(e).__name__}: {e}"))
    finally:
        server.stop()


def balanced_cut(job: JobSpec) -> int:
    """The layer boundary that best balances the two stages' forward + backward FLOPs."""
    spec = job.model_spec
    total = spec.num_layers

    def cost(a: int, b: int) -> float:
        return sum(spec.slice_flops_per_token(a, b))

    return min(range(1, total), key=lambda c: max(cost(0, c), cost(c, total)))


def atoll_two_stages(job: JobSpec, threads: int, timeout: float) -> tuple[list[float], list[float], int]:
    """(losses, step intervals of the last stage, cut) of the job trained by two node processes over gRPC."""
    import torch.distributed as dist

    from atoll.plan import PipelinePlan, Plan, StagePlan

    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    inboxes = {n: ctx.Queue() for n in ("a", "b")}
    text = job.to_toml()
    procs = [ctx.Process(target=_node, args=(n, text, threads, inboxes[n], outbox), daemon=True) for n in inboxes]
    for p in procs:
        p.start()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    cut = balanced_cut(job)
    total = job.model.n_layers + 2
    rows: dict[int, tuple] = {}
    try:
        addresses: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        done: set[str] = set()

        def receive() -> tuple:
            try:
                kind, node, value = outbox.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the two node processes did not finish {job.train.steps} steps in {timeout:.0f}s; "
                                   "raise --timeout or lower --steps") from None
            if kind == "error":
                raise RuntimeError(f"node {node} failed: {value}")
            return kind, node, value

        while len(addresses) < 2:
            kind, node, value = receive()
            if kind == "address":
                addresses[node] = value
        stages = [StagePlan(island="local", layers=(0, cut), dp=1, nodes=["a"]),
                  StagePlan(island="local", layers=(cut, total), dp=1, nodes=["b"])]
        t = job.train
        plan = Plan(model=job.model.name, global_batch=t.global_batch, seq_len=t.seq_len,
                    pipelines=[PipelinePlan(micro_batch=t.micro_batch, num_micro_batches=t.global_batch // t.micro_batch,
                                            stages=stages)],
                    epoch=1, job_id=job.id, node_addresses=addresses, rendezvous=f"127.0.0.1:{store.port}")
        for q in inboxes.values():
            q.put(plan.to_json())
        while len(done) < 2:
            kind, node, value = receive()
            if kind == "done":
                done.add(node)
            elif kind == "step" and value[1] == 1:  # the last stage reports the loss
                rows[value[0]] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    steps = sorted(rows)
    losses = [rows[s][2] for s in steps]
    gaps = [rows[b][3] - rows[a][3] for a, b in zip(steps, steps[1:]) if b == a + 1]
    return losses, gaps, cut


# --- BPE against bytes -----------------------------------------------------------------------------


def tokenizer_losses(args: argparse.Namespace, out: Path) -> dict[str, tuple[float, float]]:
    """Per tokenizer: (mean loss in nats per token over the last fifth of the steps, bits per byte)."""
    from atoll.node.local import train_local
    from atoll.node.tokenizer import load_tokenizer, train_bpe

    torch.set_num_threads(args.threads)
    bpe = train_bpe([CORPUS], vocab_size=args.bpe_vocab, out=out / "bpe.json")
    text = CORPUS.read_text(encoding="utf-8")
    nbytes = len(text.encode("utf-8"))
    results = {}
    for name, tok, vocab in (("bytes", "bytes", 256), (f"bpe-{bpe.vocab_size}", str(out / "bpe.json"), bpe.vocab_size)):
        cfg = _hf_config(args, vocab)
        model = "\n".join(f"{k} = {v}" for k, v in {
            "style": '"llama"', "vocab_size": vocab, "d_model": cfg["hidden_size"], "n_layers": cfg["num_hidden_layers"],
            "n_heads": cfg["num_attention_heads"], "n_kv_heads": cfg["num_key_value_heads"],
            "ffn_hidden": cfg["intermediate_size"], "seq_len": args.seq}.items())
        job = _job(args, model=model, tokenizer=tok, steps=args.tokenizer_steps)
        losses, _ = train_local(job)
        tail = losses[len(losses) - max(1, len(losses) // 5):]
        per_token = sum(tail) / len(tail)
        tokens_per_byte = 1.0 if tok == "bytes" else len(load_tokenizer(tok).encode(text)) / nbytes
        results[name] = (per_token, per_token / math.log(2) * tokens_per_byte)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps of the speed/parity runs (default 30)")
    p.add_argument("--tokenizer-steps", type=int, default=0, help="steps of each tokenizer run (default: --steps)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8, help="attention heads; kv heads are half of them (GQA)")
    p.add_argument("--ffn", type=int, default=0, help="SwiGLU hidden width (default: 8/3 d_model, rounded to 32)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="global batch (4 micro-batches)")
    p.add_argument("--bpe-vocab", type=int, default=1024)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="cores for the baseline (each of "
                   "Atoll's two processes gets half)")
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    if args.batch % 4:
        p.error("--batch must be a multiple of 4 (the runs use 4 micro-batches)")
    args.tokenizer_steps = args.tokenizer_steps or args.steps
    import transformers

    transformers.utils.logging.disable_progress_bar()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**_hf_config(args, 256)))
        hf.save_pretrained(folder)
        del hf
        job = _job(args, pretrained=folder)
        c = job.model
        print(f"model: Llama-shaped, d_model {c.d_model}, {c.n_layers} blocks, {c.n_heads} heads / {c.kv_heads} kv "
              f"heads, SwiGLU {c.ffn}, vocab {c.vocab_size}, {job.model_spec.total_params / 1e6:.1f}M parameters; "
              f"global batch {job.train.global_batch} x {job.train.seq_len} tokens, {job.train.steps} steps; "
              f"{args.threads} cores (load average {os.getloadavg()[0]:.1f})")
        base_losses, base_times = baseline(job, folder, args.threads)
        atoll_losses, atoll_gaps, cut = atoll_two_stages(job, max(1, args.threads // 2), args.timeout)
        tokens = job.train.global_batch * job.train.seq_len
        base_tps = tokens / _median_steady(base_times)
        atoll_tps = tokens / _median_steady(atoll_gaps) if atoll_gaps else 0.0
        ratio = atoll_tps / base_tps
        print(f"\n{'run':<44}{'tokens/s':>10}{'first loss':>12}{'last loss':>12}")
        print(f"{'one process, transformers (baseline)':<44}{base_tps:>10.0f}{base_losses[0]:>12.4f}"
              f"{base_losses[-1]:>12.4f}")
        print(f"{f'Atoll, 2 stages in 2 processes (cut at {cut})':<44}{atoll_tps:>10.0f}{atoll_losses[0]:>12.4f}"
              f"{atoll_losses[-1]:>12.4f}")
        rel = [abs(a - b) / abs(b) for a, b in zip(atoll_losses, base_losses)]
        worst = max(rel) if rel and len(atoll_losses) == len(base_losses) else float("inf")
        print(f"speed: Atoll {ratio:.2f}x the baseline (target >= {SPEED_RATIO}x)")
        print(f"parity: largest relative loss difference over {len(rel)} steps {worst:.2e} (target <= {LOSS_RTOL:g})")

        print("\nBPE against bytes (the same shape, Atoll's one-process path, "
              f"{args.tokenizer_steps} steps, losses of the last fifth of the steps):")
        print(f"{'tokenizer':<14}{'nats/token':>12}{'bits/byte':>12}")
        for name, (per_token, bpb) in tokenizer_losses(args, Path(tmp)).items():
            print(f"{name:<14}{per_token:>12.4f}{bpb:>12.4f}")

    met = [ratio >= SPEED_RATIO, worst <= LOSS_RTOL]
    print(f"\ntargets met: {sum(met)}/{len(met)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
