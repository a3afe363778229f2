"""The planner: optimality against brute force, feasibility, errors, live clusters, the plan's shape."""

from __future__ import annotations

import itertools
import math

import pytest

from atoll.coordinator.planner import (Cluster, NoFeasiblePlan, PlannerOptions, TrainSpec, parse_cluster, plan_job,
                                       search_plan)
from atoll.coordinator.planner.composer import Composer
from atoll.coordinator.planner.report import format_plan
from atoll.coordinator.planner.costmodel import CostModel
from atoll.coordinator.planner.parallelizer import SliceQuery
from atoll.models import preset_spec
from atoll.modelspec import ModelConfig, ModelSpec
from atoll.plan import Plan, lane_in_flight, lane_warmups
from atoll.serde import plan_from_proto, plan_to_proto
from atoll.types import LayerTiming, LinkMeasurement, NodeProfile

# 6 blocks + embedding + head; big enough that a few GB of device memory binds
SMALL = ModelSpec.from_config(ModelConfig(name="t8", vocab_size=8000, d_model=1024, n_layers=6, n_heads=8,
                                          seq_len=512))


def _two_islands(mem_fast: float, mem_slow: float, fast: int = 4, slow: int = 8, link_gbps: float = 10) -> Cluster:
    return parse_cluster(f"""
[[group]]
name = "fast"
tflops = 100
memory_gb = {mem_fast}
count = {fast}
gpus_per_node = 4
[[group]]
name = "slow"
tflops = 30
memory_gb = {mem_slow}
count = {slow}
gpus_per_node = 4
inter_node_gbps = {link_gbps}
""")


def _brute_bottleneck(comp: Composer, s) -> float:
    """Min over every choice of stages per island (0..cap) and every contiguous split of the layers (a laned stage
    at its pace, each lane holding its share of the micro-batches in flight, `atoll.plan.lane_warmups`)."""
    cm = comp.cost_model
    L = cm.num_layers
    best = math.inf
    for counts in itertools.product(*[range(c + 1) for c in s.caps]):
        seq = [i for i, c in enumerate(counts) for _ in range(c)]  # chain indices of the islands, in order
        p = len(seq)
        if p == 0 or p > L:
            continue
        warm = lane_warmups([s.lane(i) for i in seq])  # strict 1F1B's p - n - 1 without lanes
        for cuts in itertools.combinations(range(1, L), p - 1):
            bounds = (0, *cuts, L)
            worst = 0.0
            for n, i in enumerate(seq):
                lanes = s.lane(i)
                c = comp.parallelizer.cost(SliceQuery(start=bounds[n], end=bounds[n + 1], micro_batch=s.per_replica(i),
                                                      dp=s.lane_width(i), lanes=lanes, batch=s.batch,
                                                      in_flight=lane_in_flight(warm[n], lanes, s.m)),
                                           s.order[i])
                if c is None:
                    worst = math.inf
                    break
                worst = max(worst, c.pace_s)
                if n + 1 < p:
                    worst = max(worst, comp._fastest_link(s, i, seq[n + 1], bounds[n + 1]))
            best = min(best, worst)
    return best


@pytest.mark.parametrize("mem_fast,mem_slow,link", [(40, 40, 10), (1.2, 0.9, 10), (0.9, 0.7, 10), (2, 2, 0.05)])
def test_min_bottleneck_equals_brute_force(mem_fast: float, mem_slow: float, link: float) -> None:
    cluster = _two_islands(mem_fast, mem_slow, link_gbps=link)
    cm = CostModel(SMALL, TrainSpec(global_batch=32, seq_len=512))
    comp = Composer(cost_model=cm, cluster=cluster)
    checked = 0
    for s in comp.setups():
        if max(s.caps) > 4 or s.batch > 16:
            continue
        got = comp.min_bottleneck(s, rel_tol=1e-6)
        want = _brute_bottleneck(comp, s)
        if math.isinf(want):
            assert got is None
        else:
            assert got is not None and got == pytest.approx(want, rel=1e-4), (s.order, s.widths, s.batch)
            checked += 1
    assert checked >= 4


def test_mixed_cluster_beats_either_class_alone() -> None:
    cluster = _two_islands(40, 40, fast=8, slow=16, link_gbps=100)
    train = TrainSpec(global_batch=256, seq_len=512)
    both = plan_job(SMALL, cluster, train)
    alone = [plan_job(SMALL, cluster.subset([i]), train) for i in ("fast", "slow")]
    assert both.predicted.tokens_per_s > max(p.predicted.tokens_per_s for p in alone)
    assert {s.island for p in both.pipelines for s in p.stages} == {"fast", "slow"}


