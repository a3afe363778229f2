"""The link probe through the pipeline transport: the fitted message-size curve and real round trips."""

from __future__ import annotations

import math

import pytest

from atoll.node.peer import PeerServer
from atoll.node.transport_probe import TransferCurve, fit_transfer_curve, probe_transport


def test_the_fit_recovers_latency_and_bandwidth_from_exact_samples() -> None:
    truth = TransferCurve(latency_s=2e-3, bandwidth_bytes_per_s=500e6)
    samples = [(n, truth.seconds(n)) for n in (256 << 10, 1 << 20, 4 << 20)]
    got = fit_transfer_curve(samples)
    assert math.isclose(got.latency_s, 2e-3, rel_tol=1e-9)
    assert math.isclose(got.bandwidth_bytes_per_s, 500e6, rel_tol=1e-9)
    assert got.samples == tuple(samples)
    link = got.measurement(src="a", dst="b")
    assert math.isclose(link.rtt_seconds, 4e-3) and link.bandwidth_bytes_per_s == got.bandwidth_bytes_per_s
    assert link.probe_bytes == 4 << 20


def test_a_negative_intercept_is_refitted_through_the_origin() -> None:
    got = fit_transfer_curve([(1000, 0.5e-6), (2000, 2e-6), (3000, 3.5e-6)])
    assert got.latency_s == 0.0
    assert got.bandwidth_bytes_per_s > 0
    # through the origin: seconds = size / bandwidth fits the samples in the least-squares sense
    assert math.isclose(got.seconds(2000), 2000 / got.bandwidth_bytes_per_s)


def test_times_that_do_not_grow_with_size_give_their_mean_and_a_rate_the_link_reached() -> None:
    got = fit_transfer_curve([(1 << 20, 3e-3), (4 << 20, 2e-3)])
    assert math.isclose(got.latency_s, 2.5e-3)
    assert math.isclose(got.bandwidth_bytes_per_s, (4 << 20) / 2e-3)


@pytest.mark.parametrize("samples", [[], [(100, 1e-3)], [(100, 1e-3), (100, 2e-3)], [(0, 1e-3), (10, 2e-3)]])
def test_the_fit_refuses_what_no_curve_comes_from(samples) -> None:
    with pytest.raises(ValueError):
        fit_transfer_curve(samples)


@pytest.mark.timeout(60)
def test_round_trips_through_real_transports_give_a_curve() -> None:
    a = PeerServer(node_id="a", listen="127.0.0.1:0", token="t")
    b = PeerServer(node_id="b", listen="127.0.0.1:0", token="t")
    try:
        curve = probe_transport(a, b, sizes=(16 << 10, 64 << 10, 256 << 10), repeats=3, warmup=1, token="t")
        assert [n for n, _ in curve.samples] == [16 << 10, 64 << 10, 256 << 10]
        assert all(s > 0 for _, s in curve.samples)
        assert curve.latency_s >= 0 and curve.bandwidth_bytes_per_s > 0
        # the servers are free again afterwards: a second probe runs on them
        again = probe_transport(a, b, sizes=(4 << 10, 8 << 10), repeats=1, warmup=0, token="t")
        assert len(again.samples) == 2
    finally:
        a.stop()
        b.stop()


def test_probe_arguments_are_checked() -> None:
    a = PeerServer(node_id="a", listen="127.0.0.1:0", token="t")
    try:
        with pytest.raises(ValueError, match="repeats"):
            probe_transport(a, a, repeats=0)
        with pytest.raises(ValueError, match="sizes"):
            probe_transport(a, a, sizes=(2,))
    finally:
        a.stop()


@pytest.mark.timeout(60)
def test_a_peer_probe_fits_the_curve_to_three_sizes(monkeypatch) -> None:
    from datetime import timedelta

    from atoll.node import probe

    fitted: list[list[tuple[int, float]]] = []
    real = probe.fit_transfer_curve

    def spy(samples):
        fitted.append(list(samples))
        return real(samples)

    monkeypatch.setattr(probe, "fit_transfer_curve", spy)
    server = PeerServer(node_id="b", listen="127.0.0.1:0", token="t")
    try:
        r = probe.probe_peer(server.address, nbytes=256 << 10, token="t", timeout=timedelta(seconds=20))
        assert [n for n, _ in fitted[0]] == [16 << 10, 64 << 10, 256 << 10]
        assert r.bytes == 256 << 10 and r.rtt_seconds > 0 and r.bandwidth_bytes_per_s > 0
        # a small probe times one transfer, as before
        small = probe.probe_peer(server.address, nbytes=1024, token="t", timeout=timedelta(seconds=20))
        assert len(fitted) == 1 and small.bytes == 1024
    finally:
        server.stop()
