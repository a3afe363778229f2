"""Per-link codec choice: the least lossy codec whose transfer hides under the compute it overlaps with.

Least lossy means least expected error on Gaussian data by default; with `PolicyConfig.loss_costs` (mode "wan",
`PolicyConfig.wan`) it means the least loss cost measured in training (`atoll.compression.losscost`), which
ranks codecs such as lowrank, whose error on Gaussian data says nothing about what they cost a model.

Pure and deterministic: a `LinkPolicy` is a function of its config, the transfers it was shown and the
decisions it made (for hysteresis). No clocks, no grpc; the planner calls `predict_transfer_seconds` and
`LinkPolicy.choose` directly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from atoll.compression.dtypes import element_size
from atoll.compression.errors import CodecError
from atoll.compression.spec import CodecSpec
from atoll.compression.tensor import get_codec

ROLES = ("activation", "activation_grad", "weight_grad")
COST_ROLES = ("activation", "activation_grad")
"""The roles a stage boundary carries: chosen by loss cost under `PolicyConfig.loss_costs`."""


def predict_transfer_seconds(raw_bytes: int, spec: CodecSpec, bandwidth: float, latency: float = 0.0, *,
                             dtype: torch.dtype = torch.float32, shape: Sequence[int] | None = None) -> float:
    """Seconds to send a tensor of `raw_bytes` (of `dtype`; of `shape` where known: lowrank's size depends on
    it) under `spec` over a link of `bandwidth` bytes/s and one-way `latency` s: latency + payload / bandwidth.
    The zstd stage is counted as gaining nothing."""
    if raw_bytes < 0:
        raise ValueError(f"raw_bytes must be >= 0, got {raw_bytes}")
    if not bandwidth > 0 or math.isinf(bandwidth):
        raise ValueError(f"bandwidth must be a positive finite number of bytes/s, got {bandwidth}")
    if not latency >= 0:
        raise ValueError(f"latency must be >= 0 s, got {latency}")
    codec = get_codec(spec)
    if dtype not in codec.accepts:
        raise CodecError(f"codec {spec.codec} cannot carry dtype {dtype}")
    numel = raw_bytes // element_size(dtype)
    if shape is not None and math.prod(shape) == numel:
        return latency + codec.wire_size(shape, dtype) / bandwidth
    return latency + codec.payload_size(numel, dtype) / bandwidth


def _default_candidates() -> tuple[CodecSpec, ...]:
    return (CodecSpec("identity"), CodecSpec("fp16"), CodecSpec("int8"), CodecSpec("int4"), CodecSpec("topk"))


def _default_budgets() -> dict[str, float]:
    return {"activation": 0.01, "activation_grad": 0.15, "weight_grad": 1.0}


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """How a link chooses codecs."""

    candidates: tuple[CodecSpec, ...] = field(default_factory=_default_candidates)
    """Codecs to choose from, least lossy first (by expected error on Gaussian data)."""
    error_budgets: Mapping[str, float] = field(default_factory=_default_budgets)
    """Largest expected relative L2 error allowed per role: "activation", "activation_grad", "weight_grad"
    (weight gradients go through error feedback, so top-k fits their budget)."""
    hysteresis: float = 0.2
    """Relative margin: the current codec is kept until it overshoots the overlap by this much, and a less
    lossy one is taken back only when it fits with this much to spare."""
    ema_weight: float = 0.5
    """Weight of each new transfer in the bandwidth moving average, in (0, 1]."""
    min_observe_bytes: int = 64 << 10
    """Transfers smaller than this measure latency rather than bandwidth and are not counted."""
    change_ratio: float = 1.5
    """A transfer more than this factor off the estimate is out of band (> 1)."""
    change_samples: int = 2
    """This many consecutive out-of-band transfers in the same direction are a new regime: the estimate
    jumps to the latest instead of averaging towards it (a link that drops reacts within a few transfers,
    while one slow transfer only nudges the average)."""
    loss_costs: Mapping[str, float] | None = None
    """Measured loss cost per spec label (`atoll.compression.losscost`). When set, activations and
    activation-gradients choose among the candidates with a cost of at most `max_loss_cost`, least cost first
    (a candidate without an entry is left out); weight gradients keep the error budgets. None: expected error."""
    max_loss_cost: float = 0.03
    """With `loss_costs`: the largest loss cost a boundary may take (0.03: 3% above identity's eval loss)."""

    @classmethod
    def wan(cls, costs: Mapping[str, float] | None = None, *, names: tuple[str, ...] | None = None,
            **fields) -> PolicyConfig:
        """The quality-aware policy of a wide-area boundary: `losscost.WAN_CANDIDATES` (only those named in
        `names`, if given) chosen by loss cost (`costs`, default `losscost.table()`)."""
        from atoll.compression import losscost

        cands = tuple(c for c in losscost.WAN_CANDIDATES if names is None or c.codec in names)
        return cls(candidates=cands, loss_costs=losscost.table() if costs is None else dict(costs), **fields)

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("PolicyConfig.candidates must name at least one codec")
        if self.loss_costs is not None:
            if not self.max_loss_cost >= 0:
                raise ValueError(f"PolicyConfig.max_loss_cost must be >= 0, got {self.max_loss_cost}")
            object.__setattr__(self, "loss_costs", dict(self.loss_costs))
            if not self._by_cost():
                raise ValueError(f"no candidate has a measured loss cost within {self.max_loss_cost:g}: give "
                                 f"loss_costs for one of {', '.join(c.label() for c in self.candidates)} "
                                 f"(python -m bench.wan_pipeline measures them)")
        errors = [get_codec(c).expected_error for c in self.candidates]
        for (a, ea), (b, eb) in zip(zip(self.candidates, errors), zip(self.candidates[1:], errors[1:])):
            if self.loss_costs is not None:
                break  # ordered by loss cost instead
            if eb < ea:
                raise ValueError(f"PolicyConfig.candidates must be ordered least lossy first: {b.label()} "
                                 f"(expected error {eb:.3g}) comes after {a.label()} ({ea:.3g})")
        if set(self.error_budgets) != set(ROLES):
            raise ValueError(f"PolicyConfig.error_budgets must give exactly the roles {', '.join(ROLES)}, "
                             f"got {', '.join(sorted(self.error_budgets))}")
        for role, budget in self.error_budgets.items():
            if not budget >= 0:
                raise ValueError(f"error budget of {role} must be >= 0, got {budget}")
            if min(errors) > budget and not (self.loss_costs is not None and role in COST_ROLES):
                raise ValueError(f"no candidate fits the {role} error budget of {budget}; add a less lossy codec")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"PolicyConfig.hysteresis must be in [0, 1), got {self.hysteresis}")
        if not 0 < self.ema_weight <= 1:
            raise ValueError(f"PolicyConfig.ema_weight must be in (0, 1], got {self.ema_weight}")
        if not self.change_ratio > 1:
            raise ValueError(f"PolicyConfig.change_ratio must be > 1, got {self.change_ratio}")
        if self.change_samples < 1:
            raise ValueError(f"PolicyConfig.change_samples must be >= 1, got {self.change_samples}")
        if self.min_observe_bytes < 0:
            raise ValueError(f"PolicyConfig.min_observe_bytes must be >= 0, got {self.min_observe_bytes}")
        object.__setattr__(self, "error_budgets", dict(self.error_budgets))

    def _by_cost(self) -> tuple[CodecSpec, ...]:
        from atoll.compression.losscost import loss_cost

        costs = [(loss_cost(c, self.loss_costs), i, c) for i, c in enumerate(self.candidates)]
        return tuple(c for cost, _, c in sorted((x for x in costs if x[0] is not None), key=lambda x: x[:2])
                     if cost <= self.max_loss_cost)

    def allowed(self, role: str) -> tuple[CodecSpec, ...]:
        """The candidates within `role`'s budget, least lossy first (by loss cost where `loss_costs` is set)."""
        if role not in self.error_budgets:
            raise ValueError(f"unknown tensor role {role!r}; roles: {', '.join(ROLES)}")
        if self.loss_costs is not None and role in COST_ROLES:
            return self._by_cost()
        budget = self.error_budgets[role]
        return tuple(c for c in self.candidates if get_codec(c).expected_error <= budget)


