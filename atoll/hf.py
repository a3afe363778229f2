"""Hugging Face decoder-only models as Atoll model shapes: config.json in and out, and parameter names.

Pure mapping, no torch: `config_from_hf(config_json)` turns a `transformers` config (model_type llama,
mistral, qwen2, qwen3, gemma or gpt2) into an `atoll.modelspec.ModelConfig`, `hf_config(model)` writes one back, and
`param_map(model, layer)` says where each Atoll parameter of a layer lives in a Hugging Face checkpoint.

Atoll's modules keep two fused linears that Hugging Face keeps apart, so the mapping is one-to-one per row
range rather than per name:
- a block's ``qkv`` rows are ``q_proj``, ``k_proj``, ``v_proj`` stacked in that order (weights and, for
  Qwen2, biases); GPT-2's ``c_attn`` is already fused the same way;
- a SwiGLU block's ``fc`` rows are ``gate_proj`` then ``up_proj``.
GPT-2's ``Conv1D`` stores its weight as (in, out), the transpose of a linear's (out, in): those entries
carry ``transpose=True``. Everything else maps name to name:

    Atoll (layer i)        llama / mistral / qwen2 / qwen3 / gemma      gpt2
    0: tok.weight          model.embed_tokens.weight                    transformer.wte.weight
    0: pos.weight          -                                            transformer.wpe.weight
    i: norm1.*             model.layers.{i-1}.input_layernorm.*         transformer.h.{i-1}.ln_1.*
    i: qkv.*               model.layers.{i-1}.self_attn.{q,k,v}_proj.*  transformer.h.{i-1}.attn.c_attn.* (T)
    i: q_norm, k_norm      model.layers.{i-1}.self_attn.{q,k}_norm.*    - (qwen3 only)
    i: proj.*              model.layers.{i-1}.self_attn.o_proj.*        transformer.h.{i-1}.attn.c_proj.* (T)
    i: norm2.*             model.layers.{i-1}.post_attention_layernorm  transformer.h.{i-1}.ln_2.*
    i: fc.*                model.layers.{i-1}.mlp.{gate,up}_proj.*      transformer.h.{i-1}.mlp.c_fc.* (T)
    i: out.*               model.layers.{i-1}.mlp.down_proj.*           transformer.h.{i-1}.mlp.c_proj.* (T)
    n+1: norm.*            model.norm.*                                 transformer.ln_f.*
    n+1: lm.weight         lm_head.weight (tied: the embedding's)       lm_head.weight (tied: wte's)

Presets (`HF_PRESETS`) hold the published config.json of well-known models, so a job can name one
(`preset = "llama-3.2-1b"`) without the file at hand.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atoll.fsutil import read_text_file, shown_path
from atoll.modelspec import SIZE_LIMITS, ModelConfig, shown

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gpt2")
BASE_PREFIX = {"llama": "model.", "qwen2": "model.", "qwen3": "model.", "gemma": "model.", "gpt2": "transformer."}
"""The base model's prefix in a causal-LM checkpoint; files saved from the base model alone lack it."""
UNBUILT = {"gemma2": "logit soft-capping, alternating sliding windows and norms after each sublayer",
           "gemma3": "a vision tower, logit soft-capping, alternating sliding windows and norms after each sublayer",
           "gemma3_text": "alternating local and global attention with two rope bases and norms after each sublayer"}
"""Model types of families near the supported ones, with what Atoll's blocks do not build of them."""
HEAD_DIM = {"qwen3": 128, "gemma": 256}
"""transformers' head_dim where a config.json of the type leaves it out (others: hidden_size / heads)."""

# the published config.json of each model (the fields Atoll reads and the ones it writes back)
HF_PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
             "n_positions": 1024, "n_inner": None, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
             "bos_token_id": 50256, "eos_token_id": 50256},
    "gpt2-medium": {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 1024, "n_layer": 24, "n_head": 16,
                    "n_positions": 1024, "n_inner": None, "layer_norm_epsilon": 1e-5,
                    "activation_function": "gelu_new", "bos_token_id": 50256, "eos_token_id": 50256},
    "llama-3.2-1b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                     "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                     "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                     "bos_token_id": 128000, "eos_token_id": 128001},
    "qwen2.5-0.5b": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                     "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                     "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": True,
                     "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151643},
    "mistral-7b": {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                   "sliding_window": 4096, "tie_word_embeddings": False, "hidden_act": "silu",
                   "bos_token_id": 1, "eos_token_id": 2},  # Mistral-7B-v0.1
    "qwen3-0.6b": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                   "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": True,
                   "hidden_act": "silu", "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645},
    "gemma-2b": {"model_type": "gemma", "vocab_size": 256000, "hidden_size": 2048, "intermediate_size": 16384,
                 "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
                 "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                 "hidden_act": "gelu_pytorch_tanh", "attention_bias": False, "tie_word_embeddings": True,
                 "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1},
}

