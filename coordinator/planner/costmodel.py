"""Cost model: layer compute, boundary transfers under a codec, all-reduce, optimizer step and memory.

Units: seconds, bytes, bytes/s. A *replica* is one device running a stage on its share of a micro-batch;
per-replica micro-batches are counted in sequences.

- Compute of a layer: a profile's measured time when one is given for the island, else
  FLOPs / (peak x achievable_fraction x tokens / (tokens + half_efficiency_tokens)).
- Transfer of a boundary: wire bytes / bandwidth + latency, with the codec the link would get
  (`LinkCodecModel`): the least lossy codec of the activations' budget that keeps the transfer within the
  time it can hide under, else the fastest one the budget allows. The default asks atoll.compression's
  `LinkPolicy` and `predict_transfer_seconds`; `ExpectedRatioCodecModel` is a dependency-free stand-in
  with each codec's expected size on the wire.
- Gradient all-reduce of N replicas: ring, 2 (N-1)/N x bytes / bandwidth, plus 2 log2(N) latencies.
- Memory per device: weights, gradients and optimizer states (ZeRO-1 shards the optimizer states, ZeRO-2
  also the gradients, ZeRO-3 also the weights, over the stage's data-parallel group) plus the activations of
  the micro-batches in flight (1F1B: stage i of p holds min(p - i, m), plus its extra depth with a deep
  window); with recomputation only each layer's input is kept, plus one layer's working set.
- In-flight depth of a boundary (`window_depth`): the extra micro-batches in flight that keep a slow or
  distant link's round trip (latency both ways plus both transfers) off the pipeline's cycle, about
  ceil(round trip / cycle).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

from atoll.coordinator.planner.cluster import Island, Link
from atoll.coordinator.planner.options import CODEC_ORDER, PlannerOptions, TrainSpec
from atoll.coordinator.planner.profiles import ProfileSet
from atoll.modelspec import ModelSpec, dtype_bytes

# wire bytes per element of each codec (int8/int4 are block-wise with one fp32 scale per 128 elements):
# relative to fp32 these are the expected ratios 1x, 2x, 2x, ~3.9x, ~7.5x
CODEC_BYTES_PER_ELEM = {"identity": None, "bf16": 2.0, "fp16": 2.0, "int8": 1.0 + 4 / 128, "int4": 0.5 + 4 / 128}


class LinkCodecModel(Protocol):
    """Which codec an activation link gets, and how long one transfer then takes."""

    def choose(self, raw_bytes: int, elem_bytes: int, bandwidth: float, latency_s: float,
               overlap_s: float) -> tuple[str, float]:
        """(codec name, predicted seconds) for a tensor of `raw_bytes` (elements of `elem_bytes` each)."""
        ...

    def fastest(self, raw_bytes: int, elem_bytes: int, bandwidth: float, latency_s: float) -> float:
        """Seconds of the quickest transfer any allowed codec gives (the least a link can cost)."""
        ...


@dataclass(frozen=True, kw_only=True)
class ExpectedRatioCodecModel:
    """The planner's default: each codec's expected size on the wire, least lossy codec that hides."""

    allowed: tuple[str, ...] = ("identity", "bf16", "fp16", "int8")
    """Codecs within the activations' error budget."""

    def __post_init__(self) -> None:
        bad = [c for c in self.allowed if c not in CODEC_BYTES_PER_ELEM]
        if bad or not self.allowed:
            raise ValueError(f"allowed codecs must be some of {', '.join(CODEC_BYTES_PER_ELEM)}, got {self.allowed}")

    def seconds(self, codec: str, raw_bytes: int, elem_bytes: int, bandwidth: float, latency_s: float) -> float:
        per = CODEC_BYTES_PER_ELEM[codec]
        wire = raw_bytes if per is None else min(raw_bytes, raw_bytes / elem_bytes * per)
        return wire / bandwidth + latency_s

    def choose(self, raw_bytes: int, elem_bytes: int, bandwidth: float, latency_s: float,
               overlap_s: float) -> tuple[str, float]:
        ordered = [c for c in CODEC_ORDER if c in self.allowed]
        # a codec that cannot shrink this dtype is never chosen over the plain transfer
        timed = [(c, self.seconds(c, raw_bytes, elem_bytes, bandwidth, latency_s)) for c in ordered]
        best: tuple[str, float] | None = None
        for c, t in timed:
            if best is not None and t >= best[1]:
                continue
            best = (c, t)
            if t <= overlap_s:
                return best
        assert best is not None
        return best

    def fastest(self, raw_bytes: int, elem_bytes: int, bandwidth: float, latency_s: float) -> float:
        return min(self.seconds(c, raw_bytes, elem_bytes, bandwidth, latency_s) for c in self.allowed)


