"""ZeRO-1/2 over a stage's replicas: the same training as one process, sharded states, whole checkpoints.

Unit level: `ZeroOptimizer` on gloo groups of threads against AdamW on the whole batch. Runtime level:
nodes as threads with real gRPC peers and gloo groups (`PlanRunner`), per-step losses against the job
trained in one process (`train_local`). Tolerance: 1e-4 relative on the losses (the reductions sum in
another order; AdamW is element-wise, so sharding itself changes nothing).
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from pipeline_harness import REPO, assert_losses_match, in_threads, run_outer_plan, run_pinned_plan, stage, tiny_job

from atoll.models import preset, preset_spec
from atoll.node.checkpoint import step_dir
from atoll.node.dataparallel import gloo_group
from atoll.node.local import train_local
from atoll.node.model import build_slice, lm_loss
from atoll.node.runner import PlanRunner, RunContext
from atoll.node.slice_state import read_slice
from atoll.node.zero import ZeroConfig, ZeroOptimizer
from atoll.plan import PipelinePlan, Plan
from atoll.types import StepMetrics

TOL = 1e-4


def _threads(n: int, fn) -> list:
    """Run fn(rank, group) on n threads over one gloo group; return the results in rank order."""
    store = dist.HashStore()
    return in_threads(n, lambda r: fn(r, gloo_group(store, "zero/", rank=r, size=n, timeout=timedelta(seconds=30))))


@pytest.mark.parametrize("stage,overlap", [(1, False), (1, True), (2, False)])
def test_sharded_adamw_is_adamw_on_the_data_parallel_gradient(stage: int, overlap: bool) -> None:
    """Two replicas, each half the rows with a grad_scale of 1/2, micro-batches accumulated, several buckets
    (some parameters bigger than one), the gradient clipped: the parameters AdamW gives on the same
    data-parallel gradient (summed in the same order), and half the optimizer states on each replica. With
    `overlap`, ZeRO-1 reduce-scatters every bucket while the last micro-batch's backward runs."""
    config = preset("tiny")
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (3, 8, 17))  # steps x rows x (seq + 1)
    lr, clip, m = 3e-3, 0.5, 2

    ref = build_slice(config, 0, 6, seed=1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95), foreach=False)
    params = list(ref.parameters())
    norms = []
    for s in range(3):
        g = {}  # (replica, micro-batch) -> gradients
        for r in range(2):
            for k, x in enumerate(ids[s][4 * r:4 * r + 4].chunk(m)):
                ref_opt.zero_grad(set_to_none=True)
                (lm_loss(ref(x[:, :-1]), x[:, 1:]) / m).backward()
                g[r, k] = [p.grad.clone() for p in params]
        for i, p in enumerate(params):
            if stage == 1:  # each replica accumulates its micro-batches, then the scaled sum over replicas
                p.grad = 0.5 * (g[0, 0][i] + g[0, 1][i]) + 0.5 * (g[1, 0][i] + g[1, 1][i])
            else:  # the scaled sum over replicas of every micro-batch, accumulated
                p.grad = (0.5 * g[0, 0][i] + 0.5 * g[1, 0][i]) + (0.5 * g[0, 1][i] + 0.5 * g[1, 1][i])
        sq = float(sum(p.grad.double().pow(2).sum() for p in params))
        norms.append(sq ** 0.5)
        coef = min(clip / (norms[-1] + 1e-6), 1.0)
        for p in params:
            p.grad.mul_(coef)
        ref_opt.step()
    assert max(norms) > clip  # clipping was exercised

    def replica(rank: int, group) -> tuple[dict[str, torch.Tensor], list[float], int]:
        module = build_slice(config, 0, 6, seed=1)
        zero = ZeroOptimizer(module.parameters(), group, ZeroConfig(
            stage=stage, lr=lr, weight_decay=0.1, bucket_bytes=40_000, grad_scale=0.5))
        assert len(zero.buckets) > 3
        got = []
        for s in range(3):
            zero.zero_grad()
            for k, x in enumerate(ids[s][4 * rank:4 * rank + 4].chunk(m)):
                if overlap and k == m - 1:
                    zero.last_backward()
                (lm_loss(module(x[:, :-1]), x[:, 1:]) / m).backward()
                zero.backward_done()
            zero.reduce_gradients()
            assert zero.reduced_in_backward == (len(zero.buckets) if overlap else 0)
            got.append(zero.squared_norm() ** 0.5)
            zero.scale_gradients(min(clip / (got[-1] + 1e-6), 1.0))
            zero.step()
        states = sum(v.numel() for st in zero.optimizer.state.values() for v in st.values() if v.ndim > 0)
        if stage == 2:  # never a whole gradient: the shard accumulators and the few buckets in flight
            shard = sum(b.chunk for b in zero.buckets) * 4
            assert zero.peak_grad_bytes <= shard + 3 * max(b.size for b in zero.buckets) * 4
            assert zero.peak_grad_bytes < 0.8 * zero.flat.numel() * 4
        return {n: p.detach().clone() for n, p in module.named_parameters()}, got, states

    whole = sum(p.numel() for p in params)
    for got_params, got_norms, states in _threads(2, replica):
        assert got_norms == pytest.approx(norms, rel=1e-6)
        for n, p in ref.named_parameters():
            # atol: Adam scales noise-level gradients (the key bias's is zero but for rounding) up to about lr
            torch.testing.assert_close(got_params[n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)
        assert whole <= states <= whole + 2 * 64  # two moments of half the (padded) parameters


def test_consolidated_state_is_adamws_and_loads_back_into_other_shards() -> None:
    """ZeRO-1 gathers the whole AdamW state to one replica; a ZeRO-2 pair started from it (and from the same
    parameters) takes the next step exactly as AdamW does."""
    config = preset("tiny")
    ids = torch.randint(0, config.vocab_size, (2, 4, 17), generator=torch.Generator().manual_seed(3))
    ref = build_slice(config, 0, 6, seed=2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.95), foreach=False)

    def ref_step(s: int) -> None:
        ref_opt.zero_grad(set_to_none=True)
        lm_loss(ref(ids[s, :, :-1]), ids[s, :, 1:]).backward()
        ref_opt.step()

    def zero_step(module, zero, rank: int, s: int) -> None:
        zero.zero_grad()
        rows = ids[s, 2 * rank:2 * rank + 2]
        lm_loss(module(rows[:, :-1]), rows[:, 1:]).backward()
        zero.backward_done()
        zero.reduce_gradients()
        zero.step()

    def first(rank: int, group):
        module = build_slice(config, 0, 6, seed=2)
        zero = ZeroOptimizer(module.parameters(), group, ZeroConfig(stage=1, lr=1e-3, bucket_bytes=30_000,
                                                                    grad_scale=0.5))
        assert zero.consolidated_state(to=1) is None  # nothing to gather before the first step
        zero_step(module, zero, rank, 0)
        state = zero.consolidated_state(to=1)
        return None if state is None else {n: state[p] for n, p in module.named_parameters()}

    gathered = _threads(2, first)
    assert gathered[0] is None
    ref_step(0)
    full = gathered[1]
    ref_names = {id(p): n for n, p in ref.named_parameters()}
    assert set(full) == set(ref_names.values())
    for p, st in ref_opt.state.items():
        got = full[ref_names[id(p)]]
        assert float(got["step"]) == float(st["step"]) == 1.0
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[key], st[key], rtol=1e-5, atol=1e-9)

    after_one = {k: v.clone() for k, v in ref.state_dict().items()}

    def second(rank: int, group):
        module = build_slice(config, 0, 6, seed=2)
        module.load_state_dict(after_one)
        zero = ZeroOptimizer(module.parameters(), group, ZeroConfig(stage=2, lr=1e-3, bucket_bytes=50_000,
                                                                    grad_scale=0.5))
        zero.load_param_states({p: full[n] for n, p in module.named_parameters()})
        zero_step(module, zero, rank, 1)
        return {n: p.detach().clone() for n, p in module.named_parameters()}

    results = _threads(2, second)
    ref_step(1)
    for params in results:
        for n, p in ref.named_parameters():
            torch.testing.assert_close(params[n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)


def _two_stages(zero: tuple[int, int], cut: int = 3) -> list[PipelinePlan]:
    """One pipeline of two stages, two replicas each (micro-batches of 4 rows, 2 per replica)."""
    return [PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
        stage((0, cut), ["a", "b"], zero=zero[0]), stage((cut, 6), ["c", "d"], zero=zero[1])])]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero", [1, 2])
