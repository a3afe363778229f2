"""`atoll demo`: a coordinator and three nodes on this machine train the tiny GPT.

The same commands a person would type on four machines (`atoll coordinator`, `atoll node` x3), started as
local processes; the demo follows the job through `GetStatus`, shows a progress bar with the loss, and at
the end writes the loss curve and the plan picture into its output folder.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

log = logging.getLogger("atoll.demo")

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


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen:
    f = open(log_path, "ab")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.Popen([sys.executable, "-m", "atoll", *args], stdout=f, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise RuntimeError(f"the coordinator exited with code {proc.returncode}; see its log")
        time.sleep(0.1)
    raise TimeoutError(f"the coordinator did not write {path} within {timeout:.0f}s")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + 15
    for p in procs:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def run_demo(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from atoll.coordinator.status import fetch_status
    from atoll.job import JobSpec
    from atoll.serde import plan_from_proto
    from atoll.viz import draw_loss_curve, draw_plan_picture

    job = JobSpec.load(args.job)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    token_file = out / "token"
    token_file.write_text(secrets.token_hex(16))
    token_file.chmod(0o600)
    addr_file = out / "coordinator.address"
    addr_file.unlink(missing_ok=True)
    ckpt = out / "checkpoints"
    procs: list[subprocess.Popen] = []
    coordinator = _spawn(["coordinator", "--job", args.job, "--listen", "127.0.0.1:0", "--state-dir",
                          str(out / "coordinator"), "--token-file", str(token_file), "--address-file",
                          str(addr_file)], out / "coordinator.log")
    procs.append(coordinator)
    losses: dict[int, float] = {}
    last = None
    try:
        address = _wait_file(addr_file, coordinator, 60)
        # nodes sharing this machine split its cores; more threads than cores slows everyone many times over
        threads = max(1, (os.cpu_count() or 1) // args.nodes)
        print(f"coordinator on {address}; starting {args.nodes} nodes (logs in {out}/)")
        for i in range(args.nodes):
            procs.append(_spawn(["node", "--coordinator", address, "--token-file", str(token_file), "--listen",
                                 "127.0.0.1:0", "--state-dir", str(out / f"node{i + 1}"), "--checkpoint-dir",
                                 str(ckpt), "--threads", str(threads)], out / f"node{i + 1}.log"))
        token = token_file.read_text().strip()
        deadline = time.monotonic() + args.timeout
        bar = tqdm(total=job.train.steps, desc="training", unit="step", dynamic_ncols=True)
        announced_plan = 0
        while time.monotonic() < deadline:
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"a process exited early (code {dead[0].returncode}); see the logs in {out}/")
            try:
                last = fetch_status(address, token=token, timeout=timedelta(seconds=5))
            except Exception as e:  # the coordinator may be busy planning; try again
                log.debug("status: %s", e)
                time.sleep(0.5)
                continue
            if last.HasField("plan") and last.plan.epoch != announced_plan:
                announced_plan = last.plan.epoch
                tqdm.write(_describe(plan_from_proto(last.plan)))
            for m in last.recent_steps:
                if m.has_loss:
                    losses[m.step] = m.loss
            done = max(losses) + 1 if losses else 0
            bar.update(done - bar.n)
            if losses:
                bar.set_postfix(loss=f"{losses[max(losses)]:.3f}", tok_s=f"{last.tokens_per_second:,.0f}")
            if done >= job.train.steps:
                break
            time.sleep(0.5)
        bar.close()
        if len(losses) < job.train.steps:
            raise TimeoutError(f"the job reached step {len(losses)} of {job.train.steps} in {args.timeout:.0f}s; "
                               f"see the logs in {out}/")
    finally:
        _stop(procs[::-1])
    steps = sorted(losses)
    curve = draw_loss_curve(steps, [losses[s] for s in steps], out / "loss.png", title=f"{job.name}: loss per step")
    print(f"loss {losses[steps[0]]:.3f} -> {losses[steps[-1]]:.3f} over {len(steps)} steps; "
          f"{last.tokens_per_second:,.0f} tokens/s at the end")
    print(f"loss curve: {curve}")
    if last is not None and last.HasField("plan"):
        picture = draw_plan_picture(plan_from_proto(last.plan), job.model_spec, out / "plan.png")
        print(f"plan picture: {picture}")
    return 0


def _describe(plan) -> str:
    lines = [f"plan epoch {plan.epoch}: {len(plan.pipelines)} pipeline(s), predicted "
             f"{plan.predicted.step_time_s:.3f} s/step ({plan.predicted.bottleneck or 'no bottleneck named'})"]
    for p, pipe in enumerate(plan.pipelines):
        for s, st in enumerate(pipe.stages):
            codec = st.send.codec if st.send else "-"
            lines.append(f"  pipeline {p} stage {s}: layers [{st.layers[0]}, {st.layers[1]}) on {', '.join(st.nodes)}"
                         f" (island {st.island}), link codec {codec}")
    return "\n".join(lines)
