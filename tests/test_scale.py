"""The coordinator's pieces that must stay cheap at thousands of nodes, checked for what they compute: the sparse
link graph against the dense completion, the island rule against its pairwise form, probe sampling by drawing,
and heartbeats kept in memory until the loop writes them. `python -m bench.coordinator_scale` measures the speed."""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path

import pytest

from atoll.coordinator.islands import IslandOptions, device_class, form_islands
from atoll.coordinator.linkmatrix import (LinkGraph, ProbeOptions, complete_matrix, sample_deficit, sample_targets,
                                          symmetric_bandwidth)
from atoll.coordinator.store import JobRecord, MemberRecord, SqliteStore
from atoll.plan import IslandInfo
from atoll.types import LinkMeasurement, NodeProfile

GB = 1e9


def _random_cluster(seed: int) -> tuple[dict[str, NodeProfile], list[LinkMeasurement]]:
    r = random.Random(seed)
    n = r.randint(1, 14)
    nodes = [f"n{i:02d}" for i in range(n)]
    profiles = {x: NodeProfile(device_kind="cpu", device_name=r.choice(["a", "b"])) for x in nodes}
    links = [LinkMeasurement(src=nodes[i], dst=nodes[j], rtt_seconds=r.choice([1e-4, 1e-3, 5e-2]),
                             bandwidth_bytes_per_s=r.choice([0.0, 0.05, 0.1, 1, 2, 5, 8, 10]) * GB)
             for i in range(n) for j in range(i + 1, n) if r.random() < 0.4]
    return profiles, links


def _pairwise_islands(profiles: dict[str, NodeProfile], matrix, options: IslandOptions) -> list[IslandInfo]:
    """The rule of `atoll.coordinator.islands` in its plain pairwise form (O(n^3) and more): the reference."""
    measured = [e.bandwidth_bytes_per_s for e in matrix.values() if e.measured]
    threshold = max(options.relative_threshold * max(measured, default=0.0), options.min_bandwidth)
    by_class: dict[str, list[str]] = {}
    for n in sorted(profiles):
        by_class.setdefault(device_class(profiles[n]), []).append(n)

    def bw(a: str, b: str) -> float:
        return symmetric_bandwidth(matrix, a, b)

    clusters: list[list[str]] = []
    for nodes in by_class.values():
        groups = [[n] for n in nodes]
        while len(groups) > 1:
            best, pair = -1.0, (0, 0)
            for i in range(len(groups)):
                for j in range(i + 1, len(groups)):
                    link = min(bw(a, b) for a in groups[i] for b in groups[j])
                    if link > best:
                        best, pair = link, (i, j)
            if best <= 0 or best < threshold:
                break
            i, j = pair
            groups[i] = sorted(groups[i] + groups[j])
            del groups[j]
        clusters += groups
    clusters.sort(key=lambda g: g[0])
    everyone = sorted(profiles)
    out = []
    for group in clusters:
        inner = min((bw(a, b) for a in group for b in group if a < b), default=0.0)
        outer = max((bw(a, b) for a in group for b in everyone if b not in group), default=0.0)
        out.append(IslandInfo(id="", device="", nodes=group, inner_bandwidth=inner, outer_bandwidth=outer))
    return out


@pytest.mark.parametrize("seed", range(0, 400, 4))
def test_islands_from_the_sparse_graph_follow_the_pairwise_rule(seed: int) -> None:
    profiles, links = _random_cluster(seed)
    matrix = complete_matrix(sorted(profiles), links)
    want = [(i.nodes, i.inner_bandwidth, i.outer_bandwidth)
            for i in _pairwise_islands(profiles, matrix, IslandOptions())]
    got = form_islands(profiles, LinkGraph(profiles, links))
    assert [(i.nodes, i.inner_bandwidth, i.outer_bandwidth) for i in got] == want