TRAIN_SEQ_LEN = 2048
"""Tokens per sequence a Hugging Face model is planned at unless the user says otherwise (`train_seq_len`)."""


def train_seq_len(config: ModelConfig) -> int:
    """The sequence length to train a Hugging Face model at by default: its positions' reach (n_positions,
    max_position_embeddings) capped at `TRAIN_SEQ_LEN`. A config's reach is the longest context the model serves
    (131,072 for Llama 3.2), which pretraining meets only in a last long-context phase; one such sequence alone
    can outgrow a device (the head's fp32 log-probabilities: 67 GB for Llama 3.2's vocabulary)."""
    return min(config.seq_len, TRAIN_SEQ_LEN)


class HfConfigError(ValueError):
    """A Hugging Face config.json that Atoll cannot train; the message says which field and what to change."""


_MISSING = object()


def _need(d: dict[str, Any], key: str, where: str) -> Any:
    if d.get(key) is None:
        raise HfConfigError(f"{where}: config.json has no {key!r}; it is needed for model_type {d.get('model_type')!r}")
    return d[key]


def _int(d: dict[str, Any], key: str, where: str, size: str, default: Any = _MISSING, label: str = "") -> Any:
    """`d[key]`, an integer from 1 to the limit of the ModelConfig field `size` (`SIZE_LIMITS`); absent or null:
    `default` (none given: the key is needed). `label` names the key in errors (default: the key)."""
    value = d.get(key)
    if value is None:
        return _need(d, key, where) if default is _MISSING else default
    limit = SIZE_LIMITS[size]
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit:
        raise HfConfigError(f"{where}: {label or key} must be an integer from 1 to {limit:,} (a generous limit no "
                            f"real model meets), got {shown(value)}")
    return value


def _float(d: dict[str, Any], key: str, where: str, default: float, label: str = "") -> float:
    """`d[key]` as a finite positive float; absent or null: `default`."""
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise HfConfigError(f"{where}: {label or key} must be a finite positive number, got {shown(value)}")
    return float(value)


def _bool(d: dict[str, Any], key: str, where: str, default: bool) -> bool:
    """`d[key]`, true or false; absent or null: `default`."""
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HfConfigError(f"{where}: {key} must be true or false, got {shown(value)}")
    return value


def _object(d: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    """`d[key]`, a JSON object; absent or null: an empty one."""
    value = d.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise HfConfigError(f"{where}: {key} must be an object ({{\"rope_type\": ..., ...}}) or null, got "
                            f"{shown(value)}")
    return value


def _rope(d: dict[str, Any], where: str) -> tuple[float, tuple[float, float, float, int] | None]:
    """(theta, llama3 scaling) from either the transformers v4 fields (rope_theta, rope_scaling) or v5's
    rope_parameters."""
    params = _object(d, "rope_parameters", where)
    theta = _float(d, "rope_theta", where, _float(params, "rope_theta", where, 10000.0, "rope_parameters.rope_theta"))
    key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    scaling = _object(d, "rope_scaling", where) or (params if params.get("rope_type", "default") != "default" else None)
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise HfConfigError(f"{where}: rope scaling of type {kind!r} is not supported (only 'llama3' and none)")
    names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in names if scaling.get(k) is None]
    if missing:
        raise HfConfigError(f"{where}: {key} of type 'llama3' has no {', '.join(missing)}; it needs {', '.join(names)}")
    factor, low, high = (_float(scaling, k, where, 0.0, f"{key}.{k}") for k in names[:3])
    return theta, (factor, low, high, _int(scaling, names[3], where, "seq_len", label=f"{key}.{names[3]}"))


