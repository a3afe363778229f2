"""Saving and loading the state of a slice by layer, so a slice can be rebuilt from another cut.

A saved slice holds, keyed by global parameter name (`layers.<i>.<...>`, the same on every cut):
the parameters and persistent buffers of layers [start, end), and per parameter its AdamW state
(`step`, `exp_avg`, `exp_avg_sq`), whole even when the stage's replicas sharded it (ZeRO: the writer
saves the consolidated state). Loading takes one or more saved slices (the old cut) and picks out
the layers of the new module; every layer it needs must be present exactly once and the model shape
must match. Files are written atomically and read with `torch.load(weights_only=True)`.

Format (a dict): {"format": 1, "model": ModelConfig.to_dict(), "start", "end", "tensors": {name:
tensor}, "optimizer": {name: {state key: tensor}}, "extra": {...}} with `extra` free for the caller
(the step, say).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from atoll.fsutil import atomic_write
from atoll.modelspec import ModelConfig
from atoll.node.model import StageModule

FORMAT = 1


class SliceStateError(ValueError):
    """Saved state does not fit the slice being loaded (missing or duplicate layers, other model, shapes)."""


def layer_of(name: str) -> int:
    """The global layer index of a parameter name `layers.<i>.<...>`."""
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "layers" or not parts[1].isdigit():
        raise SliceStateError(f"{name!r} is not a layer-keyed name (layers.<i>.<...>)")
    return int(parts[1])


ParamStates = Mapping[nn.Parameter, Mapping[str, Any]]
"""Optimizer state per parameter, as `torch.optim.Optimizer.state` holds it (a sharded optimizer's
consolidated state, `atoll.node.zero.ZeroOptimizer.consolidated_state`, has the same shape)."""


def slice_state(module: StageModule, optimizer: torch.optim.Optimizer | ParamStates | None = None,
                *, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The state of `module` (and its optimizer's per-parameter state) keyed by global name.

    `optimizer` is the stage's optimizer, or its per-parameter states when a sharded optimizer has
    gathered them; either way the file holds whole per-parameter states, loadable under any cut."""
    tensors = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    opt: dict[str, dict[str, torch.Tensor]] = {}
    if optimizer is not None:
        names = {id(p): n for n, p in module.named_parameters()}
        if isinstance(optimizer, torch.optim.Optimizer):
            states: ParamStates = {p: optimizer.state.get(p, {}) for g in optimizer.param_groups for p in g["params"]}
        else:
            states = optimizer
        for p, st in states.items():
            if id(p) not in names:
                raise SliceStateError("the optimizer holds a parameter that is not in the module")
            if st:
                opt[names[id(p)]] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else torch.tensor(v))
                                     for k, v in st.items()}
    return {"format": FORMAT, "model": module.config.to_dict(), "start": module.start, "end": module.end,
            "tensors": tensors, "optimizer": opt, "extra": dict(extra or {})}


def save_slice(path: Path, module: StageModule, optimizer: torch.optim.Optimizer | ParamStates | None = None,
               *, extra: Mapping[str, Any] | None = None) -> None:
    """Write the slice's state to `path` atomically (readers see the old file or the whole new one)."""
    state = slice_state(module, optimizer, extra=extra)
    atomic_write(Path(path), lambda f: torch.save(state, f))


def read_slice(path: Path) -> dict[str, Any]:
    """A saved slice, checked for its format."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no saved slice at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError) as e:  # torch's zip reader on a truncated file, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise SliceStateError(f"{path} cannot be read, the file is damaged ({first})") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise SliceStateError(f"{path} is not a saved slice of format {FORMAT}")
    return state


def _model_dict(saved: Any) -> Any:
    """A saved model description with the fields added since it was written at their defaults."""
    try:
        return ModelConfig.from_dict(dict(saved)).to_dict()
    except (TypeError, ValueError):
        return saved


TIED_SOURCE = "layers.0.tok.weight"
"""The tensor a tied head's copy (`Head.lm.weight` on a stage without the embedding) equals."""


def _tied_copy_source(module: StageModule, states: Sequence[Mapping[str, Any]], owner: Mapping[int, Mapping[str, Any]],
                      tensors: dict[str, Any]) -> tuple[str, Mapping[str, Any]] | None:
    """A tied head's copy that the head's saved slice lacks (written by a cut that kept embedding and head on one
    stage) is the embedding's weight: take it, in `tensors`, from the source holding layer 0. Returns (the
    copy's name, that source), or None when nothing was taken."""
    copy = module.tied_copy
    if copy is None:
        return None
    name = next(n for n, p in module.named_parameters() if p is copy)
    if tensors.get(name) is not None:
        return None
    for st in states:  # a slice that held layer 0 (a live state narrowed to other layers still carries it)
        if TIED_SOURCE in st["tensors"]:
            tensors[name] = st["tensors"][TIED_SOURCE]
            return name, st
    raise SliceStateError(f"the saved slices lack {name} (the tied head's copy of the embedding weight) and hold no "
                          "layer 0 to take it from; give the slice holding layer 0 too")


def load_slice(module: StageModule, sources: Sequence[Mapping[str, Any] | Path | str],
               optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load layers [module.start, module.end) from saved slices of any cut of the same model.

    `sources` are saved slices (dicts or paths) that together cover the module's layers. With an
    optimizer, the AdamW state of every parameter is restored too (it must have been saved). Returns
    the `extra` of the first source that held a needed layer.
    """
    states = [read_slice(Path(s)) if isinstance(s, (str, Path)) else s for s in sources]
    want_model = module.config.to_dict()
    owner: dict[int, Mapping[str, Any]] = {}
    for st in states:
        if _model_dict(st.get("model")) != want_model:
            raise SliceStateError(f"saved slice [{st.get('start')}, {st.get('end')}) is of another model "
                                  f"({st.get('model', {}).get('name')!r}) than this one ({module.config.name!r})")
        for layer in range(st["start"], st["end"]):
            if module.start <= layer < module.end:
                if layer in owner:
                    raise SliceStateError(f"layer {layer} is in more than one saved slice; give one cut")
                owner[layer] = st
    missing = [i for i in range(module.start, module.end) if i not in owner]
    if missing:
        raise SliceStateError(f"no saved slice holds layer(s) {missing} of [{module.start}, {module.end})")

    tensors = {name: owner[layer_of(name)]["tensors"].get(name) for name in module.state_dict()}
    copy = _tied_copy_source(module, states, owner, tensors)
    absent = [n for n, t in tensors.items() if t is None]
    if absent:
        raise SliceStateError(f"saved slices lack {absent}")
    try:
        module.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise SliceStateError(f"saved tensors do not fit the slice: {e}") from e

    if optimizer is not None:
        params = dict(module.named_parameters())
        for name, p in params.items():
            saved = owner[layer_of(name)]["optimizer"].get(name)
            if saved is None and copy is not None and name == copy[0]:
                saved = copy[1]["optimizer"].get(TIED_SOURCE)
            if saved is None:
                raise SliceStateError(f"no optimizer state saved for {name}; save with the optimizer, or load "
                                      "without one to start it afresh")
            optimizer.state[p] = {k: v.to(p.device).clone() if k != "step" else v.clone() for k, v in saved.items()}
    first = owner[module.start]
    return dict(first.get("extra", {}))
