"""Drift benchmark: one node of a running job slowed down, and the coordinator planning around it.

    sudo .venv/bin/python -m bench.drift [--nodes 3 --quota 0.25 --model small --steps 400]

A coordinator and `--nodes` node processes on this machine train a job (the `--model` preset, one torch thread
per node), each node in a cgroup of its own with a CPU quota of `--share` cores (cgroup v1, as root), so that
the nodes are devices of their own rather than threads competing for the machine's cores. Once the job has
trained `--before` steps, the quota of the node with the most layers drops to `--quota` cores: from then on it
computes several times slower than it profiled at join, as a device does that a co-tenant shares or that
throttles. The coordinator runs with
drift checks every `--check` seconds (`atoll coordinator --drift-every`), so it should notice, plan again
from the measured speeds and switch.

Printed: the median step time in three phases (before the slowdown; slowed, under the first plan; slowed, under
the plan the drift made, after its first `--settle` steps), when the drift replan came and what it said, the
steps it rolled back (the job's step before and after the switch), and whether every process is still up.
Targets: a drift replan within `--check` x 3 + 60 s of the slowdown; the slowed job's steps at least 20% shorter
under the new plan than under the old (`DRIFT_GAIN_TARGET`); no step rolled back (the plan hands its state over
live). Ends with `targets met: N/M`.

`--regions N` splits the nodes over N regions trained as outer-mode replica groups (`--inner-steps` a round): a
slowed node's group holds every round back, and the coordinator plans that group afresh from its recent speeds
while the others run on. The last target then reads: the groups kept running lose no step, and the group planned
afresh at most the round it was in (it starts again from the round's outer state, as a group joining live ones
does).

Needs root for the cgroup, and the machine to itself: the step times are wall times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a path (python bench/drift.py): imports resolve from the checkout
    sys.path.insert(0, str(ROOT))

from bench.geo import CPU_CGROUP, PERIOD_US, _empty_cgroup, _make_cgroup  # noqa: E402

DRIFT_GAIN_TARGET = 0.20
"""The slowed job's steps must be at least this much shorter under the drift's plan than under the first."""


def _job(model: str, nodes: int, steps: int, regions: int = 1, inner_steps: int = 5) -> str:
    from atoll.job import JobSpec

    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    from atoll.models import preset
    config = replace(preset(model), seq_len=job.train.seq_len)
    job = replace(job, name="drift", id="", model=config, model_preset=None,
                  train=replace(job.train, steps=steps),
                  checkpoint=replace(job.checkpoint, interval=10),
                  cluster=replace(job.cluster, expected_nodes=nodes, min_nodes=nodes))
    if regions > 1:  # replica groups, one per region, each round waiting for the slowest
        job = replace(job, outer=replace(job.outer, mode="outer", inner_steps=inner_steps, deadline_seconds=60.0))
    return job.to_toml()


def region_of(i: int, nodes: int, regions: int) -> str | None:
    """The region of node i of `nodes` split evenly over `regions` (None: one region, no --region)."""
    return f"lab-{chr(ord('a') + i * regions // nodes)}" if regions > 1 else None


def _plans(cluster) -> list[tuple[int, float, str]]:
    """(epoch, published unix time, reason) of every plan the coordinator made."""
    with cluster.read_store() as store:
        return [(h.plan.epoch, h.created_unix, h.reason) for h in store.plan_history()]


def _first_step(cluster, epoch: int) -> int | None:
    """The first step any node reported under plan `epoch` (where the switch resumed the job)."""
    with cluster.read_store() as store:
        return min((m.step for m in store.recent_steps(limit=store.recent_steps_kept) if m.plan_epoch == epoch),
                   default=None)


def _group_resumes(cluster, old: int, new: int) -> list[tuple[str, bool, int, int, int]]:
    """Outer mode, per replica group of plan `new`: (name, kept running, the last step any of its nodes reported
    under plan `old`, the first under `new`, its inner steps a round under `old` in the job's steps)."""
    with cluster.read_store() as store:
        plans = {h.plan.epoch: h.plan for h in store.plan_history()}
        steps = store.recent_steps(limit=store.recent_steps_kept)
    before, after = plans[old], plans[new]
    out = []
    for g in after.groups:
        nodes = {n for p in g.pipelines for st in after.pipelines[p].stages for n in st.nodes}
        last = max((m.step for m in steps if m.plan_epoch == old and m.node_id in nodes), default=-1)
        first = min((m.step for m in steps if m.plan_epoch == new and m.node_id in nodes), default=-1)
        out.append((g.name, 0 < g.since_epoch < new, last, first, before.outer.inner_steps if before.outer else 1))
    return out


def _median_step(times: dict[int, float], lo: int, hi: int, least: int = 3) -> float | None:
    """The median interval between consecutive steps' loss reports for steps in [lo, hi) (None: fewer than `least`
    intervals)."""
    gaps = [times[s] - times[s - 1] for s in range(lo + 1, hi) if s in times and s - 1 in times]
    return statistics.median(gaps) if len(gaps) >= least else None


def _busiest(cluster) -> str:
    """The name of the node process holding the most layers in the current plan."""
    plan = cluster.status().plan
    layers: dict[str, int] = {}
    for p in plan.pipelines:
        for st in p.stages:
            for n in st.node_ids:
                layers[n] = layers.get(n, 0) + st.layer_end - st.layer_start
    return cluster.node_name(max(sorted(layers), key=lambda n: layers[n]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--model", default="small", help="model preset (default small)")
    ap.add_argument("--steps", type=int, default=400, help="steps of the job (it is stopped once measured)")
    ap.add_argument("--before", type=int, default=20, help="steps before the slowdown")
    ap.add_argument("--share", type=float, default=0.6, help="each node's CPU quota, in cores (default 0.6)")
    ap.add_argument("--quota", type=float, default=0.15, help="the slowed node's CPU quota, in cores")
    ap.add_argument("--check", type=float, default=10.0, help="seconds between the coordinator's drift checks")
    ap.add_argument("--settle", type=int, default=5, help="steps of the new plan left out of its median")
    ap.add_argument("--after", type=int, default=20, help="steps measured under the new plan")
    ap.add_argument("--regions", type=int, default=1,
                    help="split the nodes over this many regions, trained as outer-mode replica groups (default 1)")
    ap.add_argument("--inner-steps", type=int, default=5, help="with --regions: inner steps per outer round")
    ap.add_argument("--out", help="folder for the run (default: a temporary one)")
    a = ap.parse_args(argv)
    if not 1 <= a.regions <= a.nodes:
        ap.error(f"--regions must be between 1 and --nodes ({a.nodes})")
    if os.geteuid() != 0 or not (CPU_CGROUP / "cpu.cfs_quota_us").is_file():
        print(f"bench.drift needs root and the cgroup v1 cpu controller at {CPU_CGROUP}")
        return 2

    from atoll.launch.localcluster import LocalCluster

    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="atoll-drift-"))
    job = out / "job.toml"
    out.mkdir(parents=True, exist_ok=True)
    job.write_text(_job(a.model, a.nodes, a.steps, a.regions, a.inner_steps))
    groups = {f"node{i}": CPU_CGROUP / f"atoll-drift-{os.getpid()}-{i}" for i in range(a.nodes)}
    cluster = LocalCluster(job_path=job, out=out / "cluster", profile_seconds=2.0)
    where = f" in {a.regions} regions (outer mode, {a.inner_steps} inner steps a round)" if a.regions > 1 else ""
    print(f"{a.nodes} nodes{where} training {a.model} on this machine; logs in {out}")
    try:
        # the network fit is off: on loopback the nodes' transfers are bound by their CPU quotas, a fit reads them
        # as a network 7-29x slower than probed and replans for that, before or in place of the drift replan
        # this bench measures (bench.planner_testbed measures the fit, on shaped links)
        cluster.start_coordinator(extra=["--drift-every", str(a.check), "--no-network-fit"])
        for i, (name, group) in enumerate(groups.items()):
            cluster.start_node(name, region=region_of(i, a.nodes, a.regions))
            _make_cgroup(group, a.share)
            (group / "cgroup.procs").write_text(str(cluster.procs[name].pid))
        cluster.wait_status(lambda s: s.plan.epoch >= 1 and len(cluster.losses()) >= a.before, 300,
                            f"{a.before} steps")
        slowed = _busiest(cluster)
        (groups[slowed] / "cpu.cfs_quota_us").write_text(str(round(a.quota * PERIOD_US)))
        t_slow = time.time()
        at_slow = max(cluster.losses())
        epoch0 = cluster.status().plan.epoch
        print(f"step {at_slow}: {slowed} (the most layers) limited to {a.quota:g} of a core, from {a.share:g}")
        limit = 3 * a.check + 60
        status = cluster.wait_status(lambda s: s.plan.epoch > epoch0, limit + 60, "a drift replan")
        t_plan = time.time()
        plans = _plans(cluster)
        reason = next((r for e, _, r in plans if e == status.plan.epoch), "")
        at_plan = max(cluster.losses())
        print(f"plan epoch {status.plan.epoch} after {t_plan - t_slow:.0f} s, at step {at_plan}: {reason}")
        first_new = at_plan + 1
        cluster.wait_status(lambda s: max(cluster.losses(), default=0) >= first_new + a.settle + a.after, 600,
                            f"{a.after} steps under the new plan")
        resume = _first_step(cluster, status.plan.epoch)
        print(f"the new plan's first step: {resume}")
        groups_resumed = _group_resumes(cluster, epoch0, status.plan.epoch) if a.regions > 1 else []
        for name, kept, last, first, _ in groups_resumed:
            print(f"  group {name}: {'kept running' if kept else 'planned afresh'}, its last step under the old "
                  f"plan {last}, its first under the new {first}")
        alive = all(p.poll() is None for p in cluster.procs.values())
        times = dict(cluster._loss_times)  # noqa: SLF001 - each step's loss report time
    finally:
        cluster.stop()
        for group in groups.values():
            if group.exists():
                _empty_cgroup(group)
    before = _median_step(times, 2, at_slow)
    # every step the slowed node ran under the first plan: from the one after the slowdown's (its gap to that
    # one is slowed throughout) to the last before the new plan (a quick replan leaves only a few)
    # (a drift replan that comes within a few steps leaves only those: one interval is a measurement too)
    slow = _median_step(times, at_slow + 1, at_plan + 1, least=1)
    after = _median_step(times, first_new + a.settle, first_new + a.settle + a.after)
    print("\nmedian step time")
    for name, v in (("before the slowdown", before), ("slowed, first plan", slow), ("slowed, drift's plan", after)):
        print(f"  {name:<22} {'-' if v is None else f'{v * 1e3:8.1f} ms'}")
    gain = 1 - after / slow if slow and after else 0.0
    targets = [
        (f"a drift replan within {limit:.0f} s of the slowdown", "drift" in reason and t_plan - t_slow <= limit,
         f"{t_plan - t_slow:.0f} s" + ("" if "drift" in reason else f" (the new plan's reason: {reason})")),
        (f"steps >= {DRIFT_GAIN_TARGET:.0%} shorter under the drift's plan", gain >= DRIFT_GAIN_TARGET,
         f"{gain:.0%} shorter"),
        ("no step rolled back", resume is not None and resume >= at_plan and alive,
         f"the job was at step {at_plan} when the plan came and its first step was {resume}"
         + ("" if alive else "; a process exited")),
    ]
    if groups_resumed:
        # outer mode: a group kept running loses nothing; one planned afresh takes the outer state at its round's
        # start (the average the groups agree on), losing at most the inner steps of the round it was in
        ok = alive and all(first > last if kept else first >= last // inner * inner
                           for _, kept, last, first, inner in groups_resumed)
        targets[-1] = ("groups kept running lose no step, a group planned afresh at most its round in progress",
                       ok, "; ".join(f"{name} {'kept' if kept else 'afresh'}: {last} -> {first}"
                                     for name, kept, last, first, _ in groups_resumed)
                       + ("" if alive else "; a process exited"))
    print()
    for what, ok, detail in targets:
        print(f"  [{'met' if ok else 'MISSED'}] {what}: {detail}")
    missed = [what for what, ok, _ in targets if not ok]
    print(f"targets met: {len(targets) - len(missed)}/{len(targets)}" + (f" (missed: {'; '.join(missed)})"
                                                                          if missed else ""))
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
