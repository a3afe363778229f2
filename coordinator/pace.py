"""Outer rounds by wall-clock time: how many inner steps each replica group trains a round, from its live pace.

Why this design. Outer mode syncs replica groups every round; a round is decided once every group has arrived, so
the slowest group paces all of them. The planner splits the work from the start-up profiles (`group_inner_steps`),
and when a profile is wrong (a node under a cgroup quota that profiled at full speed, a co-tenant that came later)
the fast groups wait out most of every round. Of the designs in the literature:
- asynchronous outer steps with staleness-aware weights (async DiLoCo, Decoupled DiLoCo) would drop the round
  barrier, but every node would then apply a different sequence of updates, against the one decision per round
  that every node applies (the coordinator's), the anchor hashes that check it, and the durable round state;
- streaming partial sync (Streaming DiLoCo) staggers fragments to spread the bandwidth, and already runs here as
  the overlapped exchange; it does nothing about unequal compute;
- rounds by wall-clock time keep the barrier and everything built on it: every group trains the inner steps that
  fit in the round's target time at its own measured pace, and the average weights each contribution by the tokens
  it trained (`node/outer.py` averages by `Participant.tokens`), so a group that trained fewer steps counts for
  less and no step is wasted. This is the choice.

What is decided (`round_steps`, a pure function of (now, state, options)):
- each group's inner step time, live (`estimate`): every node reports, with its arrival at a round, the median
  wall time of the round's inner steps on its clock, not counting its waits on the outer sync (landing an
  exchange); a group's figure for the round is its slowest node's, and its estimate the median of its newest
  `PaceOptions.window_rounds` rounds' figures, or of those since its pace last shifted (`shift`: a run of newest
  figures all beyond the ones before by a quarter, or the newest alone by a half: a co-tenant that came is seen
  within one or two rounds). On a node under a CPU quota one round's figure swings by 40-80% (measured on
  bench.regions' testbed: 0.106-0.20 s a step in one run of two equal regions, each group's in turn the slower), and
  a figure from the newest round alone cut each equal group to 7-8 of its 10 steps in turn, a fifth of the job's
  tokens. The estimate carries its noise (the figures' spread over the root of their count). Per round rather than
  from the step reports (`progress.step_times`):
  reports are dropped when the coordinator falls behind, a window of recent reports of a large job holds few of a
  slow group's steps, and `step_seconds` leaves out data loading and evaluation, which a round's wall time holds;
- the round's target T = H (the plan's inner steps of the fastest group) x the fastest group's live step time;
- each group's steps = the whole steps that fit in T at its pace (T / its step time, a tenth of a step of slack
  for noise), within [1, H], as the planner's `group_inner_steps` splits a round. Fit, not rounded to the nearest:
  a group whose round runs over T makes every other group wait for it, every round, and with the overlapped
  exchange the fast group then runs a round ahead with the exchange's latency exposed on it for good; a group a
  little under T instead lets the fast group keep that slack;
- hysteresis: a figure that no longer fits (over T by more than `over_tolerance` and a tenth of a step, and by
  more than `NOISE_SIGMAS` standard errors of the two estimates' ratio, the group's and the fastest's: what the
  figures cannot tell apart from equal is not cut) changes at once; one that fits but is short of the steps that
  would fit changes only when short by more than `hysteresis` of them, so noise around a boundary does not flap it;
  a group the figures cannot tell apart from the fastest trains H (equal regions are not cut by a step each in
  turn, nor left a step short for good). A single round's figure counts as `prior_noise` (5%) noisy until three
  show the group's own spread: from one round each, a group more than 21% slower than the fastest is cut (3
  standard errors of the two), one 5% slower is not.

The steps decided when round r is decided are for round r + `LEAD_ROUNDS`: with the overlapped exchange a node
applies round r's decision at the latest at the end of round r + 1, so every node of a group learns the figure
before the round it applies to starts, and all of them switch at the same inner step (their collectives
would deadlock otherwise). Nodes take the figure only from the decision, and keep the plan's where none came.

The outer deadline (how long a round waits for a late group) follows the live round too (`outer_deadline`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

LEAD_ROUNDS = 2
"""The steps decided with round r are for round r + LEAD_ROUNDS (see the module docstring)."""


@dataclass(frozen=True, kw_only=True)
class PaceOptions:
    """How the groups' inner steps per round follow their live step times."""

    hysteresis: float = 0.10
    """A group's steps that fit the round grow only when short of T / step time by more than this fraction: step
    times vary by a few percent from round to round."""
    over_tolerance: float = 0.02
    """A group's steps that run over T by at most this fraction (and a tenth of a step) are kept."""
    min_steps: int = 3
    """Steps a group's estimate covers at least (its newest rounds until they hold this many)."""
    window_rounds: int = 8
    """Newest rounds of figures kept per group: its estimate's window (`estimate`)."""
    prior_noise: float = 0.05
    """A round's figure's relative spread assumed until a group has three figures (then measured). At 10% a group 1.5x
    slower went uncut by its first round's figures on a loaded machine (a tolerance of 42%)."""
    max_age_s: float = 600.0
    """A figure older than this counts no more (a group stalled that long is measured afresh)."""
    deadline_rounds: float = 2.0
    """The outer deadline is at least this many live rounds (`outer_deadline`)."""

    def __post_init__(self) -> None:
        if not 0 <= self.hysteresis < 1 or not 0 <= self.over_tolerance < 1 or not 0 <= self.prior_noise < 1:
            raise ValueError(f"hysteresis, over_tolerance and prior_noise must be in [0, 1), got {self.hysteresis}, "
                             f"{self.over_tolerance} and {self.prior_noise}")
        if self.min_steps < 1 or self.window_rounds < 1:
            raise ValueError(f"min_steps and window_rounds must be >= 1, got {self.min_steps} and "
                             f"{self.window_rounds}")
        if self.max_age_s <= 0 or self.deadline_rounds <= 0:
            raise ValueError(f"max_age_s and deadline_rounds must be positive, got {self.max_age_s} and "
                             f"{self.deadline_rounds}")


