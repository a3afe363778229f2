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
    p.add_argument("--model", required=True, help="model preset (tiny, small, 125m, 350m, 1.3b, 7b, 13b, 70b) "
                   "or a JSON file of a model config")
    p.add_argument("--cluster", required=True, help="cluster file (TOML), e.g. examples/clusters/mixed-a100-v100.toml")
    p.add_argument("--profiles", help="measured profiles (JSON) overriding the catalog's analytic estimates")
    p.add_argument("--global-batch", type=int, default=512, help="sequences per optimizer step (default 512)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="training dtype")
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
            return ModelSpec.from_config(ModelConfig.from_dict(json.loads(path.read_text(encoding="utf-8"))))
        except json.JSONDecodeError as e:
            raise ValueError(f"--model {name}: not valid JSON: {e}") from None
    return ModelSpec.from_preset(name)


def _run_plan(args: argparse.Namespace) -> int:
    from atoll.coordinator.planner.cluster import load_cluster
    from atoll.coordinator.planner.options import TrainSpec
    from atoll.coordinator.planner.planjob import search_plan
    from atoll.coordinator.planner.profiles import ProfileSet
    from atoll.coordinator.planner.report import format_plan

    model = load_model(args.model)
    cluster = load_cluster(args.cluster)
    profiles = ProfileSet.load(args.profiles) if args.profiles else None
    train = TrainSpec(global_batch=args.global_batch, seq_len=args.seq_len or model.config.seq_len, dtype=args.dtype)
    result = search_plan(model, cluster, train, profiles)
    print(format_plan(result.plan, cluster, search_seconds=result.seconds))
    if args.json:
        result.plan.save(args.json)
        print(f"plan written to {args.json}")
    if args.picture:
        from atoll.coordinator.planner.picture import draw_plan

        draw_plan(result.plan, result.times[0], args.picture)
        print(f"picture written to {args.picture}")
    return 0
