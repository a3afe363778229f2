"""The plan as a picture (PNG): islands and the pipeline's stages on top, a 1F1B timeline of one step below."""

from __future__ import annotations

from pathlib import Path

from atoll.coordinator.planner.simulator import PipelineTimes, simulate
from atoll.fsutil import atomic_write
from atoll.plan import Plan

KIND_COLOR = {"F": "#4c9be8", "B": "#f28e2b", "sync": "#59a14f", "opt": "#9c755f"}


def draw_plan(plan: Plan, times: PipelineTimes, path: str | Path) -> None:
    """Write the picture of `plan` (with `times`, its first pipeline's simulated stage times) to `path`."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    pl = plan.pipelines[0]
    sim = simulate(times, record=True)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7.5), gridspec_kw={"height_ratios": [1, 1.4]})
    fig.suptitle(f"{plan.model}: {plan.predicted.tokens_per_s:,.0f} tokens/s, step {plan.predicted.step_time_s:.2f} s, "
                 f"MFU {plan.predicted.mfu:.0%}", fontsize=11)

    # islands as boxes, width by GPUs; the stages each island hosts drawn inside it, for every pipeline
    palette = plt.get_cmap("tab10")
    devices = list(dict.fromkeys(i.device for i in plan.islands))
    total = sum(i.gpus for i in plan.islands)
    hosted: dict[str, list[tuple[int, int]]] = {}
    for pk, pipe in enumerate(plan.pipelines):
        for sk, s in enumerate(pipe.stages):
            hosted.setdefault(s.island, []).append((pk, sk))
    x = 0.0
    centers: dict[tuple[int, int], tuple[float, float]] = {}
    for isl in plan.islands:
        w = max(isl.gpus / total, 0.08)
        top.add_patch(Rectangle((x, 0.02), w * 0.95, 0.96, facecolor=palette(devices.index(isl.device)), alpha=0.25,
                                edgecolor="black"))
        top.text(x + 0.01, 0.95, f"{isl.id}\n{isl.gpus} x {isl.device}", va="top", fontsize=8)
        mine = hosted.get(isl.id, [])
        for n, (pk, sk) in enumerate(mine):
            s = plan.pipelines[pk].stages[sk]
            cy = 0.68 - 0.6 * n / max(1, len(mine))
            cx = x + w * 0.47
            name = f"stage {sk}" if len(plan.pipelines) == 1 else f"pipeline {pk} stage {sk}"
            top.text(cx, cy, f"{name}: layers [{s.layers[0]}, {s.layers[1]})\ndp {s.dp}, zero {s.zero}"
                     + (", recompute" if s.recompute else ""), ha="center", va="center", fontsize=7,
                     bbox={"boxstyle": "round", "facecolor": "white"})
            centers[(pk, sk)] = (cx, cy)
        x += w
    for pk, pipe in enumerate(plan.pipelines):
        for sk in range(len(pipe.stages) - 1):
            a, b = centers[(pk, sk)], centers[(pk, sk + 1)]
            top.add_patch(FancyArrowPatch(a, b, arrowstyle="->", mutation_scale=12, color="black",
                                          connectionstyle="arc3,rad=0.3"))
            send = pipe.stages[sk].send
            if send is not None:
                top.text((a[0] + b[0]) / 2, min(a[1], b[1]) - 0.08, send.codec, fontsize=7, ha="center",
                         color="darkred")
    top.set_xlim(0, max(1.0, x))
    top.set_ylim(0, 1)
    top.axis("off")
    top.set_title(f"islands and {len(plan.pipelines)} pipeline(s); timeline of pipeline 0 "
                  f"({len(pl.stages)} stages, {pl.num_micro_batches} micro-batches)", fontsize=9)

    for e in sim.events:
        if e.end <= e.start:
            continue
        bottom.barh(e.stage, e.end - e.start, left=e.start, color=KIND_COLOR[e.kind], edgecolor="white", linewidth=0.3)
    bottom.set_yticks(range(len(pl.stages)), [f"stage {k}\n{s.island}" for k, s in enumerate(pl.stages)], fontsize=7)
    bottom.invert_yaxis()
    bottom.set_xlabel("seconds")
    bottom.set_title("1F1B timeline of one step (simulated): forward, backward, all-reduce, optimizer", fontsize=9)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLOR.values()]
    bottom.legend(handles, ["forward", "backward", "all-reduce", "optimizer"], loc="lower right", fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write(Path(path), lambda f: f.write(buf.getvalue()))