def test_zero_dp2_pipeline_matches_one_process(tmp_path: Path, zero: int) -> None:
    """Both stages of a two-stage pipeline shard over their two replicas: the one-process losses, and the
    optimizer states (ZeRO-1), then the gradients too (ZeRO-2), off each replica's reported peak memory."""
    job = tiny_job(4)
    expected, _ = train_local(job)
    plain = run_pinned_plan(job, _two_stages((0, 0)), tmp_path / "plain")
    sharded = run_pinned_plan(job, _two_stages((zero, zero)), tmp_path / "zero")
    assert_losses_match(plain.losses, expected, TOL, range(4))
    assert_losses_match(sharded.losses, expected, TOL, range(4))
    params = {n: sum(p.numel() for p in build_slice(job.model, *layers).parameters())
              for layers, nodes in (((0, 3), "ab"), ((3, 6), "cd")) for n in nodes}
    before, after = plain.peaks(), sharded.peaks()
    for n, count in params.items():
        # fp32: AdamW's two moments are 8 bytes a parameter, the gradient 4; each replica keeps half of the
        # moments, and with ZeRO-2 half of the gradient less the few buckets it stages at a time (here
        # 64 KiB, or a parameter bigger than that: the embedding's and the MLP's 64 KiB + 4 bytes)
        saved = before[n] - after[n]
        assert abs(saved - 4 * count) <= 4096 if zero == 1 else 4 * count < saved, (n, saved, count)
        if zero == 2:
            assert 6 * count - 3 * (2**16 + 4096) <= saved <= 6 * count + 4096, (n, saved, count)


