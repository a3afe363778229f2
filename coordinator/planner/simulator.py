"""Event-driven simulation of one training step of a pipeline under 1F1B.

Each stage runs its own fixed 1F1B order (warm-up forwards, then one forward one backward, then the
remaining backwards; a stage with extra in-flight depth, a *deep window*, runs that many more warm-up
forwards, as `atoll.node.schedule` does); an operation starts when its stage is free and its input has
arrived. Every link carries activations forward and activation-gradients backward, one transfer at a time
per direction, in parallel with compute; a link's latency delays each transfer without occupying the link,
so transfers queued behind one another arrive a latency after their turn on the wire. After its last
backward a stage all-reduces its gradients with its data-parallel replicas, then steps its optimizer; the
step ends when the last stage is done.

With equal stages and free links the step takes (m + p - 1) x (forward + backward) before all-reduce, the
closed form the tests check.

A stage with deferred weight gradients (zero-bubble, `PipelineTimes.defer`, as `atoll.node.schedule` places
them) runs each backward as its input-gradient part (`backward_s + split_s - weight_s`: two passes cost
`split_s` more than one), which is what its upstream waits for, and the weight-gradient part as an action of
its own that needs no input; with every stage
deferring (`zero_bubble_depths`) equal stages take m (F + B + W) + (p - 1) (F + B - W) instead.

A stage of L lanes (`StageTimes.lanes`, `atoll.plan`: lane i % L trains micro-batch i) is L executors, each
running the stage's order restricted to its micro-batches, as the node does; its times are one lane's per
micro-batch, and the stages up to it open more forwards (`atoll.plan.lane_warmups`) so every lane has work.

`simulate_outer` predicts outer mode over rounds: replica groups of given step times and inner steps, and
an exchange of pseudo-gradients every round, overlapped with the next round or not.
"""

from __future__ import annotations

import functools
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from atoll.plan import Plan, lane_warmups


@dataclass(frozen=True, kw_only=True)
class StageTimes:
    forward_s: float
    """Forward time of one micro-batch."""
    backward_s: float
    """Backward time of one micro-batch."""
    sync_s: float = 0.0
    """Gradient all-reduce after the last backward."""
    sync_hidden_s: float = 0.0
    """Of `sync_s`, what runs while the stage's last backward still computes: ZeRO-1 reduce-scatters each bucket
    as the last micro-batch completes its gradients (`atoll.node.zero`), so the step waits only for the rest."""
    optimizer_s: float = 0.0
    """Optimizer step after the all-reduce."""
    weight_s: float = 0.0
    """Of `backward_s + split_s`, the linear layers' weight-gradient products: what a stage that defers them runs
    as an action of its own (`PipelineTimes.defer`)."""
    split_s: float = 0.0
    """What a stage that defers its weight gradients adds to its backward by running it in two passes (measured);
    its input-gradient action takes `backward_s + split_s - weight_s`."""
    lanes: int = 1
    """Lanes of the stage: micro-batch i runs on lane i % lanes, each lane taking the times above for it."""

    def __post_init__(self) -> None:
        if self.lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {self.lanes}")
        if self.split_s < 0 or not 0.0 <= self.weight_s <= self.backward_s + self.split_s:
            raise ValueError(f"weight_s must be in [0, backward_s + split_s] (part of the split backward) and "
                             f"split_s >= 0, got {self.weight_s} of {self.backward_s} + {self.split_s}")
        if not 0.0 <= self.sync_hidden_s <= self.sync_s:
            raise ValueError(f"sync_hidden_s must be in [0, sync_s] (part of the all-reduce), got "
                             f"{self.sync_hidden_s} of {self.sync_s}")

    @property
    def exposed_sync_s(self) -> float:
        """What of the gradient reduction the step waits for after the stage's last backward."""
        return self.sync_s - self.sync_hidden_s


