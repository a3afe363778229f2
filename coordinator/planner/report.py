"""A plan as readable text: islands, pipelines and stages, predicted throughput and the bottleneck."""

from __future__ import annotations

from atoll.coordinator.planner.cluster import GBPS, Cluster
from atoll.plan import Plan


def format_plan(plan: Plan, cluster: Cluster | None = None, *, search_seconds: float | None = None) -> str:
    p = plan.predicted
    gpus_used = sum(s.dp for pl in plan.pipelines for s in pl.stages)
    total = sum(i.gpus for i in plan.islands)
    lines = [f"plan for {plan.model}: global batch {plan.global_batch} x {plan.seq_len} tokens, "
             f"{gpus_used} of {total} GPUs"]
    lines.append(f"  step {p.step_time_s:.3f} s   {p.tokens_per_s:,.0f} tokens/s   MFU {p.mfu:.1%}")
    lines.append(f"  bottleneck: {p.bottleneck}")
    if search_seconds is not None:
        lines.append(f"  planned in {search_seconds:.2f} s")
    lines.append("islands:")
    for i in plan.islands:
        region = f" region {cluster.island(i.id).region}" if cluster is not None else ""
        lines.append(f"  {i.id:<16} {i.gpus:>5} x {i.device:<10}{region}  inner {i.inner_bandwidth / GBPS:.0f} Gbit/s")
    for k, pl in enumerate(plan.pipelines):
        lines.append(f"pipeline {k}: {len(pl.stages)} stages, {pl.num_micro_batches} micro-batches of "
                     f"{pl.micro_batch} sequences (each stage shares one among its dp replicas)")
        lines.append(f"  {'stage':>5}  {'island':<16} {'layers':<10} {'dp':>4} {'zero':>4} {'recomp':>6} "
                     f"{'compute':>9} {'mem/dev':>8}  send")
        for j, s in enumerate(pl.stages):
            send = "-"
            if s.send is not None:
                send = f"{s.send.codec} {s.send.bytes / 1e6:.1f} MB {s.send.seconds * 1e3:.1f} ms"
            lines.append(f"  {j:>5}  {s.island:<16} [{s.layers[0]}, {s.layers[1]})".ljust(36)
                         + f" {s.dp:>4} {s.zero:>4} {'yes' if s.recompute else 'no':>6} "
                         f"{s.compute_s * 1e3:>7.1f}ms {s.memory_gb_per_device:>6.1f}GB  {send}")
    return "\n".join(lines)
