"""Churn benchmark: one run of the tiny job with random node kills, joins of new nodes and graceful leaves.

The driver of `bench.chaos` (`bench.faults`) on a `LocalCluster`: `--node-kills` SIGKILLs of a random node (each
restarted on its state dir after `--restart-after` s), `--joins` new nodes started, `--leaves` SIGTERMs of a
random node (a graceful leave, not restarted), in a random order, each once the cluster has recovered from the
one before. Per event it prints the detection time, the time to the next whole step, the steps rolled back and
the bytes of state moved (what the nodes' logs say they fetched from live replicas or checkpoint copies; "n/a"
where they say nothing); then the loss curve against an undisturbed run of the same job to the same step on the
same cluster (run afterwards, in this run), as figures and as a picture (`OUT/loss.png`).

Steps rolled back per event are what the nodes said: each run of a plan logs where it resumed (`resume: step R
(live state | checkpoint; ...); the job was at step M: K steps rolled back`), and an event costs the most any
run resumed in its window rolled back (0 when no plan was made in it).

The job's global batch (`--global-batch`, 240 by default) lets the planner give an added node a share of the
rows: the busiest replica's rows a step (at most 4 a micro-batch) fall with every width up to 8 (240, 120, 80,
60, 48, 40, 36, 30), where with the tiny job's 16 they fall only at widths 2, 3, 4, 6 and 8 (a fifth replica
leaves the busiest one 4 rows, as with four), and the compute a step makes the data-parallel all-reduce cheap
beside it. Stages then run data-parallel replicas, so a kill usually hits a stage with a live replica. A joining
node may still be left idle: the planner cuts one island into stages of equal width (5 nodes: one stage of 5, or
two of 2 and one node idle) and may take the 5-way all-reduce to be slower when the probes measured
milliseconds of latency (a loaded machine); the event table says so for such a join.

Targets: a kill of a node whose stage has a live replica rolls back 0 steps and trains the next step within
15 s; a join rolls back 0 steps; the final loss is within 1% of the undisturbed run's; no node is quarantined
(none misbehaves: the coordinator's logs of both runs name no quarantine).

Usage: python -m bench.churn [--node-kills 20 --joins 10 --leaves 2] [--quick]
"""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a path (python bench/churn.py): imports resolve from the checkout
    sys.path.insert(0, str(ROOT))

from atoll.job import JobSpec  # noqa: E402
from bench.faults import (TINY, DriverConfig, Event, FaultSchedule, _log_time, bench_parser,  # noqa: E402
                          false_quarantines, final_loss, fmt, log_lines, print_targets, run_bench)

NEXT_STEP_TARGET_S = 15.0
LOSS_TARGET = 0.01
GLOBAL_BATCH = 240

RESUME = re.compile(r"resume: step (\d+) \((live state|checkpoint);.*?\); the job was at step (\d+): (\d+) steps "
                    r"rolled back")


def resumes_in_logs(logs: list[Path], start: float, end: float) -> list[tuple[str, int, str, int]]:
    """(node log, step resumed at, "live state" | "checkpoint", steps rolled back) of every run whose `resume:`
    line is stamped within [start, end) (stamps have whole seconds: a line of the start's second counts)."""
    out = []
    for log, line in log_lines(logs):
        m = RESUME.search(line)
        t = _log_time(line, start) if m else None
        if m and t is not None and int(start) <= t < end:
            out.append((log.stem, int(m[1]), m[2], int(m[4])))
    return out


def count_rollbacks(events: list[Event], logs: list[Path], end: float) -> None:
    """Set each event's steps rolled back from what the runs resumed in its window said (see the docstring)."""
    ordered = sorted(events, key=lambda e: e.at)
    for i, e in enumerate(ordered):
        until = ordered[i + 1].at if i + 1 < len(ordered) else end
        runs = resumes_in_logs(logs, e.at, until)
        e.rolled_back = max((back for _, _, _, back in runs), default=0)
        kinds = sorted({how for _, _, how, _ in runs})
        said = (f"{len(runs)} run(s) resumed from {' and '.join(kinds)}" if runs else "no run resumed")
        e.note = "; ".join(x for x in (e.note, said) if x)


def churn_job(out: Path, global_batch: int) -> Path:
    """The tiny job with `global_batch` sequences a step (the rest as examples/tiny.toml)."""
    job = JobSpec.load(TINY)
    job = replace(job, train=replace(job.train, global_batch=global_batch))
    path = out / "churn-job.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(job.to_toml())
    return path


