"""Measured layer timings that override the catalog's analytic estimate.

A profile file (JSON) holds, per device name (or island id), per layer kind, forward and backward seconds
at given micro-batch sizes and sequence length (optionally with `weight_fraction`, the weight-gradient
products' share of the backward when a zero-bubble stage defers them, and `split_overhead`, how much longer
that split backward runs than the fused one, as a node's profiler measures them), and optionally the optimizer
step time:

    {"devices": {
       "A100-80GB": {
         "layers": {"block": [{"micro_batch": 1, "seq_len": 2048, "forward_s": 0.011, "backward_s": 0.022}],
                    "embedding": [...], "head": [...]},
         "optimizer_s_per_gparam": 0.03}}}

A query at another size is interpolated linearly in tokens (micro_batch x seq_len) between the nearest
measured points, or scaled from the nearest one outside their range.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from atoll.types import MAX_SPLIT_OVERHEAD, LayerTiming, NodeProfile

LAYER_KINDS = ("embedding", "block", "head")


@dataclass(frozen=True, kw_only=True)
class TimingPoint:
    """One measurement of one layer kind."""

    tokens: int
    """micro_batch x seq_len of the measurement."""
    forward_s: float
    backward_s: float
    weight_fraction: float = 0.0
    """Of the backward, the weight-gradient products' share when a zero-bubble stage defers them (0: not
    measured; `atoll.types.LayerTiming.weight_fraction`)."""
    split_overhead: float = 0.0
    """How much longer the backward runs split in two than in one pass ((B + W) / backward - 1; 0: not measured or
    none; `atoll.types.LayerTiming.split_overhead`)."""


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """Measured timings of one device (or island)."""

    layers: Mapping[str, tuple[TimingPoint, ...]] = field(default_factory=dict)
    """Layer kind -> measurements sorted by tokens."""
    optimizer_s_per_gparam: float = 0.0
    """Optimizer step seconds per 1e9 parameters held on the device (0: use the analytic estimate)."""

    def layer_seconds(self, kind: str, tokens: int) -> tuple[float, float] | None:
        """(forward, backward) seconds of one layer of `kind` over `tokens` tokens, or None if unmeasured."""
        pts = self.layers.get(kind)
        if not pts:
            return None
        if len(pts) == 1 or tokens <= pts[0].tokens:
            p = pts[0]
            return p.forward_s * tokens / p.tokens, p.backward_s * tokens / p.tokens
        if tokens >= pts[-1].tokens:
            p = pts[-1]
            return p.forward_s * tokens / p.tokens, p.backward_s * tokens / p.tokens
        for lo, hi in zip(pts, pts[1:]):
            if lo.tokens <= tokens <= hi.tokens:
                w = (tokens - lo.tokens) / (hi.tokens - lo.tokens)
                return (lo.forward_s + w * (hi.forward_s - lo.forward_s),
                        lo.backward_s + w * (hi.backward_s - lo.backward_s))
        raise AssertionError("unreachable: points are sorted")

    def weight_fraction(self, kind: str, tokens: int) -> float | None:
        """The measured weight-gradient share of the backward of `kind` at the measurement nearest `tokens` (None:
        not measured; the cost model then takes the layer's FLOPs share)."""
        pts = [p for p in self.layers.get(kind, ()) if p.weight_fraction > 0]
        if not pts:
            return None
        return min(pts, key=lambda p: (abs(p.tokens - tokens), p.tokens)).weight_fraction

    def split_overhead(self, kind: str, tokens: int) -> float:
        """The measured extra time of the split backward of `kind` over the fused one, at the split measurement
        nearest `tokens` (0: not measured)."""
        pts = [p for p in self.layers.get(kind, ()) if p.weight_fraction > 0]
        if not pts:
            return 0.0
        return min(pts, key=lambda p: (abs(p.tokens - tokens), p.tokens)).split_overhead


@dataclass(frozen=True, kw_only=True)
class ProfileSet:
    """Timings by device name (cluster files) or island id (live nodes); keys are case-insensitive."""

    devices: Mapping[str, DeviceProfile] = field(default_factory=dict)

    def get(self, key: str) -> DeviceProfile | None:
        return self.devices.get(key.lower())

    @classmethod
    def load(cls, path: str | Path) -> "ProfileSet":
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"profile file {path}: no such file")
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"profile file {path}: not valid JSON: {e}") from None
        return cls.from_dict(doc, source=str(path))

    @classmethod
    def from_dict(cls, doc: Any, source: str = "<profiles>") -> "ProfileSet":
        if not isinstance(doc, dict) or not isinstance(doc.get("devices"), dict):
            raise ValueError(f"{source}: expected an object {{\"devices\": {{NAME: {{\"layers\": ...}}}}}}")
        out: dict[str, DeviceProfile] = {}
        for name, entry in doc["devices"].items():
            where = f"{source}: devices.{name}"
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: expected an object with 'layers'")
            layers: dict[str, list[TimingPoint]] = {}
            for kind, pts in entry.get("layers", {}).items():
                if kind not in LAYER_KINDS:
                    raise ValueError(f"{where}.layers: unknown layer kind {kind!r}; kinds: {', '.join(LAYER_KINDS)}")
                if not isinstance(pts, list):
                    raise ValueError(f"{where}.layers.{kind}: expected a list of measurements")
                for k, pt in enumerate(pts):
                    try:
                        mb, sl = int(pt["micro_batch"]), int(pt["seq_len"])
                        f, b = float(pt["forward_s"]), float(pt["backward_s"])
                        wf = float(pt.get("weight_fraction", 0.0))
                        so = float(pt.get("split_overhead", 0.0))
                    except (KeyError, TypeError, ValueError, AttributeError) as e:
                        raise ValueError(f"{where}.layers.{kind}[{k}]: needs micro_batch, seq_len, forward_s, "
                                         f"backward_s and optionally weight_fraction and split_overhead ({e})") from None
                    if mb < 1 or sl < 1 or f < 0 or b < 0:
                        raise ValueError(f"{where}.layers.{kind}[{k}]: sizes must be >= 1 and times >= 0")
                    if not 0.0 <= wf < 1.0:
                        raise ValueError(f"{where}.layers.{kind}[{k}]: weight_fraction {wf} is a share of the "
                                         f"backward, in [0, 1) (0: not measured)")
                    if not 0.0 <= so < MAX_SPLIT_OVERHEAD:
                        raise ValueError(f"{where}.layers.{kind}[{k}]: split_overhead {so} is the split backward's "
                                         f"extra time over the fused one, in [0, {MAX_SPLIT_OVERHEAD:g}) (0: none)")
                    layers.setdefault(kind, []).append(TimingPoint(tokens=mb * sl, forward_s=f, backward_s=b,
                                                                   weight_fraction=wf, split_overhead=so))
            try:
                opt = float(entry.get("optimizer_s_per_gparam", 0.0))
            except (TypeError, ValueError):
                opt = -1.0
            if not opt >= 0:  # (NaN too)
                raise ValueError(f"{where}.optimizer_s_per_gparam: seconds per 1e9 parameters, a number >= 0 "
                                 f"(0: not measured), got {entry.get('optimizer_s_per_gparam')!r}")
            out[name.lower()] = DeviceProfile(
                layers={k: tuple(sorted(v, key=lambda p: p.tokens)) for k, v in layers.items()},
                optimizer_s_per_gparam=opt)
        return cls(devices=out)

    @classmethod
    def from_timings(cls, by_key: Mapping[str, Sequence[LayerTiming]]) -> "ProfileSet":
        out: dict[str, DeviceProfile] = {}
        for key, timings in by_key.items():
            layers: dict[str, list[TimingPoint]] = {}
            for t in timings:
                layers.setdefault(t.layer_kind, []).append(
                    TimingPoint(tokens=t.micro_batch * t.seq_len, forward_s=t.forward_seconds,
                                backward_s=t.backward_seconds, weight_fraction=t.weight_fraction,
                                split_overhead=t.split_overhead))
            out[key.lower()] = DeviceProfile(layers={k: tuple(sorted(v, key=lambda p: p.tokens))
                                                     for k, v in layers.items()})
        return cls(devices=out)

    @classmethod
    def from_node_profiles(cls, islands: Mapping[str, Sequence[str]],
                           profiles: Mapping[str, NodeProfile], block_params: int = 0) -> "ProfileSet":
        """Timings per island id: for each layer kind and size, the slowest node of the island counts; with
        `block_params` (the parameters of one of the job's blocks, what a node's `optimizer_step_seconds` timed an
        AdamW step over) also the optimizer's seconds per parameter, the slowest node's."""
        by_island: dict[str, list[LayerTiming]] = {}
        for iid, nodes in islands.items():
            slowest: dict[tuple[str, int, int], LayerTiming] = {}
            for n in nodes:
                for t in profiles[n].layer_timings:
                    k = (t.layer_kind, t.micro_batch, t.seq_len)
                    cur = slowest.get(k)
                    if cur is None or t.forward_seconds + t.backward_seconds > cur.forward_seconds + cur.backward_seconds:
                        slowest[k] = t
            by_island[iid] = list(slowest.values())
        out = cls.from_timings(by_island)
        if block_params <= 0:
            return out
        devices = dict(out.devices)
        for iid, nodes in islands.items():
            opt = max((profiles[n].optimizer_step_seconds for n in nodes), default=0.0)
            if opt > 0 and iid.lower() in devices:
                devices[iid.lower()] = replace(devices[iid.lower()], optimizer_s_per_gparam=opt * 1e9 / block_params)
        return replace(out, devices=devices)
