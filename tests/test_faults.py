"""The test-only fault seam (`atoll.node.faults`, read from ATOLL_FAULT by a node process) and `bench.adversary`'s
arguments: what a scripted faulty node sends, and a bench that refuses what it cannot run before starting anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atoll.node.faults import Fault, parse_fault

REPO = Path(__file__).resolve().parent.parent


def test_a_fault_is_parsed_with_its_defaults_and_refused_with_the_kinds() -> None:
    assert parse_fault("") is None
    assert parse_fault("noise") == Fault("noise", 0.01, 0)
    assert parse_fault("nan:0.5@20") == Fault("nan", 0.5, 20)
    assert parse_fault("slow:5") == Fault("slow", 5.0, 0)
    for bad, match in [("flip", "one of bitflip, huge, nan, noise, poison, slow"),
                       ("nan:x", "KIND\\[:VALUE\\]\\[@STEP\\]"),
                       ("noise:-1", "positive")]:
        with pytest.raises(ValueError, match=match):
            parse_fault(bad)


def test_nothing_is_damaged_before_the_faults_step_or_by_a_slow_node() -> None:
    t = torch.randn(4, 8, 16)
    for fault in (Fault("nan", 1.0, 10), Fault("noise", 0.01, 10), Fault("slow", 5.0, 0)):
        assert torch.equal(fault.damage(9 if fault.kind != "slow" else 50, 0, t), t)


def test_a_poisoned_pseudo_gradient_is_scaled_or_nan_from_its_step_and_activations_are_untouched() -> None:
    assert parse_fault("poison@10") == Fault("poison", 1000.0, 10)
    deltas = {"w": torch.randn(8, 4), "b": torch.randn(4)}
    fault = Fault("poison", 1000.0, 10)
    assert fault.poison(9, deltas) is deltas
    scaled = fault.poison(10, deltas)
    assert all(torch.allclose(scaled[n], 1000.0 * deltas[n]) for n in deltas)
    assert all(bool(torch.isnan(t).all()) for t in parse_fault("poison:inf").poison(0, deltas).values())
    t = torch.randn(4, 8, 16)
    assert torch.equal(fault.damage(50, 0, t), t)  # what it sends down its pipeline is what it computed
    assert Fault("noise", 0.01, 0).poison(50, deltas) is deltas


def test_nan_and_huge_hit_one_micro_batch_on_about_the_asked_share_of_steps() -> None:
    t = torch.randn(4, 8, 16)
    nan, huge = Fault("nan", 0.25), Fault("huge", 0.25)
    hit = [s for s in range(400) if torch.isnan(nan.damage(s, 0, t)).all()]
    assert 60 <= len(hit) <= 140  # 100 expected
    assert all(torch.equal(nan.damage(s, 1, t), t) for s in hit)  # only micro-batch 0
    assert [s for s in range(400) if not torch.equal(huge.damage(s, 0, t), t)] == hit  # the same steps
    assert torch.allclose(huge.damage(hit[0], 0, t), t * 1e4)


def test_noise_is_one_percent_of_the_norm_and_bit_flips_come_at_their_rate() -> None:
    torch.manual_seed(0)
    t = torch.randn(8, 64, 64)
    noisy = Fault("noise", 0.01).damage(0, 0, t)
    assert 0.008 < float((noisy - t).norm() / t.norm()) < 0.012
    flipped = Fault("bitflip", 1e-3).damage(0, 0, t)
    changed = int((flipped.view(torch.int32) != t.view(torch.int32)).sum())
    assert 16 <= changed <= 50  # 32.8 expected of 32,768 elements
    assert torch.equal(t, t.clone())  # the input is left as it was (a new tensor is sent)


def test_the_adversary_bench_refuses_unknown_cases_and_a_fault_too_late_before_starting_anything() -> None:
    for argv, said in [(["--cases", "nan,teleport"], "unknown case(s) teleport"),
                       (["--steps", "30", "--fault-step", "25"], "leaves fewer than 10")]:
        done = subprocess.run([sys.executable, "-m", "bench.adversary", *argv], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2 and said in done.stderr, done.stderr[-500:]
    help_text = subprocess.run([sys.executable, "-m", "bench.adversary", "--help"], cwd=REPO, capture_output=True,
                               text=True, timeout=60).stdout
    assert "--quick" in help_text and "--cases" in help_text and "forged-end" in help_text


def test_a_stage_sends_the_damaged_activation_and_untouched_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seam: the damage is applied where a stage hands a tensor to its transport, and what `_send` returns (what
    the stage's verification keeps as sent) is the damaged tensor, so the door and the replicas' check see it."""
    from types import SimpleNamespace

    from atoll.node import stage as stage_module
    from atoll.node.transport import TensorKey

    sent = []
    fake = SimpleNamespace(config=SimpleNamespace(wire_dtype=torch.float32), tp=None,
                           transport=SimpleNamespace(send=lambda key, t: sent.append((key, t))))
    monkeypatch.setattr(stage_module, "injected", lambda: Fault("huge", 1.0, 5))
    t = torch.randn(2, 4, 8)
    early = stage_module.PipelineStage._send(fake, TensorKey(4, 0, "forward"), t)
    hit = stage_module.PipelineStage._send(fake, TensorKey(5, 0, "forward"), t)
    grad = stage_module.PipelineStage._send(fake, TensorKey(5, 0, "backward"), t)
    assert torch.equal(early, t) and torch.allclose(hit, t * 1e4) and torch.equal(grad, t)
    assert [torch.equal(s, r) for (_, s), r in zip(sent, (early, hit, grad))] == [True, True, True]
