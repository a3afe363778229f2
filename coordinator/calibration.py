"""Device speed as the run measures it: each node's compute per step against what its plan predicted.

A node's profile is measured once, at join, in a few seconds; the device it describes then trains for hours,
beside co-tenants, under thermal limits, behind a driver that warms up. Every step each node reports the
seconds its forward and backward passes took (`StepMetrics.compute_seconds`), and the plan it ran says what
the cost model expected of them (`StagePlan.compute_s` per micro-batch of its busiest replica, times the
pipeline's micro-batches). `speed_factors` turns the reports of one plan epoch into a factor per node:
measured over predicted, the median over its steps after the first (which warms up). When the coordinator
plans again (a join, a leave, a failure) it scales each node's profile by its factor, compounded with the
factor that plan was made with (`compound`), so the next plan and its predicted step start from what the
devices did rather than what they measured at join. A node without enough steps keeps the factor it had.

Factors are clamped to [1 / MAX_FACTOR, MAX_FACTOR]: a report far outside that is a stall (a node paused,
swapping), not a speed, and the next plan should not be built around it.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Iterable, Mapping

from atoll.plan import Plan, shares
from atoll.types import StepMetrics

MIN_STEPS = 5
"""Steps of a plan epoch a node must have reported (after its first) before its factor counts."""
MAX_FACTOR = 4.0
"""Factors are clamped to [1 / MAX_FACTOR, MAX_FACTOR]."""


def _clamp(factor: float) -> float:
    return min(MAX_FACTOR, max(1.0 / MAX_FACTOR, factor))


def spread(values: Iterable[float], unit: str = "x") -> str:
    """The range of `values` at two decimals ("1.20x-1.60x"; one figure when both ends print alike)."""
    vs = sorted(values)
    lo, hi = f"{vs[0]:.2f}{unit}", f"{vs[-1]:.2f}{unit}"
    return lo if lo == hi else f"{lo}-{hi}"


def predicted_compute(plan: Plan) -> dict[str, float]:
    """Per node of the plan, the seconds of forward and backward compute the cost model predicted for one
    step: its stage's `compute_s` (the busiest replica's micro-batch) scaled to the rows its own replica takes
    (the runtime shares a micro-batch's rows as evenly as possible, the first replicas one more), times the
    pipeline's micro-batches. Stages without a prediction (a pinned or fallback plan) are left out."""
    out: dict[str, float] = {}
    for pipe in plan.pipelines:
        for st in pipe.stages:
            if st.compute_s <= 0 or not st.nodes:
                continue
            per_lane = st.dp // st.lanes  # a laned stage's replicas share only their lane's micro-batches
            split = shares(pipe.micro_batch, per_lane)  # the rows of each replica, as the runtime shares them
            busiest = max(b - a for a, b in split)
            for k, node in enumerate(st.nodes):
                a, b = split[k // max(1, st.tp) % per_lane]  # nodes[r * tp + k] is tp rank k of replica r
                out[node] = st.compute_s * (b - a) / busiest * (pipe.num_micro_batches // st.lanes)
    return out


def epoch_compute(plan: Plan, steps: Iterable[StepMetrics]) -> dict[str, list[float]]:
    """Per node of `plan`, its measured compute seconds of each step of the plan's epoch in step order, the
    epoch's first step (which warms up: allocations, kernels, connections) and skipped steps left out."""
    expected = predicted_compute(plan)
    seen: dict[str, list[tuple[int, float]]] = {}
    for m in steps:
        if m.plan_epoch == plan.epoch and m.node_id in expected and m.compute_seconds > 0 and not m.skipped:
            seen.setdefault(m.node_id, []).append((m.step, m.compute_seconds))
    return {n: [c for _, c in sorted(rows)[1:]] for n, rows in seen.items()}


def speed_factors(plan: Plan, steps: Iterable[StepMetrics], *, min_steps: int = MIN_STEPS,
                  recent: int = 0, nodes: Collection[str] | None = None) -> dict[str, float]:
    """Measured over predicted compute per step for every node of `plan` with at least `min_steps` reports of
    its epoch after its first, the median over them (over the last `recent` of them when it is positive: the
    speed now rather than over the epoch) (clamped, see the module). Nothing for an outer-mode plan unless
    `nodes` names whose: a replan there keeps the replica groups that still run as they were planned,
    predictions and all, so their nodes' factors would be compounded with a ratio they already hold; a drift
    replan names the nodes of the groups it plans afresh. `nodes`: only these (None: every node)."""
    if plan.mode == "outer" and nodes is None:
        return {}
    expected = predicted_compute(plan)
    out: dict[str, float] = {}
    for node, kept in epoch_compute(plan, steps).items():
        if nodes is not None and node not in nodes:
            continue
        if recent > 0:
            kept = kept[-recent:]
        if len(kept) >= min_steps:
            ratio = statistics.median(kept) / expected[node]
            out[node] = _clamp(ratio)
    return out


def compound(applied: Mapping[str, float], measured: Mapping[str, float]) -> dict[str, float]:
    """The factors for the next plan: each node's factor its last plan was made with times what that plan's
    run measured (a node with no measurement keeps its factor), clamped."""
    out = dict(applied)
    for node, f in measured.items():
        out[node] = _clamp(applied.get(node, 1.0) * f)
    return out


def calibration_note(speed: Mapping[str, float], members: Iterable[str]) -> str:
    """A log line's tail saying how far the runs moved the members' speed from their profiles ("" if nowhere
    by 5% or more)."""
    alive = set(members)
    moved = sorted(f for n, f in speed.items() if n in alive and abs(f - 1.0) >= 0.05)
    if not moved:
        return ""
    return (f"; {len(moved)} node{'s' if len(moved) > 1 else ''} planned at {spread(moved)} their profiled "
            "compute time, as their runs measured")
