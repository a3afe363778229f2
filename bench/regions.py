"""Regions benchmark: one region alone, two regions synchronous, two regions as outer-mode replica groups.

On the geo testbed (two regions of two hosts, equal CPU quotas, a shaped link between the regions), the same
job three ways, each with the same number of steps per replica group:
 (i)   one region alone: lab-a's two hosts (`cluster.expected_nodes = 2`);
 (ii)  both regions synchronous: data parallel over all four hosts, one gradient all-reduce across the link per
       step. The planner's best synchronous plan leaves the second region idle (a step that crosses the link is
       slower than one region alone), so this run pins that plan (`atoll coordinator --plan`) to measure it;
 (iii) outer mode (`mode = "outer"`: a replica group per region, H inner steps per round, int8
       pseudo-gradients with error feedback, the exchange overlapped by one round).
For each it prints tokens/s (tokens trained by all groups over the wall time from the first to the last
step report, from the coordinator's store), the wide-area bytes per token (the WAN veths' transmit counters,
taken at the first and at the last step report), the final eval loss and the time to reach the final eval loss
of (i). Eval loss: every checkpoint step is loaded here into the whole model and scored on a fixed batch of
64 windows drawn at a step index far beyond training; it is paired with the step's report time and the tokens
all groups had trained by then. `runs/bench-regions/loss.png` plots eval loss against tokens and against wall
time. It ends with `targets met: N/M`.

Usage (as root): python -m bench.regions [--steps 400] [--inner-steps 10] [--codec int8]
"""

from __future__ import annotations

import argparse
import bisect
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RATE = 20e6
LATENCY_MS = 50.0
QUOTA = 0.3
"""CPU per host, of a core: four hosts and the coordinator must fit this machine's cores without contention, so
that a second region adds compute (on 2 cores, 4 x 0.45 plus the coordinator and the kernel's packet work
oversubscribe it and slow every host)."""
EVAL_STEP = 10 ** 6
EVAL_ROWS = 64
REFERENCE = ("reference: plain averaging every 10 steps on the tiny model in one process came within 2.4-5% of "
             "synchronous over 200-300 steps")


# --- pure helpers (unit-tested) ------------------------------------------------------------------------

def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """y at `x` on the piecewise-linear curve through (xs, ys) (xs ascending); None outside [xs[0], xs[-1]]."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    k = bisect.bisect_left(xs, x)
    if xs[k] == x:
        return ys[k]
    x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def time_to_reach(times: Sequence[float], losses: Sequence[float], target: float) -> float | None:
    """The first time the piecewise-linear loss curve comes down to `target`; None when it never does."""
    for k, (t, loss) in enumerate(zip(times, losses)):
        if loss <= target:
            if k == 0:
                return t
            t0, l0 = times[k - 1], losses[k - 1]
            return t0 + (t - t0) * (l0 - target) / (l0 - loss) if l0 != loss else t
    return None


def tokens_by(step_times: dict[int, Sequence[float]], t: float, tokens_per_step: int) -> int:
    """Tokens trained by time `t`: per group, the steps whose (sorted) completion times are <= t."""
    return sum(bisect.bisect_right(times, t) for times in step_times.values()) * tokens_per_step


# --- one run ---------------------------------------------------------------------------------------------

@dataclass
class RunResult:
    name: str
    groups: int
    plan: str
    wall_s: float
    tokens: int
    wan_bytes: int
    wan_bytes_all: int
    """The whole run's, start-up (profiles, link probes) included."""
    curve: list[tuple[int, float, int, float]] = field(default_factory=list)
    """Per checkpoint: (step, seconds since the first step report, tokens by then, eval loss)."""
    step_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def final_loss(self) -> float:
        return self.curve[-1][3]