@dataclass(frozen=True, kw_only=True)
class LinkTimes:
    forward_s: float
    """Activation transfer of one micro-batch to the next stage, latency included."""
    backward_s: float
    """Activation-gradient transfer back, latency included."""
    latency_s: float = 0.0
    """Of each of the two, the one-way latency: it delays a transfer's arrival but does not occupy the link,
    so the next transfer may start as soon as this one's bytes are on the wire."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.latency_s <= min(self.forward_s, self.backward_s):
            raise ValueError(f"latency_s must be in [0, min(forward_s, backward_s)] (the transfer times include it), "
                             f"got {self.latency_s} with {self.forward_s} and {self.backward_s}")


@dataclass(frozen=True, kw_only=True)
class PipelineTimes:
    stages: tuple[StageTimes, ...]
    links: tuple[LinkTimes, ...]
    """links[i] joins stage i and stage i + 1."""
    num_micro_batches: int
    in_flight: tuple[int, ...] = ()
    """Extra micro-batches in flight per stage beyond strict 1F1B (deep windows, `StagePlan.in_flight`);
    empty: strict 1F1B everywhere."""
    defer: tuple[int, ...] = ()
    """Per stage, the micro-batches whose weight gradients wait for their own action (zero-bubble,
    `StagePlan.defer_weights`; 0: none); empty: none anywhere."""

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a pipeline needs at least one stage")
        if len(self.links) != len(self.stages) - 1:
            raise ValueError(f"{len(self.stages)} stages need {len(self.stages) - 1} links, got {len(self.links)}")
        if self.num_micro_batches < 1:
            raise ValueError("num_micro_batches must be >= 1")
        if self.in_flight:
            if len(self.in_flight) != len(self.stages) or min(self.in_flight) < 0:
                raise ValueError(f"in_flight needs one extra depth >= 0 per stage ({len(self.stages)}), "
                                 f"got {self.in_flight}")
            w = [min(x, self.num_micro_batches - 1) for x in self.warmups()]  # m - 1 orders as m does
            if any(b > a for a, b in zip(w, w[1:])):
                raise ValueError(f"in_flight {self.in_flight} gives warm-ups {w} that grow downstream, which "
                                 "deadlocks; a stage may keep at most one extra micro-batch more than its upstream")
        if self.defer and (len(self.defer) != len(self.stages) or min(self.defer) < 0):
            raise ValueError(f"defer needs one depth >= 0 per stage ({len(self.stages)}), got {self.defer}")

    @functools.cached_property
    def _lane_extra(self) -> tuple[int, ...] | None:
        """Per stage, what lanes at it and after it add to its warm-up (`atoll.plan.lane_warmups`); None: no lanes."""
        lanes = [s.lanes for s in self.stages]
        if max(lanes) == 1:
            return None
        n = len(lanes)
        return tuple(w - (n - i - 1) for i, w in enumerate(lane_warmups(lanes)))

    def extra(self, stage: int) -> int:
        """Extra in-flight depth of `stage` (0 under strict 1F1B): its deep window, plus what lanes at it and after
        it ask."""
        own = self.in_flight[stage] if self.in_flight else 0
        lanes = self._lane_extra
        return own if lanes is None else own + lanes[stage]

    def deferred(self, stage: int) -> int:
        """Micro-batches whose weight gradients `stage` defers (0: computed in backward)."""
        return self.defer[stage] if self.defer else 0

    def backward_part(self, stage: int) -> float:
        """What `stage`'s backward action takes: without the weight gradients when it defers them."""
        s = self.stages[stage]
        return s.backward_s + s.split_s - s.weight_s if self.deferred(stage) else s.backward_s

    def backward_total(self, stage: int) -> float:
        """What `stage`'s backward takes per micro-batch in all: split in two when it defers its weight gradients."""
        s = self.stages[stage]
        return s.backward_s + s.split_s if self.deferred(stage) else s.backward_s

    def warmups(self) -> list[int]:
        """Warm-up forwards per stage: min(p - i - 1 + extra, m)."""
        n, m = len(self.stages), self.num_micro_batches
        return [min(n - i - 1 + self.extra(i), m) for i in range(n)]


@dataclass(frozen=True)
class Event:
    stage: int
    kind: str
    """F, B, sync or opt; in outer mode (`simulate_outer`) inner or outer."""
    micro_batch: int
    start: float
    end: float
    lane: int = 0
    """The stage's lane that ran it (`StageTimes.lanes`)."""


@dataclass(kw_only=True)
class SimResult:
    step_time_s: float
    """Until the last stage has stepped its optimizer."""
    pipeline_time_s: float
    """Until the last backward (without all-reduce and optimizer)."""
    busy_s: list[float]
    """Compute time per stage."""
    events: list[Event] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """Share of the pipeline time the busiest stage is idle."""
        return 1 - max(self.busy_s) / self.pipeline_time_s if self.pipeline_time_s > 0 else 0.0