WINDOW_TOLERANCE = 0.05
"""A boundary gets the least extra depth that keeps its loop within this fraction above the cycle."""


def window_depth(round_trip_s: float, cycle_s: float) -> int:
    """Extra micro-batches in flight a boundary needs so its round trip does not stall the pipeline.

    Under 1F1B with depth d, a boundary's loop (a micro-batch's compute on both sides, at most 2 cycles,
    plus the round trip) is shared by 2 + d micro-batches in flight, so the pipeline keeps its cycle when
    (2 + r) / (2 + d) <= 1 + WINDOW_TOLERANCE with r = round trip / cycle: about ceil(r) (exactly for whole
    r up to 18), and 0 for a round trip of a tenth of the cycle (strict 1F1B then loses under 5%).
    """
    if cycle_s <= 0 or round_trip_s <= 0 or math.isinf(round_trip_s):
        return 0
    need = (2 + round_trip_s / cycle_s) / (1 + WINDOW_TOLERANCE) - 2
    return max(0, math.ceil(need - 1e-9))


def default_codec_model(options: PlannerOptions) -> LinkCodecModel:
    """atoll.compression's link policy (what the nodes' links will choose), restricted to the options' codecs."""
    from atoll.coordinator.planner.codecpolicy import PolicyCodecModel

    return PolicyCodecModel(names=options.activation_codecs)


