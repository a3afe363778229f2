"""Replanning when the devices stop running as planned (drift).

A plan is built around each device's speed as profiled at join (and calibrated by earlier epochs,
`atoll.coordinator.calibration`). Devices drift from it: a co-tenant takes half a GPU, a card throttles, a
volunteer's machine starts other work. Membership does not change, so nothing else would replan, and a pipeline
then runs at the pace of its slowest stage for as long as the job lasts.

The coordinator checks the running epoch every `DriftOptions.interval`:
1. each node's change of speed within the epoch (`speed_changes`): the median of its last `min_steps` steps'
   compute over the median of its first `min_steps` (after the epoch's first step), once it has both;
2. drift: some node's change, over the median node's, outside [1 / threshold, threshold]; if none, nothing more
   is done. A change, not a gap to the plan's prediction: the cost model's error on some layers (the embedding,
   the head) shows as a node running "slower than planned" from the epoch's first step, and moving those layers
   to another node moves the error with them, so a gap would replan back and forth. And against the median: a
   slowdown every node shares (nodes on one machine's cores, a warmer room) leaves the plan's balance as it was;
3. the plan the planner would make now, from every profile scaled by its factor as the last `min_steps` steps
   measured it (`calibration.speed_factors(recent=...)`), against the running plan re-estimated under the same
   factors (`estimated_step`): both come from the same cost model, so its bias cancels in the comparison;
4. a switch only when the new plan predicts steps at least `min_gain` shorter and the time it saves over the
   steps left exceeds what switching costs: the restart (the last plan change's measured time from publication
   to the first step). Nothing is rolled back: a synchronous plan's nodes hand their state over live, a stage
   whose state is spread over ranks (ZeRO, tensor parallelism) gathering it whole first
   (`PlanRunner._zero_states`, `PlanRunner._tp_whole`).

After a drift replan the next check waits `interval` again and needs 2 x `min_steps` steps of the new epoch, so a
drift replans once, not every interval. A node that became faster drifts too: the planner may give it more work.

Outer mode (replica groups across regions): each round waits for the slowest group, so one slowed node holds every
group back. The groups holding a node that slowed are planned afresh from their nodes' recent speeds (fewer inner
steps a round, or their work rebalanced), every other group running on as it is (`planning.kept_groups`); the
comparison is of tokens/s over the groups (`estimated_rate`: the running plan's groups at their slowest stages' new
pace, through the planner's round simulation). A node that became faster replans nothing there (it holds no round
back, and a group planned afresh starts again from the outer state at the start of its round in progress) unless it
had been planned slower than its profile: it recovered, and its group may train more inner steps a round again.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

from atoll.plan import PipelinePlan, Plan
from atoll.types import StepMetrics

DEFAULT_SWITCH_S = 30.0
"""Restart time assumed for a plan change when no change has been measured yet."""


@dataclass(frozen=True, kw_only=True)
class DriftOptions:
    """When the coordinator replans because devices run slower or faster than planned."""

    enabled: bool = True
    threshold: float = 1.25
    """A node drifts when its compute per step changes by more than this factor within an epoch, either way,
    against the median node's change."""
    min_gain: float = 0.10
    """Replan only when the new plan predicts steps at least this much shorter (0.10: 10%)."""
    interval: timedelta = timedelta(seconds=60)
    """Between checks (each one that finds drift runs the planner)."""
    min_steps: int = 10
    """Steps compared at each end of the epoch (after its first): a node's speed is judged from 2 x this many."""

    def __post_init__(self) -> None:
        if not self.threshold > 1.0:
            raise ValueError(f"drift threshold must be above 1 (a factor), got {self.threshold}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"drift min_gain must be in [0, 1), got {self.min_gain}")
        if self.interval <= timedelta(0):
            raise ValueError(f"drift interval must be positive, got {self.interval}")
        if self.min_steps < 1:
            raise ValueError(f"drift min_steps must be >= 1, got {self.min_steps}")


def speed_changes(compute: Mapping[str, Sequence[float]], window: int) -> dict[str, float]:
    """Per node with at least 2 x `window` steps of the epoch (`calibration.epoch_compute`): the median compute of
    its last `window` steps over that of its first `window` (2.0: twice as slow as when the epoch began)."""
    out = {}
    for node, secs in compute.items():
        if len(secs) >= 2 * window:
            first = statistics.median(secs[:window])
            if first > 0:
                out[node] = statistics.median(secs[-window:]) / first
    return out


def drifted(factors: Mapping[str, float], threshold: float) -> dict[str, float]:
    """The nodes whose speed factor over the median node's lies outside [1 / threshold, threshold], with that
    relative factor."""
    if not factors:
        return {}
    median = statistics.median(factors.values())
    return {n: f / median for n, f in factors.items() if not 1.0 / threshold <= f / median <= threshold}


UNSETTLED_STEPS = 3
"""`unsettled` judges a node's newest this many steps."""


def unsettled(compute: Mapping[str, Sequence[float]], window: int, threshold: float,
              newest: int = UNSETTLED_STEPS) -> set[str]:
    """The nodes whose compute has begun to move and `speed_changes` cannot say so yet: the median of a node's
    newest `newest` steps over that of its first `window` (at least `window + newest` steps of the epoch), against
    the median node's same ratio, outside [1 / threshold, threshold]. A slowdown a few steps old reads as a slow
    network to the network fit (the starved node's transfers and its peers' waits on it stretch) while the drift
    check still waits for a window of it; the fit leaves such nodes out until the drift check has judged them."""
    ratios = {}
    for node, secs in compute.items():
        if len(secs) >= window + newest:
            first = statistics.median(secs[:window])
            if first > 0:
                ratios[node] = statistics.median(secs[-newest:]) / first
    return set(drifted(ratios, threshold))


def estimated_step(plan: Plan, factors: Mapping[str, float]) -> float:
    """The running plan's step time with each node's compute scaled by its factor (1 where it has none), in the
    plan's own cost model: each pipeline's predicted step scaled as its slowest stage's compute per micro-batch
    (a stage runs at its slowest node's pace), the slowest pipeline setting the step. Cycles of the slowest stage
    make most of a balanced pipeline's step; fill, drain and the all-reduce scale alike to first order."""
    return plan.predicted.step_time_s * _slowdown(plan.pipelines, factors)


def _slowdown(pipelines: Iterable[PipelinePlan], factors: Mapping[str, float]) -> float:
    """How many times longer the slowest of `pipelines` takes per micro-batch at its slowest stage when each
    node's compute is scaled by its factor (1 without a prediction)."""
    worst = 0.0
    for pipe in pipelines:
        before = max((st.compute_s for st in pipe.stages), default=0.0)
        after = max((st.compute_s * max((factors.get(n, 1.0) for n in st.nodes), default=1.0)
                     for st in pipe.stages), default=0.0)
        if before > 0:
            worst = max(worst, after / before)
    return worst or 1.0


def estimated_rate(plan: Plan, factors: Mapping[str, float]) -> float:
    """Tokens per second of `plan` with each node's compute scaled by its factor. A synchronous plan's at its
    `estimated_step`. An outer-mode plan's from its replica groups' inner steps, each scaled as `estimated_step`
    scales a plan (the group's slowest stage at its new pace), through the planner's round simulation
    (`simulate_outer`: each group trains its inner steps, a round waits for the slowest, the exchange overlapped
    as planned), so a slowed group holds every round back. 0 without a prediction."""
    tokens = plan.global_batch * plan.seq_len
    if plan.mode != "outer" or plan.outer is None or not plan.groups:
        step = estimated_step(plan, factors)
        return tokens / step if step > 0 else 0.0
    if any(g.step_time_s <= 0 for g in plan.groups):
        return 0.0
    from atoll.coordinator.planner.simulator import simulate_outer  # the planner's, loaded with it

    step_s = [g.step_time_s * _slowdown((plan.pipelines[p] for p in g.pipelines), factors) for g in plan.groups]
    sim = simulate_outer(step_s, [g.inner_steps for g in plan.groups], plan.outer.sync_s, overlap=plan.outer.overlap)
    return sim.tokens_per_s(tokens)


def switch_seconds(history: Iterable[tuple[int, float]], steps: Iterable[StepMetrics]) -> float:
    """What the last measured plan change cost: from a plan's publication to its epoch's first step report (the
    nodes stopping, meeting at the new rendezvous, loading their layers). `history`: (epoch, published unix)."""
    first: dict[int, float] = {}
    for m in steps:
        if m.unix_time > 0:
            first[m.plan_epoch] = min(first.get(m.plan_epoch, m.unix_time), m.unix_time)
    took = [first[e] - t for e, t in history if e in first and first[e] >= t]
    return statistics.median(took[-3:]) if took else DEFAULT_SWITCH_S


@dataclass(frozen=True)
class SwitchVerdict:
    go: bool
    why: str
    gain: float
    """The new plan's predicted step over the running one's re-estimated step, less one (0.2: 20% shorter)."""


def switch_verdict(*, current_s: float, new_s: float, steps_left: int, switch_s: float,
                   min_gain: float, per: str = "a step") -> SwitchVerdict:
    """Whether to move to the new plan: it must predict steps at least `min_gain` shorter, and the time saved
    over `steps_left` must exceed the restart (`switch_s`). `per`: what the times are of, as the reason says it
    (an outer-mode plan's are of a global batch's tokens at its groups' joint rate)."""
    if new_s <= 0 or current_s <= 0:
        return SwitchVerdict(False, "no prediction to compare", 0.0)
    gain = 1.0 - new_s / current_s
    if gain < min_gain:
        return SwitchVerdict(False, f"the best plan now predicts {new_s:.3g} s {per} against {current_s:.3g} s, "
                                    f"{gain:.0%} shorter (a switch needs {min_gain:.0%})", gain)
    saved = steps_left * (current_s - new_s)
    cost = switch_s
    if saved <= cost:
        return SwitchVerdict(False, f"the new plan would save {saved:.0f} s over the {steps_left} steps left, less "
                                    f"than switching costs ({cost:.0f} s)", gain)
    return SwitchVerdict(True, f"the new plan predicts {new_s:.3g} s {per} against {current_s:.3g} s ({gain:.0%} "
                               f"shorter), saving about {saved - cost:.0f} s over the {steps_left} steps left", gain)


def describe(factors: Mapping[str, float], shown: int = 4) -> str:
    """'node b computes 2.10x slower than planned, node c 1.40x faster (against the median node)': the largest
    departures first, the factors as `drifted` gives them."""
    items = sorted(factors.items(), key=lambda kv: -abs(math.log(max(kv[1], 1e-9))))
    parts = []
    for k, (n, f) in enumerate(items[:shown]):
        how = f"{f:.2f}x slower" if f >= 1 else f"{1 / f:.2f}x faster"
        parts.append(f"node {n} computes {how} than planned" if k == 0 else f"node {n} {how}")
    more = len(items) - shown
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "") + " (against the median node)"
