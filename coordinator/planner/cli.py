"""`atoll plan`: plan a model on a cluster file and print the plan (optionally as JSON and a picture)."""

from __future__ import annotations

import argparse

SubParsers = "argparse._SubParsersAction[argparse.ArgumentParser]"


def register(sub: SubParsers) -> None:  # type: ignore[valid-type]
    p = sub.add_parser(
        "plan", help="plan a model on a cluster: islands, slices, pipelines, predicted throughput",
        description="Cut a model into slices, place them on islands of a cluster file and compose balanced "
        "pipelines; print the plan with its predicted step time, tokens/s, MFU and bottleneck.")
    p.add_argument("--model", required=True, help="model preset (tiny, small, 125m, 350m, 1.3b, 7b, 13b, 70b) "
                   "or a JSON file of a model config")
    p.add_argument("--cluster", required=True, help="cluster file (TOML), e.g. examples/clusters/mixed.toml")
    p.add_argument("--profiles", help="measured profiles (JSON) overriding the catalog's analytic estimates")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: from the "
                   "cluster file's [train] table, else 512)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--json", metavar="FILE", help="also write the plan as JSON to FILE")
    p.add_argument("--picture", metavar="FILE.png", help="also draw the plan and a 1F1B timeline to FILE.png")
    p.set_defaults(func=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    raise ValueError("atoll plan is not implemented yet")
