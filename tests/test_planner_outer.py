"""Outer mode across regions: replica groups per region, the outer sync, H, the codec and the mode choice."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from atoll.coordinator.planner import PlannerOptions, TrainSpec, parse_cluster, search_plan
from atoll.coordinator.planner.outer import INNER_STEPS_LADDER, MODEST_INNER_STEPS, group_inner_steps
from atoll.coordinator.planner.simulator import simulate_outer
from atoll.launch.cli import main
from atoll.models import preset_spec
from atoll.plan import OuterPlan, Plan
from atoll.serde import plan_from_proto, plan_to_proto

REPO = Path(__file__).resolve().parent.parent
MODEL = preset_spec("1.3b")
TRAIN = TrainSpec(global_batch=512, seq_len=MODEL.config.seq_len)


def _two_regions(gbps: float, latency_ms: float = 80) -> str:
    return f"""
[[group]]
name = "h100-east"
device = "H100"
count = 16
region = "us-east"
inter_node_gbps = 400
[[group]]
name = "a100-west"
device = "A100-80GB"
count = 32
region = "eu-west"
[[link]]
between = ["us-east", "eu-west"]
gbps = {gbps}
latency_ms = {latency_ms}
"""


@pytest.fixture(scope="module")
def at_1g():
    cluster = parse_cluster(_two_regions(1.0), source="1g")
    return cluster, search_plan(MODEL, cluster, TRAIN)


def test_internet_bandwidth_between_regions_trains_in_outer_mode(at_1g) -> None:
    cluster, res = at_1g
    plan = res.plan
    assert plan.mode == "outer" and plan.outer is not None
    assert sorted(g.name for g in plan.groups) == ["eu-west", "us-east"]
    # both regions run: every island hosts a stage, and each group's pipelines stay in its region
    assert {s.island for p in plan.pipelines for s in p.stages} == {"h100-east", "a100-west"}
    for g in plan.groups:
        regions = {cluster.island(s.island).region for k in g.pipelines for s in plan.pipelines[k].stages}
        assert regions == {g.name}
        # each group trains the whole global batch every inner step
        assert sum(plan.pipelines[k].micro_batch * plan.pipelines[k].num_micro_batches for k in g.pipelines) == 512
    assert sorted(k for g in plan.groups for k in g.pipelines) == list(range(len(plan.pipelines)))
    o = plan.outer
    assert o.inner_steps in INNER_STEPS_LADDER
    assert 0 < o.sync_s <= o.round_s  # the exchange hides behind a round
    assert o.bytes_per_round > 0 and o.codec in ("int8", "int4", "sparse2")
    assert plan.predicted.tokens_per_s == pytest.approx(sum(g.tokens_per_s for g in plan.groups))
    assert "outer: 2 groups" in o.reason and "synchronous" in o.reason and "worth less" in o.reason
    # it beats the best single region, and the synchronous plan it was compared with
    east = search_plan(MODEL, cluster.subset(["h100-east"]), TRAIN).plan.predicted.tokens_per_s
    assert plan.predicted.tokens_per_s > 1.3 * east


def test_the_smallest_h_that_hides_is_chosen(at_1g) -> None:
    _, res = at_1g
    o = res.plan.outer
    steps = [g.step_time_s for g in res.plan.groups]
    free = sum(1 / t for t in steps)  # inner steps per second of the groups running apart
    for h in [h for h in INNER_STEPS_LADDER if h < o.inner_steps]:
        # every smaller H on the ladder either leaves the exchange longer than a round or, with whole inner
        # steps per group, trains under 95% of what the groups could
        sim = simulate_outer(steps, group_inner_steps(steps, h), o.sync_s)
        assert o.sync_s > sim.compute_s or sum(sim.steps_per_s) < 0.95 * free


def test_inner_steps_follow_each_group_speed(at_1g) -> None:
    _, res = at_1g
    plan = res.plan
    h = plan.outer.inner_steps
    fastest = min(plan.groups, key=lambda g: g.step_time_s)
    assert fastest.inner_steps == h
    for g in plan.groups:
        assert g.inner_steps >= 1
        assert abs(g.inner_steps - h * fastest.step_time_s / g.step_time_s) <= 1
    assert group_inner_steps([1.0, 2.0, 3.0], 12) == [12, 6, 4]
    assert group_inner_steps([1.0, 10.0], 1) == [1, 1]  # a slower group trains at least one step


def test_outer_plan_validates_and_round_trips(at_1g) -> None:
    _, res = at_1g
    plan = res.plan
    plan.validate(MODEL.num_layers)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert json.loads(again.to_json())["mode"] == "outer"
    back = plan_from_proto(plan_to_proto(plan))
    assert back.mode == "outer" and back.outer is not None and back.outer.inner_steps == plan.outer.inner_steps
    assert [g.pipelines for g in back.groups] == [g.pipelines for g in plan.groups]


def test_fast_links_between_regions_stay_synchronous() -> None:
    res = search_plan(MODEL, parse_cluster(_two_regions(400, 1), source="400g"), TRAIN)
    assert res.plan.mode == "sync" and res.plan.outer is None and not res.plan.groups
    assert {s.island for p in res.plan.pipelines for s in p.stages} == {"h100-east", "a100-west"}
    assert "wide-area" in res.note
    # considered anyway, two like regions with a batch large enough for both halves gain too little over
    # one synchronous step across both
    twins = _two_regions(100, 1).replace('"A100-80GB"', '"H100"').replace("count = 32", "count = 16")
    res = search_plan(MODEL, parse_cluster(twins, source="twins"), replace(TRAIN, global_batch=2048),
                      options=PlannerOptions(outer_wan_gap=1))
    assert res.plan.mode == "sync" and res.note.startswith("sync: replica groups per region would give")
    # the plan carries the reason to the coordinator's log, `atoll status` and the nodes
    assert res.plan.mode_reason == res.note and plan_from_proto(plan_to_proto(res.plan)).mode_reason == res.note


def test_one_region_is_synchronous_whatever_the_mode() -> None:
    cluster = parse_cluster(_two_regions(1.0), source="1g").subset(["h100-east"])
    for mode in ("auto", "outer"):
        assert search_plan(MODEL, cluster, TRAIN, options=PlannerOptions(outer_mode=mode)).plan.mode == "sync"


def test_the_options_force_the_mode() -> None:
    slow = parse_cluster(_two_regions(1.0), source="1g")
    forced_sync = search_plan(MODEL, slow, TRAIN, options=PlannerOptions(outer_mode="sync")).plan
    assert forced_sync.mode == "sync" and forced_sync.outer is None
    fast = parse_cluster(_two_regions(400, 1), source="400g")
    forced = search_plan(MODEL, fast, TRAIN, options=PlannerOptions(outer_mode="outer")).plan
    assert forced.mode == "outer" and len(forced.groups) == 2 and "forced" in forced.outer.reason


def test_the_options_set_h_codec_and_outer_optimizer() -> None:
    cluster = parse_cluster(_two_regions(1.0), source="1g")
    opts = PlannerOptions(outer_mode="outer", outer_inner_steps=7, outer_codec="topk", outer_topk_fraction=0.05,
                          outer_lr=0.7, outer_momentum=0.9, outer_overlap=False, outer_deadline_s=12)
    plan = search_plan(MODEL, cluster, TRAIN, options=opts).plan
    o = plan.outer
    assert (o.inner_steps, o.codec, o.lr, o.momentum, o.overlap, o.deadline_s) == (7, "topk", 0.7, 0.9, False, 12)
    assert o.topk_fraction == pytest.approx(0.05)
    assert max(g.inner_steps for g in plan.groups) == 7
    with pytest.raises(ValueError, match="outer_codec"):
        PlannerOptions(outer_codec="zip")
    with pytest.raises(ValueError, match="outer_inner_steps"):
        PlannerOptions(outer_inner_steps=-1)


def test_the_auto_codec_compresses_harder_as_the_link_slows() -> None:
    lossy = {"int8": 0, "int4": 1, "sparse2": 2}
    got = []
    for gbps in (10.0, 1.0, 0.1):
        plan = search_plan(MODEL, parse_cluster(_two_regions(gbps), source=f"{gbps}g"), TRAIN,
                           options=PlannerOptions(outer_mode="outer")).plan
        got.append((lossy[plan.outer.codec], plan.outer.inner_steps))
    assert got[0][0] == 0  # int8 where the link carries it within a modest H
    assert [c for c, _ in got] == sorted(c for c, _ in got)
    assert got[-1][0] > 0  # 0.1 Gbit/s takes int4 or sparse2


def test_the_auto_codec_takes_sparse2_where_int8_and_int4_cannot_hide(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """At 10 Gbit/s int8 hides behind a modest H; at 0.1 Gbit/s neither int8 nor int4 does, and sparse2 (SparseLoCo's
    1/64 at 2 bits) hides at a small H, sending about 50x fewer bytes a round than int8; `atoll plan` says so."""
    def outer(gbps: float, codec: str = "auto") -> OuterPlan:
        plan = search_plan(MODEL, parse_cluster(_two_regions(gbps), source=f"{gbps}g"), TRAIN,
                           options=PlannerOptions(outer_mode="outer", outer_codec=codec)).plan
        assert plan.outer is not None
        return plan.outer

    fast = outer(10.0)
    assert fast.codec == "int8"
    slow = outer(0.1)
    assert slow.codec == "sparse2" and slow.topk_fraction == pytest.approx(1 / 64)
    assert slow.sync_s <= slow.round_s and slow.inner_steps <= MODEST_INNER_STEPS
    for name in ("int8", "int4"):
        o = outer(0.1, name)
        assert o.inner_steps > MODEST_INNER_STEPS or o.sync_s > o.round_s, (name, o.inner_steps, o.sync_s, o.round_s)
    assert fast.bytes_per_round > 45 * slow.bytes_per_round
    # the plan carries the codec and its fraction to the nodes
    assert plan_from_proto(plan_to_proto(Plan(model="m", global_batch=1, seq_len=1, outer=slow))).outer == slow
    cluster = tmp_path / "slow.toml"
    cluster.write_text(_two_regions(0.1))
    assert main(["plan", "--model", "1.3b", "--global-batch", "512", "--cluster", str(cluster), "--outer", "outer",
                 "--sparse-fraction", "0.03125"]) == 0
    text = capsys.readouterr().out
    assert "sparse2 0.0312 pseudo-gradients" in text and "codec auto: the least lossy of int8, int4, sparse2" in text


def test_simulated_rounds_hide_the_sync_with_overlap_and_expose_it_without() -> None:
    steps, h = [1.0, 2.0], [10, 5]
    hidden = simulate_outer(steps, h, 8.0)
    assert hidden.round_s == pytest.approx(10.0) and hidden.exposed_s == 0.0
    assert hidden.tokens_per_s(100) == pytest.approx((10 + 5) / 10.0 * 100)
    blocking = simulate_outer(steps, h, 8.0, overlap=False)
    assert blocking.round_s == pytest.approx(18.0) and blocking.exposed_s == pytest.approx(8.0)
    # a sync longer than a round: overlapped rounds of one round's delay take (compute + sync) / 2 each
    slow = simulate_outer(steps, h, 14.0)
    assert slow.round_s == pytest.approx(12.0) and slow.exposed_s == pytest.approx(2.0)
    # a faster group cannot run ahead for ever: everyone keeps the slowest group's pace
    uneven = simulate_outer([1.0, 3.0], [10, 4], 1.0, rounds=64)
    assert uneven.round_s == pytest.approx(12.0)
    with pytest.raises(ValueError):
        simulate_outer([1.0], [1, 2], 0.0)


def test_cli_picks_outer_mode_on_two_regions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    cluster = str(REPO / "examples/clusters/two-regions.toml")
    assert main(["plan", "--model", "7b", "--cluster", cluster, "--json", str(out), "--picture", str(png)]) == 0
    text = capsys.readouterr().out
    assert "mode outer" in text and "replica groups:" in text and "reason: outer" in text
    plan = Plan.from_json(out.read_text())
    assert plan.mode == "outer" and {g.name for g in plan.groups} == {"us-east", "eu-west"}
    assert {s.island for p in plan.pipelines for s in p.stages} == {"h100-east", "a100-west"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plan", "--model", "7b", "--cluster", cluster, "--outer", "sync", "--json", str(out)]) == 0
    assert Plan.from_json(out.read_text()).mode == "sync"
    assert main(["plan", "--model", "7b", "--cluster", cluster, "--inner-steps", "50", "--outer-codec", "int4",
                 "--json", str(out)]) == 0
    o = Plan.from_json(out.read_text()).outer
    assert o is not None and (o.inner_steps, o.codec) == (50, "int4")


def test_the_job_outer_section_reaches_the_planner() -> None:
    from atoll.coordinator.islands import form_islands
    from atoll.coordinator.linkmatrix import complete_matrix
    from atoll.coordinator.planning import PlanInputs, make_plan
    from atoll.coordinator.store import MemberRecord
    from atoll.job import JobSpec, OuterSpec
    from atoll.types import LayerTiming, LinkMeasurement, NodeProfile

    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    lt = [LayerTiming(layer_kind=k, micro_batch=b, seq_len=64, forward_seconds=1e-3 * b, backward_seconds=2e-3 * b)
          for k in ("embedding", "block", "head") for b in (2, 4, 8)]
    members = {}
    for n, region in (("a1", "lab-a"), ("a2", "lab-a"), ("b1", "lab-b"), ("b2", "lab-b")):
        members[n] = MemberRecord(node_id=n, peer_address=f"10.0.{len(members)}.1:5000", profile=NodeProfile(
            hostname=n, device_kind="cpu", device_name="cpu", memory_total_bytes=8 << 30, memory_free_bytes=8 << 30,
            layer_timings=lt, region=region))
    ids = sorted(members)

    def inputs(spec: OuterSpec, between: float) -> PlanInputs:
        links = [LinkMeasurement(src=a, dst=b, bandwidth_bytes_per_s=1e9 if a[0] == b[0] else between,
                                 rtt_seconds=1e-3) for a in ids for b in ids if a < b]
        matrix = complete_matrix(ids, links)
        islands = form_islands({n: m.profile for n, m in members.items()}, matrix)
        return PlanInputs(job=replace(job, outer=spec), members=members, islands=islands, matrix=matrix,
                          links=links, epoch=1)

    plan, how = make_plan(inputs(OuterSpec(mode="outer", inner_steps=7, codec="int4", momentum=0.9), 1e9))
    assert how == "planner" and plan.mode == "outer" and plan.outer is not None
    assert (plan.outer.inner_steps, plan.outer.codec, plan.outer.momentum) == (7, "int4", 0.9)
    assert {g.name for g in plan.groups} == {"lab-a", "lab-b"}
    nodes = [{n for k in g.pipelines for s in plan.pipelines[k].stages for n in s.nodes} for g in plan.groups]
    assert nodes[0].isdisjoint(nodes[1])
    assert make_plan(inputs(OuterSpec(mode="sync"), 1e5))[0].mode == "sync"
    # auto on links as fast between the regions as inside them (one machine's loopback): synchronous
    assert make_plan(inputs(OuterSpec(), 1e9))[0].mode == "sync"
