"""A pipeline trains exactly like the unsplit model: same per-step losses, same final parameters."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from atoll.models import preset
from atoll.node.data import Batch
from atoll.node.inprocess import InProcessLinks, ThreadedRun, even_cuts, train_threaded
from atoll.node.model import build_slice
from atoll.node.norm_exchange import InProcessNormGroup
from atoll.node.reference import ReferenceRun, train_unsplit
from atoll.node.stage import PipelineStage, StageConfig
from atoll.node.synthetic import synthetic_batch
from atoll.node.transport import TransportError

TINY = preset("tiny")
STEPS = 20
CONFIG = StageConfig(micro_batches=4, lr=3e-3, max_grad_norm=0.5, weight_decay=0.01)
BATCHES = [synthetic_batch(vocab_size=TINY.vocab_size, batch=8, seq_len=TINY.seq_len, seed=7, step=i)
           for i in range(STEPS)]


@pytest.fixture(scope="module")
def reference() -> ReferenceRun:
    ref = train_unsplit(TINY, stage_config=CONFIG, batches=BATCHES)
    assert ref.losses[-1] < ref.losses[0] - 0.3, "the reference should learn the synthetic data"
    assert min(ref.grad_norms) > CONFIG.max_grad_norm, "clipping should be active in every step"  # type: ignore[operator]
    return ref


def assert_same_training(run: ThreadedRun, ref: ReferenceRun) -> None:
    losses = run.losses()
    assert len(losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, ref.losses)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: pipeline loss {got} vs unsplit {want}"
    want_state = ref.module.state_dict()
    for replica in run.stages:
        got_state: dict[str, torch.Tensor] = {}
        for stage in replica:
            got_state.update(stage.module.state_dict())
        assert got_state.keys() == want_state.keys()
        for name, want in want_state.items():
            torch.testing.assert_close(got_state[name], want, rtol=1e-4, atol=5e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_1f1b_pipeline_matches_the_unsplit_model(reference, num_stages):
    run = train_threaded(TINY, cuts=even_cuts(TINY.n_layers + 2, num_stages), stage_config=CONFIG, batches=BATCHES)
    assert_same_training(run, reference)
    for stage_results in run.results[0]:
        r = stage_results[-1]
        assert r.grad_norm == pytest.approx(reference.grad_norms[-1], rel=1e-4)
        assert r.compute_seconds > 0 and r.pipeline_seconds >= r.compute_seconds
        assert len(r.timeline) == 2 * CONFIG.micro_batches
    assert [r.loss is None for r in (s[0] for s in run.results[0])] == [True] * (num_stages - 1) + [False]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_data_parallel_pipeline_matches_one_process_with_the_full_batch(reference, num_stages):
    run = train_threaded(TINY, cuts=even_cuts(TINY.n_layers + 2, num_stages), stage_config=CONFIG, batches=BATCHES,
                         replicas=2)
    assert_same_training(run, reference)
    # the replicas of a stage end bit-identical
    for s in range(num_stages):
        a, b = run.stages[0][s].module.state_dict(), run.stages[1][s].module.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(60)
def test_gpipe_matches_the_unsplit_model(reference):
    run = train_threaded(TINY, cuts=[0, 2, 4, 6], stage_config=StageConfig(**{**CONFIG.__dict__, "schedule": "gpipe"}),
                         batches=BATCHES)
    assert_same_training(run, reference)


@pytest.mark.timeout(60)
def test_without_clipping_pipeline_still_matches():
    cfg = StageConfig(micro_batches=2, lr=1e-3, max_grad_norm=None)
    batches = BATCHES[:5]
    ref = train_unsplit(TINY, stage_config=cfg, batches=batches)
    run = train_threaded(TINY, cuts=[0, 3, 6], stage_config=cfg, batches=batches)
    assert run.losses() == pytest.approx(ref.losses, rel=1e-5)
    assert run.results[0][0][0].grad_norm is None


@pytest.mark.timeout(60)
def test_bf16_autocast_trains_close_to_fp32():
    cfg = StageConfig(micro_batches=4, lr=3e-3, max_grad_norm=0.5, bf16_autocast=True)
    batches = BATCHES[:8]
    ref32 = train_unsplit(TINY, stage_config=CONFIG, batches=batches)
    run = train_threaded(TINY, cuts=[0, 3, 6], stage_config=cfg, batches=batches)
    losses = run.losses()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses != pytest.approx(ref32.losses, rel=1e-6), "autocast should change the arithmetic"
    assert losses == pytest.approx(ref32.losses, rel=2e-2)


@pytest.mark.timeout(60)
def test_memory_tracking_counts_more_in_flight_on_earlier_stages():
    cfg = StageConfig(micro_batches=4, max_grad_norm=1.0, track_memory=True)
    run = train_threaded(TINY, cuts=[0, 2, 4, 6], stage_config=cfg, batches=BATCHES[:1])
    peaks = [res[0].peak_activation_bytes for res in run.results[0]]
    assert all(p > 0 for p in peaks)
    # the middle stage (two blocks) holds 2 micro-batches in flight under 1F1B and all 4 under GPipe
    gpipe = train_threaded(TINY, cuts=[0, 2, 4, 6], stage_config=StageConfig(**{**cfg.__dict__, "schedule": "gpipe"}),
                           batches=BATCHES[:1])
    gpeaks = [res[0].peak_activation_bytes for res in gpipe.results[0]]
    assert gpeaks[1] == pytest.approx(peaks[1] * 4 / 2, rel=0.05)  # 4 in flight vs 2


def test_stage_needs_its_data_and_a_norm_exchange():
    links = InProcessLinks(2)
    first = PipelineStage(build_slice(TINY, 0, 3), stage=0, num_stages=2, transport=links.transport(0),
                          config=CONFIG, norm_exchange=InProcessNormGroup(2).member(0))
    with pytest.raises(ValueError, match="needs batch.inputs"):
        first.train_step(0, None)
    with pytest.raises(ValueError, match="divisible by the 4 micro-batches this replica trains"):
        first.train_step(0, Batch(torch.zeros(3, 8, dtype=torch.int64), torch.zeros(3, 8, dtype=torch.int64)))
    with pytest.raises(ValueError, match="needs a norm_exchange"):
        PipelineStage(build_slice(TINY, 3, 6), stage=1, num_stages=2, transport=links.transport(1), config=CONFIG)
    with pytest.raises(ValueError, match="must start at layer 0"):
        PipelineStage(build_slice(TINY, 3, 6), stage=0, num_stages=2, transport=links.transport(0), config=CONFIG,
                      norm_exchange=InProcessNormGroup(2).member(0))


@pytest.mark.timeout(30)
def test_a_missing_neighbour_fails_the_step_within_the_receive_timeout():
    cfg = StageConfig(micro_batches=2, recv_timeout=timedelta(milliseconds=200))
    links = InProcessLinks(2)
    last = PipelineStage.create(TINY, start=3, end=6, stage=1, num_stages=2, transport=links.transport(1), config=cfg,
                                norm_exchange=InProcessNormGroup(2).member(1))
    with pytest.raises(TransportError, match="did not arrive"):
        last.train_step(0, BATCHES[0])


def test_stage_config_validation():
    with pytest.raises(ValueError, match="micro_batches"):
        StageConfig(micro_batches=0)
    with pytest.raises(ValueError, match="schedule"):
        StageConfig(schedule="interleaved")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_grad_norm"):
        StageConfig(max_grad_norm=0.0)
    with pytest.raises(ValueError, match="recv_timeout"):
        StageConfig(recv_timeout=timedelta(0))
