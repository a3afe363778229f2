"""The job's events for the dashboard: joins, leaves, failures, replans, checkpoints (with who holds each), drift
and quarantines, newest last, in a bounded log.

Two sources feed it. The coordinator's loop hands over what each of its rounds decided (`note_tick`: replans,
drift replans, lapsed leases, cadence changes), and each dashboard snapshot compares what it read with the
snapshot before (`observe`: members that joined, left, went or were quarantined; failure reports; checkpoints
that became complete; senders whose tensors were rejected). Neither touches the gRPC path.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping

MAX_EVENTS = 500
"""Events kept (the oldest drop out)."""
MAX_ANNOUNCED = 20
"""Per snapshot, most joins or leaves listed one by one; more are said as one event (10,000 joins at start)."""


_NODE_STATE = re.compile(r"^node (\S+) is (\w+)")


def kind_of(line: str) -> str:
    """The kind of one line the coordinator's loop returned (`CoordinatorState.tick`)."""
    if line.startswith("plan epoch"):
        return "drift" if "(drift:" in line else "replan"
    if " is quarantined" in line:
        return "quarantine"
    if line.startswith("node ") and (" is gone" in line or " is dead" in line):
        return "failure"
    if line.startswith("node ") and " is left" in line:
        return "leave"
    return "info"


class EventLog:
    """Thread-safe: the coordinator's loop and the snapshot builder both add to it."""

    def __init__(self, clock=time.time) -> None:
        self._lock = threading.Lock()
        self._events: deque[dict] = deque(maxlen=MAX_EVENTS)
        self._clock = clock
        self._states: dict[str, str] | None = None
        self._failures: set[tuple[int, str]] = set()
        self._complete: set[int] | None = None
        self._offenders: dict[str, int] = {}
        self._seq = 0
        self._told: dict[str, str] = {}
        """node -> the state a loop line already said it changed to."""

    def add(self, kind: str, text: str, when: float | None = None) -> None:
        with self._lock:
            self._seq += 1
            self._events.append({"seq": self._seq, "time": self._clock() if when is None else when, "kind": kind,
                                 "text": text})

    def note_tick(self, lines: Iterable[str], when: float | None = None) -> None:
        """What one round of the coordinator's loop decided, at the time it decided it. A member's change said
        here is not said again by `observe`."""
        for line in lines:
            kind = kind_of(line)
            told = _NODE_STATE.match(line)
            if told is not None:
                with self._lock:
                    self._told[told.group(1)] = told.group(2)
            self.add(kind, line, when)

    def observe(self, now: float, members: Mapping, failures: Mapping, complete: list[int], checkpoints: list,
                offenders: Mapping[str, tuple[int, str]]) -> None:
        """Compare one snapshot's reads with the last one's and log what changed. The first call only learns
        (members already there at the dashboard's start are one event, not thousands)."""
        self.observe_members(now, members)
        self.observe_progress(now, failures, complete, checkpoints, offenders)

    def observe_members(self, now: float, members: Mapping) -> None:
        """The members' part of `observe` (a reader calls it only when the membership moved)."""
        states = {n: m.state for n, m in members.items()}
        first = self._states is None
        before = self._states or {}
        self._states = states
        if first:
            counts: dict[str, int] = {}
            for s in states.values():
                counts[s] = counts.get(s, 0) + 1
            if states:
                self.add("info", "members at the dashboard's start: " + ", ".join(
                    f"{v} {k}" for k, v in sorted(counts.items())), now)
        else:
            changes: dict[str, list[str]] = {}
            with self._lock:
                told, self._told = self._told, {}
            for n, s in states.items():
                if before.get(n) != s and told.get(n) != s:
                    changes.setdefault("join" if s == "alive" else s, []).append(n)
            for kind, nodes in sorted(changes.items()):
                label = {"join": "joined", "gone": "is gone (missed its lease)", "left": "left",
                         "quarantined": "is quarantined"}.get(kind, f"is {kind}")
                event = {"join": "join", "gone": "failure", "left": "leave", "quarantined": "quarantine"}.get(
                    kind, "info")
                if len(nodes) > MAX_ANNOUNCED:
                    self.add(event, f"{len(nodes)} nodes {label.replace('is ', 'are ')}: "
                             f"{', '.join(sorted(nodes)[:5])}, ...", now)
                    continue
                for n in sorted(nodes):
                    m = members[n]
                    why = f": {m.reason}" if kind != "join" and m.reason else ""
                    where = f" ({m.profile.device_name or m.profile.device_kind}, {m.profile.region or 'no region'})" \
                        if kind == "join" else ""
                    self.add(event, f"node {n} {label}{where}{why}", now)

    def observe_progress(self, now: float, failures: Mapping, complete: list[int], checkpoints: list,
                         offenders: Mapping[str, tuple[int, str]]) -> None:
        """The rest of `observe`: failure reports, complete checkpoints, rejected tensors."""
        first = self._complete is None
        for f in failures.values():
            key = (f.epoch, f.node_id)
            if key not in self._failures:
                self._failures.add(key)
                if not first:
                    self.add("failure", f"node {f.node_id} reported its run of plan epoch {f.epoch} failed at step "
                             f"{f.step}: {f.reason}", f.reported_unix or now)
        done = set(complete)
        if self._complete is not None:
            for step in sorted(done - self._complete):
                holders = sorted({r.node_id for r in checkpoints if r.step == step})
                self.add("checkpoint", f"checkpoint step-{step:08d} complete, held by {len(holders)} node(s): "
                         f"{', '.join(holders[:12])}{', ...' if len(holders) > 12 else ''}", now)
        self._complete = done
        for n, (count, newest) in offenders.items():
            if count > self._offenders.get(n, 0) and not first:
                self.add("quarantine", f"tensors from node {n} rejected ({count} step(s) in the window): {newest}",
                         now)
        self._offenders = {n: c for n, (c, _) in offenders.items()}

    def recent(self, count: int = 200) -> list[dict]:
        with self._lock:
            return list(self._events)[-count:]
