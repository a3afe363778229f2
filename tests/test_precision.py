"""Mixed precision: bf16 and fp16 autocast with fp32 master weights, fp16's dynamic loss scale and its global
overflow check (a step that overflows anywhere is skipped by every stage of every replica)."""

from __future__ import annotations

import math
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from atoll.job import JobSpec, JobSpecError
from atoll.models import preset
from atoll.node.dataparallel import GradientAverager, gloo_group
from atoll.node.inprocess import InProcessLinks, train_threaded
from atoll.node.model import build_slice
from atoll.node.norm_exchange import InProcessNormGroup
from atoll.node.precision import LossScaleConfig, LossScaler, autocast, compute_dtype, overflow_contribution
from atoll.node.stage import PipelineStage, StageConfig, StepResult
from atoll.node.synthetic import replica_batch, synthetic_batch

TINY = preset("tiny")
BATCHES = [synthetic_batch(vocab_size=TINY.vocab_size, batch=8, seq_len=TINY.seq_len, seed=7, step=i)
           for i in range(10)]
FP32 = StageConfig(micro_batches=2, lr=3e-3, max_grad_norm=0.5)


def fp16(**scale) -> StageConfig:
    return StageConfig(micro_batches=2, lr=3e-3, max_grad_norm=0.5, fp16_loss_scale=LossScaleConfig(**scale))


def test_loss_scaler_backs_off_on_overflow_and_grows_after_good_steps():
    s = LossScaler(LossScaleConfig(init_scale=1024.0, growth_interval=3))
    s.update(found_inf=False)
    s.update(found_inf=False)
    assert (s.scale, s.good_steps) == (1024.0, 2)
    s.update(found_inf=True)  # an overflow halves the scale and restarts the count
    assert (s.scale, s.good_steps, s.skipped) == (512.0, 0, 1)
    for _ in range(3):
        s.update(found_inf=False)
    assert (s.scale, s.good_steps) == (1024.0, 0)
    floor = LossScaler(LossScaleConfig(init_scale=2.0, min_scale=1.0))
    for _ in range(5):
        floor.update(found_inf=True)
    assert floor.scale == 1.0
    restored = LossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == {"scale": 1024.0, "good_steps": 0}
    with pytest.raises(ValueError, match="scale"):
        restored.load_state_dict({"scale": float("inf")})


@pytest.mark.parametrize("bad, field", [({"init_scale": 0.0}, "init_scale"), ({"growth_interval": 0}, "growth_interval"),
                                        ({"backoff_factor": 1.0}, "backoff_factor"),
                                        ({"growth_factor": 1.0}, "growth_factor")])
def test_loss_scale_config_validation(bad, field):
    with pytest.raises(ValueError, match=field):
        LossScaleConfig(**bad)
    with pytest.raises(ValueError, match="exclude"):
        StageConfig(bf16_autocast=True, fp16_loss_scale=LossScaleConfig())