def test_plan_covers_layers_fits_memory_and_round_trips() -> None:
    cluster = _two_islands(1.2, 0.9)
    result = search_plan(SMALL, cluster, TrainSpec(global_batch=32, seq_len=512))
    plan = result.plan
    plan.validate(SMALL.num_layers)
    usable = {"fast": 1.2 * 0.9, "slow": 0.9 * 0.9}
    for s in plan.pipelines[0].stages:
        assert s.memory_gb_per_device <= usable[s.island] + 1e-9
    pl = plan.pipelines[0]
    assert pl.micro_batch * pl.num_micro_batches == plan.global_batch
    assert all(pl.micro_batch % s.dp == 0 for s in pl.stages)
    assert plan.predicted.step_time_s > 0 and plan.predicted.tokens_per_s == pytest.approx(
        32 * 512 / plan.predicted.step_time_s)
    assert plan.predicted.bottleneck
    assert Plan.from_json(plan.to_json()).to_json_dict() == plan.to_json_dict()
    assert plan_from_proto(plan_to_proto(plan)).pipelines[0].stages[0].layers == pl.stages[0].layers


def test_fits_nowhere_names_the_shortfall() -> None:
    tiny = parse_cluster('[[group]]\nname = "t4"\ndevice = "T4"\ncount = 2\n', source="two-t4.toml")
    with pytest.raises(NoFeasiblePlan, match=r"needs [\d.]+ GB .* offer [\d.]+ GB") as e:
        plan_job(preset_spec("70b"), tiny, TrainSpec(global_batch=8, seq_len=4096))
    assert "two-t4.toml" in str(e.value)


def test_compression_kicks_in_on_a_slow_link() -> None:
    fast = search_plan(SMALL, _two_islands(0.5, 0.5, fast=2, slow=2, link_gbps=100), TrainSpec(global_batch=32, seq_len=512)).plan
    slow = search_plan(SMALL, _two_islands(0.5, 0.5, fast=2, slow=2, link_gbps=0.2), TrainSpec(global_batch=32, seq_len=512)).plan
    # the links between the islands (stages on one island pass activations within a node)
    codecs = lambda p: {s.send.codec for s, t in zip(p.pipelines[0].stages, p.pipelines[0].stages[1:])  # noqa: E731
                        if s.send and s.island != t.island}
    assert codecs(slow) and codecs(slow) <= {"int8"}
    assert "int8" not in codecs(fast)
    only_identity = PlannerOptions(activation_codecs=("identity",))
    plain = search_plan(SMALL, _two_islands(0.5, 0.5, fast=2, slow=2, link_gbps=0.2), TrainSpec(global_batch=32, seq_len=512),
                        options=only_identity).plan
    assert plain.predicted.step_time_s > slow.predicted.step_time_s


def test_live_cluster_from_nodes_and_profiles() -> None:
    from atoll.coordinator.planner import ProfileSet

    tiny = preset_spec("tiny")
    nodes = {"a": ["n1", "n2"], "b": ["n3"]}
    timings = lambda scale: [LayerTiming(layer_kind=k, micro_batch=1, seq_len=64, forward_seconds=0.01 * scale,  # noqa: E731
                                         backward_seconds=0.02 * scale) for k in ("embedding", "block", "head")]
    profiles = {n: NodeProfile(device_kind="cpu", device_name="cpu", memory_total_bytes=8 * 10**9,
                               layer_timings=timings(1.0 if n != "n3" else 3.0)) for n in ("n1", "n2", "n3")}
    links = [LinkMeasurement(src="n1", dst="n2", bandwidth_bytes_per_s=1e9, rtt_seconds=1e-4),
             LinkMeasurement(src="n1", dst="n3", bandwidth_bytes_per_s=1e8, rtt_seconds=1e-3),
             LinkMeasurement(src="n2", dst="n3", bandwidth_bytes_per_s=1e8, rtt_seconds=1e-3)]
    cluster = Cluster.from_nodes(nodes, profiles, links)
    assert cluster.link("a", "b").bandwidth == 1e8
    ps = ProfileSet.from_node_profiles(nodes, profiles)
    plan = plan_job(tiny, cluster, TrainSpec(global_batch=8, seq_len=64), ps)
    plan.validate(tiny.num_layers)
    for s in plan.pipelines[0].stages:
        assert len(s.nodes) == s.dp and set(s.nodes) <= set(nodes[s.island])
    used = [n for s in plan.pipelines[0].stages for n in s.nodes]
    assert len(used) == len(set(used))


