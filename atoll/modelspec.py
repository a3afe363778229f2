"""Analytic description of a decoder-only transformer, layer by layer.

Layers are numbered as the planner and the stages see them: layer 0 is the embedding, layers
1..n_layers are the transformer blocks, and layer n_layers + 1 is the head (final norm + LM head).
A slice is a half-open range `[a, b)` of these layers.

Two styles share the description:
- ``gpt``: learned position embedding, LayerNorm (weight + bias), biased linears, GELU MLP.
- ``llama``: rotary positions (no position embedding), RMSNorm (weight only), no biases (or q/k/v biases
  only, as Qwen2 has), SwiGLU MLP. Options of the family: a head width other than d_model / n_heads and
  RMSNorms of each query and key head (Qwen3); norms scaling by (1 + weight), an embedding scaled by
  sqrt(d_model) and a tanh-GELU gate (Gemma).

Hugging Face configs (llama, mistral, qwen2, qwen3, gemma, gpt2) map onto these two styles: `atoll.hf`, which
builds on this module (never the other way round); `atoll.models` names and reads a model of either source.

Units: parameters are counts, FLOPs are per token (a multiply-add is 2 FLOPs), memory is in bytes.

FLOP convention (the one `torch.utils.flop_counter.FlopCounterMode` uses, and tested against it):
only matrix multiplications count: the linear layers, and attention's two products (QK^T and AV)
over the full score matrix even though it is causal, so a block costs 4 * seq_len * n_heads * head_dim per
token for attention. Element-wise work (norms, activations, softmax, RoPE, residual adds) and the embedding
lookup count as 0. Backward is twice the forward (gradients of both inputs and weights), including
the first block (its input gradient feeds the embedding). Note that FlopCounterMode sees the attention
products only under the math or CUDA kernels, not the CPU flash kernel.

Activation memory counts what autograd saves for backward (checked against saved-tensor hooks):
for the head, the final norm's input and output and the fp32 log-probabilities of the loss.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal

Style = Literal["gpt", "llama"]
LayerKind = Literal["embedding", "block", "head"]

DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2}


SIZE_LIMITS: dict[str, int] = {
    "vocab_size": 10_000_000, "d_model": 1_000_000, "n_layers": 10_000, "n_heads": 1_000_000,
    "n_kv_heads": 1_000_000, "ffn_hidden": 10_000_000, "seq_len": 100_000_000, "head_dim": 1_000_000,
}
"""The largest value of each size field of a ModelConfig: generous stated limits, far above any published model
(vocabularies of 256k tokens, widths near 20k, 126 blocks, contexts of 10M tokens), so that a typo is refused with
its field named rather than the planner laying out that many layers or bytes."""

REQUIRED_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len")
"""The ModelConfig fields without a default."""
LLAMA_ONLY = ("qkv_bias", "rope_theta", "rope_scaling", "head_dim", "qk_norm", "norm_unit_offset", "embed_scale")
"""The ModelConfig fields that apply to the llama style only."""


def shown(value: Any, width: int = 60) -> str:
    """`repr(value)` cut to `width` characters, for an error message that quotes what it was given."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name ("fp32", "fp16", "bf16")."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use one of fp32, fp16, bf16") from None


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of a decoder-only transformer."""

    name: str = "custom"
    """A label used in plans and logs."""
    style: Style = "gpt"
    """``gpt`` (LayerNorm, GELU, learned positions, biases) or ``llama`` (RMSNorm, SwiGLU, RoPE)."""
    vocab_size: int
    """Tokens in the vocabulary."""
    d_model: int
    """Width of the residual stream."""
    n_layers: int
    """Transformer blocks."""
    n_heads: int
    """Attention heads; must divide d_model unless head_dim is set."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means n_heads. Must divide n_heads."""
    ffn_hidden: int | None = None
    """Hidden width of the MLP; None means 4 x d_model."""
    seq_len: int
    """Maximum sequence length (the learned position table of the gpt style has this many rows)."""
    tied_head: bool = False
    """Share the LM head's weight with the token embedding."""
    # fields below default to None (the style's usual value) so that specs written before them keep their ids
    qkv_bias: bool | None = None
    """llama style: biases on the q, k and v projections (Qwen2); None: none. The gpt style always has biases."""
    norm_eps: float | None = None
    """Epsilon of the norms (LayerNorm or RMSNorm); None: 1e-5."""
    rope_theta: float | None = None
    """llama style: base of the rotary frequencies; None: 10000."""
    rope_scaling: tuple[float, float, float, int] | None = None
    """llama style: Llama 3 frequency scaling (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings); None: none."""
    gelu_tanh: bool | None = None
    """The MLP's activation is GELU's tanh approximation: in the gpt style instead of the exact GELU (GPT-2's
    gelu_new), in the llama style as the gate instead of SiLU (GeGLU, Gemma's gelu_pytorch_tanh); None: the
    style's own (GELU, SiLU)."""
    head_dim: int | None = None
    """llama style: width of one attention head, so q is n_heads x head_dim wide and k, v n_kv_heads x head_dim
    (Qwen3, Gemma: 8 heads of 256 over a width of 2048); None: d_model / n_heads. Even (rotary pairs)."""
    qk_norm: bool | None = None
    """llama style: an RMSNorm over head_dim on each query and key head before the rotary positions (Qwen3);
    None: none."""
    norm_unit_offset: bool | None = None
    """llama style: every RMSNorm scales by (1 + weight), its weights starting at 0 (Gemma); None: by weight."""
    embed_scale: bool | None = None
    """llama style: the token embedding's output is multiplied by sqrt(d_model) (Gemma); None: not scaled."""

    def __post_init__(self) -> None:
        self._check_types()
        for name, limit in SIZE_LIMITS.items():
            value = getattr(self, name)
            if value is None:  # n_kv_heads, ffn_hidden: the style's usual value
                continue
            if value <= 0:
                raise ValueError(f"model.{name} must be positive, got {value}")
            if value > limit:
                raise ValueError(f"model.{name} must be at most {limit:,} (a generous limit no real model meets), "
                                 f"got {value}")
        if self.style not in ("gpt", "llama"):
            raise ValueError(f"model.style must be 'gpt' or 'llama', got {self.style!r}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"model.n_heads ({self.n_heads}) must divide model.d_model ({self.d_model}), or set "
                             f"model.head_dim (llama style)")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_kv_heads ({self.kv_heads}) must divide model.n_heads ({self.n_heads})")
        if self.style == "gpt":
            for name in LLAMA_ONLY:
                if getattr(self, name) is not None:
                    raise ValueError(f"model.{name} applies to the llama style only; remove it or set "
                                     f"model.style = \"llama\"")
        elif self.head_size % 2:
            raise ValueError(f"the llama style's head width ({self.head_size}) must be even (rotary positions turn "
                             "pairs of it): change model.head_dim, or model.d_model / model.n_heads")
        if self.norm_eps is not None and not self.norm_eps > 0:
            raise ValueError(f"model.norm_eps must be positive, got {self.norm_eps}")
        if self.rope_theta is not None and not self.rope_theta > 0:
            raise ValueError(f"model.rope_theta must be positive, got {self.rope_theta}")
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            if not 0 < rs[3] <= SIZE_LIMITS["seq_len"] or not all(x > 0 for x in rs[:3]) or rs[1] >= rs[2]:
                raise ValueError("model.rope_scaling must be [factor, low_freq_factor, high_freq_factor, "
                                 "original_max_position_embeddings], positive, low < high, the last at most "
                                 f"{SIZE_LIMITS['seq_len']:,}; got {list(rs)}")

    def _check_types(self) -> None:
        """Each field of its type (integers are not booleans, numbers are finite), a number written as an integer
        made a float, and rope_scaling made a tuple; a field of another type is one ValueError naming it."""
        def fail(name: str, expected: str) -> None:
            raise ValueError(f"model.{name} must be {expected}, got {shown(getattr(self, name))}")

        for name in ("name", "style"):
            if not isinstance(getattr(self, name), str):
                fail(name, "a string")
        for name in SIZE_LIMITS:
            value = getattr(self, name)
            if name in ("n_kv_heads", "ffn_hidden", "head_dim") and value is None:
                continue
            if not _is_int(value):
                fail(name, "an integer" if name in REQUIRED_FIELDS else "an integer (or left out)")
        if not isinstance(self.tied_head, bool):
            fail("tied_head", "true or false")
        for name in ("qkv_bias", "gelu_tanh", "qk_norm", "norm_unit_offset", "embed_scale"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                fail(name, "true or false (or left out)")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if value is None:
                continue
            if not _is_number(value) or not math.isfinite(value):
                fail(name, "a finite number (or left out)")
            object.__setattr__(self, name, float(value))
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            if not (isinstance(rs, (list, tuple)) and len(rs) == 4 and _is_int(rs[3])
                    and all(_is_number(x) and math.isfinite(x) for x in rs[:3])):
                fail("rope_scaling", "a list [factor, low_freq_factor, high_freq_factor, "
                     "original_max_position_embeddings] of three finite numbers and an integer (or left out)")
            object.__setattr__(self, "rope_scaling", (float(rs[0]), float(rs[1]), float(rs[2]), rs[3]))

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_size(self) -> int:
        """Width of one attention head: head_dim, or d_model / n_heads."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention's output): n_heads x the head width."""
        return self.n_heads * self.head_size

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_size

    @property
    def ffn(self) -> int:
        return 4 * self.d_model if self.ffn_hidden is None else self.ffn_hidden

    @property
    def has_qkv_bias(self) -> bool:
        """Whether the q, k and v projections carry biases (always in the gpt style)."""
        return self.style == "gpt" or bool(self.qkv_bias)

    @property
    def eps(self) -> float:
        return 1e-5 if self.norm_eps is None else self.norm_eps

    @property
    def theta(self) -> float:
        return 10000.0 if self.rope_theta is None else self.rope_theta

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, *, where: str | None = None) -> "ModelConfig":
        """The ModelConfig of a dict of its fields (`to_dict`, a model JSON file); `where` names the source in
        errors (a file's path), each one line naming the field and what it should be."""
        prefix = f"{where}: " if where else ""
        if not isinstance(d, dict):
            raise ValueError(f"{prefix}a model config must be an object of model fields "
                             f"({{\"vocab_size\": 256, \"d_model\": 64, ...}}), got {shown(d)}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise ValueError(f"{prefix}unknown model field(s) {unknown}; known: {sorted(known)}")
        missing = [name for name in REQUIRED_FIELDS if name not in d]
        if missing:
            raise ValueError(f"{prefix}model field(s) {', '.join(missing)} missing; a model config needs "
                             f"{', '.join(REQUIRED_FIELDS)}")
        try:
            return cls(**d)
        except ValueError as e:
            raise ValueError(f"{prefix}{e}") from None


def _is_int(value: Any) -> bool:
    """An int, not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


PRESETS: dict[str, ModelConfig] = {
    # trains in seconds on a CPU; byte-level vocabulary
    "tiny": ModelConfig(name="tiny", vocab_size=256, d_model=64, n_layers=4, n_heads=4, ffn_hidden=256, seq_len=64),
    "small": ModelConfig(name="small", vocab_size=256, d_model=256, n_layers=8, n_heads=8, seq_len=256),
    "125m": ModelConfig(name="125m", vocab_size=50257, d_model=768, n_layers=12, n_heads=12, seq_len=1024),
    "350m": ModelConfig(name="350m", vocab_size=50257, d_model=1024, n_layers=24, n_heads=16, seq_len=1024),
    "1.3b": ModelConfig(name="1.3b", vocab_size=50257, d_model=2048, n_layers=24, n_heads=16, seq_len=2048),
    "7b": ModelConfig(name="7b", style="llama", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                      ffn_hidden=11008, seq_len=4096),
    "13b": ModelConfig(name="13b", style="llama", vocab_size=32000, d_model=5120, n_layers=40, n_heads=40,
                       ffn_hidden=13824, seq_len=4096),
    "70b": ModelConfig(name="70b", style="llama", vocab_size=32000, d_model=8192, n_layers=80, n_heads=64,
                       n_kv_heads=8, ffn_hidden=28672, seq_len=4096),
}


@dataclass(frozen=True)
class LayerSpec:
    """One layer of the model: what it holds and what it costs per token."""

    index: int
    kind: LayerKind
    params: int
    """Parameters held by this layer (a tied head holds none of its own)."""
    flops_fwd_per_token: float
    flops_bwd_per_token: float
    out_elems_per_token: int
    """Elements of the layer's output per token (what crosses a stage boundary after it)."""
    saved_elems_per_token: int
    """Elements saved for backward per token without recomputation."""
    saved_fp32_elems_per_token: int = 0
    """Extra fp32 elements saved per token (the head's log-probabilities for the loss)."""
    flops_wgrad_per_token: float = 0.0
    """Of the backward, the linear layers' weight-gradient products (what a zero-bubble schedule defers,
    `atoll.node.wgrad`)."""
    wgrad_elems_per_token: int = 0
    """Elements per token a deferred weight gradient holds until it is computed: each linear layer's input and
    output gradient."""

    def out_bytes_per_token(self, dtype: str = "fp32") -> int:
        return self.out_elems_per_token * dtype_bytes(dtype)

    def activation_bytes(self, micro_batch: int, seq_len: int, dtype: str = "fp32", recompute: bool = False) -> int:
        """Memory held for backward by one micro-batch in flight through this layer."""
        tokens = micro_batch * seq_len
        if recompute:  # only the layer's input is kept; the rest is recomputed in backward
            elems = self.out_elems_per_token
            return tokens * elems * dtype_bytes(dtype)
        return tokens * (self.saved_elems_per_token * dtype_bytes(dtype) + self.saved_fp32_elems_per_token * 4)


@dataclass(frozen=True)
class ModelSpec:
    """The model as the planner sees it: a list of layers with their costs."""

    config: ModelConfig
    layers: tuple[LayerSpec, ...] = field(repr=False)

    @classmethod
    def from_config(cls, config: ModelConfig) -> "ModelSpec":
        c = config
        d, v, f, kv, s, q = c.d_model, c.vocab_size, c.ffn, c.kv_dim, c.seq_len, c.q_dim
        gpt = c.style == "gpt"
        norm_params = 2 * d if gpt else d
        layers: list[LayerSpec] = []

        emb_params = v * d + (s * d if gpt else 0)
        layers.append(LayerSpec(0, "embedding", emb_params, 0.0, 0.0, d, saved_elems_per_token=d))

        # matmul weights of one block (multiply-adds per token = these counts)
        attn_w = d * (q + 2 * kv) + q * d
        mlp_w = (2 if gpt else 3) * d * f
        bias = (d + 2 * kv) + d + f + d if gpt else ((q + 2 * kv) if c.has_qkv_bias else 0)
        head_norms = 2 * c.head_size if c.qk_norm else 0  # one RMSNorm weight each for q and k, shared by heads
        block_params = attn_w + mlp_w + bias + 2 * norm_params + head_norms
        attn_scores = 4 * s * q  # QK^T and AV, per token, full matrix
        fwd = 2.0 * (attn_w + mlp_w) + attn_scores
        # saved for backward: norm inputs, qkv, attention output (and its copy as proj's input), the MLP's input,
        # hidden and activated
        saved = 2 * d + (q + 2 * kv) + 2 * q + (2 if gpt else 3) * f + d
        if not gpt:
            # q and k before and after RoPE, k and v repeated to every head (GQA), the gate activation's output
            saved += (q + kv) + (2 * q if kv != q else 0) + f
            if c.qk_norm:  # each head norm's input
                saved += q + kv
            if c.norm_unit_offset:  # each (1 + weight) norm's normalised input, kept for its product
                saved += 2 * d
        # deferred weight gradients: per linear layer its input and its output's gradient (qkv, proj, fc, out)
        fc_out = f if gpt else 2 * f
        stash = (d + (q + 2 * kv)) + (q + d) + (d + fc_out) + (f + d)
        for i in range(1, c.n_layers + 1):
            layers.append(LayerSpec(i, "block", block_params, fwd, 2.0 * fwd, d, saved_elems_per_token=saved,
                                    flops_wgrad_per_token=2.0 * (attn_w + mlp_w), wgrad_elems_per_token=stash))

        head_params = norm_params + (0 if c.tied_head else d * v)
        head_fwd = 2.0 * d * v
        # a tied head's product uses the embedding's weight and is computed in backward (not deferred)
        layers.append(
            LayerSpec(c.n_layers + 1, "head", head_params, head_fwd, 2.0 * head_fwd, 1,
                      saved_elems_per_token=2 * d, saved_fp32_elems_per_token=v,
                      flops_wgrad_per_token=0.0 if c.tied_head else head_fwd,
                      wgrad_elems_per_token=0 if c.tied_head else d + v)
        )
        return cls(config=c, layers=tuple(layers))

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def num_layers(self) -> int:
        """Layers including the embedding and the head (n_layers + 2)."""
        return len(self.layers)

    @property
    def total_params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def block_params(self) -> int:
        """Parameters of one block (what a node's profile times an optimizer step over); 0 without blocks."""
        return next((layer.params for layer in self.layers if layer.kind == "block"), 0)

    def with_seq_len(self, seq_len: int) -> "ModelSpec":
        return ModelSpec.from_config(replace(self.config, seq_len=seq_len))

    def slice_params(self, start: int, end: int) -> int:
        """Parameters of layers [start, end); a tied head's stage without the embedding also holds a copy of
        the tied weight (vocab x d_model, `atoll.node.tied`)."""
        self._check_slice(start, end)
        c = self.config
        copy = c.vocab_size * c.d_model if c.tied_head and start > 0 and end == len(self.layers) else 0
        return sum(layer.params for layer in self.layers[start:end]) + copy

    def slice_flops_per_token(self, start: int, end: int) -> tuple[float, float]:
        """(forward, backward) FLOPs per token of layers [start, end)."""
        self._check_slice(start, end)
        sl = self.layers[start:end]
        return sum(x.flops_fwd_per_token for x in sl), sum(x.flops_bwd_per_token for x in sl)

    def boundary_bytes(self, end: int, micro_batch: int, seq_len: int, dtype: str = "fp32") -> int:
        """Bytes of the activation that leaves layer end-1 for one micro-batch (what a stage sends)."""
        return self.layers[end - 1].out_bytes_per_token(dtype) * micro_batch * seq_len

    def activation_bytes(self, start: int, end: int, micro_batch: int, seq_len: int, dtype: str = "fp32",
                         recompute: bool = False) -> int:
        """Memory saved for backward by one micro-batch through layers [start, end)."""
        self._check_slice(start, end)
        return sum(x.activation_bytes(micro_batch, seq_len, dtype, recompute) for x in self.layers[start:end])

    def model_state_bytes(self, start: int, end: int, dtype: str = "fp32", optimizer: str = "adamw") -> dict[str, int]:
        """Weights, gradients and optimizer states of layers [start, end), unsharded.

        fp32 training keeps fp32 weights and gradients and AdamW's two fp32 moments; 16-bit mixed
        precision keeps 16-bit weights and gradients plus an fp32 master copy and the two moments.
        """
        p = self.slice_params(start, end)
        b = dtype_bytes(dtype)
        states_per_param = {"adamw": 2, "adam": 2, "sgd": 1}.get(optimizer)
        if states_per_param is None:
            raise ValueError(f"unknown optimizer {optimizer!r}: use adamw, adam or sgd")
        master = 4 if b < 4 else 0
        return {"weights": p * b, "gradients": p * b, "optimizer": p * (4 * states_per_param + master)}

    def _check_slice(self, start: int, end: int) -> None:
        if not 0 <= start < end <= self.num_layers:
            raise ValueError(f"slice [{start}, {end}) is outside the model's {self.num_layers} layers")