def plan_pipeline_times(plan: Plan, index: int = 0) -> PipelineTimes | None:
    """The simulator's input for pipeline `index` of `plan`, as the planner simulated it when it made the plan
    (its stages' `timing` and links' transfer times, carried in the plan); None for a plan whose stages carry no
    timing (the coordinator's fallback plan)."""
    pipe = plan.pipelines[index]
    if any(s.timing is None for s in pipe.stages):
        return None
    stages = tuple(StageTimes(forward_s=t.forward_s, backward_s=t.backward_s, sync_s=t.sync_s,
                              sync_hidden_s=t.sync_hidden_s, optimizer_s=t.optimizer_s, weight_s=t.weight_s,
                              split_s=t.split_s, lanes=s.lanes)
                   for s in pipe.stages for t in (s.timing,) if t is not None)
    links = tuple(LinkTimes(forward_s=x.seconds, backward_s=x.backward_seconds or x.seconds, latency_s=x.latency_s)
                  for s in pipe.stages[:-1] for x in (s.send,) if x is not None)
    defer = tuple(s.defer_weights for s in pipe.stages)
    return PipelineTimes(stages=stages, links=links, num_micro_batches=pipe.num_micro_batches,
                         in_flight=tuple(s.in_flight for s in pipe.stages), defer=defer if any(defer) else ())


def one_f_one_b_order(stage: int, num_stages: int, m: int, extra: int = 0, defer: int = 0) -> list[tuple[str, int]]:
    """The order of a 1F1B stage, `extra` micro-batches deeper than strict, with the weight gradients ("W")
    of micro-batch j after the backward of j + `defer` when it defers them (the node's schedule)."""
    warm = min(num_stages - stage - 1 + extra, m)
    ops = [("F", j) for j in range(warm)]
    for j in range(m - warm):
        ops.append(("F", warm + j))
        ops.append(("B", j))
    ops.extend(("B", j) for j in range(m - warm, m))
    if not defer:
        return ops
    out: list[tuple[str, int]] = []
    waiting: list[int] = []
    for op in ops:
        out.append(op)
        if op[0] == "B":
            waiting.append(op[1])
            if len(waiting) > defer:
                out.append(("W", waiting.pop(0)))
    out.extend(("W", j) for j in waiting)
    return out


def simulate(p: PipelineTimes, *, record: bool = False) -> SimResult:
    n, m = len(p.stages), p.num_micro_batches
    lanes = [s.lanes for s in p.stages]
    # one executor per lane of every stage (one per stage without lanes), each with its share of the stage's order
    first = list(itertools.accumulate([0] + lanes))  # executor of (stage i, lane l): first[i] + l
    plain = max(lanes) == 1  # executor i is stage i, wire i boundary i
    stage_of = [i for i in range(n) for _ in range(lanes[i])]
    orders = []
    for i in range(n):
        order = one_f_one_b_order(i, n, m, p.extra(i), p.deferred(i))
        if lanes[i] == 1:
            orders.append(order)
        else:
            orders.extend([op for op in order if op[1] % lanes[i] == lane] for lane in range(lanes[i]))
    e = len(orders)
    nxt = [0] * e
    free = [0.0] * e
    # per stage and micro-batch (None: not yet): activation arrival, gradient arrival, forward done
    f_in: list[list[float | None]] = [[0.0] * m] + [[None] * m for _ in range(n - 1)]
    b_in: list[list[float | None]] = [[None] * m for _ in range(n)]
    f_done: list[list[float | None]] = [[None] * m for _ in range(n)]
    # the wire of a boundary: one per pair of lanes it joins (their replicas send over their own links); boundary
    # i's wires from wire[i], the pair (a, b) at wire[i] + a * lanes[i + 1] + b
    wire = list(itertools.accumulate([0] + [a * b for a, b in zip(lanes, lanes[1:])]))
    link_f = [0.0] * wire[-1]
    link_b = [0.0] * wire[-1]
    busy = [0.0] * n
    last_b = [0.0] * n
    events: list[Event] = []
    queue = deque(range(e))
    queued = [True] * e
    remaining = sum(len(o) for o in orders)
    # per stage, what each kind of action takes (looked up once, not per action)
    dur_f = [s.forward_s for s in p.stages]
    dur_b = [p.backward_part(i) for i in range(n)]
    dur_w = [s.weight_s for s in p.stages]

    while queue:
        x = queue.popleft()
        queued[x] = False
        i = x if plain else stage_of[x]
        progressed = False
        order, count = orders[x], len(orders[x])
        while nxt[x] < count:
            kind, j = order[nxt[x]]
            if kind == "F":
                ready = f_in[i][j]
                dur = dur_f[i]
            elif kind == "B":
                ready = f_done[i][j] if i == n - 1 else b_in[i][j]
                dur = dur_b[i]
            else:  # a deferred weight gradient: needs nothing from a neighbour
                ready, dur = 0.0, dur_w[i]
            if ready is None:
                break
            start = max(free[x], ready)
            end = start + dur
            free[x] = end
            busy[i] += dur
            nxt[x] += 1
            remaining -= 1
            progressed = True
            if record:
                events.append(Event(i, kind, j, start, end, j % lanes[i]))
            if kind == "F":
                f_done[i][j] = end
                if i + 1 < n:
                    link = p.links[i]
                    w = i if plain else wire[i] + j % lanes[i] * lanes[i + 1] + j % lanes[i + 1]
                    t0 = max(link_f[w], end)
                    link_f[w] = t0 + link.forward_s - link.latency_s  # the wire is free again; the bytes still travel
                    f_in[i + 1][j] = t0 + link.forward_s
                    y = i + 1 if plain else first[i + 1] + j % lanes[i + 1]
                    if not queued[y]:
                        queue.append(y)
                        queued[y] = True
            elif kind == "W":
                last_b[i] = max(last_b[i], end)
            else:
                last_b[i] = max(last_b[i], end)
                if i > 0:
                    link = p.links[i - 1]
                    w = i - 1 if plain else wire[i - 1] + j % lanes[i - 1] * lanes[i] + j % lanes[i]
                    t0 = max(link_b[w], end)
                    link_b[w] = t0 + link.backward_s - link.latency_s
                    b_in[i - 1][j] = t0 + link.backward_s
                    y = i - 1 if plain else first[i - 1] + j % lanes[i - 1]
                    if not queued[y]:
                        queue.append(y)
                        queued[y] = True
        if progressed and nxt[x] < count and not queued[x]:
            queue.append(x)
            queued[x] = True
    if remaining:
        raise AssertionError(f"1F1B simulation deadlocked with {remaining} operations left")
    pipeline_end = max(last_b)
    step = 0.0
    for i, s in enumerate(p.stages):
        t_sync = last_b[i] + s.exposed_sync_s
        t_opt = t_sync + s.optimizer_s
        if record:
            events.append(Event(i, "sync", -1, last_b[i], t_sync))
            events.append(Event(i, "opt", -1, t_sync, t_opt))
        step = max(step, t_opt)
    # a laned stage's busy time is its lanes' mean: the share of the step its replicas compute
    return SimResult(step_time_s=step, pipeline_time_s=pipeline_end, busy_s=[b / k for b, k in zip(busy, lanes)],
                     events=events)


