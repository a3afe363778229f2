"""The robust choice over a band of network models (`coordinator.planner.robust`), the network models in the cost
model, and the fixes that came with them: equal widths in split chains, boundaries priced where the replicas sit."""

from __future__ import annotations

import pytest

from atoll.coordinator.planner import CostModel, PlannerOptions, TrainSpec, parse_cluster, search_plan
from atoll.coordinator.planner.composer import Composer, _Setup, split_island
from atoll.coordinator.planner.network import NOMINAL, PESSIMISTIC, NetworkModel
from atoll.coordinator.planner.robust import Scored, as_model, best_steps, choose, with_network
from atoll.models import preset_spec

MIXED = ('[[group]]\nname = "a100"\ndevice = "A100-40GB"\ncount = 8\ngpus_per_node = 4\ninter_node_gbps = 25\n'
         '[[group]]\nname = "v100"\ndevice = "V100-16GB"\ncount = 8\ngpus_per_node = 4\ninter_node_gbps = 25\n')


def _scored(nominal: float, pessimistic: float, gpus: int = 16) -> Scored:
    return Scored(steps={"nominal": nominal, "pessimistic": pessimistic}, gpus=gpus)


def test_the_choice_is_the_least_worst_case_regret() -> None:
    fast_but_fragile, balanced, safe_but_slow = _scored(1.0, 2.0), _scored(1.05, 1.2), _scored(1.3, 1.15)
    pool = [fast_but_fragile, balanced, safe_but_slow]
    best = best_steps(pool)
    assert best == {"nominal": 1.0, "pessimistic": 1.15}
    worst = {id(s): s.worst(best) for s in pool}
    pick, why = choose(pool, "nominal", 16, budget=0.0)
    assert pick is balanced and worst[id(pick)] == min(worst.values()) and "regret" in why
    # within a budget of 5%, the fastest under the nominal model: a plan 1% slower nominally and safe enough wins
    # over the least-regret one only where that one is slower nominally
    close = _scored(1.01, 1.18)  # worst regret 2.6%
    assert choose([*pool, close], "nominal", 16)[0] is close
    assert choose([*pool, close], "nominal", 16, budget=0.0)[0] is close  # also the least regret here
    # nothing within 5%: within a point of the least
    far = [_scored(1.0, 2.0), _scored(1.2, 1.5), _scored(1.3, 1.0)]  # worst 33%, 33.3%, 23%
    assert choose(far, "nominal", 16)[0] is far[2]
    # a band of one model is the fastest plan
    only = [Scored(steps={"nominal": s.steps["nominal"]}, gpus=16) for s in pool]
    assert choose(only, "nominal", 16)[0] is only[0]


def test_a_plan_idling_a_tenth_of_the_devices_must_beat_the_one_using_them_under_every_model() -> None:
    idle = _scored(1.1, 1.2, gpus=12)  # least regret, 4 of 16 devices idle
    using = _scored(1.0, 1.5, gpus=16)
    pick, why = choose([idle, using], "nominal", 16)
    assert pick is using and "runs 16 of 16" in why and "nominal" in why
    # it beats the plan using them under both models: kept
    better = _scored(0.9, 1.2, gpus=12)
    assert choose([better, using], "nominal", 16)[0] is better
    # under the tenth: no rule
    few = _scored(1.1, 1.2, gpus=15)
    assert choose([few, using], "nominal", 16)[0] is few


def test_network_models_price_cross_node_collectives_and_transfers_only() -> None:
    cluster = parse_cluster(MIXED)
    isl = cluster.islands[0]
    cm = CostModel(preset_spec("350m"), TrainSpec(global_batch=64, seq_len=1024))
    pess = with_network(cm, PESSIMISTIC)
    assert pess.table(isl, 1) is cm.table(isl, 1)  # layer tables are shared: no network changes them
    # inside one node: unchanged
    assert pess.allreduce_seconds(1e8, 4, isl) == cm.allreduce_seconds(1e8, 4, isl)
    # across nodes: a flat ring at the per-GPU figure (one flow per node), 2 (N-1) hops of latency: on nodes of 4
    # GPUs, about 4x the hierarchical all-reduce's cross-node part
    eff = cm.options.link_efficiency
    flat = 2 * 7 / 8 * 1e8 / (isl.inter_node_bandwidth * eff) + 14 * isl.latency_s
    assert pess.allreduce_seconds(1e8, 8, isl) == pytest.approx(flat)
    assert 3 * cm.allreduce_seconds(1e8, 8, isl) < pess.allreduce_seconds(1e8, 8, isl)
    # a fitted collective scale slows the cross-node ring only: the intra-node reduce-scatter and all-gather stay
    quarter = with_network(cm, NetworkModel(name="q", collective_scale=0.25))
    g, k, inter, intra = 4, 2, isl.inter_node_bandwidth * eff, isl.intra_node_bandwidth * eff
    assert quarter.allreduce_seconds(1e8, 8, isl) == pytest.approx(
        2 * (g - 1) / g * 1e8 / intra + 2 * (k - 1) / k * 1e8 / (g * inter * 0.25) + 2 * (g - 1) * 5e-6
        + 2 * (k - 1) * isl.latency_s)
    link = cluster.link("a100", "v100")
    assert pess.stream_bandwidth(isl, cluster.islands[1], link, 4, streams=4) == pytest.approx(
        0.25 * cm.stream_bandwidth(isl, cluster.islands[1], link, 4, streams=4))
    late = with_network(cm, NetworkModel(name="late", p2p_latency_s=0.01))
    assert late.stream_latency(isl, cluster.islands[1], link, 4) == pytest.approx(link.latency_s + 0.01)
    with pytest.raises(ValueError, match="p2p_scale"):
        NetworkModel(name="x", p2p_scale=0.0)


