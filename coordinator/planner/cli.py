"""`atoll plan`: plan a model on a cluster file and print the plan (optionally as JSON and a picture)."""

from __future__ import annotations

import argparse
from pathlib import Path

from atoll.argtypes import count, number
from atoll.hf import TRAIN_SEQ_LEN
from atoll.job import MAX_GLOBAL_BATCH

SubParsers = "argparse._SubParsersAction[argparse.ArgumentParser]"


def register(sub: SubParsers) -> None:  # type: ignore[valid-type]
    p = sub.add_parser(
        "plan", help="plan a model on a cluster: islands, slices, pipelines, predicted throughput",
        description="Cut a model into slices, place them on islands of a cluster file and compose balanced "
        "pipelines; print the plan with its predicted step time, tokens/s, MFU and bottleneck.")
    p.add_argument("--model", required=True, help="model preset (tiny, small, 125m, 350m, 1.3b, 7b, 13b, 70b, gpt2, "
                   "gpt2-medium, llama-3.2-1b, qwen2.5-0.5b, qwen3-0.6b, gemma-2b, mistral-7b), a JSON file of a model "
                   "config, or a Hugging Face config.json")
    p.add_argument("--cluster", required=True, help="cluster file (TOML), e.g. examples/clusters/mixed-a100-v100.toml")
    p.add_argument("--profiles", help="measured profiles (JSON) overriding the catalog's analytic estimates, keyed by "
                   "the cluster's device names")
    p.add_argument("--global-batch", type=count(most=MAX_GLOBAL_BATCH, what="a number of sequences"), default=512,
                   help=f"sequences per optimizer step, 1 to {MAX_GLOBAL_BATCH:,} (default 512)")
    p.add_argument("--seq-len", type=count(what="a number of tokens"), default=None,
                   help="tokens per sequence, at most the model's seq_len (default: the model's; for a Hugging Face "
                   f"preset or config.json, its positions' reach capped at {TRAIN_SEQ_LEN:,}, a length models are "
                   "trained at)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="training dtype")
    p.add_argument("--outer", default="auto", choices=["auto", "sync", "outer"],
                   help="across regions: auto compares one synchronous plan with replica groups per region synced "
                   "every H steps (outer mode) and keeps the faster; sync or outer force one (default auto)")
    p.add_argument("--inner-steps", type=count(least=0, most=10**9, what="a number of steps"), default=0, metavar="H",
                   help="outer mode: inner steps per round of the fastest group (default 0: the smallest H whose "
                   "sync hides behind a round)")
    p.add_argument("--outer-codec", default="auto",
                   choices=["auto", "int8", "int4", "sparse2", "topk", "bf16", "fp16", "identity"],
                   help="outer mode: codec of the pseudo-gradients (default auto: from the wide-area bandwidth)")
    p.add_argument("--topk-fraction", type=number(above=0, most=1, what="a fraction"), default=0.02,
                   help="outer mode: fraction of the pseudo-gradients top-k keeps (default 0.02)")
    p.add_argument("--sparse-fraction", type=number(above=0, most=1, what="a fraction"), default=1 / 64,
                   help="outer mode: fraction of each chunk of 4,096 the sparse2 codec keeps at 2 bits a value "
                   "(default 1/64)")
    p.add_argument("--no-overlap", action="store_true",
                   help="outer mode: block at each round's end until the exchange lands (default: overlap it with "
                   "the next round)")
    p.add_argument("--no-zero-bubble", action="store_true",
                   help="plain 1F1B: no stage defers its weight gradients (the wgrad column) or fills its wait for "
                   "the first gradient with extra warm-up forwards (the warm column keeps only deep windows)")
    p.add_argument("--compression", default="adaptive", choices=["adaptive", "wan", "identity", "bf16", "fp16", "int8",
                                                                 "int4", "hadamard", "lowrank"],
                   help="activation codecs at stage boundaries: adaptive (identity, bf16, fp16, int8 by expected "
                        "error), wan (also int4, hadamard, lowrank, by measured loss cost: the least that hides "
                        "behind compute), or one codec")
    p.add_argument("--json", metavar="FILE", help="also write the plan as JSON to FILE")
    p.add_argument("--picture", metavar="FILE.png", help="also draw the plan and a 1F1B timeline to FILE.png")
    p.set_defaults(func=_run_plan)


def load_model(name: str):
    from atoll.models import load_model_config, preset_spec
    from atoll.modelspec import ModelSpec

    if Path(name).suffix == ".json":  # a model config of its fields, or a Hugging Face config.json
        return ModelSpec.from_config(load_model_config(name))
    return preset_spec(name)


def default_seq_len(name: str, model) -> tuple[int, str]:
    """The tokens per sequence `atoll plan --model name` plans without --seq-len, and a line that says so: a
    Hugging Face preset's or config.json's training default (`atoll.hf.train_seq_len`; its own figure is the
    longest context it serves), else the model's seq_len ("" to say: Atoll's presets are lengths they train at)."""
    import json

    from atoll.hf import HF_PRESETS, train_seq_len

    if Path(name).suffix == ".json":  # load_model read it already: a Hugging Face config has a model_type
        doc = json.loads(Path(name).read_text(encoding="utf-8"))
        hf, what = isinstance(doc, dict) and "model_type" in doc, "the Hugging Face config's"
    else:
        hf, what = name.lower() in HF_PRESETS, "the preset's"
    full = model.config.seq_len
    if not hf:
        return full, ""
    seq = train_seq_len(model.config)
    reach = f" of its {full:,}-token context" if seq < full else ""
    return seq, f"seq_len {seq:,} ({what} training default{reach}; --seq-len to change)"


def _run_plan(args: argparse.Namespace) -> int:
    from atoll.coordinator.planner.cluster import load_cluster
    from atoll.coordinator.planner.codecpolicy import mode_codecs
    from atoll.coordinator.planner.options import PlannerOptions, TrainSpec
    from atoll.coordinator.planner.planjob import search_plan
    from atoll.coordinator.planner.profiles import ProfileSet
    from atoll.coordinator.planner.report import format_plan
    from atoll.inputs import input_path
    from atoll.preflight import check_output_file

    # everything the user gave is checked before the search, which can take a while
    for given, flag in ((args.json, "--json"), (args.picture, "--picture")):
        if given is not None:
            check_output_file(given, flag)
    json_out, picture_out = (Path(args.json) if args.json is not None else None,
                             Path(args.picture) if args.picture is not None else None)
    if json_out is not None and picture_out is not None and json_out.absolute() == picture_out.absolute():
        raise ValueError(f"--json and --picture both name {args.json}; give each its own file")
    if not args.cluster.strip():
        raise ValueError("--cluster: the file name is empty; name a cluster file (TOML), e.g. "
                         "examples/clusters/two-regions.toml")
    model = load_model(args.model)
    if args.seq_len is not None and args.seq_len > model.config.seq_len:
        raise ValueError(f"--seq-len ({args.seq_len}) exceeds the model's seq_len ({model.config.seq_len}); lower "
                         f"--seq-len or use a model config with a longer seq_len")
    cluster = load_cluster(input_path(args.cluster), source=args.cluster)
    for note in cluster.notes:
        print(f"note: {note}")
    profiles = None
    if args.profiles is not None:
        profiles = ProfileSet.load(args.profiles, known={i.timing_key for i in cluster.islands})
    seq_len, said = (args.seq_len, "") if args.seq_len is not None else default_seq_len(args.model, model)
    if said:
        print(said)
    train = TrainSpec(global_batch=args.global_batch, seq_len=seq_len, dtype=args.dtype)
    options = PlannerOptions(outer_mode=args.outer, outer_inner_steps=args.inner_steps, outer_codec=args.outer_codec,
                             outer_topk_fraction=args.topk_fraction, outer_sparse_fraction=args.sparse_fraction,
                             outer_overlap=not args.no_overlap,
                             zero_bubble=not args.no_zero_bubble, fill_warmup=not args.no_zero_bubble,
                             activation_codecs=mode_codecs(args.compression))
    result = search_plan(model, cluster, train, profiles, options)
    print(format_plan(result.plan, cluster, search_seconds=result.seconds, width=model.config.d_model,
                      elem_bytes=2 if args.dtype in ("bf16", "fp16") else 4))
    if result.band is not None:  # the plan and the nominal-best plan under each network model of the band
        print("\n".join(result.band.lines()))
    if result.note and result.plan.mode == "sync":
        print(f"mode {result.note}")
    if json_out is not None:  # a write that fails now (a full disk) is one line too: `atoll` prints an OSError so
        result.plan.save(json_out)
        print(f"plan written to {args.json}")
    if picture_out is not None:
        from atoll.coordinator.planner.picture import draw_plan

        draw_plan(result.plan, result.times[0], picture_out)
        print(f"picture written to {args.picture}")
    return 0
