"""Live calibration on the testbed: a job whose real link turns 4x slower than the coordinator profiled it.

    python -m bench.planner_testbed [--rate 40e6] [--slower 4] [--after 240]

Two hosts in two regions of the geo testbed (`bench/geo.py`: network namespaces, a tbf-shaped link of `--rate`
bits/s each way, no CPU quota by default: see below), a coordinator and two `atoll node` processes training the small model
synchronously (one plan over both hosts, activations or gradients crossing the shaped link; `compression.mode =
"identity"`, so the bytes on the wire are those the planner prices). The nodes probe the link at `--rate` when they
join, and the first plan is made from those figures. Once the job has trained `--before` steps the link is reshaped
to `--rate` / `--slower`: from then on the real link is 4x slower than the profile the plan rests on, as when a
cluster file or a probe overstates a link. The coordinator's network check (every `--check` seconds,
`coordinator/netfit.py`) fits its model of the network to the nodes' timed transfers and all-reduces and replans
when the fit moved and the best plan under it is worth the switch.

Printed: the plans (epoch, when, why), the network checks' verdicts from the coordinator's log, and the median step
time measured against the running plan's prediction before the slowdown, and at the end (the prediction of the
plan made under the fit, or the running plan re-scored under the fit where the check kept it). The step measured at
the end is the nodes' own timing of it (forward, backward, all-reduce, optimizer: what a plan predicts); the
interval between loss reports is printed beside it, with what runs between steps, which no plan predicts.

Targets (issue 40, "live, on the testbed"): the job reaches the plan the planner makes under the re-fitted model
within 3 replans of the slowdown (a network replan, or a check that finds the running plan within the replan
threshold of the best under the fit), and its measured/predicted step time ends within 15%.

Why no CPU quota by default: a cgroup quota limits a host's duty cycle, not its speed. A node that computes in
bursts (a pipeline stage, waiting between micro-batches) stays under it and runs at full speed, one that computes
without pause (the whole model alone) is throttled: at 0.6 of a core the same layers ran at 0.84x their profile in
the pipeline and 1.06x alone, and the speed factor the coordinator measured in one plan mispredicted the next by
45%. Without a quota each host computes at one of the machine's two cores throughout. `--quota` puts it back.

Needs root (namespaces, tc); about 3 minutes.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a path (python bench/planner_testbed.py): imports resolve from the checkout
    sys.path.insert(0, str(ROOT))

from bench.drift import _median_step  # noqa: E402 - the loss reports' median interval, as bench.drift reads it

MAX_REPLANS = 3
WITHIN = 0.15
REGIONS = ("lab-a", "lab-b")
_RUNNING = re.compile(r"against the running plan's ([0-9.eE+-]+) s")


def _job(model: str, steps: int) -> str:
    from atoll.job import JobSpec
    from atoll.models import preset

    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    job = replace(job, name="netfit-testbed", id="", model=replace(preset(model), seq_len=job.train.seq_len),
                  model_preset=None, train=replace(job.train, steps=steps),
                  checkpoint=replace(job.checkpoint, interval=1000),
                  compression=replace(job.compression, mode="identity"),
                  cluster=replace(job.cluster, expected_nodes=len(REGIONS), min_nodes=len(REGIONS)),
                  outer=replace(job.outer, mode="sync"))
    return job.to_toml()


def _network_lines(log: Path) -> list[str]:
    """The coordinator's network-check lines, oldest first."""
    if not log.is_file():
        return []
    return [line.split("network fit: ", 1)[1].strip() for line in log.read_text(errors="replace").splitlines()
            if "network fit: " in line and ("not replanning" in line or "moved" in line)]


def _reported_steps(cluster, epoch: int) -> dict[int, float]:
    """Per step of plan `epoch`, the longest step time its nodes reported (forward, backward, all-reduce and optimizer:
    what a plan predicts)."""
    out: dict[int, float] = {}
    with cluster.read_store() as store:
        for m in store.recent_steps(limit=store.recent_steps_kept):
            if m.plan_epoch == epoch and m.step_seconds > 0:
                out[m.step] = max(out.get(m.step, 0.0), m.step_seconds)
    return out


def _plans(cluster) -> list[tuple[int, float, str, float]]:
    """(epoch, published unix time, reason, predicted step seconds) of every plan the coordinator made."""
    with cluster.read_store() as store:
        return [(h.plan.epoch, h.created_unix, h.reason, h.plan.predicted.step_time_s) for h in store.plan_history()]


