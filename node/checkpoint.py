"""Checkpoints by layer: one folder per step, one file per layer, written atomically.

`<dir>/step-00000025/layer-0003.pt` holds layer 3's parameters and their AdamW state after 25 steps,
so a stage of any later cut loads exactly the layers it holds. A step's checkpoint is complete when
every layer's file is there (the coordinator also indexes what each stage reported).
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from atoll.fsutil import atomic_write_bytes
from atoll.node.model import StageModule


class CheckpointError(RuntimeError):
    """A checkpoint is missing or does not fit the stage; the message says which file and why."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def layer_file(root: Path, step: int, layer: int) -> Path:
    return step_dir(root, step) / f"layer-{layer:04d}.pt"


def save_layers(module: StageModule, optimizer: torch.optim.Optimizer, root: Path, step: int, *,
                data_position: int) -> tuple[Path, int]:
    """Write each layer of `module` with its optimizer state; return the step's folder and bytes written."""
    total = 0
    for i in range(module.start, module.end):
        layer = module.layers[str(i)]
        params = {name: p.detach().cpu() for name, p in layer.named_parameters()}
        optim = {}
        for name, p in layer.named_parameters():
            state = optimizer.state.get(p)
            if state:
                optim[name] = {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in state.items()}
        buf = io.BytesIO()
        torch.save({"layer": i, "step": step, "data_position": data_position, "params": params, "optim": optim}, buf)
        data = buf.getvalue()
        atomic_write_bytes(layer_file(root, step, i), data)
        total += len(data)
    return step_dir(root, step), total


def load_layers(module: StageModule, optimizer: torch.optim.Optimizer, root: Path, step: int) -> int:
    """Load layers [module.start, module.end) of step `step`; return the data position it recorded."""
    position = 0
    for i in range(module.start, module.end):
        path = layer_file(root, step, i)
        if not path.is_file():
            raise CheckpointError(f"checkpoint of step {step} has no file for layer {i} ({path}); nodes that take "
                                  "over layers need the same --checkpoint-dir (a shared file system)")
        blob = torch.load(path, map_location="cpu", weights_only=True)
        if blob.get("layer") != i or blob.get("step") != step:
            raise CheckpointError(f"{path} holds layer {blob.get('layer')} of step {blob.get('step')}, "
                                  f"expected layer {i} of step {step}")
        layer = module.layers[str(i)]
        named = dict(layer.named_parameters())
        if set(named) != set(blob["params"]):
            raise CheckpointError(f"{path} does not fit layer {i}: parameters {sorted(blob['params'])} vs "
                                  f"{sorted(named)} (was it written for another model?)")
        with torch.no_grad():
            for name, p in named.items():
                saved = blob["params"][name]
                if saved.shape != p.shape:
                    raise CheckpointError(f"{path}: {name} has shape {tuple(saved.shape)}, the model's is "
                                          f"{tuple(p.shape)}")
                p.copy_(saved.to(p.device, p.dtype))
        for name, state in blob["optim"].items():
            p = named[name]
            optimizer.state[p] = {k: (v.to(p.device) if torch.is_tensor(v) and v.ndim > 0 else v)
                                  for k, v in state.items()}
        position = int(blob.get("data_position", 0))
    return position
