"""TensorBoard event files of a node's training steps (`atoll node --tensorboard DIR` or `[train] tensorboard_dir`).

Each node writes under `DIR/<node id>/`, so one `tensorboard --logdir DIR` shows every node side by side:
the loss and validation loss (on the node that reports them), the node's step, compute and wait seconds, its
tokens/s, peak memory, the global gradient norm and, under fp16, the loss scale and the skipped steps.
`torch.utils.tensorboard.SummaryWriter` queues the events and writes them from a thread of its own, so a step
only pays for the queueing. The `tensorboard` package is an optional extra: `pip install 'atoll[tensorboard]'`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from atoll.types import StepMetrics

log = logging.getLogger("atoll.node.tensorboard")

FLUSH_SECONDS = 10
"""How often the writer's thread flushes queued events to the file."""


def _summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch.utils.tensorboard imports the tensorboard package
        raise RuntimeError("TensorBoard event files need the tensorboard package, which is not installed: "
                           "pip install 'atoll[tensorboard]' (or pip install tensorboard), or drop --tensorboard / "
                           "[train] tensorboard_dir") from e
    return SummaryWriter


def check_available() -> None:
    """Raise a RuntimeError that says what to install when TensorBoard cannot be written."""
    _summary_writer()


class TensorBoardLog:
    """One node's event files under `root/<node_id>/`."""

    def __init__(self, root: str | Path, node_id: str):
        writer = _summary_writer()
        self.path = Path(root) / node_id
        self.path.mkdir(parents=True, exist_ok=True)
        self._writer = writer(log_dir=str(self.path), flush_secs=FLUSH_SECONDS)

    def write(self, m: StepMetrics, *, grad_norm: float | None = None, loss_scale: float | None = None,
              skipped: bool = False) -> None:
        """The scalars of one step (`m` as the node reports it; the rest from its `StepResult`)."""
        w, step = self._writer, m.step
        if m.loss is not None:
            w.add_scalar("loss/train", m.loss, step)
        if m.val_loss is not None:
            w.add_scalar("loss/validation", m.val_loss, step)
        if grad_norm is not None and math.isfinite(grad_norm):
            w.add_scalar("train/grad_norm", grad_norm, step)
        if loss_scale is not None:
            w.add_scalar("precision/loss_scale", loss_scale, step)
            w.add_scalar("precision/skipped_step", 1.0 if skipped else 0.0, step)
        w.add_scalar("time/step_seconds", m.step_seconds, step)
        w.add_scalar("time/compute_seconds", m.compute_seconds, step)
        w.add_scalar("time/wait_seconds", m.wait_seconds, step)
        if m.step_seconds > 0 and m.tokens:
            w.add_scalar("throughput/node_tokens_per_second", m.tokens / m.step_seconds, step)
        if m.peak_memory_bytes:
            w.add_scalar("memory/peak_bytes", m.peak_memory_bytes, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def open_log(root: str | Path | None, node_id: str) -> TensorBoardLog | None:
    """The node's TensorBoard log under `root`, or None when `root` is empty. A job spec that asks for one on
    a machine without the tensorboard package trains on and says so in the log (a flag that asks for it fails at
    start-up instead: `check_available`)."""
    if not root:
        return None
    try:
        tb = TensorBoardLog(root, node_id)
    except (RuntimeError, OSError) as e:
        log.error("no TensorBoard event files under %s: %s", root, e)
        return None
    log.info("writing TensorBoard event files to %s", tb.path)
    return tb
