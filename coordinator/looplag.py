"""How late the coordinator's server loop runs: the allowance lease expiry makes for the coordinator's own stalls.

Heartbeats are answered on the server's event loop. When that loop falls behind (a burst of thousands of joins, a
plan sent to every watch, a machine whose CPU is taken by something else), a heartbeat that a node sent in time
waits in the coordinator's own queue, and its member would lapse through no fault of its own. A probe scheduled
on the loop every `period` measures how late the loop runs it; lease expiry then allows the largest lateness
seen within the last lease (`LoopLag.recent`). A node that is really gone is still declared gone, later by at
most that lateness; on an idle coordinator the allowance is a few milliseconds.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque

log = logging.getLogger("atoll.coordinator")

WARN_LAG_S = 1.0
"""A lateness worth a line in the log (at most one a minute)."""


class LoopLag:
    """Lateness of one event loop, sampled by a probe on it; read from any thread."""

    def __init__(self, period: float = 0.1, keep: float = 120.0):
        self.period, self.keep = period, keep
        self._samples: deque[tuple[float, float]] = deque()  # (monotonic time, lateness s), one per period
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._warned = 0.0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.call_soon_threadsafe(self._arm)

    def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and self._handle is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._handle.cancel)

    def _arm(self) -> None:
        if self._loop is None:
            return
        due = time.monotonic() + self.period
        self._handle = self._loop.call_later(self.period, self._probe, due)

    def _probe(self, due: float) -> None:
        now = time.monotonic()
        self.record(now, max(0.0, now - due))
        self._arm()

    def record(self, now: float, lateness: float) -> None:
        with self._lock:
            self._samples.append((now, lateness))
            while self._samples and self._samples[0][0] < now - self.keep:
                self._samples.popleft()
        if lateness >= WARN_LAG_S and now - self._warned > 60:
            self._warned = now
            log.warning("the coordinator's server loop ran %.1fs late (CPU too busy?): lease expiry allows for it, "
                        "and nodes' calls were answered that much later", lateness)

    def recent(self, window: float, now: float | None = None) -> float:
        """The largest lateness within the last `window` seconds (0 when none was measured)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return max((lag for t, lag in self._samples if t >= now - window), default=0.0)

    def latest(self) -> float:
        with self._lock:
            return self._samples[-1][1] if self._samples else 0.0