@dataclass(frozen=True, kw_only=True)
class RoundPace:
    """One group's pace in one round: its slowest node's median inner step, over `steps` steps."""

    round: int
    seconds: float
    steps: int
    unix: float
    """When it was reported (the group's arrival at the round)."""


@dataclass(frozen=True, kw_only=True)
class GroupPace:
    """What the decision knows of one replica group."""

    name: str
    since_epoch: int
    steps: int
    """Inner steps a round it trains now: the newest figure decided for it, else the plan's."""
    paces: tuple[RoundPace, ...] = ()
    """Its newest rounds' figures, oldest first."""


@dataclass(frozen=True, kw_only=True)
class PaceState:
    h: int
    """The plan's H: inner steps per round of the fastest group."""
    groups: tuple[GroupPace, ...]


@dataclass(frozen=True, kw_only=True)
class GroupSteps:
    """Inner steps a round of one replica group (named by its name and the epoch it has run since)."""

    name: str
    since_epoch: int
    steps: int
    step_s: float = 0.0
    """The live step time it was decided from (0: none measured; the group kept its steps)."""


@dataclass(frozen=True, kw_only=True)
class PaceDecision:
    groups: tuple[GroupSteps, ...]
    target_s: float
    """T: the round's target wall time (0: no live figure yet)."""
    round_s: float
    """The longest of the groups' rounds under these steps at their live pace (0: no live figure)."""
    reason: str
    decided_unix: float = 0.0
    changed: tuple[str, ...] = field(default=())
    """The groups whose steps changed."""

    def steps_of(self, name: str, since_epoch: int) -> int | None:
        return next((g.steps for g in self.groups if g.name == name and g.since_epoch == since_epoch), None)


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """A group's live inner step time and how well it is known."""

    seconds: float
    noise: float = 0.0
    """The relative standard error of `seconds`: the spread of the per-round figures it was taken from (their
    standard deviation over their mean) over the square root of their count."""
    rounds: int = 1


def estimate(now: float, paces: Sequence[RoundPace], options: PaceOptions) -> Estimate | None:
    """A group's live inner step time (see the module docstring): the median of its newest rounds' figures since its
    pace last shifted (`shift`), over `window_rounds` rounds at most, those older than `max_age_s` left out; None
    without a figure. Its noise: the figures' relative spread (the window's, where the shift left fewer than three;
    `PaceOptions.prior_noise` from fewer than three) over the square root of how many it took."""
    fresh = sorted((p for p in paces if p.seconds > 0 and p.steps > 0 and now - p.unix <= options.max_age_s),
                   key=lambda p: p.round, reverse=True)[:options.window_rounds]
    if not fresh:
        return None
    used = fresh
    since = shift([p.seconds for p in fresh])
    if since:
        used, covered = [], 0
        for p in fresh:
            used.append(p)
            covered += p.steps
            if len(used) >= since and covered >= options.min_steps:
                break
    figures = [p.seconds for p in used]
    spread = figures if len(figures) >= 3 else [p.seconds for p in fresh]
    noise = options.prior_noise  # (a figure's spread, until three of them show it)
    if len(spread) >= 3:
        noise = statistics.stdev(spread) / statistics.fmean(spread)
    noise /= math.sqrt(len(figures))
    return Estimate(seconds=statistics.median(figures), noise=noise, rounds=len(figures))