def config_from_hf(d: dict[str, Any], *, name: str | None = None, where: str = "config.json") -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json (a dict); `where` names it in errors, each an HfConfigError
    of one line naming the key and what it should be.

    Sliding-window attention (Mistral v0.1, Qwen2 with use_sliding_window) equals full causal attention on
    sequences no longer than the window, so such a model's seq_len is capped at its window.
    """
    if not isinstance(d, dict):
        raise HfConfigError(f"{where} must hold a JSON object, got {shown(d)}")
    try:
        return _config_from_hf(d, name, where)
    except HfConfigError:
        raise
    except ValueError as e:  # ModelConfig's own checks (heads that do not divide the width, ...)
        raise HfConfigError(f"{where}: {e}") from None


def _config_from_hf(d: dict[str, Any], name: str | None, where: str) -> ModelConfig:
    kind = d.get("model_type")
    if kind in UNBUILT:
        raise HfConfigError(f"{where}: model_type {kind!r} is not supported ({UNBUILT[kind]}); supported: "
                            f"{', '.join(MODEL_TYPES)}")
    if kind not in MODEL_TYPES:
        raise HfConfigError(f"{where}: model_type {shown(kind)} is not supported; use one of {', '.join(MODEL_TYPES)}")
    label = name or str(d.get("_name_or_path") or kind).rstrip("/").split("/")[-1] or kind
    if kind == "gpt2":
        act = d.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise HfConfigError(f"{where}: activation_function {shown(act)} is not supported (gelu_new, gelu)")
        if _bool(d, "scale_attn_by_inverse_layer_idx", where, False):
            raise HfConfigError(f"{where}: scale_attn_by_inverse_layer_idx is not supported; set it to false")
        return ModelConfig(name=label, style="gpt", vocab_size=_int(d, "vocab_size", where, "vocab_size"),
                           d_model=_int(d, "n_embd", where, "d_model"), n_layers=_int(d, "n_layer", where, "n_layers"),
                           n_heads=_int(d, "n_head", where, "n_heads"),
                           ffn_hidden=_int(d, "n_inner", where, "ffn_hidden", None),
                           seq_len=_int(d, "n_positions", where, "seq_len"),
                           tied_head=_bool(d, "tie_word_embeddings", where, True),
                           norm_eps=_float(d, "layer_norm_epsilon", where, 1e-5), gelu_tanh=act != "gelu")
    d_model, heads = _int(d, "hidden_size", where, "d_model"), _int(d, "num_attention_heads", where, "n_heads")
    gemma = kind == "gemma"
    head_dim = _int(d, "head_dim", where, "head_dim", HEAD_DIM.get(kind))
    if head_dim == d_model // heads and d_model % heads == 0:
        head_dim = None  # the width's own share: written as the default, so equal shapes compare equal
    # Gemma's legacy "gelu" means the tanh approximation (transformers rewrites it so); hidden_activation wins
    act_key = "hidden_activation" if gemma and d.get("hidden_activation") is not None else "hidden_act"
    act = d.get(act_key) or ("gelu_pytorch_tanh" if gemma else "silu")
    tanh_gelu = ("gelu_pytorch_tanh", "gelu_new", "gelu") if gemma else ("gelu_pytorch_tanh", "gelu_new")
    if act != "silu" and act not in tanh_gelu:
        raise HfConfigError(f"{where}: {act_key} {shown(act)} is not supported (silu, gelu_pytorch_tanh)")
    if _bool(d, "mlp_bias", where, False):
        raise HfConfigError(f"{where}: mlp_bias is not supported; set it to false")
    if kind != "qwen2" and _bool(d, "attention_bias", where, False):
        raise HfConfigError(f"{where}: attention_bias (biases on q, k, v and o) is not supported; Qwen2-style "
                            "q/k/v biases are (model_type qwen2)")
    if gemma and _bool(d, "use_bidirectional_attention", where, False):
        raise HfConfigError(f"{where}: use_bidirectional_attention is not supported (Atoll trains causal models); "
                            "set it to false")
    theta, scaling = _rope(d, where)
    seq_len = _int(d, "max_position_embeddings", where, "seq_len")
    sliding = kind == "mistral" or _bool(d, "use_sliding_window", where, False)
    window = _int(d, "sliding_window", where, "seq_len", None) if sliding else None
    if window:
        seq_len = min(seq_len, window)
    return ModelConfig(name=label, style="llama", vocab_size=_int(d, "vocab_size", where, "vocab_size"),
                       d_model=d_model, n_layers=_int(d, "num_hidden_layers", where, "n_layers"), n_heads=heads,
                       n_kv_heads=_int(d, "num_key_value_heads", where, "n_kv_heads", None),
                       ffn_hidden=_int(d, "intermediate_size", where, "ffn_hidden"), seq_len=seq_len,
                       tied_head=_bool(d, "tie_word_embeddings", where, gemma),
                       qkv_bias=True if kind == "qwen2" else None, norm_eps=_float(d, "rms_norm_eps", where, 1e-6),
                       rope_theta=theta, rope_scaling=scaling, head_dim=head_dim,
                       qk_norm=True if kind == "qwen3" else None, norm_unit_offset=True if gemma else None,
                       embed_scale=True if gemma else None, gelu_tanh=True if act != "silu" else None)


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """A config.json (or the folder holding one) as a dict."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise FileNotFoundError(f"no Hugging Face config at {shown_path(p)}: give the path of a config.json (or of its "
                                f"folder); a relative path is read from the folder the command runs in")
    text = read_text_file(p, "Hugging Face config", "give the path of a config.json (or of its folder)", HfConfigError)
    try:
        d = json.loads(text)
    except ValueError as e:  # JSONDecodeError, or an integer too long to read
        raise HfConfigError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise HfConfigError(f"{p} must hold a JSON object")
    return d