def _job(base: Path, out: Path, name: str, *, steps: int, mode: str, nodes: int, inner: int, codec: str,
         deadline: float, overlap: bool = True, apply_after: int = 0) -> Path:
    from atoll.job import JobSpec

    job = JobSpec.load(base)
    job = replace(job, name=f"regions-{name}", id="",
                  train=replace(job.train, steps=steps, warmup=min(job.train.warmup, steps // 10)),
                  checkpoint=replace(job.checkpoint, interval=inner, keep=0),
                  cluster=replace(job.cluster, expected_nodes=nodes, min_nodes=nodes),
                  outer=replace(job.outer, mode=mode, inner_steps=inner, codec=codec, overlap=overlap,
                                deadline_seconds=deadline, apply_after=apply_after))
    path = out / f"job-{name}.toml"
    path.write_text(job.to_toml())
    return path


def _reports(db: Path) -> list:
    from atoll.coordinator.store import SqliteStore

    if not db.is_file():
        return []
    store = SqliteStore(db)
    try:
        return store.recent_steps(limit=1_000_000)
    finally:
        store.close()


def _groups_of(plan) -> list[set[str]]:
    if plan.mode == "outer" and plan.groups:
        return [{n for p in g.pipelines for st in plan.pipelines[p].stages for n in st.nodes} for g in plan.groups]
    return [{n for p in plan.pipelines for st in p.stages for n in st.nodes}]


def _describe(plan) -> str:
    parts = []
    for g, nodes in enumerate(_groups_of(plan)):
        pipes = [p for p in range(len(plan.pipelines)) if plan.group_of(p) == g] if plan.mode == "outer" \
            else range(len(plan.pipelines))
        parts.append(" | ".join(" -> ".join(f"{s.island}[{s.layers[0]},{s.layers[1]})x{s.dp}"
                                             for s in plan.pipelines[p].stages) for p in pipes))
    how = f"outer, {len(plan.groups)} groups, H={'/'.join(str(g.inner_steps) for g in plan.groups)}, {plan.outer.codec}" \
        if plan.mode == "outer" else "sync"
    return f"{how}: " + "; ".join(parts)


def evaluate(job, checkpoints: Path, steps: Sequence[int]) -> dict[int, float]:
    """Mean loss of the whole model at each checkpoint step on the fixed held-out batch."""
    import torch

    from atoll.node.checkpoint import load_layers
    from atoll.node.data import TokenDataset
    from atoll.node.model import build_slice, lm_loss

    data = TokenDataset.from_source(job.data.source, job.train.seq_len, seed=job.train.seed)
    batch = data.global_batch(EVAL_STEP, EVAL_ROWS)
    total = job.model.n_layers + 2
    out = {}
    for step in steps:
        module = build_slice(job.model, 0, total, seed=job.train.seed)
        optimizer = torch.optim.AdamW(module.parameters())
        load_layers(module, optimizer, checkpoints, step)
        module.eval()
        with torch.no_grad():
            out[step] = float(lm_loss(module(batch.inputs), batch.targets))
    return out


def pinned_sync_plan(job_path: Path, hosts, out: Path) -> Path:
    """A synchronous plan over every host: a pipeline per region, one stage of the whole model with a replica on
    each of its hosts, the global batch shared by all; the nodes are named by their hosts."""
    from atoll.job import JobSpec
    from atoll.plan import PipelinePlan, Plan, StagePlan

    job = JobSpec.load(job_path)
    regions: dict[str, list[str]] = {}
    for h in hosts:
        regions.setdefault(h.region, []).append(h.name)
    share = job.train.global_batch // len(regions)
    plan = Plan(model=job.model.name, global_batch=job.train.global_batch, seq_len=job.train.seq_len, pipelines=[
        PipelinePlan(micro_batch=share, num_micro_batches=1, stages=[
            StagePlan(island=region, layers=(0, job.model.n_layers + 2), dp=len(nodes), nodes=nodes)])
        for region, nodes in sorted(regions.items())])
    plan.validate(job.model.n_layers + 2)
    path = out / "pinned-plan.json"
    plan.save(path)
    return path


def run(tb, name: str, job_path: Path, hosts, out: Path, timeout: float, pin: Path | None = None) -> RunResult:
    from atoll.job import JobSpec
    from atoll.launch.localcluster import LocalCluster
    from atoll.node.checkpoint import complete_steps_on_disk
    from atoll.serde import plan_from_proto

    job = JobSpec.load(job_path)
    last = job.train.steps - 1
    start_bytes = tb.wan_bytes()
    first_bytes = None
    with LocalCluster(job_path=job_path, out=out) as cluster:
        extra = ["--island-threshold", "0.001"] + (["--plan", str(pin)] if pin is not None else [])
        cluster.start_coordinator(host=tb.coordinator, extra=extra)
        for h in hosts:
            if pin is not None:  # a pinned plan names nodes by id: each node's id is its host's name
                from atoll.node.identity import save_node_id

                (out / h.name).mkdir(parents=True, exist_ok=True)
                save_node_id(out / h.name, h.name)
            cluster.start_node(h.name, host=h)
        end = time.monotonic() + timeout
        plan = None
        while True:
            cluster.check_alive()
            if time.monotonic() > end:
                raise TimeoutError(f"run {name} did not finish within {timeout:.0f}s; logs in {out}")
            reports = _reports(cluster.state_db)
            if reports and first_bytes is None:
                first_bytes = tb.wan_bytes()
            if plan is None and reports:
                plan = plan_from_proto(cluster.status().plan)
            if plan is not None:
                groups = _groups_of(plan)
                done = [any(r.step >= last for r in reports if r.node_id in g) for g in groups]
                if all(done):
                    break
            time.sleep(0.25)
        end_bytes = tb.wan_bytes()
        wait = time.monotonic() + 15  # the last checkpoint is written after the last step's report
        while job.train.steps not in complete_steps_on_disk(cluster.checkpoints, job.model.n_layers + 2) \
                and time.monotonic() < wait:
            time.sleep(0.2)
    groups = _groups_of(plan)
    if len(reports) >= 1900:
        print(f"  warning: {len(reports)} step reports; the coordinator keeps the newest 2000 only, so early steps "
              f"may be missing: use fewer steps", flush=True)
    tokens_per_step = job.train.global_batch * job.train.seq_len
    step_times: dict[int, list[float]] = {}
    for g, nodes in enumerate(groups):
        firsts: dict[int, float] = {}
        for r in reports:
            if r.node_id in nodes:
                firsts[r.step] = max(firsts.get(r.step, 0.0), r.unix_time)  # the step is done on every node
        step_times[g] = sorted(firsts.values())
    t0 = min(r.unix_time for r in reports)
    t1 = max(r.unix_time for r in reports)
    tokens = sum(len(v) for v in step_times.values()) * tokens_per_step
    steps_on_disk = [s for s in complete_steps_on_disk(cluster.checkpoints, job.model.n_layers + 2) if s > 0]
    losses = evaluate(job, cluster.checkpoints, steps_on_disk)
    group0 = {}
    for r in reports:
        if r.node_id in groups[0]:
            group0[r.step] = max(group0.get(r.step, 0.0), r.unix_time)
    curve = []
    for s in steps_on_disk:
        t = group0.get(s - 1)
        if t is None:
            continue
        curve.append((s, t - t0, tokens_by(step_times, t, tokens_per_step), losses[s]))
    g0 = step_times[0]
    gaps = sorted(b - a for a, b in zip(g0, g0[1:]))
    wan = sum(end_bytes.values()) - sum((first_bytes or start_bytes).values())
    return RunResult(name=name, groups=len(groups), plan=_describe(plan), wall_s=t1 - t0, tokens=tokens,
                     wan_bytes=wan, wan_bytes_all=sum(end_bytes.values()) - sum(start_bytes.values()), curve=curve,
                     step_s=gaps[len(gaps) // 2] if gaps else 0.0)


def picture(results: list[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        a.plot([c[2] for c in r.curve], [c[3] for c in r.curve], marker="o", ms=3, label=r.name)
        b.plot([c[1] for c in r.curve], [c[3] for c in r.curve], marker="o", ms=3, label=r.name)
    a.set_xlabel("tokens trained (all groups)")
    b.set_xlabel("wall time since the first step (s)")
    for ax in (a, b):
        ax.set_ylabel("eval loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("two regions, 20 Mbit/s between them: eval loss")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".loss-", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", type=Path, default=REPO / "examples" / "regions.toml")
    ap.add_argument("--steps", type=int, default=400, help="steps per replica group in every run")
    ap.add_argument("--inner-steps", type=int, default=10, help="H of the outer-mode run (also the checkpoint interval)")
    ap.add_argument("--codec", default="int8", help="codec of the outer-mode pseudo-gradients")
    ap.add_argument("--deadline", type=float, default=3.0,
                    help="outer.deadline_seconds: how long a round waits for a late group. The planner may give the "
                         "groups different H (from their profiled step times); each group still trains --steps "
                         "steps, so the group with the smaller H has rounds left when the other finishes, and each "
                         "of those waits this long (the default, 0, means at least 30 s)")
    ap.add_argument("--apply-after", type=int, default=3,
                    help="outer.apply_after of the outer run: apply a round's average this many steps into the next "
                         "(0: the job's default)")
    ap.add_argument("--no-overlap", action="store_true", help="outer run: block at each round's end (diagnosis)")
    ap.add_argument("--quota", type=float, default=QUOTA, help="CPU per host, of a core")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="bound of each run, seconds ((ii) is bound by the link: ~0.7 s a step at 20 Mbit/s)")
    ap.add_argument("--only", nargs="*", choices=("one", "sync", "outer"), help="make only these runs (diagnosis)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench-regions")
    args = ap.parse_args()

    sys.path.insert(0, str(REPO))
    from bench.geo import geo_testbed, geo_unavailable

    reason = geo_unavailable()
    if reason:
        print(f"regions benchmark skipped: {reason}")
        return 0
    from atoll.job import JobSpec

    base = JobSpec.load(args.job)
    from atoll.node.model import build_slice

    params = sum(p.numel() for p in build_slice(base.model, 0, base.model.n_layers + 2).parameters())
    print(f"regions benchmark: job {args.job.name} (model {base.model.name}, {params:,} parameters), "
          f"{args.steps} steps per group, global batch {base.train.global_batch} x {base.train.seq_len}; "
          f"two regions of two hosts at {args.quota} core each, {RATE / 1e6:.0f} Mbit/s and {LATENCY_MS:.0f} ms between them")
    results: list[RunResult] = []
    with geo_testbed(regions={"lab-a": 2, "lab-b": 2}, wan_bits_per_s=RATE, wan_latency_ms=LATENCY_MS,
                        cpu_quota=args.quota) as tb:
        runs = [("(i) one region", "sync", tb.in_region("lab-a")),
                ("(ii) two regions, sync", "sync", tb.hosts),
                ("(iii) two regions, outer", "outer", tb.hosts)]
        for k, (name, mode, hosts) in enumerate(runs):
            key = ["one", "sync", "outer"][k]
            if args.only and key not in args.only:
                continue
            folder = args.out / key  # logs and the coordinator's store stay there; checkpoints are removed
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            job_path = _job(args.job, folder, key, steps=args.steps, mode=mode, nodes=len(hosts),
                            inner=args.inner_steps, codec=args.codec, deadline=args.deadline,
                            overlap=not args.no_overlap, apply_after=args.apply_after)
            t = time.monotonic()
            pin = pinned_sync_plan(job_path, hosts, folder) if key == "sync" else None
            r = run(tb, name, job_path, hosts, folder / "run", args.timeout, pin=pin)
            shutil.rmtree(folder / "run" / "checkpoints", ignore_errors=True)
            print(f"  {name}: {r.plan}; {r.wall_s:.1f}s of training ({time.monotonic() - t:.0f}s with start-up and "
                  f"evaluation), median step {r.step_s:.3f}s", flush=True)
            results.append(r)
    target_loss = results[0].final_loss
    times = {}
    for r in results:
        times[r.name] = time_to_reach([c[1] for c in r.curve], [c[3] for c in r.curve], target_loss)
    print(f"{'run':<28}{'tokens/s':>10}{'WAN B/token':>13}{'eval loss':>11}{'to (i) loss':>13}{'wall s':>9}"
          f"{'tokens':>10}")
    for r in results:
        t = times[r.name]
        print(f"{r.name:<28}{r.tokens_per_s:>10,.0f}{r.wan_bytes / r.tokens:>13,.1f}{r.final_loss:>11.4f}"
              f"{(f'{t:.1f}s' if t is not None else 'never'):>13}{r.wall_s:>9.1f}{r.tokens:>10,}")
    print("WAN bytes over training (and whole runs, start-up probes included): "
          + ", ".join(f"{r.name.split()[0]} {r.wan_bytes / 1e6:.2f} MB ({r.wan_bytes_all / 1e6:.2f} MB)" for r in results))
    print(REFERENCE)
    if len(results) < 3:
        print("targets not judged: only some runs were made (--only)")
        return 0
    one, sync, outer = results

    speed = outer.tokens_per_s / one.tokens_per_s
    sync_bpt, outer_bpt = sync.wan_bytes / sync.tokens, outer.wan_bytes / outer.tokens
    wan_ratio = sync_bpt / outer_bpt if outer_bpt > 0 else float("inf")
    wan_text = (f"{sync_bpt:,.1f} vs {outer_bpt:,.1f} B/token = {wan_ratio:.1f}x fewer" if sync_bpt > 0 else
                f"(ii) sent {sync_bpt:.1f} B/token across: its plan does not span the link, {outer_bpt:,.1f} B/token "
                f"for (iii)")
    t_outer, t_one = times[outer.name], times[one.name] or one.curve[-1][1]
    common = min(sync.curve[-1][2], outer.curve[-1][2])
    l_sync = interpolate([c[2] for c in sync.curve], [c[3] for c in sync.curve], common)
    l_outer = interpolate([c[2] for c in outer.curve], [c[3] for c in outer.curve], common)
    gap = abs(l_outer - l_sync) / l_sync if l_sync is not None and l_outer is not None else None
    targets = [
        (f"(iii) tokens/s >= 1.8x (i): {speed:.2f}x", speed >= 1.8),
        (f"(iii) WAN bytes per token >= 50x fewer than (ii): {wan_text}", sync_bpt > 0 and wan_ratio >= 50),
        (f"(iii) reaches (i)'s final eval loss {target_loss:.4f} in <= 0.85x (i)'s wall time: "
         + (f"{t_outer:.1f}s vs {t_one:.1f}s = {t_outer / t_one:.2f}x" if t_outer is not None else "never reached"),
         t_outer is not None and t_outer <= 0.85 * t_one),
        (f"(iii) eval loss at equal tokens within 5% of (ii): at {common:,} tokens "
         + (f"{l_outer:.4f} vs {l_sync:.4f} ({gap:.1%})" if gap is not None else "no common point"),
         gap is not None and gap <= 0.05),
    ]
    for text, ok in targets:
        print(f"  [{'ok' if ok else 'MISSED'}] {text}")
    met = sum(ok for _, ok in targets)
    missed = [t.split(':')[0] for t, ok in targets if not ok]
    print(f"targets met: {met}/{len(targets)}" + (f" (missed: {'; '.join(missed)})" if missed else ""))
    png = args.out / "loss.png"
    picture(results, png)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
