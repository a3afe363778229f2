"""The whole job's loss history: every step's loss, tokens/s and validation loss, kept in bounded space.

The coordinator records one `Sample` per step report that carries a loss or a validation loss. The newest
`keep_full` steps stay at full resolution, one row per step; older steps are merged into buckets of `width`
consecutive steps that keep the count, min, mean and max of the loss (and of the validation loss) and the mean
tokens/s. When the buckets grow past `max_buckets`, their width doubles and neighbours merge, so a job of any
length is held in at most about `keep_full + max_buckets` rows, from its first step to its last: nothing is
dropped, only coarsened, and `resolution` says how coarse.

Rows and samples are plain data; `add_sample` and `compact` are pure functions the stores apply
(`atoll.coordinator.store`), `sparkline`, `downsample` and `draw_history` show a history.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from atoll.fsutil import atomic_write_bytes
from atoll.types import StepMetrics
from atoll.v1 import atoll_pb2 as pb

KEEP_FULL = 2000
"""Newest steps kept one row per step."""
MAX_BUCKETS = 1000
"""Most rows the older steps are merged into."""


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One step report's contribution: its loss and/or validation loss."""

    step: int
    epoch: int
    """The plan epoch of the report: a step trained again under a newer plan (after a rollback to a
    checkpoint) replaces its older full-resolution row instead of being averaged with it."""
    loss: float | None = None
    tokens_per_second: float | None = None
    val_loss: float | None = None


@dataclass(frozen=True, kw_only=True)
class Point:
    """Steps [first, first + width) of the history: one step (width 1) or a bucket of older steps."""

    first: int
    width: int = 1
    epoch: int = 0
    last: int = 0
    """The newest step actually recorded in the row (first <= last < first + width)."""
    count: int = 0
    """Loss reports merged."""
    loss_min: float = math.inf
    loss_sum: float = 0.0
    loss_max: float = -math.inf
    tps_sum: float = 0.0
    tps_count: int = 0
    val_count: int = 0
    val_min: float = math.inf
    val_sum: float = 0.0
    val_max: float = -math.inf

    @property
    def loss(self) -> float | None:
        """Mean loss of the row (None: only validation losses were reported in it)."""
        return self.loss_sum / self.count if self.count else None

    @property
    def val_loss(self) -> float | None:
        return self.val_sum / self.val_count if self.val_count else None

    @property
    def tokens_per_second(self) -> float | None:
        return self.tps_sum / self.tps_count if self.tps_count else None

    @property
    def step(self) -> float:
        """Where to draw the row: its step, or the middle of the steps its bucket holds."""
        return self.first if self.width == 1 else (self.first + self.last) / 2


def add_sample(row: Point | None, s: Sample) -> Point:
    """`row` (the row holding `s.step`, or None) with the sample merged in. A full-resolution row of an older
    plan epoch is replaced (the step was trained again after a rollback); otherwise reports add up (several
    replica groups report the same step in outer mode; a bucket takes whatever falls into it)."""
    if row is None or (row.width == 1 and s.epoch > row.epoch):
        row = Point(first=s.step, epoch=s.epoch, last=s.step)
    return merge(row, _point(s, row.first, row.width))


def _point(s: Sample, first: int, width: int) -> Point:
    p = Point(first=first, width=width, epoch=s.epoch, last=s.step)
    if s.loss is not None and math.isfinite(s.loss):
        p = replace(p, count=1, loss_min=s.loss, loss_sum=s.loss, loss_max=s.loss)
    if s.tokens_per_second is not None and s.tokens_per_second > 0:
        p = replace(p, tps_sum=s.tokens_per_second, tps_count=1)
    if s.val_loss is not None and math.isfinite(s.val_loss):
        p = replace(p, val_count=1, val_min=s.val_loss, val_sum=s.val_loss, val_max=s.val_loss)
    return p


def merge(a: Point, b: Point) -> Point:
    """One row holding both (`a`'s range; the caller makes sure it covers `b`'s)."""
    return Point(first=a.first, width=a.width, epoch=max(a.epoch, b.epoch), last=max(a.last, b.last),
                 count=a.count + b.count, loss_min=min(a.loss_min, b.loss_min), loss_sum=a.loss_sum + b.loss_sum,
                 loss_max=max(a.loss_max, b.loss_max), tps_sum=a.tps_sum + b.tps_sum,
                 tps_count=a.tps_count + b.tps_count, val_count=a.val_count + b.val_count,
                 val_min=min(a.val_min, b.val_min), val_sum=a.val_sum + b.val_sum, val_max=max(a.val_max, b.val_max))