def config_from_file(path: str | Path) -> ModelConfig:
    """The ModelConfig of a config.json file (or its folder)."""
    return config_from_hf(load_hf_config(path), where=str(path))


def hf_preset(name: str) -> ModelConfig | None:
    """The ModelConfig of a Hugging Face preset, or None when `name` is not one."""
    d = HF_PRESETS.get(name.lower())
    return None if d is None else config_from_hf(d, name=name.lower(), where=f"preset {name!r}")


_FAMILY = {frozenset(): "llama", frozenset({"qkv_bias"}): "qwen2", frozenset({"qk_norm"}): "qwen3",
           frozenset({"norm_unit_offset", "embed_scale"}): "gemma"}
"""The llama style's options each Hugging Face type holds: q/k/v biases (qwen2), q/k norms (qwen3), (1 + weight)
norms with a scaled embedding (gemma)."""


def model_type(config: ModelConfig) -> str:
    """The Hugging Face model_type that holds this shape: gpt2, or for the llama style llama, qwen2, qwen3 or gemma
    (`_FAMILY`); a mix of options no one type holds is a ValueError saying so."""
    c = config
    if c.style == "gpt":
        return "gpt2"
    on = frozenset(n for n in ("qkv_bias", "qk_norm", "norm_unit_offset", "embed_scale") if getattr(c, n))
    kind = _FAMILY.get(on)
    if kind is None:
        raise ValueError(f"no Hugging Face model_type holds this model's mix of {', '.join(sorted(on))} (qwen2 has "
                         "qkv_bias, qwen3 qk_norm, gemma norm_unit_offset with embed_scale): change those model fields "
                         "to load or export Hugging Face weights")
    return kind


