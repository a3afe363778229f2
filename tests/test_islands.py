"""Islands by the documented rule, probe sampling and matrix completion."""

from __future__ import annotations

import random

import pytest

from atoll.coordinator.islands import IslandOptions, form_islands
from atoll.coordinator.linkmatrix import (ProbeOptions, complete_matrix, fresh_pairs, needs_probes, probe_targets,
                                          symmetric_bandwidth)
from atoll.types import LinkMeasurement, NodeProfile

GB = 1e9


def _links(pairs: dict[tuple[str, str], float], t: float = 100.0) -> list[LinkMeasurement]:
    return [LinkMeasurement(src=a, dst=b, bandwidth_bytes_per_s=v, rtt_seconds=0.001, measured_unix=t)
            for (a, b), v in pairs.items()]


def _profiles(spec: dict[str, str]) -> dict[str, NodeProfile]:
    return {n: NodeProfile(device_kind="cuda" if d.startswith("H") or d.startswith("A") else "cpu", device_name=d)
            for n, d in spec.items()}


def test_two_sites_of_one_class_form_two_islands_and_classes_never_mix() -> None:
    profiles = _profiles({"a1": "H100", "a2": "H100", "b1": "H100", "b2": "H100", "c1": "A100"})
    fast, slow = 10 * GB, 0.1 * GB
    links = {("a1", "a2"): fast, ("b1", "b2"): fast, ("a1", "b1"): slow, ("a2", "b2"): slow, ("a1", "b2"): slow,
             ("a2", "b1"): slow, ("c1", "a1"): fast, ("c1", "a2"): fast}
    m = complete_matrix(sorted(profiles), _links(links))
    islands = form_islands(profiles, m)
    assert [(i.id, i.nodes) for i in islands] == [("cuda0", ["a1", "a2"]), ("cuda1", ["b1", "b2"]),
                                                  ("cuda2", ["c1"])]
    a = islands[0]
    assert a.inner_bandwidth == fast and a.outer_bandwidth == fast  # c1 reaches a1 fast, but is another class
    assert islands[1].inner_bandwidth == fast and islands[1].outer_bandwidth == slow  # every way out is slow
    assert islands[2].inner_bandwidth == 0.0 and islands[2].gpus == 1


def test_an_island_never_spans_a_slow_link_even_with_a_fast_chain() -> None:
    # a-b fast, b-c fast, a-c slow: single linkage would chain all three; complete linkage must not
    profiles = _profiles({"a": "cpu", "b": "cpu", "c": "cpu"})
    links = {("a", "b"): 5 * GB, ("b", "c"): 4 * GB, ("a", "c"): 0.2 * GB}
    islands = form_islands(profiles, complete_matrix(sorted(profiles), _links(links)))
    for isl in islands:
        assert isl.inner_bandwidth == 0 or isl.inner_bandwidth >= 0.3 * 5 * GB
    assert sorted(len(i.nodes) for i in islands) == [1, 2]
    assert islands[0].nodes == ["a", "b"]


def test_all_fast_loopback_nodes_make_one_island_and_floor_applies() -> None:
    profiles = _profiles({"a": "cpu", "b": "cpu", "c": "cpu"})
    links = {("a", "b"): 2 * GB, ("b", "c"): 1.5 * GB, ("a", "c"): 1.8 * GB}
    m = complete_matrix(sorted(profiles), _links(links))
    islands = form_islands(profiles, m)
    assert [i.nodes for i in islands] == [["a", "b", "c"]]
    assert islands[0].inner_bandwidth == 1.5 * GB and islands[0].outer_bandwidth == 0.0
    split = form_islands(profiles, m, IslandOptions(min_bandwidth=10 * GB))
    assert [i.nodes for i in split] == [["a"], ["b"], ["c"]]


def test_unmeasured_nodes_stay_alone() -> None:
    profiles = _profiles({"a": "cpu", "b": "cpu"})
    assert [i.nodes for i in form_islands(profiles, complete_matrix(["a", "b"], []))] == [["a"], ["b"]]


def test_completion_uses_measured_pairs_and_widest_paths() -> None:
    links = _links({("a", "b"): 8 * GB, ("b", "c"): 2 * GB}) + [
        LinkMeasurement(src="b", dst="a", bandwidth_bytes_per_s=6 * GB, rtt_seconds=0.002, measured_unix=100.0)]
    m = complete_matrix(["a", "b", "c", "d"], links)
    assert m[("a", "b")].bandwidth_bytes_per_s == 8 * GB and m[("b", "a")].bandwidth_bytes_per_s == 6 * GB
    assert m[("c", "b")].measured and m[("c", "b")].bandwidth_bytes_per_s == 2 * GB  # symmetric fill
    assert not m[("a", "c")].measured and m[("a", "c")].bandwidth_bytes_per_s == 2 * GB
    assert m[("a", "c")].rtt_seconds == pytest.approx(0.002)
    assert ("a", "d") not in m
    assert symmetric_bandwidth(m, "a", "b") == 6 * GB and symmetric_bandwidth(m, "a", "d") == 0.0


