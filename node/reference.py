"""The unsplit model trained in one process on whole batches: what a pipeline must reproduce.

Same initialisation (`build_slice` of every layer), same AdamW and the same clipping rule as
`PipelineStage`, but one forward and backward over the whole batch and no micro-batching; under fp16 torch's
own `GradScaler` does the loss scaling. Equivalence
tests compare pipelines, over any transport, with its per-step losses and final parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from atoll.modelspec import ModelConfig
from atoll.node.model import StageModule, build_slice, lm_loss
from atoll.node.data import Batch
from atoll.node.stage import StageConfig, build_optimizer


@dataclass(kw_only=True)
class ReferenceRun:
    module: StageModule
    losses: list[float]
    grad_norms: list[float]
    loss_scales: list[float] = field(default_factory=list)
    """fp16: the loss scale of each step (torch.amp.GradScaler's), empty otherwise."""


def train_unsplit(config: ModelConfig, *, stage_config: StageConfig, batches: Sequence[Batch],
                  seed: int = 0) -> ReferenceRun:
    """Train the whole model for `len(batches)` steps, one full batch per step."""
    module = build_slice(config, 0, config.n_layers + 2, seed=seed)
    opt = build_optimizer(module, stage_config)
    losses, norms, scales = [], [], []
    # fp16: torch's own GradScaler, an implementation independent of atoll.node.precision's, with its settings
    ls = stage_config.fp16_loss_scale
    scaler = torch.amp.GradScaler("cpu", init_scale=ls.init_scale, growth_factor=ls.growth_factor,
                                  backoff_factor=ls.backoff_factor, growth_interval=ls.growth_interval) \
        if ls is not None else None
    dtype = torch.float16 if ls is not None else torch.bfloat16
    for b in batches:
        if b.inputs is None or b.targets is None:
            raise ValueError("the unsplit model needs both batch.inputs and batch.targets")
        opt.zero_grad(set_to_none=True)
        ctx = torch.autocast("cpu", dtype=dtype, enabled=stage_config.bf16_autocast or ls is not None)
        with ctx:
            loss = lm_loss(module(b.inputs), b.targets)
        if scaler is None:
            loss.backward()
        else:
            scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        if stage_config.max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), stage_config.max_grad_norm)))
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)  # skipped when a gradient is not finite
            scaler.update()
        losses.append(float(loss.detach()))
    return ReferenceRun(module=module, losses=losses, grad_norms=norms, loss_scales=scales)
