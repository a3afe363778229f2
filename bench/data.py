"""Streamed datasets: packed tokens/s and peak memory against tokenizing the whole corpus in memory, and
the time to resume mid-corpus from a checkpoint's restart point against reading from the first row.

    python -m bench.data [--mb 64] [--vocab 4096]

A JSONL and a Parquet corpus of `--mb` MB (the shipped text's paragraphs, repeated with a varying prefix) are
written to a temporary folder and a byte-level BPE is trained on a slice of it. Each measurement runs in a
fresh process so its peak resident memory is its own (the growth over the process's memory after imports):
- baseline: read every row into a list, tokenize them with one `encode_batch`, concatenate the tokens;
- streamed: `open_dataset` packs the same rows into global batches of 32 x 512 tokens, step after step, to
  the end of the first epoch (a chunk of rows read and tokenized at a time).
Resume: a fresh dataset reads step k at 3/4 of the corpus, once from the first row and once from the restart
point a checkpoint there would record.

Targets: streamed JSONL >= 0.5x the baseline's tokens/s (it also packs and cuts batches); its peak memory
growth <= 0.25x the baseline's; resuming from the restart point >= 5x faster than from the first row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/data.py`: make `bench` and the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BATCH, SEQ = 32, 512


def _write_corpus(folder: Path, mb: int) -> tuple[Path, Path, int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from atoll.node.data import load_text

    paras = [p for p in load_text("builtin").split("\n\n") if p.strip()]
    rows, size, i = [], 0, 0
    while size < mb * 1e6:
        text = f"Record {i}: " + paras[i % len(paras)]
        rows.append(text)
        size += len(text.encode("utf-8"))
        i += 1
    jsonl = folder / "corpus.jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({"text": r}) + "\n")
    parquet = folder / "corpus.parquet"
    pq.write_table(pa.table({"text": rows}), parquet, row_group_size=10_000)
    return jsonl, parquet, len(rows)


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak() -> int:
    import resource

    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kb * 1024


def _measure(variant: str, source: str, tokenizer: str) -> dict:
    """Runs in its own process: {"tokens", "seconds", "growth"} of one variant."""
    import numpy as np
    import torch  # noqa: F401 - imported before the memory baseline, as training would have it

    from atoll.job import DataSpec
    from atoll.node.datasets import open_dataset
    from atoll.node.tokenizer import HFTokenizer

    tok = HFTokenizer(tokenizer)
    base = _rss()
    t0 = time.perf_counter()
    if variant == "baseline":
        with open(source, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f]
        ids = tok.encode_batch(texts)
        flat = np.concatenate([np.asarray(r + [tok.eos_id], dtype=np.int64) for r in ids])
        tokens = int(flat.size)
    else:
        ds = open_dataset(DataSpec(source=source, tokenizer=tokenizer), seq_len=SEQ)
        tokens, k = 0, 0
        while ds.position(k * BATCH).epoch == 0:
            tokens += ds.rows(k, BATCH, 0, BATCH).inputs.numel()
            k += 1
    return {"tokens": tokens, "seconds": time.perf_counter() - t0, "growth": max(0, _peak() - base)}


def _resume(source: str, tokenizer: str, step: int, folder: str, mark_every: int) -> dict:
    """Runs in its own process: seconds to step `step`'s batch from the first row and from a restart point
    (remembered every `mark_every` tokens)."""
    import atoll.node.datasets
    from atoll.job import DataSpec
    from atoll.node.datasets import open_dataset

    atoll.node.datasets.MARK_EVERY = mark_every

    spec = DataSpec(source=source, tokenizer=tokenizer)
    writer = open_dataset(spec, seq_len=SEQ)
    writer.rows(step, BATCH, 0, BATCH)
    writer.save_cursor(Path(folder), step * BATCH)
    out = {}
    for how in ("first row", "restart point"):
        ds = open_dataset(spec, seq_len=SEQ)
        t0 = time.perf_counter()
        if how == "restart point":
            assert ds.load_cursor(Path(folder))
        batch = ds.rows(step, BATCH, 0, BATCH)
        out[how] = time.perf_counter() - t0
        assert batch.inputs.shape == (BATCH, SEQ)
    return out


def _child(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent) + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "bench.data", "--child", *args], capture_output=True,
                         text=True, env=env, cwd=Path(__file__).resolve().parent.parent)
    if out.returncode != 0:
        raise RuntimeError(f"bench.data {args[0]} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=64, help="corpus size in MB (default 64)")
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary (default 4096)")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        result = _measure(*rest) if kind == "measure" else _resume(rest[0], rest[1], int(rest[2]), rest[3],
                                                                   int(rest[4]))
        print(json.dumps(result))
        return 0

    from atoll.node.datasets import MARK_EVERY
    from atoll.node.tokenizer import train_bpe

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        jsonl, parquet, n = _write_corpus(folder, args.mb)
        sample = folder / "sample.jsonl"
        with open(jsonl, encoding="utf-8") as src, open(sample, "w", encoding="utf-8") as dst:
            for _, line in zip(range(5000), src):
                dst.write(line)
        tok = train_bpe([sample], vocab_size=args.vocab, out=folder / "tokenizer.json")
        print(f"corpus: {n:,} rows, {args.mb} MB as JSONL and Parquet; BPE of {tok.vocab_size} tokens; batches of "
              f"{BATCH} x {SEQ} tokens")
        rows = {}
        for name, variant, src in (("in memory (baseline)", "baseline", jsonl), ("streamed JSONL", "streamed", jsonl),
                                   ("streamed Parquet", "streamed", parquet)):
            rows[name] = r = _child("measure", variant, str(src), str(folder / "tokenizer.json"))
            print(f"  {name:22s} {r['tokens'] / r['seconds'] / 1e6:7.2f} M tokens/s   peak memory growth "
                  f"{r['growth'] / 2**20:8.1f} MiB   ({r['tokens']:,} tokens in {r['seconds']:.1f} s)")
        base, streamed = rows["in memory (baseline)"], rows["streamed JSONL"]
        total_steps = streamed["tokens"] // (BATCH * SEQ)
        step = max(1, total_steps * 3 // 4)
        # restart points every MARK_EVERY tokens, or 1/16 of the corpus when it is smaller than 16 of them
        mark_every = min(MARK_EVERY, max(1, streamed["tokens"] // 16))
        res = _child("resume", str(jsonl), str(folder / "tokenizer.json"), str(step), str(folder), str(mark_every))
        print(f"  resume at step {step} of {total_steps}: from the first row {res['first row']:.2f} s, from the "
              f"checkpoint's restart point {res['restart point']:.2f} s (restart points every {mark_every:,} "
              f"tokens)")
    speed = (streamed["tokens"] / streamed["seconds"]) / (base["tokens"] / base["seconds"])
    memory = streamed["growth"] / max(base["growth"], 1)
    quicker = res["first row"] / max(res["restart point"], 1e-9)
    targets = [(f"streamed tokens/s {speed:.2f}x the baseline's (>= 0.5x)", speed >= 0.5),
               (f"streamed peak memory growth {memory:.2f}x the baseline's (<= 0.25x)", memory <= 0.25),
               (f"resume from the restart point {quicker:.1f}x quicker (>= 5x)", quicker >= 5)]
    for text, ok in targets:
        print(f"  {'met   ' if ok else 'MISSED'} {text}")
    met = sum(ok for _, ok in targets)
    missed = [t for t, ok in targets if not ok]
    print(f"targets met: {met}/{len(targets)}" + (f" (missed: {'; '.join(missed)})" if missed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
