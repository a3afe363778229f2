"""The node agent's outbox: checkpoint and failure reports are kept through a coordinator outage and
delivered when it is back; refused ones are dropped; those of a superseded plan are dropped."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import grpc
import pytest

from atoll.node.agent import AgentConfig, NodeAgent
from atoll.plan import Plan
from atoll.v1 import atoll_pb2 as pb


class _Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name.lower()


@pytest.fixture
def agent(tmp_path: Path):
    a = NodeAgent(AgentConfig(coordinator="127.0.0.1:1", token="t", state_dir=tmp_path,
                              backoff=(timedelta(milliseconds=10), timedelta(milliseconds=40))))
    yield a
    a.stop(leave=False)


@pytest.mark.timeout(20)
def test_reports_wait_out_an_outage_and_refusals_are_dropped(agent: NodeAgent) -> None:
    up = threading.Event()
    delivered: list[str] = []
    calls: list[str] = []

    def call(method: str, request, timeout=None):
        calls.append(method)
        if request.step == 99:
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION)
        if not up.is_set():
            raise _Refused(grpc.StatusCode.UNAVAILABLE)
        return pb.Ack(message="ok")

    agent.call = call  # type: ignore[method-assign]
    thread = threading.Thread(target=agent._outbox_loop, daemon=True)
    thread.start()
    agent.send_later("ReportCheckpoint", pb.CheckpointReport(step=10), epoch=0, what="checkpoint of step 10",
                     on_delivered=lambda: delivered.append("ck10"))
    agent.send_later("ReportFailure", pb.RunFailure(step=12, reason="x"), epoch=0, what="failure",
                     on_delivered=lambda: delivered.append("failure"))
    assert not agent.flush_outbox(timedelta(milliseconds=300))  # the coordinator is away: kept, retried
    assert len(calls) > 3 and delivered == []
    up.set()
    agent.send_later("ReportCheckpoint", pb.CheckpointReport(step=99), epoch=0, what="refused",
                     on_delivered=lambda: delivered.append("refused"))
    assert agent.flush_outbox(timedelta(seconds=5))
    assert delivered == ["ck10", "failure"]  # in order; the refused one was dropped


@pytest.mark.timeout(20)
def test_reports_of_a_superseded_plan_are_dropped(agent: NodeAgent) -> None:
    agent.call = lambda *a, **k: (_ for _ in ()).throw(_Refused(grpc.StatusCode.UNAVAILABLE))  # type: ignore
    thread = threading.Thread(target=agent._outbox_loop, daemon=True)
    thread.start()
    agent.send_later("ReportCheckpoint", pb.CheckpointReport(step=10), epoch=1, what="checkpoint of step 10")
    assert not agent.flush_outbox(timedelta(milliseconds=100))
    agent.plan = Plan(model="tiny", global_batch=1, seq_len=1, epoch=2, job_id="j")
    assert agent.flush_outbox(timedelta(seconds=5))


@pytest.mark.timeout(20)
def test_step_reports_never_raise_and_wait_in_order_for_the_coordinator(agent: NodeAgent) -> None:
    from atoll.types import StepMetrics

    up = threading.Event()
    got: list[int] = []

    def call(method: str, request, timeout=None):
        if request.step == 7:
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION)
        if not up.is_set():
            raise _Refused(grpc.StatusCode.UNAVAILABLE)
        got.append(request.step)
        return pb.StepAck(stop=request.step == 9)

    def metrics(step: int) -> StepMetrics:
        return StepMetrics(job_id="j", node_id="n", plan_epoch=1, step=step, pipeline=0, stage=0, loss=None,
                           tokens=1, step_seconds=0.1, compute_seconds=0.1, wait_seconds=0.0, links=[],
                           unix_time=0.0)

    agent.call = call  # type: ignore[method-assign]
    thread = threading.Thread(target=agent._outbox_loop, daemon=True)
    thread.start()
    assert not agent.report_step(metrics(7)).stop  # refused for good: go on, nothing kept
    for step in range(3):
        assert not agent.report_step(metrics(step)).stop  # away: kept, "go on"
    up.set()
    agent.report_step(metrics(3))  # behind the backlog, not before it
    assert agent.flush_outbox(timedelta(seconds=5))
    assert got == [0, 1, 2, 3]
    assert agent.report_step(metrics(9)).stop  # the coordinator's answer, once nothing waits


def test_a_full_step_backlog_drops_the_oldest_and_says_so(caplog) -> None:
    """While the coordinator is away a node keeps `STEP_BACKLOG` step reports; past that the oldest go, logged."""
    import logging
    from collections import deque

    from atoll.node import agent as agent_module
    from atoll.node.agent import NodeAgent, _Outgoing

    a = NodeAgent.__new__(NodeAgent)  # only the backlog: no coordinator, no threads
    a._step_backlog = deque(maxlen=3)
    a._dropped_steps = 0
    with caplog.at_level(logging.WARNING, logger="atoll"):
        for i in range(5):
            a._backlog_step(_Outgoing("ReportStep", None, 1, f"step {i}"))
    assert [o.what for o in a._step_backlog] == ["step 2", "step 3", "step 4"] and a._dropped_steps == 2
    assert sum("the oldest are dropped" in r.message for r in caplog.records) == 1
    assert agent_module.STEP_BACKLOG == 4096
