"""Heartbeat cadence: how often nodes heartbeat and how long a lease lasts, for the membership's size.

A node heartbeats every quarter lease (`CoordinatorOptions.heartbeat`). A fixed cadence makes the coordinator's
load grow with the membership: 10,000 nodes at the default 2.5 s are 4,000 heartbeats a second, which a single
coordinator process answers only with queueing (its heartbeat p99 passed half a second on a 2-core machine). So
the coordinator holds heartbeats to a rate budget (`CoordinatorOptions.heartbeat_budget`, heartbeats a second):
past `budget x interval` members, the interval stretches to `members / budget`, in half-octave steps, and the
lease with it (the same number of missed heartbeats lapses a lease at any size). Failure detection at that size
takes longer by the same factor, as it does in any large cluster manager (a Kubernetes node lease is renewed
every 10 s and lapses after 40 s).

Nodes learn the cadence from every join and heartbeat reply. A longer cadence applies at once (a node still on
the shorter interval only renews early). A shorter one is announced at once, but leases keep expiring by the
longer lease for one longer lease more, by when every live node has heartbeated under the new announcement.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Cadence:
    interval: float
    """Seconds between a node's heartbeats."""
    lease: float
    """Seconds without a heartbeat after which a member is gone."""


class HeartbeatCadence:
    """The cadence for the current membership (`update`, from the coordinator's loop) and the lease that expiry
    uses (`expiry_lease`). Thread-safe: handlers read `current` while the loop updates it."""

    STEP = math.sqrt(2.0)
    """Cadences are the base one stretched by powers of this (half octaves): a membership that grows by a few
    nodes does not announce a new interval each time."""

    def __init__(self, interval: float, lease: float, budget: float | None):
        if not 0 < interval < lease:
            raise ValueError(f"heartbeat interval ({interval}s) must be positive and shorter than the lease ({lease}s)")
        if budget is not None and budget <= 0:
            raise ValueError(f"heartbeat budget must be positive (heartbeats a second) or None, got {budget}")
        self.base = Cadence(interval, lease)
        self.budget = budget
        self._lock = threading.Lock()
        self._stretch = 0  # the current cadence is the base one times STEP ** _stretch
        self._holds: list[tuple[float, float]] = []  # (lease, until): longer leases still honoured after a shrink

    @property
    def current(self) -> Cadence:
        """What join and heartbeat replies announce."""
        with self._lock:
            return self._of(self._stretch)

    def _of(self, stretch: int) -> Cadence:
        f = self.STEP ** stretch
        return Cadence(self.base.interval * f, self.base.lease * f)

    def needed(self, members: int) -> int:
        """The smallest stretch whose heartbeats from `members` nodes stay within the budget."""
        if self.budget is None or members <= 0:
            return 0
        rate = members / (self.budget * self.base.interval)  # times the base interval the budget needs
        if rate <= 1.0:
            return 0
        return math.ceil(math.log(rate, self.STEP) - 1e-9)

    def update(self, members: int, now: float) -> Cadence | None:
        """Set the cadence for `members` alive nodes at `now`; the new cadence when it changed, else None."""
        want = self.needed(members)
        with self._lock:
            self._holds = [(lease, until) for lease, until in self._holds if until > now]
            if want == self._stretch:
                return None
            if want < self._stretch:
                if self.needed(math.ceil(members * self.STEP)) >= self._stretch:
                    return None  # hysteresis: shrink only once the membership is well below this cadence's
                old = self._of(self._stretch)
                self._holds.append((old.lease, now + old.lease))
            self._stretch = want
            return self._of(want)

    def expiry_lease(self, now: float) -> float:
        """The lease that expiry uses at `now`: the current one, or a longer one announced until recently."""
        with self._lock:
            return max([self._of(self._stretch).lease] + [lease for lease, until in self._holds if until > now])
