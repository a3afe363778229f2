"""Deep windows behind slow links: the plan's depth, the planner's choice, the simulator and the runtime.

The runtime test runs two stages as threads with real gRPC peers and gloo groups, the link between them
holding every tensor 50 ms each way (`PeerRef.added_latency`), once under strict 1F1B and once with the
stage before the link keeping every micro-batch of the step in flight: the same per-step losses as one
process, and a shorter step.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from pipeline_harness import assert_losses_match, run_pinned_plan, tiny_job

from atoll.coordinator.planner import PlannerOptions, TrainSpec, parse_cluster, search_plan
from atoll.coordinator.planner.costmodel import window_depth
from atoll.coordinator.planner.simulator import (LinkTimes, PipelineTimes, StageTimes, closed_form_step,
                                                 one_f_one_b_order, simulate, step_lower_bound)
from atoll.job import JobSpec
from atoll.modelspec import ModelConfig, ModelSpec
from atoll.node.local import train_local
from atoll.node.schedule import schedule
from atoll.plan import PipelinePlan, Plan, StagePlan
from atoll.serde import plan_from_proto, plan_to_proto

LATENCY = timedelta(milliseconds=50)


# --- plan and wire -------------------------------------------------------------------------------------------


def test_in_flight_round_trips_and_bad_depths_are_refused() -> None:
    stages = [StagePlan(island="a", layers=(0, 3), in_flight=3), StagePlan(island="b", layers=(3, 6))]
    plan = Plan(model="tiny", global_batch=16, seq_len=64,
                pipelines=[PipelinePlan(micro_batch=2, num_micro_batches=8, stages=stages)])
    plan.validate(6)
    assert [s.in_flight for s in plan_from_proto(plan_to_proto(plan)).pipelines[0].stages] == [3, 0]
    assert [s.in_flight for s in Plan.from_json(plan.to_json()).pipelines[0].stages] == [3, 0]
    with pytest.raises(ValueError, match=">= 0"):
        StagePlan(island="a", layers=(0, 3), in_flight=-1)
    deadlocks = Plan(model="tiny", global_batch=16, seq_len=64, pipelines=[PipelinePlan(
        micro_batch=2, num_micro_batches=8,
        stages=[StagePlan(island="a", layers=(0, 3)), StagePlan(island="b", layers=(3, 6), in_flight=2)])])
    with pytest.raises(ValueError, match="stage 1 keeps 2 extra micro-batches"):
        deadlocks.validate(6)


# --- simulator and planner -----------------------------------------------------------------------------------


def _two(m: int, c: float, latency: float, extra: int, wire: float = 0.0) -> PipelineTimes:
    st = StageTimes(forward_s=c / 3, backward_s=2 * c / 3)
    x = LinkTimes(forward_s=wire + latency, backward_s=wire + latency, latency_s=latency)
    return PipelineTimes(stages=(st, st), links=(x,), num_micro_batches=m, in_flight=(extra, 0))


def test_the_simulator_runs_the_nodes_schedule() -> None:
    for p in range(1, 5):
        for m in range(1, 7):
            for e in range(4):
                for s in range(p):
                    node = [(a.op[0].upper(), a.micro_batch)
                            for a in schedule("1f1b", stage=s, num_stages=p, micro_batches=m, extra_in_flight=e)]
                    assert one_f_one_b_order(s, p, m, e) == node


def test_latency_delays_transfers_without_occupying_the_link() -> None:
    # free compute-bound pipeline: 16 micro-batches of 30 ms; a 50 ms link each way
    free = simulate(_two(16, 0.03, 0.0, 0)).step_time_s
    assert free == pytest.approx(17 * 0.03)
    strict = simulate(_two(16, 0.03, 0.05, 0)).step_time_s
    # strict 1F1B: each pair of micro-batches waits out the round trip (2 x 30 ms compute + 100 ms)
    assert strict == pytest.approx(16 * (0.06 + 0.1) / 2 + 0.03, rel=0.05)
    d = window_depth(0.1, 0.03)
    assert d == 4  # ceil(100 / 30)
    deep = simulate(_two(16, 0.03, 0.05, d)).step_time_s
    # the window keeps the stages busy: the free step plus one round trip
    assert deep == pytest.approx(free + 0.1, rel=0.02)
    assert strict / deep > 2.0
    # the closed form sees the loop and the window; the lower bound stays below the simulation
    assert closed_form_step(_two(16, 0.03, 0.05, 0)) == pytest.approx(strict, rel=0.1)
    assert closed_form_step(_two(16, 0.03, 0.05, d)) == pytest.approx(deep, rel=0.1)
    for t in (_two(16, 0.03, 0.05, 0), _two(16, 0.03, 0.05, d), _two(5, 0.03, 0.05, 2, wire=0.02)):
        assert step_lower_bound(t) <= simulate(t).step_time_s + 1e-9


def test_window_depth() -> None:
    assert window_depth(0.0, 0.03) == 0
    assert window_depth(0.002, 0.03) == 0  # a fast link: strict 1F1B loses under 5%
    assert [window_depth(r * 0.03, 0.03) for r in (0.5, 1, 2, 3.3, 10)] == [1, 1, 2, 4, 10]
    assert window_depth(float("inf"), 0.03) == 0


def test_bad_depths_and_latencies_are_refused_by_the_simulator() -> None:
    with pytest.raises(ValueError, match="grow downstream"):
        PipelineTimes(stages=(StageTimes(forward_s=1, backward_s=1),) * 2,
                      links=(LinkTimes(forward_s=0, backward_s=0),), num_micro_batches=8, in_flight=(0, 2))
    with pytest.raises(ValueError, match="one extra depth"):
        PipelineTimes(stages=(StageTimes(forward_s=1, backward_s=1),) * 2,
                      links=(LinkTimes(forward_s=0, backward_s=0),), num_micro_batches=8, in_flight=(1,))
    with pytest.raises(ValueError, match="latency_s"):
        LinkTimes(forward_s=0.01, backward_s=0.01, latency_s=0.05)


SMALL = ModelSpec.from_config(ModelConfig(name="t8", vocab_size=8000, d_model=1024, n_layers=6, n_heads=8,
                                          seq_len=512))


def _two_regions(latency_ms: float, memory_gb: float = 40) -> str:
    return f"""
