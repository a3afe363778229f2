"""Zero-bubble pipelining: backward split into the input's gradient and the deferred weight gradients.

The schedule (every action once, 1F1B's order of forwards and backwards kept), the deferred products (the same
gradients as autograd's, under recomputation and bf16 autocast), the simulator (ZB-H1's bound on balanced
pipelines, a lower bound it never beats), the planner (depths, memory, the plan's fields on the wire) and the
runtime: threads and real gRPC nodes train the same losses as one process, with ZeRO-1 and data parallelism.
"""

from __future__ import annotations

import copy
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from pipeline_harness import assert_losses_match, run_pinned_plan, stage, tiny_job

from atoll.coordinator.planner import PlannerOptions, TrainSpec, parse_cluster, search_plan
from atoll.coordinator.planner.costmodel import CostModel
from atoll.coordinator.planner.simulator import (LinkTimes, PipelineTimes, StageTimes, closed_form_step,
                                                 one_f_one_b_order, simulate, step_lower_bound)
from atoll.models import preset, preset_spec
from atoll.modelspec import ModelConfig, ModelSpec
from atoll.node.inprocess import train_threaded
from atoll.node.local import train_local
from atoll.node.model import build_slice, lm_loss
from atoll.node.precision import LossScaleConfig
from atoll.node.schedule import max_deferred, max_in_flight, schedule, zero_bubble_depths
from atoll.node.stage import StageConfig
from atoll.node.synthetic import synthetic_batch
from atoll.node.wgrad import WeightGradients, attach
from atoll.plan import PipelinePlan, Plan, StagePlan
from atoll.serde import plan_from_proto, plan_to_proto

# --- schedule ------------------------------------------------------------------------------------------------


def test_weight_actions_follow_their_backward_k_micro_batches_later() -> None:
    for p in range(1, 5):
        for m in range(1, 7):
            for k in range(1, p + 2):
                for s in range(p):
                    acts = schedule("1f1b", stage=s, num_stages=p, micro_batches=m, defer_weights=k)
                    plain = schedule("1f1b", stage=s, num_stages=p, micro_batches=m)
                    assert [a for a in acts if a.op != "weight"] == plain  # 1F1B's order, so no deadlock
                    ws = [a.micro_batch for a in acts if a.op == "weight"]
                    assert ws == list(range(m))
                    backs = [a.micro_batch for a in plain if a.op == "backward"]
                    for j in range(m):
                        w = acts.index(type(acts[0])("weight", j))
                        assert acts.index(type(acts[0])("backward", j)) < w
                        if j + k < m:  # right after the backward k micro-batches later
                            assert acts[w - 1] == type(acts[0])("backward", backs[j + k])
                    assert max_deferred(acts) <= min(k + 1, m)
                    assert max_in_flight(acts) == max_in_flight(plain)
    assert zero_bubble_depths(4) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="defer_weights"):
        schedule("1f1b", stage=0, num_stages=2, micro_batches=4, defer_weights=-1)


def test_the_simulator_runs_the_nodes_zero_bubble_schedule() -> None:
    for p in range(1, 5):
        for m in range(1, 7):
            for k in range(0, 4):
                for s in range(p):
                    node = [(a.op[0].upper(), a.micro_batch) for a in
                            schedule("1f1b", stage=s, num_stages=p, micro_batches=m, defer_weights=k)]
                    assert one_f_one_b_order(s, p, m, 0, k) == node


# --- simulator -----------------------------------------------------------------------------------------------


def _balanced(p: int, m: int, f: float, b: float, w: float, defer: bool) -> PipelineTimes:
    st = StageTimes(forward_s=f, backward_s=b + w, weight_s=w)
    return PipelineTimes(stages=(st,) * p, links=(LinkTimes(forward_s=0, backward_s=0),) * (p - 1),
                         num_micro_batches=m, defer=tuple(zero_bubble_depths(p)) if defer else ())


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16), (8, 64), (16, 32)])
def test_a_balanced_pipeline_reaches_zb_h1s_bound(p: int, m: int) -> None:
    for f, b, w in [(1, 1, 1), (1, 1.3, 0.7), (1, 1.5, 0.5)]:
        zb = simulate(_balanced(p, m, f, b, w, True)).step_time_s
        plain = simulate(_balanced(p, m, f, b, w, False)).step_time_s
        assert plain == pytest.approx((m + p - 1) * (f + b + w))
        assert zb == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w))
        assert closed_form_step(_balanced(p, m, f, b, w, True)) == pytest.approx(zb)
    # nothing to defer: the same step as 1F1B
    assert simulate(_balanced(p, m, 1, 2, 0, True)).step_time_s == pytest.approx((m + p - 1) * 3)


