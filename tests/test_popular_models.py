"""Every preset, a tied GPT-2 config.json and a Qwen3-shaped one, shrunk to tiny widths, go the whole way a job
goes: each of two nodes profiles the model's own layers, the coordinator's planner plans them, and the plan trains
five steps on its nodes (threads of this process, each with its real gRPC peer server, meeting at one TCPStore).

Shrinking keeps what makes a model family itself (style, tied head, grouped-query ratio, q/k/v biases, an
explicit head width, q/k norms, Gemma's norm offset and embedding scale, rope scaling, GELU flavour) and takes the
widths, depth, vocabulary and context down to what trains in a second.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from atoll.coordinator.islands import form_islands
from atoll.coordinator.linkmatrix import complete_matrix
from atoll.coordinator.planning import PlanInputs, make_plan
from atoll.coordinator.store import MemberRecord
from atoll.hf import HF_PRESETS, config_from_hf
from atoll.models import preset
from atoll.modelspec import PRESETS, ModelConfig
from atoll.node.profiler import ProfileOptions, profile_node
from atoll.types import LinkMeasurement
from pipeline_harness import run_pinned_plan, tiny_job

STEPS = 5

GPT2_CONFIG = {  # transformers.GPT2Config().to_dict()'s fields that shape the model, at GPT-2 small's values
    "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 50257, "n_embd": 768, "n_layer": 12,
    "n_head": 12, "n_positions": 1024, "n_inner": None, "layer_norm_epsilon": 1e-5,
    "activation_function": "gelu_new", "tie_word_embeddings": True, "bos_token_id": 50256, "eos_token_id": 50256}
QWEN3_CONFIG = {  # Qwen3-0.6B's config.json: head_dim 128 over a width of 1024 with 16 heads, q/k norms, tied
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False}

MODELS: dict[str, ModelConfig] = {
    **{name: preset(name) for name in [*PRESETS, *HF_PRESETS]},
    "gpt2 config.json": config_from_hf(GPT2_CONFIG, where="config.json"),
    "qwen3 config.json": config_from_hf(QWEN3_CONFIG, where="config.json"),
}


def shrink(c: ModelConfig) -> ModelConfig:
    """`c` at tiny widths, keeping its family's traits: 4 heads (kv heads in the same ratio), a head width of 8
    (16 where the config's head width is not d_model / heads: then q is wider than the residual stream, as in
    Qwen3 and Gemma), 2 blocks, the bytes tokenizer's 256 tokens, 32 positions."""
    kv = c.n_kv_heads or c.n_heads
    heads = 4
    explicit = c.head_dim is not None and c.head_dim * c.n_heads != c.d_model
    fields = dict(d_model=32, n_layers=2, n_heads=heads, n_kv_heads=max(1, heads * kv // c.n_heads),
                  ffn_hidden=64, vocab_size=256, seq_len=32,
                  head_dim=16 if explicit else (8 if c.head_dim is not None else None))
    if c.rope_scaling is not None:  # Llama 3's: its original context at the shrunk one's scale
        factor, low, high, _ = c.rope_scaling
        fields["rope_scaling"] = (factor, low, high, 16)
    return replace(c, **fields)


def _members(job) -> dict[str, MemberRecord]:
    options = ProfileOptions(repeats=1, budget=timedelta(seconds=0.5))
    return {n: MemberRecord(node_id=n, peer_address=f"127.0.0.1:{5000 + i}",
                            profile=replace(profile_node(job, "cpu", options), region="lab"))
            for i, n in enumerate(("a", "b"))}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_model_profiles_plans_and_trains_five_steps_on_two_nodes(name: str, tmp_path: Path) -> None:
    model = shrink(MODELS[name])
    base = tiny_job(STEPS)
    job = replace(base, model=model, model_preset=None,
                  train=replace(base.train, global_batch=8, micro_batch=2, seq_len=32),
                  cluster=replace(base.cluster, expected_nodes=2, min_nodes=2))
    members = _members(job)  # the profiler ran the model's own embedding, block and head (a tied head too)
    for m in members.values():
        kinds = {t.layer_kind for t in m.profile.layer_timings}
        assert kinds == {"embedding", "block", "head"}, (name, kinds)
    links = [LinkMeasurement(src="a", dst="b", bandwidth_bytes_per_s=1e9, rtt_seconds=1e-4)]
    matrix = complete_matrix(sorted(members), links)
    islands = form_islands({n: m.profile for n, m in members.items()}, matrix)
    plan, how = make_plan(PlanInputs(job=job, members=members, islands=islands, matrix=matrix, links=links,
                                     epoch=1, rendezvous="127.0.0.1:1"))
    assert not how.startswith("fallback"), (name, how)
    plan.validate(model.n_layers + 2)
    used = {n for p in plan.pipelines for s in p.stages for n in s.nodes}
    assert used == {"a", "b"}, (name, json.dumps([i.reason for i in plan.idle]))

    run = run_pinned_plan(job, plan, tmp_path, timeout=timedelta(seconds=60))
    assert sorted(run.losses) == list(range(STEPS)), (name, run.losses)
    assert all(0 < loss < 10 for loss in run.losses.values()), (name, run.losses)
