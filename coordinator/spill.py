"""A store that outlives a full disk: `SpillingStore` runs on a `SqliteStore` and, once the disk refuses a write
(SQLite's "database or disk is full", ENOSPC), serves from memory and queues its writes, writing them when space
returns.

At the first refused write it copies what the file holds into a `MemoryStore` (reads need no space), applies that
write and every later one there, and queues them; the coordinator says so once. `flush` (every tick of the
coordinator's loop) tries the queue again, at most every `RETRY_S`; once all of it is written, with the members'
newest heartbeats, the file serves again, and that is said once too. Queued step reports and history samples are
bounded (the file keeps the newest `recent_steps_kept` reports anyway); other writes (members, plans, checkpoint
records, job control) are few, and are kept in order.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from atoll.coordinator.store import MemoryStore, SqliteStore, Store

log = logging.getLogger("atoll.coordinator.store")

RETRY_S = 5.0
"""How often a full disk is tried again (the first queued write)."""
MAX_QUEUED_HISTORY = 200_000
"""History samples queued at most (one per step report with a loss); past it the oldest are dropped, said."""
MAX_QUEUED_OTHER = 200_000
"""Other writes queued at most (members, links, plans, checkpoints): past it the oldest are dropped, said."""


def disk_full(e: BaseException) -> bool:
    """Whether `e` is the disk refusing a write for want of space (or of room to grow the log)."""
    if isinstance(e, sqlite3.OperationalError):
        text = str(e).lower()
        return "full" in text or "disk i/o error" in text
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


_WRITES = ("put_job", "put_member", "set_member_state", "put_links", "put_islands", "add_plan", "add_checkpoint",
           "drop_checkpoints", "add_step", "add_history", "put_control", "put_speed", "put_machine_flow",
           "add_outer_arrival", "put_outer_decision", "drop_outer_rounds", "put_outer_group")
_READS = ("get_job", "get_member", "peek_member", "list_members", "members_view", "list_links", "links_view",
          "get_islands", "plan_history", "latest_plan", "latest_epoch", "list_checkpoints", "recent_steps",
          "history", "get_control", "get_speed", "get_machine_flows", "outer_rounds", "outer_groups")


class SpillingStore(Store):
    """`disk`, and memory while it is full (module docstring). Thread-safe."""

    def __init__(self, disk: SqliteStore, *, clock: Callable[[], float] = time.monotonic):
        self.disk = disk
        self.path = disk.path
        self.recent_steps_kept = disk.recent_steps_kept
        self._clock = clock
        self._lock = threading.RLock()
        self._memory: MemoryStore | None = None
        """The state while the disk is full (None: the disk serves)."""
        self._steps: deque[tuple[str, tuple, dict]] = deque(maxlen=disk.recent_steps_kept)
        self._history: deque[tuple[str, tuple, dict]] = deque(maxlen=MAX_QUEUED_HISTORY)
        self._other: deque[tuple[str, tuple, dict]] = deque(maxlen=MAX_QUEUED_OTHER)
        self._dropped = 0
        self._retry_at = 0.0
        self.full_since: float | None = None
        """When (time.time) the disk refused a write, while it still does; None: writes reach the disk."""

    @property
    def queued(self) -> int:
        """Writes waiting for space."""
        with self._lock:
            return len(self._steps) + len(self._history) + len(self._other)

    # --- the two modes ------------------------------------------------------------------------------------------

    def _spill(self, e: BaseException) -> MemoryStore:
        """Copy the file's state into memory (the lock held); from now on writes are queued."""
        memory = MemoryStore()
        memory.recent_steps_kept = self.disk.recent_steps_kept
        copy_into(self.disk, memory)
        self._memory = memory
        self.full_since = time.time()
        self._retry_at = self._clock() + RETRY_S
        log.error("the coordinator's state disk is full (%s, under %s): it goes on serving from memory and queues its "
                  "writes, which it writes once space returns; free space there (a restart before that loses the "
                  "queued writes)", e, self.path.parent)
        return memory

    def _write(self, name: str, *args: Any, **kw: Any) -> Any:
        with self._lock:
            if self._memory is None:
                try:
                    return getattr(self.disk, name)(*args, **kw)
                except (sqlite3.OperationalError, OSError) as e:
                    if not disk_full(e):
                        raise
                    self._spill(e)
            assert self._memory is not None
            result = getattr(self._memory, name)(*args, **kw)  # raises as the file would (a plan epoch that does not grow)
            queue = self._steps if name == "add_step" else self._history if name == "add_history" else self._other
            if len(queue) == queue.maxlen and queue is not self._steps:
                self._dropped += 1
                if self._dropped == 1 or self._dropped % 10_000 == 0:
                    log.error("the state disk has been full for %d queued writes: the oldest are dropped (%d so far)",
                              queue.maxlen, self._dropped)
            queue.append((name, args, kw))
            return result

    def _backing(self) -> Store:
        memory = self._memory  # one reference read: reads do not wait on a write in flight
        return memory if memory is not None else self.disk

    def flush(self) -> None:
        with self._lock:
            if self._memory is None:
                try:
                    self.disk.flush()
                except (sqlite3.OperationalError, OSError) as e:
                    if not disk_full(e):
                        raise
                    self._spill(e)
                return
            if self._clock() < self._retry_at:
                return
            self._retry_at = self._clock() + RETRY_S
            written = 0
            try:
                for queue in (self._other, self._steps, self._history):  # members and plans first: steps name them
                    while queue:
                        name, args, kw = queue[0]
                        getattr(self.disk, name)(*args, **kw)
                        queue.popleft()
                        written += 1
                for m in self._memory.list_members():  # the newest heartbeats, which the memory held alone
                    self.disk.heartbeat(m.node_id, m.last_heartbeat_unix, m.plan_epoch, m.step)
                self.disk.flush()
            except (sqlite3.OperationalError, OSError) as e:
                if not disk_full(e):
                    raise
                return  # still full: what was written is off the queue, the rest waits
            held = time.time() - (self.full_since or time.time())
            self._memory, self.full_since = None, None
            log.warning("the coordinator's state disk has space again: %d queued writes written after %.0fs; the state "
                        "is on disk again", written, held)

    def close(self) -> None:
        with self._lock:
            if self._memory is not None:
                self._retry_at = 0.0
                try:
                    self.flush()
                except (sqlite3.Error, OSError):
                    pass
                if self._memory is not None:
                    log.error("the coordinator stops with %d writes it could not write to its full state disk: they "
                              "are lost (the nodes report again)", self.queued)
            self.disk.close()

    def heartbeat(self, node_id: str, now: float, plan_epoch: int, step: int) -> bool:
        return self._backing().heartbeat(node_id, now, plan_epoch, step)  # in memory either way: never a write


