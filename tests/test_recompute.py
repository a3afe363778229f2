"""Per-layer activation recomputation: the model, the plan's field, the runtime and the planner's choice.

Recomputation reruns a block's forward in backward (torch.utils.checkpoint, non-reentrant), so it changes
no number: gradients are compared exactly, and the pipelined run's losses against the one-process run
within 1e-4 relative (as every pipelined run is).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pipeline_harness import assert_losses_match, run_pinned_plan, tiny_job

from atoll import serde
from atoll.job import JobSpec
from atoll.models import preset
from atoll.modelspec import ModelConfig, ModelSpec
from atoll.node.local import train_local
from atoll.node.model import build_slice, lm_loss
from atoll.node.stage import SavedBytesCounter
from atoll.plan import PipelinePlan, Plan, StagePlan
from atoll.types import StepMetrics


def _saved_bytes(module, ids: torch.Tensor) -> int:
    counter = SavedBytesCounter({p.untyped_storage().data_ptr() for p in module.parameters()})
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        module(ids)
    return counter.bytes


def test_recomputed_blocks_give_the_same_gradients_and_keep_only_their_inputs() -> None:
    config = preset("tiny")
    ids = torch.randint(0, config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    plain = build_slice(config, 0, 6, seed=3)
    some = build_slice(config, 0, 6, seed=3, recompute=[1, 2])
    for m in (plain, some):
        lm_loss(m(ids[:, :-1]), ids[:, 1:]).backward()
    for (n, p), q in zip(plain.named_parameters(), some.parameters()):
        assert torch.equal(p.grad, q.grad), n

    # what autograd keeps: each recomputed block its input only (ModelSpec's recompute=True figure)
    spec = ModelSpec.from_config(config)
    x = ids[:, :-1]
    drop = sum(spec.layers[i].activation_bytes(2, 32) - spec.layers[i].activation_bytes(2, 32, recompute=True)
               for i in (1, 2))
    # (ModelSpec leaves out a few small saved tensors, such as attention's log-sum-exp: within 2%)
    assert _saved_bytes(plain, x) - _saved_bytes(some, x) == pytest.approx(drop, rel=0.02)
    with torch.no_grad():  # no checkpointing without autograd (evaluation)
        torch.testing.assert_close(some(x), plain(x))


def test_only_blocks_of_the_slice_can_be_recomputed() -> None:
    config = preset("tiny")
    with pytest.raises(ValueError, match="only blocks"):
        build_slice(config, 0, 3, recompute=[0])
    with pytest.raises(ValueError, match="only blocks"):
        build_slice(config, 0, 3, recompute=[4])


def test_stage_plan_recompute_layers_round_trip_and_mean_all_blocks_when_recompute_is_set() -> None:
    st = StagePlan(island="i", layers=(0, 4), recompute_layers=[3, 1, 3])
    assert st.recompute_layers == [1, 3] and st.recomputed(6) == [1, 3]
    assert StagePlan(island="i", layers=(3, 6), recompute=True).recomputed(6) == [3, 4]  # never the head (5)
    assert StagePlan(island="i", layers=(3, 6)).recomputed(6) == []
    with pytest.raises(ValueError, match="outside the stage"):
        StagePlan(island="i", layers=(0, 2), recompute_layers=[2])
    back = serde.stage_from_proto(serde.stage_to_proto(st, 0))
    assert back.recompute_layers == [1, 3] and not back.recompute
    plan = Plan(model="tiny", global_batch=4, seq_len=8,
                pipelines=[PipelinePlan(micro_batch=4, num_micro_batches=1, stages=[st, StagePlan(island="i",
                                                                                               layers=(4, 6))])])
    assert Plan.from_json(plan.to_json()).pipelines[0].stages[0].recompute_layers == [1, 3]
    m = StepMetrics(job_id="j", node_id="n", plan_epoch=1, step=2, peak_memory_bytes=123_456_789)
    assert serde.step_metrics_from_proto(serde.step_metrics_to_proto(m)).peak_memory_bytes == 123_456_789


def _run(job: JobSpec, stages: list[StagePlan], tmp_path: Path) -> tuple[dict[int, float], dict[str, int]]:
    """One pipeline: losses by step, each node's peak reported memory."""
    run = run_pinned_plan(job, [PipelinePlan(micro_batch=4, num_micro_batches=4, stages=stages)], tmp_path / "ckpt")
    return run.losses, run.peaks()


