"""The receive side of the peer transport: what a stage accepts from its neighbours, and where it waits.

Errors here are plain exceptions; the Peer servicer maps them to gRPC status codes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from atoll.v1 import atoll_pb2 as pb


class InvalidTransfer(ValueError):
    """A message is malformed or does not match what the stage expects (shape, dtype, size, codec, checksum)."""


class UnexpectedTransfer(RuntimeError):
    """A well-formed message this node cannot take now: another plan epoch, a step outside the window, no stage."""


class ReceiverBusy(RuntimeError):
    """The mailbox has no room for the tensor before the call's deadline; the sender should retry later."""


class TransferReceiver(Protocol):
    """Takes the chunks of one Transfer call and answers with its acknowledgement."""

    def receive(self, chunks: Iterator[pb.TensorChunk], *, peer: str,
                deadline_seconds: float) -> pb.TransferAck: ...