@dataclass(frozen=True)
class Decision:
    spec: CodecSpec
    reason: str
    """Why, in words, with the numbers that decided it."""
    predicted_seconds: float
    """Predicted transfer time under `spec` (nan without a bandwidth estimate)."""


class LinkPolicy:
    """Bandwidth estimate and codec choice for one directed link. Not thread-safe: one owner per link."""

    def __init__(self, config: PolicyConfig | None = None, initial_bandwidth_bytes_per_s: float | None = None,
                 latency_s: float = 0.0) -> None:
        self.config = config or PolicyConfig()
        if initial_bandwidth_bytes_per_s is not None and not (0 < initial_bandwidth_bytes_per_s < math.inf):
            raise ValueError(f"initial bandwidth must be a positive number of bytes/s (a probe's result) or None, "
                             f"got {initial_bandwidth_bytes_per_s}")
        if not 0 <= latency_s < math.inf:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        self._bandwidth = initial_bandwidth_bytes_per_s
        self.latency_s = latency_s
        self._current: dict[str, CodecSpec] = {}
        self._out_of_band = 0  # consecutive out-of-band transfers: > 0 faster, < 0 slower than the estimate

    @property
    def bandwidth(self) -> float | None:
        """Current estimate in bytes/s, None before a probe or a transfer."""
        return self._bandwidth

    def current(self, role: str) -> CodecSpec | None:
        """The codec last chosen for `role`."""
        return self._current.get(role)

    def observe(self, wire_bytes: int, seconds: float) -> None:
        """Count a real transfer of `wire_bytes` that took `seconds` (including the link's latency)."""
        if wire_bytes < 0 or not seconds > 0 or math.isinf(seconds):
            raise ValueError(f"observe needs wire_bytes >= 0 and a positive finite duration, got {wire_bytes} "
                             f"bytes in {seconds} s")
        if wire_bytes < self.config.min_observe_bytes:
            return
        # the latency is not bandwidth; keep at least a tenth of the time so a fast transfer is not infinite
        sample = wire_bytes / max(seconds - self.latency_s, seconds * 0.1)
        est, cfg = self._bandwidth, self.config
        if est is None:
            self._bandwidth = sample
            return
        if sample > est * cfg.change_ratio:
            self._out_of_band = max(self._out_of_band, 0) + 1
        elif sample < est / cfg.change_ratio:
            self._out_of_band = min(self._out_of_band, 0) - 1
        else:
            self._out_of_band = 0
        if abs(self._out_of_band) >= cfg.change_samples:
            self._bandwidth, self._out_of_band = sample, 0
        else:
            self._bandwidth = (1 - cfg.ema_weight) * est + cfg.ema_weight * sample

    def choose(self, raw_bytes: int, role: str, overlap_seconds: float, *,
               dtype: torch.dtype = torch.float32, shape: Sequence[int] | None = None) -> Decision:
        """The codec for a tensor of `raw_bytes` (of `shape`, where known) of `role` whose transfer overlaps
        `overlap_seconds` of compute."""
        allowed = self.config.allowed(role)
        if not overlap_seconds >= 0:
            raise ValueError(f"overlap_seconds must be >= 0, got {overlap_seconds}")
        allowed = tuple(c for c in allowed if dtype in get_codec(c).accepts)
        if not allowed:
            raise CodecError(f"no candidate codec for {role} can carry dtype {dtype}")
        if self._bandwidth is None:
            spec = allowed[0]
            self._current[role] = spec
            return Decision(spec, f"{spec.label()}: no bandwidth estimate yet (no probe, no transfer); "
                                  f"least lossy within the {role} budget", math.nan)
        bw = self._bandwidth
        times = [predict_transfer_seconds(raw_bytes, c, bw, self.latency_s, dtype=dtype, shape=shape) for c in allowed]
        h = self.config.hysteresis
        current = self._current.get(role)
        cur = allowed.index(current) if current in allowed else None
        link = f"at {bw / 1e6:.3g} MB/s, {raw_bytes} raw bytes"
        fits = [i for i, t in enumerate(times) if t <= overlap_seconds]

        if fits:
            best = fits[0]
            why = f"{allowed[best].label()} is the least lossy that fits: {times[best]:.3g} s <= {overlap_seconds:.3g} s " \
                  f"of overlap {link}"
            if best > 0:
                why += f" ({allowed[best - 1].label()} would take {times[best - 1]:.3g} s)"
            if cur is not None and cur != best:
                if best < cur and times[best] > overlap_seconds * (1 - h):
                    best, why = cur, (f"keeps {allowed[cur].label()}: {allowed[best].label()} would fit "
                                      f"({times[best]:.3g} s <= {overlap_seconds:.3g} s) but not with the "
                                      f"{h:.0%} hysteresis margin {link}")
                elif best > cur and times[cur] <= overlap_seconds * (1 + h):
                    best, why = cur, (f"keeps {allowed[cur].label()}: {times[cur]:.3g} s overshoots "
                                      f"{overlap_seconds:.3g} s of overlap by less than the {h:.0%} hysteresis "
                                      f"margin {link}")
        else:
            best = min(range(len(times)), key=lambda i: (times[i], i))
            why = f"{allowed[best].label()}: nothing within the {role} budget fits under {overlap_seconds:.3g} s, " \
                  f"fastest is {times[best]:.3g} s {link}"
            if cur is not None and cur != best and times[cur] <= times[best] * (1 + h):
                best, why = cur, (f"keeps {allowed[cur].label()}: nothing fits under {overlap_seconds:.3g} s and "
                                  f"its {times[cur]:.3g} s is within the {h:.0%} hysteresis margin of the fastest "
                                  f"({times[best]:.3g} s) {link}")
        spec = allowed[best]
        self._current[role] = spec
        if self.config.loss_costs is not None and role in COST_ROLES:
            from atoll.compression.losscost import loss_cost

            why += f"; ranked by measured loss cost ({spec.label()}: {loss_cost(spec, self.config.loss_costs):.1%})"
        return Decision(spec, why, times[best])
