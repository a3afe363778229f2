"""Finishing a step that some nodes of a run completed and others did not.

The last collective of a synchronous step is the pipeline's norm exchange (`atoll.node.norm_exchange`): every
replica of every stage adds its squared gradient norm, and each node then clips and steps its optimizer on its
own. When a node dies during that exchange, the all-reduce may complete on some members and fail on others
(a ring all-reduce delivers the sum to some ranks before the dead one's socket closes). Those that completed
stepped to s + 1; those that failed still hold the state after s steps, with the step's final gradients on
their parameters. No single step then has every layer, and the resume would fall back to the checkpoint.

Nothing is lost, though: a node whose exchange failed keeps the step's gradients in its live state
(`pending_grads`, `"grads"` in the saved slice), a node that completed it keeps the exchange's total
(`LiveState.norm_total`), and whoever loads the pending state finishes the step with that total (`finish`):
the same clip coefficient, AdamW step and loss-scale update the step would have made, so the state is the one
after s + 1 steps and training goes on with no step rolled back. `atoll.node.live_state.finishable` decides
which pending holders can be finished.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from atoll.node.precision import LossScaleConfig, LossScaler
from atoll.node.slice_state import TIED_SOURCE, layer_of


def pending_grads(module: torch.nn.Module, unexchanged: int | None, step: int) -> dict[str, torch.Tensor] | None:
    """The gradients of step `step` by global parameter name, when that step's norm exchange failed on this
    stage (`PipelineStage.unexchanged == step`): averaged over the replicas and unscaled, not yet clipped."""
    if unexchanged is None or unexchanged != step:
        return None
    return {name: p.grad.detach().cpu().clone() for name, p in module.named_parameters() if p.grad is not None}


def finish(module: torch.nn.Module, optimizer: torch.optim.Optimizer, parts: Sequence[tuple[Mapping[str, Any], float]],
           *, lr: float, max_grad_norm: float | None, loss_scale: LossScaleConfig | None) -> bool:
    """Finish the pending step of the layers that `parts` gave (each a loaded slice holding `"grads"`, with the
    step's norm exchange total) on `module`, just loaded from those slices: clip as the step would have with
    that total, step the optimizer at `lr` for those parameters only, and drop the gradients. Returns whether
    the step overflowed (fp16: it was skipped, and the loss scale backs off; see `finished_scale`)."""
    if not parts:
        return False
    totals = sorted({repr(float(t)) for _, t in parts})
    if len(totals) > 1:
        raise ValueError(f"the pending parts come with different norm exchange totals ({', '.join(totals)}): one "
                         "resume finishes one step of one run")
    total = float(parts[0][1])
    found_inf = loss_scale is not None and not math.isfinite(total)
    params = dict(module.named_parameters())
    copy = getattr(module, "tied_copy", None)
    optimizer.zero_grad(set_to_none=True)
    for name, p in params.items():
        layer = layer_of(name)
        for part, _ in parts:
            if int(part["start"]) <= layer < int(part["end"]):
                grad = part["grads"].get(name)
                if grad is None and p is copy:  # the copy of a tied weight: its gradient is the embedding's
                    grad = part["grads"].get(TIED_SOURCE)
                if grad is not None:
                    p.grad = grad.to(device=p.device, dtype=p.dtype).clone()
    if not found_inf:
        grads = [p.grad for p in params.values() if p.grad is not None]
        if max_grad_norm is not None:
            # the coefficient of PipelineStage.train_step (and torch.nn.utils.clip_grad_norm_)
            coef = min(max_grad_norm / (math.sqrt(total) + 1e-6), 1.0)
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()  # parameters without a gradient (the layers given at the next step) are left alone
    optimizer.zero_grad(set_to_none=True)
    return found_inf


def finished_scale(saved: Mapping[str, Any] | None, config: LossScaleConfig | None, found_inf: bool
                   ) -> dict[str, Any] | None:
    """The loss-scale state after the finished step, from the one saved before it (None: no fp16)."""
    if saved is None or config is None:
        return None if saved is None else dict(saved)
    scaler = LossScaler(config)
    scaler.load_state_dict(dict(saved))
    scaler.update(found_inf)
    return scaler.state_dict()
