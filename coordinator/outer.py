"""Outer-sync rounds of replica groups: who arrived, and when a round is decided.

A node *arrives* at round r once its pseudo-gradients of r are ready to fetch. A group has arrived when all
its nodes have. A round waits only for the groups that existed when it began (the plan epoch of its first
arrival): a group formed later (a region replanned after a node died) is not waited for, so its start-up
never stalls the others; it may still take part if it arrives before the decision. `round_decision` is a pure function of (now, the round's arrivals, the plan's groups,
the deadline): the round is decided once every group has arrived, or `deadline` after the first group
did; its participants are the groups that arrived by then. A decision never changes: every node applies
the same average, and a group left out (late, crashed, cut off) still fetches the participants' payloads.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

KEEP_DECIDED = 64
"""Decided rounds remembered (a group more rounds late than this takes the outer state afresh)."""


@dataclass(frozen=True, kw_only=True)
class GroupInfo:
    index: int
    name: str
    nodes: frozenset[str]
    since_epoch: int


@dataclass
class RoundArrivals:
    """What has arrived for one round: node -> (group, tokens), and when each group completed."""

    nodes: dict[str, tuple[int, int]] = field(default_factory=dict)
    completed: dict[int, float] = field(default_factory=dict)
    epoch: int = 0
    """The plan epoch when the round's first node arrived: groups formed after it are not waited for."""


@dataclass(frozen=True, kw_only=True)
class Participant:
    group: int
    tokens: int
    since_epoch: int
    nodes: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Decision:
    decided: bool
    participants: tuple[Participant, ...] = ()
    wait_seconds: float = 0.0
    reason: str = ""


def complete_groups(arrivals: RoundArrivals, groups: Sequence[GroupInfo]) -> dict[int, int]:
    """Group index -> tokens it trained, for the groups all of whose nodes arrived."""
    out = {}
    for g in groups:
        # by node identity: a node's group index may come from an older plan than the coordinator's newest
        got = [arrivals.nodes[n] for n in g.nodes if n in arrivals.nodes]
        if g.nodes and len(got) == len(g.nodes):
            out[g.index] = max(t for _, t in got)  # every node of a group reports the group's tokens
    return out


def round_decision(now: float, arrivals: RoundArrivals, groups: Sequence[GroupInfo], deadline_s: float) -> Decision:
    """Whether the round is decided at `now`, with its participants and a reason."""
    done = complete_groups(arrivals, groups)
    if not done:
        return Decision(decided=False, wait_seconds=deadline_s, reason="no group has arrived yet")
    by_index = {g.index: g for g in groups}
    first = min(arrivals.completed.get(i, now) for i in done)
    expected = [g for g in groups if not arrivals.epoch or g.since_epoch <= arrivals.epoch]
    everyone = all(g.index in done for g in expected)
    if not everyone and now < first + deadline_s:
        missing = sorted(g.name for g in expected if g.index not in done)
        return Decision(decided=False, wait_seconds=first + deadline_s - now,
                        reason=f"waiting for {', '.join(missing)} until the deadline")
    parts = tuple(Participant(group=i, tokens=t, since_epoch=by_index[i].since_epoch,
                              nodes=tuple(sorted(by_index[i].nodes))) for i, t in sorted(done.items()))
    left = sorted(g.name for g in groups if g.index not in done)
    return Decision(decided=True, participants=parts,
                    reason="every group arrived" if everyone else f"deadline passed without {', '.join(left)}")


@dataclass
class GroupProgress:
    """A group's outer progress, for `atoll status`."""

    name: str = ""
    inner_step: int = 0
    tokens: int = 0
    round: int = 0
    rounds_in: int = 0
    rounds_missed: int = 0
    sync_bytes: dict[str, int] = field(default_factory=dict)
    sync_seconds: dict[str, float] = field(default_factory=dict)
    late_seconds: dict[str, float] = field(default_factory=dict)


class OuterRounds:
    """The coordinator's record of outer rounds (in memory: a restarted coordinator decides the rounds in
    flight afresh from the nodes' repeated arrivals). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arrivals: dict[int, RoundArrivals] = {}
        self._decided: dict[int, Decision] = {}
        self.progress: dict[int, GroupProgress] = {}
        self.latest_decided = -1

    def arrive(self, now: float, *, round_: int, node: str, group: int, tokens: int, inner_step: int,
               groups: Sequence[GroupInfo], deadline_s: float, stats: Mapping[str, float] | None = None,
               epoch: int = 0) -> Decision:
        with self._lock:
            if round_ in self._decided:
                return self._decided[round_]
            if round_ <= self.latest_decided - KEEP_DECIDED:
                return Decision(decided=False, reason=f"round {round_} is too old; take the outer state afresh")
            arrivals = self._arrivals.setdefault(round_, RoundArrivals(epoch=epoch))
            if node:
                first_time = node not in arrivals.nodes
                arrivals.nodes[node] = (group, tokens)
                for g in groups:
                    if g.index not in arrivals.completed and node in g.nodes and complete_groups(arrivals, [g]):
                        arrivals.completed[g.index] = now
                if first_time:
                    p = self.progress.setdefault(group, GroupProgress())
                    p.name = next((g.name for g in groups if g.index == group), p.name)
                    if round_ >= p.round:
                        p.round, p.inner_step = round_, max(p.inner_step, inner_step)
                    if stats:
                        p.sync_bytes[node] = int(stats.get("bytes", 0))
                        p.sync_seconds[node] = float(stats.get("seconds", 0.0))
                        p.late_seconds[node] = float(stats.get("late", 0.0))
            decision = round_decision(now, arrivals, groups, deadline_s)
            if decision.decided:
                self._decided[round_] = decision
                self.latest_decided = max(self.latest_decided, round_)
                ins = {pt.group: pt.tokens for pt in decision.participants}
                for g in groups:
                    p = self.progress.setdefault(g.index, GroupProgress(name=g.name))
                    if g.index in ins:
                        p.rounds_in += 1
                        p.tokens += ins[g.index]
                    else:
                        p.rounds_missed += 1
                self._arrivals.pop(round_, None)
                for old in [r for r in self._decided if r <= round_ - KEEP_DECIDED]:
                    del self._decided[old]
            return decision

    def reset_progress(self) -> None:
        with self._lock:
            self.progress.clear()
