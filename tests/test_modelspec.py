"""The analytic ModelSpec against the real modules: parameters, FLOPs (FlopCounterMode), saved
activations (saved-tensor hooks), optimizer state, boundary tensors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from atoll.models import preset, preset_spec
from atoll.modelspec import PRESETS, ModelConfig, ModelSpec, dtype_bytes
from atoll.node.model import build_layer, build_slice, lm_loss
from atoll.node.stage import StageConfig, SavedBytesCounter, build_optimizer

BASE = replace(preset("tiny"), seq_len=32)
CONFIGS = {
    "gpt": BASE,
    "gpt-tied": replace(BASE, tied_head=True),
    "llama": replace(BASE, style="llama"),
    "llama-gqa": replace(BASE, style="llama", n_kv_heads=2, ffn_hidden=96),
    # Hugging Face shapes: Qwen2's q/k/v biases (with its rope theta and norm epsilon), GPT-2's tanh GELU
    "qwen2-qkv-bias": replace(BASE, style="llama", n_kv_heads=2, qkv_bias=True, rope_theta=1e6, norm_eps=1e-6),
    "gpt2-gelu-tanh": replace(BASE, gelu_tanh=True, tied_head=True),
    # heads wider than d_model / n_heads with q/k norms (Qwen3), and narrower with Gemma's norms, scaled embedding
    # and tanh-GELU gate
    "qwen3-wide-heads": replace(BASE, style="llama", n_kv_heads=2, head_dim=32, qk_norm=True),
    "gemma-narrow-heads": replace(BASE, style="llama", n_kv_heads=1, head_dim=8, norm_unit_offset=True,
                                  embed_scale=True, gelu_tanh=True),
}


def _layer_input(config: ModelConfig, index: int, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(index)
    if index == 0:
        return torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=g)
    return torch.randn(batch, config.seq_len, config.d_model, generator=g, requires_grad=True)


def _forward(config: ModelConfig, layer: torch.nn.Module, index: int, x: torch.Tensor) -> torch.Tensor:
    if index == config.n_layers + 1 and config.tied_head:
        return layer(x, tied_weight=torch.randn(config.vocab_size, config.d_model, requires_grad=True))
    return layer(x)


@pytest.mark.parametrize("name", CONFIGS)
def test_parameters_per_layer_match_the_modules(name):
    config = CONFIGS[name]
    spec = ModelSpec.from_config(config)
    assert spec.num_layers == config.n_layers + 2
    for ls in spec.layers:
        assert ls.params == sum(p.numel() for p in build_layer(config, ls.index).parameters()), ls
    assert spec.total_params == sum(p.numel() for p in build_slice(config, 0, spec.num_layers).parameters())


@pytest.mark.parametrize("name", CONFIGS)
def test_flops_per_layer_match_flop_counter(name):
    config = CONFIGS[name]
    spec = ModelSpec.from_config(config)
    for index in (0, 1, config.n_layers + 1):
        layer = build_layer(config, index)
        x = _layer_input(config, index)
        tokens = x.shape[0] * x.shape[1]
        # the math kernel exposes attention's matmuls to the counter (the CPU flash kernel does not)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fwd:
            y = _forward(config, layer, index, x)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as bwd:
            y.float().sum().backward()
        assert spec.layers[index].flops_fwd_per_token == fwd.get_total_flops() / tokens, (name, index)
        assert spec.layers[index].flops_bwd_per_token == bwd.get_total_flops() / tokens, (name, index)


def test_slice_flops_and_params_sum_their_layers():
    spec = ModelSpec.from_config(BASE)
    f, b = spec.slice_flops_per_token(1, 4)
    assert f == sum(spec.layers[i].flops_fwd_per_token for i in (1, 2, 3)) and b == 2 * f
    assert spec.slice_params(0, spec.num_layers) == spec.total_params
    with pytest.raises(ValueError, match="outside"):
        spec.slice_params(3, 3)


@pytest.mark.parametrize("name,tolerance", [("gpt", 0.02), ("llama-gqa", 0.2), ("qwen3-wide-heads", 0.2),
                                            ("gemma-narrow-heads", 0.2)])
def test_saved_activations_match_what_autograd_keeps(name, tolerance):
    config = CONFIGS[name]
    spec = ModelSpec.from_config(config)
    for index in (1, config.n_layers + 1):
        layer = build_layer(config, index)
        x = _layer_input(config, index)
        counter = SavedBytesCounter({p.untyped_storage().data_ptr() for p in layer.parameters()})
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            y = layer(x)
            if index == config.n_layers + 1:
                lm_loss(y, torch.zeros(x.shape[:2], dtype=torch.int64))
        want = spec.layers[index].activation_bytes(x.shape[0], x.shape[1])
        assert counter.bytes == pytest.approx(want, rel=tolerance), (name, index)


def test_activation_memory_options():
    spec = ModelSpec.from_config(BASE)
    full = spec.activation_bytes(1, 5, micro_batch=2, seq_len=32)
    assert spec.activation_bytes(1, 5, micro_batch=4, seq_len=32) == 2 * full
    assert spec.activation_bytes(1, 5, micro_batch=2, seq_len=32, recompute=True) < full / 5
    assert spec.activation_bytes(1, 5, micro_batch=2, seq_len=32, dtype="bf16") == full // 2


def test_boundary_bytes_match_the_tensor_a_stage_sends():
    spec = ModelSpec.from_config(BASE)
    out = build_slice(BASE, 0, 3)(_layer_input(BASE, 0, batch=3))
    assert spec.boundary_bytes(3, micro_batch=3, seq_len=BASE.seq_len) == out.numel() * out.element_size()
    assert spec.boundary_bytes(3, micro_batch=3, seq_len=BASE.seq_len, dtype="bf16") == out.numel() * 2


def test_model_state_matches_adamw_after_a_step():
    spec = ModelSpec.from_config(BASE)
    m = build_slice(BASE, 1, 4)
    opt = build_optimizer(m, StageConfig())
    m(_layer_input(BASE, 1)).sum().backward()
    opt.step()
    moments = sum(st[k].numel() * st[k].element_size() for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    state = spec.model_state_bytes(1, 4)
    assert state["optimizer"] == moments
    assert state["weights"] == state["gradients"] == sum(p.numel() * 4 for p in m.parameters())
    bf16 = spec.model_state_bytes(1, 4, dtype="bf16")
    assert bf16["weights"] == state["weights"] // 2 and bf16["optimizer"] == moments + state["weights"]
    with pytest.raises(ValueError, match="unknown optimizer"):
        spec.model_state_bytes(1, 4, optimizer="lion")


def test_presets_span_tiny_to_70b_with_known_sizes():
    assert {"tiny", "125m", "350m", "1.3b", "7b", "13b", "70b"} <= set(PRESETS)
    sizes = {n: preset_spec(n).total_params for n in PRESETS}
    assert sizes["tiny"] < 1_000_000
    assert list(sizes.values()) == sorted(sizes.values())
    # the published sizes of the Llama 2 shapes
    assert sizes["7b"] == pytest.approx(6.738e9, rel=1e-3)
    assert sizes["13b"] == pytest.approx(13.016e9, rel=1e-3)
    assert sizes["70b"] == pytest.approx(68.98e9, rel=1e-3)
    assert preset("TINY") is PRESETS["tiny"]
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("gpt5")


def test_config_validation_and_round_trip():
    with pytest.raises(ValueError, match="must divide model.d_model"):
        replace(BASE, n_heads=5)
    with pytest.raises(ValueError, match="n_kv_heads"):
        replace(BASE, n_kv_heads=3)
    with pytest.raises(ValueError, match="style"):
        replace(BASE, style="bert")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown model field"):
        ModelConfig.from_dict({**BASE.to_dict(), "dropout": 0.1})
    assert ModelConfig.from_dict(BASE.to_dict()) == BASE
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_bytes("fp8")
