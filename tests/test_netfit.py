"""The coordinator's network fit (`atoll.coordinator.netfit`): the least squares, the fitted model, the replan
verdict's hysteresis, and samples read from step reports."""

from __future__ import annotations

import random

import pytest

from atoll.coordinator.netfit import (CalibrationOptions, Sample, describe_fit, fit_kind, fit_network, model_change,
                                      replan_verdict, samples_from_steps)
from atoll.coordinator.planner.network import NOMINAL, PESSIMISTIC, NetworkModel
from atoll.types import CollectiveStats, LinkStats, StepMetrics


def _samples(kind: str, slowdown: float, extra_s: float, n: int = 40, noise: float = 0.02, seed: int = 1) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        wire = rng.uniform(1e-3, 50e-3)
        lat = rng.uniform(1e-4, 1e-3)
        measured = (lat + extra_s + slowdown * wire) * (1 + rng.uniform(-noise, noise))
        out.append(Sample(kind=kind, seconds=measured, wire_s=wire, latency_s=lat))
    return out


@pytest.mark.parametrize("slowdown,extra", [(4.0, 0.0), (1.0, 2e-3), (0.5, 5e-4), (3.0, 1e-3)])
def test_the_fit_recovers_the_slowdown_and_the_latency_left_out(slowdown: float, extra: float) -> None:
    f = fit_kind(_samples("p2p", slowdown, extra), "p2p")
    assert f is not None and f.samples == 40
    assert f.slowdown == pytest.approx(slowdown, rel=0.05)
    assert f.extra_latency_s == pytest.approx(extra, abs=1e-3)
    assert f.fitted_s == pytest.approx(f.measured_s, rel=0.03)
    assert fit_kind(_samples("p2p", slowdown, extra), "collective") is None  # another kind's samples


def test_one_size_only_gives_the_mean_ratio_and_no_latency() -> None:
    xs = [Sample(kind="collective", seconds=0.04 + 0.001 * (i % 3), wire_s=0.01) for i in range(9)]
    f = fit_kind(xs, "collective")
    assert f is not None and f.extra_latency_s == 0.0
    assert f.slowdown == pytest.approx(sum(x.seconds for x in xs) / len(xs) / 0.01)


def test_the_fitted_model_scales_the_base_per_kind_once_it_has_enough_samples() -> None:
    samples = _samples("p2p", 4.0, 0.0) + _samples("collective", 2.0, 0.0, n=5, seed=2)
    fit = fit_network(samples, NOMINAL, min_samples=8)
    assert fit.model.p2p_scale == pytest.approx(0.25, rel=0.05)
    assert fit.model.collective_scale == 1.0  # 5 samples: not enough yet
    assert fit.kinds["collective"].samples == 5
    again = fit_network(samples, NOMINAL, min_samples=5)
    assert again.model.collective_scale == pytest.approx(0.5, rel=0.05)
    # a fit made under a model that was already scaled scales it further
    on_pessimistic = fit_network(_samples("p2p", 2.0, 0.0), PESSIMISTIC)
    assert on_pessimistic.model.p2p_scale == pytest.approx(PESSIMISTIC.p2p_scale / 2, rel=0.05)
    lines = describe_fit(fit)
    assert lines[0].startswith("p2p: 40 samples") and "4.0" in lines[0] and "collective: 5 samples" in lines[1]