def test_a_nodes_measured_optimizer_step_prices_the_islands_optimizer() -> None:
    """A node times an AdamW step over one block's parameters (`NodeProfile.optimizer_step_seconds`); the island
    steps at its slowest node's seconds per parameter, where the catalog's bandwidth figure stood before."""
    from atoll.coordinator.planner import ProfileSet
    from atoll.coordinator.planner.costmodel import CostModel

    tiny = preset_spec("tiny")
    timings = [LayerTiming(layer_kind=k, micro_batch=1, seq_len=64, forward_seconds=0.01, backward_seconds=0.02)
               for k in ("embedding", "block", "head")]
    profiles = {n: NodeProfile(device_kind="cpu", device_name="cpu", memory_total_bytes=8 * 10**9,
                               layer_timings=timings, optimizer_step_seconds=s) for n, s in (("x", 0.002), ("y", 0.003))}
    islands = {"a": ["x", "y"]}
    cluster = Cluster.from_nodes(islands, profiles, [LinkMeasurement(src="x", dst="y", bandwidth_bytes_per_s=1e9,
                                                                     rtt_seconds=1e-4)])
    assert tiny.block_params == tiny.layers[1].params > 0
    ps = ProfileSet.from_node_profiles(islands, profiles, tiny.block_params)
    assert ps.get("a").optimizer_s_per_gparam == pytest.approx(0.003 * 1e9 / tiny.block_params)
    cm = CostModel(tiny, TrainSpec(global_batch=8, seq_len=64), ps)
    island = cluster.islands[0]
    assert cm.optimizer_seconds(island, 4 * tiny.block_params, zero=0, group=1) == pytest.approx(0.012)
    assert ProfileSet.from_node_profiles(islands, profiles).get("a").optimizer_s_per_gparam == 0  # not asked for
    with pytest.raises(ValueError, match="optimizer_s_per_gparam"):
        ProfileSet.from_dict({"devices": {"x": {"layers": {}, "optimizer_s_per_gparam": -1}}})
    # the plan's step counts it
    with_opt = plan_job(tiny, cluster, TrainSpec(global_batch=8, seq_len=64), ps)
    without = plan_job(tiny, cluster, TrainSpec(global_batch=8, seq_len=64), ProfileSet.from_node_profiles(islands, profiles))
    assert with_opt.predicted.step_time_s > without.predicted.step_time_s


def test_live_cluster_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="no profile for node"):
        Cluster.from_nodes({"a": ["x"]}, {}, [LinkMeasurement(src="x", dst="y", bandwidth_bytes_per_s=1,
                                                              rtt_seconds=0)])
    with pytest.raises(ValueError, match="no link measurements"):
        Cluster.from_nodes({"a": ["x", "y"]}, {n: NodeProfile(memory_total_bytes=1) for n in "xy"}, [])


def test_a_lone_node_is_planned_without_link_measurements() -> None:
    """One node has no pair to probe (a region left with one node after a failure): the planner places it,
    where it had fallen back to an even split for want of a link figure."""
    from atoll.coordinator.planner import ProfileSet

    tiny = preset_spec("tiny")
    timings = [LayerTiming(layer_kind=k, micro_batch=1, seq_len=64, forward_seconds=0.01, backward_seconds=0.02)
               for k in ("embedding", "block", "head")]
    profiles = {"x": NodeProfile(device_kind="cpu", device_name="cpu", memory_total_bytes=8 * 10**9,
                                 layer_timings=timings)}
    cluster = Cluster.from_nodes({"a": ["x"]}, profiles, [])
    plan = plan_job(tiny, cluster, TrainSpec(global_batch=8, seq_len=64),
                    ProfileSet.from_node_profiles({"a": ["x"]}, profiles))
    plan.validate(tiny.num_layers)
    assert [s.nodes for s in plan.pipelines[0].stages] == [["x"]] and plan.predicted.step_time_s > 0


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="achievable_fraction"):
        PlannerOptions(achievable_fraction=0)
    with pytest.raises(ValueError, match="activation_codecs"):
        PlannerOptions(activation_codecs=("zip",))
    with pytest.raises(ValueError, match="global_batch"):
        TrainSpec(global_batch=0, seq_len=8)


