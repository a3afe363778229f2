"""A node's heartbeats on one long-lived `HeartbeatStream` to the coordinator.

`HeartbeatSender.beat(request, timeout)` sends one heartbeat and returns its reply, as the unary `Heartbeat` would,
and raises `grpc.RpcError` as it would: the caller's handling of NOT_FOUND (join again), UNAUTHENTICATED and
outages stays the same. Underneath, the heartbeats share one stream (about a third of a unary call's cost to the
coordinator, see `atoll.coordinator.heartbeats`). The stream is opened on the first beat and again after any
failure, and renewed before its life ends. A coordinator that has no such method (UNIMPLEMENTED) or holds all the
streams it allows (RESOURCE_EXHAUSTED) gets unary heartbeats instead: for good, or for that beat.

Threads: `beat` is called from one thread (the agent's heartbeat loop); a reader thread per stream moves replies
into a queue, so a beat waits for its reply at most `timeout`. gRPC reads the requests from a queue on a thread
of its own.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import grpc

from atoll.v1 import atoll_pb2 as pb

log = logging.getLogger("atoll.node.heartbeat")

_ENDED = object()
"""Put in the reply queue when the coordinator ended the stream cleanly (its life): the next beat reopens it."""


class HeartbeatTimeout(grpc.RpcError):
    """No reply to a heartbeat within its deadline; the stream is closed and the next beat opens another."""

    def __init__(self, seconds: float):
        super().__init__(f"no heartbeat reply within {seconds:.1f}s")
        self._details = f"no heartbeat reply within {seconds:.1f}s on the heartbeat stream"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self._details


class _Stream:
    """One open HeartbeatStream call: a request queue gRPC reads, and a reader thread that queues the replies."""

    def __init__(self, open_call: Callable[[Iterator[pb.HeartbeatRequest], float], object], life: float):
        self.requests: queue.Queue = queue.Queue()
        self.replies: queue.Queue = queue.Queue()
        self.opened = time.monotonic()
        # the call's own deadline is past the life this side renews it at: the renewal ends it first
        self.call = open_call(self._requests(), life + 60.0)
        self.reader = threading.Thread(target=self._read, name="atoll-heartbeat-reader", daemon=True)
        self.reader.start()

    def _requests(self) -> Iterator[pb.HeartbeatRequest]:
        while True:
            r = self.requests.get()
            if r is None:
                return
            yield r

    def _read(self) -> None:
        try:
            for reply in self.call:  # type: ignore[attr-defined]
                self.replies.put(reply)
            self.replies.put(_ENDED)
        except grpc.RpcError as e:
            self.replies.put(e)
        except ValueError:  # the channel closed under the stream (the agent stopped)
            self.replies.put(_ENDED)

    def close(self) -> None:
        self.requests.put(None)  # half-close: the coordinator ends its side
        self.call.cancel()  # type: ignore[attr-defined]


class HeartbeatSender:
    """Heartbeats over a stream, with unary calls as the fallback (see the module's docstring)."""

    def __init__(self, open_call: Callable[[Iterator[pb.HeartbeatRequest], float], object],
                 unary: Callable[[pb.HeartbeatRequest, float], pb.HeartbeatReply], *,
                 life: timedelta = timedelta(minutes=5)):
        self._open_call = open_call
        self._unary = unary
        self._life = life.total_seconds()
        self._stream: _Stream | None = None
        self._lock = threading.Lock()
        self.streaming = True
        """False once the coordinator said it has no heartbeat streams: every beat is then a unary call."""

    def beat(self, request: pb.HeartbeatRequest, timeout: float) -> pb.HeartbeatReply:
        """Send one heartbeat; its reply, or the `grpc.RpcError` that ended it within `timeout` seconds."""
        if not self.streaming:
            return self._unary(request, timeout)
        deadline = time.monotonic() + timeout
        for _ in range(2):  # a stream the coordinator ended cleanly (its life) is reopened once, at once
            stream = self._current()
            stream.requests.put(request)
            try:
                item = stream.replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.reset()
                raise HeartbeatTimeout(timeout) from None
            if item is _ENDED:
                self.reset()
                continue
            if isinstance(item, grpc.RpcError):
                self.reset()
                code = item.code()  # type: ignore[attr-defined]
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("the coordinator has no heartbeat streams; heartbeating with unary calls")
                    self.streaming = False
                    return self._unary(request, max(0.1, deadline - time.monotonic()))
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # it holds all the streams it allows: this beat unary
                    return self._unary(request, max(0.1, deadline - time.monotonic()))
                raise item
            return item
        raise HeartbeatTimeout(timeout)

    def _current(self) -> _Stream:
        with self._lock:
            s = self._stream
            if s is not None and time.monotonic() - s.opened > self._life:
                s.close()  # renewed before the coordinator's own bound on a stream's life ends it
                s = None
            if s is None:
                s = self._stream = _Stream(self._open_call, self._life)
            return s

    def reset(self) -> None:
        """Close the open stream (after a failure, a new channel or a new node id); the next beat opens another."""
        with self._lock:
            s, self._stream = self._stream, None
        if s is not None:
            s.close()
