"""Nodes write TensorBoard event files of their steps; without the tensorboard package they say what to install."""

from __future__ import annotations

import sys

import pytest

from atoll.node.tensorboard import TensorBoardLog, check_available, open_log
from atoll.types import StepMetrics


def test_a_node_writes_its_steps_as_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorBoardLog(tmp_path, "node-a")
    for k in range(5):
        m = StepMetrics(job_id="j", node_id="node-a", plan_epoch=1, step=k, loss=5.0 - k, tokens=512,
                        step_seconds=0.5, compute_seconds=0.4, wait_seconds=0.1,
                        val_loss=4.0 if k == 4 else None)
        tb.write(m, grad_norm=1.5, loss_scale=1024.0 * (k + 1), skipped=k == 2)
    tb.close()
    acc = EventAccumulator(str(tmp_path / "node-a"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss/train")] == [5.0, 4.0, 3.0, 2.0, 1.0]
    assert [(e.step, e.value) for e in acc.Scalars("loss/validation")] == [(4, 4.0)]
    assert [e.value for e in acc.Scalars("precision/skipped_step")] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert acc.Scalars("throughput/node_tokens_per_second")[0].value == pytest.approx(1024.0)
    assert open_log("", "node-a") is None


def test_without_the_tensorboard_package_the_error_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(RuntimeError, match=r"pip install 'atoll\[tensorboard\]'"):
        check_available()
    assert open_log(tmp_path, "node-a") is None  # a job spec that asks for it trains on, saying why in the log
