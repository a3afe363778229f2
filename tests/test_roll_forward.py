"""A step whose norm exchange completed on some nodes and failed on others is finished, not rolled back: the
pending holder's gradients and the completer's total give the state after the step, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from atoll.models import preset
from atoll.node.inprocess import InProcessLinks
from atoll.node.live_state import Holder, ResumePoint, finishable, resume_point, slice_part, sources
from atoll.node.model import build_slice
from atoll.node.norm_exchange import LocalNormExchange, NormExchange, NormExchangeError
from atoll.node.precision import LossScaleConfig
from atoll.node.roll_forward import finish, finished_scale, pending_grads
from atoll.node.slice_state import load_slice, slice_state
from atoll.node.stage import PipelineStage, StageConfig, build_optimizer
from atoll.node.state_transfer import LiveState, StateHolder, deserialize_state
from atoll.node.synthetic import synthetic_batch

TINY = preset("tiny")
TOTAL = TINY.n_layers + 2
CONFIG = StageConfig(micro_batches=2, lr=3e-3, max_grad_norm=0.05)  # small: every step clips
BATCHES = [synthetic_batch(vocab_size=TINY.vocab_size, batch=8, seq_len=TINY.seq_len, seed=7, step=i)
           for i in range(5)]


class FailsAt(NormExchange):
    """The exchange of a stage whose peer died mid-exchange at step `at` (sums its own value otherwise)."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def all_sum(self, value, timeout):
        self.calls += 1
        if self.calls - 1 == self.at:
            raise NormExchangeError("norm exchange all-reduce failed: Connection closed by peer")
        return float(value)


def _stage(exchange: NormExchange) -> PipelineStage:
    return PipelineStage(build_slice(TINY, 0, TOTAL, seed=0), stage=0, num_stages=1,
                         transport=InProcessLinks(1).transport(0), config=CONFIG, norm_exchange=exchange)


@pytest.mark.timeout(60)
def test_a_pending_step_finished_with_the_completers_total_equals_the_step_taken() -> None:
    done, failed = _stage(LocalNormExchange()), _stage(FailsAt(3))
    for step in range(3):
        done.train_step(step, BATCHES[step])
        failed.train_step(step, BATCHES[step])
    taken = done.train_step(3, BATCHES[3])
    with pytest.raises(NormExchangeError):
        failed.train_step(3, BATCHES[3])
    assert done.exchanged[0] == 3 and done.unexchanged is None and failed.unexchanged == 3
    # the failed step was computed: its loss is kept for whoever finishes the step to report
    assert failed.unexchanged_loss == pytest.approx(taken.loss) and done.unexchanged_loss is None
    assert pending_grads(failed.module, failed.unexchanged, 4) is None  # only the failed step's own gradients
    grads = pending_grads(failed.module, failed.unexchanged, 3)
    pending = {**slice_state(failed.module, failed.optimizer, extra={"step": 3}), "grads": grads}
    live = LiveState.of(pending, step=3, epoch=1, pending_loss=(failed.unexchanged_loss, 1.0))
    assert live.pending and not LiveState.of(slice_state(done.module, done.optimizer), step=4, epoch=1).pending
    assert live.pending_loss[0] == pytest.approx(taken.loss)
    pending = deserialize_state(live.data, "b1")  # as fetched
    after = slice_state(done.module, done.optimizer, extra={"step": 4})
    # a new cut [2, TOTAL): layer 2 from a node that completed the step, the rest from the pending holder
    module = build_slice(TINY, 2, TOTAL, seed=5)
    optimizer = build_optimizer(module, CONFIG)
    parts = [slice_part(after, (2, 3)), slice_part(pending, (3, TOTAL))]
    load_slice(module, parts, optimizer)
    assert not finish(module, optimizer, [(parts[1], done.exchanged[1])], lr=CONFIG.lr,
                      max_grad_norm=CONFIG.max_grad_norm, loss_scale=None)
    want = dict(done.module.named_parameters())
    for name, p in module.named_parameters():
        assert torch.equal(p, want[name]), name
        assert p.grad is None
        for key, value in optimizer.state[p].items():
            assert torch.equal(value, done.optimizer.state[want[name]][key]), (name, key)
    with pytest.raises(ValueError, match="different norm exchange totals"):
        finish(module, optimizer, [(parts[1], 1.0), (parts[1], 2.0)], lr=CONFIG.lr, max_grad_norm=None,
               loss_scale=None)


