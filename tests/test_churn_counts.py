"""The churn benchmark counts the steps an event rolled back from what the nodes' runs said where they resumed."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench tree is not installed
from bench.churn import count_rollbacks, resumes_in_logs  # noqa: E402
from bench.faults import Event  # noqa: E402


def _line(t: float, text: str) -> str:
    return f"{time.strftime('%H:%M:%S', time.localtime(t))} I atoll.node.runner: {text}"


def _resume(step: int, how: str, was: int) -> str:
    return (f"resume: step {step} ({how}; no state fetched); the job was at step {was}: {was - step} steps "
            "rolled back")


def test_each_event_costs_the_most_any_run_in_its_window_rolled_back(tmp_path: Path) -> None:
    t0 = float(int(time.time()) - 600)
    (tmp_path / "node1.log").write_text("\n".join([
        _line(t0 + 1, _resume(0, "checkpoint", 0)),  # the first plan: before any event
        _line(t0 + 12, _resume(120, "live state", 120)),  # the kill at t0 + 10
        _line(t0 + 31, _resume(150, "checkpoint", 163)),  # the join at t0 + 30: 13 steps rolled back
        _line(t0 + 31, "step 151: validation loss 2.0"),
    ]) + "\n")
    (tmp_path / "node2.log").write_text("\n".join([
        _line(t0 + 12, _resume(120, "live state", 120)),
        _line(t0 + 31, _resume(150, "checkpoint", 163)),
    ]) + "\n")
    logs = sorted(tmp_path.glob("node*.log"))
    assert resumes_in_logs(logs, t0 + 10, t0 + 30) == [("node1", 120, "live state", 0),
                                                      ("node2", 120, "live state", 0)]
    kill = Event(index=1, kind="node-kill", at=t0 + 10)
    join = Event(index=2, kind="join", at=t0 + 30, note="joined")
    leave = Event(index=3, kind="leave", at=t0 + 50)  # no plan, no run resumed: nothing rolled back
    count_rollbacks([join, kill, leave], logs, t0 + 60)
    assert (kill.rolled_back, join.rolled_back, leave.rolled_back) == (0, 13, 0)
    assert kill.note == "2 run(s) resumed from live state"
    assert join.note == "joined; 2 run(s) resumed from checkpoint"
    assert leave.note == "no run resumed"
