"""The plan as a picture (PNG): islands and the pipeline's stages on top, a 1F1B timeline of one step below.

In outer mode the top shows a box per replica group (its region) holding its islands and their stages, and
the outer sync between the groups (codec, H, bytes per round and seconds); a row of rounds (each group's
inner steps and the exchange overlapped with the next round) sits between it and the 1F1B timeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from atoll.coordinator.planner.outer import format_bytes
from atoll.coordinator.planner.simulator import PipelineTimes, simulate, simulate_outer
from atoll.fsutil import atomic_write
from atoll.plan import Plan

KIND_COLOR = {"F": "#4c9be8", "B": "#f28e2b", "sync": "#59a14f", "opt": "#9c755f"}
ROUND_COLOR = {"inner": "#4c9be8", "outer": "#e15759"}


def _islands_row(ax: Any, plan: Plan, islands: list, x0: float, width: float, y0: float, height: float,
                 palette: Any, devices: list[str], centers: dict[tuple[int, int], tuple[float, float]]) -> None:
    """Island boxes side by side in [x0, x0 + width], each holding the stages it hosts."""
    from matplotlib.patches import Rectangle

    hosted: dict[str, list[tuple[int, int]]] = {}
    for pk, pipe in enumerate(plan.pipelines):
        for sk, s in enumerate(pipe.stages):
            hosted.setdefault(s.island, []).append((pk, sk))
    total = sum(i.gpus for i in islands) or 1
    shares = [max(i.gpus / total, 0.08) for i in islands]
    scale = width / sum(shares)
    x = x0
    for isl, share in zip(islands, shares):
        w = share * scale
        ax.add_patch(Rectangle((x, y0), w * 0.95, height, facecolor=palette(devices.index(isl.device)), alpha=0.25,
                               edgecolor="black"))
        ax.text(x + 0.01, y0 + height - 0.02, f"{isl.id}\n{isl.gpus} x {isl.device}", va="top", fontsize=8)
        mine = hosted.get(isl.id, [])
        for n, (pk, sk) in enumerate(mine):
            s = plan.pipelines[pk].stages[sk]
            cy = y0 + height * (0.66 - 0.6 * n / max(1, len(mine)))
            cx = x + w * 0.47
            name = f"stage {sk}" if len(plan.pipelines) == 1 else f"pipeline {pk} stage {sk}"
            ax.text(cx, cy, f"{name}: layers [{s.layers[0]}, {s.layers[1]})\ndp {s.dp}, zero {s.zero}"
                    + (", recompute" if s.recompute else ""), ha="center", va="center", fontsize=7,
                    bbox={"boxstyle": "round", "facecolor": "white"})
            centers[(pk, sk)] = (cx, cy)
        x += w


def _stage_arrows(ax: Any, plan: Plan, centers: dict[tuple[int, int], tuple[float, float]]) -> None:
    from matplotlib.patches import FancyArrowPatch

    for pk, pipe in enumerate(plan.pipelines):
        for sk in range(len(pipe.stages) - 1):
            a, b = centers[(pk, sk)], centers[(pk, sk + 1)]
            ax.add_patch(FancyArrowPatch(a, b, arrowstyle="->", mutation_scale=12, color="black",
                                         connectionstyle="arc3,rad=0.3"))
            send = pipe.stages[sk].send
            if send is not None:
                ax.text((a[0] + b[0]) / 2, min(a[1], b[1]) - 0.08, send.codec, fontsize=7, ha="center",
                        color="darkred")


def _outer_label(plan: Plan) -> str:
    o = plan.outer
    assert o is not None
    codec = o.codec + (f" {o.topk_fraction:.3g}" if o.codec == "topk" else "")
    return (f"outer sync every H={o.inner_steps} inner steps: {codec}, {format_bytes(o.bytes_per_round)} per group "
            f"per round, {o.sync_s:.1f} s vs rounds of {o.round_s:.1f} s"
            + (" (overlapped)" if o.overlap else " (blocking)"))


def _groups_row(ax: Any, plan: Plan, palette: Any, devices: list[str],
                centers: dict[tuple[int, int], tuple[float, float]]) -> None:
    """A box per replica group holding its islands, and the outer sync between the groups."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    by_id = {i.id: i for i in plan.islands}
    members: list[list] = []
    for g in plan.groups:
        ids = list(dict.fromkeys(s.island for k in g.pipelines for s in plan.pipelines[k].stages))
        members.append([by_id[i] for i in ids if i in by_id])
    gpus = [sum(i.gpus for i in m) or 1 for m in members]
    shares = [max(n / sum(gpus), 0.15) for n in gpus]
    gap = 0.06
    scale = (1 - gap * (len(shares) - 1)) / sum(shares)
    x = 0.0
    boxes: list[tuple[float, float]] = []
    for g, m, share in zip(plan.groups, members, shares):
        w = share * scale
        ax.add_patch(Rectangle((x, 0.01), w, 0.74, facecolor="none", edgecolor="#333333", linewidth=1.6,
                               linestyle="--"))
        ax.text(x + w / 2, 0.74, f"group {g.name}\n{g.inner_steps} steps of {g.step_time_s:.1f} s per round, "
                f"{g.tokens_per_s:,.0f} tok/s", ha="center", va="top", fontsize=7.5, fontweight="bold")
        _islands_row(ax, plan, m, x + 0.01, w - 0.02, 0.03, 0.57, palette, devices, centers)
        boxes.append((x, w))
        x += w + gap
    # the exchange runs between every pair of groups: arcs above the boxes, the settings written once
    for a in range(len(boxes)):
        for b in range(a + 1, len(boxes)):
            xa = boxes[a][0] + boxes[a][1] * 0.5
            xb = boxes[b][0] + boxes[b][1] * 0.5
            rad = -0.08 - 0.03 * (b - a - 1)
            ax.add_patch(FancyArrowPatch((xa, 0.755), (xb, 0.755), arrowstyle="<|-|>", mutation_scale=14,
                                         color="#e15759", linewidth=1.8, connectionstyle=f"arc3,rad={rad}"))
    ax.text(0.5, 1.0, _outer_label(plan), ha="center", va="top", fontsize=8.5, color="#b2182b",
            bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "#e15759"})


