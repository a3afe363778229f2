"""Chaos benchmark: one long run of the tiny job with random node kills and coordinator kills.

A coordinator and `--nodes` nodes as real `atoll` processes on this machine (`LocalCluster`). While the job
trains, `bench.faults` SIGKILLs a random node (restarted on its state dir `--restart-after` s after the
coordinator noticed its death, so the cluster keeps its size) or the coordinator (restarted on the same state
dir and address after `--outage` s). The next event comes as soon as the one before was detected and the job
trained `--gap-steps` whole steps again (a coordinator kill waits for the whole cluster first), so the killed
nodes rejoin while later events go on. Per event it prints the detection time, the time to the next whole
step, the steps rolled back and the bytes of state the nodes moved; then the final loss against an undisturbed
run of the same job to the same step on the same cluster (run afterwards, in this run).

Targets: the job completes through every event; every node kill is detected within 10 s; coordinator kills
cost 0 steps; no node is quarantined (none misbehaves: the coordinator's logs of both runs name no quarantine).

Usage: python -m bench.chaos [--node-kills 100 --coordinator-kills 5] [--quick]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a path (python bench/chaos.py): imports resolve from the checkout
    sys.path.insert(0, str(ROOT))

from bench.faults import (DriverConfig, FaultSchedule, bench_parser, false_quarantines, final_loss,  # noqa: E402
                          fmt, print_targets, run_bench)

DETECTION_TARGET_S = 10.0


def main() -> int:
    ap = bench_parser(__doc__, node_kills=100, restart_after=1.0, lease=8.0, out="bench-chaos",
                      quick_help="3 node kills and 1 coordinator kill on 3 nodes: a check that fits a loaded machine")
    ap.add_argument("--coordinator-kills", type=int, default=5)
    ap.add_argument("--outage", type=float, default=5.0, help="seconds the coordinator stays down")
    args = ap.parse_args()
    if args.quick:
        args.node_kills, args.coordinator_kills, args.nodes = 3, 1, 3
    schedule = FaultSchedule(node_kills=args.node_kills, coordinator_kills=args.coordinator_kills, seed=args.seed)
    cfg = DriverConfig(nodes=args.nodes, gap_steps=args.gap_steps, restart_after=args.restart_after,
                       outage=args.outage, lease=args.lease, pace="detection")
    res = run_bench(cfg, schedule, args, f"chaos: tiny job on {cfg.nodes} nodes; {args.node_kills} node kill(s) "
                    f"(restarted {cfg.restart_after:g}s after their detection), {args.coordinator_kills} coordinator "
                    f"kill(s) (down {cfg.outage:g}s), lease {cfg.lease:g}s, the next event once the one before was "
                    f"detected and {cfg.gap_steps} steps trained since", targets=4)
    if res is None:
        return 1
    events, losses, base = res.driver.events, res.losses, res.base

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
    print(f"coordinator kills: {len(coords)}; steps rolled back {coord_cost}; every node back after "
          f"{[fmt(e.detection_s) for e in coords]}s; time to the next step {[fmt(e.next_step_s) for e in coords]}s; "
          f"{'; '.join(e.note for e in coords)}")
    if losses and base:
        fl, fb = final_loss(losses), final_loss(base)
        print(f"final loss (mean of the last 10 steps): {fl:.4f} disturbed vs {fb:.4f} undisturbed "
              f"({100 * (fl - fb) / fb:+.2f}%)")
    elif res.base_error:
        print(f"no final loss comparison: the undisturbed run {res.base_error}")

    targets = {
        f"the job completes through all {len(schedule.events())} events": res.completed,
        f"every node kill detected within {DETECTION_TARGET_S:g}s": bool(kills) and len(detected) == len(kills)
        and max(detected) <= DETECTION_TARGET_S,
        "coordinator kills cost 0 steps": bool(coords) and all(c == 0 for c in coord_cost),
    }
    name, ok = false_quarantines(res)
    targets[name] = ok
    return print_targets(targets, res)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


if __name__ == "__main__":
    raise SystemExit(main())
