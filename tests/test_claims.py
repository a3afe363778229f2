"""What a member may claim, checked against the plan: the loss only from the last stage, steps in line with the
peers', a job end corroborated by more than one node (`atoll.coordinator.claims`), through the plain handlers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from atoll.coordinator import claims
from atoll.coordinator import handlers as h
from atoll.coordinator.authz import PermissionDenied
from atoll.coordinator.errors import FailedPrecondition, Unavailable
from atoll.coordinator.planning import PlanInputs, finish_plan
from atoll.coordinator.state import CoordinatorState
from atoll.coordinator.store import MemoryStore
from atoll.job import JobSpec
from atoll.plan import IslandInfo, PipelinePlan, Plan, StagePlan
from atoll.v1 import atoll_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret"


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def two_stages(inputs: PlanInputs) -> tuple[Plan, str]:
    """The first member (by id) runs stage 0, the others replicate stage 1, which computes the loss."""
    nodes = sorted(inputs.members)
    layers = inputs.job.model_spec.num_layers
    plan = Plan(model=inputs.job.model.name, global_batch=inputs.job.train.global_batch,
                seq_len=inputs.job.train.seq_len,
                islands=[IslandInfo(id="i0", device="cpu", nodes=nodes)],
                pipelines=[PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
                    StagePlan(island="i0", layers=(0, 2), nodes=nodes[:1]),
                    StagePlan(island="i0", layers=(2, layers), nodes=nodes[1:], dp=len(nodes) - 1)])])
    return finish_plan(plan, inputs), "two stages (test)"


def _profile(host: str) -> pb.NodeProfile:
    return pb.NodeProfile(hostname=host, device_kind="cpu", device_name="cpu-x", device_count=1,
                          memory_total_bytes=16 << 30, memory_free_bytes=8 << 30, cpu_count=4,
                          layer_timings=[pb.LayerTiming(layer_kind="block", micro_batch=4, seq_len=64,
                                                        forward_seconds=0.01, backward_seconds=0.02)])


@pytest.fixture
def planned() -> tuple[CoordinatorState, str, list[str]]:
    """A state running a two-stage plan of three nodes: (state, the stage-0 node, the two last-stage nodes)."""
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=1000))
    state = CoordinatorState(store=MemoryStore(), job=job, token=TOKEN, clock=Clock(), planner=two_stages)
    for i in range(3):
        h.handle_join(pb.JoinRequest(token=TOKEN, node_id=f"n{i}", profile=_profile(f"h{i}"),
                                     peer_address=f"127.0.0.1:{5000 + i}"), state)
    for n in ("n0", "n1", "n2"):
        reply = h.handle_heartbeat(pb.HeartbeatRequest(node_id=n), state)
        h.handle_report_probes(pb.ProbeReport(node_id=n, links=[
            pb.LinkMeasurement(src=n, dst=t.node_id, bandwidth_bytes_per_s=2e9, rtt_seconds=1e-4)
            for t in reply.probe]), state)
    state.tick()
    plan = state.current_plan()
    assert plan is not None and [st.nodes for st in plan.pipelines[0].stages] == [["n0"], ["n1", "n2"]]
    return state, "n0", ["n1", "n2"]


def _report(state: CoordinatorState, node: str, step: int, *, loss: bool = True) -> pb.StepAck:
    return h.handle_report_step(pb.StepMetrics(job_id=state.job.id, node_id=node, plan_epoch=state.epoch, step=step,
                                               pipeline=0, stage=0 if node == "n0" else 1, has_loss=loss, loss=2.0,
                                               tokens=1024, step_seconds=0.1), state)


def test_a_forged_job_end_from_a_stage_0_node_is_refused(planned) -> None:
    """The finding: a stage-0 node with its own valid identity sent ReportStep(step = last - 1) with a made-up loss,
    and the coordinator marked the job finished."""
    state, first, _ = planned
    last = state.target_steps - 1
    with pytest.raises(PermissionDenied, match="last stage of pipeline 0 .n1, n2. responsible for its loss"):
        _report(state, first, last)
    # without the loss, its step is far past what the others report: held back, never taken as the end
    with pytest.raises(Unavailable, match="more than 128 steps past"):
        _report(state, first, last, loss=False)
    state.tick()
    assert not state.job_complete() and not state.control.finished_unix
    assert h.handle_status(pb.StatusRequest(), state).job_state == "running"
    assert not h.handle_heartbeat(pb.HeartbeatRequest(node_id=first), state).job_finished


def test_a_last_stage_node_alone_cannot_end_the_job(planned) -> None:
    state, first, (a, b) = planned
    last = state.target_steps - 1
    with pytest.raises(Unavailable, match="peers have reported no step yet"):  # far ahead of its peers
        _report(state, a, last)
    for step in [*range(0, last - 2, 100), last - 2]:  # the job runs to its last steps, every node reporting
        for n in (first, a, b):
            _report(state, n, step, loss=n != first)
    _report(state, a, last)  # within the window now, and taken; but one node's word
    state.tick()
    assert not state.job_complete() and not state.control.finished_unix
    _report(state, first, last, loss=False)  # a second node at the last step: two of three, a majority
    assert state.job_complete()
    state.clock.t += 1e6  # (the final checkpoint's bounded wait has passed)
    state.tick()
    assert state.control.finished_unix


def test_a_report_of_an_epoch_that_never_ran_is_refused(planned) -> None:
    state, _, (a, _) = planned
    with pytest.raises(FailedPrecondition, match="never ran"):
        h.handle_report_step(pb.StepMetrics(job_id=state.job.id, node_id=a, plan_epoch=0, step=1), state)


def test_end_corroboration_rule() -> None:
    assert claims.end_corroborated({"a"}, {"a": 9}, 9)  # a plan of one node has only its word
    assert not claims.end_corroborated({"a", "b"}, {"a": 9, "b": 8}, 9)
    assert claims.end_corroborated({"a", "b"}, {"a": 9, "b": 10}, 9)
    assert not claims.end_corroborated({"a", "b", "c", "d"}, {"a": 9, "b": 9}, 9)  # half is not more than half
    assert claims.end_corroborated({"a", "b", "c", "d"}, {"a": 9, "b": 9, "d": 9}, 9)
