"""Device speed from the runs: measured compute per step against the plan's prediction, folded into the next
plan (atoll.coordinator.calibration, the state's replan and the planning adapter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from atoll.coordinator import handlers as h
from atoll.coordinator.calibration import (MAX_FACTOR, calibration_note, compound, predicted_compute,
                                           speed_factors)
from atoll.coordinator.planning import make_plan
from atoll.coordinator.state import CoordinatorState
from atoll.coordinator.store import MemoryStore
from atoll.job import JobSpec
from atoll.plan import PipelinePlan, Plan, Prediction, StagePlan
from atoll.types import StepMetrics
from atoll.v1 import atoll_pb2 as pb

from test_coordinator_planning import _inputs
from test_failure_replan import Clock, plan_three

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret"


def _plan(epoch: int = 3) -> Plan:
    # pipeline of 5-row micro-batches, 4 of them: stage 0 on 2 replicas (3 and 2 rows), stage 1 tp 2 on one
    stages = [StagePlan(island="x", layers=(0, 3), dp=2, compute_s=0.3, nodes=["a", "b"]),
              StagePlan(island="y", layers=(3, 6), dp=1, tp=2, compute_s=0.5, nodes=["c", "d"]),]
    return Plan(model="tiny", global_batch=20, seq_len=64, epoch=epoch,
                predicted=Prediction(step_time_s=2.0, tokens_per_s=640.0, mfu=0.1, bottleneck=""),
                pipelines=[PipelinePlan(micro_batch=5, num_micro_batches=4, stages=stages)])


def _steps(node: str, seconds: list[float], epoch: int = 3, first: int = 10) -> list[StepMetrics]:
    return [StepMetrics(job_id="j", node_id=node, plan_epoch=epoch, step=first + i, compute_seconds=s)
            for i, s in enumerate(seconds)]


def test_the_prediction_per_node_follows_its_rows_and_tp_ranks() -> None:
    got = predicted_compute(_plan())
    # the busiest replica (3 rows) takes compute_s per micro-batch; the other 2/3 of it
    assert got["a"] == pytest.approx(0.3 * 4) and got["b"] == pytest.approx(0.2 * 4)
    # both tp ranks of the one replica compute the whole micro-batch's share
    assert got["c"] == got["d"] == pytest.approx(0.5 * 4)
    pinned = _plan()
    pinned.pipelines[0].stages[0].compute_s = 0.0  # a plan without a prediction says nothing of its nodes
    assert set(predicted_compute(pinned)) == {"c", "d"}


def test_factors_are_the_median_after_the_first_step_of_the_epoch() -> None:
    plan = _plan()
    reports = (_steps("a", [9.0, 2.4, 2.4, 2.5, 2.3, 2.4])  # 2x its 1.2 s, after a slow first step
               + _steps("b", [0.8] * 3)  # too few steps
               + _steps("c", [1.0] * 6)  # twice as fast as predicted
               + _steps("d", [100.0] * 6)  # a stall, not a speed: clamped
               + _steps("a", [50.0] * 6, epoch=2, first=0))  # another epoch's reports
    got = speed_factors(plan, reports)
    assert set(got) == {"a", "c", "d"}
    assert got["a"] == pytest.approx(2.0) and got["c"] == pytest.approx(0.5) and got["d"] == MAX_FACTOR
    # compounded with the factors the plan was made with; a node without a measurement keeps its own
    assert compound({"a": 1.5, "b": 1.2}, got) == pytest.approx({"a": 3.0, "b": 1.2, "c": 0.5, "d": MAX_FACTOR})
    assert compound({"a": 3.0}, {"a": 3.0})["a"] == MAX_FACTOR
    from dataclasses import replace
    assert speed_factors(replace(plan, mode="outer"), reports) == {}  # kept groups keep their old predictions
    assert calibration_note({"a": 2.0, "c": 0.5, "z": 3.0, "e": 1.01}, ["a", "c", "e"]) == (
        "; 2 nodes planned at 0.50x-2.00x their profiled compute time, as their runs measured")
    assert calibration_note({"a": 1.02}, ["a"]) == ""


def test_the_planner_sees_profiles_scaled_by_the_factors() -> None:
    inputs = _inputs({"x": ["a1", "a2"], "y": ["b1", "b2"]})
    plain, _ = make_plan(inputs)
    from dataclasses import replace
    slow, _ = make_plan(replace(inputs, speed={n: 3.0 for n in inputs.members}))
    # every device three times slower: the same job's step is predicted about three times as long
    assert slow.predicted.step_time_s == pytest.approx(3 * plain.predicted.step_time_s, rel=0.35)
    # one island three times slower than it profiled: it gets fewer layers than the other
    lopsided, _ = make_plan(replace(inputs, speed={"a1": 3.0, "a2": 3.0}))
    layers = {}
    for p in lopsided.pipelines:
        for s in p.stages:
            layers[s.nodes[0][0]] = layers.get(s.nodes[0][0], 0) + s.layers[1] - s.layers[0]
    assert layers.get("a", 0) < layers.get("b", 0)


def _profile(host: str) -> pb.NodeProfile:
    return pb.NodeProfile(hostname=host, device_kind="cpu", device_name="cpu-x", device_count=1,
                          memory_total_bytes=16 << 30, memory_free_bytes=8 << 30, cpu_count=4,
                          layer_timings=[pb.LayerTiming(layer_kind=k, micro_batch=b, seq_len=64,
                                                        forward_seconds=0.002 * b, backward_seconds=0.004 * b)
                                         for k in ("embedding", "block", "head") for b in (2, 4, 8)])


def test_the_coordinator_plans_again_with_the_speed_its_nodes_ran_at() -> None:
    state, _, ids = plan_three(_profile)
    first = state.current_plan()
    assert state.epoch == 1 and first is not None and state.speed == {}
    expected = predicted_compute(first)
    assert expected
    # every node of the plan computes 1.6x what the plan predicted, step after step
    for step in range(8):
        for n, sec in expected.items():
            h.handle_report_step(pb.StepMetrics(job_id=state.job.id, node_id=n, plan_epoch=1, step=step,
                                                compute_seconds=1.6 * sec, step_seconds=2 * sec), state)
    # a failed run replans with every node alive: the new plan starts from the measured speed
    h.handle_report_failure(pb.RunFailure(job_id=state.job.id, node_id=ids[0], plan_epoch=1, step=8,
                                          reason="step 8 failed: closed"), state)
    for n in ids:
        h.handle_heartbeat(pb.HeartbeatRequest(node_id=n), state)
    events = state.tick()
    assert state.epoch == 2, events
    assert state.speed == pytest.approx({n: 1.6 for n in expected})
    assert state.store.get_speed() == pytest.approx(state.speed)
    assert any("planned at 1.60x their profiled compute time" in e for e in events), events
    second = state.current_plan()
    assert second.predicted.step_time_s > 1.3 * first.predicted.step_time_s


def test_the_factors_survive_a_coordinator_restart(tmp_path) -> None:
    from atoll.coordinator.store import SqliteStore

    path = tmp_path / "coordinator.db"
    store = SqliteStore(path)
    assert store.get_speed() == {}
    store.put_speed({"a": 1.6, "b": 0.8})
    store.put_speed({"a": 1.5, "c": 2.0})  # replaced as a whole
    store.close()
    again = SqliteStore(path)
    assert again.get_speed() == {"a": 1.5, "c": 2.0}
    state = CoordinatorState(store=again, job=JobSpec.load(ROOT / "examples" / "tiny.toml"), token=TOKEN,
                             clock=Clock())
    assert state.speed == {"a": 1.5, "c": 2.0}  # the next replan compounds from these
    again.close()
    assert MemoryStore().get_speed() == {}