@pytest.mark.parametrize("p,m", [(1, 4), (2, 4), (4, 8), (8, 16)])
def test_a_split_backward_costs_its_measured_extra_where_a_stage_defers(p: int, m: int) -> None:
    """Running the backward in two passes (input gradients, then the deferred products) costs x more per
    micro-batch than one: a deferring pipeline takes m (F + B + x + W) + (p - 1) (F + B + x - W); plain 1F1B, which
    runs one pass, is unaffected."""
    f, b, w, x = 1.0, 1.2, 0.8, 0.15
    st = StageTimes(forward_s=f, backward_s=b + w, weight_s=w, split_s=x)
    links = (LinkTimes(forward_s=0, backward_s=0),) * (p - 1)
    zb = PipelineTimes(stages=(st,) * p, links=links, num_micro_batches=m, defer=tuple(zero_bubble_depths(p)))
    assert simulate(zb).step_time_s == pytest.approx(m * (f + b + x + w) + (p - 1) * (f + b + x - w))
    assert closed_form_step(zb) == pytest.approx(simulate(zb).step_time_s)
    assert step_lower_bound(zb) <= simulate(zb).step_time_s + 1e-9
    plain = replace(zb, defer=())
    assert simulate(plain).step_time_s == pytest.approx((m + p - 1) * (f + b + w))


def _measured_profiles(spec: ModelSpec, cluster, split_overhead: float):
    """Profiles of the cluster's devices that time each layer kind as the catalog does, with the catalog's
    weight-gradient share and a measured `split_overhead`."""
    from atoll.coordinator.planner.profiles import ProfileSet

    train = TrainSpec(global_batch=256, seq_len=1024)
    catalog = CostModel(spec, train)
    kinds = {"embedding": 0, "block": 1, "head": spec.num_layers - 1}
    devices = {}
    for island in cluster.islands:
        layers = {}
        for kind, i in kinds.items():
            pts = []
            for mb in (1, 2, 4, 8):
                t = catalog.table(island, mb)
                share = t.weight(i, i + 1) / t.bwd[i] if kind != "embedding" else 0.0
                pts.append({"micro_batch": mb, "seq_len": train.seq_len, "forward_s": t.fwd[i],
                            "backward_s": t.bwd[i], "weight_fraction": share,
                            "split_overhead": split_overhead if share else 0.0})
            layers[kind] = pts
        devices[island.device.name] = {"layers": layers}
    return ProfileSet.from_dict({"devices": devices})


def test_the_planner_prices_the_measured_cost_of_splitting_the_backward() -> None:
    """Profiles that measured the split backward's extra time: a few percent leaves the deferral in place at its
    price (the predicted step grows); where splitting costs more than the deferral fills, the planner keeps
    plain 1F1B."""
    spec = preset_spec("1.3b")
    train = TrainSpec(global_batch=256, seq_len=1024)
    cluster = parse_cluster(MIXED)
    options = PlannerOptions(max_tp=1)

    def plan(x: float):
        return search_plan(spec, cluster, train, _measured_profiles(spec, cluster, x), options=options).plan

    free, priced, costly = plan(0.0), plan(0.05), plan(1.0)
    deferring = [s.defer_weights for p in free.pipelines for s in p.stages]
    assert any(deferring), deferring
    assert any(s.defer_weights for p in priced.pipelines for s in p.stages)
    assert priced.predicted.step_time_s > free.predicted.step_time_s
    assert not any(s.defer_weights for p in costly.pipelines for s in p.stages)
    plain = search_plan(spec, cluster, train, _measured_profiles(spec, cluster, 1.0),
                        options=replace(options, zero_bubble=False)).plan
    assert costly.predicted.step_time_s == pytest.approx(plain.predicted.step_time_s)


