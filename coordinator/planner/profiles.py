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

A key the format does not have, a number that is not finite (JSON's NaN, Infinity) and, for `atoll plan`, a device
the cluster does not hold are refused, naming the key, rather than left unread (the catalog's estimate planned with
instead of the measurement) or carried into the plan.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from atoll.fsutil import read_text_file
from atoll.modelspec import shown
from atoll.types import MAX_SPLIT_OVERHEAD, LayerTiming, NodeProfile

LAYER_KINDS = ("embedding", "block", "head")
DEVICE_FIELDS = ("layers", "optimizer_s_per_gparam")
"""The keys of one device's entry."""
POINT_FIELDS = ("micro_batch", "seq_len", "forward_s", "backward_s", "weight_fraction", "split_overhead")
"""The keys of one measurement (the first four required)."""
MAX_POINT_SIZE = 2**24
"""The largest micro_batch or seq_len a measurement may name: far beyond any a profiler runs, so a larger one is a
typo, refused before it scales every query to nothing."""


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
        """(forward, backward) seconds of one layer of `kind` over `tokens` tokens, or None if unmeasured:
        interpolated between measurements; under the smallest along the line through the two smallest (a cost per
        call plus one per token), over the largest in proportion to the tokens."""
        pts = self.layers.get(kind)
        if not pts:
            return None
        if len(pts) == 1 or tokens <= pts[0].tokens:
            p = pts[0]
            if len(pts) == 1 or tokens == p.tokens:
                return p.forward_s * tokens / p.tokens, p.backward_s * tokens / p.tokens
            q = pts[1]

            def below(at_p: float, at_q: float) -> float:
                # the line through the two smallest measurements: a fixed cost per call (a CPU's or a kernel
                # launch's overhead) plus a cost per token. Scaled to zero instead, a micro-batch under the
                # profiled sizes read 2x too fast on a CPU node, and the run's speed factor then carried that
                # error into plans of other micro-batches. Never below proportional, never above the smallest
                # measurement.
                slope = (at_q - at_p) / (q.tokens - p.tokens)
                return min(at_p, max(at_p * tokens / p.tokens, at_p - slope * (p.tokens - tokens)))
            return below(p.forward_s, q.forward_s), below(p.backward_s, q.backward_s)
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
    def load(cls, path: str | Path, known: Iterable[str] | None = None) -> "ProfileSet":
        """Read a profile file (JSON); with `known`, the device keys it may hold (see `from_dict`)."""
        text = read_text_file(path, "profile file", "name a profile file (JSON), or leave --profiles out")
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"profile file {path}: not valid JSON: {e}") from None
        return cls.from_dict(doc, source=str(path), known=known)

    @classmethod
    def from_dict(cls, doc: Any, source: str = "<profiles>", known: Iterable[str] | None = None) -> "ProfileSet":
        """The profiles of a parsed profile file. Every key must be one the format has (a misspelled one would be
        left unread), and every figure a finite number in its range; with `known` (the cluster's device names, or
        island ids), every device key must name one of them, case-insensitively: timings of a device the cluster
        does not hold would be ignored."""
        if not isinstance(doc, dict) or not isinstance(doc.get("devices"), dict):
            raise ValueError(f"{source}: expected an object {{\"devices\": {{NAME: {{\"layers\": ...}}}}}}")
        extra = sorted(set(doc) - {"devices"})
        if extra:
            raise ValueError(f"{source}: unknown key {extra[0]!r}; a profile file holds one key, \"devices\"")
        if not doc["devices"]:
            raise ValueError(f"{source}: \"devices\" is empty; add the timings of a device, or give no profiles")
        allowed = {k.lower(): k for k in known} if known is not None else None
        out: dict[str, DeviceProfile] = {}
        spelled: dict[str, str] = {}  # lower-case key -> as the file writes it
        for name, entry in doc["devices"].items():
            where = f"{source}: devices.{name}"
            if allowed is not None and name.lower() not in allowed:
                raise ValueError(f"{where} matches no device of the cluster (its devices: "
                                 f"{', '.join(sorted(allowed.values())) or 'none'}; keys are case-insensitive); "
                                 f"correct the name or leave the entry out")
            if name.lower() in spelled:
                raise ValueError(f"{where} repeats devices.{spelled[name.lower()]} (device keys are case-insensitive); "
                                 f"keep one")
            spelled[name.lower()] = name
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: expected an object with 'layers'")
            extra = sorted(set(entry) - set(DEVICE_FIELDS))
            if extra:
                raise ValueError(f"{where}: unknown key {extra[0]!r}; allowed keys: {', '.join(DEVICE_FIELDS)}")
            kinds = entry.get("layers", {})
            if not isinstance(kinds, dict):
                raise ValueError(f"{where}.layers: expected an object of layer kind ({', '.join(LAYER_KINDS)}) -> "
                                 f"list of measurements, got {shown(kinds)}")
            layers: dict[str, list[TimingPoint]] = {}
            for kind, pts in kinds.items():
                if kind not in LAYER_KINDS:
                    raise ValueError(f"{where}.layers: unknown layer kind {kind!r}; kinds: {', '.join(LAYER_KINDS)}")
                if not isinstance(pts, list):
                    raise ValueError(f"{where}.layers.{kind}: expected a list of measurements")
                for k, pt in enumerate(pts):
                    layers.setdefault(kind, []).append(_timing_point(pt, f"{where}.layers.{kind}[{k}]"))
            opt = entry.get("optimizer_s_per_gparam", 0.0)
            if not _finite(opt) or opt < 0:
                raise ValueError(f"{where}.optimizer_s_per_gparam: seconds per 1e9 parameters, a finite number >= 0 "
                                 f"(0: not measured), got {shown(opt)}")
            out[name.lower()] = DeviceProfile(
                layers={k: tuple(sorted(v, key=lambda p: p.tokens)) for k, v in layers.items()},
                optimizer_s_per_gparam=float(opt))
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


