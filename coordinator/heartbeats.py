"""Heartbeat streams on the coordinator server's event loop.

A node heartbeats every quarter lease; at 10,000 nodes that is 4,000 calls a second. A unary call costs the
server about 250 us of Python and gRPC work (the call's set-up, metadata, the token check, its teardown), which
saturates one core near 3,500 calls a second; a message on an open stream costs about a third of that. So each
node keeps one `HeartbeatStream` open and sends its heartbeats on it: the token and the caller's certificate are
checked once when the stream opens, and each message only that it speaks for the stream's node (and what
`handlers.handle_heartbeat` checks of any heartbeat).

Streams are bounded in number and in life, and a node holds one, two while it reconnects before the server has
noticed the first one gone: a third ends the oldest (ABORTED). A stream waits for its node's next heartbeat most of
the time; to end one at once (replaced, or the coordinator stopping: UNAVAILABLE, so the server's grace period is
not spent waiting for heartbeats) its handler's task is cancelled and the cancellation answered with the reason.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import timedelta

from atoll.coordinator import handlers
from atoll.coordinator.errors import CoordinatorError, InvalidArgument, Unavailable
from atoll.coordinator.state import CoordinatorState
from atoll.v1 import atoll_pb2 as pb

STREAMS_PER_NODE = 2
"""A node's stream plus the one it opens when it reconnects before the server has noticed the first one gone."""


class TooManyHeartbeatStreams(CoordinatorError):
    """The coordinator already holds as many heartbeat streams as it allows."""


class StreamReplaced(CoordinatorError):
    """A newer heartbeat stream of the same node replaced this one."""


@dataclass(eq=False)
class _Stream:
    node_id: str = ""
    task: asyncio.Task | None = field(default=None, repr=False)
    ending: CoordinatorError | None = None
    """Why this side ends the stream (replaced, shutting down); its task is then cancelled."""


class HeartbeatStreams:
    """The open heartbeat streams of one coordinator. Everything here runs on the server's event loop."""

    def __init__(self, state: CoordinatorState, *, max_streams: int, max_life: timedelta):
        if max_streams < 1:
            raise ValueError(f"max_streams must be at least 1, got {max_streams}")
        if max_life <= timedelta(0):
            raise ValueError(f"max_life must be positive, got {max_life}")
        self.state = state
        self.max_streams, self.max_life = max_streams, max_life
        self._open: set[_Stream] = set()
        self._by_node: dict[str, list[_Stream]] = {}

    @property
    def open(self) -> int:
        return len(self._open)

    async def serve(self, requests: AsyncIterator[pb.HeartbeatRequest],
                    check: Callable[[pb.HeartbeatRequest], None],
                    every: Callable[[], None] | None = None, seen_from: str = "") -> AsyncIterator[pb.HeartbeatReply]:
        """A reply for every heartbeat of `requests`, in order, until the node closes the stream, the stream's life
        ends (the node opens the next), or a newer stream of the same node replaces it. `check(request)` raises for
        a request the caller may not send (its certificate is another node's), on the first; `every()` raises
        before any heartbeat the stream may no longer send (its token is no longer the job's). `seen_from`: the
        host the stream came from (a coordinator restarted since the node joined learns it here)."""
        if len(self._open) >= self.max_streams:
            raise TooManyHeartbeatStreams(
                f"the coordinator holds {len(self._open)} heartbeat streams, its limit (max_heartbeat_streams); "
                f"retry later, or raise the limit if this many nodes are expected")
        loop = asyncio.get_running_loop()
        s = _Stream(task=asyncio.current_task())
        self._open.add(s)
        end = loop.time() + self.max_life.total_seconds()
        try:
            async for req in requests:
                if every is not None:
                    every()
                if not s.node_id:
                    check(req)
                    # a process that no longer speaks for the node must not replace the stream of the one that does
                    self.state.check_session(req.node_id, req.session, seen_from=seen_from)
                    self._claim(s, req.node_id)
                elif req.node_id != s.node_id:
                    raise InvalidArgument(f"a heartbeat stream speaks for one node: it opened for "
                                          f"{s.node_id!r}, not {req.node_id[:80]!r}; open a stream per node")
                yield handlers.handle_heartbeat(req, self.state)
                if loop.time() >= end:
                    return  # the node opens its next stream at once
        except asyncio.CancelledError:
            if s.ending is None:
                raise  # the node cancelled the call
            raise s.ending from None  # answered with the reason (the servicer turns it into a status)
        finally:
            self._release(s)

    def close_all(self) -> None:
        """End every open stream at once with UNAVAILABLE (the coordinator is stopping); on the server's loop."""
        for s in list(self._open):
            self._end(s, Unavailable("the coordinator is shutting down; retry shortly"))

    def _end(self, s: _Stream, why: CoordinatorError) -> None:
        if s.ending is None and s.task is not None and s.task is not asyncio.current_task():
            s.ending = why
            s.task.cancel()

    def _claim(self, s: _Stream, node_id: str) -> None:
        s.node_id = node_id
        mine = self._by_node.setdefault(node_id, [])
        while len(mine) >= STREAMS_PER_NODE:
            self._end(mine.pop(0), StreamReplaced(f"a newer heartbeat stream of node {node_id} replaced this one; a "
                                                  f"node keeps at most {STREAMS_PER_NODE}"))
        mine.append(s)

    def _release(self, s: _Stream) -> None:
        self._open.discard(s)
        mine = self._by_node.get(s.node_id)
        if mine is not None and s in mine:
            mine.remove(s)
            if not mine:
                del self._by_node[s.node_id]