@dataclass(frozen=True)
class LayerTable:
    """Per-layer times and memory of one island at one per-replica micro-batch, with prefix sums."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    params: tuple[int, ...]
    act: tuple[int, ...]
    """Bytes saved for backward per micro-batch in flight, without recomputation."""
    act_recompute: tuple[int, ...]
    """Bytes kept per micro-batch in flight with recomputation (each layer's input)."""
    pf: tuple[float, ...]
    pb: tuple[float, ...]
    pparams: tuple[int, ...]
    pact: tuple[int, ...]
    pact_rc: tuple[int, ...]
    max_layer_act: int
    """Largest single layer's full activation (the working set under recomputation)."""

    def forward(self, a: int, b: int) -> float:
        return self.pf[b] - self.pf[a]

    def backward(self, a: int, b: int) -> float:
        return self.pb[b] - self.pb[a]

    def params_of(self, a: int, b: int) -> int:
        return self.pparams[b] - self.pparams[a]


def _prefix(xs: tuple[float, ...] | tuple[int, ...]) -> tuple:
    return (0, *accumulate(xs))


class CostModel:
    """Costs of layers, links and memory for one model, training spec and set of profiles."""

    def __init__(self, model: ModelSpec, train: TrainSpec, profiles: ProfileSet | None = None,
                 options: PlannerOptions | None = None, codec_model: LinkCodecModel | None = None) -> None:
        self.model = model
        self.train = train
        self.profiles = profiles or ProfileSet()
        self.options = options or PlannerOptions()
        self.codecs = codec_model or default_codec_model(self.options)
        self.elem_bytes = dtype_bytes(train.dtype)
        self._tables: dict[tuple[str, int], LayerTable] = {}
        states = model.model_state_bytes(0, model.num_layers, train.dtype, train.optimizer)
        total = max(1, model.total_params)
        self.weight_bytes_per_param = states["weights"] / total
        self.grad_bytes_per_param = states["gradients"] / total
        self.opt_bytes_per_param = states["optimizer"] / total
        self.max_layer_params = max(layer.params for layer in model.layers)

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    # --- compute -------------------------------------------------------------------------------------

    def table(self, island: Island, micro_batch: int) -> LayerTable:
        key = (island.id, micro_batch)
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = self._build_table(island, micro_batch)
        return t

    def _build_table(self, island: Island, micro_batch: int) -> LayerTable:
        seq = self.train.seq_len
        tokens = micro_batch * seq
        prof = self.profiles.get(island.timing_key)
        o = self.options
        peak = island.device.peak_flops(self.train.dtype)
        eff = o.achievable_fraction * tokens / (tokens + o.half_efficiency_tokens)
        fwd: list[float] = []
        bwd: list[float] = []
        for layer in self.model.layers:
            measured = prof.layer_seconds(layer.kind, tokens) if prof else None
            if measured is not None:
                f, b = measured
            else:
                if peak <= 0:
                    raise ValueError(f"island {island.id!r} ({island.device.name}): no measured timing for "
                                     f"{layer.kind} layers and no peak TFLOPS to estimate them; give a profile")
                f = layer.flops_fwd_per_token * tokens / (peak * eff)
                b = layer.flops_bwd_per_token * tokens / (peak * eff)
            fwd.append(f)
            bwd.append(b)
        d = self.train.dtype
        params = tuple(layer.params for layer in self.model.layers)
        act = tuple(layer.activation_bytes(micro_batch, seq, d) for layer in self.model.layers)
        act_rc = tuple(layer.activation_bytes(micro_batch, seq, d, recompute=True) for layer in self.model.layers)
        return LayerTable(fwd=tuple(fwd), bwd=tuple(bwd), params=params, act=act, act_recompute=act_rc,
                          pf=_prefix(tuple(fwd)), pb=_prefix(tuple(bwd)), pparams=_prefix(params),
                          pact=_prefix(act), pact_rc=_prefix(act_rc), max_layer_act=max(act))

    # --- memory --------------------------------------------------------------------------------------

    def memory_capacity(self, island: Island) -> float:
        """Usable bytes per device of the island."""
        return island.device.memory_gb * 1e9 * (1 - self.options.memory_reserve_fraction)

    def state_linear(self, zero: int, group: int) -> tuple[float, float]:
        """(bytes per parameter, constant bytes) of weights + gradients + optimizer states per device under
        a ZeRO stage over `group` replicas: ZeRO-1 shards the optimizer states, ZeRO-2 also the gradients,
        ZeRO-3 also the weights, holding the gathered weights of one layer (and its gradient) while it runs."""
        w, g, o = self.weight_bytes_per_param, self.grad_bytes_per_param, self.opt_bytes_per_param
        if zero >= 1:
            o /= group
        if zero >= 2:
            g /= group
        const = 0.0
        if zero >= 3:
            w /= group
            const = 2 * self.max_layer_params * self.weight_bytes_per_param
        return w + g + o, const

    def state_bytes(self, params: int, zero: int, group: int) -> float:
        per, const = self.state_linear(zero, group)
        return params * per + const

    # --- communication -------------------------------------------------------------------------------

    def allreduce_linear(self, replicas: int, island: Island) -> tuple[float, float]:
        """(seconds per byte, constant seconds) of a ring all-reduce over `replicas` devices of one island:
        2 (N-1)/N x bytes / bandwidth plus 2 log2(N) latencies."""
        if replicas <= 1:
            return 0.0, 0.0
        within = replicas <= island.gpus_per_node
        bw = island.intra_node_bandwidth if within else island.inter_node_bandwidth
        lat = 5e-6 if within else island.latency_s
        return 2 * (replicas - 1) / replicas / bw, 2 * math.ceil(math.log2(replicas)) * lat

    def allreduce_seconds(self, nbytes: float, replicas: int, island: Island) -> float:
        """Ring all-reduce of `nbytes` over `replicas` devices of one island."""
        if nbytes <= 0:
            return 0.0
        per, const = self.allreduce_linear(replicas, island)
        return nbytes * per + const

    def gather_seconds(self, nbytes: float, replicas: int, island: Island) -> float:
        """All-gather of `nbytes` (ZeRO-3 weights) over `replicas` devices of one island: half an all-reduce."""
        return self.allreduce_seconds(nbytes, replicas, island) / 2

    def stream_bandwidth(self, src: Island, dst: Island, link: Link, width: int, streams: int) -> float:
        """Bytes/s of one of `width` replica-to-replica streams from `src` to `dst`.

        Per-node links give each stream its host's share; a shared (region) link is divided among all
        `streams` crossing it at once.
        """
        gpn = min(src.gpus_per_node, dst.gpus_per_node)
        if src.id == dst.id:
            if 2 * width <= src.gpus_per_node:
                return src.intra_node_bandwidth
            return src.inter_node_bandwidth / min(width, src.gpus_per_node)
        per_node = link.bandwidth / min(width, gpn)
        if link.shared:
            node_nic = min(src.inter_node_bandwidth, dst.inter_node_bandwidth) / min(width, gpn)
            return min(node_nic, link.bandwidth / max(1, streams))
        return per_node

    def optimizer_seconds(self, island: Island, params: int, zero: int, group: int) -> float:
        prof = self.profiles.get(island.timing_key)
        local = params / group if zero >= 1 else params
        if prof and prof.optimizer_s_per_gparam > 0:
            return prof.optimizer_s_per_gparam * local / 1e9
        # read and write weights, gradient and optimizer states once
        per_param = 2 * (self.weight_bytes_per_param + self.grad_bytes_per_param + self.opt_bytes_per_param)
        return local * per_param / self.options.optimizer_bytes_per_s

    def model_flops_per_step(self) -> float:
        f, b = self.model.slice_flops_per_token(0, self.model.num_layers)
        return (f + b) * self.train.tokens_per_step
