"""Checkpoints per stage: one folder per step, one slice file per stage of the cut that wrote it.

`<dir>/step-00000025/layers-0000-0003.pt` holds layers [0, 3) with their AdamW state after 25 steps
(`atoll.node.slice_state` format, written atomically). A stage of any later cut reads only the files
whose layer ranges overlap its own and picks its layers out of them.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from atoll.node.model import StageModule
from atoll.node.slice_state import load_slice, save_slice

_FILE = re.compile(r"^layers-(\d{4})-(\d{4})\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing or does not fit the stage; the message says which and what to do."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def save_layers(module: StageModule, optimizer: torch.optim.Optimizer, root: Path, step: int, *,
                data_position: int) -> tuple[Path, int]:
    """Write the stage's layers and optimizer state for `step`; return the file and its size."""
    path = step_dir(root, step) / f"layers-{module.start:04d}-{module.end:04d}.pt"
    save_slice(path, module, optimizer, extra={"step": step, "data_position": data_position})
    # a step reached again under another cut (after a resume) must not keep the old cut's overlapping files
    for old in _overlapping(step_dir(root, step), module.start, module.end):
        if old != path:
            old.unlink(missing_ok=True)
    return path, path.stat().st_size


def _overlapping(folder: Path, start: int, end: int) -> list[Path]:
    found = []
    for f in sorted(folder.glob("layers-*.pt")) if folder.is_dir() else []:
        m = _FILE.match(f.name)
        if m and int(m.group(1)) < end and start < int(m.group(2)):
            found.append(f)
    return found


def load_layers(module: StageModule, optimizer: torch.optim.Optimizer, root: Path, step: int) -> int:
    """Load the stage's layers (and optimizer state) from the checkpoint of `step`; return its data position."""
    folder = step_dir(root, step)
    files = _overlapping(folder, module.start, module.end)
    if not files:
        raise CheckpointError(f"no checkpoint of step {step} holds layers [{module.start}, {module.end}) under "
                              f"{folder}; nodes that take over layers need the same --checkpoint-dir "
                              "(a shared file system)")
    try:
        extra = load_slice(module, files, optimizer)
    except ValueError as e:
        raise CheckpointError(f"checkpoint of step {step} under {folder}: {e}") from e
    return int(extra.get("data_position", 0))
