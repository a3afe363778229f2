"""A stage's work verified by sampling (`atoll.node.verify`): a replica that perturbs what it sends (1% noise), whose
layer's sign is flipped or whose weights are stale is named at every check of it, the step skipped; an honest run
of a few hundred micro-batches names no one; the sampling and the tolerances."""

from __future__ import annotations

import threading

import pytest
import torch

from atoll.node.stage import PipelineStage
from atoll.node.verify import VERIFY, sample, tolerance
from atoll.plan import PipelinePlan
from atoll.types import TensorOffence

from pipeline_harness import run_pinned_plan, stage, tiny_job


def test_the_sample_is_the_same_everywhere_about_one_step_in_every_and_covers_every_replica_and_micro_batch():
    picks = [sample(0, s, every=4, replicas=2, micro_batches=3) for s in range(4000)]
    assert picks == [sample(0, s, every=4, replicas=2, micro_batches=3) for s in range(4000)]
    chosen = [p for p in picks if p is not None]
    assert 800 < len(chosen) < 1200
    assert {(p.replica, p.micro_batch) for p in chosen} == {(r, m) for r in range(2) for m in range(3)}
    assert [sample(1, s, every=4, replicas=2, micro_batches=3) for s in range(200)] != picks[:200]  # keyed
    assert sample(0, 0, every=4, replicas=1, micro_batches=3) is None


def test_the_tolerance_sits_between_rounding_and_one_percent_in_every_precision():
    y = torch.randn(4, 16, 64)
    norm = float(y.norm())
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        bound = tolerance(dtype, norm, y.numel())
        rounded = float((y.to(dtype).float() - y).norm())  # one rounding of the output
        assert 2 * rounded <= bound < 0.01 * norm, (dtype, rounded, bound, norm)
    assert tolerance(torch.float32, 0.0, 10) > 0


def _run(tmp_path, monkeypatch, steps: int, perturb=None):
    """Two stages of two replicas each, every step checked; `perturb(self, step)` runs on node b's thread before
    each of its steps. The verification offences reported, as (reporter, sender, step)."""
    if perturb is not None:
        train_step = PipelineStage.train_step

        def seam(self, step, batch):
            if threading.current_thread().name == "node-b":
                perturb(self, step)
            return train_step(self, step, batch)

        monkeypatch.setattr(PipelineStage, "train_step", seam)
    job = tiny_job(steps, global_batch=8, seq_len=16)
    result = run_pinned_plan(job, [PipelinePlan(micro_batch=4, num_micro_batches=2, stages=[
        stage((0, 3), ["a", "b"]), stage((3, 6), ["c", "d"])])], tmp_path, verify_every=1)
    found = [(m.node_id, o.sender, o.step) for m in result.reports for o in m.offences if o.kind == VERIFY]
    return result, found


def test_an_honest_run_of_hundreds_of_micro_batches_has_no_detection(tmp_path, monkeypatch):
    result, found = _run(tmp_path, monkeypatch, 40)  # 40 steps x 2 micro-batches x 4 replicas, every step checked
    assert found == []
    assert not any(m.skipped for m in result.reports)
    assert {m.step for m in result.reports} == set(range(40))


def _noise(self, step):
    if getattr(self, "_noisy", False):
        return
    self._noisy = True
    send = self._send

    def noisy(key, t):
        if key.direction == "forward":
            t = t + torch.randn_like(t) * (0.01 * float(t.norm()) / t.numel() ** 0.5)  # 1% of its norm
        return send(key, t)

    self._send = noisy


def _sign_flip(self, step):
    if step == 0:
        with torch.no_grad():
            w = next(p for n, p in self.module.named_parameters() if n == "layers.1.fc.weight")
            w.neg_()


def _stale(self, step):
    if step == 0:
        self.optimizer.step = lambda *a, **k: None  # its weights stay those of step 0


@pytest.mark.parametrize("perturb", [_noise, _sign_flip, _stale], ids=["noise-1pct", "sign-flip", "stale"])
def test_a_replica_that_perturbs_its_outputs_is_named_at_every_check_of_it(tmp_path, monkeypatch, perturb):
    steps = 12
    result, found = _run(tmp_path, monkeypatch, steps, perturb)
    checked_b = [s for s in range(steps) if sample(0, s, every=1, replicas=2, micro_batches=2).replica == 1]
    # stale weights equal the others' until the first update (step 0 is checked against the same weights)
    want = [s for s in checked_b if perturb is not _stale or s > 0]
    named = sorted(s for reporter, sender, s in found if sender == "b")
    assert named == want and want, (found, checked_b)
    assert all(reporter == "a" for reporter, sender, _ in found if sender == "b")
    assert not any(sender in ("c", "d") for _, sender, _ in found)  # the honest stage is never named
    skipped = {m.step for m in result.reports if m.skipped}
    assert set(want) <= skipped


def test_the_coordinator_takes_a_verification_offence_only_against_another_replica_of_the_stage():
    from atoll.coordinator.quarantine import offence_refusal
    from atoll.plan import Plan

    plan = Plan(model="tiny", global_batch=8, seq_len=16, epoch=3, job_id="j", pipelines=[
        PipelinePlan(micro_batch=4, num_micro_batches=2, stages=[stage((0, 3), ["a", "b"]), stage((3, 6), ["c"])])])

    def o(sender: str) -> TensorOffence:
        return TensorOffence(sender=sender, kind=VERIFY, direction="forward", step=5)

    assert offence_refusal(plan, "a", 0, 0, o("b")) == ""
    assert "no other replica" in offence_refusal(plan, "a", 0, 0, o("a"))
    assert "no other replica" in offence_refusal(plan, "a", 0, 0, o("c"))
    assert "no other replica" in offence_refusal(plan, "c", 0, 1, o("a"))
