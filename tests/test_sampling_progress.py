"""The coordinator's incremental answer to "which members lack their sample of links" (`SampleProgress`) matches
checking every member afresh, through joins, probes, departures, rejoins, stale measurements and reprobes."""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path

import pytest

from atoll.coordinator import handlers as h
from atoll.coordinator.linkmatrix import ProbeOptions, sample_deficit
from atoll.coordinator.membership import MembershipOptions
from atoll.coordinator.reachability import unreachable_nodes
from atoll.coordinator.state import CoordinatorOptions, CoordinatorState, _ProbeIndex
from atoll.coordinator.store import MemoryStore
from atoll.job import JobSpec
from atoll.v1 import atoll_pb2 as pb

JOB = Path(__file__).resolve().parents[1] / "examples" / "tiny.toml"


def _full_answer(state: CoordinatorState, now: float) -> set[str]:
    """Every alive member checked afresh: the rule `SampleProgress` must answer as."""
    alive = state.alive_members()
    index = _ProbeIndex.of(alive)
    sizes = {c: len(v) for c, v in index.by_class.items()}
    skip = unreachable_nodes(alive)
    horizon = max(now - state.options.probes.reprobe_after.total_seconds(), state._stale_before)
    return {n for n in alive
            if sample_deficit(n, index.class_of, sizes,
                              {p for p, t in state._measured.get(n, {}).items() if t >= horizon} | (skip - {n}),
                              state.options.probes)[1] > 0}


def _profile(i: int, region: str) -> pb.NodeProfile:
    return pb.NodeProfile(hostname=f"h{i}", device_kind="cuda", device_name="H100", device_count=1,
                          memory_total_bytes=80 << 30, cpu_count=8, region=region)


@pytest.mark.parametrize("seed", range(12))
def test_incremental_unprobed_matches_checking_every_member(seed: int) -> None:
    r = random.Random(seed)
    now = [1000.0]
    options = CoordinatorOptions(
        membership=MembershipOptions(lease=timedelta(seconds=10)),
        probes=ProbeOptions(all_pairs_up_to=4, per_class=2, random_extra=1, max_per_round=3,
                            reprobe_after=timedelta(seconds=60), in_flight_timeout=timedelta(seconds=5)))
    state = CoordinatorState(store=MemoryStore(), job=JobSpec.load(JOB), token="t", clock=lambda: now[0],
                             options=options)
    state._rng = random.Random(seed)  # the probe peers drawn
    regions = ["r0", "r1", "r2"][:r.randint(1, 3)]
    ids: dict[int, str] = {}
    for step in range(60):
        now[0] += r.choice([0.5, 1.0, 3.0, 20.0])
        action = r.random()
        if action < 0.35 or len(ids) < 3:  # a join (new, or back after leaving) of a node in some region
            i = r.randrange(40)
            reply = h.handle_join(pb.JoinRequest(token="t", node_id=f"n{i:02d}", profile=_profile(i, r.choice(regions)),
                                                 peer_address="" if r.random() < 0.1 else f"10.0.0.{i}:1"), state)
            ids[i] = reply.node_id
        elif action < 0.45:  # a leave
            i = r.choice(sorted(ids))
            h.handle_leave(pb.LeaveRequest(node_id=ids.pop(i), reason="bye"), state)
        elif action < 0.5:
            state.request_reprobe(now[0])
        alive = state.alive_members()
        for n in alive:  # heartbeats, and the probes they hand out reported (some not)
            reply = h.handle_heartbeat(pb.HeartbeatRequest(node_id=n), state)
            links = [pb.LinkMeasurement(src=n, dst=t.node_id, rtt_seconds=1e-3, bandwidth_bytes_per_s=1e9)
                     for t in reply.probe if r.random() < 0.8]
            if links:
                h.handle_report_probes(pb.ProbeReport(node_id=n, links=links), state)
        state.tick()
        alive = state.alive_members()
        assert state.unprobed(alive, now[0], state._probe_index) == _full_answer(state, now[0]), step
