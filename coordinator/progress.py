"""Training progress from step reports: step, loss, throughput, where each node's time goes, what each link carries.

Every node reports one `StepMetrics` per step (`atoll.node.runner`): its step, compute and wait time and the
traffic of the links it sends on, and the tokens of its rows; one last-stage node also reports the batch's
loss. These functions summarise the recent reports of one plan epoch for `atoll status` and the metrics
endpoint. They take reports oldest first, as `Store.recent_steps` returns them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from atoll.types import LinkStats, StepMetrics


@dataclass(frozen=True, kw_only=True)
class StageUsage:
    """One node's recent steps: means per step."""

    node_id: str
    pipeline: int
    stage: int
    steps: int
    """Steps summarised."""
    step_seconds: float
    compute_seconds: float
    """Forward and backward passes."""
    wait_seconds: float
    """Waiting for neighbours' tensors."""
    peak_memory_bytes: int = 0
    """The highest peak memory the node reported over these steps (0: none measured)."""

    @property
    def utilisation(self) -> float:
        """Compute time / step time."""
        return self.compute_seconds / self.step_seconds if self.step_seconds > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class LinkUsage:
    """What one node sent one peer in one direction over its recent steps: means per step."""

    src: str
    dst: str
    direction: str
    pipeline: int
    stage: int
    """The sender's place in the plan."""
    steps: int
    codec: str
    """The codec of the sender's latest step."""
    bytes_raw: float
    bytes_wire: float
    seconds: float
    """Time on the wire."""
    estimate_bytes_per_s: float
    """The sender's bandwidth estimate (moving average of real transfers) at its latest step."""

    @property
    def achieved_bytes_per_s(self) -> float:
        return self.bytes_wire / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class Progress:
    """The job's recent progress in one plan epoch."""

    step: int
    """Latest step any node reported (in any epoch)."""
    loss: float | None
    """Latest reported loss (in any epoch), and its step."""
    loss_step: int
    tokens_per_second: float
    measured_step_seconds: float
    """Median wall time per step over the recent steps (see `step_times`); 0 before any step is reported."""
    measured_steps: int
    """Steps that median is taken over."""
    stages: list[StageUsage]
    links: list[LinkUsage]


def _last_stages(reports: Sequence[StepMetrics]) -> dict[int, int]:
    """pipeline -> index of its last stage, the highest any node of it reported."""
    last: dict[int, int] = {}
    for r in reports:
        last[r.pipeline] = max(last.get(r.pipeline, 0), r.stage)
    return last


def step_times(reports: Sequence[StepMetrics]) -> dict[int, float]:
    """step -> its wall time, from reports of one epoch.

    A step's wall time is the gap between a last-stage node's reports of it and of the step before, the
    longest such gap over the last stage's replicas (each gap on one node's clock). It counts everything a
    step costs: the pipeline, the all-reduce, the optimizer, checkpoints and reporting. A step without such a
    gap (the first one reported) gets the longest step time any node reported for it.
    """
    last = _last_stages(reports)
    done: dict[tuple[str, int], float] = {}
    longest: dict[int, float] = {}
    for r in reports:
        longest[r.step] = max(longest.get(r.step, 0.0), r.step_seconds)
        if r.stage == last[r.pipeline] and r.unix_time > 0:
            done[r.node_id, r.step] = r.unix_time
    gaps: dict[int, float] = {}
    for (node, step), t in done.items():
        before = done.get((node, step - 1))
        if before is not None and t > before:
            gaps[step] = max(gaps.get(step, 0.0), t - before)
    return {step: gaps.get(step, seconds) for step, seconds in longest.items() if gaps.get(step, seconds) > 0}


def _tokens(reports: Sequence[StepMetrics]) -> dict[int, int]:
    """step -> tokens trained, for steps all last-stage replicas have reported (those of one epoch).

    Each last-stage replica reports the tokens of its own rows; a step counts once as many replicas reported
    it as reported any step, so a step half reported does not look slow.
    """
    last = _last_stages(reports)
    tokens: dict[int, int] = {}
    nodes: dict[int, set[str]] = {}
    for r in reports:
        if r.stage == last[r.pipeline] and r.node_id not in nodes.setdefault(r.step, set()):
            nodes[r.step].add(r.node_id)
            tokens[r.step] = tokens.get(r.step, 0) + r.tokens
    full = max((len(n) for n in nodes.values()), default=0)
    return {s: t for s, t in tokens.items() if len(nodes[s]) == full}