@pytest.mark.timeout(120)
def test_pipeline_with_a_stage_recomputing_some_blocks_matches_one_process(tmp_path: Path) -> None:
    """Stage 0 recomputes block 1 of its blocks 1-2, stage 1 keeps everything: the one-process losses, and
    stage 0's reported peak memory drops by what block 1 no longer keeps for its in-flight micro-batches, less
    the working set its recomputation needs."""
    job = tiny_job(4)
    expected, _ = train_local(job)
    got, peaks = _run(job, [StagePlan(island="i", layers=(0, 3), nodes=["a"], recompute_layers=[1]),
                            StagePlan(island="i", layers=(3, 6), nodes=["b"])], tmp_path / "rc")
    _, plain = _run(job, [StagePlan(island="i", layers=(0, 3), nodes=["a"]),
                          StagePlan(island="i", layers=(3, 6), nodes=["b"])], tmp_path / "plain")
    assert_losses_match(got, expected, 1e-4, range(4))
    block = ModelSpec.from_config(job.model).layers[1]
    # 1F1B: stage 0 of 2 holds 2 micro-batches of 4 rows at once
    drop = 2 * (block.activation_bytes(4, job.train.seq_len) - block.activation_bytes(4, job.train.seq_len,
                                                                                       recompute=True))
    # less what a recomputed block rebuilds in backward (its activations for one micro-batch)
    working_set = block.activation_bytes(4, job.train.seq_len)
    assert plain["a"] - peaks["a"] == pytest.approx(drop - working_set, rel=0.03)
    assert plain["b"] == peaks["b"]


# --- the planner's choice ------------------------------------------------------------------------------

PLANNED = ModelSpec.from_config(ModelConfig(name="t8", vocab_size=8000, d_model=1024, n_layers=6, n_heads=8,
                                            seq_len=512))


def _island(memory_gb: float):
    from atoll.coordinator.planner import parse_cluster

    return parse_cluster(f"""
[[group]]
name = "g"
tflops = 100
memory_gb = {memory_gb}
count = 4
gpus_per_node = 4
""").islands[0]


def _parallelizer(**options):
    from atoll.coordinator.planner import PlannerOptions, TrainSpec
    from atoll.coordinator.planner.costmodel import CostModel
    from atoll.coordinator.planner.parallelizer import DefaultParallelizer

    cm = CostModel(PLANNED, TrainSpec(global_batch=32, seq_len=512, dtype="fp32"),
                   options=PlannerOptions(zero_stages=(0,), **options))
    return cm, DefaultParallelizer(cm)


def test_the_parallelizer_recomputes_the_cheapest_prefix_of_blocks_that_fits() -> None:
    """Memory between 'everything kept' and 'every block recomputed': the cost names the fewest blocks (a prefix
    of the slice's) whose recomputation fits, priced one forward each, and its memory is within the device."""
    from atoll.coordinator.planner.parallelizer import SliceQuery

    q = SliceQuery(start=0, end=5, micro_batch=4, dp=1, in_flight=4)  # embedding and blocks 1-4
    cm, par = _parallelizer()
    t = cm.table(_island(1000), 4)
    kept = par.cost(q, _island(1000))
    assert kept is not None and kept.recompute_layers == () and not kept.recompute
    block_saving = 4 * (t.act[1] - t.act_recompute[1])
    for want in (1, 2, 3):  # a capacity that recomputing `want` blocks just meets
        cap = kept.memory_bytes - want * block_saving + t.max_layer_act + 1
        island = _island(cap / 1e9 / (1 - cm.options.memory_reserve_fraction))
        c = par.cost(q, island)
        assert c is not None and c.recompute_layers == tuple(range(1, 1 + want)) and not c.recompute
        assert c.memory_bytes <= cm.memory_capacity(island)
        assert c.backward_s == pytest.approx(kept.backward_s + cm.table(island, 4).forward(1, 1 + want))
        assert par.evaluate(q, island, zero=0, recompute_blocks=want) == c  # the same configuration, priced
    tight = _island((kept.memory_bytes - 4 * block_saving + t.max_layer_act + 1) / 1e9 / 0.9)
    every = par.cost(q, tight)
    assert every is not None and every.recompute and every.recompute_layers == (1, 2, 3, 4)
    assert par.cost(q, _island(0.5 * every.memory_bytes / 1e9)) is None  # nothing fits
    assert _parallelizer(allow_recompute=False)[1].cost(q, tight) is None


def test_reach_agrees_with_cost_where_memory_binds() -> None:
    """`reach` (the composer's fast path) finds the smallest start `cost` accepts within a time limit, also when
    only recomputing some blocks makes the slice fit."""
    from atoll.coordinator.planner.parallelizer import SliceQuery

    cm, par = _parallelizer()
    end, k = 7, 3
    whole = par.cost(SliceQuery(start=0, end=end, micro_batch=4, dp=1, in_flight=k), _island(1000))
    assert whole is not None
    checked = 0
    for frac in (0.45, 0.6, 0.8):
        island = _island(frac * whole.memory_bytes / 1e9 / 0.9)
        for limit in (whole.time_s * x for x in (0.2, 0.4, 0.6, 0.8, 1.0, 1.3)):
            ok = [a for a in range(end) if (c := par.cost(SliceQuery(start=a, end=end, micro_batch=4, dp=1,
                                                                      in_flight=k), island)) is not None
                  and c.time_s <= limit]
            expect = min(ok) if ok else end
            assert par.reach(island, 4, 1, k, end, limit) == expect, (frac, limit)
            checked += any(par.cost(SliceQuery(start=a, end=end, micro_batch=4, dp=1, in_flight=k),
                                    island).recompute_layers for a in ok)
    assert checked  # some of the answers needed recomputation
