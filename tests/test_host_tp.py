"""Tensor parallelism over the nodes of one machine (`[cluster] host_tp`): the coordinator groups each island's
nodes by hostname, the planner may run a stage tp within a machine, and every tp group's nodes share one."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from atoll.coordinator.islands import form_islands
from atoll.coordinator.linkmatrix import complete_matrix
from atoll.coordinator.planner.cluster import Cluster, Island
from atoll.coordinator.planner.catalog import device
from atoll.coordinator.planner.composer import StageChoice
from atoll.coordinator.planner.parallelizer import IslandCost
from atoll.coordinator.planner.planjob import NodeAssignmentError, assign_nodes
from atoll.coordinator.planning import PlanInputs, make_plan, planner_plan
from atoll.coordinator.store import MemberRecord
from atoll.job import JobSpec
from atoll.types import LayerTiming, LinkMeasurement, NodeProfile

ROOT = Path(__file__).resolve().parents[1]


def _profile(host: str, seconds: float = 0.5) -> NodeProfile:
    lt = [LayerTiming(layer_kind=k, micro_batch=b, seq_len=64, forward_seconds=seconds * b,
                      backward_seconds=2 * seconds * b) for k in ("embedding", "block", "head") for b in (2, 4, 8)]
    return NodeProfile(hostname=host, device_kind="cuda", device_name="A100-80GB", memory_total_bytes=80 << 30,
                       memory_free_bytes=80 << 30, layer_timings=lt)


def test_an_islands_nodes_are_grouped_by_machine() -> None:
    hosts = {"a": "m1", "e": "m2", "b": "m1", "f": "m2", "c": "m1", "d": "m1"}
    profiles = {n: _profile(h) for n, h in hosts.items()}
    links = []
    for x in hosts:
        for y in hosts:
            if x < y:
                same = hosts[x] == hosts[y]
                links.append(LinkMeasurement(src=x, dst=y, bandwidth_bytes_per_s=(50e9 if same else 1e9) + ord(x),
                                             rtt_seconds=1e-5 if same else 2e-4))
    isl = Cluster.from_nodes({"i": list(hosts)}, profiles, links, hosts=hosts).islands[0]
    assert isl.nodes == ("a", "b", "c", "d", "e", "f") and isl.hosts == ("m1",) * 4 + ("m2",) * 2
    assert isl.gpus_per_node == 2  # the fewest any machine holds: a tp group of 2 fits on either
    assert isl.intra_node_bandwidth == pytest.approx(50e9 + ord("a"))  # slowest between nodes of one machine
    assert isl.inter_node_bandwidth == pytest.approx(1e9 + ord("a"))  # slowest between machines
    # without machines every node is its own: tp 1, the island's slowest link both ways
    plain = Cluster.from_nodes({"i": list(hosts)}, profiles, links).islands[0]
    assert plain.gpus_per_node == 1 and not plain.hosts and plain.nodes == tuple(hosts)
    assert plain.intra_node_bandwidth == plain.inter_node_bandwidth == pytest.approx(1e9 + ord("a"))
    with pytest.raises(ValueError, match="hosts"):
        replace(isl, hosts=("m1",))


def _stage(island: Island, tp: int, dp: int) -> StageChoice:
    cost = IslandCost(forward_s=1.0, backward_s=2.0, memory_bytes=0.0, dp=dp, tp=tp, zero=0, recompute=False,
                      micro_batch=1)
    return StageChoice(island=island, start=0, end=1, cost=cost, sync_s=0.0, optimizer_s=0.0)


def test_each_tp_group_gets_nodes_of_one_machine() -> None:
    nodes = tuple("abcdefgh")
    island = Island(id="i", group="i", device=device("A100-80GB"), gpus=8, gpus_per_node=4, nodes=nodes,
                    hosts=("m1",) * 4 + ("m2",) * 4)
    # in pipeline order the tp-1 stage would take a, b, c and leave the first tp pair d and e: two machines
    got = assign_nodes([[_stage(island, 1, 3), _stage(island, 2, 1), _stage(island, 2, 1)]])
    machine = dict(zip(nodes, island.hosts))
    for k in (1, 2):
        assert len(got[0, k]) == 2 and len({machine[n] for n in got[0, k]}) == 1, got
    assert len(got[0, 0]) == 3
    assert sorted(n for ns in got.values() for n in ns) == sorted(set(n for ns in got.values() for n in ns))
    # replica-major: replica r's tp ranks are nodes[r * tp: (r + 1) * tp], each on one machine
    two = assign_nodes([[_stage(island, 2, 2), _stage(island, 2, 2)]])
    for ns in two.values():
        assert machine[ns[0]] == machine[ns[1]] and machine[ns[2]] == machine[ns[3]]
    odd = replace(island, gpus=6, gpus_per_node=3, nodes=nodes[:6], hosts=("m1",) * 3 + ("m2",) * 3)
    with pytest.raises(NodeAssignmentError, match="no machine has 2"):
        assign_nodes([[_stage(odd, 2, 3)]])


def _inputs(hosts: dict[str, str], host_tp: bool, seconds: float = 0.5, d_model: int = 1024) -> PlanInputs:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    # two sequences a step: data parallelism reaches two replicas at most, and a pipeline of one micro-batch
    # leaves its stages idle in turn, so the other two nodes pay only by sharding a replica's layers
    # a model wide enough that its matrices split over two ranks keep most of their speed
    job = replace(job, cluster=replace(job.cluster, expected_nodes=len(hosts), host_tp=host_tp),
                  train=replace(job.train, global_batch=2, micro_batch=1),
                  model=replace(job.model, d_model=d_model, n_heads=16, ffn_hidden=4 * d_model))
    members = {n: MemberRecord(node_id=n, peer_address=f"10.0.{i}.1:5000", profile=_profile(h, seconds))
               for i, (n, h) in enumerate(hosts.items())}
    links = [LinkMeasurement(src=a, dst=b, bandwidth_bytes_per_s=100e9 if hosts[a] == hosts[b] else 50e9,
                             rtt_seconds=1e-5) for a in hosts for b in hosts if a < b]
    ids = sorted(hosts)
    matrix = complete_matrix(ids, links)
    islands = form_islands({n: m.profile for n, m in members.items()}, matrix)
    return PlanInputs(job=job, members=members, islands=islands, matrix=matrix, links=links, epoch=1,
                      rendezvous="10.0.9.9:29400")


def test_the_coordinator_plans_tp_within_machines_only_when_the_job_asks() -> None:
    """Two sequences a step on two machines of two nodes: the planner runs two replicas, each tp 2 over one
    machine's nodes (each tp group on one machine). Without `host_tp` every stage runs tp 1."""
    hosts = {"a1": "m1", "b1": "m2", "a2": "m1", "b2": "m2"}
    plan, how = make_plan(_inputs(hosts, host_tp=True))
    assert how == "planner", how
    stages = [s for p in plan.pipelines for s in p.stages]
    assert any(s.tp > 1 for s in stages), [(s.dp, s.tp) for s in stages]
    for s in stages:
        assert len(s.nodes) == s.dp * s.tp
        for r in range(s.dp):
            group = s.nodes[r * s.tp:(r + 1) * s.tp]
            assert len({hosts[n] for n in group}) == 1, (s.nodes, s.tp)
    plan.validate(6)
    off, _ = make_plan(_inputs(hosts, host_tp=False))
    assert all(s.tp == 1 for p in off.pipelines for s in p.stages)
    # a region's replica group planned around groups that run on (outer mode) runs tp 1: the runtime has no tp
    # there
    grouped = planner_plan(replace(_inputs(hosts, host_tp=True), replica_groups=True))
    assert all(s.tp == 1 for p in grouped.pipelines for s in p.stages)


