"""A plan as readable text: islands, pipelines and stages, predicted throughput and the bottleneck; in outer
mode also the replica groups and the outer sync between them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from atoll.compression.errors import CodecError
from atoll.compression.losscost import WAN_CANDIDATES, loss_cost, table
from atoll.compression.spec import DEFAULT_BLOCK_SIZE, CodecSpec
from atoll.compression.tensor import get_codec
from atoll.coordinator.planner.cluster import GBPS, Cluster
from atoll.coordinator.planner.outer import OUTER_TOKEN_NOTE, format_bytes
from atoll.coordinator.planner.unused import UnusedIsland
from atoll.plan import Plan, StagePlan
from atoll.units import counted, duration


def device_word(kinds: Iterable[str]) -> str:
    """What to call devices of these kinds ("cpu", "cuda", ...): CPUs, GPUs, or devices when mixed or unknown."""
    kinds = set(kinds)
    if kinds == {"cpu"}:
        return "CPUs"
    if kinds == {"cuda"}:
        return "GPUs"
    return "devices"


def format_plan(plan: Plan, cluster: Cluster | None = None, *, search_seconds: float | None = None,
                device_kinds: Iterable[str] | None = None, unused: Sequence[UnusedIsland] = (),
                width: int | None = None, elem_bytes: int = 4) -> str:
    """The plan as text. `device_kinds` names the kinds of the devices planned on (a cluster file's are GPUs);
    the devices left out are listed with their reasons from `plan.idle`, or, for a plan without them, from
    `unused` (`explain_unused`). `width` (d_model) and `elem_bytes` (of the boundary's dtype) give each
    boundary's codec ratio exactly (a low-rank codec's depends on the shape)."""
    p = plan.predicted
    if device_kinds is not None:
        devices = device_word(device_kinds)
    else:
        devices = "GPUs" if cluster is not None and cluster.source != "live" else "devices"
    gpus_used = sum(s.dp * s.tp for pl in plan.pipelines for s in pl.stages)
    total = sum(i.gpus for i in plan.islands)
    lines = [f"plan for {plan.model}: global batch {plan.global_batch} x {plan.seq_len} tokens, "
             f"{gpus_used} of {total} {devices}"]
    # MFU needs the devices' peak FLOP/s, which CPUs and devices known only by their profile lack
    mfu = f"   MFU {p.mfu:.1%}" if p.mfu > 0 else ""
    lines.append(f"  step {duration(p.step_time_s)}   {p.tokens_per_s:,.0f} tokens/s{mfu}")
    lines.append(f"  bottleneck: {p.bottleneck}")
    if search_seconds is not None:
        lines.append(f"  planned in {search_seconds:.2f} s")
    group_of: dict[int, str] = {}
    if plan.mode == "outer" and plan.outer is not None:
        o = plan.outer
        codec = o.codec + (f" {o.topk_fraction:.3g}" if o.codec in ("topk", "sparse2") else "")
        lines.append(f"  mode outer: {len(plan.groups)} replica groups, each training the whole global batch every "
                     f"inner step; tokens/s is their sum, and {OUTER_TOKEN_NOTE}")
        lines.append(f"  outer sync every H={o.inner_steps} inner steps: {codec} pseudo-gradients, "
                     f"{format_bytes(o.bytes_per_round)} per group per round in {o.sync_s:.1f} s against rounds of "
                     f"{o.round_s:.1f} s ({'overlapped' if o.overlap else 'blocking'}); outer lr {o.lr:g}, "
                     f"momentum {o.momentum:g}{' nesterov' if o.nesterov and o.momentum else ''}, "
                     f"deadline {o.deadline_s:.0f} s")
        lines.append(f"  reason: {o.reason}")
        lines.append("replica groups:")
        for g in plan.groups:
            lines.append(f"  {g.name:<16} pipelines {', '.join(map(str, g.pipelines)):<8} {g.inner_steps:>4} inner "
                         f"steps of {duration(g.step_time_s)} per round   {g.tokens_per_s:,.0f} tokens/s")
            for k in g.pipelines:
                group_of[k] = g.name
    lines.append("islands:")
    for i in plan.islands:
        region = f" region {cluster.island(i.id).region}" if cluster is not None else ""
        inner = f"inner {i.inner_bandwidth / GBPS:.0f} Gbit/s" if i.inner_bandwidth else "no link inside (one node)"
        lines.append(f"  {i.id:<16} {i.gpus:>5} x {i.device:<10}{region}  {inner}")
    lines += _unused_lines(plan, unused, devices)
    for k, pl in enumerate(plan.pipelines):
        owner = f", replica group {group_of[k]}" if k in group_of else ""
        zb = ("; weight gradients deferred where the wgrad column gives a depth (zero-bubble: backward "
              "computes what the previous stage waits for first; 'd of n': depth d, on only n of the stage's layers, "
              "as memory allows)") if any(s.defer_weights for s in pl.stages) else ""
        if any(s.in_flight for s in pl.stages):
            zb += ("; the warm column: extra forwards a stage runs before its first backward (a deep window behind "
                   "a slow link, or filling its wait for the first gradient)")
        if any(s.lanes > 1 for s in pl.stages):
            zb += ("; dp LxD: L lanes of D replicas, lane i % L taking micro-batch i (a stage wider than a "
                   "micro-batch has sequences, each lane at 1/L of the pace; compute is a lane's)")
        lines.append(f"pipeline {k}: {counted(len(pl.stages), 'stage')}, {counted(pl.num_micro_batches, 'micro-batch', 'micro-batches')} of "
                     f"{pl.micro_batch} sequences (each stage shares one among its dp replicas, as evenly as "
                     f"possible{owner}){zb}")
        lines.append(f"  {'stage':>5}  {'island':<16} {'layers':<10} {'dp x tp':>13} {'zero':>4} {'recomp':>6} "
                     f"{'wgrad':>8} {'warm':>4} {'compute':>9} {'mem/dev':>8}  send: codec, raw per micro-batch, ratio, transfer, stall, loss cost")
        for j, s in enumerate(pl.stages):
            send = "-"
            if s.send is not None:
                send = _boundary(s, pl.stages[j + 1] if j + 1 < len(pl.stages) else None, width, elem_bytes)
            lines.append(f"  {j:>5}  {s.island:<16} [{s.layers[0]}, {s.layers[1]})".ljust(36)
                         + f" {_shape(s):>13} {s.zero:>4} {_recomputed(s):>6} "
                         f"{_deferred(s):>8} {s.in_flight or '-':>4} "
                         f"{duration(s.compute_s):>9} {_gb(s.memory_gb_per_device):>8}  {send}")
    return "\n".join(lines)


def _boundary(s: StagePlan, after: StagePlan | None, width: int | None, elem_bytes: int) -> str:
    """A stage boundary: raw bytes per micro-batch, codec, ratio, transfer time, predicted stall (what the slower
    direction's transfer exceeds the compute of the slower side it overlaps, per micro-batch) and predicted loss
    cost (`atoll.compression.losscost`; '?' where unmeasured)."""
    send = s.send
    assert send is not None
    try:
        # a wide-area codec's rank and bits are the candidate's the planner timed (`losscost.WAN_CANDIDATES`)
        wide = {c.codec: c for c in WAN_CANDIDATES if c.codec in ("hadamard", "lowrank")}
        spec = wide.get(send.codec) or CodecSpec(send.codec, block_size=send.block_size or DEFAULT_BLOCK_SIZE,
                                                  zstd_level=send.zstd_level,
                                                  **({"topk_fraction": send.topk_fraction} if send.topk_fraction else {}))
        dtype = torch.bfloat16 if elem_bytes == 2 else torch.float32
        numel = send.bytes // (2 if elem_bytes == 2 else 4)
        shape = (numel // width, width) if width and numel % width == 0 else (numel,)
        wire = get_codec(spec).wire_size(shape, dtype)
        ratio = f"{send.bytes / wire:.3g}x" if wire else "-"
        cost = loss_cost(spec, table())
    except (CodecError, ValueError):
        ratio, cost = "?", None
    transfer = max(send.seconds, send.backward_seconds)
    stall = max(0.0, transfer - max(s.compute_s, after.compute_s if after is not None else 0.0))
    return (f"{send.codec} {send.bytes / 1e6:.1f} MB {ratio} {duration(send.seconds)}, stall {duration(stall)}, "
            f"loss {'?' if cost is None else f'+{cost:.1%}'}")



def _shape(s: StagePlan) -> str:
    """The dp x tp column: with lanes, dp as lanes x the replicas of each (`atoll.plan`)."""
    dp = f"{s.lanes}x{s.dp // s.lanes}" if s.lanes > 1 else f"{s.dp}"
    return f"dp {dp} x tp {s.tp}"


def _deferred(s: StagePlan) -> str:
    """The wgrad column: the depth of a stage's deferred weight gradients, with how many layers defer when not
    all of them, or none."""
    if not s.defer_weights:
        return "-"
    return f"{s.defer_weights} of {len(s.defer_layers)}" if s.defer_layers else str(s.defer_weights)


def _gb(gb: float) -> str:
    """Memory per device: GB, or MB where that would print 0.0GB."""
    return f"{gb:.1f}GB" if gb >= 0.1 else f"{gb * 1e3:.1f}MB"


def _recomputed(s: StagePlan) -> str:
    """The recomp column: all of a stage's blocks, how many of them (a prefix), or none."""
    return "all" if s.recompute else str(len(s.recompute_layers)) if s.recompute_layers else "no"


def _unused_lines(plan: Plan, unused: Sequence[UnusedIsland], devices: str) -> list[str]:
    """Devices no stage runs on, per island, with the reason (`plan.idle`, else `unused` for whole islands)."""
    total = {i.id: i.gpus for i in plan.islands}
    on: dict[str, int] = {}
    for pl in plan.pipelines:
        for s in pl.stages:
            on[s.island] = on.get(s.island, 0) + s.dp * s.tp
    lines = []
    if plan.idle:
        for x in plan.idle:
            n = total.get(x.island, x.gpus)
            nodes = f" ({', '.join(x.nodes)})" if x.nodes else ""
            head = (f"idle{nodes}," if x.gpus >= n else
                    f"{n - x.gpus} of its {n} {devices} used, {x.gpus} idle{nodes};")
            lines.append(f"  {x.island}: {head} {x.reason}")
        return ["idle:"] + lines
    why = {u.island: u.reason for u in unused}
    for i in plan.islands:
        n = on.get(i.id, 0)
        if n == 0:
            lines.append(f"  {i.id}: idle, {why.get(i.id, 'the plan found is faster without it')}")
        elif n < i.gpus:
            lines.append(f"  {i.id}: {n} of its {i.gpus} {devices} used; the plan found is faster with fewer")
    return (["idle:"] + lines) if lines else []