def needs_compaction(full_rows: int, keep_full: int = KEEP_FULL) -> bool:
    """Whether the full-resolution rows have grown enough past `keep_full` to merge the oldest (a quarter of
    `keep_full` more, so the merge runs once every so many steps rather than at every one)."""
    return full_rows > keep_full + max(1, keep_full // 4)


def compact(rows: Sequence[Point], *, keep_full: int = KEEP_FULL, max_buckets: int = MAX_BUCKETS) -> list[Point]:
    """The history with every full-resolution row but the newest `keep_full` merged into buckets.

    Buckets start at multiples of their width (at least 2), so merging two neighbours when the width doubles
    gives a bucket of the doubled width; the width doubles until at most `max_buckets` remain.
    """
    if keep_full < 1 or max_buckets < 1:
        raise ValueError(f"keep_full and max_buckets must be >= 1, got {keep_full}, {max_buckets}")
    rows = sorted(rows, key=lambda r: r.first)
    full = [r for r in rows if r.width == 1]
    buckets = [r for r in rows if r.width > 1]
    if len(full) <= keep_full and len(buckets) <= max_buckets:
        return rows
    old, recent = full[:-keep_full] if len(full) > keep_full else [], full[-keep_full:]
    width = max([b.width for b in buckets], default=2)
    merged = _bucket(buckets + old, width)
    while len(merged) > max_buckets:
        width *= 2
        merged = _bucket(merged, width)
    # a bucket never reaches into the full-resolution steps: those stay one row per step
    if recent:
        newest_bucketed = max((b.first + b.width for b in merged), default=0)
        if newest_bucketed > recent[0].first:
            spill = [r for r in recent if r.first < newest_bucketed]
            recent = recent[len(spill):]
            merged = _bucket(merged + spill, width)
    return merged + recent


def _bucket(rows: Sequence[Point], width: int) -> list[Point]:
    out: dict[int, Point] = {}
    for r in sorted(rows, key=lambda r: r.first):
        key = r.first // width * width
        moved = replace(r, first=key, width=width)
        out[key] = merge(out[key], moved) if key in out else moved
    return [out[k] for k in sorted(out)]


def resolution(rows: Sequence[Point]) -> str:
    """How the history is held, in words: which steps are per step and which in buckets of how many."""
    if not rows:
        return "no steps recorded yet"
    rows = sorted(rows, key=lambda r: r.first)
    full = [r for r in rows if r.width == 1]
    buckets = [r for r in rows if r.width > 1]
    parts = []
    if buckets:
        parts.append(f"steps {buckets[0].first}-{buckets[-1].last} in {len(buckets)} buckets of "
                     f"{buckets[-1].width} steps (min/mean/max)")
    if full:
        parts.append(f"steps {full[0].first}-{full[-1].last} every step")
    return "; ".join(parts) + f" ({len(rows)} rows)"


def downsample(rows: Sequence[Point], most: int) -> list[Point]:
    """At most `most` rows covering the same steps: neighbours merged into spans of equal numbers of steps (so a
    line drawn from them is even in steps, whatever mix of single steps and buckets they came from; the min and
    max survive)."""
    rows = sorted(rows, key=lambda r: r.first)
    if most < 1:
        raise ValueError(f"most must be >= 1, got {most}")
    if len(rows) <= most:
        return list(rows)
    start, end = rows[0].first, max(r.first + r.width for r in rows)
    span = math.ceil((end - start) / most)
    groups: dict[int, list[Point]] = {}
    for r in rows:
        groups.setdefault((r.first - start) // span, []).append(r)
    out = []
    for group in groups.values():
        acc = replace(group[0], width=group[-1].first + group[-1].width - group[0].first)
        for r in group[1:]:
            acc = merge(acc, r)
        out.append(acc)
    return out


_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float | None], width: int = 60) -> str:
    """`values` (oldest first) as one line of block characters, `width` at most (evenly sampled means);
    a gap (None) is a space."""
    vals = list(values)
    if not vals:
        return ""
    if len(vals) > width:
        per = len(vals) / width
        cells = []
        for i in range(width):
            part = [v for v in vals[int(i * per):max(int((i + 1) * per), int(i * per) + 1)] if v is not None]
            cells.append(sum(part) / len(part) if part else None)
        vals = cells
    finite = [v for v in vals if v is not None and math.isfinite(v)]
    if not finite:
        return " " * len(vals)
    lo, hi = min(finite), max(finite)
    span = hi - lo
    out = []
    for v in vals:
        if v is None or not math.isfinite(v):
            out.append(" ")
        else:
            out.append(_BARS[min(len(_BARS) - 1, int((v - lo) / span * len(_BARS))) if span > 0 else 0])
    return "".join(out)


