"""Plan watches on the coordinator server's event loop.

An open WatchPlan stream is a coroutine waiting on an `asyncio.Event`, not a thread: the state's publish and
close wake every watch through `loop.call_soon_threadsafe`, so thousands of nodes can watch while the unary
calls keep the server's thread pool to themselves. Watches are bounded in number, in life, and per node.

A new plan goes to every open watch at once: converted to its message once (`_to_message`) and serialized once
(`add_coordinator_to_server` registers WatchPlan with a serializer that remembers the last message's bytes), so
10,000 watches cost one serialization of a plan that names 10,000 nodes, not 10,000. Nodes watch with
WatchPlanPacked, which sends that serialization as one zstd frame (`PackedPlan`), also made once: each watch then
carries ~14 KB instead of ~200 KB, and the plan's wave through 10,000 watches moves 140 MB instead of 2 GB.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta

import zstandard

from atoll.coordinator import handlers
from atoll.coordinator.errors import CoordinatorError
from atoll.coordinator.state import CoordinatorState
from atoll.plan import Plan
from atoll.serde import plan_to_proto
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc

WATCHES_PER_NODE = 2
"""A node's watch plus the one it opens when it reconnects before the server has noticed the first one gone."""


class TooManyWatches(CoordinatorError):
    """The coordinator already holds as many plan watches as it allows."""


class WatchReplaced(CoordinatorError):
    """A newer watch of the same node ended this one."""


@dataclass(eq=False)
class _Watch:
    node_id: str
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    replaced: bool = False


class PlanWatches:
    """The open plan watches of one coordinator. `watch()` runs on the server's event loop, and so does
    everything that reads or changes the open watches; only the state's listener comes from other threads."""

    def __init__(self, state: CoordinatorState, *, max_watches: int, max_life: timedelta):
        self.state = state
        self.max_watches, self.max_life = max_watches, max_life
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open: set[_Watch] = set()
        self._by_node: dict[str, list[_Watch]] = {}
        self._message: tuple[Plan, pb.Plan] | None = None
        self._packed: tuple[Plan, pb.PackedPlan] | None = None
        self._remove_listener = state.add_plan_listener(self._wake_threadsafe)

    @property
    def open(self) -> int:
        return len(self._open)

    def close(self) -> None:
        self._remove_listener()

    async def watch(self, req: pb.WatchPlanRequest, *, packed: bool = False) -> AsyncIterator[pb.Plan | pb.PackedPlan]:
        """Plans newer than `req.known_epoch` as they are published (`packed`: as `PackedPlan`s), until the watch's
        life ends, a newer watch of the same node replaces it, or the state closes."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        w = self._admit(req.node_id)
        try:
            # the membership check reads the store, so it runs on the server's thread pool, not on the loop
            known = await loop.run_in_executor(None, handlers.open_watch, req, self.state)
            end = loop.time() + self.max_life.total_seconds()
            while not self.state.closed:
                w.wake.clear()  # before looking, so that a publish from here on ends the wait below at once
                if w.replaced:
                    raise WatchReplaced(f"a newer plan watch of node {w.node_id} replaced this one; a node keeps at "
                                        f"most {WATCHES_PER_NODE}")
                plan = self.state.newer_plan(known, req.node_id)
                if plan is not None:
                    if req.node_id:  # a newer process of the node may have joined since the watch opened
                        self.state.check_session(req.node_id, req.session)
                    known = plan.epoch
                    yield self._to_packed(plan) if packed else self._to_message(plan)
                    continue
                left = end - loop.time()
                if left <= 0:
                    return  # the node opens its next watch at once
                try:
                    await asyncio.wait_for(w.wake.wait(), left)
                except asyncio.TimeoutError:
                    return
        finally:
            self._release(w)

    def _admit(self, node_id: str) -> _Watch:
        if len(self._open) >= self.max_watches:
            raise TooManyWatches(f"the coordinator holds {len(self._open)} plan watches, its limit (max_watches); "
                                 f"retry later, or raise the limit if this many nodes are expected")
        w = _Watch(node_id)
        self._open.add(w)
        if node_id:  # an anonymous watch (a status tool) counts only against the total
            mine = self._by_node.setdefault(node_id, [])
            while len(mine) >= WATCHES_PER_NODE:
                old = mine.pop(0)
                old.replaced = True
                old.wake.set()
            mine.append(w)
        return w

    def _release(self, w: _Watch) -> None:
        self._open.discard(w)
        mine = self._by_node.get(w.node_id)
        if mine is not None and w in mine:
            mine.remove(w)
            if not mine:
                del self._by_node[w.node_id]

    def _to_message(self, plan: Plan) -> pb.Plan:
        # every watch sends the same new plan: convert it once
        if self._message is None or self._message[0] is not plan:
            self._message = (plan, plan_to_proto(plan))
        return self._message[1]

    def _to_packed(self, plan: Plan) -> pb.PackedPlan:
        if self._packed is None or self._packed[0] is not plan:
            raw = self._to_message(plan).SerializeToString()
            self._packed = (plan, pb.PackedPlan(epoch=plan.epoch, plan_bytes=len(raw),
                                                plan_zstd=zstandard.ZstdCompressor(level=3).compress(raw)))
        return self._packed[1]

    def _wake_threadsafe(self) -> None:
        loop = self._loop
        if loop is None:
            return  # no watch has started yet, so none waits
        try:
            loop.call_soon_threadsafe(self._wake_all)
        except RuntimeError:
            pass  # the loop has closed with the server: no watch is left to wake

    def _wake_all(self) -> None:
        for w in self._open:
            w.wake.set()


class SerializeOnce:
    """A response serializer that serializes a message once however many streams send it: it remembers the bytes
    of the last message it was given (by identity; the message is kept referenced, so its id is not reused)."""

    def __init__(self) -> None:
        self._last: tuple[object, bytes] | None = None
        self._lock = threading.Lock()

    def __call__(self, message) -> bytes:
        last = self._last
        if last is not None and last[0] is message:
            return last[1]
        data = message.SerializeToString()
        with self._lock:
            self._last = (message, data)
        return data


class _Registrations:
    """Takes the method handlers a generated `add_*_to_server` registers, instead of a server."""

    def __init__(self) -> None:
        self.handlers: dict = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # the same handlers come to `add_registered_method_handlers`

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.handlers.update(handlers)


def add_coordinator_to_server(servicer: pb_grpc.CoordinatorServicer, server) -> None:
    """`add_CoordinatorServicer_to_server`, with WatchPlan's plans serialized once for all the watches."""
    import grpc

    taken = _Registrations()
    pb_grpc.add_CoordinatorServicer_to_server(servicer, taken)
    handlers = dict(taken.handlers)
    for name in ("WatchPlan", "WatchPlanPacked"):
        watch = handlers[name]
        handlers[name] = grpc.unary_stream_rpc_method_handler(
            watch.unary_stream, request_deserializer=watch.request_deserializer, response_serializer=SerializeOnce())
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


SERVICE = "atoll.v1.Coordinator"
