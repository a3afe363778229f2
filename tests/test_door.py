"""Tensors checked at the door (`atoll.node.door`): a bad tensor from a neighbour, or a bad loss, makes the step
skip on every node with the sender named, instead of poisoning the step; honest tensors are never flagged."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch

from atoll.node.door import NON_FINITE, NORM, Door, DoorConfig, NormGauge, tensor_norm
from atoll.node.peer_link import PeerLink
from atoll.node.transport import TensorKey
from atoll.plan import PipelinePlan
from pipeline_harness import run_pinned_plan, stage, tiny_job


def corrupt_sends(monkeypatch, node: str, direction: str, when: dict[int, str]) -> None:
    """Make `node`'s links send `direction` tensors of step s replaced as `when[s]` says ("nan" or "huge")."""
    enqueue = PeerLink.enqueue

    def bad(self, key: TensorKey, tensor: torch.Tensor) -> None:
        how = when.get(key.step) if self.cfg.node_id == node and key.direction == direction else None
        if how == "nan":
            tensor = tensor.clone()
            tensor.view(-1)[::7] = float("nan")
        elif how == "huge":
            tensor = tensor * 1e4
        enqueue(self, key, tensor)

    monkeypatch.setattr(PeerLink, "enqueue", bad)


def two_stages(job) -> list[PipelinePlan]:
    n = job.model.n_layers + 2
    return [PipelinePlan(micro_batch=job.train.micro_batch, num_micro_batches=job.train.num_micro_batches,
                         stages=[stage((0, n // 2), ["a"]), stage((n // 2, n), ["b"])])]


@pytest.mark.parametrize("direction, sender, receiver", [("forward", "a", "b"), ("backward", "b", "a")])
def test_nan_and_huge_tensors_skip_the_step_on_every_node_and_name_the_sender(tmp_path, monkeypatch, direction,
                                                                               sender, receiver):
    job = tiny_job(steps=10, grad_clip=1.0)
    corrupt_sends(monkeypatch, sender, direction, {2: "nan", 8: "huge"})
    run = run_pinned_plan(job, two_stages(job), tmp_path / "ckpt", timeout=timedelta(seconds=60))
    by = {(m.node_id, m.step): m for m in run.reports}
    for step in range(10):
        bad = step in (2, 8)
        assert by[("a", step)].skipped == bad and by[("b", step)].skipped == bad, step
    named = [o for m in run.reports for o in m.offences]
    assert {(o.step, o.sender, o.kind) for o in named} == {(2, sender, NON_FINITE), (8, sender, NORM)}
    assert all(m.node_id == receiver for m in run.reports if m.offences)
    # the poisoned steps never reached the weights: every later loss is finite and the run kept learning
    losses = run.losses
    assert all(math.isfinite(losses[s]) for s in range(10) if s not in (2, 8)), losses
    assert losses[9] < losses[0]


def test_a_non_finite_local_loss_skips_the_step_everywhere(tmp_path, monkeypatch):
    from atoll.node import stage as stage_mod

    lm_loss = stage_mod.lm_loss
    calls = {"n": 0}

    def loss_nan_at_step_3(out, tgt):
        calls["n"] += 1
        loss = lm_loss(out, tgt)
        # 4 micro-batches a step: the 13th call is step 3's first micro-batch
        return loss * float("nan") if calls["n"] == 13 else loss

    monkeypatch.setattr(stage_mod, "lm_loss", loss_nan_at_step_3)
    job = tiny_job(steps=6)
    run = run_pinned_plan(job, two_stages(job), tmp_path / "ckpt", timeout=timedelta(seconds=60))
    skipped = sorted({(m.node_id, m.step) for m in run.reports if m.skipped})
    assert skipped == [("a", 3), ("b", 3)]
    loss_offences = [o for m in run.reports for o in m.offences]
    assert [(o.sender, o.kind, o.finite) for o in loss_offences] == [("b", "loss", False)]
    assert 3 not in run.losses  # a non-finite loss is not reported
    assert all(math.isfinite(v) for v in run.losses.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_rejected_tensor_skips_in_every_precision_and_fp32_bf16_keep_no_loss_scale(precision):
    from atoll.models import preset
    from atoll.node.inprocess import InProcessLinks
    from atoll.node.model import build_slice
    from atoll.node.norm_exchange import InProcessNormGroup
    from atoll.node.stage import PipelineStage, StageConfig
    from atoll.node.precision import LossScaleConfig
    from atoll.node.synthetic import synthetic_batch
    import threading

    model = preset("tiny")
    cfg = StageConfig(micro_batches=2, max_grad_norm=None, bf16_autocast=precision == "bf16",
                      fp16_loss_scale=LossScaleConfig() if precision == "fp16" else None)
    links, group = InProcessLinks(2), InProcessNormGroup(2)
    doors = [Door("a"), Door("b")]
    stages = [PipelineStage(build_slice(model, a, b, seed=0), stage=i, num_stages=2, transport=links.transport(i),
                            config=cfg, norm_exchange=group.member(i), door=doors[i])
              for i, (a, b) in enumerate([(0, 3), (3, 6)])]
    batch = synthetic_batch(vocab_size=model.vocab_size, batch=4, seq_len=16, seed=0, step=0)
    results: dict[int, list] = {0: [], 1: []}

    def run(i: int) -> None:
        for step in range(3):
            if i == 1 and step == 1:  # stage 1's door rejects one activation of step 1 as if it were NaN
                doors[1].admit(TensorKey(1, 0, "forward"), "a", torch.full((2,), float("nan")))
            results[i].append(stages[i].train_step(step, batch))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r.skipped for r in results[0]] == [False, True, False]
    assert [r.skipped for r in results[1]] == [False, True, False]
    assert [len(r.offences) for r in results[1]] == [0, 1, 0]
    if precision != "fp16":
        assert all(r.loss_scale is None for r in results[0] + results[1])
    for s in stages:
        assert all(torch.isfinite(p).all() for p in s.module.parameters())


def test_the_running_band_accepts_drift_and_flags_far_norms():
    cfg = DoorConfig()
    g = NormGauge()
    for i in range(100):  # a norm that halves over 100 tensors, with 5% noise
        value = math.log(10.0 * 0.5 ** (i / 100) * (1.05 if i % 2 else 0.95))
        assert not g.outside(value, cfg, cfg.warmup)
        g.add(value, cfg)
    assert g.outside(math.log(5.0 * 25), cfg, cfg.warmup)
    assert g.outside(math.log(5.0 / 25), cfg, cfg.warmup)
    assert not g.outside(math.log(5.0 * 3), cfg, cfg.warmup)


def test_a_rejected_tensor_is_replaced_by_the_links_last_good_one():
    door = Door("b")
    good = torch.ones(4, 3)
    assert door.admit(TensorKey(0, 0, "forward"), "a", good) is good
    out = door.admit(TensorKey(0, 1, "forward"), "a", torch.full((4, 3), float("inf")))
    assert torch.equal(out, good) and out is not good
    first = door.admit(TensorKey(0, 0, "backward"), "c", torch.full((2,), float("nan")))
    assert torch.equal(first, torch.zeros(2))
    assert [o.sender for o in door.take(0)] == ["a", "c"] and door.take(0) == []
    assert math.isnan(tensor_norm(torch.tensor([1.0, float("nan")])))
    assert math.isinf(tensor_norm(torch.tensor([1e20, 1.0])))  # its square overflows fp32: as bad as inf


def test_a_clean_run_and_an_honest_slow_neighbour_have_no_offences(tmp_path, monkeypatch):
    # a few hundred steps of the tiny job through a lossy codec: the running band flags none of its tensors, and a
    # node five times slower than its neighbour is judged by what it sends, never by when
    job = tiny_job(steps=200, mode="int8")
    run = run_pinned_plan(job, two_stages(job), tmp_path / "clean", timeout=timedelta(seconds=60), join=600)
    assert len({m.step for m in run.reports}) == 200
    assert [o for m in run.reports for o in m.offences] == [] and not any(m.skipped for m in run.reports)

    import time as _time

    enqueue = PeerLink.enqueue

    def slow(self, key, tensor):
        if self.cfg.node_id == "a":
            _time.sleep(0.05)  # several times the tiny stage's compute per micro-batch
        enqueue(self, key, tensor)

    monkeypatch.setattr(PeerLink, "enqueue", slow)
    job = tiny_job(steps=30, mode="int8")
    run = run_pinned_plan(job, two_stages(job), tmp_path / "slow", timeout=timedelta(seconds=60), join=300)
    assert [o for m in run.reports for o in m.offences] == [] and not any(m.skipped for m in run.reports)
    waited = [m.wait_seconds for m in run.reports if m.node_id == "b"]
    computed = [m.compute_seconds for m in run.reports if m.node_id == "b"]
    assert sum(waited) > sum(computed)  # b spent its steps waiting on the slow node
