"""Checkpoints per stage: one folder per step, one slice file per stage of the cut that wrote it.

`<dir>/step-00000025/layers-0000-0003.pt` holds layers [0, 3) with their AdamW state after 25 steps
(`atoll.node.slice_state` format, written atomically; under ZeRO the writer saves the state its
replicas gathered to it, so the file does not depend on the sharding). A stage of any later cut reads only the files
whose layer ranges overlap its own and picks its layers out of them.

A step folder is complete when its files hold every layer of the model once, end to end (the files of one
cut: each stage of a pipeline wrote its range). `prune_checkpoints` keeps the newest complete ones.
"""

from __future__ import annotations

import re
import shutil
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from atoll.fsutil import atomic_write, atomic_write_text
from atoll.modelspec import ModelConfig
from atoll.node.model import StageModule
from atoll.node.slice_state import ParamStates, SliceStateError, layer_of, load_slice, read_slice, save_slice

_FILE = re.compile(r"^layers-(\d{4})-(\d{4})\.pt$")
_STEP = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing or does not fit the stage; the message says which and what to do."""


JOB_FILE = "JOB"
"""The file in a checkpoint folder that names the job whose checkpoints it holds (`claim_checkpoint_dir`)."""


RUN_FILE = "RUN"
"""The file in a checkpoint folder that names the coordinator's run of the job its steps belong to."""


class CheckpointDirTaken(ValueError):
    """The checkpoint folder holds another job's checkpoints."""


def claim_checkpoint_dir(root: Path, job_id: str, run_id: str = "") -> bool:
    """Mark `root` as the checkpoint folder of job `job_id` (its `JOB` file) and of the coordinator's run of it
    (`run_id`, its `RUN` file), before the node writes there; True where it newly claimed it for the job. Step
    folders are named by step alone, so a second job writing into the folder of a first one would overwrite its
    steps and prune the rest: a folder whose JOB file names another job that still has step folders there is refused
    (`CheckpointDirTaken`, saying what to do). So is one whose steps belong to an earlier run of the same job (a
    coordinator started on a fresh state dir runs the job afresh, from step 0, over them). Step folders without a
    JOB file, or without a RUN file (written before the files were kept), are taken as this job's and run's; an
    empty `run_id` (an older coordinator) checks no run."""
    root = Path(root)
    marker = root / JOB_FILE
    owner = marker.read_text(encoding="utf-8", errors="replace").strip() if marker.is_file() else ""
    steps = _steps_on_disk(root)
    if owner and owner != job_id and steps:
        raise CheckpointDirTaken(
            f"the checkpoint folder {root} holds the checkpoints of job {owner[:80]}, and this node joined job "
            f"{job_id}: writing there would overwrite and prune them. Give this node another --checkpoint-dir (or "
            f"another --state-dir), or move that job's checkpoints away first (`atoll export` makes a model of a "
            f"complete step)")
    run_file = root / RUN_FILE
    held = run_file.read_text(encoding="utf-8", errors="replace").strip() if run_file.is_file() else ""
    if run_id and held and held != run_id and owner == job_id and steps:
        raise CheckpointDirTaken(
            f"the checkpoint folder {root} holds steps {steps[0]}-{steps[-1]} of an earlier run of job {job_id} "
            f"(run {held[:40]}), and the coordinator runs the job afresh (run {run_id}: it was started on another "
            f"state dir than that run's), from step 0 over them. To go on with that run, start the coordinator on "
            f"its --state-dir; to start afresh, move those step folders away first (`atoll export` makes a model "
            f"of a complete step), or give this node another --checkpoint-dir")
    root.mkdir(parents=True, exist_ok=True)
    if run_id and held != run_id:
        mark_run(root, run_id)
    if owner == job_id:
        return False
    atomic_write_text(marker, f"{job_id}\n")
    return True