@pytest.mark.timeout(150)
def test_checkpoint_under_zero_resumes_under_another_cut(tmp_path: Path) -> None:
    """Checkpoint after 3 steps with ZeRO-2 and ZeRO-1 stages over two replicas each; the files hold whole
    AdamW states; resume on two single nodes cut elsewhere: the losses of training straight through."""
    job = tiny_job(6, interval=3)
    expected, _ = train_local(job)
    first = run_pinned_plan(job, _two_stages((2, 1), cut=2), tmp_path / "ckpt", until_step=3).losses
    assert sorted(first) == [0, 1, 2]
    saved = read_slice(step_dir(tmp_path / "ckpt", 3) / "layers-0002-0006.pt")
    whole = build_slice(job.model, 2, 6)
    assert set(saved["optimizer"]) == {n for n, _ in whole.named_parameters()}
    for n, p in whole.named_parameters():
        assert saved["optimizer"][n]["exp_avg"].shape == p.shape
    second = run_pinned_plan(job, [PipelinePlan(micro_batch=4, num_micro_batches=4,
                                                stages=[stage((0, 4), ["a"]), stage((4, 6), ["b"])])],
                             tmp_path / "ckpt", resume_step=3).losses
    assert_losses_match({**first, **second}, expected, TOL, range(6))


# --- measured memory against the plan ------------------------------------------------------------------

def test_a_stage_over_its_planned_memory_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    job = tiny_job(6)
    plan = Plan(model="tiny", global_batch=16, seq_len=64, epoch=1, job_id="job", pipelines=[PipelinePlan(
        micro_batch=4, num_micro_batches=4, stages=[stage((0, 6), ["a"], memory_gb_per_device=0.002)])])
    ctx = RunContext(node_id="a", job=job, peer_server=None, checkpoint_dir=Path("unused"),  # type: ignore[arg-type]
                     report_step=lambda m: False, report_checkpoint=lambda c: None)
    runner = PlanRunner(ctx, plan)
    with caplog.at_level("WARNING", logger="atoll.node.runner"):
        runner._check_memory(0, 2_100_000)  # 5% over: fine
        assert not caplog.records
        runner._check_memory(1, 2_300_000)
        runner._check_memory(2, 2_400_000)
    assert len(caplog.records) == 1 and "15% above the plan's 0.002 GB" in caplog.records[0].getMessage()


