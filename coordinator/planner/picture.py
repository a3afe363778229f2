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
from atoll.units import counted

KIND_COLOR = {"F": "#4c9be8", "B": "#f28e2b", "W": "#edc948", "sync": "#59a14f", "opt": "#9c755f"}
KIND_NAME = {"F": "forward", "B": "backward", "W": "weight gradients (deferred)", "sync": "all-reduce",
             "opt": "optimizer"}
ROUND_COLOR = {"inner": "#4c9be8", "outer": "#e15759"}


def pipeline_order(plan: Plan, islands: list | None = None) -> list:
    """`islands` (default: the plan's) in the order the pipelines run through them: pipeline 0's stages first,
    then each further pipeline's new islands, then those no stage uses. Drawn in this order, every link of a
    pipeline points right (or down, inside one island), so no arrow crosses another."""
    islands = list(plan.islands) if islands is None else islands
    by_id = {i.id: i for i in islands}
    order = list(dict.fromkeys(s.island for pipe in plan.pipelines for s in pipe.stages if s.island in by_id))
    return [by_id[i] for i in order] + [i for i in islands if i.id not in order]


def _islands_row(ax: Any, plan: Plan, islands: list, x0: float, width: float, y0: float, height: float,
                 palette: Any, devices: list[str], boxes: dict[tuple[int, int], Any]) -> None:
    """Island boxes side by side in [x0, x0 + width], in pipeline order, each holding the stages it hosts
    (their text boxes go into `boxes`)."""
    from matplotlib.patches import Rectangle

    hosted: dict[str, list[tuple[int, int]]] = {}
    for pk, pipe in enumerate(plan.pipelines):
        for sk, s in enumerate(pipe.stages):
            hosted.setdefault(s.island, []).append((pk, sk))
    islands = pipeline_order(plan, islands)
    total = sum(i.gpus for i in islands) or 1
    shares = [max(i.gpus / total, 0.08) for i in islands]
    scale = width / sum(shares)
    x = x0
    for isl, share in zip(islands, shares):
        w = share * scale
        mine = hosted.get(isl.id, [])
        ax.add_patch(Rectangle((x, y0), w * 0.95, height, facecolor=palette(devices.index(isl.device)),
                               alpha=0.25 if mine else 0.08, edgecolor="black" if mine else "#999999",
                               hatch=None if mine else "//"))
        ax.text(x + 0.01, y0 + height - 0.02, f"{isl.id}\n{isl.gpus} x {isl.device}" + ("" if mine else "\nunused"),
                va="top", fontsize=8, color="black" if mine else "#666666")
        # stages stacked below the island's label, one slot each; crowded islands get one-line labels
        top, bottom = y0 + height * 0.78, y0 + height * 0.04
        slot = (top - bottom) / max(1, len(mine))
        for n, (pk, sk) in enumerate(mine):
            s = plan.pipelines[pk].stages[sk]
            name = f"stage {sk}" if len(plan.pipelines) == 1 else f"pipeline {pk} stage {sk}"
            sep = "\n" if len(mine) <= 2 else ", "
            label = (f"{name}: layers [{s.layers[0]}, {s.layers[1]}){sep}dp {s.dp} x tp {s.tp}, zero {s.zero}"
                     + (f", {s.lanes} lanes" if s.lanes > 1 else "")
                     + (", recompute" if s.recompute else
                        f", recompute {len(s.recompute_layers)} blocks" if s.recompute_layers else ""))
            boxes[(pk, sk)] = ax.text(x + w * 0.47, top - slot * (n + 0.5), label, ha="center", va="center",
                                      fontsize=7 if len(mine) <= 2 else 6.5,
                                      bbox={"boxstyle": "round,pad=0.3", "facecolor": "white"})
        x += w


def _stage_arrows(ax: Any, plan: Plan, boxes: dict[tuple[int, int], Any]) -> None:
    """An arrow from each stage to the next, its codec written beside it: straight when the next stage is to
    the right or below (islands are drawn in pipeline order), an arc otherwise. Called once the layout is
    final: arrows are clipped to the stages' boxes, and an arc's label sits at its drawn midpoint."""
    import numpy as np
    from matplotlib.patches import FancyArrowPatch

    ax.figure.canvas.draw()  # places the text boxes the arrows are clipped to
    to_data = ax.transData.inverted()
    for pk, pipe in enumerate(plan.pipelines):
        for sk in range(len(pipe.stages) - 1):
            ta, tb = boxes[(pk, sk)], boxes[(pk, sk + 1)]
            a, b = ta.get_position(), tb.get_position()
            forward = b[0] > a[0] + 1e-6 or (abs(b[0] - a[0]) <= 1e-6 and b[1] < a[1])
            rad = 0.0 if forward else 0.35
            ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=12, color="black", linewidth=1.2,
                                         connectionstyle=f"arc3,rad={rad}", patchA=ta.get_bbox_patch(),
                                         patchB=tb.get_bbox_patch(), zorder=4))
            send = pipe.stages[sk].send
            if send is None:
                continue
            label = f"{send.codec}, {send.seconds * 1e3:.0f} ms" if send.seconds > 0 else send.codec
            da, db = ax.transData.transform(a), ax.transData.transform(b)
            dx, dy = db - da
            mid = (da + db) / 2
            if rad:  # arc3's control point is mid + rad (dy, -dx); the curve passes halfway to it
                mid = mid + rad / 2 * np.array([dy, -dx])
            vertical = abs(dx) < abs(dy)
            ax.annotate(label, to_data.transform(mid), xytext=(5, 0) if vertical else (0, 4),
                        textcoords="offset points", ha="left" if vertical else "center",
                        va="center" if vertical else "bottom", fontsize=7, color="darkred", zorder=5,
                        bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none",
                              "alpha": 0.8})


