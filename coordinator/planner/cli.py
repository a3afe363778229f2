"""`atoll plan`: plan a model on a cluster file and print the plan (optionally as JSON and a picture)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SubParsers = "argparse._SubParsersAction[argparse.ArgumentParser]"


def register(sub: SubParsers) -> None:  # type: ignore[valid-type]
    p = sub.add_parser(
        "plan", help="plan a model on a cluster: islands, slices, pipelines, predicted throughput",
        description="Cut a model into slices, place them on islands of a cluster file and compose balanced "
        "pipelines; print the plan with its predicted step time, tokens/s, MFU and bottleneck.")
    p.add_argument("--model", required=True, help="model preset (tiny, small, 125m, 350m, 1.3b, 7b, 13b, 70b, gpt2, "
                   "gpt2-medium, llama-3.2-1b, qwen2.5-0.5b, mistral-7b), a JSON file of a model config, or a "
                   "Hugging Face config.json")
    p.add_argument("--cluster", required=True, help="cluster file (TOML), e.g. examples/clusters/mixed-a100-v100.toml")
    p.add_argument("--profiles", help="measured profiles (JSON) overriding the catalog's analytic estimates")
    p.add_argument("--global-batch", type=int, default=512, help="sequences per optimizer step (default 512)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="training dtype")
    p.add_argument("--outer", default="auto", choices=["auto", "sync", "outer"],
                   help="across regions: auto compares one synchronous plan with replica groups per region synced "
                   "every H steps (outer mode) and keeps the faster; sync or outer force one (default auto)")
    p.add_argument("--inner-steps", type=int, default=0, metavar="H",
                   help="outer mode: inner steps per round of the fastest group (default 0: the smallest H whose "
                   "sync hides behind a round)")
    p.add_argument("--outer-codec", default="auto", choices=["auto", "int8", "int4", "topk", "bf16", "fp16", "identity"],
                   help="outer mode: codec of the pseudo-gradients (default auto: from the wide-area bandwidth)")
    p.add_argument("--topk-fraction", type=float, default=0.02,
                   help="outer mode: fraction of the pseudo-gradients top-k keeps (default 0.02)")
    p.add_argument("--no-overlap", action="store_true",
                   help="outer mode: block at each round's end until the exchange lands (default: overlap it with "
                   "the next round)")
    p.add_argument("--no-zero-bubble", action="store_true",
                   help="plain 1F1B: no stage defers its weight gradients (the wgrad column) or fills its wait for "
                   "the first gradient with extra warm-up forwards (the warm column keeps only deep windows)")
    p.add_argument("--json", metavar="FILE", help="also write the plan as JSON to FILE")
    p.add_argument("--picture", metavar="FILE.png", help="also draw the plan and a 1F1B timeline to FILE.png")
    p.set_defaults(func=_run_plan)


def load_model(name: str):
    from atoll.modelspec import ModelConfig, ModelSpec

    path = Path(name)
    if path.suffix == ".json":
        if not path.is_file():
            raise FileNotFoundError(f"--model {name}: no such file")
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(doc, dict) and "model_type" in doc:  # a Hugging Face config.json
                from atoll.hf import config_from_hf

                return ModelSpec.from_config(config_from_hf(doc, where=str(path)))
            return ModelSpec.from_config(ModelConfig.from_dict(doc))
        except json.JSONDecodeError as e:
            raise ValueError(f"--model {name}: not valid JSON: {e}") from None
    return ModelSpec.from_preset(name)


def _run_plan(args: argparse.Namespace) -> int:
    from atoll.coordinator.planner.cluster import load_cluster
    from atoll.coordinator.planner.options import PlannerOptions, TrainSpec
    from atoll.coordinator.planner.planjob import search_plan
    from atoll.coordinator.planner.profiles import ProfileSet
    from atoll.coordinator.planner.report import format_plan
    from atoll.inputs import input_path

    model = load_model(args.model)
    cluster = load_cluster(input_path(args.cluster))
    profiles = ProfileSet.load(args.profiles) if args.profiles else None
    train = TrainSpec(global_batch=args.global_batch, seq_len=args.seq_len or model.config.seq_len, dtype=args.dtype)
    options = PlannerOptions(outer_mode=args.outer, outer_inner_steps=args.inner_steps, outer_codec=args.outer_codec,
                             outer_topk_fraction=args.topk_fraction, outer_overlap=not args.no_overlap,
                             zero_bubble=not args.no_zero_bubble, fill_warmup=not args.no_zero_bubble)
    result = search_plan(model, cluster, train, profiles, options)
    print(format_plan(result.plan, cluster, search_seconds=result.seconds))
    if result.note and result.plan.mode == "sync":
        print(f"mode {result.note}")
    if args.json:
        result.plan.save(args.json)
        print(f"plan written to {args.json}")
    if args.picture:
        from atoll.coordinator.planner.picture import draw_plan

        draw_plan(result.plan, result.times[0], args.picture)
        print(f"picture written to {args.picture}")
    return 0