def test_status_summary_keeps_each_nodes_highest_peak() -> None:
    from atoll.coordinator.progress import summarize

    reports = [StepMetrics(job_id="j", node_id=n, plan_epoch=1, step=s, stage=st, step_seconds=1.0,
                           peak_memory_bytes=peak) for n, st, s, peak in
               (("a", 0, 0, 100), ("a", 0, 1, 300), ("a", 0, 2, 200), ("b", 1, 1, 50))]
    usage = {u.node_id: u.peak_memory_bytes for u in summarize(reports, epoch=1).stages}
    assert usage == {"a": 300, "b": 50}


@pytest.mark.timeout(150)
def test_zero_stages_in_outer_mode_keep_their_replicas_identical_and_sync(tmp_path: Path) -> None:
    """Outer mode over ZeRO stages: a group whose stages shard over two replicas (ZeRO-2, ZeRO-1) and a group
    of one node exchange int8 pseudo-gradients every 3 steps; the outer updates land in the flat parameters the
    sharded AdamW steps, so the replicas stay bit-identical, the groups agree after the last round and the
    loss falls (`run_outer_plan`, as in tests/test_outer_runner.py)."""
    from atoll.plan import OuterPlan

    steps = 9
    job = tiny_job(steps)
    job = replace(job, outer=replace(job.outer, apply_after=2))
    outer = OuterPlan(inner_steps=3, codec="int8", lr=0.8, momentum=0.5, overlap=True, deadline_s=30.0)
    g0 = [PipelinePlan(micro_batch=8, num_micro_batches=2, stages=[stage((0, 3), ["a", "c"], zero=2),
                                                                   stage((3, 6), ["b", "d"], zero=1)])]
    g1 = [PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[stage((0, 6), ["e"])])]
    run = run_outer_plan(job, [g0, g1], outer, tmp_path)
    losses, params, rounds = run.losses, run.params, run.rounds
    for a, c in (("a", "c"), ("b", "d")):
        for n in params[a]:
            assert torch.equal(params[a][n], params[c][n]), n
    for n, t in {**params["a"], **params["b"]}.items():
        assert torch.allclose(t, params["e"][n], atol=1e-5), n
    assert losses[(0, steps - 1)] < losses[(0, 0)] and losses[(1, steps - 1)] < losses[(1, 0)]
    assert rounds.latest_decided == steps // 3 - 1