def draw_history(rows: Sequence[Point], path: str | Path, *, title: str = "loss") -> Path:
    """The whole history as a PNG: the mean loss per row, the min-max band of bucketed rows, and the
    validation loss where reported."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r.first)
    loss = [r for r in rows if r.loss is not None]
    val = [r for r in rows if r.val_loss is not None]
    if not loss and not val:
        raise ValueError("the history holds no loss yet: nothing to draw (ask again once steps are reported)")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if loss:
        xs = [r.step for r in loss]
        ax.plot(xs, [r.loss for r in loss], label="loss", color="#4c9be8", linewidth=1.2)
        if any(r.width > 1 for r in loss):
            ax.fill_between(xs, [r.loss_min for r in loss], [r.loss_max for r in loss], color="#4c9be8",
                            alpha=0.2, linewidth=0, label="min-max of merged steps")
    if val:
        ax.plot([r.step for r in val], [r.val_loss for r in val], label="validation loss", color="#f28e2b",
                marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross entropy, nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(Path(path), buf.getvalue())
    return Path(path)


def sample_of(m: StepMetrics, tokens_per_step: int) -> Sample | None:
    """A step report's part of the history, or None when it carries neither a loss nor a validation loss.

    Its tokens/s is the job's tokens per step over the reporting node's step time (in outer mode, one replica
    group's rate: each group reports its own steps)."""
    if m.loss is None and m.val_loss is None:
        return None
    tps = tokens_per_step / m.step_seconds if m.loss is not None and m.step_seconds > 0 else None
    return Sample(step=m.step, epoch=m.plan_epoch, loss=m.loss, tokens_per_second=tps, val_loss=m.val_loss)


def to_proto(p: Point) -> pb.LossPoint:
    def finite(x: float) -> float:
        return x if math.isfinite(x) else 0.0

    return pb.LossPoint(first_step=p.first, last_step=p.last, width=p.width, count=p.count,
                        loss=p.loss or 0.0, loss_min=finite(p.loss_min), loss_max=finite(p.loss_max),
                        tokens_per_second=p.tokens_per_second or 0.0, has_val_loss=p.val_count > 0,
                        val_loss=p.val_loss or 0.0, val_loss_min=finite(p.val_min), val_loss_max=finite(p.val_max))


def from_proto(m: pb.LossPoint) -> Point:
    """The point as the status client sees it (means are exact; the sums behind them are rebuilt from them,
    and a point's several validation reports count as one)."""
    p = Point(first=m.first_step, width=max(1, m.width), last=m.last_step)
    if m.count:
        p = replace(p, count=m.count, loss_min=m.loss_min, loss_sum=m.loss * m.count, loss_max=m.loss_max)
    if m.tokens_per_second > 0:
        p = replace(p, tps_sum=m.tokens_per_second, tps_count=1)
    if m.has_val_loss:
        p = replace(p, val_count=1, val_min=m.val_loss_min, val_sum=m.val_loss, val_max=m.val_loss_max)
    return p


STATUS_POINTS = 120
"""History points in a StatusReply unless the request asks for another number: enough for a sparkline."""


def fill_status(reply: pb.StatusReply, rows: Sequence[Point], points: int = 0) -> None:
    """Put the history into a StatusReply: at most `points` points (0: STATUS_POINTS), how it is held, and
    how many rows the store holds."""
    reply.history.extend(to_proto(p) for p in downsample(rows, points or STATUS_POINTS))
    reply.history_resolution = resolution(rows)
    reply.history_rows = len(rows)
