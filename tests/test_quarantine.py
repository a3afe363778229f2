"""Quarantine (`atoll.coordinator.quarantine`): a sender its neighbours keep rejecting is taken out of the plan, told so
by its heartbeats, kept out when it joins again, and let back by `atoll job release`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from atoll.coordinator import handlers as h
from atoll.coordinator.errors import FailedPrecondition, InvalidArgument
from atoll.coordinator.quarantine import QuarantineOptions, quarantine_reason
from atoll.coordinator.state import CoordinatorState
from atoll.coordinator.store import MemoryStore
from atoll.job import JobSpec
from atoll.v1 import atoll_pb2 as pb
from test_claims import Clock, _profile, two_stages

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret"


def _join(state: CoordinatorState, n: str) -> pb.JoinReply:
    return h.handle_join(pb.JoinRequest(token=TOKEN, node_id=n, profile=_profile(f"host-{n}"),
                                        peer_address=f"127.0.0.1:{5000 + int(n[1:])}"), state)


def _beat_all(state: CoordinatorState, nodes) -> None:
    for n in nodes:
        reply = h.handle_heartbeat(pb.HeartbeatRequest(node_id=n, plan_epoch=state.epoch), state)
        h.handle_report_probes(pb.ProbeReport(node_id=n, links=[
            pb.LinkMeasurement(src=n, dst=t.node_id, bandwidth_bytes_per_s=2e9, rtt_seconds=1e-4)
            for t in reply.probe]), state)


@pytest.fixture
def planned() -> tuple[CoordinatorState, Clock]:
    """Four nodes: n0 runs stage 0, n1-n3 replicate stage 1."""
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=1000))
    clock = Clock()
    state = CoordinatorState(store=MemoryStore(), job=job, token=TOKEN, clock=clock, planner=two_stages)
    for i in range(4):
        _join(state, f"n{i}")
    _beat_all(state, ["n0", "n1", "n2", "n3"])
    state.tick()
    plan = state.current_plan()
    assert plan is not None and [st.nodes for st in plan.pipelines[0].stages] == [["n0"], ["n1", "n2", "n3"]]
    return state, clock


def _report(state: CoordinatorState, node: str, step: int, offences=()) -> pb.StepAck:
    return h.handle_report_step(pb.StepMetrics(job_id=state.job.id, node_id=node, plan_epoch=state.epoch, step=step,
                                               pipeline=0, stage=0 if node == "n0" else 1, tokens=1024,
                                               step_seconds=0.1, offences=list(offences), skipped=bool(offences)),
                                state)


def _nan_from(sender: str, step: int, direction: str = "forward") -> pb.TensorOffence:
    return pb.TensorOffence(sender=sender, kind="non-finite", direction=direction, step=step, finite=False,
                            detail="(non-finite values)")


def test_repeated_offences_quarantine_the_sender_until_the_operator_releases_it(planned) -> None:
    state, clock = planned
    for step in range(12):
        offended = step in (3, 7, 11)
        for n in ("n0", "n1", "n2", "n3"):
            # n1 and n2 both reject step 11's activations: one step, counted once
            named = [_nan_from("n0", step)] if offended and (n == "n1" or (n == "n2" and step == 11)) else []
            _report(state, n, step, named)
        if step == 7:  # two offending steps: named in the status, not quarantined yet
            status = h.handle_status(pb.StatusRequest(), state)
            assert [(o.node_id, o.offences, o.quarantined) for o in status.offenders] == [("n0", 2, False)]
            assert "step 7: n0 sent a non-finite activation" in status.offenders[0].newest
    member = state.store.get_member("n0")
    assert member is not None and member.state == "quarantined" and "3 steps" in member.reason
    # the next plan leaves it out
    clock.t += 3
    _beat_all(state, ["n1", "n2", "n3"])
    state.tick()
    clock.t += 3
    state.tick()
    assert state.epoch == 2
    assert "n0" not in {n for st in state.current_plan().pipelines[0].stages for n in st.nodes}
    # its heartbeats say so (and give it nothing to probe); joining again does not let it back
    beat = h.handle_heartbeat(pb.HeartbeatRequest(node_id="n0"), state)
    assert beat.quarantined and "3 steps" in beat.quarantine_reason and not beat.probe
    _join(state, "n0")
    assert state.store.get_member("n0").state == "quarantined"
    status = h.handle_status(pb.StatusRequest(), state)
    assert [(o.node_id, o.quarantined) for o in status.offenders] == [("n0", True)]
    listed = h.handle_control_job(pb.JobControlRequest(action="quarantine"), state)
    assert [q.node_id for q in listed.quarantined] == ["n0"]
    # the operator lets it back: it heartbeats, so it is alive, and the next plan may include it
    with pytest.raises(FailedPrecondition, match="not quarantined"):
        h.handle_control_job(pb.JobControlRequest(action="release", node_id="n1"), state)
    done = h.handle_control_job(pb.JobControlRequest(action="release", node_id="n0"), state)
    assert "released" in done.message and state.store.get_member("n0").state == "alive"
    assert not h.handle_heartbeat(pb.HeartbeatRequest(node_id="n0"), state).quarantined
    assert h.handle_control_job(pb.JobControlRequest(action="quarantine"), state).quarantined == []
    for _ in range(6):
        clock.t += 3
        _beat_all(state, ["n0", "n1", "n2", "n3"])
        state.tick()
    assert "n0" in {n for st in state.current_plan().pipelines[0].stages for n in st.nodes}


def test_offences_the_plan_does_not_allow_are_refused_and_a_loss_counts_for_no_quarantine(planned) -> None:
    state, _ = planned
    with pytest.raises(InvalidArgument, match="sends no forward tensors"):
        _report(state, "n2", 0, [_nan_from("n1", 0)])  # n1 is n2's fellow replica, not its neighbour
    with pytest.raises(InvalidArgument, match="sends no backward tensors"):
        _report(state, "n1", 0, [_nan_from("n0", 0, "backward")])  # the last stage gets no gradients
    loss = pb.TensorOffence(sender="n1", kind="loss", direction="loss", step=0, finite=False)
    for step in range(5):
        for n in ("n0", "n1", "n2", "n3"):
            _report(state, n, step, [replace_step(loss, step)] if n == "n1" else [])
    assert state.store.get_member("n1").state == "alive"


def replace_step(o: pb.TensorOffence, step: int) -> pb.TensorOffence:
    out = pb.TensorOffence()
    out.CopyFrom(o)
    out.step = step
    return out


def test_the_quarantine_rule_counts_distinct_steps_within_the_window() -> None:
    opts = QuarantineOptions(offences=3, window_steps=100)
    assert quarantine_reason("x", [5, 5, 6], "", opts) is None
    assert quarantine_reason("x", [5, 60, 200], "", opts) is None  # spread wider than the window
    assert "3 steps" in quarantine_reason("x", [150, 200, 249], "the newest", opts)


def test_the_fault_benchmarks_find_a_quarantine_in_the_coordinators_log(planned, caplog, tmp_path: Path) -> None:
    """bench.chaos and bench.churn count false quarantines from the coordinator's log: its parser reads the line the
    coordinator writes (here made by a real quarantine), and a log without one, or no log, names none."""
    import logging
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench tree is not installed
    from bench.faults import quarantines

    state, _ = planned
    with caplog.at_level(logging.INFO, logger="atoll"):
        for step in range(12):
            for n in ("n0", "n1", "n2", "n3"):
                _report(state, n, step, [_nan_from("n0", step)] if step in (3, 7, 11) and n == "n1" else [])
    assert state.store.get_member("n0").state == "quarantined"
    log = tmp_path / "coordinator.log"
    log.write_text("\n".join(f"12:00:00 W {r.name}: {r.getMessage()}" for r in caplog.records) + "\n")
    found = quarantines([log, tmp_path / "missing.log"])
    assert [n for n, _ in found] == ["n0"] and "3 steps" in found[0][1], found
    clean = tmp_path / "clean.log"
    clean.write_text("12:00:00 I atoll.coordinator: plan epoch 2 (node n1 is gone)\n")
    assert quarantines([clean]) == []
