"""An in-process transport: the stages of one pipeline replica run as threads and hand tensors over
through per-stage mailboxes keyed by `TensorKey`.

`InProcessLinks(num_stages).transport(s)` is stage `s`'s `Transport`: a forward send lands in stage
`s + 1`'s mailbox, a backward send in stage `s - 1`'s. Sent tensors are copied, as a wire would.
`train_threaded` runs a whole pipeline (optionally with data-parallel replicas) as threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from atoll.modelspec import ModelConfig
from atoll.node.dataparallel import GradientAverager, gloo_group
from atoll.node.model import build_slice
from atoll.node.norm_exchange import InProcessNormGroup
from atoll.node.slice_state import load_slice
from atoll.node.data import Batch
from atoll.node.stage import PipelineStage, StageConfig, StepResult
from atoll.node.synthetic import replica_batch
from atoll.node.transport import TensorKey, Transport, TransportError


class _Mailbox:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.items: dict[TensorKey, torch.Tensor] = {}
        self.closed = False


class InProcessLinks:
    """The mailboxes of the `num_stages` stages of one pipeline replica."""

    def __init__(self, num_stages: int):
        if num_stages < 1:
            raise ValueError(f"a pipeline needs at least one stage, got {num_stages}")
        self.num_stages = num_stages
        self._boxes = [_Mailbox() for _ in range(num_stages)]

    def transport(self, stage: int) -> "InProcessTransport":
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside a pipeline of {self.num_stages} stages")
        return InProcessTransport(self, stage)

    def close(self) -> None:
        """Wake every waiting receiver with a TransportError (used when a stage thread fails)."""
        for box in self._boxes:
            with box.cond:
                box.closed = True
                box.cond.notify_all()


class InProcessTransport(Transport):
    def __init__(self, links: InProcessLinks, stage: int):
        self.links, self.stage = links, stage

    def send(self, key: TensorKey, tensor: torch.Tensor) -> None:
        dst = self.stage + 1 if key.direction == "forward" else self.stage - 1
        if not 0 <= dst < self.links.num_stages:
            where = "downstream of the last" if key.direction == "forward" else "upstream of the first"
            raise TransportError(f"stage {self.stage} cannot send {key}: there is no stage {where} stage")
        box = self.links._boxes[dst]
        copy = tensor.detach().clone()
        with box.cond:
            if box.closed:
                raise TransportError(f"stage {self.stage} cannot send {key}: the pipeline was closed")
            if key in box.items:
                raise TransportError(f"stage {self.stage} sent {key} twice to stage {dst}")
            box.items[key] = copy
            box.cond.notify_all()

    def recv(self, key: TensorKey, timeout: timedelta) -> torch.Tensor:
        box = self.links._boxes[self.stage]
        with box.cond:
            if not box.cond.wait_for(lambda: key in box.items or box.closed, timeout.total_seconds()):
                raise TransportError(f"stage {self.stage} waited {timeout} for {key} and it did not arrive; "
                                     "is the neighbouring stage running the same step and schedule?")
            if key not in box.items:
                raise TransportError(f"stage {self.stage} was waiting for {key} when the pipeline was closed")
            return box.items.pop(key)

    def pending(self) -> int:
        """Tensors delivered to this stage and not yet received (0 after a clean step)."""
        box = self.links._boxes[self.stage]
        with box.cond:
            return len(box.items)


@dataclass(kw_only=True)
class ThreadedRun:
    """What `train_threaded` returns: per replica, per stage, the modules and the step results."""

    stages: list[list[PipelineStage]]
    results: list[list[list[StepResult]]]
    """results[replica][stage][step index]."""

    def losses(self) -> list[float]:
        """Per step, the loss averaged over replicas (what one process with the whole batch computes)."""
        per_replica = [[r.loss for r in rep[-1]] for rep in self.results]
        return [sum(x for x in col if x is not None) / len(col) for col in zip(*per_replica)]


def even_cuts(total_layers: int, num_stages: int) -> list[int]:
    """Boundaries [0, ..., total_layers] splitting the layers into `num_stages` near-equal counts."""
    if not 1 <= num_stages <= total_layers:
        raise ValueError(f"cannot cut {total_layers} layers into {num_stages} stages")
    return [round(i * total_layers / num_stages) for i in range(num_stages + 1)]


def train_threaded(config: ModelConfig, *, cuts: Sequence[int], stage_config: StageConfig,
                   batches: Sequence[Batch], first_step: int = 0, replicas: int = 1, seed: int = 0,
                   stage_groups: Sequence[dist.ProcessGroup] | None = None,
                   resume_from: Sequence[Mapping[str, Any] | Path] | None = None,
                   join_timeout: timedelta = timedelta(minutes=5),
                   defer_weights: Sequence[int] | None = None,
                   defer_layers: Sequence[Sequence[int]] | None = None,
                   in_flight: Sequence[int] | None = None) -> ThreadedRun:
    """Train `len(batches)` steps with one thread per (replica, stage) of a pipeline cut at `cuts`.

    Each batch is the global batch of a step; replica r trains on its r-th share of the rows, and
    the replicas of a stage average gradients over an in-process gloo group. With `stage_groups`
    (one process group per stage, whose other members are in other processes) this process runs one
    pipeline replica (`replicas` must be 1), is given its own share of the data in `batches`, and
    averages each stage's gradients over that stage's group. With `resume_from` (saved slices of
    any cut) every stage loads its layers and optimizer state before the first step. `defer_weights` gives
    each stage its zero-bubble depth (`StageConfig.defer_weights`; `atoll.node.schedule.zero_bubble_depths`),
    `defer_layers` the layers that defer (`StageConfig.defer_layers`; empty: all) and `in_flight` its extra
    warm-up forwards (`StageConfig.in_flight`), one entry per stage.
    """
    if stage_groups is not None and (replicas != 1 or len(stage_groups) != len(cuts) - 1):
        raise ValueError(f"stage_groups needs replicas=1 and one group per stage ({len(cuts) - 1}), got "
                         f"replicas={replicas} and {len(stage_groups)} groups")
    cuts = list(cuts)
    total = config.n_layers + 2
    if len(cuts) < 2 or cuts[0] != 0 or cuts[-1] != total or any(a >= b for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"cuts must rise strictly from 0 to {total} (the model's layers), got {cuts}")
    p = len(cuts) - 1
    for name, per in (("defer_weights", defer_weights), ("defer_layers", defer_layers), ("in_flight", in_flight)):
        if per is not None and len(per) != p:
            raise ValueError(f"{name} needs one entry per stage ({p}), got {list(per)}")
    stages: list[list[PipelineStage]] = []
    links = [InProcessLinks(p) for _ in range(replicas)]
    store = dist.HashStore()
    for r in range(replicas):
        norms = InProcessNormGroup(p)
        row = []
        for s in range(p):
            module = build_slice(config, cuts[s], cuts[s + 1], seed=seed)
            cfg = stage_config
            if defer_weights is not None:
                cfg = replace(cfg, defer_weights=defer_weights[s])
            if defer_layers is not None:
                cfg = replace(cfg, defer_layers=tuple(defer_layers[s]))
            if in_flight is not None:
                cfg = replace(cfg, in_flight=in_flight[s])
            stage = PipelineStage(module, stage=s, num_stages=p, transport=links[r].transport(s),
                                  config=cfg, norm_exchange=norms.member(s))
            if resume_from is not None:
                load_slice(module, resume_from, stage.optimizer)
            row.append(stage)
        stages.append(row)

    results: list[list[list[StepResult]]] = [[[] for _ in range(p)] for _ in range(replicas)]
    errors: list[BaseException] = []

    def work(r: int, s: int) -> None:
        try:
            stage = stages[r][s]
            if stage_groups is not None:
                stage.grad_averager = GradientAverager(stage_groups[s])
            elif replicas > 1:
                group = gloo_group(store, f"stage{s}", rank=r, size=replicas, timeout=stage_config.collective_timeout)
                stage.grad_averager = GradientAverager(group)
            for k, b in enumerate(batches):
                results[r][s].append(stage.train_step(first_step + k, replica_batch(b, r, replicas)))
        except BaseException as e:  # re-raised by the caller; wake the other stages so they fail fast
            errors.append(e)
            for ln in links:
                ln.close()

    threads = [threading.Thread(target=work, args=(r, s), name=f"replica{r}-stage{s}", daemon=True)
               for r in range(replicas) for s in range(p)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + join_timeout.total_seconds()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        for ln in links:
            ln.close()
        raise TimeoutError(f"pipeline threads did not finish within {join_timeout}")
    if errors:
        raise errors[0]
    return ThreadedRun(stages=stages, results=results)