@pytest.mark.timeout(120)
def test_zero_falls_back_to_adamw_where_other_pipelines_hold_the_layers(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Two pipelines cut differently average per layer segment: their ZeRO request is declined with the reason,
    and the run is the one-process run."""
    job = tiny_job(3)
    expected, _ = train_local(job)
    with caplog.at_level("INFO", logger="atoll.node.runner"):
        got = run_pinned_plan(job, [
            PipelinePlan(micro_batch=4, num_micro_batches=3, stages=[stage((0, 3), ["a"], zero=1),
                                                                     stage((3, 6), ["b"], zero=2)]),
            PipelinePlan(micro_batch=2, num_micro_batches=2, stages=[stage((0, 2), ["c"], zero=1),
                                                                     stage((2, 6), ["d"], zero=1)]),
        ], tmp_path).losses
    assert_losses_match(got, expected, TOL, range(3))
    declined = [r.getMessage() for r in caplog.records if "training with plain AdamW" in r.getMessage()]
    assert len(declined) == 4 and all("average per layer segment" in m for m in declined), declined


@pytest.mark.timeout(120)
def test_memory_benchmark_measures_what_the_planner_predicts(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/memory.py on the tiny model: every stage of every ZeRO and recomputation setting within 15%, and of
    four of them again with deferred weight gradients (zero-bubble; one deferring half the layers with a deeper
    warm-up)."""
    import sys

    sys.path.insert(0, str(REPO))  # the bench tree is not installed
    from bench.memory import main

    threads = torch.get_num_threads()
    try:
        assert main(["--model", "tiny", "--seq", "32", "--vocab", "0", "--steps", "1", "--only", "0,1,2",
                     "--recompute", "off,all"]) == 0
    finally:
        torch.set_num_threads(threads)  # the benchmark runs one thread per node
    assert "targets met: 20/20" in capsys.readouterr().out  # 12 without the zero-bubble runs


def test_the_parallelizer_takes_zero_1_at_equal_time_also_under_tensor_parallelism() -> None:
    """ZeRO-1 costs the time of ZeRO-0 (a reduce-scatter and an all-gather move an all-reduce's bytes) for less
    memory and a shorter optimizer step, so a data-parallel stage gets it; so does a tensor-parallel one with
    more than one replica (each tp rank shards its shards over its peers, `atoll.node.zero`)."""
    from atoll.coordinator.planner import TrainSpec, parse_cluster
    from atoll.coordinator.planner.costmodel import CostModel
    from atoll.coordinator.planner.parallelizer import DefaultParallelizer, SliceQuery

    cluster = parse_cluster('[[group]]\nname = "a100"\ndevice = "A100-80GB"\ncount = 8\ngpus_per_node = 8\n')
    island = cluster.islands[0]
    par = DefaultParallelizer(CostModel(preset_spec("1.3b"), TrainSpec(global_batch=64, seq_len=1024)))
    got = par.cost(SliceQuery(start=1, end=9, micro_batch=8, dp=8, in_flight=2, batch=8), island)
    assert got is not None and got.dp == 8 and got.tp == 1 and got.zero == 1
    zero0 = par.evaluate(SliceQuery(start=1, end=9, micro_batch=8, dp=8, in_flight=2, batch=8), island, zero=0)
    assert got.time_s == pytest.approx(zero0.time_s) and got.memory_bytes < zero0.memory_bytes
    entries = par._entries(island, 8, 8, False)  # (tp, dp, rows, zero, ...) of every split of 8 devices
    assert {e[0] for e in entries} >= {1, 2, 4, 8} and {e[3] for e in entries if e[0] == 1} == {0, 1, 2, 3}
    assert {e[3] for e in entries if e[0] > 1 and e[1] > 1} == {0, 1, 2, 3}
    assert {e[3] for e in entries if e[1] == 1} == {0}  # tp 8: one replica, nothing to shard over
    q = SliceQuery(start=1, end=9, micro_batch=8, dp=8, in_flight=2, batch=8)
    tp_zero1, tp_zero0 = (par.evaluate(q, island, zero=z, tp=2) for z in (1, 0))
    assert tp_zero1.time_s == pytest.approx(tp_zero0.time_s) and tp_zero1.memory_bytes < tp_zero0.memory_bytes


@pytest.mark.parametrize("stage", [1, 2])
def test_a_dropped_zero_optimizer_is_freed_with_its_launcher_thread(stage: int) -> None:
    """The gradient hooks on the parameters do not keep a ZeroOptimizer (its flat buffers and optimizer states)
    alive once the stage drops it, and ZeRO-1's launcher thread ends with it: a replan makes a new one."""
    import gc
    import weakref

    def replica(rank: int, group) -> weakref.ref:
        module = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        zero = ZeroOptimizer(module.parameters(), group, ZeroConfig(stage=stage, bucket_bytes=1_000))
        zero.zero_grad()
        zero.last_backward()
        module(torch.randn(4, 16)).sum().backward()
        zero.backward_done()
        zero.reduce_gradients()
        zero.step()
        assert zero.reduced_in_backward == (len(zero.buckets) if stage == 1 else 0)
        return weakref.ref(zero)

    def launchers() -> set[int]:
        return {t.ident for t in threading.enumerate() if t.name == "atoll-zero1-reduce"}

    before = launchers()  # other tests' optimizers may still be held (a run's groups are released later)
    refs = _threads(2, replica)
    gc.collect()
    assert all(r() is None for r in refs)
    deadline = time.monotonic() + 5
    while launchers() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not launchers() - before
