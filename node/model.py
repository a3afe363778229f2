"""The torch modules of a decoder-only transformer, built slice by slice.

`build_slice(config, start, end)` allocates only layers `[start, end)` (layer 0 is the embedding, the
last is the final norm + LM head, as in `atoll.modelspec`): the modules are made on the meta device and
only the slice's own parameters are then allocated, on the target device and dtype. Each layer is
initialised from a generator seeded by (seed, layer index), so every node builds identical weights for a
layer whatever the cut (or left for pretrained weights to fill: `init=False`, `atoll.node.pretrained`).
Parameters are named by global layer index (`layers.<i>.<...>`), so the state of a slice can be saved
by layer and loaded into another cut of the same model; `atoll.hf` maps them to Hugging Face names.
A tied head (`tied_head`) uses the embedding's weight on the embedding's stage; on a stage of its own it holds a
copy (`layers.<last>.lm.weight`), drawn like the embedding's token table, which `atoll.node.tied` keeps equal.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from atoll.modelspec import ModelConfig
from atoll.node.wgrad import DeferrableLinear


class OffsetRMSNorm(nn.Module):
    """RMSNorm that scales by (1 + weight), computed in fp32 and cast back (Gemma's); the weight starts at 0."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def _norm(config: ModelConfig, width: int | None = None) -> nn.Module:
    """The style's norm over `width` features (default: d_model)."""
    width = config.d_model if width is None else width
    if config.style == "gpt":
        return nn.LayerNorm(width, eps=config.eps)
    if config.norm_unit_offset:
        return OffsetRMSNorm(width, config.eps)
    return nn.RMSNorm(width, eps=config.eps)


def rope_inv_freq(config: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Rotary inverse frequencies (head_dim / 2,), fp32, with Llama 3's scaling when the config has it
    (the same arithmetic as `transformers`' rope initialisation, so pretrained weights see the same angles)."""
    hd = config.head_size
    inv = 1.0 / (config.theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
    if config.rope_scaling is None:
        return inv
    factor, low, high, original = config.rope_scaling
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Embedding(nn.Module):
    """Token embedding (+ learned positions in the gpt style; times sqrt(d_model) with `embed_scale`).
    Input: (batch, seq) int64 token ids."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.seq_len, config.d_model) if config.style == "gpt" else None
        self.scale = math.sqrt(config.d_model) if config.embed_scale else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        if self.scale is not None:  # the scale rounded to the table's dtype first, as transformers' Gemma does
            x = x * torch.tensor(self.scale, dtype=x.dtype, device=x.device)
        if self.pos is not None:
            x = x + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return x


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate pairs (first half, second half)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.n_heads, self.kv_heads, self.head_dim = c.n_heads, c.kv_heads, c.head_size
        gpt = c.style == "gpt"
        self.gpt = gpt
        self.norm1 = _norm(c)
        self.qkv = DeferrableLinear(c.d_model, c.q_dim + 2 * c.kv_dim, bias=c.has_qkv_bias)
        # Qwen3: one norm over head_dim for every query head, one for every key head (before the rotary positions)
        self.q_norm = _norm(c, c.head_size) if c.qk_norm else None
        self.k_norm = _norm(c, c.head_size) if c.qk_norm else None
        self.proj = DeferrableLinear(c.q_dim, c.d_model, bias=gpt)
        self.norm2 = _norm(c)
        if gpt:
            self.fc = DeferrableLinear(c.d_model, c.ffn, bias=True)
        else:
            self.fc = DeferrableLinear(c.d_model, 2 * c.ffn, bias=False)  # gate and up, fused
        self.out = DeferrableLinear(c.ffn, c.d_model, bias=gpt)
        self.gelu = "tanh" if c.gelu_tanh else "none"
        self.gate_gelu = bool(c.gelu_tanh)  # llama style: a tanh-GELU gate (GeGLU) instead of SiLU
        self.config = c
        # rotary angles for the sequence length last seen, made on first use (so a block built on the meta
        # device holds no table, and a long max position costs nothing until it is used)
        self._rope: tuple[int, torch.device, torch.Tensor, torch.Tensor] | None = None

    def rope(self, s: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (s, head_dim / 2) fp32, of positions 0..s-1."""
        if self._rope is None or self._rope[0] != s or self._rope[1] != device:
            with torch.autocast(device.type, enabled=False):  # fp32 angles under a bf16/fp16 forward too
                ang = torch.outer(torch.arange(s, dtype=torch.float32, device=device),
                                  rope_inv_freq(self.config, device))
            self._rope = (s, device, ang.cos(), ang.sin())
        return self._rope[2], self._rope[3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm1(x)
        # q width from the head count: n_heads x head_dim, or its tp shard's heads (atoll.node.tp lowers
        # n_heads/kv_heads)
        qd = self.n_heads * self.head_dim
        q, k, v = self.qkv(h).split([qd, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.n_heads, self.head_dim)
        k = k.view(b, s, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if not self.gpt:
            cos, sin = self.rope(s, q.device)
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if self.kv_heads != self.n_heads:
            rep = self.n_heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, qd))
        h = self.norm2(x)
        if self.gpt:
            h = F.gelu(self.fc(h), approximate=self.gelu)
        else:
            gate, up = self.fc(h).chunk(2, dim=-1)
            h = (F.gelu(gate, approximate="tanh") if self.gate_gelu else F.silu(gate)) * up
        return x + self.out(h)


class Head(nn.Module):
    """Final norm and LM head. Output: (batch, seq, vocab) logits."""

    def __init__(self, config: ModelConfig, tied_copy: bool = False):
        super().__init__()
        self.norm = _norm(config)
        # a tied head on a stage without the embedding holds its own copy of the shared weight (`lm.weight`,
        # kept equal to the embedding's by `atoll.node.tied`); on the embedding's stage it uses that one
        self.tied_copy = tied_copy
        # the tied copy's gradient is summed with the embedding's after backward: computed there, not deferred
        self.lm = nn.Linear(config.d_model, config.vocab_size, bias=False) if tied_copy else \
            DeferrableLinear(config.d_model, config.vocab_size, bias=False) if not config.tied_head else None
        # the matmul with the embedding's weight: `atoll.node.tp` swaps in its vocab-parallel form
        self.tied_linear = F.linear

    def forward(self, x: torch.Tensor, tied_weight: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm(x)
        if self.lm is not None:
            return self.lm(h)
        if tied_weight is None:
            raise RuntimeError("a tied head on the embedding's stage needs the embedding's weight")
        return self.tied_linear(h, tied_weight)


def _init_layer(module: nn.Module, config: ModelConfig, seed: int, index: int) -> None:
    """GPT-2 style initialisation from a generator seeded by (seed, layer index)."""
    g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + index)
    residual_std = 0.02 / math.sqrt(2 * config.n_layers)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim == 1:  # norm weights and biases
                p.copy_(torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p))
                continue
            std = residual_std if name.startswith(("proj.", "out.")) else 0.02
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(std).to(p.dtype))
        for m in module.modules():  # a (1 + weight) norm is the identity scale at weight 0
            if isinstance(m, OffsetRMSNorm):
                m.weight.zero_()


def init_tied_copy(head: Head, config: ModelConfig, seed: int) -> None:
    """Give a tied head's copy the embedding's initial weight: the first tensor `_init_layer` draws for layer 0
    (its token table), so both stages start equal without either sending it."""
    assert head.lm is not None
    g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + 0)
    with torch.no_grad():
        w = head.lm.weight
        w.copy_(torch.randn(w.shape, generator=g, dtype=torch.float32).mul_(0.02).to(w.dtype))


def layer_kind(config: ModelConfig, index: int) -> str:
    if index == 0:
        return "embedding"
    if index == config.n_layers + 1:
        return "head"
    if 0 < index <= config.n_layers:
        return "block"
    raise ValueError(f"layer {index} is outside the model's {config.n_layers + 2} layers")


def _new_layer(config: ModelConfig, index: int) -> nn.Module:
    return {"embedding": Embedding, "block": Block, "head": Head}[layer_kind(config, index)](config)


def build_layer(config: ModelConfig, index: int, seed: int = 0, *, tied_copy: bool = False) -> nn.Module:
    """One layer on the CPU, initialised as in every slice. `tied_copy`: a tied model's head holding its own copy
    of the shared weight, as on a stage without the embedding (a tied head built alone has no weight otherwise)."""
    if tied_copy and not (config.tied_head and layer_kind(config, index) == "head"):
        raise ValueError(f"layer {index} is not the head of a tied model: it holds no copy of the tied weight")
    module = Head(config, tied_copy=True) if tied_copy else _new_layer(config, index)
    _init_layer(module, config, seed, index)
    return module


class StageModule(nn.Module):
    """Layers [start, end) of the model. Input: token ids (first stage) or hidden states.

    Output: hidden states (batch, seq, d_model), or logits (batch, seq, vocab) when it holds the head.
    Blocks in `recompute` run under `torch.utils.checkpoint` (non-reentrant) while training: their forward
    keeps only the block's input, and backward runs the block again to rebuild what it needs.
    """

    def __init__(self, config: ModelConfig, start: int, end: int, seed: int = 0,
                 recompute: Iterable[int] = (), *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32, init: bool = True):
        super().__init__()
        total = config.n_layers + 2
        if not 0 <= start < end <= total:
            raise ValueError(f"slice [{start}, {end}) is outside the model's {total} layers")
        self.config, self.start, self.end = config, start, end
        # Megatron-style tied weights: the head's stage, when it is not the embedding's, holds a copy of the
        # shared weight (initialised identically; its gradient summed with the embedding's, `atoll.node.tied`)
        copy = config.tied_head and end == total and start > 0
        with torch.device("meta"):  # shapes only; the slice's own tensors are allocated below
            layers = nn.ModuleDict({str(i): Head(config, tied_copy=True) if copy and i == total - 1
                                    else _new_layer(config, i) for i in range(start, end)})
        self.layers = layers.to(dtype=dtype).to_empty(device=torch.device("cpu") if device is None else device)
        if init:
            for i in range(start, end):
                _init_layer(self.layers[str(i)], config, seed, i)
            if copy:
                init_tied_copy(self.layers[str(total - 1)], config, seed)
        self.recompute: frozenset[int] = frozenset()
        self.set_recompute(recompute)

    def set_recompute(self, layers: Iterable[int]) -> None:
        """Recompute these blocks (global layer indices) in backward from now on; () recomputes none."""
        chosen = frozenset(int(i) for i in layers)
        bad = sorted(i for i in chosen if not self.start <= i < self.end or layer_kind(self.config, i) != "block")
        if bad:
            raise ValueError(f"only blocks of this slice [{self.start}, {self.end}) can be recomputed; {bad} are not "
                             f"(layer 0 is the embedding, {self.config.n_layers + 1} the head)")
        self.recompute = chosen

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def tied_copy(self) -> nn.Parameter | None:
        """The head's copy of the tied embedding weight when this slice holds the head but not the embedding."""
        head = self.layers[str(self.end - 1)] if self.is_last else None
        if isinstance(head, Head) and head.tied_copy and head.lm is not None:
            return head.lm.weight
        return None

    @property
    def ties_embedding(self) -> bool:
        """Whether this slice holds the embedding of a tied model whose head is on another stage."""
        return self.config.tied_head and self.is_first and not self.is_last

    @property
    def is_last(self) -> bool:
        return self.end == self.config.n_layers + 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.start, self.end):
            layer = self.layers[str(i)]
            if isinstance(layer, Head) and layer.lm is None:
                x = layer(x, tied_weight=self.layers["0"].tok.weight)
            elif i in self.recompute and torch.is_grad_enabled():
                # non-reentrant: works with inputs that need no grad, nests under autocast and saved-tensor
                # hooks (which see the one input it keeps), and restores the RNG state for the rerun
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return x


def build_slice(config: ModelConfig, start: int, end: int, *, seed: int = 0,
                device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
                recompute: Iterable[int] = (), init: bool = True) -> StageModule:
    """Allocate layers [start, end) only, on `device` in `dtype`, initialised identically on every node
    (`init=False`: left uninitialised, for a checkpoint or pretrained weights to fill); `recompute`: the
    blocks whose activations are recomputed in backward instead of kept."""
    return StageModule(config, start, end, seed, recompute=recompute, device=device, dtype=dtype, init=init)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; logits (batch, seq, vocab), targets (batch, seq) int64."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
