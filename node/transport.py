"""The seam between the pipeline schedule and whatever carries tensors between stages.

A stage sends activations downstream and activation-gradients upstream; each tensor is keyed by
(step, micro-batch, direction). `send` may return before the tensor is delivered (bounded in-flight
data); `recv` blocks until the matching tensor arrives or its timeout expires. Implementations: the
in-process transport (tests, single-process pipelines) and the gRPC peer transport.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch

Direction = Literal["forward", "backward"]


class TransportError(RuntimeError):
    """A tensor could not be sent or did not arrive in time; the message says which and why."""


@dataclass(frozen=True, order=True)
class TensorKey:
    step: int
    micro_batch: int
    direction: Direction
    """forward: an activation travelling downstream; backward: an activation-gradient travelling upstream."""


class Transport(ABC):
    """One stage replica's connections to its upstream and downstream neighbours."""

    @abstractmethod
    def send(self, key: TensorKey, tensor: torch.Tensor) -> None:
        """Send downstream (forward) or upstream (backward). May return before delivery."""

    @abstractmethod
    def recv(self, key: TensorKey, timeout: timedelta) -> torch.Tensor:
        """The tensor sent to this stage under `key`; raises TransportError on timeout."""

    def flush(self, timeout: timedelta) -> None:
        """Block until every tensor sent so far has been delivered."""

    def close(self) -> None:
        """Release connections and threads."""