def test_letting_the_planner_use_tp_never_gives_a_slower_plan() -> None:
    """A narrow model (tp splits its small matrices badly) on two sequences a step: the two-stage pipeline without
    tp is faster than one tp stage. The search with tp settles on the tp stage (7.5 s: the pipeline's first cut,
    7.6 s, is dropped before refining its cuts would reach 7.2 s), so the coordinator plans without tp too and
    keeps the faster."""
    hosts = {"a1": "m1", "b1": "m2", "a2": "m1", "b2": "m2"}
    on, _ = make_plan(_inputs(hosts, host_tp=True, d_model=64))
    off, _ = make_plan(_inputs(hosts, host_tp=False, d_model=64))
    assert on.predicted.step_time_s <= off.predicted.step_time_s * (1 + 1e-9), (on.predicted, off.predicted)


def test_a_setups_bound_leaves_deferred_weight_gradients_off_the_path() -> None:
    """Each setup's lower bound is one: no refined arrangement of it simulates faster. With one micro-batch a
    step, a zero-bubble pipeline's last stage computes its weight-gradient products while the first still runs
    its backward, so a bound that puts every layer's whole backward on the micro-batch's path (9.0 s here,
    against 7.2 s simulated) pruned the setup of the best plan."""
    from atoll.coordinator.planner import PlannerOptions, ProfileSet, TrainSpec
    from atoll.coordinator.planner.composer import Composer
    from atoll.coordinator.planner.costmodel import CostModel
    from atoll.coordinator.planner.simulator import simulate

    hosts = {"a1": "m1", "b1": "m2", "a2": "m1", "b2": "m2"}
    inputs = _inputs(hosts, host_tp=True, d_model=64)
    islands = {i.id: list(i.nodes) for i in inputs.islands}
    profiles = {n: m.profile for n, m in inputs.members.items()}
    cluster = Cluster.from_nodes(islands, profiles, inputs.links, hosts=hosts)
    job = inputs.job
    train = TrainSpec(global_batch=job.train.global_batch, seq_len=job.train.seq_len, dtype=job.train.dtype)
    options = PlannerOptions(micro_batches=(1,), equal_widths=False, zero_stages=(0, 1, 2))
    composer = Composer(cost_model=CostModel(job.model_spec, train, ProfileSet.from_node_profiles(islands, profiles),
                                             options), cluster=cluster)
    checked = 0
    for s in composer.setups():
        cand = composer.chain_best(s)
        if cand is None:
            continue
        cand.step_s = simulate(cand.times).step_time_s
        best = composer.refine(cand, s)
        assert s.bound <= best.step_s + 1e-9, (s.widths, s.batch, s.bound, best.step_s)
        checked += 1
    assert checked >= 2


