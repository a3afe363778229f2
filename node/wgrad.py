"""Deferred weight gradients: a backward that computes first what the upstream stage waits for.

The backward of a linear layer ``y = x W^T + b`` has two halves of about equal cost: the gradient of its
input, ``dy W``, which the stage sends upstream and which the previous stage is waiting for, and the
gradient of its weight, ``dy^T x``, which only the optimizer needs, at the end of the step. Computing the
weight half later, in the time a stage would otherwise spend waiting for its neighbours, shortens the
pipeline's fill and drain: this is the zero-bubble schedule's split of backward into B and W (Qi et al.,
*Zero Bubble Pipeline Parallelism*, ICLR 2024; `atoll.node.schedule` places the W actions).

`DeferrableLinear` is an `nn.Linear` (same parameters, same state dict) whose forward, while a
`WeightGradients` is attached to it (`attach`), runs through `_DeferredWeightLinear`: its backward returns the
input's and the bias's gradients at once and records ``(weight, dy, x)`` with the `WeightGradients`; the stage
takes what one micro-batch's backward recorded (`take`) and computes it later (`apply`), adding ``dy^T x`` into
``weight.grad`` as autograd's own accumulation would. Under autocast the layer computes in the autocast dtype
as `F.linear` would (inputs and weight cast, output in that dtype) and the deferred product is taken in that
dtype too, then added in the weight's dtype.

The attachment is a module attribute, not a thread-local, so a recomputed block (`torch.utils.checkpoint`)
takes the same path in the recomputation as in the original forward, on whatever thread autograd runs it.
Under tensor parallelism (`atoll.node.tp`) the weights, inputs and gradients are DTensors: the products keep
their placements (a column-parallel layer's weight gradient is sharded by rows, as the weight is), so each tp
rank defers and computes its own shards' gradients. A stage attaches only when nothing else acts on a
parameter's gradient as it is produced: not with ZeRO-2's gradient hooks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from atoll.node.storage import storage_bytes


@dataclass(frozen=True)
class _Pending:
    weight: nn.Parameter
    grad_out: torch.Tensor
    """(..., out_features): the gradient of the layer's output."""
    inputs: torch.Tensor
    """(..., in_features): the layer's input, as the product used it."""


class WeightGradients:
    """The weight-gradient products a stage's backward passes deferred, by micro-batch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a CUDA backward records from autograd's device thread
        self._open: list[_Pending] = []

    def record(self, weight: nn.Parameter, grad_out: torch.Tensor, inputs: torch.Tensor) -> None:
        with self._lock:
            self._open.append(_Pending(weight, grad_out, inputs))

    def take(self) -> list[_Pending]:
        """What the backward passes since the last `take` deferred (one micro-batch's, called after it)."""
        with self._lock:
            got, self._open = self._open, []
        return got

    def clear(self) -> None:
        """Drop anything recorded and not taken (a step that failed halfway)."""
        self.take()

    @staticmethod
    def nbytes(pending: list[_Pending]) -> int:
        """Bytes the deferred products hold until they are applied (each storage once; a DTensor's local shard)."""
        return storage_bytes(t for p in pending for t in (p.grad_out, p.inputs))

    @staticmethod
    def apply(pending: list[_Pending], done: Callable[[nn.Parameter], None] | None = None) -> None:
        """Compute the deferred weight gradients and add them to the weights' ``.grad``; `done(weight)` after
        each (a ZeRO-1 stage starts reducing what is complete)."""
        with torch.no_grad():
            for p in pending:
                go = p.grad_out.reshape(-1, p.grad_out.shape[-1])
                x = p.inputs.reshape(-1, p.inputs.shape[-1])
                g = go.t().mm(x)
                if g.dtype != p.weight.dtype:
                    g = g.to(p.weight.dtype)
                if p.weight.grad is None:
                    p.weight.grad = g
                else:
                    p.weight.grad.add_(g)
                if done is not None:
                    done(p.weight)


class _DeferredWeightLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: nn.Parameter, bias: torch.Tensor | None,
                sink: WeightGradients) -> torch.Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device):  # compute as autocast's linear would: in its dtype
            dt = torch.get_autocast_dtype(device)
            xc, wc = x.to(dt), weight.to(dt)
            with torch.autocast(device, enabled=False):
                out = F.linear(xc, wc, bias.to(dt) if bias is not None else None)
        else:
            xc, wc = x, weight
            out = F.linear(x, weight, bias)
        ctx.save_for_backward(xc, wc)
        ctx.weight, ctx.sink, ctx.has_bias = weight, sink, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        xc, wc = ctx.saved_tensors
        if grad_out.dtype != wc.dtype:
            grad_out = grad_out.to(wc.dtype)
        grad_x = grad_out.matmul(wc) if ctx.needs_input_grad[0] else None
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[1]:
            ctx.sink.record(ctx.weight, grad_out, xc)
        return grad_x, None, grad_b, None


class DeferrableLinear(nn.Linear):
    """`nn.Linear` whose weight gradient is deferred to a `WeightGradients` while one is attached."""

    deferred: WeightGradients | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sink = self.deferred
        if sink is None or not torch.is_grad_enabled() or not self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)
        return _DeferredWeightLinear.apply(x, self.weight, self.bias, sink)


def attach(module: nn.Module, sink: WeightGradients | None) -> int:
    """Defer the weight gradients of every `DeferrableLinear` in `module` to `sink` (None: compute them in
    backward again); returns how many layers it reached (0: this module has nothing to defer)."""
    n = 0
    for m in module.modules():
        if isinstance(m, DeferrableLinear):
            m.deferred = sink
            n += 1
    return n