@pytest.mark.parametrize("raw,bw,overlap", [(2_000_000, 1e8, 0.005), (2_000_000, 1e8, 0.03), (64 << 20, 1e10, 1e-3),
                                            (10_000, 1e6, 1.0)])
def test_default_codecs_agree_with_the_compression_policy(raw: int, bw: float, overlap: float) -> None:
    import torch

    from atoll.coordinator.planner.codecpolicy import PolicyCodecModel

    model = PolicyCodecModel()
    codec, sec = model.choose(raw, 2, bw, 1e-3, overlap)
    d = model.policy(bw, 1e-3).choose(raw, "activation", overlap, dtype=torch.bfloat16)
    assert (codec, sec) == (d.spec.codec, pytest.approx(d.predicted_seconds))


def test_measured_profiles_override_the_catalog(tmp_path) -> None:
    from atoll.coordinator.planner import ProfileSet

    cluster = _two_islands(40, 40, fast=4, slow=4, link_gbps=100)
    train = TrainSpec(global_batch=32, seq_len=512)
    # "slow" measured: every layer takes 1 ms forward and 2 ms backward per 512 tokens
    doc = {"devices": {"slow": {"layers": {k: [{"micro_batch": 1, "seq_len": 512, "forward_s": 0.001,
                                                "backward_s": 0.002}] for k in ("embedding", "block", "head")}}}}
    path = tmp_path / "profiles.json"
    path.write_text(__import__("json").dumps(doc))
    ps = ProfileSet.load(path)
    cm = CostModel(SMALL, train, ps)
    slow = cluster.island("slow")
    t = cm.table(slow, 2)  # 1024 tokens: twice the measured time
    assert t.fwd == pytest.approx([0.002] * SMALL.num_layers) and t.bwd == pytest.approx([0.004] * SMALL.num_layers)
    plan = plan_job(SMALL, cluster.subset(["slow"]), train, ps)
    st = plan.pipelines[0].stages[0]
    per_replica = plan.pipelines[0].micro_batch // st.dp
    layers = st.layers[1] - st.layers[0]
    assert st.compute_s == pytest.approx(layers * 0.003 * per_replica, rel=1e-6)
    with pytest.raises(ValueError, match="unknown layer kind"):
        ProfileSet.from_dict({"devices": {"x": {"layers": {"mlp": []}}}})
    with pytest.raises(ValueError, match="needs micro_batch"):
        ProfileSet.from_dict({"devices": {"x": {"layers": {"block": [{"micro_batch": 1}]}}}})


def test_several_pipelines_split_the_batch_and_count_the_cross_all_reduce() -> None:
    from atoll.coordinator.planner.multipipe import several_pipelines

    cluster = _two_islands(40, 40, fast=8, slow=16, link_gbps=100)
    cm = CostModel(SMALL, TrainSpec(global_batch=256, seq_len=512))
    multi = several_pipelines(cm, cluster, [["fast"], ["slow"]])
    assert multi is not None and sum(multi.shares) == 256
    assert all(c.micro_batch * c.num_micro_batches == s for c, s in zip(multi.pipelines, multi.shares))
    assert all(x > 0 for per in multi.cross_sync_s for x in per)
    # each stage averages with the other pipelines' holders of its layers, which the runtime does without ZeRO
    assert all(st.cost.zero == 0 for c in multi.pipelines for st in c.stages)
    # a slower link between the islands makes the same split dearer
    slow_link = several_pipelines(cm, _two_islands(40, 40, fast=8, slow=16, link_gbps=1), [["fast"], ["slow"]])
    assert slow_link is not None and slow_link.step_s > multi.step_s


def test_equal_widths_and_single_pipeline_options() -> None:
    cluster = _two_islands(40, 40, fast=8, slow=16, link_gbps=100)
    opts = PlannerOptions(equal_widths=True, several_pipelines=False)
    plan = plan_job(SMALL, cluster, TrainSpec(global_batch=256, seq_len=512), options=opts)
    assert len(plan.pipelines) == 1
    assert len({s.dp for s in plan.pipelines[0].stages}) == 1



