"""The job trained in one process, unsplit: the yardstick the distributed run is compared with.

Same initialisation, data, learning-rate schedule, optimizer and clipping as the nodes; the whole global
batch each step, in the same micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch

from atoll.job import JobSpec
from atoll.node.datasets import open_dataset
from atoll.node.inprocess import InProcessLinks
from atoll.node.model import StageModule, build_slice
from atoll.node.pretrained import load_pretrained
from atoll.node.runner import learning_rate, stage_config
from atoll.node.stage import PipelineStage, StepResult


def train_local(job: JobSpec, *, steps: int | None = None, device: torch.device | str = "cpu",
                on_step: Callable[[int, StepResult], None] | None = None) -> tuple[list[float], StageModule]:
    """Train the whole model for `steps` (default: the job's) steps; return per-step losses and the model."""
    t = job.train
    steps = t.steps if steps is None else steps
    module = build_slice(job.model, 0, job.model.n_layers + 2, seed=t.seed, device=device,
                         init=job.pretrained is None)
    if job.pretrained is not None:
        load_pretrained(module, job.pretrained)
    cfg = stage_config(job, t.global_batch // t.micro_batch, timedelta(seconds=60))
    stage = PipelineStage(module, stage=0, num_stages=1, transport=InProcessLinks(1).transport(0), config=cfg)
    data = open_dataset(job.data, seq_len=t.seq_len, seed=t.seed, vocab_size=job.model.vocab_size)
    losses = []
    for step in range(steps):
        for group in stage.optimizer.param_groups:
            group["lr"] = learning_rate(job, step)
        result = stage.train_step(step, data.global_batch(step, t.global_batch))
        losses.append(float(result.loss))
        if on_step is not None:
            on_step(step, result)
    return losses, module
