"""Tied embedding and head across pipeline stages (Megatron-style copies, `atoll.node.tied`).

A two-stage pipeline of a tied GPT-2-shaped and a tied Llama-shaped model (real gRPC peers and a TCPStore, as in
tests/test_hf_models.py) matches `transformers` with tie_word_embeddings=True in one process, per step over
several AdamW steps with gradient clipping (same tolerance: 1e-5 relative per step); the two copies are equal
after training; the checkpoint exports to a tied Hugging Face folder whose logits match the reference's.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from pipeline_harness import assert_losses_match

from atoll.hf import config_from_hf
from atoll.models import preset
from atoll.modelspec import ModelSpec
from atoll.node.checkpoint import load_layers, read_checkpoint, save_layers
from atoll.node.model import build_slice
from atoll.node.slice_state import read_slice
from atoll.node.stage import StageConfig, build_optimizer
from atoll.node.tied import TiedPlanError, check_tied_plan, tied_holders
from atoll.plan import PipelinePlan, Plan, StagePlan

transformers = pytest.importorskip("transformers")

TIED = {
    "gpt2": {"model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 64,
             "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
             "tie_word_embeddings": True},
    "llama": {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 5000.0,
              "tie_word_embeddings": True},
}


def _plan(stage_nodes: list[tuple[tuple[int, int], list[str]]], tp: int = 1) -> Plan:
    stages = [StagePlan(island="i", layers=layers, dp=len(nodes) // tp, tp=tp, nodes=nodes)
              for layers, nodes in stage_nodes]
    return Plan(model="m", global_batch=16, seq_len=32,
                pipelines=[PipelinePlan(micro_batch=16, num_micro_batches=1, stages=stages)])


# --- the model: copies built equal, one stage unchanged ----------------------------------------------------


def test_the_head_stage_holds_a_copy_built_equal_to_the_embedding() -> None:
    config = config_from_hf(TIED["llama"])
    total = config.n_layers + 2
    first, last = build_slice(config, 0, 2, seed=3), build_slice(config, 2, total, seed=3)
    assert first.ties_embedding and first.tied_copy is None
    assert last.tied_copy is not None and not last.ties_embedding
    assert torch.equal(last.tied_copy, first.layers["0"].tok.weight)
    whole = build_slice(config, 0, total, seed=3)  # one stage: the head uses the embedding's weight, no copy
    assert whole.tied_copy is None and not whole.ties_embedding
    assert "layers.5.lm.weight" not in dict(whole.named_parameters())
    ids = torch.randint(0, config.vocab_size, (2, 8))
    torch.testing.assert_close(last(first(ids)), whole(ids), rtol=0, atol=1e-6)
    # the planner's spec counts the copy on the head's stage only
    spec = ModelSpec.from_config(config)
    assert spec.slice_params(2, total) - spec.slice_params(2, total - 1) == \
        spec.layers[-1].params + config.vocab_size * config.d_model
    assert spec.slice_params(0, total) == spec.total_params


def test_a_checkpoint_of_one_stage_gives_the_head_stage_its_copy(tmp_path: Path) -> None:
    config = config_from_hf(TIED["gpt2"])
    total = config.n_layers + 2
    cfg = StageConfig(micro_batches=1)
    whole = build_slice(config, 0, total, seed=1)
    opt = build_optimizer(whole, cfg)
    whole(torch.randint(0, 256, (2, 8))).sum().backward()
    opt.step()
    save_layers(whole, opt, tmp_path, 1, data_position=0)
    head = build_slice(config, 3, total, seed=9)
    head_opt = build_optimizer(head, cfg)
    load_layers(head, head_opt, tmp_path, 1)
    assert torch.equal(head.tied_copy, whole.layers["0"].tok.weight)
    assert torch.equal(head_opt.state[head.tied_copy]["exp_avg"], opt.state[whole.layers["0"].tok.weight]["exp_avg"])
    # and a two-stage checkpoint loads back into one stage (the copy is left aside)
    first = build_slice(config, 0, 3, seed=1)
    first_opt = build_optimizer(first, cfg)
    first(torch.randint(0, 256, (2, 8))).sum().backward()
    first_opt.step()
    save_layers(first, first_opt, tmp_path, 2, data_position=0)
    save_layers(head, head_opt, tmp_path, 2, data_position=0)
    again = build_slice(config, 0, total, seed=5)
    load_layers(again, build_optimizer(again, cfg), tmp_path, 2)
    assert torch.equal(again.layers["0"].tok.weight, first.layers["0"].tok.weight)


# --- plans the runtime trains, and what it refuses ---------------------------------------------------------


def test_tied_holders_and_refusals() -> None:
    plan = _plan([((0, 3), ["a", "b"]), ((3, 6), ["c"])])  # unequal widths
    assert tied_holders(plan, [0]) == (("a", "b"), ("c",))
    check_tied_plan(plan, [0])
    with pytest.raises(TiedPlanError, match="tensor parallelism"):
        check_tied_plan(_plan([((0, 3), ["a", "b"]), ((3, 6), ["c", "d"])], tp=2), [0])
    check_tied_plan(Plan(model="m", global_batch=16, seq_len=32, pipelines=[PipelinePlan(
        micro_batch=16, num_micro_batches=1, stages=[StagePlan(island="i", layers=(0, 2), dp=1, nodes=["a"]),
                                                     StagePlan(island="i", layers=(2, 4), dp=1, tp=2, nodes=["b", "c"]),
                                                     StagePlan(island="i", layers=(4, 6), dp=1, nodes=["d"])])]), [0])
    mixed = Plan(model="m", global_batch=32, seq_len=32, pipelines=[
        _plan([((0, 6), ["a"])]).pipelines[0], _plan([((0, 3), ["b"]), ((3, 6), ["c"])]).pipelines[0]])
    with pytest.raises(TiedPlanError, match="every pipeline"):
        check_tied_plan(mixed, [0, 1])


def test_the_planner_cuts_a_tied_model_and_prices_the_tied_sum() -> None:
    from atoll.coordinator.planner.cluster import load_cluster
    from atoll.coordinator.planner.costmodel import CostModel
    from atoll.coordinator.planner.options import PlannerOptions, TrainSpec
    from atoll.coordinator.planner.planjob import search_plan
    from atoll.coordinator.planner.tied import mixes_cuts, tied_sync_seconds

    repo = Path(__file__).resolve().parent.parent
    cluster = load_cluster(repo / "examples" / "clusters" / "mixed-a100-v100.toml")
    train = TrainSpec(global_batch=256, seq_len=1024)
    tied = replace(preset("llama-3.2-1b"), seq_len=1024, n_layers=64)
    # pipelines of one stage each are the best plan here with ZeRO; without it the model is cut (it used to be
    # kept whole whatever the options), with the copies' sum priced and the copies' stages unsharded (tp = 1)
    for opts in (PlannerOptions(), PlannerOptions(zero_stages=(0,), several_pipelines=False)):
        result = search_plan(ModelSpec.from_config(tied), cluster, train, options=opts)
        plan = result.plan
        assert not mixes_cuts([len(p.stages) for p in plan.pipelines])
        check_tied_plan(plan, range(len(plan.pipelines)))
    assert any(len(p.stages) > 1 for p in plan.pipelines)
    # the first and last stage each wait on the copies' all-reduce besides their own gradient sync
    cm = CostModel(ModelSpec.from_config(tied), train, None, PlannerOptions(zero_stages=(0,), max_tp=1))
    stages = result.candidate.stages
    tied_s = tied_sync_seconds(cm, cluster, stages[0].island, stages[-1].island)
    assert tied_s > 0
    for st in (stages[0], stages[-1]):
        own = cm.grad_sync_seconds(cm.model.slice_params(st.start, st.end), st.island, st.cost.dp, st.cost.tp)
        assert st.sync_s == pytest.approx(own + tied_s)
    middle = stages[1]
    assert middle.sync_s == pytest.approx(cm.grad_sync_seconds(cm.model.slice_params(middle.start, middle.end),
                                                                middle.island, middle.cost.dp, middle.cost.tp))
    cm = CostModel(ModelSpec.from_config(tied), train)
    a, b = cluster.islands[0], cluster.islands[-1]
    nbytes = tied.vocab_size * tied.d_model * cm.grad_bytes_per_param
    assert tied_sync_seconds(cm, cluster, a, a) == pytest.approx(cm.allreduce_seconds(nbytes, 2, a))
    assert tied_sync_seconds(cm, cluster, a, b) > 0
    untied = CostModel(ModelSpec.from_config(replace(tied, tied_head=False)), train)
    assert tied_sync_seconds(untied, cluster, a, b) == 0.0
    assert mixes_cuts([1, 2]) and not mixes_cuts([2, 3]) and not mixes_cuts([1, 1])



def test_the_planner_shards_a_tied_model_where_no_stage_holds_a_copy() -> None:
    """Tensor parallelism on a whole tied model's one stage (its table and head vocab-parallel, `atoll.node.tp`) and
    on the stages between a cut's first and last; never on a stage holding a copy of the tied weight, in `cost`
    and in `reach` (whose start the composer places without asking `cost` again)."""
    from atoll.coordinator.planner.cluster import load_cluster
    from atoll.coordinator.planner.costmodel import CostModel
    from atoll.coordinator.planner.options import TrainSpec
    from atoll.coordinator.planner.parallelizer import DefaultParallelizer, SliceQuery
    from atoll.coordinator.planner.planjob import search_plan

    repo = Path(__file__).resolve().parent.parent
    cluster = load_cluster(repo / "examples" / "clusters" / "mixed-a100-v100.toml")
    v100 = next(i for i in cluster.islands if i.id == "v100")
    train = TrainSpec(global_batch=256, seq_len=1024)
    tied = replace(preset("llama-3.2-1b"), seq_len=1024)
    total = tied.n_layers + 2
    par = DefaultParallelizer(CostModel(ModelSpec.from_config(tied), train))

    def cost(a: int, e: int):  # 96 sequences over the island's 64 V100s: tp 2 pays (rows per replica)
        return par.cost(SliceQuery(start=a, end=e, micro_batch=1, dp=64, in_flight=1, batch=96), v100)

    assert cost(0, total).tp == 2 and cost(5, 10).tp == 2 and cost(1, total - 1).tp == 2
    for a, e in ((1, total), (0, 10)):  # the head's stage with its copy, the embedding's of a cut
        got = cost(a, e)
        assert got is not None and got.tp == 1 and got.zero == 0
    for end in (10, total):
        for limit in (0.03, 0.1, 0.2, 0.3):
            a = par.reach(v100, 1, 64, 1, end, limit, batch=96)
            if a < end:
                got = cost(a, end)
                assert got is not None and got.time_s <= limit, (end, limit, a)
    plan = search_plan(ModelSpec.from_config(tied), cluster, train).plan
    check_tied_plan(plan, range(len(plan.pipelines)))
    assert any(st.tp > 1 for p in plan.pipelines for st in p.stages)  # tied models used to plan tp = 1 throughout


def test_the_planner_counts_the_copy_in_memory_and_keeps_zero_off_the_copies() -> None:
    from atoll.coordinator.planner.cluster import load_cluster
    from atoll.coordinator.planner.costmodel import CostModel
    from atoll.coordinator.planner.options import TrainSpec
    from atoll.coordinator.planner.parallelizer import DefaultParallelizer, SliceQuery
    from atoll.coordinator.planner.tied import holds_tied_weight

    repo = Path(__file__).resolve().parent.parent
    island = load_cluster(repo / "examples" / "clusters" / "mixed-a100-v100.toml").islands[0]
    train = TrainSpec(global_batch=64, seq_len=1024)
    tied = replace(preset("llama-3.2-1b"), seq_len=1024)
    total = tied.n_layers + 2
    costs = {}
    for t in (True, False):
        cm = CostModel(ModelSpec.from_config(replace(tied, tied_head=t)), train)
        par = DefaultParallelizer(cm)
        head = SliceQuery(start=10, end=total, micro_batch=1, dp=4, in_flight=1)
        costs[t] = par.evaluate(head, island, zero=0).memory_bytes, par.cost(head, island), cm
        if t:
            for a, e in ((0, 10), (10, total)):
                got = par.cost(SliceQuery(start=a, end=e, micro_batch=1, dp=4, in_flight=1), island)
                assert got is not None and got.zero == 0 and holds_tied_weight(cm.model, a, e)
            whole = par.cost(SliceQuery(start=0, end=total, micro_batch=1, dp=4, in_flight=1), island)
            assert whole is not None and not holds_tied_weight(cm.model, 0, total)
    # the untied head's own weight and the tied head's copy weigh the same
    assert costs[True][0] == pytest.approx(costs[False][0])


# --- two stages over gRPC against transformers -----------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_two_stage_tied_pipeline_matches_transformers_and_exports(family: str, tmp_path: Path) -> None:
    from test_hf_models import STEPS, _hf_model, _job, _pipeline, _save, _transformers_losses

    from atoll.launch.export import export

    hf = _hf_model(TIED[family], seed=2)
    assert hf.lm_head.weight is hf.get_input_embeddings().weight
    job = _job(_save(hf, tmp_path / "hf"))
    job = replace(job, checkpoint=replace(job.checkpoint, interval=STEPS))
    assert job.model.tied_head
    got = _pipeline(job, 3, tmp_path)
    want = _transformers_losses(hf, job)
    assert sorted(got) == list(range(STEPS))
    assert_losses_match(got, want, 1e-5, range(STEPS))
    assert want[-1] < want[0]  # it trained

    # the copies are equal after training, and equal to the reference's tied weight
    total = job.model.n_layers + 2
    folder = tmp_path / "ckpt" / f"step-{STEPS:08d}"
    first, last = read_slice(folder / "layers-0000-0003.pt"), read_slice(folder / f"layers-0003-{total:04d}.pt")
    emb, copy = first["tensors"]["layers.0.tok.weight"], last["tensors"][f"layers.{total - 1}.lm.weight"]
    assert torch.equal(emb, copy)
    torch.testing.assert_close(emb, hf.get_input_embeddings().weight.detach(), rtol=0, atol=2e-5)
    _, tensors, _ = read_checkpoint(tmp_path / "ckpt", STEPS)
    assert f"layers.{total - 1}.lm.weight" in tensors

    # export writes the tied folder (one tensor), which transformers loads with the same logits
    out = tmp_path / "export"
    export(tmp_path / "ckpt", STEPS, out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    assert back.lm_head.weight.data_ptr() == back.get_input_embeddings().weight.data_ptr()
    ids = torch.randint(0, job.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf.eval()(ids).logits, rtol=0, atol=1e-4)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_tied_copies_with_unequal_widths_match_transformers(tmp_path: Path) -> None:
    """Two replicas of the embedding's stage and one of the head's: each copy's holders average, then the group of
    all three sums each side once (1/2 from each embedding holder, 1/1 from the head holder)."""
    from pipeline_harness import run_pinned_plan
    from test_hf_models import STEPS, _hf_model, _job, _save, _transformers_losses

    hf = _hf_model(TIED["llama"], seed=4)
    job = _job(_save(hf, tmp_path / "hf"))
    job = replace(job, checkpoint=replace(job.checkpoint, interval=STEPS))
    total = job.model.n_layers + 2
    stages = [StagePlan(island="i", layers=(0, 3), dp=2, nodes=["a", "b"]),
              StagePlan(island="i", layers=(3, total), dp=1, nodes=["c"])]
    got = run_pinned_plan(job, [PipelinePlan(micro_batch=4, num_micro_batches=4, stages=stages)], tmp_path / "ckpt",
                          join=150).losses
    want = _transformers_losses(hf, job)
    assert sorted(got) == list(range(STEPS))
    assert_losses_match(got, want, 1e-5, range(STEPS))
    _, tensors, _ = read_checkpoint(tmp_path / "ckpt", STEPS)
    assert torch.equal(tensors["layers.0.tok.weight"], tensors[f"layers.{total - 1}.lm.weight"])


def test_a_live_state_of_one_stage_gives_the_head_stage_its_copy() -> None:
    """A plan that cuts a model another plan kept whole: the head's stage reads its layers from the whole
    stage's live state, narrowed to its own layers, which still carries the embedding's weight."""
    from atoll.node.live_state import slice_part
    from atoll.node.slice_state import load_slice, slice_state

    config = config_from_hf(TIED["llama"])
    total = config.n_layers + 2
    whole = build_slice(config, 0, total, seed=1)
    opt = build_optimizer(whole, StageConfig(micro_batches=1))
    whole(torch.randint(0, 256, (2, 8))).sum().backward()
    opt.step()
    head = build_slice(config, 4, total, seed=7)
    head_opt = build_optimizer(head, StageConfig(micro_batches=1))
    load_slice(head, [slice_part(slice_state(whole, opt), (4, total))], head_opt)
    assert torch.equal(head.tied_copy, whole.layers["0"].tok.weight)
    assert torch.equal(head_opt.state[head.tied_copy]["exp_avg_sq"], opt.state[whole.layers["0"].tok.weight]["exp_avg_sq"])


def test_a_stage_holding_a_copy_refuses_to_train_without_the_sum() -> None:
    from atoll.node.inprocess import InProcessLinks
    from atoll.node.norm_exchange import InProcessNormGroup
    from atoll.node.stage import PipelineStage

    config = config_from_hf(TIED["gpt2"])
    norms = InProcessNormGroup(2)
    for s, (a, e) in enumerate(((0, 3), (3, config.n_layers + 2))):
        with pytest.raises(ValueError, match="tied embedding weight"):
            PipelineStage(build_slice(config, a, e), stage=s, num_stages=2, transport=InProcessLinks(2).transport(s),
                          config=StageConfig(micro_batches=1), norm_exchange=norms.member(s))


# --- the node's start-up profile -------------------------------------------------------------------------


def test_a_node_profiles_a_tied_model_with_the_heads_own_compute(monkeypatch) -> None:
    """A tied head built alone has no weight of its own: the profile times it as a stage runs it, a linear over
    the vocabulary whose weight's gradient its backward computes (summed with the other copy's, never deferred)."""
    from atoll.job import JobSpec
    from atoll.node import profiler
    from atoll.node.profiler import ProfileOptions, profile_node

    repo = Path(__file__).resolve().parent.parent
    config = replace(config_from_hf(TIED["gpt2"]), name="tied")
    job = JobSpec.load(repo / "examples" / "tiny.toml")
    job = replace(job, model=config, model_preset=None, train=replace(job.train, seq_len=32))
    built, logits, grads = [], [], [0]
    real_build, real_loss = profiler.build_layer, profiler.lm_loss

    def build(cfg, index, *args, **kwargs):
        layer = real_build(cfg, index, *args, **kwargs)
        if index == cfg.n_layers + 1 and layer.lm is not None:
            built.append(layer)
            layer.lm.weight.register_hook(lambda g: grads.__setitem__(0, grads[0] + 1))
        return layer

    def loss(out, ids):
        logits.append(tuple(out.shape))
        return real_loss(out, ids)

    monkeypatch.setattr(profiler, "build_layer", build)
    monkeypatch.setattr(profiler, "lm_loss", loss)
    p = profile_node(job, "cpu", ProfileOptions(micro_batches=(2,), repeats=2))
    head = next(t for t in p.layer_timings if t.layer_kind == "head")
    assert head.forward_seconds > 0 and head.backward_seconds > 0
    assert head.weight_fraction == 0 and head.split_overhead == 0  # nothing of it deferred
    assert len(built) == 1 and set(logits) == {(2, 32, config.vocab_size)}
    assert grads[0] == len(logits) >= 3  # the weight's gradient in every timed backward (a warm-up round, two timed)
