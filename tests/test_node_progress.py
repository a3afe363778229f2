"""The node's progress line: on a run's first step, then at most every `every_s` seconds."""

from __future__ import annotations

from atoll.node.progress import ProgressLine
from atoll.types import StepMetrics


def test_a_line_on_the_first_step_then_every_interval_with_the_mean_step_time() -> None:
    t = [0.0]
    lines: list[str] = []
    p = ProgressLine(300, every_s=30.0, clock=lambda: t[0], emit=lines.append)

    def step(i: int, seconds: float, loss: float | None = None) -> str | None:
        t[0] += seconds
        return p.step(StepMetrics(job_id="j", node_id="n", plan_epoch=2, step=i, stage=1, loss=loss, tokens=1000,
                                  step_seconds=seconds))

    first = step(0, 0.5, loss=4.25)
    assert first == "step 0 (1 of 300 done; plan epoch 2, pipeline 0 stage 1): 0.5 s/step, 2,000 tokens/s here, " \
                    "loss 4.2500"
    assert all(step(i, 1.0) is None for i in range(1, 30))  # 29.5 s since the first line
    line = step(30, 2.0)
    assert line is not None and line.startswith("step 30 (31 of 300 done") and "1.03 s/step" in line  # 31 s / 30
    assert "loss" not in line  # only the node that reports the loss shows it
    assert lines == [first, line]
