"""Cost model: layer compute, boundary transfers under a codec, all-reduce, optimizer step and memory.

Units: seconds, bytes, bytes/s. A *replica* is one device running a stage on its share of a micro-batch;
per-replica micro-batches are counted in sequences.

- Compute of a layer: a profile's measured time when one is given for the island, else FLOPs / (the
  device's effective FLOP/s on its dtype's math path, `DeviceSpec.effective_flops`: 16-bit tensor cores,
  TF32 tensor cores for fp32 where the device has them, else the fp32 units, each at its achievable fraction)
  x tokens / (tokens + half_efficiency_tokens)); the head's also the loss's memory-bound passes over the
  logits (`loss_bytes_per_logit`) at the device's memory bandwidth x `memory_fraction`, which its FLOPs leave
  out (a measured head includes them).
- Tensor parallelism over tp GPUs of one node (Megatron's layout, as `atoll.node.tp` runs it): a layer's
  compute divided by tp at the efficiency of its narrower per-rank matrices (`tp_efficiency`), plus the
  collectives over the node's links: per block two all-reduces of its output forward and two of its input
  gradient backward; the vocabulary-parallel embedding one all-reduce forward; the head an all-gather of
  its logits forward and an all-reduce of its input gradient backward. Weights, gradients and optimizer
  states are divided by tp; activations too, except what every rank keeps whole: the blocks' two norm
  inputs, the embedding's output, the head's gathered logits and every layer's input.
- Transfers: latency + size / (line rate x `link_efficiency`), the message-size curve of a measured
  link (a small message is dominated by the latency, a large one by the rate). A link's rate is per GPU
  flow (see `cluster`): the replicas of a stage each send their own stream at that rate, except across a
  shared region link, whose capacity every stream crossing it divides.
- Transfer of a boundary: wire bytes / bandwidth + latency, with the codec the link would get
  (`LinkCodecModel`): the least lossy codec of the activations' budget that keeps the transfer within the
  time it can hide under, else the fastest one the budget allows. The default asks atoll.compression's
  `LinkPolicy` and `predict_transfer_seconds`; `ExpectedRatioCodecModel` is a dependency-free stand-in
  with each codec's expected size on the wire.
- All-reduce of N replicas: a ring, 2 (N-1)/N x bytes / bandwidth plus 2 (N-1) latencies (one per hop);
  hierarchical when the group spans nodes and the intra-node links are faster: reduce-scatter and
  all-gather inside each node (g members) around a ring across the k nodes on 1/g of the bytes per GPU,
  2 (g-1)/g x bytes / intra + 2 (k-1)/k x bytes / (g x inter), with 2 (g-1) + 2 (k-1) latencies. A stage
  with tensor parallelism all-reduces its gradient shards per tp rank over its dp replicas.
- Gradient reduction overlapped with the last backward: a ZeRO-1 stage without tensor parallelism
  reduce-scatters each gradient bucket (`ZERO1_BUCKET_BYTES`, last layers first) as soon as the last
  micro-batch has completed it (`atoll.node.zero`), so its reduce-scatter (half the all-reduce) runs under
  that micro-batch's backward, or under its deferred weight gradients where the stage defers them; the step
  still waits for the last bucket and for the parameters' all-gather after the optimizer step
  (`sync_hidden_seconds`).
- Optimizer step: a profile's measured time per parameter, else reading and writing every weight, gradient and
  optimizer state once at the device's memory bandwidth x `memory_fraction` (`optimizer_bytes_per_s` where the
  device's bandwidth is not known).
- Memory per device: weights, gradients and optimizer states (ZeRO-1 shards the optimizer states, ZeRO-2
  also the gradients, ZeRO-3 also the weights, over the stage's data-parallel group) plus the activations of
  the micro-batches in flight (1F1B: stage i of p holds min(p - i, m), plus its extra depth with a deep
  window), each with the activation the stage sent (held for its backward); ZeRO-2 also holds a few of
  its gradient buckets staged (`ZERO2_STAGED_FRACTION`). The runtime recomputes blocks only, a chosen
  prefix of a stage's blocks: each keeps its input instead of its activations, plus one block's working
  set in backward. A stage that defers its weight gradients (zero-bubble) also holds each deferred
  micro-batch's linear-layer inputs and output gradients (`deferred_bytes`). A CPU stage reports the same
  accounting from its real tensors (`atoll.node.stage`; it does not see that transient working set); a CUDA
  stage reports the allocator's peak.
- Weight gradients: of a layer's backward, the share of its FLOPs that are the linear layers' weight-gradient
  products (`LayerSpec.flops_wgrad_per_token`), of a measured backward too; a zero-bubble stage runs them as
  actions of their own.
- In-flight depth of a boundary (`window_depth`): the extra micro-batches in flight that keep a slow or
  distant link's round trip (latency both ways plus both transfers) off the pipeline's cycle, about
  ceil(round trip / cycle).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
from collections.abc import Sequence
from typing import Protocol

from atoll.coordinator.planner.cluster import INTRA_NODE_LATENCY_S, Island, Link
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


ZERO2_STAGED_FRACTION = 3 / 32
"""Share of a stage's whole gradient ZeRO-2 holds staged besides its shard: `atoll.node.zero` cuts a stage into
32 buckets (of at most 25 MiB) and holds about three at a time (one reduced while one or two fill)."""

ZERO1_BUCKET_BYTES = 25 * 2**20
"""`atoll.node.zero.ZeroConfig.bucket_bytes`: the gradient a ZeRO-1 stage reduce-scatters at once."""

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


def default_codec_model(options: PlannerOptions, width: int | None = None) -> LinkCodecModel:
    """atoll.compression's link policy (what the nodes' links will choose), restricted to the options' codecs;
    `width`: the boundary tensor's last dimension (d_model), which a low-rank codec's size depends on."""
    from atoll.coordinator.planner.codecpolicy import PolicyCodecModel

    return PolicyCodecModel(names=options.activation_codecs, width=width)


@dataclass(frozen=True)
class LayerTable:
    """Per-layer times and memory of one island at one per-replica micro-batch, with prefix sums."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    params: tuple[int, ...]
    act: tuple[int, ...]
    """Bytes saved for backward per micro-batch in flight, without recomputation."""
    act_recompute: tuple[int, ...]
    """Bytes kept per micro-batch in flight when the layer is recomputed: a block's input (the runtime
    recomputes blocks only; the embedding's and the head's figures are their `act`)."""
    pf: tuple[float, ...]
    pb: tuple[float, ...]
    pparams: tuple[int, ...]
    pact: tuple[int, ...]
    pact_rc: tuple[int, ...]
    max_layer_act: int
    """Largest block's full activation (the working set of a recomputed block in backward)."""
    pw: tuple[float, ...] = ()
    """Prefix sums of each layer's weight-gradient part of `bwd` (what a zero-bubble stage defers)."""
    pstash: tuple[int, ...] = ()
    """Prefix sums of the bytes one micro-batch's deferred weight gradients hold per layer."""
    psplit: tuple[float, ...] = ()
    """Prefix sums of what splitting each layer's backward in two adds to it (measured; 0 by the catalog): a
    zero-bubble stage's input-gradient and weight-gradient actions together take `bwd` plus this."""
    loss: tuple[float, float] = (0.0, 0.0)
    """Of the head's `fwd` and `bwd`, the loss's memory-bound passes over the logits (`loss_bytes_per_logit`)
    as the catalog prices them; 0 where a profile measured the head (its timing includes the loss). Under tensor
    parallelism every rank computes it on the gathered logits, whole."""

    def forward(self, a: int, b: int) -> float:
        return self.pf[b] - self.pf[a]

    def backward(self, a: int, b: int) -> float:
        return self.pb[b] - self.pb[a]

    def params_of(self, a: int, b: int) -> int:
        return self.pparams[b] - self.pparams[a]

    def weight(self, a: int, b: int) -> float:
        """The weight-gradient products of [a, b) a zero-bubble stage defers: of `backward(a, b) + split(a, b)`."""
        return self.pw[b] - self.pw[a] if self.pw else 0.0

    def split(self, a: int, b: int) -> float:
        """What splitting the backward of [a, b) in two (input gradients, then the deferred products) adds to it."""
        return self.psplit[b] - self.psplit[a] if self.psplit else 0.0

    def stash(self, a: int, b: int) -> int:
        """Bytes one micro-batch's deferred weight gradients of [a, b) hold until they are computed."""
        return self.pstash[b] - self.pstash[a] if self.pstash else 0


