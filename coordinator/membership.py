"""Membership decisions as pure functions of (now, state, options), each returning a decision and its reason.

- `expire_leases`: which alive members missed their lease and are now gone.
- `join_decision`: whether a join is a new member, an update of the same node, or a conflicting claim.
- `plan_decision`: whether the coordinator should (re)plan now.
- `live_resume`: whether the next plan may resume from live state (not after plans that failed to fetch it).
- `failure_decision`: whether a failed run of the current plan (reported by a node that is still alive)
  calls for a new epoch now, backing off when consecutive epochs keep failing.

The clock is a parameter, so tests step time by hand; nothing here reads the wall clock or does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from atoll.coordinator.store import MemberRecord
from atoll.job import ClusterSpec
from atoll.plan import LIVE_FETCH_FAILED
from atoll.units import counted


@dataclass(frozen=True, kw_only=True)
class MembershipOptions:
    """Leases and how long to let membership settle before planning."""

    lease: timedelta = timedelta(seconds=10)
    """A member that sends no heartbeat for this long is marked gone."""
    restart_grace: timedelta | None = None
    """After the coordinator (re)starts, members have this long to heartbeat again before their lease counts
    from their last heartbeat; None means one lease. Keeps a restarted coordinator from expiring everyone."""
    settle: timedelta = timedelta(seconds=1)
    """After a membership change, wait this long for further changes before replanning, so a burst of
    joins or departures yields one new epoch rather than several."""
    failure_backoff: timedelta = timedelta(seconds=1)
    """A failed plan epoch is replanned at once; when the epoch before it failed too, after this long, doubled
    for each further failed epoch in a row, so a plan that keeps failing cannot replan in a tight loop."""
    failure_backoff_max: timedelta = timedelta(seconds=60)
    """The longest wait before replanning a failed epoch."""
    join_settle: timedelta = timedelta(seconds=10)
    """Joins alone (nobody gone) replan once no further node has joined for this long: a trickle of joins makes
    one new epoch, not one each. Training goes on meanwhile, so the wait costs nothing but the joiners' time."""
    join_settle_max: timedelta = timedelta(seconds=60)
    """The longest a join waits for its replan, however many nodes keep joining (ten joins within a minute, a
    few seconds apart, cause one replan)."""

    def __post_init__(self) -> None:
        if self.lease <= timedelta(0):
            raise ValueError(f"lease must be positive, got {self.lease}")
        if self.restart_grace is not None and self.restart_grace < timedelta(0):
            raise ValueError(f"restart_grace must be >= 0, got {self.restart_grace}")
        if self.settle < timedelta(0):
            raise ValueError(f"settle must be >= 0, got {self.settle}")
        if not timedelta(0) <= self.join_settle <= self.join_settle_max:
            raise ValueError(f"join_settle ({self.join_settle}) must be >= 0 and at most join_settle_max "
                             f"({self.join_settle_max})")
        if not timedelta(0) <= self.failure_backoff <= self.failure_backoff_max:
            raise ValueError(f"failure_backoff ({self.failure_backoff}) must be >= 0 and at most failure_backoff_max "
                             f"({self.failure_backoff_max})")

    @property
    def grace(self) -> timedelta:
        return self.lease if self.restart_grace is None else self.restart_grace


@dataclass(frozen=True)
class Transition:
    node_id: str
    state: Literal["gone"]
    reason: str


def lease_deadline(member: MemberRecord, started_unix: float, options: MembershipOptions) -> float:
    """Unix time at which an alive member's lease lapses."""
    return max(member.last_heartbeat_unix + options.lease.total_seconds(),
               started_unix + options.grace.total_seconds())


def expire_leases(now: float, members: Iterable[MemberRecord], started_unix: float,
                  options: MembershipOptions, stalled: float = 0.0) -> list[Transition]:
    """Alive members whose lease has lapsed at `now`, with the reason for each.

    `stalled`: the longest the coordinator itself answered late within the last lease (`LoopLag.recent`); a
    heartbeat may have waited that long in its own queue, so a lease lapses only that much later.
    The loop asks this four times a second of every member: `lease_deadline`'s rule with its constants worked
    out once, so a member costs a comparison or two (10,000 members, a few milliseconds).
    """
    lease = options.lease.total_seconds()
    if now <= started_unix + options.grace.total_seconds():
        return []  # restart grace: nobody lapses yet
    limit = lease + max(0.0, stalled)
    out = []
    for m in members:
        if now > m.last_heartbeat_unix + limit and m.state == "alive":
            silent = now - max(m.last_heartbeat_unix, started_unix)
            allowed = f"; allowing {stalled:.1f}s the coordinator ran late" if stalled >= 0.05 else ""
            out.append(Transition(m.node_id, "gone", f"no heartbeat for {silent:.1f}s (lease {lease:g}s{allowed})"))
    return out