def _rounds(ax: Any, plan: Plan) -> None:
    """Three rounds of every group's inner steps and the exchanges between them."""
    from matplotlib.patches import Rectangle

    o = plan.outer
    assert o is not None
    sim = simulate_outer([g.step_time_s for g in plan.groups], [g.inner_steps for g in plan.groups], o.sync_s,
                         overlap=o.overlap, rounds=4, record=True)
    n = len(plan.groups)
    for e in sim.events:
        if e.micro_batch > 2 or e.end <= e.start:
            continue
        ax.barh(e.stage, e.end - e.start, left=e.start, color=ROUND_COLOR[e.kind], edgecolor="white", linewidth=0.6)
        ax.text((e.start + e.end) / 2, e.stage, f"round {e.micro_batch}", ha="center", va="center", fontsize=7,
                color="white")
    ax.set_yticks(range(n + 1), [f"{g.name}\n{g.inner_steps} x {g.step_time_s:.1f} s" for g in plan.groups]
                  + ["outer sync"], fontsize=7)
    ax.set_xlim(0, 1.3 * max(e.end for e in sim.events if e.micro_batch <= 2))
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"outer rounds (simulated): inner steps of each group, and each round's exchange "
                 f"({'overlapped with the next round' if o.overlap else 'blocking'})", fontsize=9)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in ROUND_COLOR.values()]
    ax.legend(handles, ["inner steps", "pseudo-gradient exchange"], loc="upper right", fontsize=7)


def draw_plan(plan: Plan, times: PipelineTimes, path: str | Path) -> None:
    """Write the picture of `plan` (with `times`, its first pipeline's simulated stage times) to `path`."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    pl = plan.pipelines[0]
    sim = simulate(times, record=True)
    outer = plan.mode == "outer" and plan.outer is not None and bool(plan.groups)
    if outer:
        fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(13, 10),
                                                  gridspec_kw={"height_ratios": [1.6, 0.7, 1.0]})
    else:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7.5), gridspec_kw={"height_ratios": [1, 1.4]})
    title = (f"{plan.model}: {plan.predicted.tokens_per_s:,.0f} tokens/s, step {plan.predicted.step_time_s:.2f} s, "
             f"MFU {plan.predicted.mfu:.0%}")
    if outer:
        title = (f"{plan.model}, outer mode: {len(plan.groups)} replica groups, {plan.predicted.tokens_per_s:,.0f} "
                 f"tokens/s in all (outer-mode tokens), MFU {plan.predicted.mfu:.0%}")
    fig.suptitle(title, fontsize=11)

    palette = plt.get_cmap("tab10")
    devices = list(dict.fromkeys(i.device for i in plan.islands))
    centers: dict[tuple[int, int], tuple[float, float]] = {}
    if outer:
        _groups_row(top, plan, palette, devices, centers)
        top.set_title(f"replica groups (one per region) and {len(plan.pipelines)} pipeline(s)", fontsize=9)
        top.set_xlim(0, 1)
        _rounds(middle, plan)
    else:
        _islands_row(top, plan, list(plan.islands), 0.0, 1.0, 0.02, 0.96, palette, devices, centers)
        top.set_title(f"islands and {len(plan.pipelines)} pipeline(s); timeline of pipeline 0 "
                      f"({len(pl.stages)} stages, {pl.num_micro_batches} micro-batches)", fontsize=9)
        top.set_xlim(0, 1)
    _stage_arrows(top, plan, centers)
    top.set_ylim(0, 1)
    top.axis("off")

    for e in sim.events:
        if e.end <= e.start:
            continue
        bottom.barh(e.stage, e.end - e.start, left=e.start, color=KIND_COLOR[e.kind], edgecolor="white", linewidth=0.3)
    bottom.set_yticks(range(len(pl.stages)), [f"stage {k}\n{s.island}" for k, s in enumerate(pl.stages)], fontsize=7)
    bottom.invert_yaxis()
    bottom.set_xlabel("seconds")
    which = f" of pipeline 0 (group {plan.groups[0].name})" if outer else ""
    bottom.set_title(f"1F1B timeline of one step{which} (simulated): forward, backward, all-reduce, optimizer",
                     fontsize=9)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLOR.values()]
    bottom.legend(handles, ["forward", "backward", "all-reduce", "optimizer"], loc="lower right", fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write(Path(path), lambda f: f.write(buf.getvalue()))
