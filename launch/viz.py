"""Pictures a person would rather look at than read: the loss curve and the plan."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from atoll.fsutil import atomic_write_bytes
from atoll.modelspec import ModelSpec
from atoll.plan import Plan


def draw_loss_curve(steps: Sequence[int], losses: Sequence[float], path: str | Path, *, title: str = "loss",
                    reference: Sequence[float] | None = None) -> Path:
    """Loss per step as a PNG (with an optional reference curve, e.g. the same job in one process)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(list(steps), list(losses), label="distributed", color="#4c9be8")
    if reference is not None:
        ax.plot(range(len(reference)), list(reference), label="one process", color="#f28e2b", linestyle="--")
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


def draw_plan_picture(plan: Plan, model: ModelSpec, path: str | Path) -> Path:
    """The plan's islands and pipelines, and a simulated 1F1B timeline of one step of its first pipeline: the
    simulation the planner predicted the step time with (its times travel in the plan), as `atoll plan --picture`
    draws it."""
    from atoll.coordinator.planner.picture import draw_plan
    from atoll.coordinator.planner.simulator import LinkTimes, PipelineTimes, StageTimes, plan_pipeline_times

    times = plan_pipeline_times(plan, 0)
    if times is None:  # the coordinator's fallback plan: no simulation behind it, only each stage's compute
        pipe = plan.pipelines[0]
        # a stage's predicted compute is forward + backward; backward costs about twice the forward
        stages = tuple(StageTimes(forward_s=s.compute_s / 3, backward_s=2 * s.compute_s / 3) for s in pipe.stages)
        links = tuple(LinkTimes(forward_s=s.send.seconds if s.send else 0.0,
                                backward_s=s.send.seconds if s.send else 0.0) for s in pipe.stages[:-1])
        times = PipelineTimes(stages=stages, links=links, num_micro_batches=pipe.num_micro_batches)
    draw_plan(plan, times, path)
    return Path(path)
