"""`atoll demo`: a coordinator and three nodes on this machine train the tiny GPT.

The same commands a person would type on four machines (`atoll coordinator`, `atoll node` x3), started as
local processes; the demo follows the job through `GetStatus` and the coordinator's store, shows a progress
bar with the loss, and at the end writes the loss curve and the plan picture into its output folder.

A run left in the output folder by an earlier demo is replaced by a fresh one, unless `--resume` asks to
continue it. SIGINT, SIGTERM and SIGHUP stop the coordinator and the nodes before the demo exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from pathlib import Path

from atoll.argtypes import count, seconds

log = logging.getLogger("atoll.launch.demo")

SubParsers = "argparse._SubParsersAction[argparse.ArgumentParser]"

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def register(sub: SubParsers) -> None:  # type: ignore[valid-type]
    p = sub.add_parser(
        "demo", help="train the tiny GPT with a coordinator and three nodes on this machine",
        description="Start a coordinator and three nodes on this machine (separate processes talking gRPC over "
        "loopback), train the job, show progress, and write the loss curve and the plan picture. Runs from any "
        "folder; paths are relative to the current one. An earlier run in --out is replaced by a fresh one "
        "unless --resume is given.")
    p.add_argument("--job", default="examples/tiny.toml",
                   help="job spec (default: examples/tiny.toml, the tiny GPT installed with atoll)")
    p.add_argument("--nodes", type=count(most=64, what="a node count"), default=3, help="nodes to start (default: 3)")
    p.add_argument("--out", default="runs/demo", help="output folder: logs, state, checkpoints, pictures "
                   "(default: runs/demo)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out (one stopped early) instead of starting a fresh one")
    p.add_argument("--stall-timeout", type=seconds(), default=300.0, metavar="SECONDS",
                   help="give up when no step has finished for this long, start-up included (default: 300)")
    p.add_argument("--timeout", type=seconds(), default=None, metavar="SECONDS",
                   help="give up after this long in all (default: no limit, however many steps the job has)")
    p.set_defaults(func=run_demo)


class _Stopped(Exception):
    """A stop signal arrived."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _StopSignals:
    """The handler of STOP_SIGNALS: the first one raises _Stopped where the demo is, unless the shutdown has begun
    (`disarm`); later ones are only noted, so nothing cuts the shutdown short."""

    def __init__(self) -> None:
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def __call__(self, signum: int, _frame: object) -> None:
        if self.armed:
            self.armed = False
            raise _Stopped(signum)


def _prepare(out: Path, job_id: str, steps: int, resume: bool) -> int | None:
    """Make `out` ready for the run: the steps an earlier run reported, which a resumed one starts from (0 for a
    fresh run); None when there is nothing to train (a finished run to resume)."""
    from atoll.launch.localcluster import clear_run, stored_run

    previous = stored_run(out)
    if previous is None:
        return 0
    old_id, reached = previous
    if not resume:
        print(f"{out} holds an earlier run (job {old_id}, {reached} steps); starting a fresh one in its place "
              f"(--resume continues a run instead)")
        clear_run(out)
        return 0
    if old_id != job_id:
        raise ValueError(f"cannot resume: {out} holds job {old_id}, and the job spec is now {job_id} (it changed "
                         f"since); run without --resume for a fresh run, or give another --out")
    if reached >= steps:
        print(f"the run in {out} already finished its {steps} steps; run without --resume to train again")
        return None
    print(f"resuming the run in {out} from its last checkpoint ({reached} of {steps} steps were reported)")
    return reached