@pytest.mark.parametrize("seed", range(1, 400, 8))
def test_the_sparse_graph_answers_as_the_dense_matrix(seed: int) -> None:
    profiles, links = _random_cluster(seed)
    nodes = sorted(profiles)
    dense, graph = complete_matrix(nodes, links), LinkGraph(nodes, links)
    assert set(graph) == set(dense)
    for pair, e in dense.items():
        g = graph[pair]
        assert (g.measured, g.bandwidth_bytes_per_s) == (e.measured, e.bandwidth_bytes_per_s), pair
        assert g.rtt_seconds == pytest.approx(e.rtt_seconds), pair


def test_thousands_of_nodes_form_islands_by_region_without_comparing_every_pair() -> None:
    """5,000 nodes in 4 regions, each probing the next node of its region and 6 random peers (fast inside a region,
    slow across): one island per region, whole; the sparse form never touches the 12.5 million pairs."""
    r = random.Random(0)
    n = 5000
    nodes = [f"n{i:05d}" for i in range(n)]
    profiles = {x: NodeProfile(device_kind="cuda", device_name="H100", region=f"r{i % 4}") for i, x in enumerate(nodes)}
    links = []
    for i, x in enumerate(nodes):
        for j in [(i + 4) % n] + [r.randrange(n) for _ in range(6)]:
            if j != i:
                links.append(LinkMeasurement(src=x, dst=nodes[j], rtt_seconds=1e-3,
                                             bandwidth_bytes_per_s=(10 * GB if i % 4 == j % 4 else 0.1 * GB)))
    islands = form_islands(profiles, LinkGraph(nodes, links))
    assert sorted(len(i.nodes) for i in islands) == [1250] * 4
    assert {i.group for i in islands} == {"r0", "r1", "r2", "r3"}
    assert all(i.inner_bandwidth == 10 * GB and i.outer_bandwidth == 0.1 * GB for i in islands)


def test_probe_sampling_by_drawing_completes_every_node_in_bounded_rounds() -> None:
    opts = ProbeOptions(all_pairs_up_to=8, per_class=2, random_extra=2, max_per_round=4)
    r = random.Random(1)
    class_of = {f"n{i:04d}": f"c{i % 3}" for i in range(3000)}
    by_class: dict[str, list[str]] = {}
    for n, c in class_of.items():
        by_class.setdefault(c, []).append(n)
    everyone = list(class_of)
    sizes = {c: len(v) for c, v in by_class.items()}
    fresh: dict[str, set[str]] = {n: set() for n in class_of}
    handed = 0
    for _ in range(3):  # heartbeats: each node is handed what it lacks, at most 4 a round
        for n in everyone:
            targets = sample_targets(n, class_of, by_class, everyone, fresh[n], opts, r)
            assert len(targets) <= 4 and n not in targets and not set(targets) & fresh[n]
            handed += len(targets)
            for t in targets:
                fresh[n].add(t)
                fresh[t].add(n)
    assert all(sample_deficit(n, class_of, sizes, fresh[n], opts)[1] <= 0 for n in everyone)
    for n in everyone:  # every class is covered, with the random extras on top
        assert {class_of[p] for p in fresh[n]} == {"c0", "c1", "c2"} and len(fresh[n]) >= 8
    assert handed <= 8 * len(everyone)  # O(n) probes, not O(n^2)


def test_few_nodes_are_sampled_in_full() -> None:
    opts = ProbeOptions()
    class_of = {n: "cpu" for n in "abcd"}
    by_class = {"cpu": list("abcd")}
    assert sample_targets("a", class_of, by_class, list("abcd"), set(), opts, random.Random(0)) == ["b", "c", "d"]
    assert sample_targets("a", class_of, by_class, list("abcd"), {"b", "c", "d"}, opts, random.Random(0)) == []


