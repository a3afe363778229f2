"""Codec throughput, ratio and error on 16 MiB tensors, one thread, next to memcpy and `.to(float16)`; then the
outer sync's codecs on real pseudo-gradients: WAN bytes per round against int8 at the same H.

    python bench/codecs.py [--repeats 7] [--inner-steps 5]

Throughput is the tensor's own bytes over the best wall time of `--repeats` runs after a warm-up (the
minimum is the least disturbed by other processes on a shared machine; the median is printed beside it).
Speed targets are checked on the float32 Gaussian tensor, ratio and error targets on both Gaussian
tensors; every other row is for information.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from atoll.compression import CodecSpec, ErrorFeedback, get_codec
from atoll.models import preset, preset_spec
from atoll.modelspec import ModelConfig
from atoll.node.data import TokenDataset
from atoll.node.model import build_slice

MIB = 1 << 20
SPECS = [CodecSpec("identity"), CodecSpec("fp16"), CodecSpec("bf16"), CodecSpec("int8"), CodecSpec("int4"),
         CodecSpec("topk", topk_fraction=0.01), CodecSpec("int8", zstd_level=1)]


def _time(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best, median) seconds."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def _activations() -> torch.Tensor:
    """8 Mi float32 elements of the residual stream leaving one transformer block of atoll's own model
    (llama style, d_model 512, seeded initialisation) on random tokens: what a pipeline stage sends."""
    cfg = ModelConfig(name="bench", style="llama", vocab_size=4096, d_model=512, n_layers=1, n_heads=8, seq_len=256)
    stage = build_slice(cfg, 0, 2, seed=0).eval()  # the embedding and the first block
    ids = torch.randint(0, cfg.vocab_size, (64, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return stage(ids).reshape(-1).contiguous()


def _gaussian(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(16 * MIB // torch.empty((), dtype=dtype).element_size(), generator=g).to(dtype)


@dataclass
class Row:
    codec: str
    data: str
    encode: float
    """GB/s, best run."""
    decode: float
    ratio: float
    rel_l2: float
    max_abs: float
    encode_median: float
    decode_median: float


def _gbs(nbytes: int, seconds: tuple[float, float]) -> tuple[float, float]:
    return nbytes / seconds[0] / 1e9, nbytes / seconds[1] / 1e9


def measure(spec: CodecSpec, x: torch.Tensor, data: str, repeats: int) -> Row:
    codec = get_codec(spec)
    payload = codec.encode(x)
    y = codec.decode(payload, x.shape, x.dtype)
    nbytes = x.numel() * x.element_size()
    enc = _gbs(nbytes, _time(lambda: codec.encode(x), repeats))
    dec = _gbs(nbytes, _time(lambda: codec.decode(payload, x.shape, x.dtype), repeats))
    diff = y.float() - x.float()
    return Row(spec.label(), data, enc[0], dec[0], nbytes / memoryview(payload).nbytes,
               float(diff.norm() / x.float().norm()), float(diff.abs().max()), enc[1], dec[1])


def baselines(x: torch.Tensor, data: str, repeats: int) -> list[Row]:
    nbytes = x.numel() * x.element_size()
    dst = torch.empty_like(x)
    copy = _gbs(nbytes, _time(lambda: dst.copy_(x), repeats))
    half = _gbs(nbytes, _time(lambda: x.to(torch.float16), repeats))
    h = x.to(torch.float16)
    back = _gbs(nbytes, _time(lambda: h.to(x.dtype), repeats))
    diff = h.float() - x.float()
    return [Row("memcpy (baseline)", data, copy[0], copy[0], 1.0, 0.0, 0.0, copy[1], copy[1]),
            Row(".to(float16) (baseline)", data, half[0], back[0], nbytes / (h.numel() * 2),
                float(diff.norm() / x.float().norm()), float(diff.abs().max()), half[1], back[1])]


def targets(rows: list[Row]) -> list[tuple[str, bool]]:
    by = {(r.codec, r.data): r for r in rows}
    out: list[tuple[str, bool]] = []

    def check(name: str, value: float, op: str, bound: float) -> None:
        ok = value >= bound if op == ">=" else value <= bound
        out.append((f"{name} = {value:.3g} {op} {bound:g}", ok))

    g32 = "gaussian fp32"
    check("int8 encode GB/s", by["int8/64", g32].encode, ">=", 2)
    check("int8 decode GB/s", by["int8/64", g32].decode, ">=", 3)
    for c in ("fp16", "bf16"):
        check(f"{c} encode GB/s", by[c, g32].encode, ">=", 8)
        check(f"{c} decode GB/s", by[c, g32].decode, ">=", 8)
    check("topk 1% encode GB/s", by["topk/0.01", g32].encode, ">=", 0.5)
    check("topk 1% decode GB/s", by["topk/0.01", g32].decode, ">=", 0.5)
    check("int8 ratio vs fp32", by["int8/64", g32].ratio, ">=", 3.8)
    check("int4 ratio vs fp32", by["int4/64", g32].ratio, ">=", 7)
    check("topk 1% ratio vs fp32", by["topk/0.01", g32].ratio, ">=", 40)
    for data in (g32, "gaussian bf16"):
        check(f"int8 rel L2 ({data})", by["int8/64", data].rel_l2, "<=", 0.01)
        check(f"int4 rel L2 ({data})", by["int4/64", data].rel_l2, "<=", 0.12)
    return out


# --- the outer sync: pseudo-gradients across regions --------------------------------------------------------

OUTER_SPECS = [CodecSpec("int8"), CodecSpec("int4"), CodecSpec("topk", topk_fraction=0.02),
               CodecSpec("sparse2", topk_fraction=1 / 64), CodecSpec("sparse2", topk_fraction=1 / 64, zstd_level=3)]
OUTER_ROUNDS = 8


def pseudo_gradients(h: int, *, batch: int = 8, seq_len: int = 128, seed: int = 0) -> tuple[dict[str, torch.Tensor], int]:
    """Atoll's `small` model (8 blocks, d_model 256) trained `h` AdamW steps on the builtin corpus from its seeded
    initialisation: per parameter, the anchor minus the parameters (what a replica group sends at a round's end),
    and the tokens the round trained."""
    cfg = preset("small")
    model = build_slice(cfg, 0, cfg.n_layers + 2, seed=seed)
    data = TokenDataset.from_source("builtin", seq_len, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(h):
        b = data.global_batch(step, batch)
        loss = torch.nn.functional.cross_entropy(model(b.inputs).flatten(0, 1), b.targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: anchor[n] - p.detach() for n, p in model.named_parameters()}, h * batch * seq_len


@dataclass
class OuterRow:
    codec: str
    wire_bytes: int
    """One group's bytes of one round (every parameter, as encoded)."""
    ratio: float
    """float32 bytes over wire bytes."""
    rel_l2: float
    """Relative L2 error of one round's decoded pseudo-gradient."""
    lag: float
    """After OUTER_ROUNDS rounds of the same pseudo-gradient under error feedback: what is still held back (the
    residual) over one round's pseudo-gradient (L2)."""
    encode_s: float
    """Encoding one round, best of the repeats, one thread."""


def measure_outer(spec: CodecSpec, grads: dict[str, torch.Tensor], repeats: int) -> OuterRow:
    codec = get_codec(spec)
    payloads = {n: codec.encode(g) for n, g in grads.items()}
    wire = sum(memoryview(p).nbytes for p in payloads.values())
    raw = sum(g.numel() * 4 for g in grads.values())
    err = sum(float((codec.decode(payloads[n], g.shape, g.dtype) - g).norm() ** 2) for n, g in grads.items())
    total = sum(float(g.norm() ** 2) for g in grads.values())
    ef = ErrorFeedback(spec)
    for _ in range(OUTER_ROUNDS):
        for n, g in grads.items():
            ef.encode(n, g)
    held = sum(float(r.norm() ** 2) for n in grads if (r := ef.residual(n)) is not None)
    best, _ = _time(lambda: [codec.encode(g) for g in grads.values()], repeats)
    return OuterRow(spec.label(), wire, raw / wire, (err / total) ** 0.5, (held / total) ** 0.5, best)


def outer_report(h: int, repeats: int) -> list[tuple[str, bool]]:
    """Print the outer codecs' WAN bytes per round (and per token) against int8 at H = `h`; the targets."""
    grads, tokens = pseudo_gradients(h)
    numel = sum(g.numel() for g in grads.values())
    rows = [measure_outer(spec, grads, repeats) for spec in OUTER_SPECS]
    int8 = rows[0]
    print(f"\nouter sync: pseudo-gradients of the small model ({numel / 1e6:.2f} M parameters, {len(grads)} tensors) "
          f"after H={h} AdamW steps ({tokens:,} tokens a round), one group's round, one thread")
    header = (f"{'codec':<22} {'WAN bytes/round':>16} {'bytes/token':>12} {'fp32/wire':>10} {'vs int8':>8} "
              f"{'rel L2':>7} {f'held after {OUTER_ROUNDS}':>15} {'encode s':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.codec:<22} {r.wire_bytes:>16,} {r.wire_bytes / tokens:>12.2f} {r.ratio:>10.1f} "
              f"{int8.wire_bytes / r.wire_bytes:>7.1f}x {r.rel_l2:>7.3f} {r.lag:>15.2f} {r.encode_s:>9.3f}")
    print("(rel L2: one round's decoded pseudo-gradient against the true one; held after N: what error feedback still "
          "holds back after N rounds of it, in rounds' worth)")
    for name in ("1.3b", "7b"):
        n = preset_spec(name).total_params
        sizes = {s.label(): get_codec(s).payload_size(n, torch.float32) for s in OUTER_SPECS[:4]}
        print(f"  {name} ({n / 1e9:.2f} B parameters) per group per round: "
              + ", ".join(f"{k} {v / 1e6:,.0f} MB" for k, v in sizes.items()))
    by = {r.codec: r for r in rows}
    sparse = by["sparse2/0.0156"]
    out = [(f"sparse2 fp32/wire on pseudo-gradients = {sparse.ratio:.3g} >= 146", sparse.ratio >= 146),
           (f"sparse2 WAN bytes per round vs int8 at H={h} = {int8.wire_bytes / sparse.wire_bytes:.3g}x >= 8",
            int8.wire_bytes / sparse.wire_bytes >= 8)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per figure")
    parser.add_argument("--inner-steps", type=int, default=5, metavar="H",
                        help="inner steps of the round whose pseudo-gradients the outer codecs carry (default 5)")
    args = parser.parse_args()
    grads_h = args.inner_steps
    acts = _activations()  # captured with the default threads; every measurement below uses one
    torch.set_num_threads(1)
    inputs = [("gaussian fp32", _gaussian(torch.float32)), ("gaussian bf16", _gaussian(torch.bfloat16)),
              ("activations fp32", acts[: 4 * MIB].clone()), ("activations bf16", acts.to(torch.bfloat16))]
    rows: list[Row] = []
    for data, x in inputs:
        rows += baselines(x, data, args.repeats)
        rows += [measure(spec, x, data, args.repeats) for spec in SPECS]

    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, 16 MiB per tensor, best (median) of "
          f"{args.repeats} runs; GB/s of the tensor's own bytes; ratio = tensor bytes / payload bytes")
    header = (f"{'codec':<24} {'data':<17} {'encode GB/s':>19} {'decode GB/s':>19} {'ratio':>7} {'rel L2':>9} "
              f"{'max abs':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        enc = f"{r.encode:.2f} ({r.encode_median:.2f})"
        dec = f"{r.decode:.2f} ({r.decode_median:.2f})"
        print(f"{r.codec:<24} {r.data:<17} {enc:>19} {dec:>19} {r.ratio:7.2f} {r.rel_l2:9.2e} {r.max_abs:9.2e}")
    results = targets(rows) + outer_report(grads_h, max(1, args.repeats // 3))
    print()
    for text, ok in results:
        print(f"  [{'met' if ok else 'MISSED'}] {text}")
    missed = [text for text, ok in results if not ok]
    met = len(results) - len(missed)
    print(f"targets met: {met}/{len(results)}" + (f" (missed: {'; '.join(missed)})" if missed else ""))


if __name__ == "__main__":
    main()