def test_an_overflowed_pending_step_is_skipped_and_backs_the_scale_off() -> None:
    module = build_slice(TINY, 0, 2, seed=0)
    optimizer = build_optimizer(module, CONFIG)
    state = slice_state(module, optimizer)
    state["grads"] = {n: torch.ones_like(p) for n, p in module.named_parameters()}
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    cfg = LossScaleConfig(init_scale=1024.0, growth_interval=2)
    assert finish(module, optimizer, [(state, math.inf)], lr=1.0, max_grad_norm=1.0, loss_scale=cfg)
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())
    assert finished_scale({"scale": 1024.0, "good_steps": 1}, cfg, True) == {"scale": 512.0, "good_steps": 0}
    assert finished_scale({"scale": 1024.0, "good_steps": 1}, cfg, False) == {"scale": 2048.0, "good_steps": 0}
    assert finished_scale(None, None, False) is None


def _h(node: str, step: int, a: int, b: int, **kw) -> Holder:
    return Holder(node_id=node, address=f"{node}:1", step=step, layers=(a, b), epoch=kw.pop("epoch", 1), **kw)


def test_the_resume_point_finishes_a_pending_holder_with_the_total_of_the_step_after_it() -> None:
    # b1's exchange of step 12 failed; a completed it (total 2.5) and stepped to 13
    held = [_h("a", 13, 0, 3, norm_total=2.5), _h("b1", 12, 3, 6, pending=True, norm_total=1.5)]
    assert [(h.node_id, h.finish, h.reaches) for h in finishable(held)] == [("b1", 2.5, 13)]
    p = resume_point(held, total_layers=6, checkpoint_step=0)
    assert (p.step, p.live, p.rolled_back) == (13, True, 0)
    assert [(h.node_id, h.step, h.finish) for h in p.holders] == [("a", 13, None), ("b1", 12, 2.5)]
    assert ResumePoint.from_json(p.to_json()) == p
    assert [(h.node_id, rng) for h, rng in sources(p, (2, 6), "b1", "")] == [("a", (2, 3)), ("b1", (3, 6))]
    # no total known (a left), or a total of another run: the pending state counts at its own step only
    for other in ([_h("a", 13, 0, 3)], [_h("a", 13, 0, 3, norm_total=2.5, epoch=2)]):
        p = resume_point([*other, held[1]], total_layers=6, checkpoint_step=0)
        assert (p.step, p.live, p.rolled_back) == (0, False, 13)
        assert "b1 layers [3, 6) at step 12 with the gradients of its failed step" in p.reason
    # every node failed the exchange: all resume at 12, nothing to finish
    both = [_h("a", 12, 0, 3, pending=True), _h("b1", 12, 3, 6, pending=True)]
    p = resume_point(both, total_layers=6, checkpoint_step=0)
    assert (p.step, p.live) == (12, True) and all(h.finish is None for h in p.holders)


def test_a_whole_job_restart_counts_what_it_rolls_back_from_the_reported_steps() -> None:
    """Every node restarted: no live holder reaches as far as the reports did (309 steps trained, the checkpoint of
    300), so the rollback counts from the plan's reached step, not from the checkpoint (it said 0 before)."""
    p = resume_point([], total_layers=6, checkpoint_step=300, reached=309)
    assert (p.step, p.live, p.rolled_back) == (300, False, 9)
    # live holders at the reported step: nothing rolled back; nothing held, nothing trained: a fresh start
    p = resume_point([_h("a", 309, 0, 3), _h("b", 309, 3, 6)], total_layers=6, checkpoint_step=300, reached=309)
    assert (p.step, p.live, p.rolled_back) == (309, True, 0)
    p = resume_point([], total_layers=6, checkpoint_step=0, reached=0)
    assert (p.step, p.rolled_back) == (0, 0) and "fresh start" in p.reason
    p = resume_point([], total_layers=6, checkpoint_step=0, reached=12)  # no checkpoint yet: back to step 0
    assert (p.step, p.rolled_back) == (0, 12) and "checkpoint of step 0" in p.reason