def closed_form_step(p: PipelineTimes) -> float:
    """A fast estimate: fill and drain once through every stage and link, then m - 1 bottleneck cycles.

    The cycle is the slowest stage, the busiest link (its time on the wire) or the slowest boundary loop: a
    micro-batch's forward and backward on both sides of a boundary plus the latency both ways, shared by the
    micro-batches its window keeps in flight (1 more upstream than downstream under strict 1F1B, 1 + d with
    a deep window of depth d). Exact for equal stages and free links ((m + p - 1) x t); otherwise close to
    `simulate`, used to rank candidates before simulating the best.
    """
    m = p.num_micro_batches
    # window of boundary i: 2 + e_i - e_{i+1} micro-batches (a window clamped by m never reaches a steady state)
    loops = [(a.forward_s + p.backward_part(i) + b.forward_s + p.backward_part(i + 1) + 2 * x.latency_s)
             / (2 + p.extra(i) - p.extra(i + 1)) for i, (a, b, x) in enumerate(zip(p.stages, p.stages[1:], p.links))]
    cycle = max(max((s.forward_s + p.backward_total(i)) / s.lanes for i, s in enumerate(p.stages)),
                max((max(x.forward_s, x.backward_s) - x.latency_s for x in p.links), default=0.0),
                max(loops, default=0.0))
    # deferred weight gradients fill the fill and drain: each deferring stage's share of them shrinks by 2 W,
    # but the last micro-batch's weight gradients still end the step (m (F + B + W) + (p - 1) (F + B - W))
    deferred = [s.weight_s if p.deferred(i) else 0.0 for i, s in enumerate(p.stages)]
    fill = sum(s.forward_s + p.backward_total(i) - 2 * w for i, (s, w) in enumerate(zip(p.stages, deferred))) \
        + 2 * max(deferred) \
        + sum(x.forward_s + x.backward_s for x in p.links)
    tail = max(s.exposed_sync_s + s.optimizer_s for s in p.stages)
    return fill + (m - 1) * cycle + tail