def test_several_pipelines_refine_a_coarse_batch_split() -> None:
    from atoll.coordinator.planner.multipipe import several_pipelines

    cluster = parse_cluster("""
[[group]]
name = "a100"
device = "A100-40GB"
count = 4
inter_node_gbps = 25
[[group]]
name = "v100"
device = "V100-16GB"
count = 4
inter_node_gbps = 25
""")
    cm = CostModel(preset_spec("350m"), TrainSpec(global_batch=512, seq_len=1024))
    coarse = several_pipelines(cm, cluster, [["a100"], ["v100"]], refine_below_s=0.0)
    fine = several_pipelines(cm, cluster, [["a100"], ["v100"]])
    assert coarse is not None and fine is not None
    assert coarse.shares == [384, 128]  # granules of 64 sequences
    # the A100s are about 2.5x as fast: a finer granule moves sequences to the V100s and shortens the step
    assert fine.shares[1] > 128 and sum(fine.shares) == 512
    assert fine.step_s < coarse.step_s
    assert all(c.micro_batch * c.num_micro_batches == s for c, s in zip(fine.pipelines, fine.shares))
    # a split that even perfectly shared work could not bring under the single pipeline is given up early
    assert several_pipelines(cm, cluster, [["a100"], ["v100"]], beat_s=0.5 * fine.step_s) is None


def test_the_capacity_bound_gives_up_on_several_pipelines_before_composing_them(monkeypatch) -> None:
    from atoll.coordinator.planner import multipipe
    from atoll.coordinator.planner.multipipe import capacity_bound_s, several_pipelines, slowest_link

    two_regions = """
[[group]]
name = "a100"
device = "A100-40GB"
count = 4
region = "east"
[[group]]
name = "v100"
device = "V100-16GB"
count = 4
region = "west"
[[link]]
between = ["east", "west"]
gbps = 1
latency_ms = 40
"""
    cluster = parse_cluster(two_regions)
    groups = [["a100"], ["v100"]]
    cm = CostModel(preset_spec("350m"), TrainSpec(global_batch=512, seq_len=1024))
    multi = several_pipelines(cm, cluster, groups)
    assert multi is not None
    bound = capacity_bound_s(cm, cluster, groups, None, slowest_link(cluster, groups))
    # no split beats it: every GPU at its best shape, plus the gradients over the shared region link
    assert 0 < bound <= multi.step_s
    link = slowest_link(cluster, groups)
    assert link.shared and bound > 2 * 0.5 * cm.model.total_params * cm.grad_bytes_per_param / link.bandwidth
    # a target under the bound is given up without composing a single pipeline
    composed = []
    monkeypatch.setattr(multipipe, "Composer", lambda **kw: composed.append(kw) or pytest.fail("composed"))
    assert several_pipelines(cm, cluster, groups, beat_s=0.99 * bound) is None and not composed
    # measured profiles may make a device relatively faster at some layers: no bound then
    from atoll.coordinator.planner import ProfileSet
    ps = ProfileSet.from_dict({"devices": {"V100-16GB": {"layers": {k: [{"micro_batch": 1, "seq_len": 1024,
                                                                          "forward_s": 0.001, "backward_s": 0.002}]
                                                                      for k in ("embedding", "block", "head")}}}})
    measured = CostModel(preset_spec("350m"), TrainSpec(global_batch=512, seq_len=1024), ps)
    assert capacity_bound_s(measured, cluster, groups, None, link) == 0.0


def test_island_chains_also_run_from_the_slowest_class_to_the_fastest() -> None:
    # the fast island has more memory, so the memory order puts it first; the other order puts it last
    cluster = _two_islands(40, 20, fast=4, slow=8)
    comp = Composer(cost_model=CostModel(SMALL, TrainSpec(global_batch=32, seq_len=512)), cluster=cluster)
    chains = [tuple(i.id for i in o) for o in comp.orders()]
    assert ("fast", "slow") in chains and ("slow", "fast") in chains
    assert len(chains) == len(set(chains))

    # a small cluster tries every order of a region's islands
    three = parse_cluster("""
[[group]]
name = "a"
tflops = 100
memory_gb = 40
count = 4
[[group]]
name = "b"
tflops = 50
memory_gb = 20
count = 4
[[group]]
name = "c"
tflops = 25
memory_gb = 30
count = 4
""")
    comp = Composer(cost_model=CostModel(SMALL, TrainSpec(global_batch=32, seq_len=512)), cluster=three)
    full = {tuple(i.id for i in o) for o in comp.orders() if len(o) == 3}
    assert full == set(itertools.permutations("abc"))