def test_held_state_says_the_state_is_pending_and_carries_the_last_total() -> None:
    module = build_slice(TINY, 3, 6, seed=0)
    state = {**slice_state(module), "grads": {}}
    holder = StateHolder(node_id="b1")
    holder.end_run(1, LiveState.of(state, step=12, epoch=1, norm_total=1.5))
    reply = holder.held(2, wait=0.0)
    assert (reply.step, reply.pending, reply.has_norm_total, reply.norm_total) == (12, True, True, 1.5)
    holder.end_run(2, LiveState.of(slice_state(module), step=13, epoch=2))
    reply = holder.held(3, wait=0.0)
    assert (reply.step, reply.pending, reply.has_norm_total) == (13, False, False)


def test_the_finished_steps_loss_adds_every_last_stage_replicas_share() -> None:
    """Two replicas of the last stage each held half the batch and a share of its loss; the loss is reported only
    when every share is there."""
    from atoll.node.live_state import Holder, ResumePoint, finished_loss

    def holder(node: str, layers: tuple[int, int], share: tuple[float, float] | None, finish: float | None = 2.0,
               step: int = 3) -> Holder:
        return Holder(node_id=node, address="", step=step, layers=layers, pending=share is not None, finish=finish,
                      pending_loss=share)

    first = holder("a", (0, 3), None, finish=None, step=4)
    both = ResumePoint(step=4, live=True, reason="", holders=(
        first, holder("b1", (3, TOTAL), (0.5 * 2.0, 0.5)), holder("b2", (3, TOTAL), (0.5 * 3.0, 0.5))))
    assert finished_loss(both, TOTAL) == pytest.approx(2.5)
    assert finished_loss(ResumePoint.from_json(both.to_json()), TOTAL) == pytest.approx(2.5)  # as agreed
    one = ResumePoint(step=4, live=True, reason="", holders=(first, holder("b1", (3, TOTAL), (1.0, 0.5))))
    assert finished_loss(one, TOTAL) is None  # the other half of the batch's loss is lost with its node
    alone = ResumePoint(step=4, live=True, reason="", holders=(first, holder("b", (3, TOTAL), (2.25, 1.0))))
    assert finished_loss(alone, TOTAL) == pytest.approx(2.25)


def test_a_zero_stages_gathered_state_carries_the_total_that_finishes_another_stages_failed_step() -> None:
    """A ZeRO stage that completed the norm exchange of step 11 and stepped to 12 hands over its gathered state
    with that exchange's total, so the holder of another stage whose exchange of step 11 failed is finished to
    step 12 instead of the job going back to its checkpoint."""
    from types import SimpleNamespace

    from atoll.node.runner import PlanRunner

    module = build_slice(TINY, 3, 6, seed=0)
    optimizer = build_optimizer(module, CONFIG)
    states = {p: {"step": torch.tensor(12.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
              for p in module.parameters()}
    runner = SimpleNamespace(plan=SimpleNamespace(mode="sync", epoch=1), placement=SimpleNamespace(tp=1),
                             scaler=None)
    stage = SimpleNamespace(exchanged=(11, 2.5), unexchanged=None, unexchanged_loss=None)
    live = PlanRunner._snapshot(runner, module, optimizer, 12, stage, states)
    holder = StateHolder(node_id="b1")
    holder.end_run(1, live)
    reply = holder.held(2, wait=0.0)
    assert (reply.step, reply.pending, reply.has_norm_total, reply.norm_total) == (12, False, True, 2.5)
    held = [_h("a", 11, 0, 3, pending=True), _h("b1", 12, 3, 6, norm_total=reply.norm_total)]
    p = resume_point(held, total_layers=6, checkpoint_step=0)
    assert (p.step, p.live, p.rolled_back) == (12, True, 0)
    # an exchange older than its last step (it stopped before the exchange of step 12 completed): no total
    stage.exchanged = (10, 2.5)
    assert PlanRunner._snapshot(runner, module, optimizer, 12, stage, states).norm_total is None