def run_demo(args: argparse.Namespace) -> int:
    from atoll.inputs import input_path
    from atoll.job import JobSpec
    from atoll.launch.localcluster import ProcessExited

    job_path = input_path(args.job)
    job = JobSpec.load(job_path)
    out = Path(args.out)
    if args.nodes < 1:
        raise ValueError(f"--nodes must be at least 1, got {args.nodes}")
    start = _prepare(out, job.id, job.train.steps, args.resume)
    if start is None:
        return 0
    stop = _StopSignals()
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        return _train(args, job, job_path, out, stop, start)
    except _Stopped as e:
        print(f"stopped by {e}: the coordinator and the nodes are shut down; --resume continues the run")
        return 128 + e.signum
    except ProcessExited as e:
        log.error("%s", e)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _train(args: argparse.Namespace, job, job_path: Path, out: Path, stop: _StopSignals, start: int = 0) -> int:
    """Run the job on a local cluster with a progress bar; `start`: the steps an earlier run reported (--resume),
    where the bar starts, so its rate and time left count only what this run trains."""
    from tqdm import tqdm

    from atoll.coordinator.planner.report import format_plan
    from atoll.launch.localcluster import LocalCluster
    from atoll.serde import plan_from_proto

    # nodes sharing this machine split its cores; more threads than cores slows everyone many times over
    threads = max(1, (os.cpu_count() or 1) // args.nodes)
    cluster = LocalCluster(job_path=job_path, out=out, threads_per_node=threads)
    steps = job.train.steps
    started = time.monotonic()
    last = None  # the latest status
    reached = start  # steps done, by the coordinator's latest loss
    try:
        address = cluster.start_coordinator()
        print(f"coordinator on {address}; starting {args.nodes} nodes (logs in {cluster.out}/)")
        tls = "--insecure" if cluster.insecure else f"--tls-ca {cluster.ca_file}"
        print(f"from another terminal: atoll status --coordinator {address} --token-file {cluster.token_file} {tls} "
              f"(atoll job stop/extend take the same flags)")
        for i in range(args.nodes):
            cluster.start_node(f"node{i + 1}", extra=["--exit-when-done"])
        announced = 0
        progressed = read_losses = time.monotonic()
        with tqdm(total=steps, initial=min(start, steps), desc="training", unit="step", dynamic_ncols=True) as bar:
            while reached < steps:
                now = time.monotonic()
                if args.timeout is not None and now - started > args.timeout:
                    raise TimeoutError(f"the job reached step {reached} of {steps} after {now - started:.0f} s, "
                                       f"the --timeout; see the logs in {cluster.out}/")
                if now - progressed > args.stall_timeout:
                    raise TimeoutError(f"no step finished in {args.stall_timeout:.0f} s (--stall-timeout); the job "
                                       f"reached step {reached} of {steps} after {now - started:.0f} s; see the "
                                       f"logs in {cluster.out}/")
                if cluster.procs["coordinator"].poll() is not None:
                    cluster.check_alive()
                if now - read_losses >= 1.0:  # the store keeps the latest reports only: read them as they come
                    cluster.losses()
                    read_losses = now
                try:
                    last = cluster.status()
                except (ConnectionError, PermissionError) as e:  # the coordinator may be busy planning
                    log.debug("status: %s", e)
                    time.sleep(0.5)
                    continue
                if last.HasField("plan") and last.plan.epoch != announced:
                    announced = last.plan.epoch
                    plan = plan_from_proto(last.plan)
                    kinds = {m.profile.device_kind for m in last.members if m.node_id in plan.node_addresses}
                    tqdm.write(f"plan epoch {plan.epoch}, nodes {', '.join(sorted(plan.node_addresses))}:\n"
                               + format_plan(plan, device_kinds=kinds))
                # `atoll job stop/extend` move the end: the bar follows the coordinator's target
                if last.target_steps and last.target_steps != steps:
                    steps = bar.total = last.target_steps
                    bar.refresh()
                if last.job_state == "finished":  # stopped early (atoll job stop), or done
                    reached = max(reached, last.target_steps)
                    bar.update(min(reached, steps) - bar.n)
                    break
                # the coordinator's own summary: the latest loss and the step it belongs to
                done = last.loss_step + 1 if last.has_loss else 0
                if done > reached:
                    reached, progressed = done, time.monotonic()
                bar.update(min(reached, steps) - bar.n)
                if last.has_loss:
                    bar.set_postfix(loss=f"{last.loss:.3f}", tok_s=f"{last.tokens_per_second:,.0f}")
                if reached < steps:
                    time.sleep(0.25)
            # the bar ends on the loss the summary below prints (the history's newest step), not on the last
            # poll's, which may be a few steps older or another pipeline's
            rows = [r for r in _history(cluster.state_db) if r.loss is not None]
            if rows:
                bar.set_postfix(loss=f"{rows[-1].loss:.3f}",
                                tok_s=f"{last.tokens_per_second:,.0f}" if last is not None else "-")
    finally:
        stop.disarm()  # from here a stop signal must not cut the shutdown short
        cluster.stop()
        # whatever ended the run, the curve of what was trained (the caller then says why it ended early): the
        # coordinator's whole-job history, which keeps every step however long the job
        _draw(job, cluster.losses(), cluster.out, last, steps, time.monotonic() - started,
              history=_history(cluster.state_db), start=start)
    return 0


def _history(state_db: Path) -> list:
    """The whole job's loss history from the coordinator's store (`atoll.coordinator.history`); [] without one."""
    from atoll.coordinator.store import SqliteStore

    if not state_db.is_file():
        return []
    store = SqliteStore(state_db, read_only=True)
    try:
        return store.history()
    finally:
        store.close()


def _draw(job, losses: dict[int, float], out: Path, last, steps: int, elapsed: float, history=None,
          start: int = 0) -> None:
    """The loss curve and the plan picture, with a line of summary; `start`: the steps an earlier run reported (a
    resumed run), so the time is said of the steps this run trained, not of the whole job's."""
    from atoll.coordinator.history import draw_history, resolution
    from atoll.launch.viz import draw_loss_curve, draw_plan_picture
    from atoll.serde import plan_from_proto

    rows = [r for r in history or [] if r.loss is not None]
    if rows:  # the store's history: every step of the job, older ones merged into buckets
        reached = rows[-1].last
        complete = reached + 1 >= steps
        curve = draw_history(rows, out / "loss.png", title=f"{job.name}: loss per step" + (
            "" if complete else f" (steps 0-{reached} of {steps})"))
        first = losses[min(losses)] if losses and min(losses) == rows[0].first else rows[0].loss
        summary = f"loss {first:.3f} -> {rows[-1].loss:.3f} over {reached + 1 - rows[0].first} steps"
        held = f" ({resolution(rows)})"
        newest = reached
    elif losses:
        ordered = sorted(losses)
        complete = ordered[-1] + 1 >= steps
        curve = draw_loss_curve(ordered, [losses[s] for s in ordered], out / "loss.png",
                                title=f"{job.name}: loss per step" + ("" if complete else
                                                                      f" (steps 0-{ordered[-1]} of {steps})"))
        summary = f"loss {losses[ordered[0]]:.3f} -> {losses[ordered[-1]]:.3f} over {len(ordered)} steps"
        held = ""
        newest = ordered[-1]
    else:
        return
    rate = f"; {last.tokens_per_second:,.0f} tokens/s at the end" if last is not None and complete else ""
    if 0 < start <= newest:  # a resumed run: its time is of the steps it trained
        print(f"{summary}, the last {newest + 1 - start} of them in this run's {elapsed:.0f} s{rate}")
    else:
        print(f"{summary} in {elapsed:.0f} s{rate}")
    print(f"loss curve: {curve}{held}")
    if last is not None and last.HasField("plan"):
        picture = draw_plan_picture(plan_from_proto(last.plan), job.model_spec, out / "plan.png")
        print(f"plan picture: {picture}")