def test_the_lower_bound_holds_with_deferred_weights() -> None:
    rng = random.Random(3)
    for _ in range(1500):
        p, m = rng.randint(1, 5), rng.randint(1, 9)
        stages = []
        for _ in range(p):
            b = rng.uniform(0.1, 3)
            x = rng.choice((0.0, rng.uniform(0, 0.3 * b)))  # what splitting the backward adds, if anything
            stages.append(StageTimes(forward_s=rng.uniform(0.1, 2), backward_s=b, weight_s=rng.uniform(0, b + x),
                                     split_s=x, sync_s=rng.uniform(0, 1), optimizer_s=rng.uniform(0, 1)))
        links = []
        for _ in range(p - 1):
            lat = rng.uniform(0, 0.3)
            links.append(LinkTimes(forward_s=lat + rng.uniform(0, 1), backward_s=lat + rng.uniform(0, 1),
                                   latency_s=lat))
        t = PipelineTimes(stages=tuple(stages), links=tuple(links), num_micro_batches=m,
                          defer=tuple(rng.randint(0, p + 1) for _ in range(p)))
        sim = simulate(t, record=True)
        assert step_lower_bound(t) <= sim.step_time_s + 1e-9
        # every weight action after its own backward, and the stage's all-reduce after its last one
        for i in range(p):
            ev = {(e.kind, e.micro_batch): e for e in sim.events if e.stage == i}
            if t.deferred(i):
                for j in range(m):
                    assert ev[("W", j)].start >= ev[("B", j)].end - 1e-12
                assert ev[("sync", -1)].start >= max(ev[("W", j)].end for j in range(m)) - 1e-12
    with pytest.raises(ValueError, match="weight_s"):
        StageTimes(forward_s=1, backward_s=1, weight_s=2)
    with pytest.raises(ValueError, match="split_s"):
        StageTimes(forward_s=1, backward_s=1, split_s=-0.1)
    with pytest.raises(ValueError, match="defer"):
        PipelineTimes(stages=(StageTimes(forward_s=1, backward_s=1),) * 2, links=(LinkTimes(forward_s=0, backward_s=0),),
                      num_micro_batches=4, defer=(1,))


# --- the deferred products -----------------------------------------------------------------------------------


LLAMA = ModelConfig(name="tiny-llama", style="llama", vocab_size=256, d_model=64, n_layers=3, n_heads=4,
                    n_kv_heads=2, ffn_hidden=128, seq_len=32)


