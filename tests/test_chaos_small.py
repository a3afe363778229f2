"""A bounded `bench.chaos`: the tiny job on three node processes and a coordinator process, with a coordinator
SIGKILLed and restarted on its state dir and a node SIGKILLed and restarted, through the benchmark's own driver
(`bench.faults`). The job completes, the coordinator's outage costs no step (training between neighbours goes on
while it is away, and the restarted coordinator keeps the plan), and the node's death is detected within its
lease and a tick."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.faults import DriverConfig, FaultDriver, FaultSchedule, rolled_back, write_job  # noqa: E402

pytestmark = pytest.mark.integration


def test_rolled_back_counts_the_deepest_fall_below_the_steps_trained() -> None:
    steps = [(1.0, 10, 1, 0.0), (2.0, 11, 1, 0.0), (3.0, 12, 1, 0.0), (5.0, 10, 2, 0.0), (6.0, 11, 2, 0.0),
             (7.0, 12, 2, 0.0), (8.0, 13, 2, 0.0)]
    assert rolled_back(steps, 4.0, 9.0) == 3  # 12 was trained, the job went on from 10
    assert rolled_back(steps, 2.5, 4.5) == 0
    assert rolled_back([(1.0, 5, 1, 0.0), (2.0, 6, 1, 0.0), (3.0, 7, 1, 0.0)], 1.5, 9.0) == 0


@pytest.mark.timeout(240)
def test_the_job_survives_a_coordinator_kill_and_a_node_kill(tmp_path: Path) -> None:
    cfg = DriverConfig(nodes=3, gap_steps=5, first_at=10, min_steps=10, restart_after=5.0, outage=3.0, lease=4.0,
                       recover_timeout=120.0)
    job = write_job(cfg, 260, tmp_path / "job.toml")
    # seed 1 orders the two: the coordinator first, while the first plan trains
    schedule = FaultSchedule(node_kills=1, coordinator_kills=1, seed=1)
    assert schedule.events() == ["coordinator-kill", "node-kill"]
    driver = FaultDriver(cfg, job, tmp_path / "run", seed=1, say=print)
    events = driver.run(schedule, timeout=200.0)
    losses = driver.summary_losses()
    print("\n".join(f"{e.kind} {e.target} at step {e.step}: detection {e.detection_s}, next step {e.next_step_s}, "
                    f"rolled back {e.rolled_back}; {e.role}; {e.note}" for e in events))
    assert [e.kind for e in events] == ["coordinator-kill", "node-kill"], "the job ended before every event"
    assert sorted(losses) == list(range(260)), "the job did not complete"
    coordinator, node = events
    assert coordinator.rolled_back == 0, coordinator.note
    assert coordinator.trained_while_down, coordinator.note  # neighbours trained on while it was away
    assert coordinator.next_step_s is not None and coordinator.next_step_s < cfg.outage
    if node.role.startswith("pipeline"):  # a node the plan ran: its death is noticed within lease + tick
        assert node.detection_s is not None and node.detection_s <= cfg.lease + 2.0, node