def test_few_nodes_probe_every_pair_once() -> None:
    opts = ProbeOptions()
    classes = {n: "cpu" for n in "abcd"}
    fresh: set[frozenset[str]] = set()
    in_flight: set[frozenset[str]] = set()
    handed = []
    for n in "abcd":
        for p in probe_targets(n, classes, fresh, in_flight, opts):
            in_flight.add(frozenset((n, p)))
            handed.append(frozenset((n, p)))
    assert len(handed) == len(set(handed)) == 6  # every unordered pair, once
    assert all(needs_probes(n, classes, fresh, opts) for n in "abcd")
    fresh = set(handed)
    assert not any(needs_probes(n, classes, fresh, opts) for n in "abcd")


def test_many_nodes_probe_a_bounded_sample_per_class() -> None:
    opts = ProbeOptions(all_pairs_up_to=8, per_class=2, random_extra=1, max_per_round=100)
    classes = {f"g{i:02d}": "H100" for i in range(40)} | {f"c{i:02d}": "cpu" for i in range(40)}
    fresh: set[frozenset[str]] = set()
    total = 0
    for n in sorted(classes):
        targets = probe_targets(n, classes, fresh, set(), opts, random.Random(n))
        fresh |= {frozenset((n, p)) for p in targets}
        total += len(targets)
        assert len(targets) <= 5
    assert total <= 5 * len(classes)  # O(n), not O(n^2) = 3160
    # every node ends with links into both classes
    for n in classes:
        mine = [next(iter(p - {n})) for p in fresh if n in p]
        assert {classes[p] for p in mine} == {"H100", "cpu"}


def test_stale_measurements_are_probed_again() -> None:
    opts = ProbeOptions()
    links = _links({("a", "b"): GB}, t=100.0)
    assert fresh_pairs(links, now=200.0, options=opts) == {frozenset("ab")}
    assert fresh_pairs(links, now=100.0 + 601, options=opts) == set()
    assert fresh_pairs(links, now=200.0, options=opts, stale_before=150.0) == set()


def test_options_validated() -> None:
    with pytest.raises(ValueError, match="relative_threshold"):
        IslandOptions(relative_threshold=0)
    with pytest.raises(ValueError, match="probe_bytes"):
        ProbeOptions(probe_bytes=1)


def test_islands_never_span_regions() -> None:
    from atoll.coordinator.islands import device_class
    from atoll.types import NodeProfile

    a = NodeProfile(device_kind="cuda", device_name="H100", region="us-east")
    b = NodeProfile(device_kind="cuda", device_name="H100", region="eu-west")
    assert device_class(a) != device_class(b)
    assert device_class(a) == device_class(NodeProfile(device_kind="cuda", device_name="H100", region="us-east"))


def test_nodes_that_drifted_from_their_profile_leave_their_island() -> None:
    from atoll.coordinator.islands import speed_class

    profiles = _profiles({n: "H100" for n in ("a", "b", "c", "d", "e")})
    links = {(x, y): 10 * GB for x in profiles for y in profiles if x < y}
    m = complete_matrix(sorted(profiles), _links(links))
    assert [i.nodes for i in form_islands(profiles, m)] == [["a", "b", "c", "d", "e"]]
    # against the median node (a, 1.0x its profile): d within 1.25x of it, the same class; b and c both about 3x
    # slower, an island of their own; e 2x faster, alone
    speed = {"a": 1.0, "b": 2.9, "c": 3.2, "d": 0.85, "e": 0.5}
    got = [i.nodes for i in form_islands(profiles, m, speed=speed)]
    assert got == [["a", "d"], ["b", "c"], ["e"]]
    # every node 1.6x slower than it profiled (they share a machine's cores): one island still
    assert [i.nodes for i in form_islands(profiles, m, speed={n: 1.6 for n in profiles})] == [
        ["a", "b", "c", "d", "e"]]
    assert [speed_class(f, 1.25) for f in (1.0, 1.25, 1.3, 0.79, 3.0, 0.5)] == [0, 0, 1, -1, 5, -3]
    assert [i.nodes for i in form_islands(profiles, m, IslandOptions(speed_split=4.0), speed)] == [
        ["a", "b", "c", "d", "e"]]
