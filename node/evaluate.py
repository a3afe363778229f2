"""Validation passes: held-out batches forward through the pipeline, no backward, no weight update.

Every stage of a pipeline runs the pass after the same training step (`train.eval_every`): the first stage
feeds the held-out inputs, each stage sends its activations on through the same transport as training, and
the last stage returns the mean loss over the held-out batches. The pass's tensors travel under the step
just trained, as micro-batches numbered after the step's own (held-out batch j, micro-batch i is number
`m * (1 + j) + i` of m per batch), so they never meet a training tensor; a transport that bounds the
micro-batch index must allow `transport_micro_batches(m, batches)` of them. A laned stage's replica passes its
lane's micro-batches (i % lanes == lane; m is a multiple of lanes, so the number's lane is i's).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from atoll.node.data import Batch
from atoll.node.model import lm_loss
from atoll.node.stage import PipelineStage
from atoll.node.transport import TensorKey


def transport_micro_batches(micro_batches: int, eval_batches: int) -> int:
    """Micro-batch numbers a step uses when a validation pass of `eval_batches` batches may follow it."""
    return micro_batches * (1 + eval_batches)


def eval_key(step: int, micro_batches: int, batch: int, micro_batch: int) -> TensorKey:
    return TensorKey(step, micro_batches * (1 + batch) + micro_batch, "forward")


def validation_loss(stage: PipelineStage, step: int, batches: Sequence[Batch] | None, count: int) -> float | None:
    """Run `count` held-out batches (this replica's rows of each; the first and last stages pass them, others
    None) forward after training step `step`; the last stage returns their mean loss, the others None."""
    m, lanes, lane = stage.config.micro_batches, stage.config.lanes, stage.config.lane
    if (stage.is_first or stage.is_last) and (batches is None or len(batches) != count):
        raise ValueError(f"stage {stage.stage} needs its {count} held-out batches for the validation pass")
    stage.module.eval()
    losses: list[float] = []
    with torch.no_grad():
        for j in range(count):
            b = batches[j] if batches is not None else None
            inputs = stage._split(b.inputs if b else None, "inputs", stage.is_first)
            targets = stage._split(b.targets if b else None, "targets", stage.is_last)
            for i in range(lane, m, lanes):  # a laned replica passes its lane's micro-batches
                key = eval_key(step, m, j, i)
                h = inputs[i // lanes].to(stage.device) if stage.is_first else stage._recv(key).to(stage.device)
                with stage._autocast():
                    out = stage.module(h)
                    if stage.is_last:
                        losses.append(float(lm_loss(out, targets[i // lanes].to(stage.device)).float()))
                if not stage.is_last:
                    stage._send(key, out)
    if not stage.is_last:
        # nothing comes back to wait for: without this a stage that ends its run here (the last step) could
        # close its transport before the pass's last activations reach the next stage
        stage.transport.flush(stage.config.recv_timeout)
    stage.module.train()
    return sum(losses) / len(losses) if stage.is_last else None
