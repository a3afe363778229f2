"""One contract, two backends: MemoryStore and SqliteStore behave the same; SQLite survives a reopen."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from atoll.coordinator.store import (CheckpointRecord, JobRecord, MemberRecord, MemoryStore, OuterArrivalRecord,
                                     SqliteStore, Store, StoreError)
from atoll.plan import IslandInfo, PipelinePlan, Plan, StagePlan
from atoll.types import LayerTiming, LinkMeasurement, LinkStats, NodeProfile, StepMetrics


def _profile(name: str = "cpu-x") -> NodeProfile:
    return NodeProfile(hostname="h", device_kind="cpu", device_name=name, memory_total_bytes=8 << 30,
                       layer_timings=[LayerTiming(layer_kind="block", micro_batch=2, seq_len=64,
                                                  forward_seconds=0.01, backward_seconds=0.02)])


def _member(node_id: str, **kw) -> MemberRecord:
    return MemberRecord(node_id=node_id, peer_address=f"127.0.0.1:{len(node_id)}", profile=_profile(),
                        joined_unix=1.0, last_heartbeat_unix=1.0, **kw)


def _plan(epoch: int) -> Plan:
    return Plan(model="tiny", global_batch=8, seq_len=32, epoch=epoch, job_id="j",
                pipelines=[PipelinePlan(micro_batch=2, num_micro_batches=4,
                                        stages=[StagePlan(island="i0", layers=(0, 3), nodes=["a"]),
                                                StagePlan(island="i1", layers=(3, 6), nodes=["b"])])])


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    s: Store = MemoryStore() if request.param == "memory" else SqliteStore(tmp_path / "state.db")
    yield s
    s.close()


class TestStoreContract:
    def test_job_is_one_per_store(self, store: Store) -> None:
        assert store.get_job() is None
        store.put_job(JobRecord(job_id="j", name="n", spec_toml="x", created_unix=2.0))
        store.put_job(JobRecord(job_id="j", name="n", spec_toml="y", created_unix=2.0))
        assert store.get_job() == JobRecord(job_id="j", name="n", spec_toml="y", created_unix=2.0)
        with pytest.raises(StoreError, match="holds job j"):
            store.put_job(JobRecord(job_id="other", name="n", spec_toml="x"))

    def test_members_upsert_heartbeat_and_state(self, store: Store) -> None:
        store.put_member(_member("b"))
        store.put_member(_member("a"))
        assert [m.node_id for m in store.list_members()] == ["a", "b"]
        assert store.get_member("a") == _member("a")
        assert store.get_member("zz") is None
        assert store.heartbeat("a", 5.0, plan_epoch=2, step=7)
        assert not store.heartbeat("zz", 5.0, plan_epoch=2, step=7)
        a = store.get_member("a")
        assert a is not None and (a.last_heartbeat_unix, a.plan_epoch, a.step) == (5.0, 2, 7)
        store.set_member_state("a", "gone", "missed its lease")
        a = store.get_member("a")
        assert a is not None and (a.state, a.reason) == ("gone", "missed its lease")
        store.put_member(_member("a"))
        assert store.get_member("a").state == "alive"  # type: ignore[union-attr]
        with pytest.raises(ValueError, match="member state"):
            store.set_member_state("a", "zombie", "")

    def test_returned_records_are_copies(self, store: Store) -> None:
        store.put_member(_member("a"))
        m = store.get_member("a")
        assert m is not None
        m.profile.device_name = "changed"
        assert store.get_member("a").profile.device_name == "cpu-x"  # type: ignore[union-attr]

    def test_links_keep_the_latest_per_direction(self, store: Store) -> None:
        store.put_links([LinkMeasurement(src="a", dst="b", bandwidth_bytes_per_s=1e9, rtt_seconds=0.001,
                                         probe_bytes=10, measured_unix=1.0),
                         LinkMeasurement(src="b", dst="a", bandwidth_bytes_per_s=2e9, rtt_seconds=0.001)])
        store.put_links([LinkMeasurement(src="a", dst="b", bandwidth_bytes_per_s=3e9, rtt_seconds=0.002,
                                         measured_unix=2.0)])
        links = store.list_links()
        assert [(x.src, x.dst, x.bandwidth_bytes_per_s) for x in links] == [("a", "b", 3e9), ("b", "a", 2e9)]

    def test_islands_replace(self, store: Store) -> None:
        assert store.get_islands() == []
        isl = [IslandInfo(id="i0", device="cpu", nodes=["a", "b"], gpus=2, inner_bandwidth=1e9)]
        store.put_islands(isl)
        assert store.get_islands() == isl
        store.put_islands([])
        assert store.get_islands() == []

    def test_plan_history_and_epochs_increase(self, store: Store) -> None:
        assert store.latest_plan() is None and store.latest_epoch() == 0
        store.add_plan(_plan(1), created_unix=1.0, reason="first")
        store.add_plan(_plan(2), created_unix=2.0, reason="b left")
        with pytest.raises(StoreError, match="does not exceed"):
            store.add_plan(_plan(2), created_unix=3.0)
        assert store.latest_epoch() == 2
        assert store.latest_plan() == _plan(2)
        assert [(h.plan.epoch, h.reason) for h in store.plan_history()] == [(1, "first"), (2, "b left")]

    def test_checkpoint_index(self, store: Store) -> None:
        r = CheckpointRecord(step=25, plan_epoch=1, node_id="a", layer_start=0, layer_end=3, path="/x", bytes=9)
        store.add_checkpoint(r)
        store.add_checkpoint(CheckpointRecord(step=25, plan_epoch=1, node_id="a", layer_start=0, layer_end=3,
                                              path="/y", bytes=10))
        store.add_checkpoint(CheckpointRecord(step=0, plan_epoch=1, node_id="b", layer_start=3, layer_end=6))
        cps = store.list_checkpoints()
        assert [(c.step, c.node_id, c.path) for c in cps] == [(0, "b", ""), (25, "a", "/y")]
        # a node that lost its files of a step: only its records of that step go
        assert store.drop_checkpoints(25, "a") == 1 and store.drop_checkpoints(25, "b") == 0
        assert [(c.step, c.node_id) for c in store.list_checkpoints()] == [(0, "b")]

    def test_recent_steps_are_bounded(self, store: Store) -> None:
        store.recent_steps_kept = 5
        for i in range(8):
            store.add_step(StepMetrics(job_id="j", node_id="a", plan_epoch=1, step=i, loss=float(i) if i % 2 else None,
                                       tokens=100, links=[LinkStats(peer="b", direction="forward", codec="int8")]))
        steps = store.recent_steps(100)
        assert [s.step for s in steps] == [3, 4, 5, 6, 7]
        assert steps[0].loss == 3.0 and steps[1].loss is None and steps[0].links[0].codec == "int8"
        assert [s.step for s in store.recent_steps(2)] == [6, 7]


    def test_outer_rounds_round_trip(self, store: Store) -> None:
        """Arrivals and decisions of outer rounds, read back as written; a repeated arrival or decision replaces the
        one before; the rounds before a bound are dropped together."""
        for r, node, group in [(3, "b", 1), (3, "a", 0), (4, "a", 0)]:
            store.add_outer_arrival(OuterArrivalRecord(round=r, node_id=node, group=group, tokens=64 * (group + 1),
                                                       epoch=2, arrived_unix=10.0 + r))
        store.add_outer_arrival(OuterArrivalRecord(round=3, node_id="b", group=1, tokens=99, epoch=2, arrived_unix=14.0))
        store.put_outer_decision(3, '{"version": 1}')
        store.put_outer_decision(3, '{"version": 2}')
        store.put_outer_decision(4, '{"version": 1}')
        arrivals, decisions = store.outer_rounds()
        assert [(a.round, a.node_id, a.group, a.tokens, a.epoch, a.arrived_unix) for a in arrivals] == [
            (3, "a", 0, 64, 2, 13.0), (3, "b", 1, 99, 2, 14.0), (4, "a", 0, 64, 2, 14.0)]
        assert decisions == {3: '{"version": 2}', 4: '{"version": 1}'}
        store.drop_outer_rounds(before=4)
        arrivals, decisions = store.outer_rounds()
        assert [(a.round, a.node_id) for a in arrivals] == [(4, "a")] and decisions == {4: '{"version": 1}'}
        store.put_outer_group("lab-a", '{"rounds_in": 1}')
        store.put_outer_group("lab-a", '{"rounds_in": 2}')
        store.put_outer_group("lab-b", '{"rounds_in": 1}')
        store.drop_outer_rounds(before=10)  # a group's counters are the job's, not a round's
        assert store.outer_groups() == {"lab-a": '{"rounds_in": 2}', "lab-b": '{"rounds_in": 1}'}


def test_sqlite_state_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    s = SqliteStore(path)
    s.put_job(JobRecord(job_id="j", name="n", spec_toml="x"))
    s.put_member(_member("a"))
    s.add_plan(_plan(3), created_unix=1.0)
    s.close()
    again = SqliteStore(path)
    assert again.get_job() is not None and again.get_job().job_id == "j"  # type: ignore[union-attr]
    assert [m.node_id for m in again.list_members()] == ["a"]
    assert again.latest_epoch() == 3
    assert again._read("PRAGMA journal_mode")[0][0] == "wal"
    again.close()
