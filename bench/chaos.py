"""Chaos benchmark: one long run of the tiny job with random node kills and coordinator kills.

A coordinator and `--nodes` nodes as real `atoll` processes on this machine (`LocalCluster`). While the job
trains, `bench.faults` SIGKILLs a random node (restarted on its state dir after `--restart-after` s, so the
cluster keeps its size) or the coordinator (restarted on the same state dir and address after `--outage` s),
one event every `--steps-per-event` steps once the cluster has recovered from the one before. Per event it
prints the detection time, the time to the next whole step, the steps rolled back and the bytes of state the
nodes moved; then the final loss against an undisturbed run of the same job on the same cluster (measured
first, in this run).

Targets: the job completes; every node kill is detected within 10 s; coordinator kills cost 0 steps.

Usage: python -m bench.chaos [--node-kills 100 --coordinator-kills 5] [--quick]
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a path (python bench/chaos.py): imports resolve from the checkout
    sys.path.insert(0, str(ROOT))

from bench.faults import (DriverConfig, FaultSchedule, RunFailed, event_table, final_loss, fmt,  # noqa: E402
                          run_pair)

DETECTION_TARGET_S = 10.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--node-kills", type=int, default=100)
    ap.add_argument("--coordinator-kills", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="3 node kills and 1 coordinator kill on 3 nodes: a check "
                                                         "that fits a loaded machine")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="the job's steps (default: enough for the events at the "
                                                            "step time a short calibration run measures)")
    ap.add_argument("--gap-steps", type=int, default=10, help="steps trained after a recovery before the next event")
    ap.add_argument("--restart-after", type=float, default=10.0, help="seconds a killed node stays down")
    ap.add_argument("--outage", type=float, default=5.0, help="seconds the coordinator stays down")
    ap.add_argument("--lease", type=float, default=8.0, help="the coordinator's lease (seconds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=None, help="bound of each run in seconds (default: from the "
                                                                "number of events)")
    ap.add_argument("--out", type=Path, default=Path("runs") / "bench-chaos")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the cluster's processes are stopped too
    if args.quick:
        args.node_kills, args.coordinator_kills, args.nodes = 3, 1, 3
    schedule = FaultSchedule(node_kills=args.node_kills, coordinator_kills=args.coordinator_kills, seed=args.seed)
    cfg = DriverConfig(nodes=args.nodes, gap_steps=args.gap_steps, restart_after=args.restart_after,
                       outage=args.outage, lease=args.lease)
    print(f"chaos: tiny job on {cfg.nodes} nodes; {args.node_kills} node kill(s) (down {cfg.restart_after:g}s each), "
          f"{args.coordinator_kills} coordinator kill(s) (down {cfg.outage:g}s), lease {cfg.lease:g}s, the next event "
          f"{cfg.gap_steps} steps after a recovery; logs under {args.out}", flush=True)
    try:
        res = run_pair(cfg, schedule, args.out, steps=args.steps, timeout=args.timeout,
                       say=lambda s: print(s, flush=True))
    except RunFailed as e:
        print(f"the calibration or undisturbed run failed: {e}")
        print("targets met: 0/3 (missed: the undisturbed run did not finish)")
        return 1
    events, losses, base = res.driver.events, res.losses, res.base
    print(f"disturbed run: {len(events)} of {len(schedule.events())} event(s) in {res.wall_s:.0f}s"
          + (f"; FAILED: {res.error}" if res.error else ""))
    for line in event_table(events):
        print(line)

    kills = [e for e in events if e.kind == "node-kill"]
    coords = [e for e in events if e.kind == "coordinator-kill"]
    detections = [e.detection_s for e in kills]
    detected = [d for d in detections if d is not None]
    rolled = [e.rolled_back or 0 for e in kills]
    print(f"node kills: {len(kills)}; detection median {fmt(_median(detected))}s, max {fmt(max(detected, default=None))}s"
          f" ({len(detections) - len(detected)} undetected); steps rolled back: total {sum(rolled)}, max "
          f"{max(rolled, default=0)}; time to the next step: median "
          f"{fmt(_median([e.next_step_s for e in kills if e.next_step_s is not None]))}s")
    coord_cost = [e.rolled_back for e in coords]
    print(f"coordinator kills: {len(coords)}; steps rolled back {coord_cost}; time to the next step "
          f"{[fmt(e.next_step_s) for e in coords]}s; {'; '.join(e.note for e in coords)}")
    if losses and base:
        fl, fb = final_loss(losses), final_loss(base)
        print(f"final loss (mean of the last 10 steps): {fl:.4f} disturbed vs {fb:.4f} undisturbed "
              f"({100 * (fl - fb) / fb:+.2f}%)")

    targets = {
        "the job completes": res.completed,
        f"every node kill detected within {DETECTION_TARGET_S:g}s": bool(kills) and len(detected) == len(kills)
        and max(detected) <= DETECTION_TARGET_S,
        "coordinator kills cost 0 steps": bool(coords) and all(c == 0 for c in coord_cost),
    }
    missed = [name for name, ok in targets.items() if not ok]
    if res.driver.not_injected:
        print(f"note: {res.driver.not_injected} event(s) were not injected: the job ended first (give --steps)")
    print(f"targets met: {len(targets) - len(missed)}/{len(targets)}"
          + (f" (missed: {'; '.join(missed)})" if missed else ""))
    return 0


def _median(xs: list[float]) -> float | None:
    import statistics

    return statistics.median(xs) if xs else None


if __name__ == "__main__":
    raise SystemExit(main())
