"""Machine probes: what one node's flow reaches while every node of its machine sends at once, and the links
between machines the planner reads at most at it (`atoll.coordinator.machineprobe`)."""

from __future__ import annotations

import pytest
from test_coordinator_handlers import ROOT, TOKEN, Clock, join

from atoll.coordinator import handlers as h
from atoll.coordinator.errors import InvalidArgument
from atoll.coordinator.machineprobe import MachineProbes, per_flow_links
from atoll.coordinator.state import CoordinatorState
from atoll.coordinator.store import MemoryStore, SqliteStore
from atoll.job import JobSpec
from atoll.types import LinkMeasurement
from atoll.v1 import atoll_pb2 as pb

MACHINES = {"m1": ["a", "b"], "m2": ["c", "d"]}


def _flow(src: str, dst: str, bw: float, flows: int = 2) -> LinkMeasurement:
    return LinkMeasurement(src=src, dst=dst, bandwidth_bytes_per_s=bw, rtt_seconds=1e-3, flows=flows)


def test_a_round_has_every_node_of_a_machine_probe_another_machine_at_one_moment() -> None:
    probes = MachineProbes(reprobe_after_s=600, timeout_s=30)
    receivable = {"a", "b", "c", "d"}.__contains__
    assert probes.needs(MACHINES, 0.0) == {"m1", "m2"}
    assert probes.needs({"m1": ["a", "b"]}, 0.0) == set()  # one machine: nothing to probe
    assert probes.needs({"m1": ["a"], "m2": ["c"]}, 0.0) == set()  # a node alone on its machine: its lone probes
    first = probes.target("a", "m1", MACHINES, receivable, now=10.0, lead_s=3.0)
    assert first is not None and (first.receiver, first.start_unix, first.flows) == ("c", 13.0, 2)
    assert probes.target("a", "m1", MACHINES, receivable, now=11.0, lead_s=3.0) is None  # told once
    second = probes.target("b", "m1", MACHINES, receivable, now=11.0, lead_s=3.0)
    assert second is not None and (second.receiver, second.start_unix) == ("d", 13.0)  # its own receiver, same start
    assert probes.record(_flow("a", "c", 40e6), "m1", 13.5) is None  # b's flow still to come
    assert probes.record(_flow("a", "d", 1e9), "m1", 13.5) is None  # not the pair the round gave a
    outcome = probes.record(_flow("b", "d", 60e6), "m1", 13.6)
    assert outcome is not None and "2 flows sent at once reach 400.0 Mbit/s each" in outcome
    assert probes.per_flow() == {"m1": 50e6}
    assert probes.needs(MACHINES, 14.0) == {"m2"} and probes.needs(MACHINES, 700.0) == {"m1", "m2"}
    assert probes.missing(MACHINES, receivable, 14.0) == {"c", "d"}
    assert probes.missing(MACHINES, {"c", "d"}.__contains__, 14.0) == set()  # m1 accepts no connections: m2's round cannot form


def test_a_late_node_sends_nothing_and_an_overdue_round_ends_with_the_flows_that_came() -> None:
    probes = MachineProbes(reprobe_after_s=600, timeout_s=30)
    receivable = {"a", "b", "c", "d"}.__contains__
    assert probes.target("a", "m1", MACHINES, receivable, now=0.0, lead_s=0.5).start_unix == 2.0  # at least 2 s
    assert probes.target("b", "m1", MACHINES, receivable, now=1.9, lead_s=0.5) is None  # too late to start with a
    assert probes.record(_flow("a", "c", 80e6), "m1", 2.5) is not None  # the one flow that ran
    assert probes.per_flow() == {"m1": 80e6}
    probes.target("c", "m2", MACHINES, receivable, now=3.0, lead_s=0.5)
    probes.target("d", "m2", MACHINES, receivable, now=3.0, lead_s=0.5)
    assert probes.record(_flow("c", "a", 0.0), "m2", 5.5) is None  # a failed flow; d never reports
    assert probes.expire(60.0) == [] and probes.rounds  # two flows on one card: twice a lone probe's time
    [outcome] = probes.expire(70.0)
    assert "none of its 2 flows" in outcome and "m2" not in probes.per_flow()
    assert probes.needs(MACHINES, 71.0) == set()  # tried: not again before reprobe_after


def test_rounds_formed_at_once_spread_over_the_machines() -> None:
    """Each machine looks for receivers from the machine after it: four machines' rounds each go to another
    machine, not all to the first one (whose card would then carry every round at once)."""
    probes = MachineProbes(reprobe_after_s=600, timeout_s=30)
    order = ["m1", "m2", "m3", "m4"]
    by_machine = {m: [f"{m}-a", f"{m}-b"] for m in order}

    def after(m: str):
        i = order.index(m)
        return (order[(i + j) % 4] for j in range(1, 4))

    got = {m: probes.target(f"{m}-a", m, by_machine, lambda n: True, 0.0, 3.0, after=after).receiver for m in order}
    assert got == {"m1": "m2-a", "m2": "m3-a", "m3": "m4-a", "m4": "m1-a"}


