"""`atoll demo`: a coordinator and three nodes on this machine train the tiny GPT.

The same commands a person would type on four machines (`atoll coordinator`, `atoll node` x3), started as
local processes; the demo follows the job through `GetStatus`, shows a progress bar with the loss, and at
the end writes the loss curve and the plan picture into its output folder.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("atoll.launch.demo")

SubParsers = "argparse._SubParsersAction[argparse.ArgumentParser]"


def register(sub: SubParsers) -> None:  # type: ignore[valid-type]
    p = sub.add_parser(
        "demo", help="train the tiny GPT with a coordinator and three nodes on this machine",
        description="Start a coordinator and three nodes on this machine (separate processes talking gRPC over "
        "loopback), train the job, show progress, and write the loss curve and the plan picture.")
    p.add_argument("--job", default="examples/tiny.toml", help="job spec (default: examples/tiny.toml)")
    p.add_argument("--nodes", type=int, default=3, help="nodes to start (default: 3)")
    p.add_argument("--out", default="runs/demo", help="output folder: logs, state, checkpoints, pictures")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    p.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from atoll.coordinator.planner.report import format_plan
    from atoll.job import JobSpec
    from atoll.launch.localcluster import LocalCluster
    from atoll.serde import plan_from_proto
    from atoll.launch.viz import draw_loss_curve, draw_plan_picture

    job = JobSpec.load(args.job)
    # nodes sharing this machine split its cores; more threads than cores slows everyone many times over
    threads = max(1, (os.cpu_count() or 1) // args.nodes)
    cluster = LocalCluster(job_path=Path(args.job), out=Path(args.out), threads_per_node=threads)
    last = None
    with cluster:
        address = cluster.start_coordinator()
        print(f"coordinator on {address}; starting {args.nodes} nodes (logs in {cluster.out}/)")
        for i in range(args.nodes):
            cluster.start_node(f"node{i + 1}", extra=["--exit-when-done"])
        deadline = time.monotonic() + args.timeout
        bar = tqdm(total=job.train.steps, desc="training", unit="step", dynamic_ncols=True)
        announced = 0
        while time.monotonic() < deadline:
            if "coordinator" in cluster.procs and cluster.procs["coordinator"].poll() is not None:
                cluster.check_alive()
            try:
                last = cluster.status()
            except Exception as e:  # the coordinator may be busy planning; ask again
                log.debug("status: %s", e)
                time.sleep(0.5)
                continue
            if last.HasField("plan") and last.plan.epoch != announced:
                announced = last.plan.epoch
                plan = plan_from_proto(last.plan)
                tqdm.write(f"plan epoch {plan.epoch}, nodes {', '.join(sorted(plan.node_addresses))}:\n"
                           + format_plan(plan))
            # the coordinator's own summary: the latest loss and the step it belongs to
            done = last.loss_step + 1 if last.has_loss else 0
            bar.update(done - bar.n)
            if last.has_loss:
                bar.set_postfix(loss=f"{last.loss:.3f}", tok_s=f"{last.tokens_per_second:,.0f}")
            if done >= job.train.steps:
                break
            time.sleep(0.25)
        bar.close()
        losses = cluster.losses()  # every step, from the coordinator's store
        if len(losses) < job.train.steps:
            raise TimeoutError(f"the job reached step {len(losses)} of {job.train.steps} in {args.timeout:.0f}s; "
                               f"see the logs in {cluster.out}/")
    steps = sorted(losses)
    curve = draw_loss_curve(steps, [losses[s] for s in steps], cluster.out / "loss.png",
                            title=f"{job.name}: loss per step")
    print(f"loss {losses[steps[0]]:.3f} -> {losses[steps[-1]]:.3f} over {len(steps)} steps; "
          f"{last.tokens_per_second:,.0f} tokens/s at the end")
    print(f"loss curve: {curve}")
    if last is not None and last.HasField("plan"):
        picture = draw_plan_picture(plan_from_proto(last.plan), job.model_spec, cluster.out / "plan.png")
        print(f"plan picture: {picture}")
    return 0