def _finite(v: Any) -> bool:
    """Whether `v` is a finite number (JSON's NaN and Infinity are not; nor is true or "0.1")."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _timing_point(pt: Any, where: str) -> TimingPoint:
    """One measurement of a profile file, checked: `where` names it in errors (`file: devices.X.layers.block[0]`)."""
    needs = "needs micro_batch, seq_len, forward_s, backward_s and optionally weight_fraction and split_overhead"
    if not isinstance(pt, dict):
        raise ValueError(f"{where}: {needs}, got {shown(pt)}")
    missing = [k for k in POINT_FIELDS[:4] if k not in pt]
    if missing:
        raise ValueError(f"{where}: {needs} (missing {', '.join(missing)})")
    extra = sorted(set(pt) - set(POINT_FIELDS))
    if extra:
        raise ValueError(f"{where}: unknown key {extra[0]!r}; allowed keys: {', '.join(POINT_FIELDS)}")
    sizes = []
    for key in ("micro_batch", "seq_len"):
        v = pt[key]
        if not _finite(v) or v != int(v) or not 1 <= v <= MAX_POINT_SIZE:
            raise ValueError(f"{where}.{key}: a whole number from 1 to {MAX_POINT_SIZE:,}, got {shown(v)}")
        sizes.append(int(v))
    times = []
    for key in ("forward_s", "backward_s"):
        v = pt[key]
        if not _finite(v) or v < 0:
            raise ValueError(f"{where}.{key}: seconds, a finite number >= 0, got {shown(v)}")
        times.append(float(v))
    wf, so = pt.get("weight_fraction", 0.0), pt.get("split_overhead", 0.0)
    if not _finite(wf) or not 0.0 <= wf < 1.0:
        raise ValueError(f"{where}: weight_fraction {shown(wf)} is a share of the backward, in [0, 1) (0: not "
                         f"measured)")
    if not _finite(so) or not 0.0 <= so < MAX_SPLIT_OVERHEAD:
        raise ValueError(f"{where}: split_overhead {shown(so)} is the split backward's extra time over the fused one, "
                         f"in [0, {MAX_SPLIT_OVERHEAD:g}) (0: none)")
    return TimingPoint(tokens=sizes[0] * sizes[1], forward_s=times[0], backward_s=times[1], weight_fraction=float(wf),
                       split_overhead=float(so))
