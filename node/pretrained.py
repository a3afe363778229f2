"""Hugging Face safetensors in and out of Atoll's layer-keyed parameters.

`load_pretrained(module, folder)` fills a stage's layers from a local folder of Hugging Face weights
(`model.safetensors`, or shards listed in `model.safetensors.index.json`): the stage opens only the files
that hold its own tensors and reads only those tensors (`safe_open(...).get_tensor`), so a stage of a large
model never reads the rest. `to_hf_tensors(config, tensors)` is the way back (`atoll export`).
Names, fused rows and GPT-2's transposes follow `atoll.hf.param_map`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from atoll.hf import BASE_PREFIX, HfConfigError, config_from_file, model_type, param_map, split_sizes
from atoll.modelspec import ModelConfig
from atoll.node.model import StageModule

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class PretrainedError(ValueError):
    """Pretrained weights are missing or do not fit the model; the message says which and what to do."""


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the folder's index (or its single file)."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise PretrainedError(f"{index} is not a safetensors index (a JSON object with a weight_map): {e}") from None
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise PretrainedError(f"no {SINGLE} or {INDEX} in {folder}: model.pretrained must be a folder of Hugging Face "
                          "safetensors weights (as save_pretrained or the Hub writes it)")


def _check_shape(config: ModelConfig, folder: Path) -> None:
    """The folder's config.json, when it has one, describes the same layers as the job's model."""
    if not (folder / "config.json").is_file():
        return
    try:
        theirs = config_from_file(folder)
    except HfConfigError as e:
        raise PretrainedError(str(e)) from None
    # the name, the context length and tying may differ: positions beyond the trained ones are the job's
    # choice, and an untied head starts as a copy of the tied embedding
    mine = replace(config, name=theirs.name, seq_len=theirs.seq_len, tied_head=theirs.tied_head)
    if config.style == "gpt":  # the learned position table has seq_len rows: it must match
        mine = replace(mine, seq_len=config.seq_len)
    mine, theirs = _resolved(mine), _resolved(theirs)
    if mine != theirs:
        diff = {k: (v, theirs.to_dict()[k]) for k, v in mine.to_dict().items() if theirs.to_dict()[k] != v}
        raise PretrainedError(f"the weights in {folder} are of another model: (job, config.json) differ in {diff}; "
                              "drop the [model] fields that override it, or point model.pretrained elsewhere")


def _resolved(c: ModelConfig) -> ModelConfig:
    """`c` with the None defaults spelt out, so equal shapes compare equal however they were written."""
    llama = c.style == "llama"

    def flag(name: str) -> bool | None:
        return bool(getattr(c, name)) if llama else None

    return replace(c, n_kv_heads=c.kv_heads, ffn_hidden=c.ffn, norm_eps=c.eps,
                   qkv_bias=c.has_qkv_bias if llama else None, rope_theta=c.theta if llama else None,
                   gelu_tanh=bool(c.gelu_tanh), head_dim=c.head_size if llama else None, qk_norm=flag("qk_norm"),
                   norm_unit_offset=flag("norm_unit_offset"), embed_scale=flag("embed_scale"))


def check_pretrained(config: ModelConfig, folder: str | Path) -> None:
    """Raise PretrainedError (saying what to do) unless `folder` holds every tensor of this model; reads the
    index and the files' headers only (a node checks this before it joins)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise PretrainedError(f"model.pretrained {folder} is not a folder on this node; every node reads the weights "
                              "from its own disk: copy the folder here, at the same path")
    _check_shape(config, folder)
    wanted = _sources(config, 0, config.n_layers + 2, folder, weight_files(folder))
    absent = sorted({str(path) for sources, _ in wanted.values() for _, path in sources if not path.is_file()})
    if absent:
        raise PretrainedError(f"{folder / INDEX} lists files this node lacks: {absent}; copy the whole folder")


def _sources(config: ModelConfig, start: int, end: int, folder: Path, files: Mapping[str, Path]
             ) -> dict[str, tuple[list[tuple[str, Path]], bool]]:
    """Per Atoll parameter of layers [start, end): the (Hugging Face name, file) pairs to stack, and whether
    to transpose."""
    prefix = BASE_PREFIX[model_type(config)]

    def where(name: str) -> tuple[str, Path] | None:
        for candidate in (name, name.removeprefix(prefix)):
            if candidate in files:
                return candidate, files[candidate]
        return None

    wanted: dict[str, tuple[list[tuple[str, Path]], bool]] = {}
    copy = config.tied_head and start > 0 and end == config.n_layers + 2  # the head holds the tied weight's copy
    for i in range(start, end):
        for short, spec in param_map(config, i, tied_copy=copy).items():
            found = [where(n) for n in spec.names]
            if any(f is None for f in found) and spec.fallback:
                found = [where(n) for n in spec.fallback]
            if any(f is None for f in found):
                missing = [n for n, f in zip(spec.names, found) if f is None]
                raise PretrainedError(f"{folder} has no tensor {missing[0]} (layer {i}, {short}); the folder must hold "
                                      f"a {model_type(config)} model of this shape")
            wanted[f"layers.{i}.{short}"] = ([f for f in found if f is not None], spec.transpose)
    return wanted


def load_pretrained(module: StageModule, folder: str | Path) -> int:
    """Copy the pretrained weights of the module's layers into it; return the number of tensors read."""
    from safetensors import safe_open

    folder = Path(folder)
    _check_shape(module.config, folder)
    wanted = _sources(module.config, module.start, module.end, folder, weight_files(folder))
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(wanted))
    if missing:  # a programming error in the mapping, not the user's
        raise PretrainedError(f"no Hugging Face name is known for {missing}")
    read = 0
    with ExitStack() as stack, torch.no_grad():
        handles: dict[Path, Any] = {}
        for name, (sources, transpose) in wanted.items():
            parts = []
            for hf_name, path in sources:
                if path not in handles:
                    if not path.is_file():
                        raise PretrainedError(f"{path} (listed in {folder / INDEX}) is missing")
                    handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
                parts.append(handles[path].get_tensor(hf_name))
                read += 1
            t = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
            if transpose:
                t = t.t()
            p = params[name]
            if tuple(t.shape) != tuple(p.shape):
                raise PretrainedError(f"{name} needs shape {tuple(p.shape)}, but {[s[0] for s in sources]} in {folder} "
                                      f"give {tuple(t.shape)}; the weights are of another model shape")
            p.copy_(t)
    return read


def to_hf_tensors(config: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Atoll's whole-model tensors (`layers.<i>.<...>`) under their Hugging Face names, each a separate
    contiguous tensor (fused rows split, GPT-2's Conv1D weights transposed)."""
    out: dict[str, torch.Tensor] = {}
    for i in range(config.n_layers + 2):
        for short, spec in param_map(config, i).items():
            name = f"layers.{i}.{short}"
            if name not in tensors:
                raise PretrainedError(f"the checkpoint lacks {name}: it does not hold the whole model")
            t = tensors[name].detach().cpu()
            parts = t.split(split_sizes(config, short), dim=0) if len(spec.names) > 1 else (t,)
            for hf_name, part in zip(spec.names, parts, strict=True):
                out[hf_name] = (part.t() if spec.transpose else part).contiguous().clone()
    return out