def step_lower_bound(p: PipelineTimes) -> float:
    """A step time `simulate` never beats: stage i cannot start before micro-batch 0 reaches it, then runs
    m forwards and m backwards one at a time; its last gradient must still pass back through every earlier
    stage before stage 0 all-reduces and steps. Equal to the closed form on equal stages with free links."""
    m = p.num_micro_batches
    reach = back = 0.0
    through_first = after_own = 0.0
    for i, s in enumerate(p.stages):
        own = -(-m // s.lanes)  # the micro-batches of its busiest lane
        done = reach + own * (s.forward_s + p.backward_total(i))
        # a deferring stage runs its last min(k + 1, m) weight gradients after its last backward
        trailing = min(p.deferred(i) + 1, own) * s.weight_s if p.deferred(i) else 0.0
        through_first = max(through_first, done - trailing + back)
        after_own = max(after_own, done + s.exposed_sync_s + s.optimizer_s)
        if i < len(p.links):
            reach += s.forward_s + p.links[i].forward_s
            back += p.backward_part(i) + p.links[i].backward_s
    first = p.stages[0]
    first_trailing = min(p.deferred(0) + 1, -(-m // first.lanes)) * first.weight_s if p.deferred(0) else 0.0
    return max(through_first + first_trailing + first.exposed_sync_s + first.optimizer_s, after_own)


# --- outer mode: replica groups syncing every round ------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class OuterSimResult:
    round_s: float
    """Steady-state wall time of one round (compute plus any exposed sync or waiting)."""
    compute_s: float
    """Compute of one round: the slowest group's inner steps."""
    exposed_s: float
    """Wall time per round the sync adds beyond the compute (0 when it hides)."""
    steps_per_s: list[float]
    """Per group, inner steps per second of wall time (each inner step trains the global batch)."""
    events: list[Event] = field(default_factory=list)
    """With `record`: per round, each group's inner steps (stage = the group, kind "inner") and the exchange
    (stage = the number of groups, kind "outer"), `micro_batch` holding the round."""

    def tokens_per_s(self, tokens_per_step: int) -> float:
        """Tokens per second over every group (outer-mode tokens, not synchronous ones)."""
        return sum(self.steps_per_s) * tokens_per_step


def simulate_outer(step_s: Sequence[float], inner_steps: Sequence[int], sync_s: float, *, overlap: bool = True,
                   rounds: int = 24, record: bool = False) -> OuterSimResult:
    """Rounds of replica groups: group g runs `inner_steps[g]` steps of `step_s[g]` seconds, then sends its
    pseudo-gradients; round r's exchange lands `sync_s` after the last group has sent.

    Without overlap a group starts round r + 1 only once round r's exchange has landed (the sync is always
    exposed). With overlap it starts round r + 1 at once and applies round r's average at the end of round
    r + 1, waiting there only if that exchange has not landed (so the sync hides when it takes at most a
    round). Rates are measured over the second half of `rounds` on the group that starts last (a faster
    group may run up to a round ahead for a while, but in the long run keeps the laggard's pace).
    """
    if not step_s or len(step_s) != len(inner_steps):
        raise ValueError(f"need one step time per group and one inner_steps per group, got {len(step_s)} and "
                         f"{len(inner_steps)}")
    if min(step_s) <= 0 or min(inner_steps) < 1 or sync_s < 0 or rounds < 2:
        raise ValueError("step times must be positive, inner_steps >= 1, sync_s >= 0 and rounds >= 2")
    g = len(step_s)
    work = [h * t for h, t in zip(inner_steps, step_s)]
    start = [0.0] * g
    landed_prev = 0.0  # when round r - 1's exchange landed (overlap: awaited at the end of round r)
    mark = rounds // 2
    t_mark = 0.0
    events: list[Event] = []
    for r in range(rounds):
        if r == mark:
            t_mark = max(start)
        end = [s + w for s, w in zip(start, work)]
        landed = max(end) + sync_s
        if record:
            events.extend(Event(k, "inner", r, s, e) for k, (s, e) in enumerate(zip(start, end)))
            events.append(Event(g, "outer", r, max(end), landed))
        if overlap:
            start = [max(e, landed_prev) for e in end]
        else:
            start = [landed] * g
        landed_prev = landed
    span = max(start) - t_mark
    round_s = span / (rounds - mark)
    compute = max(work)
    exposed = round_s - compute
    return OuterSimResult(round_s=round_s, compute_s=compute, exposed_s=exposed if exposed > 1e-9 * round_s else 0.0,
                          steps_per_s=[h / round_s for h in inner_steps], events=events)