def loss_bytes_per_logit(elem_bytes: int) -> tuple[int, int]:
    """Bytes the loss moves per logit (forward, backward), as the last stage computes it (`atoll.node.model.lm_loss`:
    the logits cast to fp32, then cross-entropy): forward, log-softmax reads and writes fp32 (8), after the cast
    reads the job's dtype and writes fp32; backward, the loss's dense gradient is written (4), log-softmax's
    backward reads it and its output and writes the input gradient (12), and the cast back reads fp32 and writes
    the job's dtype. No cast in an fp32 job."""
    cast = elem_bytes + 4 if elem_bytes != 4 else 0
    return 8 + cast, 16 + cast


def _largest_block(model: ModelSpec, act: tuple[int, ...]) -> int:
    return max((a for layer, a in zip(model.layers, act) if layer.kind == "block"), default=0)


def _prefix(xs: tuple[float, ...] | tuple[int, ...]) -> tuple:
    return (0, *accumulate(xs))


def held_deferred(per: int, act: int, depth: int) -> float:
    """What deferring weight gradients `depth` micro-batches deep adds to a stage's memory, from its `deferred_parts`
    (S, A): depth x S + max(0, S - A) (`CostModel.deferred_bytes`)."""
    return depth * per + max(0, per - act)


def deepest_deferral(per: int, act: int, room: float, most: int) -> int:
    """The most micro-batches, up to `most`, whose deferred products (`deferred_parts` S, A) fit in `room`
    bytes; 0 when not even one does."""
    k = most
    while k >= 1 and held_deferred(per, act, k) > room:
        k -= 1
    return k