def shift(newest_first: Sequence[float]) -> int:
    """How many of the newest per-round figures came since the group's pace shifted (a co-tenant came or left); 0:
    no shift in the window. The longest run of newest figures that all lie beyond every one of the (up to
    `SHIFT_REFERENCE`, at least 2) figures before them on one side, their median beyond those figures' by more than
    `SHIFT` (`JUMP` for the newest figure alone). A run is kept, not only the newest rounds: a group three rounds
    into a new pace is measured from those three while older rounds still fill most of its window. With noise
    alone, two figures beyond the four before them happen in 2 of 15 windows, and rarely by a quarter."""
    x = list(newest_first)
    for k in range(len(x) - 2, 0, -1):
        new, ref = x[:k], x[k:k + SHIFT_REFERENCE]
        ratio = statistics.median(new) / statistics.median(ref)
        bound = JUMP if k == 1 else SHIFT
        if (min(new) > max(ref) and ratio > 1 + bound) or (max(new) < min(ref) and ratio * (1 + bound) < 1):
            return k
    return 0


def step_time(now: float, paces: Sequence[RoundPace], options: PaceOptions) -> float | None:
    """A group's live inner step time (`estimate`'s seconds); None without a figure."""
    e = estimate(now, paces, options)
    return None if e is None else e.seconds


SHIFT = 0.25
"""A run of two or more newest figures is a shift of pace when beyond the figures before it by more than this."""

JUMP = 0.5
"""The newest figure alone is a shift of pace when beyond the figures before it by more than this (one round's
noise on a CPU quota, the worst measured, is 1.4x between consecutive rounds)."""

SHIFT_REFERENCE = 4
"""Figures before a run that it is compared with (`shift`)."""

NOISE_SIGMAS = 3.0
"""A group's steps are cut only when its round runs over T by more than this many standard errors of the
difference of the two step-time estimates (the group's and the fastest group's), and `over_tolerance`."""

SLACK_STEPS = 0.1
"""A group's steps fit the round when they run over it by at most this share of one step (noise)."""


def fitting_steps(current: int, ideal: float, h: int, options: PaceOptions, noise: float = 0.0) -> int:
    """A group's inner steps for a round of `ideal` of its steps (T / its step time), from its `current` ones (see
    the module docstring): the whole steps that fit, within [1, h], with hysteresis. `noise`: the relative standard
    error of `ideal`; what it cannot tell apart from a round of H steps gets H, and steps over `ideal` by less than
    `NOISE_SIGMAS` of it are kept."""
    tolerance = max(options.over_tolerance, NOISE_SIGMAS * noise)
    if ideal * (1 + tolerance) >= h:
        return h  # as fast as the fastest, as far as the figures can tell
    fit = min(h, max(1, math.floor(ideal + SLACK_STEPS)))
    if current > ideal * (1 + tolerance) + SLACK_STEPS:
        return fit  # over the round: it would pace every other group
    if current < fit and ideal - current > options.hysteresis * ideal:
        return fit
    return min(h, max(1, current))


def round_steps(now: float, state: PaceState, options: PaceOptions) -> PaceDecision:
    """Each group's inner steps a round from its live step time (see the module docstring), with the reason."""
    h = max(1, state.h)
    est = {i: e for i, g in enumerate(state.groups) if (e := estimate(now, g.paces, options)) is not None}
    live = {i: e.seconds for i, e in est.items()}
    if not live:
        return PaceDecision(groups=tuple(GroupSteps(name=g.name, since_epoch=g.since_epoch, steps=g.steps)
                                         for g in state.groups),
                            target_s=0.0, round_s=0.0, reason="no live step times yet: the plan's inner steps",
                            decided_unix=now)
    fastest = min(live, key=lambda i: live[i])
    target = h * live[fastest]
    out, changed, notes = [], [], []
    for i, g in enumerate(state.groups):
        s = live.get(i)
        steps = min(h, max(1, g.steps))
        if s is not None:
            noise = 0.0 if i == fastest else math.hypot(est[i].noise, est[fastest].noise)
            new = fitting_steps(steps, target / s, h, options, noise)
            if new != steps:
                changed.append(g.name)
                notes.append(f"{g.name} {steps} -> {new} ({s:.3g} s a step)")
                steps = new
        out.append(GroupSteps(name=g.name, since_epoch=g.since_epoch, steps=steps, step_s=s or 0.0))
    round_s = max(x.steps * x.step_s for x in out)
    missing = sorted(g.name for i, g in enumerate(state.groups) if i not in live)
    reason = (f"rounds of {target:.3g} s (H={h} steps of {state.groups[fastest].name}'s {live[fastest]:.3g} s): "
              + ("; ".join(notes) if notes else "every group's steps fit")
              + (f"; no live figure yet for {', '.join(missing)} (kept)" if missing else ""))
    return PaceDecision(groups=tuple(out), target_s=target, round_s=round_s, reason=reason, decided_unix=now,
                        changed=tuple(changed))


def outer_deadline(planned_s: float, round_s: float, options: PaceOptions) -> float:
    """How long a round waits for a late group after the first arrived: the plan's figure (the job's setting, or the
    planner's from the predicted round), and at least `deadline_rounds` live rounds, so a group whose rounds run
    longer than predicted is not left out of every round."""
    return max(planned_s, options.deadline_rounds * round_s)