def test_a_model_that_fits_only_over_tp_ranks_is_planned_with_them(monkeypatch) -> None:
    """With host_tp, a search without tp that finds nothing (a model that fits only split over a machine's ranks)
    leaves the plan with tp; a tp plan that cannot be placed leaves the one without."""
    import atoll.coordinator.planner as planner
    from atoll.coordinator.planner import NoFeasiblePlan
    from atoll.coordinator.planner.planjob import NodeAssignmentError

    real = planner.plan_job
    hosts = {"a1": "m1", "b1": "m2", "a2": "m1", "b2": "m2"}

    def tp_only(model, cluster, train, profiles, options):
        if options.max_tp == 1:
            raise NoFeasiblePlan("layer 1 does not fit one device's memory")
        return real(model, cluster, train, profiles, options)

    monkeypatch.setattr(planner, "plan_job", tp_only)
    plan = planner_plan(_inputs(hosts, host_tp=True))
    assert any(s.tp > 1 for p in plan.pipelines for s in p.stages)

    def unplaceable(model, cluster, train, profiles, options):
        if options.max_tp > 1:
            raise NodeAssignmentError("island cuda0: no machine has 2 of its nodes left for another replica")
        return real(model, cluster, train, profiles, options)

    monkeypatch.setattr(planner, "plan_job", unplaceable)
    plan = planner_plan(_inputs(hosts, host_tp=True))
    assert all(s.tp == 1 for p in plan.pipelines for s in p.stages)

    monkeypatch.setattr(planner, "plan_job", lambda *a: (_ for _ in ()).throw(NoFeasiblePlan("nothing fits")))
    with pytest.raises(NoFeasiblePlan, match="nothing fits"):
        planner_plan(_inputs(hosts, host_tp=True))
