"""Outer-sync rounds of replica groups: who arrived, and when a round is decided.

A node *arrives* at round r once its pseudo-gradients of r are ready to fetch. A group has arrived when all
its nodes have. A round waits only for the groups that existed when it began (the plan epoch of its first
arrival): a group formed later (a region replanned after a node died) is not waited for, so its start-up
never stalls the others; it may still take part if it arrives before the decision. `round_decision` is a pure function of (now, the round's arrivals, the plan's groups,
the deadline): the round is decided once every group has arrived, or `deadline` after the first group
did; its participants are the groups that arrived by then.

The coordinator's decision is the only one: every node applies exactly its set of participants, a group left
out (late, crashed, cut off) included. A node fetches each contribution from any node that holds it, within a
bound; one that stays out of its reach past the bound is reported, and the round is decided again for everyone
without it (`redecide`: a new version of the decision). Nodes apply a decision only once it is final
(`decision_final`): every node that arrived at the round and still trains in its group holds its contributions,
or `FINAL_AFTER_BOUNDS` fetch bounds passed since it was made (a node that is no longer an alive member is waited
for by no one).

The bound is for a link that may come back; a contribution whose holder the coordinator knows is dead will not. With
every question the coordinator checks the round's open decision (`lost_contributions`): a participant one of whose
nodes is no longer an alive member (failed, lease lapsed, left), or whose group the newest plan has no more
(replanned away: its nodes serve nothing again), and that no relay holds (every node of another live group fetched
it), is left out at once in a new version of the decision, as if reported out of reach. Nodes keep asking while
they fetch, so they learn the new version on their next question and give up that fetch. Nodes decide nothing on
their own (no early out-of-reach on a refused connection): the coordinator's decision stays the only one, every
node applies the same final set, and a final decision never changes. Arrivals and decisions are written to the store as
they happen, so a
restarted coordinator resumes the rounds in flight (nodes repeat their arrival with every question, too).

Each node reports a crc32 of its anchor per layer once a round landed (`anchor_mismatch`): the same layer's
hashes must agree on every node of every group, and a mismatch is logged and counted in the status.

Rounds by wall-clock time (`atoll.coordinator.pace`, which says why): each node reports with its arrival the median
wall time of the round's inner steps, outer waits left out; the decision of round r fixes each group's inner steps
for round r + `LEAD_ROUNDS` from those live figures (`Decision.inner_steps`), kept with the decision in the store, so
a restarted coordinator answers the same, and every node of a group switches at the same round boundary.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from atoll.coordinator.pace import (LEAD_ROUNDS, GroupPace, GroupSteps, PaceOptions, PaceState, RoundPace,
                                    outer_deadline, step_time)
from atoll.coordinator.pace import round_steps as decide_steps

log = logging.getLogger("atoll.coordinator.outer")

KEEP_DECIDED = 64
"""Decided rounds remembered (a group more rounds late than this takes the outer state afresh)."""
FINAL_AFTER_BOUNDS = 2.0
"""A decision is final at the latest this many fetch bounds (`OuterPlan.fetch_bound_s`) after it was made: a node
fetches each contribution for at most one bound before it reports it out of reach, so a node silent for two (dead,
or cut off from the coordinator) holds up nobody; it takes the final decision's contributions from any node holding
them later."""


@dataclass(frozen=True, kw_only=True)
class GroupInfo:
    index: int
    name: str
    nodes: frozenset[str]
    since_epoch: int
    inner_steps: int = 0
    """Inner steps a round the plan gives it (0: H, `OuterRounds.arrive`'s `h`)."""


@dataclass
class RoundArrivals:
    """What has arrived for one round: node -> (group, tokens), and when each group completed."""

    nodes: dict[str, tuple[int, int]] = field(default_factory=dict)
    completed: dict[int, float] = field(default_factory=dict)
    epoch: int = 0
    """The plan epoch when the round's first node arrived: groups formed after it are not waited for."""
    norms: dict[str, float] = field(default_factory=dict)
    """node -> the L2 norm of the contribution it serves for its group (inf: not finite); heard with every
    question, so a restarted coordinator hears them again."""


@dataclass(frozen=True, kw_only=True)
class Participant:
    group: int
    tokens: int
    since_epoch: int
    nodes: tuple[str, ...]


def same_group(a: Participant, b: Participant) -> bool:
    """Whether two participants are one replica group (the same since-epoch and nodes; indices may differ)."""
    return a.since_epoch == b.since_epoch and set(a.nodes) == set(b.nodes)


@dataclass(frozen=True, kw_only=True)
class Decision:
    decided: bool
    participants: tuple[Participant, ...] = ()
    wait_seconds: float = 0.0
    reason: str = ""
    version: int = 0
    """1 for the first decision of a round, one more for each re-decision (`redecide`)."""
    decided_unix: float = 0.0
    checkpointer: Participant | None = None
    """The group that writes the job's checkpoints: the first group of the plan the round was decided under."""
    final: bool = False
    """Every node that must apply it holds its contributions (`decision_final`): nodes apply it now."""
    inner_steps: tuple[GroupSteps, ...] = ()
    """Each group's inner steps in round `steps_round` (`atoll.coordinator.pace`; empty: the plan's)."""
    steps_round: int = 0
    target_s: float = 0.0
    """The round's target wall time the steps were decided for (0: no live figure yet)."""
    round_s: float = 0.0
    """The longest group's round under those steps at its live pace."""


def decision_to_json(d: Decision) -> str:
    def part(p: Participant | None) -> dict | None:
        return None if p is None else {"group": p.group, "tokens": p.tokens, "since_epoch": p.since_epoch,
                                       "nodes": list(p.nodes)}
    return json.dumps({"participants": [part(p) for p in d.participants], "reason": d.reason, "version": d.version,
                       "decided_unix": d.decided_unix, "checkpointer": part(d.checkpointer), "final": d.final,
                       "inner_steps": [{"name": g.name, "since_epoch": g.since_epoch, "steps": g.steps,
                                        "step_s": g.step_s} for g in d.inner_steps],
                       "steps_round": d.steps_round, "target_s": d.target_s, "round_s": d.round_s},
                      sort_keys=True)


def decision_from_json(text: str) -> Decision:
    d = json.loads(text)

    def part(x: dict | None) -> Participant | None:
        return None if x is None else Participant(group=int(x["group"]), tokens=int(x["tokens"]),
                                                  since_epoch=int(x["since_epoch"]), nodes=tuple(x["nodes"]))
    return Decision(decided=True, participants=tuple(part(x) for x in d["participants"]), reason=d["reason"],
                    version=int(d["version"]), decided_unix=float(d["decided_unix"]),
                    checkpointer=part(d.get("checkpointer")), final=bool(d.get("final", False)),
                    inner_steps=tuple(GroupSteps(name=g["name"], since_epoch=int(g["since_epoch"]), steps=int(g["steps"]),
                                                 step_s=float(g.get("step_s", 0.0))) for g in d.get("inner_steps", [])),
                    steps_round=int(d.get("steps_round", 0)), target_s=float(d.get("target_s", 0.0)),
                    round_s=float(d.get("round_s", 0.0)))


def complete_groups(arrivals: RoundArrivals, groups: Sequence[GroupInfo]) -> dict[int, int]:
    """Group index -> tokens it trained, for the groups all of whose nodes arrived."""
    out = {}
    for g in groups:
        # by node identity: a node's group index may come from an older plan than the coordinator's newest
        got = [arrivals.nodes[n] for n in g.nodes if n in arrivals.nodes]
        if g.nodes and len(got) == len(g.nodes):
            out[g.index] = max(t for _, t in got)  # every node of a group reports the group's tokens
    return out


def writer_of(parts: Sequence[Participant], groups: Sequence[GroupInfo],
              before: Sequence[Participant] = ()) -> Participant | None:
    """The checkpoint-writing group a decision names: the newest plan's first group that takes part in the round (it
    arrived, so it is alive), else the plan's first. A killed writer is replaced from the first round decided
    without it, not only once its lease lapses and a replan names another (its interval's checkpoints were lost).
    The decision of round r + 1 names the writer of round r's checkpoint (`node/runner.py`): with `before` (round
    r's participants), a group that took part in both comes first, as only a group that ran through round r's end
    holds that checkpoint (one that rejoined since starts afresh)."""
    taking = {p.group for p in parts}
    held = {p.group for p in parts if any(same_group(p, q) for q in before)}
    g = next((g for g in groups if g.index in held), None) or \
        next((g for g in groups if g.index in taking), groups[0] if groups else None)
    return None if g is None else Participant(group=g.index, tokens=0, since_epoch=g.since_epoch,
                                              nodes=tuple(sorted(g.nodes)))


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
    return Decision(decided=True, participants=parts, version=1, decided_unix=now, checkpointer=writer_of(parts, groups),
                    reason="every group arrived" if everyone else f"deadline passed without {', '.join(left)}")


MAX_HOLD_S = 1.0
"""The longest the coordinator holds a node's outer-sync question (`OuterRounds.hold`)."""
HOLD_RECHECK_S = 0.25
"""A held question is asked again at least this often (a round's deadline may pass meanwhile)."""
MAX_HOLDERS = 16
"""Questions held at once, at most: each holds one of the server's threads (64 by default)."""

OUTLIER_FACTOR = 10.0
"""A group whose pseudo-gradient norm is more than this many times the median of the other groups' is left out of
the round. Honest groups of one round train the same model from the same anchor: their norms differ by what they
trained (a group of fewer inner steps has a smaller one, never a larger one by much: a few times at most), while a
poisoned or broken one is off by orders of magnitude. Only the high side is judged (a small contribution cannot
pull the average far), and only against a positive median; with every group but one poisoned, the honest one looks
small and nothing is left out (a majority of bad groups is not what this defends against)."""


def group_norms(arrivals: RoundArrivals, groups: Sequence[GroupInfo], indices: Iterable[int]) -> dict[int, float]:
    """Group index -> the norm of its whole contribution (its nodes serve disjoint parameters: the root of the sum of
    their squares), for the groups of `indices` every node of which reported one."""
    out = {}
    for g in groups:
        if g.index in indices and g.nodes and all(n in arrivals.norms for n in g.nodes):
            out[g.index] = sum(arrivals.norms[n] ** 2 for n in g.nodes) ** 0.5
    return out


def outliers(norms: Mapping[int, float], factor: float = OUTLIER_FACTOR,
             tokens: Mapping[int, int] | None = None) -> dict[int, str]:
    """Group index -> why its contribution is left out: its norm is not finite, or above `factor` times the median of
    the other groups' finite norms. With `tokens` (group -> the tokens its contribution trained), norms are compared
    per token: on uneven regions a group that trains 10 inner steps a round moves its parameters about 10 times as
    far as one that trains 1, honestly (compared whole, the fast region would be left out of every round)."""
    def scale(i: int) -> float:
        return 1.0 / tokens[i] if tokens is not None and tokens.get(i, 0) > 0 else 1.0

    out = {}
    for i, norm in norms.items():
        if norm != norm or norm == float("inf"):
            out[i] = "its pseudo-gradient is not finite"
            continue
        others = sorted(v * scale(j) for j, v in norms.items() if j != i and v == v and v != float("inf"))
        if not others:
            continue
        mid, mine = statistics.median(others), norm * scale(i)
        if mid > 0 and mine > factor * mid:
            per = " a token" if tokens is not None and tokens.get(i, 0) > 0 else ""
            out[i] = (f"its pseudo-gradient norm {norm:.4g}" + (f" over {tokens[i]:,} tokens" if per else "")
                      + f" is {mine / mid:.0f}x the median{per} {mid:.4g} of the others'")
    return out


def exclude_outliers(decision: Decision, arrivals: RoundArrivals, groups: Sequence[GroupInfo]) -> tuple[Decision, str]:
    """`decision` without the participants whose contribution is an outlier (`outliers`, per token trained), and a
    line naming them ("" when none is)."""
    tokens = {p.group: p.tokens for p in decision.participants}
    bad = outliers(group_norms(arrivals, groups, set(tokens)), tokens=tokens)
    if not bad:
        return decision, ""
    names = {g.index: g.name for g in groups}
    line = "; ".join(f"{names.get(i, i)} ({', '.join(sorted(next(g.nodes for g in groups if g.index == i)))}): {why}"
                     for i, why in sorted(bad.items()))
    parts = tuple(p for p in decision.participants if p.group not in bad)
    return replace(decision, participants=parts, checkpointer=writer_of(parts, groups), reason=f"{decision.reason}; left out as outliers: {line}"), line


def redecide(now: float, decision: Decision, out_of_reach: Participant, node: str) -> Decision | None:
    """The round decided again without `out_of_reach`, whose contribution `node` could not fetch within its bound;
    None when the decision does not have it (an earlier re-decision left it out already)."""
    parts = tuple(p for p in decision.participants if not same_group(p, out_of_reach))
    if len(parts) == len(decision.participants):
        return None
    gone = f"group {out_of_reach.group} ({', '.join(out_of_reach.nodes)})"
    writer = decision.checkpointer
    if writer is not None and same_group(writer, out_of_reach) and parts:  # not the group left out
        writer = replace(parts[0], tokens=0)
    return replace(decision, participants=parts, version=decision.version + 1, decided_unix=now, final=False,
                   checkpointer=writer,
                   reason=f"decided again without {gone}: its contribution stayed out of reach of node {node}")


def lost_contributions(decision: Decision, groups: Sequence[GroupInfo], alive: Callable[[str], bool],
                       fetched: Mapping[str, int]) -> dict[int, str]:
    """Participant position in `decision` -> why its contribution is gone for good: one of its nodes is no longer an
    alive member (its payloads died with it), or its group is in the newest plan (`groups`) no more (replanned away:
    its nodes serve nothing again). A contribution is kept while a relay holds it: every node of another group of the
    newest plan is alive and holds a version of the round's decision (`fetched`: node -> the newest version it holds
    whole; every version holds the participants of the later ones), so together they serve all of it on."""
    def relayed(p: Participant) -> bool:
        return any(g.nodes and g.nodes.isdisjoint(p.nodes) and all(alive(n) and fetched.get(n, 0) > 0 for n in g.nodes)
                   for g in groups)

    out = {}
    for i, p in enumerate(decision.participants):
        dead = sorted(n for n in p.nodes if not alive(n))
        planned = any(g.since_epoch == p.since_epoch and g.nodes == frozenset(p.nodes) for g in groups)
        if (dead or not planned) and not relayed(p):
            out[i] = (f"node(s) {', '.join(dead)} of it are no longer members" if dead
                      else "its group was planned afresh") + " and no live group holds its contribution"
    return out


def decision_final(now: float, decision: Decision, arrived: Iterable[str], fetched: Mapping[str, int],
                   bound_s: float) -> tuple[bool, str]:
    """Whether every node that arrived at the round holds the contributions of `decision` (`fetched`: node -> the
    newest version it holds whole), or `bound_s` passed since it was made; with the reason."""
    waiting = sorted(n for n in arrived if fetched.get(n, 0) != decision.version)
    if not waiting:
        return True, "every node that arrived holds its contributions"
    if now >= decision.decided_unix + bound_s:
        return True, (f"{len(waiting)} node(s) did not say they hold its contributions within {bound_s:.0f}s "
                      f"({', '.join(waiting[:4])}); they take them from any node that does")
    return False, f"waiting for {', '.join(waiting[:4])}{' ...' if len(waiting) > 4 else ''} to fetch its contributions"


def anchor_mismatch(round_: int, layer: int, crcs: Mapping[str, int], groups: Mapping[str, str]) -> str | None:
    """A line naming the nodes (and their groups) whose anchor of `layer` after `round_` differs, or None when every
    node reported the same crc32."""
    by_crc: dict[int, list[str]] = {}
    for node, crc in sorted(crcs.items()):
        by_crc.setdefault(crc, []).append(node)
    if len(by_crc) < 2:
        return None
    parts = "; ".join(f"{crc:08x} on " + ", ".join(f"{n} ({groups.get(n, '?')})" for n in nodes)
                      for crc, nodes in sorted(by_crc.items(), key=lambda kv: -len(kv[1])))
    return f"outer round {round_}, layer {layer}: the anchors differ: {parts}"


@dataclass
class GroupProgress:
    """A group's outer progress, for `atoll status`; kept by the group's name (its region), which a replan keeps
    while it may list the groups in another order."""

    name: str = ""
    inner_step: int = 0
    tokens: int = 0
    round: int = 0
    rounds_in: int = 0
    rounds_missed: int = 0
    sync_bytes: dict[str, int] = field(default_factory=dict)
    sync_seconds: dict[str, float] = field(default_factory=dict)
    late_seconds: dict[str, float] = field(default_factory=dict)
    round_tokens: dict[int, int] = field(default_factory=dict)
    """Round -> tokens the group trained in it, for its `KEEP_DECIDED` newest rounds."""
    round_waits: dict[int, float] = field(default_factory=dict)
    """Round -> the longest any of its nodes waited on the exchange before it (reported with its arrival there),
    for its `KEEP_DECIDED` newest rounds."""
    step_s: float = 0.0
    """Its live inner step time as the newest decision took it (0: not measured yet)."""
    assigned_steps: int = 0
    """Inner steps a round the newest decision gives it (0: none decided yet, the plan's)."""
    sync_bytes_total: int = 0
    """Wide-area bytes of every exchange its nodes reported (sent and received, summed over its nodes)."""
    wait_total_s: float = 0.0
    """Seconds it waited on exchanges over the job: each round's longest wait of its nodes, summed."""
    counted: dict[str, int] = field(default_factory=dict)
    """Node -> the newest round whose exchange stats are in the totals (a node repeats its arrival every poll)."""

    def to_json(self) -> str:
        """Its counters, as the store keeps them (a restarted coordinator's status goes on from them)."""
        return json.dumps({
            "name": self.name, "inner_step": self.inner_step, "tokens": self.tokens, "round": self.round,
            "rounds_in": self.rounds_in, "rounds_missed": self.rounds_missed,
            "round_tokens": self.round_tokens, "round_waits": self.round_waits, "step_s": self.step_s,
            "assigned_steps": self.assigned_steps, "sync_bytes_total": self.sync_bytes_total,
            "wait_total_s": self.wait_total_s, "counted": self.counted}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GroupProgress:
        d = json.loads(text)
        return cls(name=str(d["name"]), inner_step=int(d["inner_step"]), tokens=int(d["tokens"]),
                   round=int(d["round"]), rounds_in=int(d["rounds_in"]), rounds_missed=int(d["rounds_missed"]),
                   round_tokens={int(k): int(v) for k, v in d["round_tokens"].items()},
                   round_waits={int(k): float(v) for k, v in d["round_waits"].items()},
                   step_s=float(d["step_s"]), assigned_steps=int(d["assigned_steps"]),
                   sync_bytes_total=int(d["sync_bytes_total"]), wait_total_s=float(d["wait_total_s"]),
                   counted={str(k): int(v) for k, v in d["counted"].items()})

    def steps_per_round(self, tokens_per_step: int) -> float:
        """Inner steps it trained per round, over its newest rounds (a group trains `tokens_per_step` a step)."""
        got = list(self.round_tokens.values())  # (a copy: arrivals change it while the status reads it)
        return sum(got) / len(got) / tokens_per_step if got and tokens_per_step > 0 else 0.0

    def wait_per_round(self) -> float:
        """Seconds its slowest node waited on an exchange per round, over its newest rounds."""
        got = list(self.round_waits.values())
        return sum(got) / len(got) if got else 0.0

    def add_round(self, round_: int, node: str, tokens: int, stats: Mapping[str, float] | None) -> None:
        """A node of the group arrived at `round_`, having trained `tokens` in it, with its previous exchange's stats."""
        self.round_tokens[round_] = max(self.round_tokens.get(round_, 0), tokens)
        if stats:
            self.sync_bytes[node] = int(stats.get("bytes", 0))
            self.sync_seconds[node] = float(stats.get("seconds", 0.0))
            self.late_seconds[node] = float(stats.get("late", 0.0))
            if round_ > self.counted.get(node, -1):  # (its stats of this round, once)
                self.counted[node] = round_
                self.sync_bytes_total += self.sync_bytes[node]
            if round_ > 0:  # (the first round follows no exchange)
                was = self.round_waits.get(round_, 0.0)
                self.round_waits[round_] = max(was, self.late_seconds[node])
                if round_ >= min(self.round_waits):  # (a round already forgotten is not counted again)
                    self.wait_total_s += self.round_waits[round_] - was
        for kept in (self.round_tokens, self.round_waits):
            for old in sorted(kept)[:-KEEP_DECIDED]:
                del kept[old]


class OuterRounds:
    """The coordinator's record of outer rounds: arrivals, decisions (with their re-decisions and finality) and the
    nodes' anchor hashes. With a store, arrivals and decisions are written as they happen and read back at start,
    so a restarted coordinator resumes the rounds in flight. Thread-safe."""

    def __init__(self, store=None, now: float = 0.0) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._generation = 0
        """Bumped by every arrival, report or re-decision: what a held question (`hold`) waits on."""
        self._holders = 0
        self._store = store
        """An `atoll.coordinator.store.Store` (None: in memory only)."""
        self._arrivals: dict[int, RoundArrivals] = {}
        self._fetched: dict[int, dict[str, int]] = {}
        """round -> node -> the newest decision version the node holds every contribution of."""
        self._decided: dict[int, Decision] = {}
        self.progress: dict[str, GroupProgress] = {}
        """Group name -> its progress (`GroupProgress`)."""
        self.latest_decided = -1
        self._hashes: dict[tuple[int, int], dict[str, int]] = {}
        self._hash_groups: dict[str, str] = {}
        self.anchor_mismatches = 0
        """(round, layer)s whose anchors differed between nodes."""
        self.last_mismatch = ""
        self.exclusions = 0
        """Group contributions left out of a round as outliers (`exclude_outliers`)."""
        self.last_exclusion = ""
        self.pace_options = PaceOptions()
        self._paces: dict[tuple[str, int], dict[int, RoundPace]] = {}
        """(group name, since-epoch) -> round -> its slowest node's median inner step in the round."""
        self._pace_nodes: dict[tuple[str, int], frozenset[str]] = {}
        self._steps: dict[tuple[str, int], int] = {}
        """(group name, since-epoch) -> the inner steps a round the newest decision gave it."""
        self.round_s = 0.0
        """The newest decision's longest round at the groups' live pace (0: none measured yet)."""
        self.target_s = 0.0
        """The newest decision's target round time (H x the fastest group's live step)."""
        if store is not None:
            self._load(now)

    def recent_decisions(self, count: int) -> dict[int, Decision]:
        """The newest `count` rounds' decisions, by round (for the dashboard)."""
        with self._lock:
            return {r: self._decided[r] for r in sorted(self._decided)[-count:]}

    def _load(self, now: float) -> None:
        arrivals, decisions = self._store.outer_rounds()
        for r, text in sorted(decisions.items()):
            d = decision_from_json(text)
            if not d.final:  # its bound counts from now: the nodes' confirmations are heard again from now
                d = replace(d, decided_unix=max(d.decided_unix, now))
            self._decided[r] = d
            self.latest_decided = max(self.latest_decided, r)
            self._take_steps(d)  # the newest decision's steps are the ones the hysteresis starts from
        for name, text in self._store.outer_groups().items():
            try:
                self.progress[name] = GroupProgress.from_json(text)
            except (ValueError, KeyError, TypeError, AttributeError) as e:  # counters only: the rounds go on
                log.warning("outer group %s: its stored counters are unreadable (%s); they start again", name, e)
        for a in arrivals:
            if a.round in self._decided and self._decided[a.round].final:
                continue
            rec = self._arrivals.setdefault(a.round, RoundArrivals(epoch=a.epoch))
            rec.nodes[a.node_id] = (a.group, a.tokens)
        if decisions or arrivals:
            pending = sorted(set(self._arrivals) | {r for r, d in self._decided.items() if not d.final})
            log.info("outer rounds resumed from the store: newest decided %d; in flight: %s", self.latest_decided,
                     ", ".join(map(str, pending)) or "none")

    def _take_steps(self, d: Decision) -> None:
        if d.inner_steps:
            self._steps = {(g.name, g.since_epoch): g.steps for g in d.inner_steps}
            self.round_s, self.target_s = d.round_s, d.target_s

    def _note_pace(self, group: GroupInfo, round_: int, seconds: float, steps: int, now: float) -> None:
        """A node's median inner step in `round_` (its group's figure is its slowest node's)."""
        kept = self._paces.setdefault((group.name, group.since_epoch), {})
        self._pace_nodes[(group.name, group.since_epoch)] = group.nodes
        was = kept.get(round_)
        kept[round_] = RoundPace(round=round_, seconds=max(seconds, was.seconds if was else 0.0),
                                 steps=max(steps, was.steps if was else 0), unix=now)
        for old in sorted(kept)[:-self.pace_options.window_rounds]:
            del kept[old]

    def _decide_steps(self, now: float, round_: int, decision: Decision, groups: Sequence[GroupInfo],
                      h: int) -> Decision:
        """`decision` with each group's inner steps for round `round_` + `LEAD_ROUNDS` (`pace.round_steps`)."""
        live = {(g.name, g.since_epoch) for g in groups}
        for key in [k for k in self._paces if k not in live]:  # a group replanned away: measured afresh
            del self._paces[key]
            self._pace_nodes.pop(key, None)
        state = PaceState(h=h, groups=tuple(GroupPace(
            name=g.name, since_epoch=g.since_epoch,
            steps=self._steps.get((g.name, g.since_epoch)) or g.inner_steps or h,
            paces=tuple(sorted(self._paces.get((g.name, g.since_epoch), {}).values(), key=lambda p: p.round)))
            for g in groups))
        pace = decide_steps(now, state, self.pace_options)
        if pace.changed:
            log.info("outer round %d: inner steps of round %d: %s", round_, round_ + LEAD_ROUNDS, pace.reason)
        for g in pace.groups:
            p = self.progress.setdefault(g.name, GroupProgress(name=g.name))
            p.step_s, p.assigned_steps = g.step_s, g.steps
        return replace(decision, inner_steps=pace.groups, steps_round=round_ + LEAD_ROUNDS, target_s=pace.target_s,
                       round_s=pace.round_s)

    def live_step_times(self, now: float) -> dict[frozenset[str], float]:
        """The nodes of each replica group measured so far -> its live inner step time (`pace.step_time`), for the
        next plan's split of the rounds (`planning.live_split`)."""
        with self._lock:
            out = {}
            for key, paces in self._paces.items():
                s = step_time(now, list(paces.values()), self.pace_options)
                if s is not None and key in self._pace_nodes:
                    out[self._pace_nodes[key]] = s
            return out

    def _keep(self, round_: int, decision: Decision) -> None:
        self._decided[round_] = decision
        self.latest_decided = max(self.latest_decided, round_)
        if self._store is not None:
            self._store.put_outer_decision(round_, decision_to_json(decision))

    def hold(self, ask: Callable[[], Decision], first: Decision, seconds: float, known: int = 0
             ) -> tuple[Decision, bool]:
        """A long poll: `ask()` again (a question, registering nothing) whenever an arrival or report comes, and at
        least every `HOLD_RECHECK_S` (a deadline may pass), until its answer (decided, version, final) differs from
        `first` or `seconds` pass; (the newest answer, whether it held). Only an answer the asking node has already
        (undecided, or decision version `known` not final yet) is held: a newer one goes back at once. Holds at most
        `MAX_HOLDERS` questions at once (each holds a server thread); past that it answers at once."""
        if seconds <= 0 or first.final or (first.decided and first.version != known):
            return first, False
        with self._lock:
            if self._holders >= MAX_HOLDERS:
                return first, False
            self._holders += 1
            generation = self._generation
        try:
            key = (first.decided, first.version, first.final)
            end = time.monotonic() + min(seconds, MAX_HOLD_S)
            d = first
            while (left := end - time.monotonic()) > 0:
                with self._lock:
                    if self._generation == generation:
                        self._changed.wait(min(left, HOLD_RECHECK_S))
                    generation = self._generation
                d = ask()
                if (d.decided, d.version, d.final) != key:
                    break
            return d, True
        finally:
            with self._lock:
                self._holders -= 1

    def arrive(self, now: float, *, round_: int, node: str, group: int, tokens: int, inner_step: int,
               groups: Sequence[GroupInfo], deadline_s: float, stats: Mapping[str, float] | None = None,
               epoch: int = 0, fetched_version: int = 0, unreachable: Sequence[Participant] = (),
               version: int = 0, fetch_bound_s: float | None = None, h: int = 0, step_seconds: float = 0.0,
               round_steps: int = 0, norm: float | None = None, alive: Callable[[str], bool] | None = None
               ) -> Decision:
        """A node's arrival at `round_` (or its question, `node` empty), repeated with every question: what it
        holds of the decision (`fetched_version`) and which participants of decision `version` stayed out of its
        reach. Returns the round's decision as it stands (`Decision.final`: apply it). `fetch_bound_s`: how long
        nodes try to fetch a contribution (default `deadline_s`).

        With `h` (the plan's H), rounds go by wall-clock time (`atoll.coordinator.pace`): `step_seconds` is the
        node's median inner step in the round over `round_steps` steps, the first decision of a round fixes each
        group's inner steps for a later round, and `deadline_s` is stretched to the live round
        (`pace.outer_deadline`). `norm`: the L2 norm of the contribution the node serves (None: not measured); a
        group whose contribution is an outlier is left out of the round's first decision (`exclude_outliers`).
        `alive`: whether a node is an alive member now (None: every node is); an open decision is decided again at
        once without a contribution gone with a dead node or a group replanned away (`lost_contributions`), and a
        dead node is waited for by no finality."""
        from atoll.coordinator.store import OuterArrivalRecord

        with self._lock:
            if node or unreachable:
                self._generation += 1  # (notified on leaving the lock: a held question sees the new state)
                self._changed.notify_all()
            decision = self._decided.get(round_)
            if decision is not None and decision.final:
                if unreachable:
                    log.warning("outer round %d: node %s could not fetch %s, but the round is final already; it "
                                "takes the contributions from any node holding them", round_, node,
                                ", ".join(f"group {x.group}" for x in unreachable))
                return decision
            if decision is None and round_ <= self.latest_decided - KEEP_DECIDED:
                return Decision(decided=False, reason=f"round {round_} is too old; take the outer state afresh")
            arrivals = self._arrivals.setdefault(round_, RoundArrivals(epoch=epoch))
            if h > 0:
                deadline_s = outer_deadline(deadline_s, self.round_s, self.pace_options)
            if node:
                first_time = node not in arrivals.nodes
                arrivals.nodes[node] = (group, tokens)
                if norm is not None:
                    arrivals.norms[node] = norm if norm == norm else float("inf")
                mine = next((g for g in groups if g.index == group), None)
                if h > 0 and mine is not None and step_seconds > 0 and round_steps > 0:
                    self._note_pace(mine, round_, step_seconds, round_steps, now)
                if first_time:
                    if self._store is not None:
                        self._store.add_outer_arrival(OuterArrivalRecord(
                            round=round_, node_id=node, group=group, tokens=tokens, epoch=arrivals.epoch,
                            arrived_unix=now))
                    name = next((g.name for g in groups if g.index == group), str(group))
                    p = self.progress.setdefault(name, GroupProgress(name=name))
                    if round_ >= p.round:
                        p.round, p.inner_step = round_, max(p.inner_step, inner_step)
                    p.add_round(round_, node, tokens, stats)
                if fetched_version:
                    self._fetched.setdefault(round_, {})[node] = fetched_version
            # (every complete group, not only the arriving node's: after a restart the times start afresh)
            for g in groups:
                if g.index not in arrivals.completed and complete_groups(arrivals, [g]):
                    arrivals.completed[g.index] = now
            if decision is None:
                decision = round_decision(now, arrivals, groups, deadline_s)
                if not decision.decided:
                    return decision
                decision, excluded = exclude_outliers(decision, arrivals, groups)
                if (before := self._decided.get(round_ - 1)) is not None:
                    decision = replace(decision, checkpointer=writer_of(decision.participants, groups,
                                                                        before.participants))
                if excluded:
                    self.exclusions += 1
                    self.last_exclusion = f"round {round_}: {excluded}"
                    log.warning("outer round %d: left out as outliers: %s", round_, excluded)
                if h > 0:
                    decision = self._decide_steps(now, round_, decision, groups, h)
                    self._take_steps(decision)
                self._keep(round_, decision)
                self._count(decision, groups)
                self._save_progress()
            for x in unreachable:
                again = redecide(now, decision, x, node) if version == decision.version else None
                if again is not None:
                    log.warning("outer round %d: %s (version %d)", round_, again.reason, again.version)
                    decision = again
                    self._keep(round_, decision)
                    self._missed(x, groups)
            lost = {} if alive is None else lost_contributions(decision, groups, alive, self._fetched.get(round_, {}))
            if lost:
                gone = [decision.participants[i] for i in sorted(lost)]
                why = "; ".join(f"group {p.group} ({', '.join(p.nodes)}): {lost[i]}"
                                for i, p in zip(sorted(lost), gone, strict=True))
                decision = replace(decision, participants=tuple(p for i, p in enumerate(decision.participants)
                                                                if i not in lost),
                                   version=decision.version + 1, decided_unix=now, final=False,
                                   reason=f"decided again without {why}")
                log.warning("outer round %d: %s (version %d)", round_, decision.reason, decision.version)
                self._keep(round_, decision)
                for x in gone:
                    self._missed(x, groups)
            # who must hold the decision's contributions: the nodes that arrived and still train in a group that ran
            # unchanged since the round began (a dead node, or one whose group was planned afresh, takes the outer
            # state anew rather than applying this round)
            kept = {n for g in groups if not arrivals.epoch or g.since_epoch <= arrivals.epoch for n in g.nodes
                    if alive is None or alive(n)}
            final, why = decision_final(now, decision, [n for n in arrivals.nodes if n in kept],
                                        self._fetched.get(round_, {}), FINAL_AFTER_BOUNDS * (fetch_bound_s or deadline_s))
            if not final:
                return decision
            decision = replace(decision, final=True)
            self._keep(round_, decision)
            if decision.version > 1 or not why.startswith("every"):
                log.info("outer round %d is final at version %d: %s", round_, decision.version, why)
            self._arrivals.pop(round_, None)
            self._fetched.pop(round_, None)
            for old in [r for r in self._decided if r <= round_ - KEEP_DECIDED]:
                del self._decided[old]
            for key in [k for k in self._hashes if k[0] <= round_ - KEEP_DECIDED]:
                del self._hashes[key]
            if self._store is not None:
                self._store.drop_outer_rounds(before=round_ - KEEP_DECIDED + 1)
            return decision

    def _save_progress(self) -> None:
        """Write every group's counters to the store (with each decision: a restart resumes them)."""
        if self._store is not None:
            for name, p in self.progress.items():
                self._store.put_outer_group(name, p.to_json())

    def _missed(self, x: Participant, groups: Sequence[GroupInfo]) -> None:
        """`x`, counted in with an earlier version of a round's decision, was left out of it after all."""
        # (its index may be an older plan's: the group holding its nodes now, of the same region)
        name = next((g.name for g in groups if g.nodes & set(x.nodes)), None)
        p = self.progress.get(name) if name is not None else None
        if p is not None:
            p.rounds_in, p.rounds_missed = max(0, p.rounds_in - 1), p.rounds_missed + 1
            p.tokens = max(0, p.tokens - x.tokens)
            self._save_progress()

    def _count(self, decision: Decision, groups: Sequence[GroupInfo]) -> None:
        ins = {pt.group: pt.tokens for pt in decision.participants}
        for g in groups:
            p = self.progress.setdefault(g.name, GroupProgress(name=g.name))
            if g.index in ins:
                p.rounds_in += 1
                p.tokens += ins[g.index]
            else:
                p.rounds_missed += 1

    def report_hashes(self, node: str, group: str, hashes: Iterable[tuple[int, int, int]]) -> list[str]:
        """Record a node's anchor hashes, (round, layer, crc32) each; the mismatches they reveal, as log lines (a
        (round, layer) is counted once, however many nodes then disagree)."""
        found = []
        with self._lock:
            self._hash_groups[node] = group
            for round_, layer, crc in hashes:
                if round_ <= self.latest_decided - KEEP_DECIDED:
                    continue
                crcs = self._hashes.setdefault((round_, layer), {})
                before = len(set(crcs.values()))
                crcs[node] = crc
                if before == 1 and len(set(crcs.values())) > 1:
                    line = anchor_mismatch(round_, layer, crcs, self._hash_groups)
                    if line is not None:
                        self.anchor_mismatches += 1
                        self.last_mismatch = line
                        found.append(line)
        return found

    def reset_progress(self) -> None:
        with self._lock:
            self.progress.clear()