def _delegate_write(name: str) -> Callable[..., Any]:
    def method(self: SpillingStore, *args: Any, **kw: Any) -> Any:
        return self._write(name, *args, **kw)
    method.__name__ = name
    method.__doc__ = getattr(Store, name).__doc__
    return method


def _delegate_read(name: str) -> Callable[..., Any]:
    def method(self: SpillingStore, *args: Any, **kw: Any) -> Any:
        return getattr(self._backing(), name)(*args, **kw)
    method.__name__ = name
    method.__doc__ = getattr(Store, name).__doc__
    return method


for _name in _WRITES:
    setattr(SpillingStore, _name, _delegate_write(_name))
for _name in _READS:
    setattr(SpillingStore, _name, _delegate_read(_name))
SpillingStore.__abstractmethods__ = frozenset()


def copy_into(source: Store, memory: MemoryStore) -> None:
    """Everything `source` holds, written into the empty `memory` (reads only from `source`)."""
    job = source.get_job()
    if job is not None:
        memory.put_job(job)
    for m in source.list_members():
        memory.put_member(m)
    memory.put_links(source.list_links())
    memory.put_islands(source.get_islands())
    for p in source.plan_history():
        memory.add_plan(p.plan, p.created_unix, p.reason)
    for c in source.list_checkpoints():
        memory.add_checkpoint(c)
    for s in source.recent_steps(source.recent_steps_kept):
        memory.add_step(s)
    memory.load_history(source.history())
    memory.put_control(source.get_control())
    memory.put_speed(source.get_speed())
    for machine, (bw, when) in source.get_machine_flows().items():
        memory.put_machine_flow(machine, bw, when)
    arrivals, decisions = source.outer_rounds()
    for a in arrivals:
        memory.add_outer_arrival(a)
    for r, text in decisions.items():
        memory.put_outer_decision(r, text)
    for name, text in source.outer_groups().items():
        memory.put_outer_group(name, text)


def spilling(store: Store) -> Store:
    """`store` behind a `SpillingStore` when it is on disk."""
    return SpillingStore(store) if isinstance(store, SqliteStore) else store