class CostModel:
    """Costs of layers, links and memory for one model, training spec and set of profiles."""

    def __init__(self, model: ModelSpec, train: TrainSpec, profiles: ProfileSet | None = None,
                 options: PlannerOptions | None = None, codec_model: LinkCodecModel | None = None) -> None:
        self.model = model
        self.train = train
        self.profiles = profiles or ProfileSet()
        self.options = options or PlannerOptions()
        self.codecs = codec_model or default_codec_model(self.options, model.config.d_model)
        self.elem_bytes = dtype_bytes(train.dtype)
        self._tables: dict[tuple[str, int, int], LayerTable] = {}
        o = self.options
        self.fractions = {"tensor16": o.achievable_fraction, "tf32": o.tf32_fraction, "fp32": o.fp32_fraction}
        states = model.model_state_bytes(0, model.num_layers, train.dtype, train.optimizer)
        total = max(1, model.total_params)
        self.weight_bytes_per_param = states["weights"] / total
        self.grad_bytes_per_param = states["gradients"] / total
        self.opt_bytes_per_param = states["optimizer"] / total
        self.max_layer_params = max(layer.params for layer in model.layers)
        self.num_layers: int = model.num_layers
        """Layers including the embedding and the head (read on every step of the search: a plain attribute)."""
        # per layer, the bytes per sequence of the activation it sends on (`stage_output_bytes`)
        self._out_per_seq = [layer.out_bytes_per_token(train.dtype) * train.seq_len for layer in model.layers]

    # --- compute -------------------------------------------------------------------------------------

    def table(self, island: Island, micro_batch: int, tp: int = 1) -> LayerTable:
        """Per-layer times and memory per device of a replica running `micro_batch` sequences, its layers
        split over `tp` GPUs of one node (the tp collectives included in the times)."""
        key = (island.id, micro_batch, tp)
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = (self._build_table(island, micro_batch) if tp == 1
                                     else self._tp_table(island, micro_batch, tp))
        return t

    def tp_efficiency(self, tp: int) -> float:
        """Efficiency of a layer split over tp ranks relative to the whole layer: kernels on narrower
        matrices (width d / tp) run a smaller share of their peak."""
        if tp <= 1:
            return 1.0
        h = self.options.half_efficiency_width
        d = self.model.config.d_model
        return (d / tp / (d / tp + h)) / (d / (d + h))

    def _tp_table(self, island: Island, micro_batch: int, tp: int) -> LayerTable:
        base = self.table(island, micro_batch)
        c = self.model.config
        tokens = micro_batch * self.train.seq_len
        out = tokens * c.d_model * self.elem_bytes  # a layer's output (or input gradient): one tp all-reduce
        ar = self.tp_allreduce_seconds(out, tp, island)
        gather = self.tp_allreduce_seconds(tokens * c.vocab_size * self.elem_bytes, tp, island) / 2
        comm = {"block": (2 * ar, 2 * ar), "embedding": (ar, 0.0), "head": (gather, ar)}
        speed = tp * self.tp_efficiency(tp)
        kept_whole = 2 * out  # a block's two norm inputs, saved whole on every rank
        fwd, bwd, params, act, wgt, stash, split = [], [], [], [], [], [], []
        for n, (layer, f, b, p, a) in enumerate(zip(self.model.layers, base.fwd, base.bwd, base.params, base.act)):
            cf, cb = comm[layer.kind]
            lf, lb = base.loss if layer.kind == "head" else (0.0, 0.0)  # the loss: whole on every rank
            fwd.append((f - lf) / speed + lf + cf)
            bwd.append((b - lb) / speed + lb + cb)
            params.append(-(-p // tp))
            act.append(kept_whole + (a - kept_whole) // tp if layer.kind == "block" else a)
            # deferred weight gradients: each rank's products of its shards; a column-parallel layer keeps its whole
            # input and its shard of the output gradient, a row-parallel one the reverse (a block's qkv, fc | proj,
            # out: d whole per token in each of the four; the head: its input)
            wgt.append(base.weight(n, n + 1) / speed)
            split.append(base.split(n, n + 1) / speed)
            s = base.stash(n, n + 1)
            whole = (4 if layer.kind == "block" else 1) * tokens * c.d_model * self.elem_bytes if s else 0
            stash.append(whole + (s - whole) // tp)
        return LayerTable(fwd=tuple(fwd), bwd=tuple(bwd), params=tuple(params), act=tuple(act),
                          act_recompute=base.act_recompute, pf=_prefix(tuple(fwd)), pb=_prefix(tuple(bwd)),
                          pparams=_prefix(tuple(params)), pact=_prefix(tuple(act)), pact_rc=base.pact_rc,
                          max_layer_act=_largest_block(self.model, act), pw=_prefix(tuple(wgt)),
                          pstash=_prefix(tuple(stash)), psplit=_prefix(tuple(split)), loss=base.loss)

    def _build_table(self, island: Island, micro_batch: int) -> LayerTable:
        seq = self.train.seq_len
        tokens = micro_batch * seq
        prof = self.profiles.get(island.timing_key)
        o = self.options
        peak = island.device.effective_flops(self.train.dtype, self.fractions)
        eff = tokens / (tokens + o.half_efficiency_tokens)
        mem_bw = island.device.effective_memory_bandwidth(o.memory_fraction)
        loss = (0.0, 0.0)
        fwd: list[float] = []
        bwd: list[float] = []
        wgt: list[float] = []
        split: list[float] = []
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
            # the weight-gradient products' share of the backward: as measured where the profile split the
            # backward (a CPU's attention and norms leave the products a smaller share than their FLOPs), else
            # by FLOPs (of a measured backward too)
            share = prof.weight_fraction(layer.kind, tokens) if measured is not None and prof else None
            if share is None:
                share = layer.flops_wgrad_per_token / layer.flops_bwd_per_token if layer.flops_bwd_per_token else 0.0
            # two passes cost more than one where the profile measured it (the catalog has no figure for it)
            extra = b * prof.split_overhead(layer.kind, tokens) if measured is not None and prof else 0.0
            wgt.append((b + extra) * share)
            split.append(extra)
            if layer.kind == "head" and measured is None and mem_bw > 0:
                # the loss over the logits: memory-bound passes the FLOPs do not count (a measured head has it)
                per = tokens * self.model.config.vocab_size / mem_bw
                bf, bb = loss_bytes_per_logit(self.elem_bytes)
                loss = (bf * per, bb * per)
                fwd[-1] += loss[0]
                bwd[-1] += loss[1]
        d = self.train.dtype
        stash = tuple(tokens * layer.wgrad_elems_per_token * self.elem_bytes for layer in self.model.layers)
        params = tuple(layer.params for layer in self.model.layers)
        act = tuple(layer.activation_bytes(micro_batch, seq, d) for layer in self.model.layers)
        act_rc = tuple(layer.activation_bytes(micro_batch, seq, d, recompute=layer.kind == "block")
                       for layer in self.model.layers)
        return LayerTable(fwd=tuple(fwd), bwd=tuple(bwd), params=params, act=act, act_recompute=act_rc,
                          pf=_prefix(tuple(fwd)), pb=_prefix(tuple(bwd)), pparams=_prefix(params),
                          pact=_prefix(act), pact_rc=_prefix(act_rc), max_layer_act=_largest_block(self.model, act),
                          pw=_prefix(tuple(wgt)), pstash=_prefix(stash), psplit=_prefix(tuple(split)), loss=loss)

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
        if zero >= 2:  # the shard of the gradient, and the few buckets it stages while they are reduced
            g = g / group + ZERO2_STAGED_FRACTION * g
        const = 0.0
        if zero >= 3:
            w /= group
            const = 2 * self.max_layer_params * self.weight_bytes_per_param
        return w + g + o, const

    def state_bytes(self, params: int, zero: int, group: int) -> float:
        per, const = self.state_linear(zero, group)
        return params * per + const

    def deferred_bytes(self, t: LayerTable, a: int, e: int, recompute_layers: tuple[int, ...] | list[int],
                       depth: int, layers: Sequence[int] = ()) -> float:
        """Memory per device a stage [a, e) adds by deferring its weight gradients `depth` micro-batches (zero-bubble,
        `atoll.node.schedule`), on top of its 1F1B memory: each deferred micro-batch holds S bytes (every deferring
        linear layer's input and output gradient; of `layers` alone where given, else of every layer), and right
        after a backward the stage holds one in-flight micro-batch fewer (A bytes of activations, less where
        blocks are recomputed) and one deferred more: depth x S + max(0, S - A)."""
        if depth <= 0:
            return 0.0
        return held_deferred(*self.deferred_parts(t, a, e, recompute_layers, layers), depth)

    def deferred_parts(self, t: LayerTable, a: int, e: int, recompute_layers: tuple[int, ...] | list[int],
                       layers: Sequence[int] = ()) -> tuple[int, int]:
        """(S, A) of `deferred_bytes`: the bytes one deferred micro-batch of the stage [a, e) holds (of `layers`
        alone where given), and the activations one in-flight micro-batch holds (less where blocks are
        recomputed)."""
        per = sum(t.stash(i, i + 1) for i in layers) if layers else t.stash(a, e)
        act = t.pact[e] - t.pact[a] - sum(t.act[i] - t.act_recompute[i] for i in recompute_layers)
        return per, act

    def stage_output_bytes(self, end: int, micro_batch: int) -> int:
        """Bytes a stage ending before layer `end` keeps per micro-batch in flight beyond its layers' saved
        activations: the activation it sent, held for its backward (none on the last stage)."""
        if end >= self.num_layers:
            return 0
        return self._out_per_seq[end - 1] * micro_batch  # `ModelSpec.boundary_bytes`, one product per call

    # --- communication -------------------------------------------------------------------------------

    def allreduce_linear(self, replicas: int, island: Island, per_node: int | None = None) -> tuple[float, float]:
        """(seconds per byte, constant seconds) of an all-reduce over `replicas` devices of one island,
        `per_node` of them on each node (default: as many as a node holds).

        Inside one node a ring over the intra-node links: 2 (N-1)/N x bytes / bandwidth, 2 (N-1) latencies.
        Across k nodes with g members each: hierarchical when the intra-node links are faster (reduce-scatter
        in each node, a ring across the nodes on each member's 1/g of the bytes, all-gather in each node),
        else a flat ring whose slowest hop crosses nodes."""
        if replicas <= 1:
            return 0.0, 0.0
        eff = self.options.link_efficiency
        g = max(1, min(replicas, per_node or island.gpus_per_node, island.gpus_per_node))
        k = -(-replicas // g)
        # (an island's figures are None only where it has no such link: then no all-reduce crosses one)
        if k == 1:
            intra = island.intra_node_bandwidth * eff
            return 2 * (replicas - 1) / replicas / intra, 2 * (replicas - 1) * INTRA_NODE_LATENCY_S
        net = self.options.network
        inter = island.inter_node_bandwidth * eff * net.collective_scale
        intra = (island.intra_node_bandwidth or 0.0) * eff
        hop = island.latency_s + net.collective_latency_s
        if g > 1 and intra > inter and not net.flat_ring:
            return (2 * (g - 1) / g / intra + 2 * (k - 1) / k / (g * inter),
                    2 * (g - 1) * INTRA_NODE_LATENCY_S + 2 * (k - 1) * hop)
        return 2 * (replicas - 1) / replicas / inter, 2 * (replicas - 1) * hop

    def allreduce_seconds(self, nbytes: float, replicas: int, island: Island, per_node: int | None = None) -> float:
        """All-reduce of `nbytes` over `replicas` devices of one island (`allreduce_linear`)."""
        if nbytes <= 0:
            return 0.0
        per, const = self.allreduce_linear(replicas, island, per_node)
        return nbytes * per + const

    def tp_allreduce_seconds(self, nbytes: float, tp: int, island: Island) -> float:
        """All-reduce of `nbytes` over a tensor-parallel group: `tp` GPUs of one node, a ring over its links."""
        if tp <= 1 or nbytes <= 0:
            return 0.0
        return self.allreduce_seconds(nbytes, tp, island, per_node=tp)

    def grad_sync_seconds(self, params: int, island: Island, dp: int, tp: int = 1) -> float:
        """A stage's gradient all-reduce: each tp rank's shard (params / tp) over its `dp` replicas, which sit
        gpus_per_node / tp to a node; the tp ranks run theirs at once, each over its own links."""
        shard = -(-params // tp) * self.grad_bytes_per_param
        return self.allreduce_seconds(shard, dp, island, per_node=max(1, island.gpus_per_node // tp))

    def sync_hidden_seconds(self, sync_s: float, params: int, *, zero: int, dp: int, tp: int, window_s: float) -> float:
        """Of a stage's gradient sync `sync_s` (`grad_sync_seconds`), what runs while its last backward action
        (`window_s`: the last micro-batch's backward, or its deferred weight gradients) still computes. Only a
        ZeRO-1 stage without tensor parallelism overlaps (`atoll.node.zero`): its reduce-scatter, half of the
        all-reduce, bucket by bucket as the gradients complete, all but the last bucket's share."""
        if zero != 1 or tp != 1 or dp <= 1 or sync_s <= 0 or window_s <= 0:
            return 0.0
        buckets = max(1, math.ceil(params * self.grad_bytes_per_param / ZERO1_BUCKET_BYTES))
        return min(window_s, sync_s / 2 * (1 - 1 / buckets))

    def transfer_seconds(self, nbytes: float, bandwidth: float, latency_s: float) -> float:
        """One message of `nbytes` over a link of line rate `bandwidth`: latency + size / achievable rate."""
        return latency_s + nbytes / (bandwidth * self.options.link_efficiency)

    def effective_bandwidth(self, nbytes: float, bandwidth: float, latency_s: float) -> float:
        """Bytes/s a message of `nbytes` sees on a link of line rate `bandwidth` (the message-size curve)."""
        return nbytes / self.transfer_seconds(nbytes, bandwidth, latency_s) if nbytes > 0 else 0.0

    def gather_seconds(self, nbytes: float, replicas: int, island: Island) -> float:
        """All-gather of `nbytes` (ZeRO-3 weights) over `replicas` devices of one island: half an all-reduce."""
        return self.allreduce_seconds(nbytes, replicas, island) / 2

    def stream_bandwidth(self, src: Island, dst: Island, link: Link, width: int, streams: int) -> float:
        """Achievable bytes/s of one of `width` GPU-to-GPU streams from `src` to `dst` (line rate x
        `link_efficiency`; `transfer_seconds` adds the latency).

        Link figures are per GPU flow (`cluster`): each stream runs at the link's rate; between two stages
        of one island of `width` devices each (dp x tp, every lane) that fit in one node together, at the
        intra-node rate; across a shared (region) link, at its
        capacity divided among all `streams` crossing it at once, and never above the GPUs' own rate.
        """
        eff = self.options.link_efficiency
        if src.id == dst.id and 2 * width <= src.gpus_per_node:
            return src.intra_node_bandwidth * eff
        eff *= self.options.network.p2p_scale  # every other stream crosses nodes
        if src.id == dst.id:
            return src.inter_node_bandwidth * eff
        if link.shared:
            own = min(src.inter_node_bandwidth, dst.inter_node_bandwidth)
            return min(own, link.bandwidth / max(1, streams)) * eff
        return link.bandwidth * eff

    def stream_latency(self, src: Island, dst: Island, link: Link, width: int) -> float:
        """One-way latency of a stream of `stream_bandwidth`'s: the link's, plus the network model's added latency
        where it crosses nodes."""
        if src.id == dst.id and 2 * width <= src.gpus_per_node:
            return link.latency_s
        return link.latency_s + self.options.network.p2p_latency_s

    def optimizer_seconds(self, island: Island, params: int, zero: int, group: int, tp: int = 1) -> float:
        """The optimizer step of a device holding `params` / tp parameters (/ `group` under ZeRO >= 1)."""
        prof = self.profiles.get(island.timing_key)
        local = params / tp / group if zero >= 1 else params / tp
        if prof and prof.optimizer_s_per_gparam > 0:
            return prof.optimizer_s_per_gparam * local / 1e9
        # read and write weights, gradient and optimizer states once, at the device's memory bandwidth
        per_param = 2 * (self.weight_bytes_per_param + self.grad_bytes_per_param + self.opt_bytes_per_param)
        bw = island.device.effective_memory_bandwidth(self.options.memory_fraction) or self.options.optimizer_bytes_per_s
        return local * per_param / bw

    def model_flops_per_step(self) -> float:
        f, b = self.model.slice_flops_per_token(0, self.model.num_layers)
        return (f + b) * self.train.tokens_per_step