@pytest.mark.parametrize("config", [preset("tiny"), LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_deferred_weight_gradients_equal_autograds(config: ModelConfig, recompute: bool, dtype) -> None:
    n = config.n_layers + 2
    plain = build_slice(config, 0, n, seed=1, recompute=range(1, n - 1) if recompute else ())
    split = copy.deepcopy(plain)
    sink = WeightGradients()
    assert attach(split, sink) == 4 * config.n_layers + 1  # qkv, proj, fc, out per block and the head
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    tgt = torch.roll(ids, -1, dims=1)

    def loss(module: torch.nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            return lm_loss(module(ids), tgt)

    loss(plain).backward()
    loss(split).backward()
    pending = sink.take()
    assert len(pending) == 4 * config.n_layers + 1
    deferred = {id(p.weight) for p in pending}
    for p in split.parameters():  # the deferred weights have no gradient yet, the rest have theirs
        assert (p.grad is None) == (id(p) in deferred)
    assert WeightGradients.nbytes(pending) > 0
    WeightGradients.apply(pending)
    for a, b in zip(plain.parameters(), split.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7)
    # detached: backward computes them again
    attach(split, None)
    split.zero_grad(set_to_none=True)
    loss(split).backward()
    assert all(p.grad is not None for p in split.parameters())
    assert not sink.take()


def test_a_tied_heads_copy_is_not_deferred() -> None:
    config = replace(preset("tiny"), tied_head=True)
    head = build_slice(config, 3, config.n_layers + 2, seed=0)  # the head's stage holds a copy of the weight
    assert attach(head, WeightGradients()) == 4 * (config.n_layers + 2 - 3 - 1)


def test_the_planners_stash_is_what_the_runtime_holds() -> None:
    """The cost model's bytes of one micro-batch's deferred products equal what the runtime's hold."""
    config = preset("tiny")
    spec = ModelSpec.from_config(config)
    cm = CostModel(spec, TrainSpec(global_batch=8, seq_len=config.seq_len, dtype="fp32"))
    island = parse_cluster('[[group]]\nname = "g"\ndevice = "A100-80GB"\ncount = 1\n').islands[0]
    n = config.n_layers + 2
    module = build_slice(config, 0, n, seed=0)
    sink = WeightGradients()
    attach(module, sink)
    ids = torch.randint(0, config.vocab_size, (2, config.seq_len))
    lm_loss(module(ids), ids).backward()
    held = WeightGradients.nbytes(sink.take())
    assert cm.table(island, 2).stash(0, n) == pytest.approx(held, rel=0.02)


# --- runtime -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_threads_with_deferred_weights_train_as_1f1b_does(precision: str) -> None:
    config = preset("tiny")
    m, steps = 4, 3
    batches = [synthetic_batch(vocab_size=config.vocab_size, batch=2 * m, seq_len=config.seq_len, seed=0, step=i)
               for i in range(steps)]
    cfg = StageConfig(micro_batches=m, lr=1e-3, track_memory=True, bf16_autocast=precision == "bf16",
                      fp16_loss_scale=LossScaleConfig(init_scale=2.0 ** 10) if precision == "fp16" else None)
    cuts = [0, 2, 4, 6]
    plain = train_threaded(config, cuts=cuts, stage_config=cfg, batches=batches)
    zb = train_threaded(config, cuts=cuts, stage_config=cfg, batches=batches, defer_weights=zero_bubble_depths(3))
    assert zb.losses() == pytest.approx(plain.losses(), rel=1e-5)
    for a, b in zip(plain.stages[0], zb.stages[0]):
        for x, y in zip(a.module.parameters(), b.module.parameters()):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
    last = zb.results[0]
    for s in range(3):
        ops = [t.op for t in last[s][-1].timeline]
        assert ops.count("weight") == m and ops.count("backward") == m
        assert all(t.compute > 0 for t in last[s][-1].timeline if t.op == "weight")
    # the last stage holds its deferred products besides its single in-flight micro-batch
    assert last[2][-1].peak_activation_bytes > plain.results[0][2][-1].peak_activation_bytes


def test_some_layers_defer_and_the_rest_compute_in_backward() -> None:
    """`defer_layers`: where memory holds only part of a stage's products, the named layers defer theirs and the
    others compute them in backward; the step is the same, and a stage holds less than deferring every layer."""
    config = preset("tiny")
    m = 4
    batches = [synthetic_batch(vocab_size=config.vocab_size, batch=2 * m, seq_len=config.seq_len, seed=0, step=i)
               for i in range(2)]
    cfg = StageConfig(micro_batches=m, lr=1e-3, track_memory=True)
    cuts = [0, 2, 4, 6]
    depths = zero_bubble_depths(3)
    plain = train_threaded(config, cuts=cuts, stage_config=cfg, batches=batches)
    every = train_threaded(config, cuts=cuts, stage_config=cfg, batches=batches, defer_weights=depths)
    part = train_threaded(config, cuts=cuts, stage_config=cfg, batches=batches, defer_weights=depths,
                          defer_layers=[[1], [3], [5]])
    assert part.losses() == pytest.approx(plain.losses(), rel=1e-5)
    for a, b in zip(plain.stages[0], part.stages[0]):
        for x, y in zip(a.module.parameters(), b.module.parameters()):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
    mid = part.stages[0][1]
    deferring = {n for n, mod in mid.module.named_modules() if getattr(mod, "deferred", None) is not None}
    assert deferring and all(n.startswith("layers.3.") for n in deferring)
    assert part.results[0][1][-1].peak_activation_bytes < every.results[0][1][-1].peak_activation_bytes
    with pytest.raises(ValueError, match="defer_layers"):
        train_threaded(config, cuts=cuts, stage_config=cfg, batches=batches[:1], defer_weights=depths,
                       defer_layers=[[1], [5], [5]])


def test_threads_with_deeper_warm_ups_and_deferred_weights_train_as_1f1b_does() -> None:
    """Extra warm-up forwards (`in_flight`, as the composer fills a pipeline's wait with them) on top of deferred
    weight gradients: the same step."""
    config = preset("tiny")
    m = 6
    batches = [synthetic_batch(vocab_size=config.vocab_size, batch=m, seq_len=config.seq_len, seed=1, step=i)
               for i in range(2)]
    cfg = StageConfig(micro_batches=m, lr=1e-3)
    cuts = [0, 2, 4, 6]
    plain = train_threaded(config, cuts=cuts, stage_config=cfg, batches=batches)
    filled = train_threaded(config, cuts=cuts, stage_config=cfg, batches=batches, defer_weights=zero_bubble_depths(3),
                            in_flight=[2, 1, 0])
    assert filled.losses() == pytest.approx(plain.losses(), rel=1e-5)
    first = [t.op for t in filled.results[0][0][-1].timeline]
    assert first[:5] == ["forward"] * 5  # p - 1 + 2 warm-up forwards before the first backward


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_nodes_with_deferred_weights_match_one_process(tmp_path: Path) -> None:
    """Real gRPC peers and gloo groups: a 3-stage plan, the middle stage 2 replicas under ZeRO-1 (its products
    added into the flat gradient buffer) and the first 2 under ZeRO-2 (computes them in backward)."""
    steps = 4
    job = tiny_job(steps, micro_batch=2)
    expected, _ = train_local(job)
    m = job.train.global_batch // 2
    plan = [PipelinePlan(micro_batch=2, num_micro_batches=m, stages=[
        stage((0, 2), ["a", "b"], zero=2, defer_weights=1), stage((2, 4), ["c", "d"], zero=1, defer_weights=2),
        stage((4, 6), ["e"], defer_weights=3, defer_layers=[5])])]  # the last stage defers its head's alone
    run = run_pinned_plan(job, plan, tmp_path / "ckpt")
    assert sorted(run.losses) == list(range(steps))
    assert_losses_match(run.losses, expected, 1e-4, range(steps))


# --- planner -------------------------------------------------------------------------------------------------


MIXED = """
[[group]]
name = "a100"
device = "A100-80GB"
count = 8
gpus_per_node = 8
[[group]]
name = "v100"
device = "V100-32GB"
count = 8
gpus_per_node = 8
"""


def test_the_planner_defers_weights_where_the_runtime_can_and_it_fits() -> None:
    spec = preset_spec("1.3b")
    train = TrainSpec(global_batch=256, seq_len=1024)
    cluster = parse_cluster(MIXED)
    zb = search_plan(spec, cluster, train, options=PlannerOptions(max_tp=1))
    off = search_plan(spec, cluster, train, options=PlannerOptions(max_tp=1, zero_bubble=False))
    stages = [s for p in zb.plan.pipelines for s in p.stages]
    assert len(stages) > 1 and any(s.defer_weights for s in stages)
    for p in zb.plan.pipelines:
        for n, s in enumerate(p.stages):
            assert 0 <= s.defer_weights <= n + 1
            if s.defer_weights:
                assert s.zero <= 1
    assert all(s.defer_weights == 0 for p in off.plan.pipelines for s in p.stages)
    assert zb.plan.predicted.step_time_s < off.plan.predicted.step_time_s
    usable = {i.id: i.device.memory_gb * (1 - PlannerOptions().memory_reserve_fraction) for i in cluster.islands}
    for s in stages:
        assert s.memory_gb_per_device <= usable[s.island] + 1e-9
    # a plan's depths travel on the wire and in JSON
    back = plan_from_proto(plan_to_proto(zb.plan))
    assert [s.defer_weights for p in back.pipelines for s in p.stages] == [s.defer_weights for s in stages]
    assert [s.defer_weights for p in Plan.from_json(zb.plan.to_json()).pipelines for s in p.stages] == \
        [s.defer_weights for s in stages]
    with pytest.raises(ValueError, match="defer_weights"):
        StagePlan(island="a", layers=(0, 3), defer_weights=-1)
    with pytest.raises(ValueError, match="outside"):
        StagePlan(island="a", layers=(0, 3), defer_weights=1, defer_layers=[3])
    with pytest.raises(ValueError, match="defer_weights is 0"):
        StagePlan(island="a", layers=(0, 3), defer_layers=[1])
    part = Plan(model="m", global_batch=2, seq_len=8, pipelines=[PipelinePlan(micro_batch=1, num_micro_batches=2, stages=[
        StagePlan(island="a", layers=(0, 3), defer_weights=1, defer_layers=[2, 1])])])
    assert plan_from_proto(plan_to_proto(part)).pipelines[0].stages[0].defer_layers == [1, 2]
    assert Plan.from_json(part.to_json()).pipelines[0].stages[0].defer_layers == [1, 2]


def test_the_job_and_the_cli_can_turn_it_off(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from atoll.launch.cli import main
    from atoll.job import JobSpec

    job = JobSpec.load(Path(__file__).resolve().parent.parent / "examples" / "tiny.toml")
    assert job.train.zero_bubble and "zero_bubble" not in job.to_toml()  # the default keeps old jobs' ids
    off = replace(job, train=replace(job.train, zero_bubble=False))
    path = tmp_path / "job.toml"
    path.write_text(off.to_toml())
    assert "zero_bubble = false" in off.to_toml() and not JobSpec.load(path).train.zero_bubble
    cluster = tmp_path / "mixed.toml"
    cluster.write_text(MIXED)
    for flag, deferred in (([], True), (["--no-zero-bubble"], False)):
        out = tmp_path / "plan.json"
        assert main(["plan", "--model", "1.3b", "--cluster", str(cluster), "--global-batch", "256", "--seq-len", "1024",
                     "--json", str(out), *flag]) == 0
        capsys.readouterr()
        stages = [s for p in Plan.from_json(out.read_text()).pipelines for s in p.stages]
        assert any(s.defer_weights for s in stages) == deferred
        if not deferred:  # plain 1F1B: no filled warm-up either (this cluster's fast links ask no deep window)
            assert all(s.in_flight == 0 for s in stages)


def test_the_composer_keeps_plain_1f1b_where_deferring_simulates_slower() -> None:
    """Deferring never costs a plan: where the weight actions would land on a stage's critical path (here a first
    stage whose backward is all weight gradients), the same pipeline without deferral is kept."""
    from atoll.coordinator.planner.composer import Candidate, Composer, StageChoice
    from atoll.coordinator.planner.parallelizer import IslandCost

    cluster = parse_cluster(MIXED)
    island = cluster.islands[0]
    composer = Composer(cost_model=CostModel(preset_spec("350m"), TrainSpec(global_batch=8, seq_len=512)),
                        cluster=cluster)

    def choice(f: float, b: float, w: float, defer: int) -> StageChoice:
        cost = IslandCost(forward_s=f, backward_s=b, memory_bytes=0.0, dp=1, zero=0, recompute=False, micro_batch=1)
        return StageChoice(island=island, start=0, end=1, cost=cost, sync_s=0.0, optimizer_s=0.0, defer=defer,
                           weight_s=w, defer_bytes=1.0)

    stages = [choice(1, 6, 6, 1), choice(2, 4, 0, 2)]
    times = PipelineTimes(stages=tuple(StageTimes(forward_s=s.cost.forward_s, backward_s=s.cost.backward_s,
                                                  weight_s=s.weight_s) for s in stages),
                          links=(LinkTimes(forward_s=0, backward_s=0),), num_micro_batches=2, defer=(1, 2))
    worse = Candidate(order=("a100",), micro_batch=1, num_micro_batches=2, stages=stages, links=[], times=times,
                      estimate_s=closed_form_step(times), step_s=simulate(times).step_time_s)
    kept = composer._plain_if_faster(worse)
    plain = simulate(replace(times, defer=())).step_time_s
    assert kept.step_s == pytest.approx(plain) and plain < simulate(times).step_time_s
    assert not kept.times.defer and all(s.defer == 0 and s.defer_bytes == 0 for s in kept.stages)
    # a balanced pipeline keeps its deferral
    even = [choice(1, 2, 1, 1), choice(1, 2, 1, 2)]
    t2 = replace(times, stages=tuple(StageTimes(forward_s=1, backward_s=2, weight_s=1) for _ in even), num_micro_batches=4)
    got = composer._plain_if_faster(Candidate(order=("a100",), micro_batch=1, num_micro_batches=4, stages=even,
                                              links=[], times=t2, estimate_s=closed_form_step(t2),
                                              step_s=simulate(t2).step_time_s))
    assert got.times.defer == (1, 2) and got.step_s < simulate(replace(t2, defer=())).step_time_s


def test_a_stage_whose_weight_gradients_are_too_short_keeps_them_in_backward() -> None:
    """A weight action costs something of its own: below `min_deferred_s` of weight gradients per micro-batch a
    stage keeps them in backward."""
    spec = preset_spec("1.3b")
    train = TrainSpec(global_batch=256, seq_len=1024)
    cluster = parse_cluster(MIXED)
    options = PlannerOptions(max_tp=1)
    assert any(s.defer_weights for p in search_plan(spec, cluster, train, options=options).plan.pipelines
               for s in p.stages)
    never = search_plan(spec, cluster, train, options=replace(options, min_deferred_s=1e3)).plan
    assert not any(s.defer_weights for p in never.pipelines for s in p.stages)


def test_where_memory_holds_part_of_the_products_some_layers_defer() -> None:
    """The composer defers as many layers' weight gradients as the stage's memory holds, at the deepest depth that
    holds them: the bytes it counts are the chosen layers', within the room left, and the time it defers theirs."""
    from atoll.coordinator.planner.composer import Composer, StageChoice

    cluster = parse_cluster(MIXED)
    island = cluster.islands[0]
    cm = CostModel(preset_spec("7b"), TrainSpec(global_batch=64, seq_len=2048))
    composer = Composer(cost_model=cm, cluster=cluster)
    start, end = 1, 9
    t = cm.table(island, 2)  # a 7b block's weight gradients: 11 ms per micro-batch, above `min_deferred_s`
    one = cm.deferred_bytes(t, start, end, (), 1, [start])
    full = cm.deferred_bytes(t, start, end, (), 1)
    assert one < full
    for room in (2.5 * one, 0.5 * full):
        cost = cm_cost = replace(_cost(t, start, end), memory_bytes=cm.memory_capacity(island) - room)
        st = StageChoice(island=island, start=start, end=end, cost=cost, sync_s=0.0, optimizer_s=0.0)
        got = composer._deferred(st, 0, 8)
        assert got.defer == 1 and got.defer_layers and set(got.defer_layers) < set(range(start, end))
        assert got.defer_bytes == pytest.approx(cm.deferred_bytes(t, start, end, (), 1, got.defer_layers))
        assert got.defer_bytes <= room and cm_cost.memory_bytes + got.defer_bytes <= cm.memory_capacity(island)
        assert got.weight_s == pytest.approx(sum(t.weight(i, i + 1) for i in got.defer_layers))
    # with room for every layer at the zero-bubble depth, all of them (the plan's empty list)
    roomy = replace(_cost(t, start, end), memory_bytes=0.0)
    got = composer._deferred(StageChoice(island=island, start=start, end=end, cost=roomy, sync_s=0.0,
                                         optimizer_s=0.0), 2, 8)
    assert got.defer == 3 and got.defer_layers == () and got.weight_s == pytest.approx(t.weight(start, end))
    # room for nothing: unchanged
    tight = replace(_cost(t, start, end), memory_bytes=cm.memory_capacity(island) - 0.5 * one)
    got = composer._deferred(StageChoice(island=island, start=start, end=end, cost=tight, sync_s=0.0,
                                         optimizer_s=0.0), 2, 8)
    assert got.defer == 0 and got.defer_bytes == 0


def _cost(t, start: int, end: int):
    from atoll.coordinator.planner.parallelizer import IslandCost

    return IslandCost(forward_s=t.forward(start, end), backward_s=t.backward(start, end), memory_bytes=0.0, dp=1,
                      zero=0, recompute=False, micro_batch=2)


def test_the_composer_fills_the_wait_for_the_first_gradient_where_memory_allows() -> None:
    """Deeper warm-ups (ZB-H2's idea): on a cluster with room to spare, the plan's stages run extra warm-up forwards
    beyond any deep window, within their memory, and the plan simulates faster than without them."""
    spec = preset_spec("350m")
    cluster = parse_cluster(MIXED)
    train = TrainSpec(global_batch=512, seq_len=1024)
    filled = search_plan(spec, cluster, train)
    plain = search_plan(spec, cluster, train, options=PlannerOptions(fill_warmup=False))
    extra = [s.in_flight for p in filled.plan.pipelines for s in p.stages]
    assert sum(extra) > sum(s.in_flight for p in plain.plan.pipelines for s in p.stages)
    assert filled.plan.predicted.step_time_s < plain.plan.predicted.step_time_s
    filled.plan.validate()
    usable = {i.id: i.device.memory_gb * (1 - PlannerOptions().memory_reserve_fraction) for i in cluster.islands}
    for p in filled.plan.pipelines:
        for n, s in enumerate(p.stages):
            assert s.in_flight <= len(p.stages) - n - 1 or s.in_flight == 0
            assert s.memory_gb_per_device <= usable[s.island] + 1e-9