def test_one_gpu_machines_and_a_small_batch_run_in_lanes_and_the_runtime_places_them(monkeypatch) -> None:
    """32 machines of one GPU each (no tensor parallelism), a global batch of 16: a stage of 4 devices cannot
    share a micro-batch of 2 sequences, so the planner runs it in 2 lanes of 2 (micro-batch i on lane i % 2) and
    keeps the pipeline's 8 micro-batches, which simulates faster than the best plan without lanes (micro-batches
    of 4). Every node of the plan finds its place, with its lane."""
    import atoll.coordinator.planner.composer as composer
    from atoll.node.placement import place

    cluster = parse_cluster("[[group]]\nname = \"v\"\ndevice = \"RTX4090\"\ncount = 32\ngpus_per_node = 1\n"
                            "inter_node_gbps = 25\nintra_node_gbps = 64\n")
    model = preset_spec("350m")
    train = TrainSpec(global_batch=16, seq_len=model.config.seq_len)
    # under the cluster's figures alone: the robust choice may prefer the plan without lanes, whose fewer
    # transfers lose less where the links are slower than the file says (tests/test_planner_robust.py)
    nominal = PlannerOptions(band=())
    laned = search_plan(model, cluster, train, options=nominal).plan
    monkeypatch.setattr(composer, "MAX_LANES", 1)
    plain = search_plan(model, cluster, train, options=nominal).plan
    assert all(s.lanes == 1 for p in plain.pipelines for s in p.stages)
    assert laned.predicted.tokens_per_s > plain.predicted.tokens_per_s
    pipe = laned.pipelines[0]
    assert any(s.lanes > 1 for s in pipe.stages)
    names = iter(f"n{k}" for k in range(32))
    for s in pipe.stages:
        assert s.dp // s.lanes <= pipe.micro_batch < s.dp and pipe.num_micro_batches % s.lanes == 0
        s.nodes = [next(names) for _ in range(s.dp * s.tp)]
    laned.validate(model.num_layers)
    for s in pipe.stages:
        for r, n in enumerate(s.nodes):
            pl = place(laned, n, model.num_layers)
            assert pl is not None and pl.lane == r // (s.dp // s.lanes)
    assert "lanes" in format_plan(laned)


def test_a_micro_batch_under_the_profiled_sizes_keeps_the_per_call_cost() -> None:
    """A CPU node profiled at 128, 256 and 512 tokens a layer: a plan of 64-token micro-batches is priced along the
    line through the two smallest measurements (what each call costs regardless of its size stays), not scaled to
    zero (which read the run 2x faster than it went); a superlinear pair falls back to proportional, a noisy
    inverted one to the smallest measurement; between and above the measurements, as before."""
    from atoll.coordinator.planner.profiles import DeviceProfile, TimingPoint

    cpu = DeviceProfile(layers={"block": (TimingPoint(tokens=128, forward_s=0.006, backward_s=0.012),
                                          TimingPoint(tokens=256, forward_s=0.010, backward_s=0.020),
                                          TimingPoint(tokens=512, forward_s=0.018, backward_s=0.036))})
    assert cpu.layer_seconds("block", 64) == pytest.approx((0.004, 0.008))  # 0.002 + 64 x 3.1e-5, not 0.003
    assert cpu.layer_seconds("block", 192) == pytest.approx((0.008, 0.016))
    assert cpu.layer_seconds("block", 1024) == pytest.approx((0.036, 0.072))
    steep = DeviceProfile(layers={"block": (TimingPoint(tokens=128, forward_s=0.001, backward_s=0.002),
                                            TimingPoint(tokens=256, forward_s=0.004, backward_s=0.008))})
    assert steep.layer_seconds("block", 64) == pytest.approx((0.0005, 0.001))
    inverted = DeviceProfile(layers={"block": (TimingPoint(tokens=128, forward_s=0.004, backward_s=0.008),
                                               TimingPoint(tokens=256, forward_s=0.003, backward_s=0.007))})
    assert inverted.layer_seconds("block", 64) == pytest.approx((0.004, 0.008))
    assert DeviceProfile(layers={"block": (TimingPoint(tokens=128, forward_s=0.004, backward_s=0.008),)}
                         ).layer_seconds("block", 64) == pytest.approx((0.002, 0.004))
