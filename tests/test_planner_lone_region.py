"""A region of one node: its island has no link inside it, so no figure for one. The slowest link measured anywhere
(a wide-area one) stood in for it, made auto mode see every such cluster as "no faster inside its regions than
between them" and plan synchronously on the fastest region alone, and priced the node's interface in the outer sync
at that link."""

from __future__ import annotations

from dataclasses import replace

import pytest

from atoll.coordinator.planner import Cluster, PlannerOptions, ProfileSet, TrainSpec, search_plan
from atoll.coordinator.planner.outer import RegionPlan, codec_spec, sync_cost, wan_gap
from atoll.coordinator.planner.planjob import search_sync
from atoll.models import preset_spec
from atoll.types import LayerTiming, LinkMeasurement, NodeProfile

MODEL = preset_spec("tiny")
TRAIN = TrainSpec(global_batch=16, seq_len=64)
MBIT = 1e6 / 8  # bytes/s
LAN = 1000 * MBIT
# the tiny model's layers at micro-batch 4 as a core measured them (seconds forward, backward)
CORE = {"embedding": (1.4e-4, 2.2e-4), "block": (1.3e-3, 2.0e-3), "head": (4.5e-4, 5.7e-4)}


def _profile(share: float) -> NodeProfile:
    """A node given `share` of a core (the testbed's CPU quotas)."""
    return NodeProfile(device_kind="cpu", device_name="cpu", memory_total_bytes=8 * 10**9,
                       optimizer_step_seconds=1.7e-3 / share,
                       layer_timings=[LayerTiming(layer_kind=k, micro_batch=4, seq_len=64, forward_seconds=f / share,
                                                  backward_seconds=b / share) for k, (f, b) in CORE.items()])


def _cluster(regions: dict[str, tuple[int, float]], wan: dict[frozenset[str], float]
             ) -> tuple[Cluster, dict[str, list[str]], dict[str, NodeProfile]]:
    """Live islands, one per region ({region: (nodes, share of a core)}), every pair of nodes measured: LAN inside a
    region, `wan[{a, b}]` bytes/s between regions a and b."""
    nodes = {r: [f"{r}-{j}" for j in range(n)] for r, (n, _) in regions.items()}
    profiles = {x: _profile(share) for r, (_, share) in regions.items() for x in nodes[r]}
    region_of = {x: r for r, xs in nodes.items() for x in xs}
    ids = list(region_of)
    links = []
    for k, a in enumerate(ids):
        for b in ids[k + 1:]:
            ra, rb = region_of[a], region_of[b]
            bw, rtt = (LAN, 2e-4) if ra == rb else (wan[frozenset((ra, rb))], 0.2)
            links += [LinkMeasurement(src=a, dst=b, bandwidth_bytes_per_s=bw, rtt_seconds=rtt),
                      LinkMeasurement(src=b, dst=a, bandwidth_bytes_per_s=bw, rtt_seconds=rtt)]
    return Cluster.from_nodes(nodes, profiles, links, regions={r: r for r in nodes}), nodes, profiles


# the testbed: regions of 2, 2 and 1 hosts at 0.35, 0.2 and 0.15 of a core, links of 20, 10 and 5 Mbit/s
GEO = {"lab-a": (2, 0.35), "lab-b": (2, 0.2), "lab-c": (1, 0.15)}
GEO_WAN = {frozenset(("lab-a", "lab-b")): 20 * MBIT, frozenset(("lab-a", "lab-c")): 10 * MBIT,
           frozenset(("lab-b", "lab-c")): 5 * MBIT}


