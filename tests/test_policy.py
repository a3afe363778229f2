"""The link policy under scripted bandwidth sequences: adapts within a few decisions, does not flap."""

from __future__ import annotations

import math
import random

import pytest
import torch

from atoll.compression import CodecSpec, LinkPolicy, PolicyConfig, predict_transfer_seconds
from atoll.compression.policy import ROLES

GBIT = 1e9 / 8
MBIT = 1e6 / 8
RAW = 32 << 20          # a 32 MiB float32 activation
OVERLAP = 1.5           # seconds of compute the transfer hides under
LATENCY = 0.02


def _step(policy: LinkPolicy, bandwidth: float, role: str = "activation", overlap: float = OVERLAP):
    """One micro-batch: decide, then 'send' at the scripted bandwidth and report the transfer."""
    d = policy.choose(RAW, role, overlap)
    wire = predict_transfer_seconds(RAW, d.spec, 1.0)  # at 1 byte/s: the payload bytes of the choice
    policy.observe(int(wire), wire / bandwidth + LATENCY)
    return d


def _rank(spec: CodecSpec, config: PolicyConfig) -> int:
    return config.candidates.index(spec)


def test_prediction_uses_the_codec_ratio_and_latency() -> None:
    assert predict_transfer_seconds(1000, CodecSpec("identity"), 1000.0, 0.5) == pytest.approx(1.5)
    assert predict_transfer_seconds(1 << 20, CodecSpec("fp16"), 1.0) == pytest.approx(1 << 19)
    assert predict_transfer_seconds(1 << 20, CodecSpec("fp16"), 1.0, dtype=torch.bfloat16) == pytest.approx(1 << 20)
    int8 = predict_transfer_seconds(1 << 20, CodecSpec("int8"), 1.0)
    assert (1 << 20) / int8 == pytest.approx(4 * 64 / 66)
    with pytest.raises(ValueError, match="bandwidth must be"):
        predict_transfer_seconds(1, CodecSpec("fp16"), 0.0)


def test_fast_link_sends_uncompressed() -> None:
    p = LinkPolicy(PolicyConfig(), GBIT, LATENCY)
    d = p.choose(RAW, "activation", OVERLAP)
    assert d.spec == CodecSpec("identity") and "fits" in d.reason
    assert d.predicted_seconds == pytest.approx(LATENCY + RAW / GBIT)


def test_drop_to_50mbit_moves_to_a_stronger_codec_within_3_decisions_and_recovers() -> None:
    config = PolicyConfig()
    p = LinkPolicy(config, GBIT, LATENCY)
    for _ in range(5):
        assert _step(p, GBIT).spec == CodecSpec("identity")
    after_drop = [_step(p, 50 * MBIT) for _ in range(8)]
    assert any(_rank(d.spec, config) > 0 for d in after_drop[:3]), [d.reason for d in after_drop[:3]]
    # settles on int8, the least lossy that fits (1.38 s < 1.5 s); activations never go beyond their budget
    assert after_drop[-1].spec == CodecSpec("int8")
    assert all(d.spec in config.allowed("activation") for d in after_drop)
    recovered = [_step(p, GBIT) for _ in range(8)]
    assert any(d.spec == CodecSpec("identity") for d in recovered[:3])
    assert recovered[-1].spec == CodecSpec("identity")


@pytest.mark.parametrize("bandwidth", [GBIT, 50 * MBIT])
def test_jitter_of_ten_percent_changes_nothing(bandwidth: float) -> None:
    p = LinkPolicy(PolicyConfig(), bandwidth, LATENCY)
    rng = random.Random(0)
    first = p.choose(RAW, "activation", OVERLAP).spec
    specs = {_step(p, bandwidth * rng.uniform(0.9, 1.1)).spec for _ in range(200)}
    assert specs == {first}


def _boundary_bandwidth() -> float:
    """The bandwidth at which int8 exactly fills the overlap."""
    return (RAW * 66 / 256) / (OVERLAP - LATENCY)