def test_overflow_contribution_makes_any_non_finite_norm_inf():
    assert overflow_contribution(4.0) == 4.0
    assert overflow_contribution(float("nan")) == math.inf
    assert overflow_contribution(math.inf) + overflow_contribution(float("nan")) == math.inf
    assert compute_dtype("bf16") == torch.bfloat16 and compute_dtype("fp16") == torch.float16
    with pytest.raises(ValueError, match="precision"):
        compute_dtype("fp8")
    with autocast("fp16", "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16


def test_the_scale_travels_in_the_layer_files_of_a_checkpoint(tmp_path):
    from atoll.node.checkpoint import load_layers_extra, save_layers
    from atoll.node.stage import build_optimizer

    module = build_slice(TINY, 0, 3, seed=0)
    save_layers(module, build_optimizer(module, FP32), tmp_path, 5, data_position=80,
                extra={"loss_scale": {"scale": 2048.0, "good_steps": 7}})
    again = build_slice(TINY, 0, 3, seed=1)
    extra = load_layers_extra(again, None, tmp_path, 5)  # type: ignore[arg-type]
    assert extra["loss_scale"] == {"scale": 2048.0, "good_steps": 7} and extra["data_position"] == 80
    restored = LossScaler()
    restored.load_state_dict(extra["loss_scale"])
    assert restored.scale == 2048.0


def test_job_spec_takes_precision_and_the_loss_scale():
    base = ('[job]\nname = "p"\n[model]\npreset = "tiny"\n[train]\nglobal_batch = 8\nseq_len = 32\n'
            'micro_batch = 2\nsteps = 10\n')
    job = JobSpec.from_toml(base + 'precision = "fp16"\nloss_scale = 1024.0\nloss_scale_window = 50\n')
    assert (job.train.dtype, job.train.loss_scale, job.train.loss_scale_window) == ("fp16", 1024.0, 50)
    assert JobSpec.from_toml(job.to_toml()) == job
    assert JobSpec.from_toml(base + 'dtype = "bf16"\n').train.dtype == "bf16"
    # a job that leaves the new fields at their defaults keeps the id it had before they existed
    assert "loss_scale" not in JobSpec.from_toml(base).to_toml()
    with pytest.raises(JobSpecError, match="train.precision"):
        JobSpec.from_toml(base + 'precision = "fp8"\n')
    with pytest.raises(JobSpecError, match="both"):
        JobSpec.from_toml(base + 'precision = "fp16"\ndtype = "fp16"\n')


@pytest.mark.timeout(60)
def test_fp16_autocast_with_loss_scaling_trains_close_to_fp32():
    batches = BATCHES[:6]
    ref = train_threaded(TINY, cuts=[0, 3, 6], stage_config=FP32, batches=batches)
    run = train_threaded(TINY, cuts=[0, 3, 6], stage_config=fp16(init_scale=2.0 ** 12), batches=batches)
    losses = run.losses()
    assert all(math.isfinite(x) for x in losses)
    assert losses != pytest.approx(ref.losses(), rel=1e-6), "fp16 autocast should change the arithmetic"
    assert losses == pytest.approx(ref.losses(), rel=2e-2)
    assert not any(r.skipped for r in run.results[0][-1])
    # fp32 master weights
    assert all(p.dtype == torch.float32 for s in run.stages[0] for p in s.module.parameters())


@pytest.mark.timeout(60)
def test_a_scale_too_large_for_fp16_overflows_for_real_and_backs_off_until_steps_apply():
    run = train_threaded(TINY, cuts=[0, 3, 6], stage_config=fp16(init_scale=2.0 ** 24), batches=BATCHES[:8])
    results = run.results[0]
    skipped = [r.skipped for r in results[-1]]
    assert skipped[0], "a loss scale of 2^24 overflows fp16 activation gradients"
    assert not skipped[-1], "the scale should have come down far enough for steps to apply"
    assert [r.skipped for r in results[0]] == skipped, "both stages skip the same steps"
    scales = [r.loss_scale for r in results[-1]]
    for a, b, skip in zip(scales, scales[1:], skipped):
        assert b == (a / 2 if skip else a)


def _two_by_two(config: StageConfig, steps: int, overflow_at: int | None):
    """A two-stage pipeline with two replicas, run step by step (threads), with replica 1 stage 0's gradient
    of one parameter made inf at step `overflow_at`. Returns (results[step][replica][stage], params after each
    step: params[step][replica][stage])."""
    cuts = [0, 3, 6]
    links = [InProcessLinks(2) for _ in range(2)]
    norms = [InProcessNormGroup(2) for _ in range(2)]
    stages = [[PipelineStage(build_slice(TINY, cuts[s], cuts[s + 1], seed=0), stage=s, num_stages=2,
                             transport=links[r].transport(s), config=config, norm_exchange=norms[r].member(s))
               for s in range(2)] for r in range(2)]
    current = {"step": -1}
    victim = next(stages[1][0].module.parameters())
    victim.register_hook(lambda g: torch.full_like(g, math.inf) if current["step"] == overflow_at else g)
    store = dist.HashStore()
    groups: dict[int, list] = {0: [None, None], 1: [None, None]}

    def join(r: int, s: int) -> None:
        groups[s][r] = gloo_group(store, f"stage{s}", rank=r, size=2, timeout=timedelta(seconds=30))

    threads = [threading.Thread(target=join, args=(r, s)) for r in range(2) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for r in range(2):
        for s in range(2):
            stages[r][s].grad_averager = GradientAverager(groups[s][r])
    results: list[list[list[StepResult | None]]] = []
    params = []
    for step in range(steps):
        current["step"] = step
        out: list[list[StepResult | None]] = [[None, None], [None, None]]
        errors: list[BaseException] = []

        def work(r: int, s: int) -> None:
            try:
                out[r][s] = stages[r][s].train_step(step, replica_batch(BATCHES[step], r, 2))
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
                for ln in links:
                    ln.close()

        threads = [threading.Thread(target=work, args=(r, s)) for r in range(2) for s in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]
        results.append(out)
        params.append([[{k: v.detach().clone() for k, v in stages[r][s].module.state_dict().items()}
                        for s in range(2)] for r in range(2)])
    return results, params


@pytest.mark.timeout(90)
def test_an_overflow_in_one_stage_of_one_replica_skips_the_step_everywhere_and_halves_the_scale():
    steps, at = 6, 3
    config = fp16(init_scale=2.0 ** 10, growth_interval=2)
    results, params = _two_by_two(config, steps, overflow_at=at)
    flat = [[results[k][r][s] for r in range(2) for s in range(2)] for k in range(steps)]
    # the injected inf in replica 1 stage 0 skips step 3 on all four stage replicas, and only step 3
    for k in range(steps):
        assert [x.skipped for x in flat[k]] == [k == at] * 4, f"step {k}"
    # every stage replica holds the same scale: 2^10, grown after every 2 good steps, halved at the overflow
    scales = [{x.loss_scale for x in flat[k]} for k in range(steps)]
    assert scales == [{1024.0}, {1024.0}, {2048.0}, {2048.0}, {1024.0}, {1024.0}]
    # the parameters did not move at the skipped step, anywhere, and did at the others
    for r in range(2):
        for s in range(2):
            before, after = params[at - 1][r][s], params[at][r][s]
            assert all(torch.equal(before[n], after[n]) for n in before), f"replica {r} stage {s} stepped"
            later = params[at + 1][r][s]
            assert not all(torch.equal(after[n], later[n]) for n in after), "training goes on after the skip"
    # the replicas stay identical, and the loss stays finite after the skip
    for s in range(2):
        a, b = params[-1][0][s], params[-1][1][s]
        assert all(torch.equal(a[n], b[n]) for n in a)
    assert all(math.isfinite(results[k][r][1].loss) for k in range(steps) for r in range(2))


@pytest.mark.timeout(240)
def test_fp16_job_through_the_runner_resumes_its_loss_scale_from_the_checkpoint(tmp_path):
    """Real gRPC peers and gloo groups: an fp16 job with a loss scale that overflows for real at step 4 (after
    growing from 2^18 every 2 good steps) checkpoints at step 4 under one cut and resumes under another. Only a
    restored scale skips step 4 again, as the one-process run does, and gives the same losses."""
    from pipeline_harness import run_pinned_plan, stage, tiny_job

    from atoll.node.local import train_local
    from atoll.plan import PipelinePlan

    job = tiny_job(8, interval=4, dtype="fp16", loss_scale=2.0 ** 18, loss_scale_window=2)
    local: list[StepResult] = []
    expected, _ = train_local(job, on_step=lambda k, r: local.append(r))
    assert [r.skipped for r in local][:5] == [False, False, False, False, True], "the scale overflows at step 4"
    first = run_pinned_plan(job, [PipelinePlan(micro_batch=4, num_micro_batches=4,
                                               stages=[stage((0, 2), ["a"]), stage((2, 6), ["b"])])],
                            tmp_path / "ckpt", until_step=4).losses
    for f in sorted((tmp_path / "ckpt" / "step-00000004").glob("layers-*.pt")):  # every stage's file carries it
        assert torch.load(f, weights_only=False)["extra"]["loss_scale"] == {"scale": 2.0 ** 20, "good_steps": 0}
    second = run_pinned_plan(job, [PipelinePlan(micro_batch=4, num_micro_batches=4,
                                                stages=[stage((0, 4), ["a"]), stage((4, 6), ["b"])])],
                             tmp_path / "ckpt", resume_step=4).losses
    got = {**first, **second}
    assert sorted(got) == list(range(8))
    for s in range(8):
        assert got[s] == pytest.approx(expected[s], rel=1e-3), (s, got[s], expected[s])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero", [0, 2])
def test_an_injected_overflow_skips_the_step_on_every_node_of_a_two_stage_two_replica_run(tmp_path, monkeypatch,
                                                                                          zero):
    """Four nodes (two stages x two replicas) through the runner, with plain AdamW and with ZeRO-2: an inf in
    node b's gradients (stage 0, replica 1) at step 3 reaches every node through the data-parallel reduction and
    the pipeline's norm exchange, so all skip it, like one process given the same overflow; without the
    agreement the stages or replicas would step apart."""
    import atoll.node.local as local_mod
    import atoll.node.runner as runner_mod
    from pipeline_harness import run_pinned_plan, tiny_job
    from test_zero import _two_stages

    from atoll.node.local import train_local

    at = 3
    where = threading.local()
    build = runner_mod.build_slice

    def poisoned_build(*a, **kw):  # the victim's module gets a gradient hook that turns step `at`'s grads to inf
        module = build(*a, **kw)
        if getattr(where, "node", None) in ("b", "local"):
            p = next(module.parameters())
            p.register_hook(lambda g: torch.full_like(g, math.inf) if where.step == at else g)
        return module

    train_step = PipelineStage.train_step

    def tracked_step(self, step, batch=None):
        where.step = step
        return train_step(self, step, batch)

    run = runner_mod.PlanRunner.run

    def tracked_run(self, stop, until_step=None):
        where.node = self.ctx.node_id
        return run(self, stop, until_step)

    monkeypatch.setattr(runner_mod, "build_slice", poisoned_build)
    monkeypatch.setattr(local_mod, "build_slice", poisoned_build)
    monkeypatch.setattr(PipelineStage, "train_step", tracked_step)
    monkeypatch.setattr(runner_mod.PlanRunner, "run", tracked_run)

    job = tiny_job(6, dtype="fp16", loss_scale=2.0 ** 10, loss_scale_window=1000)
    where.node = "local"
    local: list[StepResult] = []
    expected, _ = train_local(job, on_step=lambda k, r: local.append(r))
    assert [r.skipped for r in local] == [k == at for k in range(6)]
    assert [r.loss_scale for r in local] == [1024.0] * 4 + [512.0] * 2
    run = run_pinned_plan(job, _two_stages((zero, zero)), tmp_path)
    got, reports = run.losses, run.reports
    assert sorted(got) == list(range(6))
    for s in range(6):
        assert got[s] == pytest.approx(expected[s], rel=1e-3), (s, got[s], expected[s])
    # every node reported step 3 skipped, and only step 3, and the same scale at every step
    by_node: dict[str, list] = {}
    for m in sorted(reports, key=lambda m: m.step):
        by_node.setdefault(m.node_id, []).append((m.skipped, m.loss_scale))
    assert sorted(by_node) == ["a", "b", "c", "d"]
    for node, seen in by_node.items():
        assert seen == [(k == at, 1024.0 if k <= at else 512.0) for k in range(6)], node
    # the step after the skip saw the same weights as the skipped one in both runs; a run that stepped at 3
    # would not match
    where.node = "nobody"
    unpoisoned, _ = train_local(job)
    assert unpoisoned[at + 1] != pytest.approx(expected[at + 1], rel=1e-3)


def test_16_bit_precisions_send_16_bit_activations_and_compute_in_fp32_between_boundaries():
    assert FP32.wire_dtype == torch.float32
    assert fp16().wire_dtype == torch.float16
    assert StageConfig(bf16_autocast=True).wire_dtype == torch.bfloat16
    links = InProcessLinks(2)
    norms = InProcessNormGroup(2)
    cfg = fp16(init_scale=256.0)
    stages = [PipelineStage(build_slice(TINY, a, b, seed=0), stage=s, num_stages=2, transport=links.transport(s),
                            config=cfg, norm_exchange=norms.member(s)) for s, (a, b) in enumerate([(0, 3), (3, 6)])]
    sent: list[torch.dtype] = []
    for st in stages:
        send = st.transport.send
        st.transport.send = lambda key, t, send=send: (sent.append(t.dtype), send(key, t))[1]
    threads = [threading.Thread(target=st.train_step, args=(0, BATCHES[0])) for st in stages]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sent and set(sent) == {torch.float16}  # activations downstream and their gradients upstream
    assert all(p.grad is None or p.grad.dtype == torch.float32 for st in stages for p in st.module.parameters())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("init_scale, growth", [(2.0 ** 12, 3), (2.0 ** 24, 1000)])
def test_a_pipeline_matches_torch_grad_scaler_on_the_unsplit_model(init_scale, growth):
    """torch.amp.GradScaler on the whole model in one process is an independent implementation of the same
    dynamic loss scale: a two-stage, two-replica pipeline has its losses and its scale at every step (growing
    every 3 steps; from 2^24 backing off through real fp16 overflows)."""
    from atoll.node.reference import train_unsplit

    cfg = fp16(init_scale=init_scale, growth_interval=growth)
    batches = BATCHES[:8]
    ref = train_unsplit(TINY, stage_config=cfg, batches=batches)
    run = train_threaded(TINY, cuts=[0, 3, 6], stage_config=cfg, batches=batches, replicas=2)
    assert [r.loss_scale for r in run.results[0][-1]] == ref.loss_scales
    assert (max(ref.loss_scales) > init_scale) if growth == 3 else (min(ref.loss_scales) < init_scale / 8)
    assert run.losses() == pytest.approx(ref.losses, rel=2e-3)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_an_fp16_job_end_to_end_with_tensorboard_and_the_loss_history(tmp_path):
    """atoll coordinator and two atoll node processes (--tensorboard) train an fp16 job: the losses match one
    process, every node writes TensorBoard events with the loss scale, and the coordinator's history, drawn by
    --plot, holds every step."""
    from dataclasses import replace
    from pathlib import Path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from atoll.coordinator.status import PLOT_POINTS, fetch_status, plot_history
    from atoll.launch.localcluster import LocalCluster
    from atoll.node.local import train_local

    steps = 12
    job = JobSpec.load(Path(__file__).resolve().parent.parent / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=steps, warmup=2, dtype="fp16", loss_scale=1024.0),
                  compression=replace(job.compression, mode="identity"),
                  cluster=replace(job.cluster, expected_nodes=2, min_nodes=2), outer=replace(job.outer, mode="sync"))
    path = tmp_path / "job.toml"
    path.write_text(job.to_toml())
    expected, _ = train_local(job)
    tb = tmp_path / "tb"
    with LocalCluster(job_path=path, out=tmp_path / "run", insecure=True) as cluster:
        cluster.start_coordinator(extra=["--island-threshold", "0.001"])
        for name in ("node1", "node2"):
            cluster.start_node(name, extra=["--tensorboard", str(tb)])
        cluster.wait_status(lambda s: len(cluster.losses()) >= steps, 200, f"{steps} steps")
        status = fetch_status(cluster.address, token=cluster.token, history_points=PLOT_POINTS)
    got = cluster.losses()
    for s in range(steps):
        assert got[s] == pytest.approx(expected[s], rel=1e-3), (s, got[s], expected[s])
    assert status.history_rows == steps and sum(p.count for p in status.history) == steps
    assert plot_history(status, tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    nodes = sorted(p for p in tb.iterdir() if p.is_dir())
    assert len(nodes) == 2
    for folder in nodes:
        acc = EventAccumulator(str(folder))
        acc.Reload()
        assert {e.value for e in acc.Scalars("precision/loss_scale")} == {1024.0}, folder
    losses = [EventAccumulator(str(f)) for f in nodes]
    for acc in losses:
        acc.Reload()
    # every replica of the last stage reports the loss (the history above holds one vote of theirs per step)
    last = {n for p in status.plan.pipelines for n in p.stages[-1].node_ids[::max(1, p.stages[-1].tp)]}
    assert {f.name for f, acc in zip(nodes, losses) if "loss/train" in acc.Tags()["scalars"]} == last