def test_links_between_machines_are_read_at_most_at_the_machines_per_flow_figure() -> None:
    machine_of = {"a": "m1", "b": "m1", "c": "m2", "d": "m2", "e": "m3"}
    links = [_flow("a", "b", 5e9, 1), _flow("a", "c", 125e6, 1), _flow("c", "e", 125e6, 1), _flow("b", "e", 10e6, 1)]
    got = per_flow_links(links, machine_of, {"m1": 50e6, "m2": 100e6})
    assert [x.bandwidth_bytes_per_s for x in got] == [5e9, 50e6, 100e6, 10e6]  # within m1; min(m1, m2); m2; below


def test_the_coordinator_runs_a_machines_round_before_it_plans_and_plans_with_its_figure(tmp_path) -> None:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    clock = Clock()
    state = CoordinatorState(store=SqliteStore(tmp_path / "coordinator.db"), job=job, token=TOKEN, clock=clock)
    ids = [join(state, host=host, port=5001 + i).node_id for i, host in enumerate(["m1", "m1", "m2", "m2"])]
    state.tick()
    first = h.handle_heartbeat(pb.HeartbeatRequest(node_id=ids[0]), state)
    assert first.probe and not [t for t in first.probe if t.flows > 1]  # not while the machine's nodes probe alone
    parts: dict[str, pb.ProbeTarget] = {}
    pending = {ids[0]: first}
    for n in [*ids, *ids]:  # as nodes do: lone probes reported at once, a round's part kept for its start
        reply = pending.pop(n, None) or h.handle_heartbeat(pb.HeartbeatRequest(node_id=n), state)
        assert reply.coordinator_unix == clock.t
        parts.update({n: t for t in reply.probe if t.flows > 1})
        h.handle_report_probes(pb.ProbeReport(node_id=n, links=[pb.LinkMeasurement(
            src=n, dst=t.node_id, bandwidth_bytes_per_s=125e6, rtt_seconds=1e-4)  # 1 Gbit/s everywhere
            for t in reply.probe if t.flows <= 1]), state)
    alive = state.alive_members()
    assert state.unprobed(alive, clock.t) == set(ids)  # the links are measured; each machine's round is to come
    assert set(parts) == set(ids)
    start = parts[ids[0]].start_unix
    assert {parts[n].start_unix for n in ids[:2]} == {start} and start == clock.t + 1.5 * 2.5 + 1  # after the next heartbeats
    assert {parts[n].node_id for n in ids[:2]} == set(ids[2:])  # m1's two nodes each probe a node of m2
    with pytest.raises(InvalidArgument, match="at most 1024 flows"):
        h.handle_report_probes(pb.ProbeReport(node_id=ids[0], links=[pb.LinkMeasurement(
            src=ids[0], dst=ids[2], bandwidth_bytes_per_s=1.0, rtt_seconds=0.0, flows=5000)]), state)
    clock.t = parts[ids[0]].start_unix + 1
    for n, bw in zip(ids, (30e6, 50e6, 100e6, 100e6)):  # m1's card is shared, m2's is not
        h.handle_report_probes(pb.ProbeReport(node_id=n, links=[pb.LinkMeasurement(
            src=n, dst=parts[n].node_id, bandwidth_bytes_per_s=bw, rtt_seconds=1e-3, flows=2)]), state)
    assert state.unprobed(alive, clock.t) == set()
    assert state._machines.per_flow() == {"m1": 40e6, "m2": 100e6}  # noqa: SLF001 - the figures planned with
    # the lone probes stay as they were in the store: a round's flows are no link's measurement of their own
    assert {x.bandwidth_bytes_per_s for x in state.store.list_links()} == {125e6}
    inputs = state._plan_inputs(alive, clock.t)  # noqa: SLF001 - what the planner is given
    assert inputs.machine_flows == {"m1": 40e6, "m2": 100e6}
    # a restarted coordinator plans from the figures its store kept, without measuring the machines again first
    state.store.close()
    again = CoordinatorState(store=SqliteStore(tmp_path / "coordinator.db"), job=job, token=TOKEN, clock=clock)
    assert again._machines.per_flow() == {"m1": 40e6, "m2": 100e6}  # noqa: SLF001
    assert again._machines.needs({"m1": ids[:2], "m2": ids[2:]}, clock.t) == set()  # noqa: SLF001
    assert again._machines.needs({"m1": ids[:2], "m2": ids[2:]}, clock.t + 10**6) == {"m1", "m2"}  # noqa: SLF001 - stale in time
    again.store.close()


def test_both_stores_keep_each_machines_newest_figure(tmp_path) -> None:
    for store in (MemoryStore(), SqliteStore(tmp_path / "c.db")):
        assert store.get_machine_flows() == {}
        store.put_machine_flow("m1", 40e6, 10.0)
        store.put_machine_flow("m2", None, 11.0)  # a round none of whose flows got through
        store.put_machine_flow("m1", 50e6, 12.0)
        assert store.get_machine_flows() == {"m1": (50e6, 12.0), "m2": (None, 11.0)}
        store.close()
    assert SqliteStore(tmp_path / "c.db").get_machine_flows() == {"m1": (50e6, 12.0), "m2": (None, 11.0)}