def hf_config(config: ModelConfig, *, bos_token_id: int | None = None,
              eos_token_id: int | None = None) -> dict[str, Any]:
    """A config.json for `config` that `transformers` loads (written by `atoll export`); fp32 weights."""
    c = config
    common: dict[str, Any] = {"vocab_size": c.vocab_size, "tie_word_embeddings": c.tied_head,
                              "torch_dtype": "float32", "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    if c.style == "gpt":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": c.d_model, "n_layer": c.n_layers,
                "n_head": c.n_heads, "n_inner": c.ffn_hidden, "n_positions": c.seq_len, "n_ctx": c.seq_len,
                "layer_norm_epsilon": c.eps, "activation_function": "gelu_new" if c.gelu_tanh else "gelu",
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **common}
    kind = model_type(c)
    architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "gemma": "GemmaForCausalLM"}[kind]
    out: dict[str, Any] = {
        "architectures": [architecture], "model_type": kind,
        "hidden_size": c.d_model, "intermediate_size": c.ffn, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.kv_heads, "head_dim": c.head_size,
        "max_position_embeddings": c.seq_len, "rms_norm_eps": c.eps, "rope_theta": c.theta,
        "hidden_act": "gelu_pytorch_tanh" if c.gelu_tanh else "silu", "attention_dropout": 0.0, **common}
    if kind in ("llama", "qwen3", "gemma"):
        out.update(attention_bias=False)
    if kind == "llama":
        out.update(mlp_bias=False)
    if kind in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None)
    if kind == "gemma":  # transformers' Gemma takes token 0 as padding (its embedding row untrained) unless told
        out.update(pad_token_id=None)
    if c.rope_scaling is not None:
        factor, low, high, original = c.rope_scaling
        out["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                               "high_freq_factor": high, "original_max_position_embeddings": original}
    return out


@dataclass(frozen=True)
class HfTensor:
    """Where one Atoll parameter's values are in a Hugging Face checkpoint."""

    names: tuple[str, ...]
    """Hugging Face tensor names, stacked along dim 0 in this order (one name: the tensor itself)."""
    transpose: bool = False
    """The Hugging Face tensor is stored (in, out) (GPT-2's Conv1D): transpose it."""
    fallback: tuple[str, ...] = ()
    """Names to use when `names` are absent (an untied head read from a tied checkpoint: the embedding)."""


def param_map(config: ModelConfig, index: int, *, tied_copy: bool = False) -> dict[str, HfTensor]:
    """Atoll parameter names of layer `index` (without the ``layers.<index>.`` prefix) -> where they are.
    `tied_copy`: the head of a tied model on a stage without the embedding, whose `lm.weight` is a copy of the
    embedding's (read from the embedding's tensor)."""
    c = config
    gpt = c.style == "gpt"
    emb = "transformer.wte.weight" if gpt else "model.embed_tokens.weight"
    if index == 0:
        out = {"tok.weight": HfTensor((emb,))}
        if gpt:
            out["pos.weight"] = HfTensor(("transformer.wpe.weight",))
        return out
    if index == c.n_layers + 1:
        norm = "transformer.ln_f" if gpt else "model.norm"
        out = {"norm.weight": HfTensor((f"{norm}.weight",))}
        if gpt:
            out["norm.bias"] = HfTensor((f"{norm}.bias",))
        if not c.tied_head:
            out["lm.weight"] = HfTensor(("lm_head.weight",), fallback=(emb,))
        elif tied_copy:
            out["lm.weight"] = HfTensor((emb,))
        return out
    if not 0 < index <= c.n_layers:
        raise ValueError(f"layer {index} is outside the model's {c.n_layers + 2} layers")
    j = index - 1
    if gpt:
        h = f"transformer.h.{j}"
        out = {}
        for atoll, hf in (("norm1", "ln_1"), ("norm2", "ln_2")):
            out[f"{atoll}.weight"] = HfTensor((f"{h}.{hf}.weight",))
            out[f"{atoll}.bias"] = HfTensor((f"{h}.{hf}.bias",))
        for atoll, hf in (("qkv", "attn.c_attn"), ("proj", "attn.c_proj"), ("fc", "mlp.c_fc"), ("out", "mlp.c_proj")):
            out[f"{atoll}.weight"] = HfTensor((f"{h}.{hf}.weight",), transpose=True)
            out[f"{atoll}.bias"] = HfTensor((f"{h}.{hf}.bias",))
        return out
    h = f"model.layers.{j}"
    out = {
        "norm1.weight": HfTensor((f"{h}.input_layernorm.weight",)),
        "qkv.weight": HfTensor(tuple(f"{h}.self_attn.{p}_proj.weight" for p in "qkv")),
        **({f"{p}_norm.weight": HfTensor((f"{h}.self_attn.{p}_norm.weight",)) for p in "qk"} if c.qk_norm else {}),
        "proj.weight": HfTensor((f"{h}.self_attn.o_proj.weight",)),
        "norm2.weight": HfTensor((f"{h}.post_attention_layernorm.weight",)),
        "fc.weight": HfTensor((f"{h}.mlp.gate_proj.weight", f"{h}.mlp.up_proj.weight")),
        "out.weight": HfTensor((f"{h}.mlp.down_proj.weight",)),
    }
    if c.has_qkv_bias:
        out["qkv.bias"] = HfTensor(tuple(f"{h}.self_attn.{p}_proj.bias" for p in "qkv"))
    return out


def split_sizes(config: ModelConfig, atoll_name: str) -> list[int]:
    """Rows of each Hugging Face tensor stacked in a fused Atoll parameter (`qkv.*` or a SwiGLU `fc.*`)."""
    if atoll_name.startswith("qkv.") and config.style != "gpt":
        return [config.q_dim, config.kv_dim, config.kv_dim]
    if atoll_name.startswith("fc.") and config.style != "gpt":
        return [config.ffn, config.ffn]
    return []