JoinKind = Literal["new", "update", "rejoin", "conflict"]


@dataclass(frozen=True)
class JoinDecision:
    kind: JoinKind
    reason: str


def join_decision(now: float, existing: MemberRecord | None, *, hostname: str, started_unix: float,
                  options: MembershipOptions) -> JoinDecision:
    """How to treat a join that claims `existing`'s node id (None: an id not seen before).

    A node keeps its id in its state dir, so the same id from the same host is the same node coming back
    (an idempotent update, whatever its new peer address). The same id from another host is a second
    machine with a copied state dir: refused while the first holds a live lease, accepted once it lapsed.
    """
    if existing is None:
        return JoinDecision("new", "first join")
    if existing.state != "alive":
        return JoinDecision("rejoin", f"was {existing.state}")
    if existing.profile.hostname == hostname:
        return JoinDecision("update", "same node joined again")
    if now > lease_deadline(existing, started_unix, options):
        return JoinDecision("rejoin", f"lease of the node on {existing.profile.hostname!r} had lapsed")
    return JoinDecision("conflict", f"node id {existing.node_id} is held by a live node on host "
                                    f"{existing.profile.hostname!r}; remove the copied state dir of the node on "
                                    f"{hostname!r} (or give it its own --state-dir)")


def _names(ids: Set[str], shown: int = 8) -> str:
    """Node ids for a reason line: all of a few, the first `shown` and a count of many (a line, not a page)."""
    names = sorted(ids)
    if len(names) <= shown:
        return ", ".join(names)
    return f"{', '.join(names[:shown])} and {len(names) - shown} more"


@dataclass(frozen=True)
class PlanDecision:
    plan: bool
    reason: str


def plan_decision(now: float, *, alive: Set[str], planned: Set[str] | None, unprobed: Set[str],
                  last_change_unix: float, cluster: ClusterSpec, options: MembershipOptions,
                  stale: bool = False, moved: Set[str] = frozenset(), restarted: Set[str] = frozenset(),
                  first_join_unix: float | None = None, returning: Set[str] = frozenset()) -> PlanDecision:
    """Whether to publish a new plan now.

    alive: ids of alive members; planned: ids in the current plan (None: no plan yet); unprobed: alive
    members whose links to the others are not measured yet; last_change_unix: the latest join or
    departure; stale: the current plan was made by an earlier coordinator process (its rendezvous store
    is gone) and its members have all been heard from since, so it is replaced by a new epoch; moved:
    planned members that came back at another peer address than the plan names; restarted: planned members whose
    process restarted since the plan was made (their runs of it are gone); first_join_unix: when the
    earliest alive member the plan does not name joined (None: not known), for the join debounce; returning:
    alive members an earlier plan named (a node or a region restarted and came back). Joins of returning members
    that make the cluster whole again (alive reaches `cluster.expected_nodes`) replan after `settle`, not the join
    debounce: no further join is expected, and a region back from a restart should not idle for it.
    """
    if planned is None:
        if len(alive) < cluster.expected_nodes:
            return PlanDecision(False, f"waiting for nodes: {len(alive)} of {cluster.expected_nodes} joined (the job's "
                                       f"cluster.expected_nodes; start more nodes, or lower it in the job spec)")
        if unprobed:
            return PlanDecision(False, f"waiting for link probes of {_names(unprobed)}")
        return PlanDecision(True, f"{counted(len(alive), 'node')} joined and probed (expected {cluster.expected_nodes})")
    if set(alive) == set(planned):
        if stale:
            return PlanDecision(True, "the coordinator restarted and the plan's members are back: a new epoch with "
                                      "a fresh rendezvous, from the last complete checkpoint")
        if moved:
            wait = last_change_unix + options.settle.total_seconds() - now
            if wait > 0:
                return PlanDecision(False, f"members came back at new addresses; settling for {wait:.1f}s more")
            return PlanDecision(True, f"members came back at new peer addresses: {', '.join(sorted(moved))}")
        if restarted:
            wait = last_change_unix + options.settle.total_seconds() - now
            if wait > 0:
                return PlanDecision(False, f"{_names(restarted)} restarted; settling for {wait:.1f}s more")
            return PlanDecision(True, f"{_names(restarted)} restarted (their runs of the plan are gone): a new epoch, "
                                      f"from live state or the last complete checkpoint")
        return PlanDecision(False, "membership matches the current plan")
    if len(alive) < cluster.min_nodes:
        return PlanDecision(False, f"only {len(alive)} alive, fewer than cluster.min_nodes = {cluster.min_nodes}; "
                                   f"waiting for nodes")
    joined, gone = set(alive) - set(planned), set(planned) - set(alive)
    if unprobed:
        return PlanDecision(False, f"waiting for link probes of {_names(unprobed)}")
    wait = last_change_unix + options.settle.total_seconds() - now
    if wait > 0:
        return PlanDecision(False, f"membership changed; settling for {wait:.1f}s more")
    whole_again = joined <= set(returning) and len(alive) >= cluster.expected_nodes
    if joined and not gone and first_join_unix is not None and not whole_again:  # joins alone: debounced
        quiet = last_change_unix + options.join_settle.total_seconds() - now
        cap = first_join_unix + options.join_settle_max.total_seconds() - now
        if quiet > 0 and cap > 0:
            return PlanDecision(False, f"{len(joined)} node(s) joined ({', '.join(joined)}); replanning once none has "
                                       f"joined for {options.join_settle.total_seconds():g}s, in "
                                       f"{min(quiet, cap):.1f}s at most")
    parts = ([f"joined: {_names(joined)}" + (" (back: the cluster is whole again)" if whole_again else "")]
             if joined else []) + ([f"gone: {_names(gone)}"] if gone else [])
    return PlanDecision(True, "; ".join(parts))