def test_a_one_node_island_has_no_inner_link_figure() -> None:
    cluster, _, _ = _cluster(GEO, GEO_WAN)
    lone = cluster.island("lab-c")
    assert lone.gpus == 1
    # no link inside it was measured, nor made up from the 5 Mbit/s link between lab-b and lab-c
    assert lone.inter_node_bandwidth is None and lone.intra_node_bandwidth is None
    assert cluster.link("lab-c", "lab-c") is None
    assert cluster.island("lab-a").inter_node_bandwidth == LAN  # a measured link inside stays
    assert cluster.link("lab-a", "lab-a").bandwidth == LAN
    # auto mode compares the slowest link between regions with the slowest measured inside one
    assert wan_gap(cluster) == (5 * MBIT, LAN)
    # its interface in the outer sync: the fastest link measured from the node
    from atoll.coordinator.planner.outer import nic_bandwidth

    assert nic_bandwidth(cluster, "lab-c") == 10 * MBIT
    assert nic_bandwidth(cluster, "lab-a") == LAN
    # regions of one node each: no link inside any region, and nothing for the gap to compare with
    alone, _, _ = _cluster({"x": (1, 1.0), "y": (1, 1.0)}, {frozenset("xy"): 5 * MBIT})
    assert wan_gap(alone) == (5 * MBIT, None)
    # a figure it has not got is not asked of an island of several hosts
    with pytest.raises(ValueError, match="need an inter-node bandwidth"):
        replace(cluster.island("lab-a"), inter_node_bandwidth=None)


def test_auto_mode_trains_every_region_when_one_has_a_single_node() -> None:
    cluster, nodes, profiles = _cluster(GEO, GEO_WAN)
    timings = ProfileSet.from_node_profiles(nodes, profiles, MODEL.block_params)
    options = PlannerOptions(micro_batches=(4,), equal_widths=False, outer_mode="auto")
    res = search_plan(MODEL, cluster, TRAIN, timings, options)
    plan = res.plan
    # inside each region of two hosts the links are 50x faster than the fastest between regions: wide-area links,
    # and replica groups beat the synchronous plan (which trains on lab-a alone: its other links are too slow)
    assert plan.mode == "outer", plan.mode_reason
    assert sorted(g.name for g in plan.groups) == ["lab-a", "lab-b", "lab-c"]
    assert plan.idle == []
    used = {n for p in plan.pipelines for s in p.stages for n in s.nodes}
    assert used == {n for ns in nodes.values() for n in ns}
    # the faster the region, the more inner steps it trains per round
    steps = {g.name: g.inner_steps for g in plan.groups}
    assert steps["lab-a"] > steps["lab-b"] > steps["lab-c"] >= 1
    sync = search_sync(MODEL, cluster, TRAIN, timings, options).plan
    assert plan.predicted.tokens_per_s >= options.outer_min_gain * sync.predicted.tokens_per_s


def test_the_outer_sync_prices_a_lone_node_at_its_measured_links() -> None:
    """lab-c's node sends its whole replica to two groups through its own interface, priced at the fastest link
    measured from it (20 Mbit/s), not at the slowest link measured anywhere (2 Mbit/s, between lab-a and lab-b,
    whose exchange goes the wider way, through lab-c's region): that took ten times as long."""
    wan = {frozenset(("lab-a", "lab-b")): 2 * MBIT, frozenset(("lab-a", "lab-c")): 20 * MBIT,
           frozenset(("lab-b", "lab-c")): 20 * MBIT}
    cluster, nodes, profiles = _cluster(GEO, wan)
    timings = ProfileSet.from_node_profiles(nodes, profiles, MODEL.block_params)
    options = PlannerOptions(micro_batches=(4,), equal_widths=False)
    groups = [RegionPlan(region=r, result=search_sync(MODEL, cluster.subset([r]), TRAIN, timings, options))
              for r in ("lab-a", "lab-b", "lab-c")]
    cost = sync_cost(groups, cluster, MODEL, codec_spec("int8", options))
    assert cost is not None
    whole = cost.bytes_per_group / 2  # a group's replica, encoded, to each of the two others
    assert cost.link == "the network interfaces of lab-c, 0.02 Gbit/s"
    # two replicas through its 20 Mbit/s, then the longest route's one-way latency (lab-a, lab-c, lab-b: 2 x 0.1 s)
    assert cost.seconds == pytest.approx(2 * whole / (20 * MBIT) + 0.2, rel=1e-6)
