"""Per-node rate limits with a penalty, for the calls whose every acceptance costs the whole job (a failure report
or a join that changes the membership makes a new plan, and every node restarts its run).

A token bucket per node: `burst` calls at once, then one more every `every_s`. A call beyond that is refused, and
the node is held off for a penalty that doubles with each refused call (from `penalty_s` up to `max_penalty_s`);
the count of refusals is forgotten once the node kept to its rate for a whole bucket. The clock is the caller's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class RateOptions:
    """How often one node may make a call."""

    burst: int
    """Calls a node may make at once."""
    every_s: float
    """Seconds that earn it one more."""
    penalty_s: float
    """How long a node is held off after its first call past the rate; each further refusal doubles it."""
    max_penalty_s: float = 600.0
    """The longest a node is held off at a time."""

    def __post_init__(self) -> None:
        if self.burst < 1 or not self.every_s > 0 or not 0 < self.penalty_s <= self.max_penalty_s:
            raise ValueError(f"a rate limit needs burst >= 1, every_s > 0 and 0 < penalty_s <= max_penalty_s, got "
                             f"{self.burst}, {self.every_s}, {self.penalty_s}, {self.max_penalty_s}")


@dataclass
class _Bucket:
    tokens: float
    updated: float
    held_until: float = 0.0
    strikes: int = 0


@dataclass
class PerNodeLimit:
    """`take(node, now)`: None when `node` may make the call now, else the seconds until it may."""

    options: RateOptions
    max_keys: int = 100_000
    """Nodes tracked at most (a join may claim any id): past it, those idle longest are forgotten."""
    _buckets: dict[str, _Bucket] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, node: str, now: float) -> float | None:
        o = self.options
        with self._lock:
            b = self._buckets.get(node)
            if b is None:
                if len(self._buckets) >= self.max_keys:
                    self._forget(now)
                b = self._buckets[node] = _Bucket(tokens=float(o.burst), updated=now)
            b.tokens = min(float(o.burst), b.tokens + max(0.0, now - b.updated) / o.every_s)
            b.updated = now
            if now >= b.held_until and b.tokens >= 1.0:
                b.tokens -= 1.0
                if b.tokens >= o.burst - 1:  # it kept to its rate for a whole bucket: past refusals are forgiven
                    b.strikes = 0
                return None
            b.strikes += 1
            b.held_until = max(b.held_until, now + min(o.max_penalty_s, o.penalty_s * 2 ** (b.strikes - 1)))
            return b.held_until - now

    def _forget(self, now: float) -> None:
        idle = sorted(self._buckets, key=lambda k: self._buckets[k].updated)
        for k in idle[: max(1, len(idle) // 4)]:
            if self._buckets[k].held_until <= now:
                del self._buckets[k]