@dataclass(frozen=True, kw_only=True)
class RunFailureRecord:
    """A node's report that its run of a plan epoch failed (a transfer, a collective, the set-up)."""

    epoch: int
    node_id: str
    step: int
    reason: str
    reported_unix: float


def failure_backoff(failed_in_a_row: int, options: MembershipOptions) -> float:
    """Seconds to wait before replanning the latest of `failed_in_a_row` consecutive failed epochs:
    0 for the first, then `failure_backoff` doubled per further failure, at most `failure_backoff_max`."""
    if failed_in_a_row <= 1:
        return 0.0
    first, most = options.failure_backoff.total_seconds(), options.failure_backoff_max.total_seconds()
    return min(most, first * 2.0 ** min(failed_in_a_row - 2, 64))


LIVE_FETCH_FAILURES = 2
"""Plans in a row that failed to fetch the live state they agreed on before the next resumes from a checkpoint."""


def live_resume(epoch: int, failures: Mapping[int, RunFailureRecord]) -> bool:
    """Whether the plan after `epoch` may resume from live state: not when `epoch` and the `LIVE_FETCH_FAILURES` - 1
    plans before it each failed because a node could not fetch the live state the plan's nodes agreed to resume
    from (`atoll.plan.LIVE_FETCH_FAILED`: a holder that answers but cannot give its state, a link too slow for it).
    Made again from the same members, the next plan would agree on the same state and fail the same way; from the
    checkpoint it rolls back to the checkpoint's step, but it trains."""
    return not all(f is not None and LIVE_FETCH_FAILED in f.reason
                   for f in (failures.get(epoch - k) for k in range(LIVE_FETCH_FAILURES)))


def failure_decision(now: float, *, epoch: int, failures: Mapping[int, RunFailureRecord], alive: Set[str],
                     planned: Set[str], last_heard: Mapping[str, float], options: MembershipOptions) -> PlanDecision:
    """Whether the failure of the current plan `epoch` calls for a new epoch (same members) now.

    failures: the first failure reported for each epoch; a failure of an older epoch is no reason (a newer
    plan already replaced it). The plan's members must all be alive and all heard from (`last_heard`: unix
    time of each member's latest heartbeat) since the failure was reported: a member that went silent is
    probably gone, and its lapsing lease makes the next plan without it. When epochs before this one failed
    too, the new plan waits `failure_backoff` of how many failed in a row.
    """
    failure = failures.get(epoch)
    if failure is None:
        return PlanDecision(False, f"no failure reported for plan epoch {epoch}")
    what = f"plan epoch {epoch} failed on node {failure.node_id} at step {failure.step}: {failure.reason}"
    if set(alive) != set(planned):
        return PlanDecision(False, f"{what}; membership differs from the plan, so its change replans")
    silent = sorted(n for n in planned if last_heard.get(n, float("-inf")) < failure.reported_unix)
    if silent:
        return PlanDecision(False, f"{what}; waiting to hear from {', '.join(silent)} before replanning")
    in_a_row = 1
    while epoch - in_a_row in failures:
        in_a_row += 1
    delay = failure_backoff(in_a_row, options)
    if now < failure.reported_unix + delay:
        return PlanDecision(False, f"{what}; {in_a_row} epochs failed in a row, replanning {delay:g}s after the "
                                   f"failure")
    if in_a_row > 1:
        return PlanDecision(True, f"{what} ({in_a_row} epochs failed in a row; waited {delay:g}s)")
    return PlanDecision(True, what)