def test_the_replan_verdict_has_hysteresis() -> None:
    opts = CalibrationOptions(change=1.5, min_gain=0.10)
    slow = NetworkModel(name="fitted", p2p_scale=0.25, collective_scale=0.25)
    # moved 4x, the best plan under it 30% shorter: replan
    go = replan_verdict(fitted=slow, planned=NOMINAL, running_s=10.0, best_s=7.0, options=opts)
    assert go.go and "30% shorter" in go.why
    # moved 4x but no gain: nothing
    assert not replan_verdict(fitted=slow, planned=NOMINAL, running_s=10.0, best_s=9.5, options=opts).go
    # after the replan the running plan was made under `slow`: a fit wobbling around it replans nothing, whatever
    # the planner would now say
    wobble = NetworkModel(name="fitted", p2p_scale=0.3, collective_scale=0.22)
    stay = replan_verdict(fitted=wobble, planned=slow, running_s=10.0, best_s=5.0, options=opts)
    assert not stay.go and "within" in stay.why
    assert model_change(wobble, slow) == pytest.approx(0.3 / 0.25)
    # latency the model left out counts against the transfers' typical time
    laggy = NetworkModel(name="fitted", p2p_latency_s=0.02)
    assert model_change(laggy, NOMINAL, {"p2p": 0.01}) == pytest.approx(3.0)
    assert model_change(laggy, NOMINAL) == 1.0
    with pytest.raises(ValueError, match="factor above 1"):
        CalibrationOptions(change=1.0)


def test_samples_are_read_from_step_reports_and_predicted_under_the_plans_model() -> None:
    link_of = {("a", "b"): (1e8, 1e-3), ("b", "c"): (5e7, 2e-3), ("c", "a"): (1e8, 1e-3)}
    group_of = {"a": ["a", "b", "c"]}
    steps = [StepMetrics(job_id="j", node_id="a", plan_epoch=1, step=0,
                         links=[LinkStats(peer="b", direction="forward", bytes_wire=4_000_000, seconds=0.2,
                                          transfers=4),
                                LinkStats(peer="z", direction="forward", bytes_wire=10, seconds=1.0, transfers=1)],
                         collectives=[CollectiveStats(kind="all_reduce", bytes=3_000_000, participants=3, seconds=0.5,
                                                      count=2)])]
    got = samples_from_steps(steps, link_of, group_of, 0.96, NOMINAL)
    p2p = [s for s in got if s.kind == "p2p"]
    coll = [s for s in got if s.kind == "collective"]
    assert len(p2p) == 1 and len(coll) == 1  # no probe to peer z: not a sample
    assert p2p[0].seconds == pytest.approx(0.05) and p2p[0].wire_s == pytest.approx(1e6 / (1e8 * 0.96))
    assert p2p[0].latency_s == pytest.approx(1e-3)
    # the ring runs at its slowest link (b-c), paying 4 hops at its largest latency
    assert coll[0].seconds == pytest.approx(0.25)
    assert coll[0].wire_s == pytest.approx(4 / 3 * 3e6 / (5e7 * 0.96)) and coll[0].latency_s == pytest.approx(4 * 2e-3)
    # under a model that already reads the links 4x slower, the same bytes are predicted 4x longer
    slow = samples_from_steps(steps, link_of, group_of, 0.96, PESSIMISTIC)
    assert slow[0].wire_s == pytest.approx(4 * p2p[0].wire_s)


def test_a_running_plan_is_re_estimated_under_a_fitted_network() -> None:
    from atoll.coordinator.netfit import plan_step_under
    from atoll.coordinator.planner import PlannerOptions, TrainSpec, parse_cluster, search_plan
    from atoll.models import preset_spec

    cluster = parse_cluster('[[group]]\nname = "a"\ndevice = "A100-40GB"\ncount = 8\ngpus_per_node = 1\n'
                            'inter_node_gbps = 10\n[[group]]\nname = "b"\ndevice = "V100-16GB"\ncount = 8\n'
                            'gpus_per_node = 1\ninter_node_gbps = 10\n')
    plan = search_plan(preset_spec("350m"), cluster, TrainSpec(global_batch=64, seq_len=1024),
                       options=PlannerOptions(band=())).plan
    assert any(st.dp > 1 for p in plan.pipelines for st in p.stages) or len(plan.pipelines[0].stages) > 1
    same = plan_step_under(plan, NOMINAL, NetworkModel(name="fitted"))
    assert same == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    slower = plan_step_under(plan, NOMINAL, NetworkModel(name="fitted", p2p_scale=0.25, collective_scale=0.25))
    slowest = plan_step_under(plan, NOMINAL, NetworkModel(name="fitted", p2p_scale=0.05, collective_scale=0.05))
    assert plan.predicted.step_time_s < slower < slowest
    # a plan made under a slow model and re-estimated under the nominal one gets faster again
    assert plan_step_under(plan, NetworkModel(name="fitted", p2p_scale=0.25, collective_scale=0.25), NOMINAL) \
        <= plan.predicted.step_time_s