def run(argv: list[str] | None = None) -> list[tuple[str, bool]] | None:
    """One run (see the module docstring; `argv` its options): its targets as (what, met), printed with the run's
    figures; None where the testbed cannot be built here (the reason printed)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", help="model preset (default small: a pipeline over both hosts pays "
                                                     "at the probed rate, one host alone at the slow one)")
    ap.add_argument("--rate", type=float, default=40e6, help="the link's rate when the nodes probe it, bits/s")
    ap.add_argument("--slower", type=float, default=4.0, help="how many times slower the link turns")
    ap.add_argument("--quota", type=float, default=0.0,
                    help="each host's CPU quota, in cores (default 0: none, a core of the machine's two each)")
    ap.add_argument("--before", type=int, default=20, help="steps trained before the link slows")
    ap.add_argument("--check", type=float, default=10.0, help="seconds between the coordinator's checks")
    ap.add_argument("--after", type=float, default=240.0, help="seconds the job trains on the slow link")
    ap.add_argument("--tail", type=int, default=15, help="steps at the end whose median is the measured step")
    ap.add_argument("--out", help="folder for the run (default: a temporary one)")
    a = ap.parse_args(argv)

    from bench.geo import geo_testbed, geo_unavailable

    why = geo_unavailable()
    if why:
        print(f"bench.planner_testbed needs the geo testbed: {why}")
        return None
    from atoll.launch.localcluster import LocalCluster
    from atoll.serde import plan_from_proto

    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="atoll-netfit-"))
    out.mkdir(parents=True, exist_ok=True)
    job_path = out / "job.toml"
    job_path.write_text(_job(a.model, 100_000))
    slow_rate = a.rate / a.slower
    cores = f"{a.quota:g} of a core each" if a.quota > 0 else "no CPU quota"
    print(f"2 hosts in {' and '.join(REGIONS)} ({cores}), the {a.model} model synchronously over a link "
          f"probed at {a.rate / 1e6:g} Mbit/s that turns {a.slower:g}x slower after {a.before} steps; logs in {out}")
    with geo_testbed(regions=dict.fromkeys(REGIONS, 1), wan_bits_per_s=a.rate, cpu_quota=a.quota or None,
                     coordinator_cpu_quota=0.3) as tb, LocalCluster(job_path=job_path, out=out / "cluster") as cluster:
        cluster.start_coordinator(host=tb.coordinator, extra=["--island-threshold", "0.001",
                                                              "--drift-every", str(a.check)])
        for h in tb.hosts:
            cluster.start_node(h.name, host=h)
        status = cluster.wait_status(lambda s: s.plan.epoch >= 1 and len(cluster.losses()) >= a.before, 600,
                                     f"{a.before} steps")
        first = plan_from_proto(status.plan)
        at_slow = max(cluster.losses())
        tb.set_rate(*REGIONS, slow_rate)
        t_slow = time.time()
        print(f"step {at_slow}: the link between {REGIONS[0]} and {REGIONS[1]} now {slow_rate / 1e6:g} Mbit/s "
              f"(plan epoch {first.epoch}, predicted {first.predicted.step_time_s:.3g} s a step)")
        end = time.monotonic() + a.after
        while time.monotonic() < end:
            cluster.check_alive()
            cluster.losses()
            time.sleep(1.0)
        losses = cluster.losses()
        times = dict(cluster._loss_times)  # noqa: SLF001 - each step's loss report time
        plans = _plans(cluster)
        status = cluster.status()
        running = plan_from_proto(status.plan)
        checks = _network_lines(out / "cluster" / "coordinator.log")
        reported = _reported_steps(cluster, running.epoch)
        cluster.stop()

    last_step = max(losses)
    print("\nplans")
    for epoch, unix, reason, predicted in plans:
        when = "before the slowdown" if unix < t_slow else f"{unix - t_slow:.0f} s after it"
        print(f"  epoch {epoch}, {when}: predicted {predicted:.3g} s a step; {reason}")
    print("network checks (the coordinator's log)")
    for line in checks:
        print(f"  {line}")
    replans = [(e, r) for e, u, r, _ in plans if u >= t_slow]
    network_replans = [e for e, r in replans if r.startswith("network fit")]
    # the step the running plan began at: its first report after the newest plan was published
    start = min((s for s, t in times.items() if t >= max(u for _, u, _, _ in plans)), default=last_step)
    before = _median_step(times, 2, at_slow)
    lo = max(start + 3, last_step - a.tail)
    between = _median_step(times, lo, last_step + 1)  # loss reports' intervals: the step and what runs between steps
    tail = [v for k, v in reported.items() if lo <= k <= last_step]
    measured = statistics.median(tail) if tail else None
    # the prediction the coordinator holds for the running plan: its own (made under the fit) unless a later check
    # re-scored it under a newer fit and kept it
    last_check = checks[-1] if checks else ""
    rescored = _RUNNING.search(last_check) if "not replanning" in last_check else None
    predicted = float(rescored.group(1)) if rescored else running.predicted.step_time_s
    kept = bool(checks) and "not replanning" in last_check
    print(f"\nmedian step time before the slowdown {before:.3g} s against {first.predicted.step_time_s:.3g} s "
          f"predicted ({before / first.predicted.step_time_s:.2f})" if before else "")
    ratio = measured / predicted if measured and predicted > 0 else float("inf")
    print(f"at the end (plan epoch {running.epoch}, steps {lo}-{last_step}): measured {measured or 0:.3g} s a step "
          f"(as the nodes time it) against {predicted:.3g} s predicted ({ratio:.2f})")
    if between and measured:
        print(f"  between loss reports {between:.3g} s: {between - measured:.3g} s a step outside the step (the batch "
              f"read, reports, the progress line), which no plan predicts ({between / predicted:.2f} of the "
              f"prediction)")
    reached = (kept or bool(network_replans)) and len(replans) <= MAX_REPLANS
    targets = [
        (f"the re-fitted plan within {MAX_REPLANS} replans: {len(replans)} replan(s) after the slowdown "
         f"({len(network_replans)} by the network fit); the last check: {last_check or 'none'}", reached),
        (f"measured/predicted within {WITHIN:.0%}: {ratio:.2f}", abs(ratio - 1) <= WITHIN),
    ]
    for what, ok in targets:
        print(f"  [{'met' if ok else 'MISSED'}] {what}")
    return targets


def main(argv: list[str] | None = None) -> int:
    targets = run(argv)
    if targets is None:
        return 2
    print(f"targets met: {sum(ok for _, ok in targets)}/{len(targets)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
