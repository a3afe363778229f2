"""Hugging Face-family models: config.json mapping, presets, meta-device builds, pretrained weights per stage,
and a two-stage pipeline trained against the same `transformers` model in one process.

Tolerances (fp32 on CPU): logits within 1e-5 absolute (the same arithmetic in another order); training
losses within 1e-5 relative per step over 6 AdamW steps (four micro-batches accumulated over gRPC against
one whole batch; measured differences are about 1e-7).
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pipeline_harness import assert_losses_match
from torch.utils._python_dispatch import TorchDispatchMode

from atoll.hf import HF_PRESETS, HfConfigError, config_from_hf, hf_config, param_map
from atoll.job import JobSpec, JobSpecError
from atoll.models import preset
from atoll.modelspec import ModelSpec
from atoll.node.model import build_slice

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent

# small shapes of each family: GQA + SwiGLU (llama), q/k/v biases (qwen2), Llama 3 rope scaling, GPT-2, heads
# wider than hidden_size / heads with q/k norms (qwen3), and Gemma's (1 + weight) norms, scaled embedding, tanh-GELU
# gate and tied head, its heads narrower than hidden_size / heads
SMALL = {
    "llama": {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 5000.0,
              "tie_word_embeddings": False},
    "llama3-rope": {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
                    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                    "tie_word_embeddings": False},
    "mistral": {"model_type": "mistral", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 160,
                "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
                "max_position_embeddings": 256, "sliding_window": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "tie_word_embeddings": False, "use_sliding_window": False},
    "qwen3": {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "tie_word_embeddings": False},
    "gemma": {"model_type": "gemma", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 12,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True},
    "gpt2": {"model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 64,
             "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
             "tie_word_embeddings": False},
}


def _hf_model(d: dict, seed: int = 0):
    cfg = transformers.AutoConfig.for_model(**d)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    with torch.no_grad():  # non-trivial norms and biases, so a swapped or missing one shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _save(model, folder: Path, shard: str | None = None) -> Path:
    model.save_pretrained(folder, max_shard_size=shard) if shard else model.save_pretrained(folder)
    return folder


# --- config.json and presets ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(HF_PRESETS))
def test_preset_parameter_counts_equal_transformers(name: str) -> None:
    config = preset(name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**HF_PRESETS[name]))
    assert ModelSpec.from_config(config).total_params == sum(p.numel() for p in model.parameters())
    assert config_from_hf(hf_config(config), name=name) == replace(config, name=name)


def test_presets_follow_the_published_configs() -> None:
    llama = preset("llama-3.2-1b")
    assert (llama.style, llama.kv_heads, llama.ffn, llama.tied_head, llama.theta, llama.eps) == \
        ("llama", 8, 8192, True, 500000.0, 1e-5)
    assert llama.rope_scaling == (32.0, 1.0, 4.0, 8192) and llama.seq_len == 131072
    qwen = preset("qwen2.5-0.5b")
    assert qwen.has_qkv_bias and qwen.eps == 1e-6 and qwen.theta == 1e6 and qwen.kv_heads == 2
    assert preset("mistral-7b").seq_len == 4096  # capped at the sliding window
    gpt2 = preset("gpt2")
    assert gpt2.style == "gpt" and gpt2.gelu_tanh and gpt2.tied_head and gpt2.seq_len == 1024
    qwen3 = preset("qwen3-0.6b")  # 16 heads of 128 over a width of 1,024
    assert (qwen3.q_dim, qwen3.kv_dim, qwen3.qk_norm, qwen3.tied_head) == (2048, 1024, True, True)
    gemma = preset("gemma-2b")
    assert gemma.norm_unit_offset and gemma.embed_scale and gemma.gelu_tanh and gemma.tied_head
    assert ModelSpec.from_config(gemma).total_params == 2_506_172_416  # the published 2.51B
    # the qkv biases are counted by the planner's spec: one block of qwen2.5 holds d + 2 kv of them
    assert ModelSpec.from_config(qwen).layers[1].params - \
        ModelSpec.from_config(replace(qwen, qkv_bias=None)).layers[1].params == 896 + 2 * 128


def test_unsupported_configs_say_what_to_change() -> None:
    with pytest.raises(HfConfigError, match="model_type 'bert'"):
        config_from_hf({"model_type": "bert"})
    with pytest.raises(HfConfigError, match="rope scaling of type 'yarn'"):
        config_from_hf({**SMALL["llama"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(HfConfigError, match=r"model_type 'gemma2' is not supported \(logit soft-capping.*\); "
                                            r"supported: .*qwen3, gemma"):
        config_from_hf({**SMALL["gemma"], "model_type": "gemma2"})
    with pytest.raises(HfConfigError, match="hidden_act 'relu' is not supported"):
        config_from_hf({**SMALL["qwen3"], "hidden_act": "relu"})
    with pytest.raises(HfConfigError, match="attention_bias"):
        config_from_hf({**SMALL["qwen3"], "attention_bias": True})
    with pytest.raises(ValueError, match="llama style only"):
        replace(preset("gpt2"), qkv_bias=True)
    with pytest.raises(ValueError, match="llama style only"):
        replace(preset("gpt2"), head_dim=32)
    with pytest.raises(ValueError, match="must be even"):
        replace(config_from_hf(SMALL["qwen3"]), head_dim=15)


def test_head_width_activation_and_defaults_follow_transformers() -> None:
    qwen3 = config_from_hf(SMALL["qwen3"])
    assert (qwen3.head_size, qwen3.q_dim, qwen3.kv_dim, qwen3.qk_norm, qwen3.tied_head) == (32, 128, 64, True, False)
    # a head_dim equal to the width's share is the default; absent, each type takes transformers' own default
    assert config_from_hf({**SMALL["llama"], "head_dim": 16}) == config_from_hf(SMALL["llama"])
    assert config_from_hf({k: v for k, v in SMALL["qwen3"].items() if k != "head_dim"}).head_size == 128
    gemma = {k: v for k, v in SMALL["gemma"].items() if k not in ("head_dim", "hidden_act", "tie_word_embeddings")}
    got = config_from_hf(gemma)
    assert (got.head_size, got.gelu_tanh, got.tied_head, got.norm_unit_offset, got.embed_scale) == \
        (256, True, True, True, True)
    # Gemma's legacy "gelu" is the tanh approximation (as transformers reads it); hidden_activation wins over it
    assert config_from_hf({**gemma, "hidden_act": "gelu"}).gelu_tanh
    assert config_from_hf({**gemma, "hidden_act": "gelu", "hidden_activation": "silu"}).gelu_tanh is None
    for shape in (SMALL["qwen3"], SMALL["gemma"]):
        config = config_from_hf(shape)
        assert config_from_hf(hf_config(config), name=config.name) == config


def test_job_takes_hf_config_and_pretrained(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMALL["qwen2"]))
    text = (REPO / "examples" / "tiny.toml").read_text().replace('preset = "tiny"', f'hf_config = "{tmp_path}/config.json"'
                                                                "\ntied_head = false\nn_layers = 2")
    job = JobSpec.from_toml(text)
    assert job.model.has_qkv_bias and job.model.n_layers == 2 and job.model.theta == 1e6 and job.pretrained is None
    assert JobSpec.from_toml(job.to_toml()) == job  # resolved into fields: nodes need no config.json
    only = JobSpec.from_toml(text.replace(f'hf_config = "{tmp_path}/config.json"\ntied_head = false\nn_layers = 2',
                                          f'pretrained = "{tmp_path}"'))
    assert only.pretrained == str(tmp_path) and only.model.n_layers == 3
    assert JobSpec.from_toml(only.to_toml()) == only
    llama = JobSpec.from_toml(text.replace(f'hf_config = "{tmp_path}/config.json"\ntied_head = false\nn_layers = 2',
                                           'preset = "llama-3.2-1b"'))
    assert llama.model.rope_scaling == (32.0, 1.0, 4.0, 8192)
    with pytest.raises(JobSpecError, match="model.hf_config"):
        JobSpec.from_toml(text.replace(str(tmp_path), str(tmp_path / "nowhere")))
    # jobs written before the new model fields keep their ids
    assert JobSpec.load(REPO / "examples" / "tiny.toml").id == JobSpec.from_toml(
        (REPO / "examples" / "tiny.toml").read_text()).id


def test_atoll_plan_reads_a_hugging_face_config(tmp_path: Path) -> None:
    from atoll.coordinator.planner.cli import load_model

    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_PRESETS["qwen2.5-0.5b"]))
    assert load_model(str(path)).config == replace(preset("qwen2.5-0.5b"), name="qwen2")
    assert load_model("Qwen2.5-0.5B").total_params == 494_032_768  # the published count


def test_the_planner_plans_tied_and_untied_heads() -> None:
    from atoll.coordinator.planner.cluster import load_cluster
    from atoll.coordinator.planner.options import TrainSpec
    from atoll.coordinator.planner.planjob import search_plan

    cluster = load_cluster(REPO / "examples" / "clusters" / "mixed-a100-v100.toml")
    train = TrainSpec(global_batch=256, seq_len=1024)
    tied = preset("llama-3.2-1b")
    plan = search_plan(ModelSpec.from_config(replace(tied, seq_len=1024)), cluster, train).plan
    # a tied head may be cut from its embedding (tests/test_tied_pipeline.py); its pipelines are all cut or all whole
    cuts = {len(p.stages) > 1 for p in plan.pipelines}
    assert len(cuts) == 1
    untied = search_plan(ModelSpec.from_config(replace(tied, seq_len=1024, tied_head=False, n_layers=64)), cluster,
                         train).plan
    assert any(len(p.stages) > 1 for p in untied.pipelines)  # an untied (and deeper) one is cut


# --- building on the meta device ---------------------------------------------------------------------


class _Allocations(TorchDispatchMode):
    """Bytes of every tensor an op creates off the meta device (factory ops and copies alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name.startswith(("aten::empty", "aten::randn", "aten::zeros", "aten::ones", "aten::_to_copy")):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self.bytes += t.numel() * t.element_size()
        return out


def test_a_stage_allocates_only_its_own_layers() -> None:
    config = preset("qwen2.5-0.5b")
    spec = ModelSpec.from_config(config)
    own = spec.slice_params(1, 3) * 4
    with _Allocations() as seen:
        stage = build_slice(config, 1, 3, init=False)
    assert sum(p.numel() for p in stage.parameters()) * 4 == own
    assert own <= seen.bytes <= own * 1.01, (seen.bytes, own)  # the 545 MB embedding and the other blocks: never
    # a whole 7B model on the meta device holds its spec's parameters and allocates nothing
    big = preset("mistral-7b")
    with _Allocations() as seen:
        whole = build_slice(big, 0, big.n_layers + 2, device="meta", init=False)
    assert seen.bytes == 0 and sum(p.numel() for p in whole.parameters()) == ModelSpec.from_config(big).total_params


# --- pretrained weights -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(SMALL))
def test_pretrained_stages_give_the_logits_of_transformers(family: str, tmp_path: Path, monkeypatch) -> None:
    from safetensors import safe_open

    from atoll.node import pretrained

    hf = _hf_model(SMALL[family], seed=1)
    folder = _save(hf, tmp_path / "hf", shard="40KB")  # sharded, with model.safetensors.index.json
    assert (folder / "model.safetensors.index.json").is_file()
    config = config_from_hf(SMALL[family])
    total = config.n_layers + 2
    read: list[list[str]] = []

    class Recording:  # every tensor a stage reads, to check it reads only its own
        def __init__(self, path, framework):
            self.f = safe_open(path, framework=framework)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read[-1].append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr("safetensors.safe_open", Recording)
    stages = []
    for a, b in ((0, 2), (2, total)):
        read.append([])
        stage = build_slice(config, a, b, init=False)
        pretrained.load_pretrained(stage, folder)
        copy = config.tied_head and a > 0 and b == total  # a tied head on a stage of its own reads the embedding
        own = {n for i in range(a, b) for spec in param_map(config, i, tied_copy=copy).values() for n in spec.names}
        assert read[-1] and {n.removeprefix("transformer.").removeprefix("model.") for n in read[-1]} <= \
            {n.removeprefix("transformer.").removeprefix("model.") for n in own}
        stages.append(stage.eval())
    ids = torch.randint(0, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = stages[1](stages[0](ids))
        want = hf(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_tied_checkpoint_loads_into_an_untied_head(tmp_path: Path) -> None:
    from atoll.node.pretrained import load_pretrained

    d = {**SMALL["gpt2"], "tie_word_embeddings": True}
    hf = _hf_model(d)
    folder = _save(hf, tmp_path / "hf")
    config = replace(config_from_hf(d), tied_head=False)  # so the head may sit on another stage
    head = build_slice(config, config.n_layers + 1, config.n_layers + 2, init=False)
    load_pretrained(head, folder)
    torch.testing.assert_close(head.layers[str(config.n_layers + 1)].lm.weight, hf.transformer.wte.weight)
    whole = build_slice(config_from_hf(d), 0, config.n_layers + 2, init=False)
    load_pretrained(whole, folder)
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(whole.eval()(ids), hf(ids).logits, atol=1e-5, rtol=0)


def test_pretrained_of_another_shape_is_refused(tmp_path: Path) -> None:
    from atoll.node.pretrained import PretrainedError, load_pretrained

    folder = _save(_hf_model(SMALL["llama"]), tmp_path / "hf")
    other = replace(config_from_hf(SMALL["llama"]), d_model=32, n_heads=2, n_kv_heads=1)
    with pytest.raises(PretrainedError, match="another model"):
        load_pretrained(build_slice(other, 0, 2, init=False), folder)
    with pytest.raises(PretrainedError, match="no model.safetensors"):
        load_pretrained(build_slice(other, 0, 2, init=False), tmp_path)


def test_a_node_checks_the_pretrained_folder_before_it_joins(tmp_path: Path) -> None:
    from atoll.node.pretrained import INDEX, PretrainedError, check_pretrained

    config = config_from_hf(SMALL["llama"])
    folder = _save(_hf_model(SMALL["llama"]), tmp_path / "hf", shard="40KB")
    check_pretrained(config, folder)
    with pytest.raises(PretrainedError, match="not a folder on this node"):
        check_pretrained(config, tmp_path / "elsewhere")
    index = json.loads((folder / INDEX).read_text())
    (folder / sorted(set(index["weight_map"].values()))[-1]).unlink()
    with pytest.raises(PretrainedError, match="lists files this node lacks"):
        check_pretrained(config, folder)
    index["weight_map"].pop("model.layers.1.mlp.up_proj.weight")
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(PretrainedError, match="no tensor model.layers.1.mlp.up_proj.weight"):
        check_pretrained(config, folder)


# --- a two-stage pipeline against transformers, per step ---------------------------------------------------

STEPS = 6


def _job(folder: Path) -> JobSpec:
    base = JobSpec.load(REPO / "examples" / "tiny.toml")
    text = base.to_toml().replace('preset = "tiny"', f'pretrained = "{folder}"')
    job = JobSpec.from_toml(text.replace(f'id = "{base.id}"\n', ""))
    return replace(job, train=replace(job.train, steps=STEPS, warmup=2, seq_len=32),
                   compression=replace(job.compression, mode="identity"))


def _pipeline(job: JobSpec, cut: int, tmp_path: Path) -> dict[int, float]:
    """The job on two nodes (threads with real gRPC peers and a TCPStore), layers [0, cut) and [cut, end)."""
    from pipeline_harness import run_pinned_plan, stage

    from atoll.plan import PipelinePlan

    stages = [stage((0, cut), ["a"]), stage((cut, job.model.n_layers + 2), ["b"])]
    return run_pinned_plan(job, [PipelinePlan(micro_batch=4, num_micro_batches=4, stages=stages)], tmp_path / "ckpt",
                           join=120).losses


def _transformers_losses(hf, job: JobSpec) -> list[float]:
    """The same model trained by plain PyTorch in one process: AdamW, clipping and the schedule of the job."""
    from atoll.node.data import TokenDataset
    from atoll.node.runner import learning_rate, stage_config

    t = job.train
    cfg = stage_config(job, 4, timedelta(seconds=30))
    opt = torch.optim.AdamW(hf.parameters(), lr=t.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=t.weight_decay,
                            foreach=False)
    data = TokenDataset.from_source(job.data.source, t.seq_len, seed=t.seed)
    hf.train()
    losses = []
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = learning_rate(job, step)
        b = data.global_batch(step, t.global_batch)
        opt.zero_grad(set_to_none=True)
        logits = hf(b.inputs).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), b.targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), t.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_two_stage_pipeline_matches_transformers_per_step(family: str, tmp_path: Path) -> None:
    hf = _hf_model(SMALL[family], seed=2)
    job = _job(_save(hf, tmp_path / "hf"))
    assert job.model == replace(config_from_hf(SMALL[family]), name=job.model.name)
    got = _pipeline(job, 3, tmp_path)
    want = _transformers_losses(hf, job)
    assert sorted(got) == list(range(STEPS))
    assert_losses_match(got, want, 1e-5, range(STEPS))
    assert want[-1] < want[0]  # it trained


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_models_benchmark_runs_and_its_pipeline_matches_transformers(capsys, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))  # the bench tree is not installed
    from bench.models import main as bench_main

    threads = torch.get_num_threads()
    try:
        assert bench_main(["--steps", "4", "--d-model", "32", "--layers", "2", "--heads", "4", "--seq", "16",
                           "--batch", "4", "--bpe-vocab", "260", "--threads", "1", "--timeout", "240"]) == 0
    finally:
        torch.set_num_threads(threads)  # the benchmark sets its own
    out = capsys.readouterr().out
    parity = next(line for line in out.splitlines() if line.startswith("parity:"))
    assert float(parity.split("over 4 steps ")[1].split()[0]) <= 1e-3, out
    assert "bpe-260" in out and "targets met: " in out


def test_checkpoints_written_before_the_new_model_fields_still_load() -> None:
    from atoll.node.slice_state import load_slice, slice_state

    config = preset("tiny")
    saved = slice_state(build_slice(config, 0, 3, seed=4))
    for name in ("qkv_bias", "norm_eps", "rope_theta", "rope_scaling", "gelu_tanh"):
        del saved["model"][name]  # as a file written before these fields existed
    target = build_slice(config, 0, 3, seed=5)
    load_slice(target, [saved])
    assert torch.equal(target.state_dict()["layers.1.qkv.weight"], saved["tensors"]["layers.1.qkv.weight"])
