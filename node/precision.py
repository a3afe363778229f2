"""Mixed precision: the autocast of a job's precision, and fp16's dynamic loss scale agreed by every stage.

`[train] precision` is "fp32", "bf16" or "fp16". Weights, gradients and optimizer states stay fp32 (the
master weights) in every case; bf16 and fp16 run the forward passes under `torch.autocast` in that dtype
(the backward follows the forward's dtypes). bf16 keeps fp32's exponent range and needs no loss scaling.
fp16 does: the last stage multiplies the loss by the scale before backward, so the activation gradients
that travel upstream and every stage's parameter gradients carry the same factor; each stage divides its
gradients by the scale before clipping and the optimizer.

The global overflow check. A step must be skipped by every stage of every replica or by none, and the scale
must change the same way everywhere, else the replicas drift apart and the stages disagree on the scale the
next step's gradients carry. The agreement rides on the collectives a step already runs, so it costs no
round trip of its own and no call to the coordinator:
1. the data-parallel gradient average (`GradientAverager`, ZeRO's reduce-scatter, the shared layer segments
   of pipelines with different cuts) sums every replica's gradients, so an inf or nan in any replica's
   gradient of a layer is in every holder's averaged gradient of it;
2. each stage then contributes `overflow_contribution(its squared norm)` (+inf when its averaged gradients
   are not all finite) to the norm exchange over every stage of its pipeline, so every node of the pipeline
   receives the same non-finite total when any stage of any replica overflowed, and a finite one otherwise.
Every node then applies `LossScaler.update(found_inf)` to the same scale with the same flag: on an overflow
all skip the optimizer step and halve the scale; after `growth_interval` good steps in a row all double it.
The scale is saved in each stage's checkpoint files (`save_layers(extra=...)`, so it travels with the layers
to whichever node fetches them) and restored by every node that resumes from that checkpoint; a resume from
live state (or from scratch) starts every node at the configured scale.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch


PRECISIONS = ("fp32", "bf16", "fp16")

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype autocast runs matrix products in under `precision` (float32 for "fp32")."""
    if precision not in PRECISIONS:
        raise ValueError(f'precision must be one of {", ".join(PRECISIONS)}, got {precision!r}')
    return _AUTOCAST_DTYPES.get(precision, torch.float32)


def autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager[None]:
    """The forward pass's context under `precision`: autocast in bf16 or fp16, nothing for fp32."""
    dtype = compute_dtype(precision)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """fp16's dynamic loss scale."""

    init_scale: float = 2.0 ** 16
    """The scale of the first step (a resumed job continues from its checkpoint's)."""
    growth_interval: int = 2000
    """Good steps in a row (no overflow anywhere) after which the scale grows by `growth_factor`."""
    growth_factor: float = 2.0
    """Factor of a growth."""
    backoff_factor: float = 0.5
    """Factor applied to the scale at an overflow (the step is skipped)."""
    min_scale: float = 2.0 ** -24
    """The scale never goes below this (fp16's smallest subnormal): a run that overflows at every step keeps
    skipping at this scale instead of dividing by zero, and the skipped steps say so."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ValueError(f"init_scale (train.loss_scale) must be a positive number, got {self.init_scale}")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval (train.loss_scale_window) must be >= 1, got {self.growth_interval}")
        if not self.growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if not 0.0 < self.min_scale <= self.init_scale:
            raise ValueError(f"min_scale must be in (0, init_scale], got {self.min_scale}")


class LossScaler:
    """The dynamic loss scale of one stage replica; every stage of every replica holds an equal one.

    `update(found_inf)` is a pure step of (scale, good steps) given the global overflow flag, so nodes that
    start from the same state and see the same flags keep the same scale without exchanging it.
    """

    def __init__(self, config: LossScaleConfig | None = None):
        self.config = config or LossScaleConfig()
        self.scale = float(self.config.init_scale)
        self.good_steps = 0
        """Steps without an overflow since the last change of the scale."""
        self.skipped = 0
        """Steps skipped for an overflow by this run (not saved: a count for the logs and metrics)."""

    def update(self, found_inf: bool) -> None:
        """After a step: on an overflow back off (the caller skipped the step); else count it and maybe grow."""
        c = self.config
        if found_inf:
            self.scale = max(c.min_scale, self.scale * c.backoff_factor)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= c.growth_interval:
            self.scale *= c.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        scale, good = state.get("scale"), state.get("good_steps", 0)
        if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"a loss-scale state needs a positive finite 'scale', got {scale!r}")
        if not isinstance(good, int) or good < 0:
            raise ValueError(f"a loss-scale state needs a non-negative integer 'good_steps', got {good!r}")
        self.scale, self.good_steps = float(scale), good


def overflow_contribution(squared_norm: float) -> float:
    """What a stage adds to its pipeline's norm exchange under fp16: its squared gradient norm, or +inf when
    that is not finite (a nan becomes inf, so that an inf from one stage and a nan from another still sum to a
    non-finite total rather than depend on the order of the sum)."""
    return squared_norm if math.isfinite(squared_norm) else math.inf


def squared_norm(grads: list[torch.Tensor]) -> float:
    """The sum of squares of `grads`, in float64 from float32 norms (inf or nan when any element is)."""
    if not grads:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), 2.0, dtype=torch.float32) for g in grads])
    return float(torch.sum(norms.double() ** 2))