def _outer_label(plan: Plan) -> str:
    o = plan.outer
    assert o is not None
    codec = o.codec + (f" {o.topk_fraction:.3g}" if o.codec in ("topk", "sparse2") else "")
    return (f"outer sync every H={o.inner_steps} inner steps: {codec}, {format_bytes(o.bytes_per_round)} per group "
            f"per round, {o.sync_s:.1f} s vs rounds of {o.round_s:.1f} s"
            + (" (overlapped)" if o.overlap else " (blocking)"))


def _groups_row(ax: Any, plan: Plan, palette: Any, devices: list[str], boxes: dict[tuple[int, int], Any]) -> None:
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
    centers: list[float] = []
    for g, m, share in zip(plan.groups, members, shares):
        w = share * scale
        ax.add_patch(Rectangle((x, 0.01), w, 0.72, facecolor="none", edgecolor="#333333", linewidth=1.6,
                               linestyle="--"))
        ax.text(x + w / 2, 0.71, f"group {g.name}\n{g.inner_steps} steps of {g.step_time_s:.1f} s per round\n"
                f"{g.tokens_per_s:,.0f} tok/s", ha="center", va="top", fontsize=7, fontweight="bold")
        _islands_row(ax, plan, m, x + 0.01, w - 0.02, 0.03, 0.56, palette, devices, boxes)
        centers.append(x + w / 2)
        x += w + gap
    # every group exchanges with every other: a bus above the boxes, one two-headed arrow per group, the
    # settings written once above the bus (inside the axes, clear of the titles)
    bus = 0.83
    ax.plot([centers[0], centers[-1]], [bus, bus], color="#e15759", linewidth=2.2, solid_capstyle="round")
    for c in centers:
        ax.add_patch(FancyArrowPatch((c, 0.735), (c, bus), arrowstyle="<|-|>", mutation_scale=12, color="#e15759",
                                     linewidth=1.8, shrinkA=0, shrinkB=0))
    ax.text(0.5, bus + 0.025, _outer_label(plan), ha="center", va="bottom", fontsize=8.5, color="#b2182b",
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
    # MFU needs the devices' peak FLOP/s, which CPUs and devices known only by their profile lack
    mfu = f", MFU {plan.predicted.mfu:.0%}" if plan.predicted.mfu > 0 else ""
    title = f"{plan.model}: {plan.predicted.tokens_per_s:,.0f} tokens/s, step {plan.predicted.step_time_s:.2f} s{mfu}"
    if outer:
        title = (f"{plan.model}, outer mode: {len(plan.groups)} replica groups, {plan.predicted.tokens_per_s:,.0f} "
                 f"tokens/s in all (outer-mode tokens){mfu}")
    fig.suptitle(title, fontsize=11)

    palette = plt.get_cmap("tab10")
    devices = list(dict.fromkeys(i.device for i in plan.islands))
    boxes: dict[tuple[int, int], Any] = {}
    if outer:
        _groups_row(top, plan, palette, devices, boxes)
        top.set_title(f"replica groups (one per region) and {len(plan.pipelines)} pipeline(s)", fontsize=9)
        _rounds(middle, plan)
    else:
        _islands_row(top, plan, list(plan.islands), 0.0, 1.0, 0.02, 0.96, palette, devices, boxes)
        top.set_title(f"islands in pipeline order and {len(plan.pipelines)} pipeline(s); timeline of pipeline 0 "
                      f"({counted(len(pl.stages), 'stage')}, {counted(pl.num_micro_batches, 'micro-batch', 'micro-batches')})", fontsize=9)
    top.set_xlim(0, 1)
    top.set_ylim(0, 1)
    top.axis("off")

    for e in sim.events:
        if e.end <= e.start:
            continue
        # a laned stage's row is split into a thin bar per lane (sync and optimizer span the row)
        lanes = pl.stages[e.stage].lanes if e.kind in ("F", "B", "W") else 1
        h = 0.8 / lanes
        bottom.barh(e.stage - 0.4 + h * (e.lane + 0.5) if lanes > 1 else e.stage, e.end - e.start, height=h,
                    left=e.start, color=KIND_COLOR[e.kind], edgecolor="white", linewidth=0.3)
    bottom.set_yticks(range(len(pl.stages)), [f"stage {k}\n{s.island}" + (f"\n{s.lanes} lanes" if s.lanes > 1 else "")
                                              for k, s in enumerate(pl.stages)], fontsize=7)
    bottom.invert_yaxis()
    bottom.set_xlabel("seconds")
    which = f" of pipeline 0 (group {plan.groups[0].name})" if outer else ""
    kinds = [k for k in KIND_COLOR if any(e.kind == k for e in sim.events)]
    zb = " with deferred weight gradients (zero-bubble)" if "W" in kinds else ""
    bottom.set_title(f"1F1B timeline of one step{which}{zb} (simulated): "
                     f"{', '.join(KIND_NAME[k] for k in kinds)}", fontsize=9)
    handles = [Rectangle((0, 0), 1, 1, color=KIND_COLOR[k]) for k in kinds]
    bottom.legend(handles, [KIND_NAME[k] for k in kinds], loc="lower right", fontsize=7)
    fig.tight_layout()
    _stage_arrows(top, plan, boxes)  # after the layout: it measures the drawn boxes
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write(Path(path), lambda f: f.write(buf.getvalue()))