def loss_picture(base: dict[int, float], losses: dict[int, float], events: list[Event], path: Path) -> None:
    """The loss by step of both runs, with a line at the step of each event."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.plot(sorted(base), [base[s] for s in sorted(base)], color="0.6", lw=3.0, alpha=0.7, label="undisturbed")
    ax.plot(sorted(losses), [losses[s] for s in sorted(losses)], color="tab:blue", lw=1.0, label="with churn")
    colours = {"node-kill": "tab:red", "join": "tab:green", "leave": "tab:orange", "coordinator-kill": "tab:purple"}
    seen: set[str] = set()
    for e in events:
        ax.axvline(max(e.step, 0), color=colours.get(e.kind, "k"), lw=0.7, alpha=0.6,
                   label=e.kind if e.kind not in seen else None)
        seen.add(e.kind)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("tiny job: loss with node kills, joins and leaves against the undisturbed run")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def main() -> int:
    ap = bench_parser(__doc__, node_kills=20, restart_after=10.0, lease=8.0, out="bench-churn",
                      quick_help="2 node kills, 1 join and 1 leave on 3 nodes: a check that fits a loaded machine")
    ap.add_argument("--joins", type=int, default=10)
    ap.add_argument("--leaves", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=GLOBAL_BATCH,
                    help="sequences a step (the tiny job's micro-batch is 4); see the module's docstring")
    args = ap.parse_args()
    if args.quick:
        args.node_kills, args.joins, args.leaves, args.nodes = 2, 1, 1, 3
    schedule = FaultSchedule(node_kills=args.node_kills, joins=args.joins, leaves=args.leaves, seed=args.seed)
    cfg = DriverConfig(nodes=args.nodes, gap_steps=args.gap_steps, restart_after=args.restart_after, lease=args.lease,
                       outage=min(5.0, args.lease / 2), job=churn_job(args.out, args.global_batch))
    res = run_bench(cfg, schedule, args, f"churn: tiny job (global batch {args.global_batch}) on {cfg.nodes} nodes; "
                    f"{args.node_kills} node kill(s) (down {cfg.restart_after:g}s each), {args.joins} join(s), "
                    f"{args.leaves} graceful leave(s); lease {cfg.lease:g}s", targets=4,
                    before_table=lambda r: count_rollbacks(r.driver.events, sorted((args.out / "disturbed").glob(
                        "node*.log")), float("inf")))
    if res is None:
        return 1
    events, losses, base = res.driver.events, res.losses, res.base

    kills = [e for e in events if e.kind == "node-kill"]
    replicated = [e for e in kills if e.live_replica]
    joins = [e for e in events if e.kind == "join"]
    leaves = [e for e in events if e.kind == "leave"]
    for name, group in (("kills with a live replica", replicated), ("kills without one", [e for e in kills
                                                                                        if not e.live_replica]),
                        ("joins", joins), ("leaves", leaves)):
        if group:
            moved = [e.state_bytes for e in group if e.state_bytes is not None]
            print(f"{name}: {len(group)}; rolled back {[e.rolled_back for e in group]} steps; next step after "
                  f"{[fmt(e.next_step_s) for e in group]} s; state moved "
                  f"{f'{sum(moved):,} bytes' if moved else 'n/a (no node reported a state transfer)'}")
    loss_ok = False
    if losses and base:
        fl, fb = final_loss(losses), final_loss(base)
        loss_ok = res.completed and abs(fl - fb) <= LOSS_TARGET * fb
        print(f"final loss (mean of the last 10 steps): {fl:.4f} with churn vs {fb:.4f} undisturbed "
              f"({100 * (fl - fb) / fb:+.2f}%)")
        marks = sorted(base)[:: max(1, len(base) // 8)]
        print("loss by step (undisturbed / with churn): " + ", ".join(
            f"{s}: {base[s]:.3f}/{fmt(losses.get(s), '.3f')}" for s in marks))
        picture = args.out / "loss.png"
        loss_picture(base, losses, events, picture)
        print(f"loss curves: {picture}")

    targets = {
        f"kills of a node with a live replica: 0 steps rolled back, next step within {NEXT_STEP_TARGET_S:g}s":
            bool(replicated) and all(e.rolled_back == 0 and e.next_step_s is not None
                                     and e.next_step_s <= NEXT_STEP_TARGET_S for e in replicated),
        "joins: 0 steps rolled back": bool(joins) and all(e.rolled_back == 0 for e in joins),
        f"final loss within {100 * LOSS_TARGET:g}% of the undisturbed run's": loss_ok,
    }
    if not replicated:
        print("note: no kill hit a node whose stage had a live replica")
    name, ok = false_quarantines(res)
    targets[name] = ok
    return print_targets(targets, res)


if __name__ == "__main__":
    raise SystemExit(main())