def test_hysteresis_is_what_keeps_a_boundary_link_steady() -> None:
    bw = _boundary_bandwidth()
    rng = random.Random(1)
    jitter = [bw * rng.uniform(0.9, 1.1) for _ in range(100)]
    counts = {}
    for h in (0.0, 0.2):
        p = LinkPolicy(PolicyConfig(hysteresis=h, ema_weight=1.0), bw, LATENCY)
        changes, last = 0, None
        for b in jitter:
            spec = _step(p, b, role="activation_grad").spec
            changes += last is not None and spec != last
            last = spec
        counts[h] = changes
    assert counts[0.0] > 5      # without a margin it flaps between int8 and int4
    assert counts[0.2] == 0


def test_when_nothing_fits_the_fastest_within_budget_wins() -> None:
    p = LinkPolicy(PolicyConfig(), 10 * MBIT, LATENCY)
    act = p.choose(RAW, "activation", 0.1)
    assert act.spec == CodecSpec("int8") and "nothing" in act.reason
    grad = p.choose(RAW, "activation_grad", 0.1)
    assert grad.spec == CodecSpec("int4")
    wgrad = p.choose(RAW, "weight_grad", 0.1)
    assert wgrad.spec.codec == "topk"


def test_decisions_are_deterministic() -> None:
    def run() -> list[tuple[CodecSpec, str, float]]:
        p = LinkPolicy(PolicyConfig(), GBIT, LATENCY)
        bws = [GBIT, GBIT, 50 * MBIT, 50 * MBIT, 20 * MBIT, GBIT]
        return [(d.spec, d.reason, d.predicted_seconds) for d in (_step(p, b, role) for b in bws for role in ROLES)]
    assert run() == run()


def test_one_slow_transfer_only_nudges_the_estimate_two_reset_it() -> None:
    p = LinkPolicy(PolicyConfig(ema_weight=0.25), 100e6)
    p.observe(10 << 20, (10 << 20) / 10e6)
    assert p.bandwidth == pytest.approx(0.75 * 100e6 + 0.25 * 10e6)
    p.observe(10 << 20, (10 << 20) / 10e6)
    assert p.bandwidth == pytest.approx(10e6)
    p.observe(10 << 20, (10 << 20) / 11e6)  # in band again: averaged
    assert p.bandwidth == pytest.approx(0.75 * 10e6 + 0.25 * 11e6)


def test_without_an_estimate_it_says_so() -> None:
    p = LinkPolicy(PolicyConfig())
    d = p.choose(RAW, "weight_grad", 1.0)
    assert d.spec == CodecSpec("identity") and "no bandwidth estimate" in d.reason and math.isnan(d.predicted_seconds)
    p.observe(10 << 20, 1.0)
    assert p.bandwidth == pytest.approx(10 << 20)
    p.observe(100, 1.0)  # too small to measure bandwidth
    assert p.bandwidth == pytest.approx(10 << 20)


@pytest.mark.parametrize("kwargs, match", [
    ({"candidates": ()}, "at least one"),
    ({"candidates": (CodecSpec("int8"), CodecSpec("fp16"))}, "least lossy first"),
    ({"error_budgets": {"activation": 0.01}}, "exactly the roles"),
    ({"candidates": (CodecSpec("int4"),)}, "no candidate fits the activation"),
    ({"hysteresis": 1.0}, "hysteresis"),
    ({"ema_weight": 0.0}, "ema_weight"),
    ({"change_ratio": 1.0}, "change_ratio"),
])
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PolicyConfig(**kwargs)


def test_bad_arguments() -> None:
    p = LinkPolicy(PolicyConfig(), GBIT)
    with pytest.raises(ValueError, match="unknown tensor role 'weights'"):
        p.choose(RAW, "weights", 1.0)
    with pytest.raises(ValueError, match="positive finite duration"):
        p.observe(100, 0.0)
    with pytest.raises(ValueError, match="initial bandwidth"):
        LinkPolicy(PolicyConfig(), -1.0)
