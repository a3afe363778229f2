"""Test-only fault injection: a node that misbehaves on purpose, for `bench.adversary` and end-to-end tests.

Off by default. A node process reads two environment variables once, at its first use here:

- `ATOLL_FAULT=KIND[:VALUE][@STEP]` makes this node's stage damage what it sends downstream from step STEP on
  (default 0), or run slowly:
  - `nan:P`: on a step drawn with probability P (default 0.25), one micro-batch's activations become NaN;
  - `huge:P`: likewise, multiplied by 1e4;
  - `bitflip:R`: each element of every activation it sends has one random bit of its float32 flipped with
    probability R (default 1e-4): silent data corruption;
  - `noise:F`: Gaussian noise at F (default 0.01) of each activation's norm is added to it;
  - `slow:X`: every forward and backward takes X times (default 5) as long (a sleep after the compute, timed
    with it): an honest but slow node;
  - `poison:X` (outer mode): the pseudo-gradient this node serves its replica group's peers each round is X times
    (default 1000) what it trained, from the first round whose steps start at or past STEP on; the value `inf`
    serves NaN instead (`Fault.poison`).
- `ATOLL_CHECKS=off` turns this node's own checks off: no tensor door, no stage verification (to measure what the
  checks cost).

The damage is applied where the stage hands a tensor to its transport, so every check downstream (the door, the
replicas' verification) sees exactly what a broken or lying node would send. Nothing else reads these variables.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass
from functools import cache

import torch

log = logging.getLogger("atoll.node.faults")

FAULT_ENV = "ATOLL_FAULT"
CHECKS_ENV = "ATOLL_CHECKS"
KINDS = {"nan": 0.25, "huge": 0.25, "bitflip": 1e-4, "noise": 0.01, "slow": 5.0, "poison": 1000.0}


@dataclass(frozen=True)
class Fault:
    kind: str
    value: float
    from_step: int = 0

    def damage(self, step: int, micro_batch: int, t: torch.Tensor) -> torch.Tensor:
        """What this node sends instead of activation `t` (a new tensor; `t` itself untouched)."""
        if step < self.from_step or self.kind == "slow":
            return t
        if self.kind in ("nan", "huge"):
            draw = random.Random(step * 7919 + 17)
            if micro_batch != 0 or draw.random() >= self.value:
                return t
            return torch.full_like(t, float("nan")) if self.kind == "nan" else t * 1e4
        if self.kind == "noise":
            wide = t.float()
            scale = self.value * float(wide.norm()) / max(1, wide.numel()) ** 0.5
            return (wide + scale * torch.randn_like(wide)).to(t.dtype)
        if self.kind == "bitflip":
            wide = t.float().contiguous().clone()
            bits = wide.view(torch.int32).view(-1)
            hit = torch.nonzero(torch.rand(bits.numel()) < self.value).view(-1)
            if hit.numel():
                which = torch.randint(0, 32, (hit.numel(),), dtype=torch.int32)
                bits[hit] ^= torch.bitwise_left_shift(torch.ones_like(which), which)
            return wide.to(t.dtype)
        return t

    def poison(self, step: int, deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What this node serves instead of its round's pseudo-gradients `deltas` (kind "poison", `step`: the round's
        first step): each scaled by the value, or NaN where the value is inf."""
        if self.kind != "poison" or step < self.from_step:
            return deltas
        if self.value == float("inf"):
            return {n: torch.full_like(d, float("nan")) for n, d in deltas.items()}
        return {n: d * self.value for n, d in deltas.items()}

    def slow_down(self, step: int, seconds: float) -> None:
        """Sleep (X - 1) x `seconds` after a compute of `seconds` (kind "slow")."""
        if self.kind == "slow" and step >= self.from_step and seconds > 0:
            time.sleep((self.value - 1.0) * seconds)


def parse_fault(text: str) -> Fault | None:
    """`KIND[:VALUE][@STEP]` (see the module docstring); "" gives None. Raises ValueError naming the kinds."""
    text = text.strip()
    if not text:
        return None
    spec, _, at = text.partition("@")
    kind, _, value = spec.partition(":")
    if kind not in KINDS:
        raise ValueError(f"{FAULT_ENV}={text!r}: the kind must be one of {', '.join(sorted(KINDS))}")
    try:
        fault = Fault(kind, float(value) if value else KINDS[kind], int(at) if at else 0)
    except ValueError:
        raise ValueError(f"{FAULT_ENV}={text!r}: write KIND[:VALUE][@STEP], e.g. noise:0.01@20") from None
    if fault.value <= 0 or fault.from_step < 0:
        raise ValueError(f"{FAULT_ENV}={text!r}: the value must be positive and the step at least 0")
    return fault


@cache
def injected() -> Fault | None:
    """This process's fault (None: the normal case), logged once when there is one."""
    fault = parse_fault(os.environ.get(FAULT_ENV, ""))
    if fault is not None:
        log.warning("test-only fault injection (%s): this node %s from step %d", FAULT_ENV, fault.kind,
                    fault.from_step)
    return fault


@cache
def checks_off() -> bool:
    """Whether `ATOLL_CHECKS=off` turned this node's door and stage verification off (to measure their cost)."""
    off = os.environ.get(CHECKS_ENV, "").strip().lower() == "off"
    if off:
        log.warning("%s=off: this node checks no received tensor and verifies no stage (a measurement, not for jobs)",
                    CHECKS_ENV)
    return off