def test_heartbeats_stay_in_memory_until_flushed_and_joins_are_written_at_once(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    s = SqliteStore(path)
    s.put_job(JobRecord(job_id="j", name="n", spec_toml="x"))
    s.put_member(MemberRecord(node_id="a", peer_address="127.0.0.1:1", profile=NodeProfile(hostname="h"),
                              last_heartbeat_unix=1.0))
    assert s.heartbeat("a", 5.0, plan_epoch=2, step=3)
    assert s.get_member("a").last_heartbeat_unix == 5.0  # type: ignore[union-attr]
    disk = SqliteStore(path)  # a second reader sees what is on disk: the join, not yet the heartbeat
    assert disk.get_member("a").last_heartbeat_unix == 1.0  # type: ignore[union-attr]
    disk.close()
    s.flush()
    disk = SqliteStore(path)
    assert (disk.get_member("a").last_heartbeat_unix, disk.get_member("a").step) == (5.0, 3)  # type: ignore[union-attr]
    disk.close()
    view = s.members_view()
    s.heartbeat("a", 9.0, plan_epoch=2, step=4)
    assert view["a"].last_heartbeat_unix == 5.0  # a view's records are replaced, never changed under a reader
    s.close()


def test_the_coordinator_loop_writes_heartbeats_each_round(tmp_path: Path) -> None:
    from atoll.coordinator import handlers as h
    from atoll.coordinator.membership import MembershipOptions
    from atoll.coordinator.state import CoordinatorOptions, CoordinatorState
    from atoll.job import JobSpec
    from atoll.v1 import atoll_pb2 as pb

    now = [100.0]
    store = SqliteStore(tmp_path / "state.db")
    job = JobSpec.load(Path(__file__).resolve().parents[1] / "examples" / "tiny.toml")
    state = CoordinatorState(store=store, job=job, token="t", clock=lambda: now[0],
                             options=CoordinatorOptions(membership=MembershipOptions(lease=timedelta(seconds=10))))
    node = h.handle_join(pb.JoinRequest(token="t", peer_address="127.0.0.1:9", profile=pb.NodeProfile(
        hostname="h", device_kind="cpu", device_name="cpu", device_count=1, memory_total_bytes=1 << 30,
        cpu_count=1)), state).node_id
    now[0] = 104.0
    h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, step=7), state)
    state.tick()
    disk = SqliteStore(tmp_path / "state.db")
    assert disk.get_member(node).last_heartbeat_unix == 104.0  # type: ignore[union-attr]
    disk.close()
    store.close()


def test_lease_expiry_follows_the_lease_deadline_rule() -> None:
    from atoll.coordinator.membership import MembershipOptions, expire_leases, lease_deadline

    r = random.Random(3)
    for _ in range(200):
        options = MembershipOptions(lease=timedelta(seconds=r.choice([1, 10, 30])),
                                    restart_grace=r.choice([None, timedelta(0), timedelta(seconds=20)]))
        started = 1000.0
        members = [MemberRecord(node_id=f"n{i}", peer_address="", profile=NodeProfile(),
                                state=r.choice(["alive", "alive", "gone", "left"]),
                                last_heartbeat_unix=started + r.uniform(-40, 60)) for i in range(30)]
        now = started + r.uniform(0, 90)
        want = [m.node_id for m in members if m.state == "alive" and now > lease_deadline(m, started, options)]
        assert [t.node_id for t in expire_leases(now, members, started, options)] == want


def test_store_views_are_the_stored_records_in_list_order(tmp_path: Path) -> None:
    from atoll.coordinator.store import MemoryStore

    for store in (MemoryStore(), SqliteStore(tmp_path / "state.db")):
        store.put_job(JobRecord(job_id="j", name="n", spec_toml="x"))
        store.put_links([LinkMeasurement(src=f"n{i % 7}", dst=f"n{(i * 3 + 1) % 7}", rtt_seconds=1e-3,
                                         bandwidth_bytes_per_s=float(i + 1)) for i in range(20)])
        assert [(x.src, x.dst, x.bandwidth_bytes_per_s) for x in store.links_view()] == \
            [(x.src, x.dst, x.bandwidth_bytes_per_s) for x in store.list_links()]
        store.put_member(MemberRecord(node_id="a", peer_address="127.0.0.1:1", profile=NodeProfile(hostname="h")))
        seen = store.peek_member("a")
        store.heartbeat("a", 5.0, plan_epoch=1, step=2)
        assert seen.last_heartbeat_unix == 0.0  # a heartbeat replaces the record: a peeked one stays as read
        assert store.peek_member("a").last_heartbeat_unix == 5.0 and store.peek_member("b") is None
        store.close()