def mark_run(root: Path, run_id: str) -> None:
    """Name `run_id` as the run the steps in checkpoint folder `root` belong to (its `RUN` file, atomically)."""
    atomic_write_text(Path(root) / RUN_FILE, f"{run_id}\n")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def save_layers(module: StageModule, optimizer: torch.optim.Optimizer | ParamStates, root: Path, step: int, *,
                data_position: int, state: Mapping[str, Any] | None = None,
                extra: Mapping[str, Any] | None = None) -> tuple[Path, int]:
    """Write the stage's layers and optimizer state for `step`; return the file and its size.

    `optimizer` is the stage's AdamW, or the whole per-parameter states a ZeRO optimizer gathered
    (`ZeroOptimizer.consolidated_state`): the file is the same either way.
    `state`, when given, is the slice's whole state already in the `atoll.node.slice_state` format and is
    written instead of `module` and `optimizer` (a tensor-parallel stage, whose parameters are shards:
    `atoll.node.tp.TensorParallel.full_state` gathers them into whole layers).
    `extra` is kept in the file beside the step and the data position (`load_layers_extra` reads it back): state
    every stage shares, such as fp16's loss scale, travels with the layers wherever they are copied."""
    path = step_dir(root, step) / f"layers-{module.start:04d}-{module.end:04d}.pt"
    extra = {**(extra or {}), "step": step, "data_position": data_position}
    if state is None:
        save_slice(path, module, optimizer, extra=extra)
    else:
        whole = {**state, "extra": {**state.get("extra", {}), **extra}}
        atomic_write(path, lambda f: torch.save(whole, f))
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
    return int(load_layers_extra(module, optimizer, root, step).get("data_position", 0))


def load_layers_extra(module: StageModule, optimizer: torch.optim.Optimizer, root: Path, step: int
                      ) -> dict[str, Any]:
    """`load_layers`, returning the `extra` its writer saved (the step, the data position and what it added)."""
    folder = step_dir(root, step)
    files = _overlapping(folder, module.start, module.end)
    if not files:
        raise CheckpointError(f"no checkpoint of step {step} holds layers [{module.start}, {module.end}) under "
                              f"{folder}, and no node the plan names held a copy to fetch")
    sources: list[Any] = list(files)
    if module.tied_copy is not None:  # a tied head's copy missing from a cut that kept it with the embedding
        sources = [read_slice(f) for f in files]
        name = f"layers.{module.end - 1}.lm.weight"
        if not any(name in st["tensors"] for st in sources):
            sources += [read_slice(f) for f in _overlapping(folder, 0, 1) if f not in files]
    try:
        extra = load_slice(module, sources, optimizer)
    except (ValueError, SliceStateError) as e:
        raise CheckpointError(f"checkpoint of step {step} under {folder}: {e}") from e
    return dict(extra)


def set_aside(root: Path, step: int, layers: tuple[int, int]) -> list[Path]:
    """Rename this node's files of the checkpoint of `step` overlapping `layers` to `*.damaged` (a file that could
    not be loaded), so a copy can be fetched in their place; the files renamed."""
    moved = []
    for f in _overlapping(step_dir(root, step), *layers):
        target = f.with_name(f.name + ".damaged")
        f.replace(target)
        moved.append(target)
    return moved


def read_checkpoint(root: Path, step: int) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """The whole model of a complete checkpoint: (its config, every layer's tensors by global name, the
    `extra` of the file holding layer 0). The one reader of whole checkpoints (`atoll export`)."""
    if not Path(root).is_dir():
        raise CheckpointError(f"no checkpoint folder {root}{' (it is a file)' if Path(root).exists() else ''}: give "
                              f"the folder that holds the step-NNNNNNNN folders (a node's --checkpoint-dir)")
    folder = step_dir(root, step)
    files = _overlapping(folder, 0, 1 << 30)
    if not files:
        there = _steps_on_disk(root)
        hint = (f" (a checkpoint is named by the steps it follows: the one after step {step}, as the logs and "
                f"`atoll status` number steps, is {step + 1})") if step + 1 in there else ""
        raise CheckpointError(f"no checkpoint of step {step} under {folder}; steps there: {there or 'none'}{hint}")
    states = [read_slice(f) for f in files]
    config = ModelConfig.from_dict(dict(states[0]["model"]))
    total = config.n_layers + 2
    if step not in complete_steps_on_disk(root, total):
        raise CheckpointError(f"the checkpoint of step {step} under {folder} does not hold all {total} layers yet "
                              f"(its files: {[f.name for f in files]}); complete steps: "
                              f"{complete_steps_on_disk(root, total) or 'none'}")
    owner: dict[int, dict[str, Any]] = {}
    for st in sorted(states, key=lambda st: (st["start"], st["end"])):
        for layer in range(st["start"], st["end"]):
            owner.setdefault(layer, st)
    tensors = {name: t for layer, st in owner.items() for name, t in st["tensors"].items()
               if layer_of(name) == layer}
    return config, tensors, dict(owner[0].get("extra", {}))