def _tokens_per_second(reports: Sequence[StepMetrics], window: int) -> float:
    """Tokens per second over each pipeline's last `window` complete steps, summed over the pipelines. The same
    as one rate over the job's steps where the pipelines step together (a synchronous plan); in outer mode each
    replica group steps at its own pace, and one rate over the steps every group had reported took the slowest
    group's step time for all of them."""
    by_pipeline: dict[int, list[StepMetrics]] = {}
    for r in reports:
        by_pipeline.setdefault(r.pipeline, []).append(r)
    total = 0.0
    for ours in by_pipeline.values():
        tokens, times = _tokens(ours), step_times(ours)
        steps = sorted(s for s in tokens if times.get(s, 0.0) > 0)[-window:]
        total_s = sum(times[s] for s in steps)
        total += sum(tokens[s] for s in steps) / total_s if total_s > 0 else 0.0
    return total


def throughput(reports: Iterable[StepMetrics], epoch: int, window: int = 5) -> tuple[int, float]:
    """(latest step reported, tokens per second over the last `window` complete steps of `epoch`)."""
    reports = list(reports)
    latest = max((r.step for r in reports), default=0)
    return latest, _tokens_per_second([r for r in reports if r.plan_epoch == epoch], window)


def _stage_usage(reports: Sequence[StepMetrics]) -> list[StageUsage]:
    groups: dict[tuple[int, int, str], list[StepMetrics]] = {}
    for r in reports:
        groups.setdefault((r.pipeline, r.stage, r.node_id), []).append(r)
    out = []
    for (pipeline, stage, node), rs in sorted(groups.items()):
        n = len(rs)
        out.append(StageUsage(node_id=node, pipeline=pipeline, stage=stage, steps=n,
                              step_seconds=sum(r.step_seconds for r in rs) / n,
                              compute_seconds=sum(r.compute_seconds for r in rs) / n,
                              wait_seconds=sum(r.wait_seconds for r in rs) / n,
                              peak_memory_bytes=max(r.peak_memory_bytes for r in rs)))
    return out


def _link_usage(reports: Sequence[StepMetrics]) -> list[LinkUsage]:
    groups: dict[tuple[int, int, str, str, str], list[tuple[int, LinkStats]]] = {}
    for r in reports:
        for x in r.links:
            groups.setdefault((r.pipeline, r.stage, r.node_id, x.direction, x.peer), []).append((r.step, x))
    out = []
    # along the pipeline, forward before backward
    for (pipeline, stage, src, direction, dst), hits in sorted(
            groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][3] != "forward", kv[0][2], kv[0][4])):
        steps = len({step for step, _ in hits})
        latest = max(hits, key=lambda hit: hit[0])[1]
        out.append(LinkUsage(src=src, dst=dst, direction=direction, pipeline=pipeline, stage=stage, steps=steps,
                             codec=latest.codec, bytes_raw=sum(x.bytes_raw for _, x in hits) / steps,
                             bytes_wire=sum(x.bytes_wire for _, x in hits) / steps,
                             seconds=sum(x.seconds for _, x in hits) / steps,
                             estimate_bytes_per_s=latest.bandwidth_bytes_per_s))
    return out


def summarize(reports: Sequence[StepMetrics], epoch: int, window: int = 8) -> Progress:
    """The job's progress from its recent reports (oldest first), over the last `window` steps of `epoch`; each
    pipeline's stages and links over its own last `window` steps (outer mode: replica groups step at their own
    pace, and a group that fell behind, the one a user looks for, has none of the newest step numbers)."""
    latest = max((r.step for r in reports), default=0)
    with_loss = [r for r in reports if r.loss is not None]
    newest_loss = max(with_loss, key=lambda r: (r.plan_epoch, r.step), default=None)
    ours = [r for r in reports if r.plan_epoch == epoch]
    steps_of: dict[int, set[int]] = {}
    for r in ours:
        steps_of.setdefault(r.pipeline, set()).add(r.step)
    recent_steps = {p: set(sorted(steps)[-window:]) for p, steps in steps_of.items()}
    recent = [r for r in ours if r.step in recent_steps[r.pipeline]]
    times = step_times(ours)
    measured = [times[s] for s in sorted(times)[-window:]]
    return Progress(
        step=latest, loss=newest_loss.loss if newest_loss is not None else None,
        loss_step=newest_loss.step if newest_loss is not None else 0,
        tokens_per_second=_tokens_per_second(ours, window),
        measured_step_seconds=statistics.median(measured) if measured else 0.0, measured_steps=len(measured),
        stages=_stage_usage(recent), links=_link_usage(recent))
