"""`atoll export`: a checkpoint's stages gathered into a Hugging Face folder.

The folder holds the weights as safetensors (one `model.safetensors`, or shards of at most `--shard-size`
with `model.safetensors.index.json`), `config.json` (`atoll.hf.hf_config`: model_type gpt2, llama or
qwen2), `generation_config.json`, and, with `--tokenizer`, the tokenizer (`tokenizer.json` and a
`tokenizer_config.json` naming the fast tokenizer), so `transformers.AutoModelForCausalLM.from_pretrained`
and `AutoTokenizer.from_pretrained` load it. Exported again into the same folder without `--tokenizer`, the
folder keeps the tokenizer the earlier export wrote. Every file is written atomically; weights stay fp32.
The context length is the config's (`n_positions`, `max_position_embeddings`); `generation_config.json` sets no
`max_length` (transformers warns when one is set beside a caller's `max_new_tokens`).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path
from typing import Any

from atoll.argtypes import count, number
from atoll.fsutil import atomic_write_bytes, atomic_write_text

log = logging.getLogger("atoll.export")

SHARD_BYTES = 2 * 1024**3
"""Default largest shard (bytes of tensor data), as `save_pretrained` uses for big models."""


def _shards(tensors: dict[str, Any], limit: int) -> list[dict[str, Any]]:
    """Tensors in name order, cut into groups of at most `limit` bytes (a larger tensor goes alone)."""
    out: list[dict[str, Any]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        if out[-1] and size + nbytes > limit:
            out.append({})
            size = 0
        out[-1][name] = t
        size += nbytes
    return out


def _special_ids(tokenizer: Path | None) -> tuple[int | None, int | None, dict[str, str]]:
    """(bos id, eos id, special token strings) of a tokenizer.json, for the configs."""
    if tokenizer is None:
        return None, None, {}
    from atoll.node.tokenizer import HFTokenizer

    tok = HFTokenizer(tokenizer)
    if tok.eos_id is None:
        return None, None, {}
    eos = tok.tok.id_to_token(tok.eos_id)
    return tok.eos_id, tok.eos_id, {"eos_token": eos, "bos_token": eos}


_EXPORTED = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
                       r"tokenizer(_config)?\.json")
"""The files an export writes besides the configs (which every export writes anew)."""


def stale_exported(out: Path, written: list[Path]) -> list[Path]:
    """Files an earlier export left in `out` that this one did not write (shards of another count, a model index
    a single file replaces): transformers would load them with the new ones."""
    keep = {p.name for p in written}
    return sorted(p for p in out.iterdir() if p.is_file() and _EXPORTED.fullmatch(p.name) and p.name not in keep) \
        if out.is_dir() else []


def export(checkpoint_dir: str | Path, step: int, out: str | Path, *, tokenizer: str | Path | None = None,
           shard_bytes: int = SHARD_BYTES) -> list[Path]:
    """Write the checkpoint of `step` under `checkpoint_dir` as a Hugging Face folder `out`; return the files."""
    from safetensors.torch import save

    from atoll.hf import hf_config
    from atoll.node.checkpoint import read_checkpoint
    from atoll.node.pretrained import to_hf_tensors

    if shard_bytes <= 0:
        raise ValueError(f"--shard-size must be positive, got {shard_bytes}")
    tok_path = Path(tokenizer) if tokenizer else None
    if tok_path is not None and not tok_path.is_file():
        raise FileNotFoundError(f"tokenizer {tok_path} not found: give the tokenizer.json the job trained with")
    config, tensors, extra = read_checkpoint(Path(checkpoint_dir), step)
    weights = to_hf_tensors(config, tensors)
    out = Path(out)
    if tok_path is None and (out / "tokenizer.json").is_file():
        tok_path = out / "tokenizer.json"  # an earlier export's: kept, its special ids in the configs again
        log.info("kept the tokenizer an earlier export wrote in %s", out)
    bos, eos, special = _special_ids(tok_path)
    written: list[Path] = []
    groups = _shards(weights, shard_bytes)
    meta = {"format": "pt"}
    if len(groups) == 1:
        path = out / "model.safetensors"
        atomic_write_bytes(path, save(groups[0], metadata=meta))
        written.append(path)
    else:
        weight_map: dict[str, str] = {}
        for k, group in enumerate(groups, 1):
            path = out / f"model-{k:05d}-of-{len(groups):05d}.safetensors"
            atomic_write_bytes(path, save(group, metadata=meta))
            weight_map.update({name: path.name for name in group})
            written.append(path)
        total = sum(t.numel() * t.element_size() for t in weights.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        written.append(_json(out / "model.safetensors.index.json", index))
    cfg = hf_config(config, bos_token_id=bos, eos_token_id=eos)
    cfg["atoll"] = {"step": step, "model": config.name, "data_position": int(extra.get("data_position", 0))}
    written.append(_json(out / "config.json", cfg))
    gen = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}
    written.append(_json(out / "generation_config.json", gen))
    if tok_path is not None:
        target = out / "tokenizer.json"
        if tok_path != target:
            atomic_write_bytes(target, tok_path.read_bytes())
        tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.seq_len, **special}
        written += [target, _json(out / "tokenizer_config.json", tcfg)]
    for stale in stale_exported(out, written):
        stale.unlink()
        log.info("removed %s, left in %s by an earlier export", stale.name, out)
    return written


def _json(path: Path, doc: dict[str, Any]) -> Path:
    atomic_write_text(path, json.dumps(doc, indent=2) + "\n")
    return path


def register(sub) -> None:  # type: ignore[no-untyped-def]
    p = sub.add_parser(
        "export", help="write a checkpoint as a Hugging Face model folder",
        description="Gather the stages of a checkpoint into a Hugging Face folder (safetensors, config.json, "
        "generation_config.json, the tokenizer) that transformers.AutoModelForCausalLM.from_pretrained loads.")
    p.add_argument("--checkpoint-dir", required=True, help="the nodes' --checkpoint-dir (holding step-NNNNNNNN/)")
    p.add_argument("--step", type=count(least=0, what="a step"), required=True, help="the checkpoint's step (a complete one)")
    p.add_argument("--out", required=True, help="the folder to write (created if missing)")
    p.add_argument("--tokenizer", help="the job's tokenizer.json (its [data] tokenizer), copied into the folder; "
                   "without it the folder keeps the tokenizer an earlier export wrote there, or holds none (a job on "
                   "bytes has none to give)")
    p.add_argument("--shard-size", type=number(above=0, most=1024, what="a size in GiB"), default=SHARD_BYTES / 1024**3,
                   help="largest safetensors shard in GiB (default: 2)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from atoll.node.checkpoint import CheckpointError

    try:
        files = export(args.checkpoint_dir, args.step, args.out, tokenizer=args.tokenizer,
                       shard_bytes=int(args.shard_size * 1024**3))
    except CheckpointError as e:  # said to the person at the terminal without a traceback
        raise ValueError(str(e)) from None
    size = sum(f.stat().st_size for f in files)
    print(f"wrote {len(files)} files ({size / 1e6:.1f} MB) to {args.out}: load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(args.out)!r})")
    if not any(f.name == "tokenizer.json" for f in files):
        log.warning("no tokenizer in %s (no --tokenizer): AutoTokenizer cannot load it from there. A job with a "
                    "[data] tokenizer file: export again with --tokenizer that tokenizer.json. A job on bytes (the "
                    "default): a token is a UTF-8 byte, so list(text.encode()) are its ids and bytes(ids).decode() "
                    "its text", args.out)
    return 0