[[group]]
name = "east"
region = "east"
tflops = 100
memory_gb = {memory_gb}
count = 2
gpus_per_node = 1
[[group]]
name = "west"
region = "west"
tflops = 100
memory_gb = {memory_gb}
count = 2
gpus_per_node = 1
[[link]]
between = ["east", "west"]
gbps = 100
latency_ms = {latency_ms}
"""


def test_the_planner_deepens_the_window_before_a_distant_link() -> None:
    train = TrainSpec(global_batch=64, seq_len=512)
    options = PlannerOptions(outer_mode="sync", micro_batches=(1,), several_pipelines=False)
    far = search_plan(SMALL, parse_cluster(_two_regions(30)), train, options=options)
    stages = far.plan.pipelines[0].stages
    islands = [s.island for s in stages]
    assert {"east", "west"} <= set(islands), islands  # the plan uses both regions
    boundary = next(k for k in range(len(stages) - 1) if stages[k].island != stages[k + 1].island)
    cycle = max(s.compute_s for s in stages)
    assert stages[boundary].in_flight - stages[boundary + 1].in_flight >= window_depth(0.06, cycle) - 1 > 0
    assert all(a.in_flight >= b.in_flight for a, b in zip(stages, stages[1:]))
    # the simulated step with the window against the same plan under strict 1F1B
    times = far.times[0]
    strict = simulate(replace(times, in_flight=())).step_time_s
    assert far.plan.predicted.step_time_s == pytest.approx(simulate(times).step_time_s)
    assert simulate(times).step_time_s < 0.8 * strict
    # next door, no depth is needed
    near = search_plan(SMALL, parse_cluster(_two_regions(0.01)), train, options=options)
    assert all(s.in_flight == 0 for s in near.plan.pipelines[0].stages)


def test_the_window_is_bounded_by_memory() -> None:
    """Devices that fit the strict plan with little to spare get less depth (never a stage moved)."""
    train = TrainSpec(global_batch=64, seq_len=512)
    options = PlannerOptions(outer_mode="sync", micro_batches=(1,), several_pipelines=False)
    roomy = search_plan(SMALL, parse_cluster(_two_regions(30, memory_gb=40)), train, options=options)
    tight = search_plan(SMALL, parse_cluster(_two_regions(30, memory_gb=0.55)), train, options=options)
    deep = max(s.in_flight for s in roomy.plan.pipelines[0].stages)
    shallow = max(s.in_flight for s in tight.plan.pipelines[0].stages)
    assert shallow < deep
    for s in tight.plan.pipelines[0].stages:
        assert s.memory_gb_per_device <= 0.55 * (1 - PlannerOptions().memory_reserve_fraction) + 1e-9


# --- runtime: two stages over gRPC, 50 ms each way -------------------------------------------------------------


def _run(job: JobSpec, stages: list[StagePlan], micro_batch: int, latency: timedelta
         ) -> tuple[dict[int, float], dict[int, float]]:
    """Per-step losses and per-step wall time (the slower node's) of a plan run by nodes as threads."""
    pipeline = PipelinePlan(micro_batch=micro_batch, num_micro_batches=job.train.global_batch // micro_batch,
                            stages=stages)
    run = run_pinned_plan(job, [pipeline], Path("/nonexistent"), join=60, wan_latency=lambda plan, peer: latency)
    seconds: dict[int, float] = {}
    for m in run.reports:
        seconds[m.step] = max(seconds.get(m.step, 0.0), m.step_seconds)
    return run.losses, seconds


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_deep_window_matches_one_process_and_beats_strict_1f1b_behind_a_150ms_link() -> None:
    """Strict 1F1B waits out a round trip every two micro-batches, a deep window about one a step: behind a link
    of latency L, m micro-batches, compute C a step, strict ~ m / 2 x 2L + C and deep ~ 2L + C. The nodes run as
    threads of this process, so a loaded machine stretches C: with L = 50 ms a CI run read 0.47 s deep against
    0.50 s strict. With L = 150 ms, deep x 1.5 < strict holds while C < 1.5 s (it reads about 0.1 s idle)."""
    latency = timedelta(milliseconds=150)
    steps = 6
    job = tiny_job(steps, micro_batch=2)
    expected, _ = train_local(job)
    m = job.train.global_batch // 2
    strict_losses, strict_s = _run(job, [StagePlan(island="east", layers=(0, 3), nodes=["a"]),
                                         StagePlan(island="west", layers=(3, 6), nodes=["b"])], 2, latency)
    # every micro-batch of the step in flight before the link: warm-up min(1 + (m - 1), m) = m forwards
    deep_losses, deep_s = _run(job, [StagePlan(island="east", layers=(0, 3), nodes=["c"], in_flight=m - 1),
                                     StagePlan(island="west", layers=(3, 6), nodes=["d"])], 2, latency)
    for got in (strict_losses, deep_losses):
        assert sorted(got) == list(range(steps))
        assert_losses_match(got, expected, 1e-4, range(steps))
    # the first step warms up (connections, allocations); the median of the others
    strict = statistics.median(strict_s[s] for s in range(1, steps))
    deep = statistics.median(deep_s[s] for s in range(1, steps))
    # strict 1F1B waits out a round trip every two micro-batches: at least m / 2 x 2L per step
    assert strict >= m / 2 * 2 * latency.total_seconds() * 0.9, strict
    assert deep * 1.5 < strict, (deep, strict)
    print(f"\nmedian step behind a {latency.total_seconds() * 1e3:.0f} ms link: strict 1F1B {strict:.3f} s, "
          f"deep window {deep:.3f} s")


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_coordinator_and_node_processes_run_a_deep_window_across_regions(tmp_path: Path) -> None:
    """`atoll coordinator --plan` with a deep window on the first stage, and two `atoll node` processes in two
    regions that hold what they send each other for 50 ms (--wan-latency-ms): the depth reaches the nodes
    over the wire and the losses match one process."""
    from atoll.launch.localcluster import LocalCluster

    steps = 5
    job = tiny_job(steps, micro_batch=2, nodes=2)
    m = job.train.global_batch // 2
    job_path, plan_path, out = tmp_path / "job.toml", tmp_path / "plan.json", tmp_path / "cluster"
    job_path.write_text(job.to_toml())
    Plan(model="tiny", global_batch=job.train.global_batch, seq_len=job.train.seq_len, pipelines=[PipelinePlan(
        micro_batch=2, num_micro_batches=m, stages=[StagePlan(island="east", layers=(0, 3), nodes=["east-0"],
                                                              in_flight=m - 1),
                                                    StagePlan(island="west", layers=(3, 6), nodes=["west-0"])])]
         ).save(plan_path)
    expected, _ = train_local(job)
    with LocalCluster(job_path=job_path, out=out, profile_seconds=1.0) as cluster:
        cluster.start_coordinator(extra=["--plan", str(plan_path)])
        cluster.start_node("near", node_id="east-0", region="east", extra=["--wan-latency-ms", "50"])
        cluster.start_node("far", node_id="west-0", region="west", extra=["--wan-latency-ms", "50"])
        losses = cluster.wait_losses(steps, 100)
        status = cluster.status()
        from atoll.coordinator.store import SqliteStore

        store = SqliteStore(cluster.state_db, read_only=True)
        try:
            reports = store.recent_steps(limit=64)
        finally:
            store.close()
    assert [s.in_flight for s in status.plan.pipelines[0].stages] == [m - 1, 0]
    # the link holds every tensor: no step is shorter than one round trip
    assert min(r.step_seconds for r in reports) >= 2 * LATENCY.total_seconds(), reports
    assert {i.group for i in status.plan.islands} == {"east", "west"}
    assert_losses_match(losses, expected, 1e-4, range(steps))