def _steps_on_disk(root: Path) -> list[int]:
    return sorted(int(m.group(1)) for m in (_STEP.match(p.name) for p in Path(root).iterdir()) if m) \
        if Path(root).is_dir() else []


def complete_steps_on_disk(root: Path, total_layers: int) -> list[int]:
    """Steps, ascending, whose folder under `root` holds layers [0, total_layers) in files that chain end to end."""
    done = []
    for folder in Path(root).iterdir() if Path(root).is_dir() else []:
        m = _STEP.match(folder.name)
        if m is None or not folder.is_dir():
            continue
        ranges = {(int(f.group(1)), int(f.group(2))) for f in map(_FILE.match, (p.name for p in folder.iterdir()))
                  if f is not None}
        reach, ends = 0, {}
        for start, end in ranges:
            ends.setdefault(start, set()).add(end)
        frontier = {0}
        while frontier:  # the layers reachable from 0 by chaining ranges
            reach = max(reach, *frontier)
            frontier = {e for s in frontier for e in ends.pop(s, ())}
        if reach >= total_layers:
            done.append(int(m.group(1)))
    return sorted(done)


def prune_older(root: Path, before: int, *, keep: int = 0) -> list[int]:
    """Delete the step folders older than `before` (the coordinator's word that no node needs them: the job holds
    `checkpoint.keep` newer complete checkpoints) but the folder of step `keep` (the running plan's resume step);
    return the steps deleted. Unlike `prune_checkpoints` it needs no complete step on this disk, so a node holding
    some layers, or copies of other nodes' layers, prunes too."""
    removed = []
    root = Path(root)
    if before <= 0 or not root.is_dir():
        return removed
    for folder in sorted(root.iterdir()):
        m = _STEP.match(folder.name)
        if m is not None and folder.is_dir() and int(m.group(1)) < before and int(m.group(1)) != keep:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(int(m.group(1)))
    return removed


def prune_own(root: Path, layers: tuple[int, int], *, keep: Iterable[int] = ()) -> list[int]:
    """Delete this stage's files (exactly `layers`) of every step older than the newest step holding one, but the
    steps in `keep`; return the steps pruned. What a node whose disk filled does to make room for its next
    checkpoint: its newest file stays, so the job keeps a step to resume from, and other nodes' files (a shared
    folder, copies) are left alone."""
    root = Path(root)
    name = f"layers-{layers[0]:04d}-{layers[1]:04d}.pt"
    held = [s for s in _steps_on_disk(root) if (step_dir(root, s) / name).is_file()]
    pruned = []
    for s in held[:-1]:
        if s not in set(keep):
            (step_dir(root, s) / name).unlink(missing_ok=True)
            pruned.append(s)
    return pruned


def file_crc32(path: Path, chunk: int = 1 << 20) -> int:
    """CRC-32 of the file at `path` (what a checkpoint report carries, so copies can be checked against it)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def prune_checkpoints(root: Path, *, total_layers: int, keep: int, upto: int | None = None,
                      protect: Iterable[int] = ()) -> list[int]:
    """Delete step folders older than the `keep`-th newest complete one; return the steps deleted.

    Only complete steps at or before `upto` count (None: all), so a step whose report the coordinator
    has not acknowledged yet never makes an older one it may resume from go away. Steps in `protect` (the
    resume step of the running plan) and every step at or after the oldest kept one stay, complete or not.
    `keep` < 1 keeps everything. Folders are removed whole; a folder another node removes at the same
    time is not an error.
    """
    if keep < 1:
        return []
    complete = [s for s in complete_steps_on_disk(root, total_layers) if upto is None or s <= upto]
    if len(complete) <= keep:
        return []
    oldest_kept = complete[-keep]
    protected = set(protect)
    removed = []
    for folder in sorted(Path(root).iterdir()):
        m = _STEP.match(folder.name)
        if m is None or not folder.is_dir():
            continue
        step = int(m.group(1))
        if step < oldest_kept and step not in protected:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(step)
    return removed