def test_a_plan_carries_its_figures_under_the_band_and_no_other_candidate_has_a_smaller_worst_regret() -> None:
    model = preset_spec("350m")
    train = TrainSpec(global_batch=64, seq_len=1024)
    res = search_plan(model, parse_cluster(MIXED), train)
    band = res.band
    assert band is not None and [m.name for m in band.models] == ["nominal", "pessimistic"]
    assert band.chosen["nominal"] == pytest.approx(res.plan.predicted.step_time_s)
    chosen_worst = max(band.regret(band.chosen).values())
    assert chosen_worst <= max(band.regret(band.nominal_best).values()) + 1e-12
    assert all(band.best[k] <= band.chosen[k] for k in band.best)
    lines = band.lines()
    assert "nominal" in lines[2] and "pessimistic" in lines[3]
    # the nominal plan re-priced under the pessimistic model is no faster, and unchanged under its own
    nominal = search_plan(model, parse_cluster(MIXED), train, options=PlannerOptions(band=()))
    assert nominal.band is None
    cm = CostModel(model, train)
    c = nominal.candidate
    assert as_model(c, cm, cm, parse_cluster(MIXED)) is c
    slow = as_model(c, cm, with_network(cm, PESSIMISTIC), parse_cluster(MIXED))
    assert slow.step_s >= c.step_s and [st.cost.dp for st in slow.stages] == [st.cost.dp for st in c.stages]


def test_equal_widths_hold_in_chains_that_visit_an_island_twice() -> None:
    cluster = parse_cluster('[[group]]\nname = "a100"\ndevice = "A100-80GB"\ncount = 16\n'
                            '[[group]]\nname = "v100"\ndevice = "V100-32GB"\ncount = 32\n')
    cm = CostModel(preset_spec("1.3b"), TrainSpec(global_batch=256, seq_len=2048),
                   options=PlannerOptions(equal_widths=True, band=()))
    comp = Composer(cost_model=cm, cluster=cluster)
    seeds = [s for s in comp.setups() if len(s.order) == 2][:6]
    split = comp.split_setups(seeds)
    assert split and all(len(set(s.widths)) == 1 for s in split)
    plan = search_plan(cm.model, cluster, cm.train, options=cm.options).plan
    stages = [st for p in plan.pipelines for st in p.stages]
    assert len({st.dp for st in stages}) == 1 and all(st.tp == 1 for st in stages)


def test_a_boundary_is_intra_node_only_where_both_stages_fit_one_node() -> None:
    cluster = parse_cluster('[[group]]\nname = "a"\ndevice = "A100-80GB"\ncount = 16\ngpus_per_node = 8\n'
                            'intra_node_gbps = 600\ninter_node_gbps = 100\n')
    isl = cluster.islands[0]
    cm = CostModel(preset_spec("350m"), TrainSpec(global_batch=64, seq_len=1024),
                   options=PlannerOptions(network=NOMINAL))
    comp = Composer(cost_model=cm, cluster=cluster)
    eff = cm.options.link_efficiency

    def bandwidth(order, widths, lanes=()):
        """Between two neighbouring stages: on the chain's one island (its index twice), or on its two parts."""
        s = _Setup(order=order, widths=widths, batch=8, m=8, caps=(2,) * len(order), bound=0.0, lanes=lanes)
        return comp._link(s, 0, len(order) - 1, 4)[1]

    assert bandwidth((isl,), (4,)) == pytest.approx(isl.intra_node_bandwidth * eff)
    assert bandwidth((isl,), (8,)) == pytest.approx(isl.inter_node_bandwidth * eff)
    # four lanes of two devices each: 2 streams, but 8 devices a stage, which no node holds twice
    assert bandwidth((isl,), (8,), (4,)) == pytest.approx(isl.inter_node_bandwidth * eff)
    # two parts of a split island are cut between nodes
    front, back = split_island(isl, 0.5)
    assert bandwidth((front, back), (2, 2)) == pytest.approx(isl.inter_node_bandwidth * eff)
