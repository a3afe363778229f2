"""The heartbeat cadence stretches with the membership, within the coordinator's heartbeat budget."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from atoll.coordinator.cadence import HeartbeatCadence
from atoll.coordinator.membership import MembershipOptions
from atoll.coordinator.metrics import CoordinatorMetrics
from atoll.coordinator.state import CoordinatorOptions, CoordinatorState
from atoll.coordinator.store import MemberRecord, MemoryStore
from atoll.job import JobSpec
from atoll.types import NodeProfile

REPO = Path(__file__).resolve().parent.parent


def test_small_memberships_keep_the_base_cadence() -> None:
    c = HeartbeatCadence(2.5, 10.0, budget=2000.0)
    assert c.update(5000, now=0.0) is None  # 5,000 nodes every 2.5 s: exactly the budget
    assert (c.current.interval, c.current.lease) == (2.5, 10.0)


def test_a_large_membership_stretches_interval_and_lease_together_within_the_budget() -> None:
    c = HeartbeatCadence(2.5, 10.0, budget=2000.0)
    got = c.update(10_000, now=0.0)
    assert got is not None and got == c.current
    assert 10_000 / got.interval <= 2000.0  # within the budget
    assert 10_000 / (got.interval / HeartbeatCadence.STEP) > 2000.0  # and no longer than it needs to be
    assert got.lease / got.interval == pytest.approx(4.0)  # as many missed heartbeats lapse a lease as before
    assert c.expiry_lease(0.0) == got.lease


def test_a_shrinking_membership_announces_the_short_cadence_but_expires_by_the_long_lease_for_one_lease() -> None:
    c = HeartbeatCadence(2.5, 10.0, budget=2000.0)
    long = c.update(20_000, now=0.0)
    assert long is not None
    assert c.update(19_000, now=1.0) is None  # hysteresis: a few nodes fewer change nothing
    short = c.update(100, now=100.0)
    assert short is not None and (short.interval, short.lease) == (2.5, 10.0)
    assert c.expiry_lease(100.0 + long.lease - 0.1) == long.lease  # nodes still on the long interval keep leases
    assert c.expiry_lease(100.0 + long.lease + 0.1) == 10.0


def test_no_budget_means_a_fixed_cadence() -> None:
    c = HeartbeatCadence(2.5, 10.0, budget=None)
    assert c.update(1_000_000, now=0.0) is None
    assert c.current.interval == 2.5


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="budget"):
        HeartbeatCadence(2.5, 10.0, budget=0.0)
    with pytest.raises(ValueError, match="shorter than the lease"):
        HeartbeatCadence(10.0, 10.0, budget=None)
    with pytest.raises(ValueError, match="heartbeat_budget"):
        CoordinatorOptions(heartbeat_budget=-1.0)


def _member(i: int, now: float) -> MemberRecord:
    return MemberRecord(node_id=f"n{i}", peer_address=f"10.0.0.{i % 250}:{7000 + i}", state="alive",
                        profile=NodeProfile(hostname=f"h{i}", device_kind="cpu", device_name="c",
                                            memory_total_bytes=1 << 30, cpu_count=1),
                        joined_unix=now, last_heartbeat_unix=now)


def test_the_coordinator_stretches_the_lease_it_expires_by_with_its_membership() -> None:
    """40 members against a budget of 4 heartbeats a second (base: every 2.5 s, lease 10 s): the interval
    stretches to at least 10 s, and a member silent for 15 s is not gone while one silent past the long lease is."""
    now = [1000.0]
    state = CoordinatorState(store=MemoryStore(), job=JobSpec.load(REPO / "examples" / "tiny.toml"),
                             token="t", clock=lambda: now[0],
                             options=CoordinatorOptions(membership=MembershipOptions(lease=timedelta(seconds=10)),
                                                        heartbeat_budget=4.0))
    for i in range(40):
        state.store.put_member(_member(i, now[0]))
    state.tick(now[0])
    cadence = state.cadence.current
    assert cadence.interval >= 10.0 and cadence.lease >= 40.0
    metrics = CoordinatorMetrics()
    metrics.update(state)
    text = generate_latest(metrics.registry).decode()
    assert f"atoll_coordinator_heartbeat_interval_seconds {cadence.interval}" in text
    assert f"atoll_coordinator_lease_seconds {cadence.lease}" in text
    now[0] += 15.0
    for i in range(1, 40):
        state.store.heartbeat(f"n{i}", now[0], 0, 0)
    events = state.tick(now[0])
    assert not any("gone" in e for e in events), events
    now[0] += cadence.lease
    for i in range(1, 40):
        state.store.heartbeat(f"n{i}", now[0], 0, 0)
    events = state.tick(now[0])
    assert any("node n0 is gone" in e for e in events), events
    state.close()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_nodes_follow_the_cadence_their_coordinator_announces(tmp_path) -> None:
    """A real coordinator with a budget of one heartbeat a second and three nodes (every 2 s, lease 8 s, would be
    1.5 a second): the nodes learn the stretched interval from their heartbeats' replies and keep their leases."""
    from atoll.coordinator.service import CoordinatorService, ServiceConfig
    from atoll.node.agent import AgentConfig, NodeAgent

    options = CoordinatorOptions(membership=MembershipOptions(lease=timedelta(seconds=8)), heartbeat_budget=1.0)
    service = CoordinatorService(job=JobSpec.load(REPO / "examples" / "tiny.toml"), token="tok", options=options,
                                 config=ServiceConfig(listen="127.0.0.1:0", state_dir=tmp_path / "state")).start()
    agents = []
    try:
        for i in range(3):
            cfg = AgentConfig(coordinator=service.address, token="tok", state_dir=tmp_path / f"n{i}",
                              listen="127.0.0.1:0")
            agents.append(NodeAgent(cfg, profile=NodeProfile(hostname=f"h{i}", device_kind="cpu", device_name="c",
                                                             memory_total_bytes=1 << 30, cpu_count=1)).start())
        end = time.monotonic() + 30
        while True:
            want = service.state.cadence.current.interval
            if want > 2.0 and all(a.heartbeat_interval == want for a in agents):
                break
            assert time.monotonic() < end, (want, [a.heartbeat_interval for a in agents])
            time.sleep(0.1)
        assert 3 / want <= 1.0
        assert all(m.state == "alive" for m in service.store.list_members())
    finally:
        for a in agents:
            a.stop(leave=False)
        service.stop()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_node_heartbeats_at_once_after_joining(tmp_path) -> None:
    """Its first heartbeat's reply hands it the peers to probe, and a plan waits for every member's probes: with a
    40 s lease (a beat every 10 s) the first one still comes within a couple of seconds of the join."""
    from atoll.coordinator.service import CoordinatorService, ServiceConfig
    from atoll.node.agent import AgentConfig, NodeAgent

    options = CoordinatorOptions(membership=MembershipOptions(lease=timedelta(seconds=40)))
    service = CoordinatorService(job=JobSpec.load(REPO / "examples" / "tiny.toml"), token="tok", options=options,
                                 config=ServiceConfig(listen="127.0.0.1:0", state_dir=tmp_path / "state")).start()
    agent = None
    try:
        cfg = AgentConfig(coordinator=service.address, token="tok", state_dir=tmp_path / "n0", listen="127.0.0.1:0")
        agent = NodeAgent(cfg, profile=NodeProfile(hostname="h0", device_kind="cpu", device_name="c",
                                                   memory_total_bytes=1 << 30, cpu_count=1)).start()
        assert agent.heartbeat_interval == 10.0
        end = time.monotonic() + 3.0
        while True:
            service.store.flush()
            (m,) = service.store.list_members()
            if m.last_heartbeat_unix > m.joined_unix:
                break
            assert time.monotonic() < end, "no heartbeat within 3 s of the join"
            time.sleep(0.05)
    finally:
        if agent is not None:
            agent.stop(leave=False)
        service.stop()
