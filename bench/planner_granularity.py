"""What cuts finer than a block would give the planner: a block split into its attention and its MLP half.

    python -m bench.planner_granularity [--only NAME]

Stages are cut between whole blocks. A stage boundary inside a block, between the attention sublayer and the MLP
(each with its residual, so the activation that crosses it is the residual stream as between blocks), would let
the planner balance stages more finely. This benchmark measures what that is worth before the runtime is asked
for it: for each mixed-device scenario of `bench.planner`, it plans the model as it is and the same model with
every block described as two layers (attention: the q/k/v and output projections, the attention products, the
first norm; MLP: the two or three MLP matrices, the second norm; parameters and FLOPs add up to the block's), in
the same cost model and search, and prints both plans' tokens/s against the best published-strategy baseline, the
best naive baseline and the ceiling (`bench.planner.ceiling`). The plans with half-blocks are not runnable (the
runtime cuts at whole blocks): the figure is an upper bound of the lever, for deciding whether to build it.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.baselines import BASELINES, PUBLISHED  # noqa: E402
from bench.planner import SCENARIOS, ceiling  # noqa: E402

from atoll.coordinator.planner import TrainSpec, search_plan  # noqa: E402
from atoll.coordinator.planner.costmodel import CostModel  # noqa: E402
from atoll.models import preset_spec  # noqa: E402
from atoll.modelspec import LayerSpec, ModelSpec  # noqa: E402


def half_blocks(spec: ModelSpec) -> ModelSpec:
    """`spec` with each block as two layers, its attention half and its MLP half (`ModelSpec.from_config`'s
    arithmetic, split)."""
    c = spec.config
    d, f, kv, s, q = c.d_model, c.ffn, c.kv_dim, c.seq_len, c.q_dim
    gpt = c.style == "gpt"
    norm = 2 * d if gpt else d
    attn_w, mlp_w = d * (q + 2 * kv) + q * d, (2 if gpt else 3) * d * f
    attn_bias = (d + 2 * kv) + d if gpt else ((q + 2 * kv) if c.has_qkv_bias else 0)
    attn_bias += 2 * c.head_size if c.qk_norm else 0
    mlp_bias = f + d if gpt else 0
    attn_fwd, mlp_fwd = 2.0 * attn_w + 4 * s * q, 2.0 * mlp_w
    attn_saved, mlp_saved = d + (q + 2 * kv) + 2 * q, d + (2 if gpt else 3) * f + d
    if not gpt:  # RoPE's q and k before and after, GQA's repeated k and v, the q/k norms' inputs; the gate's output
        attn_saved += (q + kv) + (2 * q if kv != q else 0) + ((q + kv) if c.qk_norm else 0)
        mlp_saved += f
    if c.norm_unit_offset:  # each (1 + weight) norm's normalised input
        attn_saved, mlp_saved = attn_saved + d, mlp_saved + d
    attn_stash, mlp_stash = (d + (q + 2 * kv)) + (q + d), (d + (f if gpt else 2 * f)) + (f + d)
    layers = [spec.layers[0]]
    for _ in range(c.n_layers):
        layers.append(LayerSpec(len(layers), "block", attn_w + attn_bias + norm, attn_fwd, 2 * attn_fwd, d,
                                saved_elems_per_token=attn_saved, flops_wgrad_per_token=2.0 * attn_w,
                                wgrad_elems_per_token=attn_stash))
        layers.append(LayerSpec(len(layers), "block", mlp_w + mlp_bias + norm, mlp_fwd, 2 * mlp_fwd, d,
                                saved_elems_per_token=mlp_saved, flops_wgrad_per_token=2.0 * mlp_w,
                                wgrad_elems_per_token=mlp_stash))
    layers.append(replace(spec.layers[-1], index=len(layers)))
    return ModelSpec(config=c, layers=tuple(layers))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="run only scenarios whose name contains this")
    args = ap.parse_args(argv)
    print(f"{'scenario':<42} {'cut':<11} {'tokens/s':>10} {'x pub':>6} {'x naive':>7} {'of ceil':>7} {'plan s':>6}  "
          "stages (island, layers, dp x tp)")
    for s in SCENARIOS:
        if (args.only and args.only not in s.name) or not s.mixed_in_region or s.regions > 1:
            continue
        model = preset_spec(s.model)
        cluster = s.load()
        train = TrainSpec(global_batch=s.global_batch, seq_len=s.seq_len or model.config.seq_len)
        model = model.with_seq_len(train.seq_len)
        cm = CostModel(model, train)
        tokens = train.tokens_per_step
        pub = max(b(cm, cluster).tokens_per_s(tokens) for b in PUBLISHED)
        naive = max(b(cm, cluster).tokens_per_s(tokens) for b in BASELINES)
        ceil = ceiling(cm, cluster)
        split = half_blocks(model)
        assert split.total_params == model.total_params
        assert abs(sum(x.flops_fwd_per_token for x in split.layers)
                   - sum(x.flops_fwd_per_token for x in model.layers)) < 1e-6 * ceil
        for cut, spec in (("block", model), ("half-block", split)):
            t0 = time.perf_counter()
            plan = search_plan(spec, cluster, train).plan
            secs = time.perf_counter() - t0
            tps = plan.predicted.tokens_per_s
            stages = "; ".join(", ".join(f"{st.island} {list(st.layers)} {st.dp}x{st.tp}" for st in pl.stages)
                               for pl in plan.pipelines)
            print(f"{s.name[:42]:<42} {cut:<11} {tps:>10,.0f} {tps / pub:>5.3f}x {tps / naive:>6.3f}x "
                  f"{tps / ceil:>6.1%} {secs:>6.1f}  {stages[:160]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