def test_the_coordinator_fits_the_reports_shows_the_fit_and_replans_only_past_both_thresholds() -> None:
    """Three nodes probed at 2 GB/s and planned; their all-reduces and transfers then report what a link 8x slower
    takes. The coordinator fits that, says so in the status, and plans under the fit only once the fit moved; reports
    that run as the model says make no planner run at all."""
    from test_drift import _later, _state

    from atoll.coordinator import handlers as h
    from atoll.coordinator.calibration import predicted_compute
    from atoll.v1 import atoll_pb2 as pb

    def report(slowdown: float, steps: range) -> None:
        plan = state.current_plan()
        stage = {n: st for p in plan.pipelines for st in p.stages for n in st.nodes}
        expected = predicted_compute(plan)
        for step in steps:
            clock.t += 1.0
            for n, sec in expected.items():
                group = len(stage[n].nodes)
                # a ring all-reduce of 4 MB over the group at the probed 2 GB/s (x link efficiency), `slowdown`
                # times as long, and 4 transfers of 1 MB to a peer
                ring = 2 * (group - 1) / group * 4e6 / (2e9 * 0.96) * slowdown + 2 * (group - 1) * 5e-5
                peer = next(m for m in ids if m != n)
                h.handle_report_step(pb.StepMetrics(
                    job_id=state.job.id, node_id=n, plan_epoch=plan.epoch, step=step, compute_seconds=sec,
                    step_seconds=1.0, unix_time=clock.t,
                    links=[pb.LinkStats(peer=peer, direction=1, bytes_raw=4_000_000, bytes_wire=4_000_000,
                                        seconds=4 * (1e6 / (2e9 * 0.96) * slowdown + 5e-5), transfers=4)],
                    collectives=[pb.CollectiveStats(kind="all_reduce", bytes=4_000_000 + 1000 * (step % 5),
                                                    participants=group, seconds=2 * ring, count=2)]), state)

    state, clock, ids = _state()
    assert state.current_plan().predicted.step_time_s > 0
    planner_runs = []
    inner = state.planner
    state.planner = lambda inputs: planner_runs.append(inputs.network) or inner(inputs)
    report(1.0, range(0, 14))  # (a fit waits for 13 steps of the epoch after its first: `unsettled`'s)
    _later(state, clock, 61)
    state.tick()
    assert planner_runs == [] and state.network == NOMINAL  # as the probes said: nothing to replan
    lines = state.network_fit_lines()
    assert any(line.startswith("p2p:") and "1.00x slower" in line for line in lines), lines
    report(8.0, range(14, 26))
    _later(state, clock, 61)
    events = state.tick()
    lines = h.handle_status(pb.StatusRequest(), state).network_fit
    # the newest 24 reports of each node: 12 steps as probed, 12 at 8x
    fit = state.network_fit
    assert fit is not None and 1.5 < fit.kinds["p2p"].slowdown < 8 and 1.5 < fit.kinds["collective"].slowdown < 8
    assert any(line.startswith("p2p: 72 samples") for line in lines) and lines[0].startswith("planned under nominal")
    # the fit moved past 1.5x: the planner ran under it, and the plan changed only where that paid 10%
    assert planner_runs and planner_runs[-1] == fit.model and fit.model.p2p_scale < 1 / 1.5
    assert (state.network == fit.model) == bool(events), events
