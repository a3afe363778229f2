"""Adversary benchmark: one faulty or lying node per run of a 6-node job, and what it costs the job.

The tiny job on a coordinator and six `atoll node` processes on this machine (`LocalCluster`), pinned to two
stages of three replicas each (stage 0: a0 a1 a2, stage 1: b0 b1 b2, so the door of every stage-1 node sees what
stage 0 sends and stage 0's replicas verify each other). One case per run:

- `clean`: no fault (the baseline; checks on) and `checks-off`: every node with `ATOLL_CHECKS=off` (the checks' cost);
- through the test-only seam `ATOLL_FAULT` (`atoll.node.faults`) on node a1, from step `--fault-step`: `nan` and
  `huge` activations (one micro-batch on a quarter of its steps), `bitflip` (each element of what it sends, one
  random bit flipped with probability 1e-4), `noise` (Gaussian noise at 1% of each activation's norm), and the
  control `slow` (an honest node, each forward and backward 5x as long), which must never be quarantined;
- through the real gRPC API under a member's own certificate (read from its state dir): `forged-end` (stage-0 node
  a0 and last-stage node b0 report the job's last step with a made-up loss), `forged-loss` (a0 reports losses of
  current steps; last-stage node b0 a made-up loss for each of the next steps before its true reports, and losses
  500 steps ahead: a0's and the far ones are refused, the rest outvoted by b1 and b2, and b0 named and quarantined), `fake-failures` (a0 reports 20 failures in 10 s), `join-replay` (a
  token holder joins once, then sends the same join three more times);
- damaged state: `node-disk` (a0, stage 0's checkpoint writer, writes onto a 32 MB tmpfs that is filled at step
  `--fault-step`), `coordinator-disk` (the coordinator's state dir on a tmpfs filled at that step and freed 6 s later).

Per case: whether the job finished, its final loss (mean of the last 10 steps, each step's loss as the coordinator's
history holds it: the median of the last stage's reports, one per node) against the clean run's, steps lost
(rolled back by restarts, plus skipped steps), steps from the fault to the faulty node's quarantine, nodes
quarantined that did nothing wrong, the run's tokens/s; and for the claims cases what the coordinator answered.

Targets (issue 38): every case finishes within 1% of the clean run's final loss; the faulty node is quarantined
within 50 steps (nan, huge, bitflip), the 1%-noise stage within 200; 0 false quarantines in any run (the slow
control included); the checks cost at most 3% of a stage's step, so of tokens/s, on the tiny job and a 125M-class
job (judged by `bench.check_cost`, run at the end: the tokens/s of the clean and checks-off runs are printed beside
it, but six node processes on a shared machine move them by more than the checks cost); every forged claim and
replayed join is refused and the fake failures make at most 2 plans; each damaged-state case ends in recovery with one clear line.

The outer-mode variant, `poisoned-pseudo-gradient`: three replica groups of one node each (a0, b0, c0 in regions
lab-a, lab-b, lab-c; 60 steps in rounds of 5, each blocking on its exchange, so that two runs train alike), c0
serving its pseudo-gradient x 1000 from the fault step on (`ATOLL_FAULT=poison:1000`); its baseline `clean-outer`
runs first. Printed: whether the job finished, its final loss against the clean outer run, the rounds the
coordinator left c0's group out of and how it named it (its log), and exclusions in the clean outer run (targets:
c0's group out of every round from the fault's on but the job's last, no other group, none in the clean run).

The disk cases mount a tmpfs and need root; without it they are reported as not run.

Usage: python -m bench.adversary [--quick] [--steps 120] [--cases nan,noise,...,poisoned-pseudo-gradient]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a path (python bench/adversary.py): imports resolve from the checkout
    sys.path.insert(0, str(ROOT))

STAGE0, STAGE1 = ["a0", "a1", "a2"], ["b0", "b1", "b2"]
FAULTY = "a1"
FORGER = "b0"
"""forged-loss: the last-stage node that forges losses (outvoted by b1 and b2, named, quarantined)."""
GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN = 24, 6, 64
QUARANTINE_WITHIN = {"nan": 50, "huge": 50, "bitflip": 50, "noise": 200}
FAULTS = {"nan": "nan:0.25", "huge": "huge:0.25", "bitflip": "bitflip:1e-4", "noise": "noise:0.01", "slow": "slow:5"}
CLAIMS = ("forged-end", "forged-loss", "fake-failures", "join-replay")
DISKS = ("node-disk", "coordinator-disk")
OUTER = ("poisoned-pseudo-gradient",)
OUTER_NODES = {"a0": "lab-a", "b0": "lab-b", "c0": "lab-c"}
"""The outer-mode variant: three replica groups of one node each, one per region."""
POISONER = "c0"
OUTER_INNER_STEPS, OUTER_STEPS = 5, 60
POISON = "poison:1000"
"""What `POISONER` serves from the fault step on: its pseudo-gradient x 1000 (`atoll.node.faults`)."""
ALL_CASES = ("clean", "checks-off", "nan", "huge", "bitflip", "noise", "slow", *CLAIMS, *DISKS, *OUTER)
QUICK_CASES = ("clean", "checks-off", "nan", "forged-end", "slow", "node-disk")
LOSS_TOLERANCE = 0.01
FULL_FOR_S = 6.0
"""How long the coordinator's state disk stays full (the job goes on meanwhile)."""
CHECK_COST_TARGET = 0.03


@dataclass
class Result:
    case: str
    finished: bool = False
    losses: dict[int, float] = field(default_factory=dict)
    rolled_back: int = 0
    skipped: int = 0
    quarantined: dict[str, int] = field(default_factory=dict)
    """node -> the step the status first showed it quarantined."""
    tokens_per_s: float | None = None
    epochs: int = 0
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    ok: dict[str, bool] = field(default_factory=dict)
    """Case-specific checks (a claim refused, one clear line...), each a target."""
    not_run: str = ""
    exclusions: list[tuple[int, str]] = field(default_factory=list)
    """Outer mode: (round, the line naming the groups left out as outliers) of each exclusion."""
    forged_steps: list[int] = field(default_factory=list)
    """forged-loss: the steps b0 forged a loss of within the step window."""

    def final_loss(self, last: int = 10) -> float | None:
        tail = sorted(self.losses)[-last:]
        return statistics.fmean(self.losses[s] for s in tail) if tail else None


# --- the job and its cluster ---------------------------------------------------------------------------------------


def write_job(path: Path, steps: int) -> Path:
    from atoll.job import JobSpec

    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=steps, warmup=5, global_batch=GLOBAL_BATCH,
                                     micro_batch=MICRO_BATCH, seq_len=SEQ_LEN),
                  checkpoint=replace(job.checkpoint, interval=20),
                  cluster=replace(job.cluster, expected_nodes=6, min_nodes=1))
    path.write_text(job.to_toml())
    return path


def write_outer_job(path: Path) -> Path:
    """The outer-mode variant's job: the tiny model, `OUTER_STEPS` steps in rounds of `OUTER_INNER_STEPS` that block
    on the exchange (`overlap = false`), one replica group per region."""
    from atoll.job import JobSpec

    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=OUTER_STEPS, warmup=5, global_batch=GLOBAL_BATCH,
                                     micro_batch=MICRO_BATCH, seq_len=SEQ_LEN),
                  checkpoint=replace(job.checkpoint, interval=20),
                  cluster=replace(job.cluster, expected_nodes=len(OUTER_NODES), min_nodes=len(OUTER_NODES)),
                  # rounds that block until the exchange lands: with the overlapped exchange the step a group applies
                  # an average at follows the machine's timing, and two clean runs ended 1.6% apart (2.4014, 2.4070,
                  # 2.4400), more than the 1% the case is judged by; blocking, 2.3866 and 2.3862
                  outer=replace(job.outer, mode="outer", inner_steps=OUTER_INNER_STEPS, deadline_seconds=60.0,
                                overlap=False))
    path.write_text(job.to_toml())
    return path


def write_plan(path: Path, n_layers: int) -> Path:
    from atoll.plan import PipelinePlan, Plan, StagePlan

    half = n_layers // 2
    Plan(model="tiny", global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, pipelines=[PipelinePlan(
        micro_batch=MICRO_BATCH, num_micro_batches=GLOBAL_BATCH // MICRO_BATCH, stages=[
            StagePlan(island="a", layers=(0, half), dp=3, nodes=list(STAGE0)),
            StagePlan(island="b", layers=(half, n_layers), dp=3, nodes=list(STAGE1))])]).save(path)
    return path


def can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


def mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          timeout=30)
    return done.returncode == 0


def umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def fill(disk: Path) -> Path:
    filler = disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    return filler


# --- the adversary: a member speaking through the real API under its own certificate -------------------------------


class Member:
    """A coordinator stub under node `node_id`'s certificate (its state dir's key and certificate)."""

    def __init__(self, cluster, node_id: str):
        from atoll.node.credentials import NodeCredentials
        from atoll.rpc import RpcOptions, make_channel
        from atoll.v1 import atoll_pb2_grpc as pb_grpc

        creds = NodeCredentials(cluster.out / node_id, node_id=node_id, token=cluster.token,
                                coordinator_ca_pem=cluster.ca_file.read_bytes())
        self.node_id = node_id
        self.channel = make_channel(cluster.address, creds.coordinator_rpc(RpcOptions()), token=cluster.token)
        self.stub = pb_grpc.CoordinatorStub(self.channel)

    def call(self, method: str, request) -> str:
        """The status code's name the coordinator answered ("OK" when it took the request)."""
        import grpc

        try:
            getattr(self.stub, method)(request, timeout=10)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name

    def close(self) -> None:
        self.channel.close()


def forge_end(cluster, res: Result, status) -> None:
    from atoll.v1 import atoll_pb2 as pb

    last = status.target_steps - 1
    answers = []
    for node, stage in (("a0", 0), ("b0", 1)):
        m = Member(cluster, node)
        for _ in range(3):
            answers.append(m.call("ReportStep", pb.StepMetrics(
                job_id=status.job.job_id, node_id=node, plan_epoch=status.plan.epoch, step=last, pipeline=0,
                stage=stage, has_loss=True, loss=0.1234, tokens=GLOBAL_BATCH * SEQ_LEN, step_seconds=0.1,
                unix_time=time.time())))
        m.close()
    res.notes.append(f"forged job ends at step {last} (a0 x3, b0 x3) answered: {', '.join(answers)}")
    res.ok["forged job end not taken"] = True  # judged at the end: the job trained every step


FORGED_LOSS = 0.001
FORGED_AHEAD = range(3, 11)
"""The steps past the newest one the status showed whose loss last-stage node b0 forges (before its true reports)."""


def forge_losses(cluster, res: Result, status) -> None:
    from atoll.v1 import atoll_pb2 as pb

    answers = {}
    for who, node, stage, steps in (("a0", "a0", 0, [status.step + k for k in range(5)]),
                                    ("b0 (in step)", "b0", 1, [status.step + k for k in FORGED_AHEAD]),
                                    ("b0 (500 ahead)", "b0", 1, [status.step + 500 + k for k in range(5)])):
        m = Member(cluster, node)
        got = []
        for step in steps:
            got.append(m.call("ReportStep", pb.StepMetrics(
                job_id=status.job.job_id, node_id=node, plan_epoch=status.plan.epoch, step=step,
                pipeline=0, stage=stage, has_loss=True, loss=FORGED_LOSS, tokens=GLOBAL_BATCH * SEQ_LEN,
                step_seconds=0.1, unix_time=time.time())))
        answers[who] = got
        m.close()
    res.forged_steps = [status.step + k for k in FORGED_AHEAD]
    res.notes.append("forged losses answered: " + "; ".join(f"{n}: {', '.join(a)}" for n, a in answers.items()))
    res.ok["forged losses of a0 and b0 500 steps ahead refused"] = \
        all(a != "OK" for who, got in answers.items() if who != "b0 (in step)" for a in got)


def fake_failures(cluster, res: Result, status) -> None:
    from atoll.v1 import atoll_pb2 as pb

    m = Member(cluster, "a0")
    before = cluster.status().plan.epoch
    answers = []
    for _ in range(20):
        s = cluster.status()
        answers.append(m.call("ReportFailure", pb.RunFailure(
            job_id=s.job.job_id, node_id="a0", plan_epoch=s.plan.epoch, step=s.step, reason="fake failure")))
        time.sleep(0.5)
    m.close()
    time.sleep(3)
    plans = cluster.status().plan.epoch - before
    res.notes.append(f"20 fake failure reports: {answers.count('OK')} taken, the rest "
                     f"{', '.join(sorted(set(a for a in answers if a != 'OK'))) or '-'}; {plans} new plan(s)")
    res.ok["fake failures make at most 2 plans"] = plans <= 2


def join_replay(cluster, res: Result, status) -> None:
    import tempfile

    from atoll.node.credentials import NodeCredentials
    from atoll.rpc import RpcOptions, make_channel
    from atoll.v1 import atoll_pb2 as pb
    from atoll.v1 import atoll_pb2_grpc as pb_grpc

    with tempfile.TemporaryDirectory() as tmp:
        creds = NodeCredentials(Path(tmp), node_id="intruder", token=cluster.token,
                                coordinator_ca_pem=cluster.ca_file.read_bytes())
        boot = make_channel(cluster.address, creds.coordinator_rpc(RpcOptions()), token=cluster.token)
        stub = pb_grpc.CoordinatorStub(boot)
        try:
            challenge = stub.JoinChallenge(pb.JoinChallengeRequest(token=cluster.token, node_id="intruder"),
                                           timeout=10).challenge
            profile = pb.NodeProfile(hostname="intruder", device_kind="cpu", device_name="cpu", device_count=1,
                                     memory_total_bytes=1 << 30, memory_free_bytes=1 << 30, cpu_count=1)
            join = pb.JoinRequest(token=cluster.token, node_id="intruder", job_id=status.job.job_id,
                                  profile=profile, peer_address="", csr_pem=creds.csr(challenge))
            import grpc

            answers = []
            for _ in range(4):
                try:
                    stub.Join(join, timeout=10)
                    answers.append("OK")
                except grpc.RpcError as e:
                    answers.append(e.code().name)
        finally:
            boot.close()
    res.notes.append(f"a join, then the same join three times: {', '.join(answers)}")
    res.ok["every replayed join refused"] = answers[0] == "OK" and all(a == "PERMISSION_DENIED" for a in answers[1:])


ADVERSARIES: dict[str, Callable] = {"forged-end": forge_end, "forged-loss": forge_losses,
                                    "fake-failures": fake_failures, "join-replay": join_replay}


# --- one run -------------------------------------------------------------------------------------------------------


def run_case(case: str, args: argparse.Namespace, out: Path) -> Result:
    from atoll.job import JobSpec
    from atoll.launch.localcluster import LocalCluster

    res = Result(case)
    run = out / case
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    job_path = write_job(run / "job.toml", args.steps)
    plan_path = write_plan(run / "plan.json", JobSpec.load(job_path).model_spec.num_layers)
    env: dict[str, dict[str, str]] = {n: {} for n in STAGE0 + STAGE1}
    if case == "checks-off":
        env = {n: {"ATOLL_CHECKS": "off"} for n in env}
    if case in FAULTS:
        env[FAULTY] = {"ATOLL_FAULT": f"{FAULTS[case]}@{args.fault_step}"}
    mounts: list[Path] = []
    disk = None
    if case in DISKS:
        if not can_mount():
            res.not_run = "mounting a tmpfs takes root"
            return res
        disk = run / "ckpt-disk" if case == "node-disk" else run / "cluster" / "coordinator"
        if not mount_tmpfs(disk, "32m" if case == "node-disk" else "64m"):
            res.not_run = "this machine does not let mount a tmpfs"
            return res
        mounts.append(disk)
    cluster = LocalCluster(job_path=job_path, out=run / "cluster", profile_seconds=1.0)
    started = time.monotonic()
    filled = freed = None
    acted = False
    try:
        cluster.start_coordinator(extra=["--plan", str(plan_path)])
        for n in STAGE0 + STAGE1:
            extra = ["--checkpoint-dir", str(disk)] if case == "node-disk" and n == "a0" else None
            cluster.start_node(n, node_id=n, env=env[n], extra=extra)
        deadline = started + args.timeout
        last = None
        while time.monotonic() < deadline:
            try:
                s = cluster.status(timeout=5)
            except Exception:  # noqa: BLE001 - a busy coordinator misses a poll; the next one asks again
                time.sleep(1)
                continue
            last = s
            for o in s.offenders:
                if o.quarantined and o.node_id not in res.quarantined:
                    res.quarantined[o.node_id] = s.step
            if s.job_state == "finished":
                res.finished = True
                break
            if s.plan.epoch >= 1 and s.step >= args.fault_step and not acted:
                acted = True
                if case in ADVERSARIES:
                    threading.Thread(target=ADVERSARIES[case], args=(cluster, res, s), daemon=True).start()
                if disk is not None:
                    fill(disk)
                    filled = time.monotonic()
            if case == "coordinator-disk" and filled is not None and freed is None \
                    and time.monotonic() - filled > FULL_FOR_S:
                (disk / "filler").unlink(missing_ok=True)
                freed = time.monotonic()
            time.sleep(0.5)
        res.wall_s = time.monotonic() - started
        if case == "coordinator-disk" and filled is not None and freed is None:  # the job ended first
            (disk / "filler").unlink(missing_ok=True)
            freed = time.monotonic()
        # the nodes leave once they have delivered their last reports (the end is decided on the first of them);
        # a coordinator whose disk was full writes what it queued at its next try
        settle = time.monotonic() + 60
        while time.monotonic() < settle and (
                any(p.poll() is None for n, p in cluster.procs.items() if n != "coordinator")
                or (case == "coordinator-disk" and "has space again" not in
                    (run / "cluster" / "coordinator.log").read_text(errors="replace"))):
            time.sleep(0.5)
        if last is not None:
            res.epochs = last.plan.epoch
            if case == "node-disk":
                res.notes.append("under-replicated shown: " + ("; ".join(last.under_replicated) or "no (closed)"))
        reports = cluster.step_reports()
        history = recorded_losses(cluster)
    finally:
        cluster.stop()
        for m in mounts:
            umount(m)
    res.losses = history
    res.rolled_back = max((r.steps_rolled_back for r in reports), default=0)
    res.skipped = len({r.step for r in reports if r.offences})
    res.tokens_per_s = tokens_per_s(reports)
    logs = {p.stem: p.read_text(errors="replace") for p in (run / "cluster").glob("*.log")}
    tracebacks = sum(t.count("Traceback") for t in logs.values())
    if tracebacks:
        res.notes.append(f"{tracebacks} traceback(s) in the logs")
    if case == "node-disk":
        a0 = logs.get("a0", "")
        lines = sum(1 for line in a0.splitlines() if "could not be written" in line)
        asked = any("asks this node to write its stage's checkpoints too" in logs.get(n, "") for n in ("a1", "a2"))
        res.notes.append(f"a0 said so in {lines} line(s) (an error's cause is logged once a minute); a stand-in "
                         f"asked: {asked}")
        res.ok["node disk: said so, a stand-in writes"] = lines >= 1 and asked and not tracebacks
    if case == "coordinator-disk":
        c = logs.get("coordinator", "")
        said = c.count("state disk is full")
        back = "has space again" in c
        res.notes.append(f"coordinator: 'state disk is full' said {said} time(s), flushed when freed: {back}")
        res.ok["coordinator disk: said once, flushed"] = said == 1 and back and not tracebacks
    if case == "forged-end":
        res.ok["forged job end not taken"] = res.finished and len(res.losses) >= args.steps
    if case == "forged-loss":
        kept = {s: res.losses.get(s) for s in res.forged_steps}
        res.notes.append("recorded loss of the steps b0 forged: " +
                         ", ".join(f"{s}: {fmt(x, '.4f')}" for s, x in kept.items()))
        res.ok["no forged loss recorded"] = bool(kept) and all(x is None or x > 100 * FORGED_LOSS
                                                                for x in kept.values())
        res.ok["b0 quarantined for its forged losses"] = "b0" in res.quarantined
    return res


EXCLUDED = re.compile(r"outer round (\d+): left out as outliers: (.*)")


def run_outer_case(case: str, args: argparse.Namespace, out: Path) -> Result:
    """`clean-outer` or `poisoned-pseudo-gradient`: the outer-mode job of three one-node replica groups, node
    `POISONER` serving a poisoned pseudo-gradient from the fault step on in the latter; the rounds' exclusions
    (the coordinator's log) in `Result.exclusions`."""
    from atoll.launch.localcluster import LocalCluster

    res = Result(case)
    run = out / case
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    job_path = write_outer_job(run / "job.toml")
    cluster = LocalCluster(job_path=job_path, out=run / "cluster", profile_seconds=1.0)
    started = time.monotonic()
    try:
        cluster.start_coordinator()
        for n, region in OUTER_NODES.items():
            env = {"ATOLL_FAULT": f"{POISON}@{args.fault_step}"} if case != "clean-outer" and n == POISONER else {}
            cluster.start_node(n, node_id=n, region=region, env=env)
        deadline = started + args.timeout
        while time.monotonic() < deadline:
            try:
                s = cluster.status(timeout=5)
            except Exception:  # noqa: BLE001 - a busy coordinator misses a poll; the next one asks again
                time.sleep(1)
                continue
            for o in s.offenders:
                if o.quarantined and o.node_id not in res.quarantined:
                    res.quarantined[o.node_id] = s.step
            res.epochs = s.plan.epoch
            if s.job_state == "finished":
                res.finished = True
                break
            time.sleep(0.5)
        res.wall_s = time.monotonic() - started
        settle = time.monotonic() + 60
        while time.monotonic() < settle and any(p.poll() is None for n, p in cluster.procs.items()
                                                if n != "coordinator"):
            time.sleep(0.5)
        reports = cluster.step_reports()
        history = recorded_losses(cluster)
    finally:
        cluster.stop()
    res.losses = history
    res.tokens_per_s = tokens_per_s(reports)
    log = (run / "cluster" / "coordinator.log").read_text(errors="replace")
    res.exclusions = [(int(m.group(1)), m.group(2).strip()) for m in EXCLUDED.finditer(log)]
    rounds = sorted({r for r, _ in res.exclusions})
    named = sorted({POISONER in line for _, line in res.exclusions})
    res.notes.append(f"{len(res.exclusions)} group contribution(s) left out as outliers"
                     + (f", rounds {rounds[0]}-{rounds[-1]} ({len(rounds)}); e.g. {res.exclusions[0][1]}"
                        if rounds else ""))
    if case == "clean-outer":
        res.ok["0 false exclusions"] = not res.exclusions
    else:
        # the node serves a poisoned pseudo-gradient from the first round starting at or past the fault step; every
        # round from there but the job's last (which may end it before it is decided) must leave it out
        first = -(-args.fault_step // OUTER_INNER_STEPS)
        last = OUTER_STEPS // OUTER_INNER_STEPS - 1
        res.ok[f"{POISONER}'s group left out and named in rounds {first}-{last - 1}, no other group"] = \
            named == [True] and set(range(first, last)) <= set(rounds) and min(rounds) >= first
    return res


def recorded_losses(cluster) -> dict[int, float]:
    """Each step's loss as the coordinator's history holds it (`atoll.coordinator.claims.LossVotes`: the median of
    the loss holders' reports, one per node)."""
    if not cluster.state_db.is_file():
        return {}
    with cluster.read_store() as store:
        return {p.first: p.loss for p in store.history() if p.width == 1 and p.loss is not None}


def tokens_per_s(reports: list, skip: int = 10) -> float | None:
    """Tokens/s of the job from its loss reports: steps after the first `skip`, between the first and last report."""
    times: dict[int, float] = {}
    for r in reports:
        if r.loss is not None and r.step >= skip:
            times[r.step] = max(times.get(r.step, 0.0), r.unix_time)
    if len(times) < 5:
        return None
    steps = sorted(times)
    span = times[steps[-1]] - times[steps[0]]
    return (len(steps) - 1) * GLOBAL_BATCH * SEQ_LEN / span if span > 0 else None


# --- the table -----------------------------------------------------------------------------------------------------


def fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def report(results: list[Result], args: argparse.Namespace, extra: list[Result]) -> dict[str, bool]:
    """Print the table and return the targets; `extra`: more clean and checks-off runs, for the checks' cost."""
    bases = {c: next((r.final_loss() for r in results if r.case == c), None) for c in ("clean", "clean-outer")}
    rows = [["case", "finished", "final loss", "vs clean", "rolled back", "skipped", "quarantined (steps after fault)",
             "false q.", "tokens/s", "plans", "wall s"]]
    targets: dict[str, bool] = {}
    for r in results:
        if r.not_run:
            rows.append([r.case, f"not run: {r.not_run}"] + [""] * 9)
            continue
        loss = r.final_loss()
        base = bases["clean-outer" if r.case == "clean-outer" or r.case in OUTER else "clean"]
        rel = None if loss is None or base is None else loss / base - 1
        faulty = FAULTY if r.case in QUARANTINE_WITHIN else {"forged-loss": FORGER}.get(r.case)
        after = {n: s - args.fault_step for n, s in r.quarantined.items()}
        false = [n for n in r.quarantined if n != faulty]
        rows.append([r.case, "yes" if r.finished else "NO", fmt(loss, ".4f"), fmt(None if rel is None else 100 * rel,
                    "+.2f") + ("%" if rel is not None else ""), str(r.rolled_back), str(r.skipped),
                     ", ".join(f"{n} ({a})" for n, a in after.items()) or "-", str(len(false)),
                     fmt(r.tokens_per_s, ",.0f"), str(r.epochs), f"{r.wall_s:.0f}"])
        if r.case not in ("checks-off", "clean-outer"):
            targets[f"{r.case}: finished, final loss within 1% of clean"] = r.finished and rel is not None \
                and abs(rel) <= LOSS_TOLERANCE
        targets[f"{r.case}: 0 false quarantines"] = not false
        if r.case in QUARANTINE_WITHIN:
            within = QUARANTINE_WITHIN[r.case]
            targets[f"{r.case}: {faulty} quarantined within {within} steps"] = \
                faulty in after and after[faulty] <= within
        for name, ok in r.ok.items():
            targets[f"{r.case}: {name}"] = ok
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for r in results:
        for note in r.notes:
            print(f"  {r.case}: {note}")
    ons = [r.tokens_per_s for r in results + extra if r.case == "clean" and r.tokens_per_s]
    offs = [r.tokens_per_s for r in results + extra if r.case == "checks-off" and r.tokens_per_s]
    if ons and offs:
        on, off = max(ons), max(offs)  # the best of each: a shared machine only ever slows a run down
        cost = 1 - on / off
        print(f"checks' cost: {on:,.0f} tokens/s with the checks (best of {', '.join(f'{x:,.0f}' for x in ons)}), "
              f"{off:,.0f} without (best of {', '.join(f'{x:,.0f}' for x in offs)}): {100 * cost:+.1f}% "
              f"(target <= {100 * CHECK_COST_TARGET:.0f}%)")
        if abs(cost) > 3 * CHECK_COST_TARGET:
            print("  (the runs differ by more than the checks can cost: the machine's load decides this figure)")
    if args.cost_models:
        # judged on the checks' time in a stage's step (`bench.check_cost`): six node processes on a shared machine
        # move tokens/s by more than the checks cost, run to run
        from bench.check_cost import main as check_cost

        print(f"\nthe checks' cost in a stage's step (python -m bench.check_cost --models {args.cost_models}):",
              flush=True)
        targets["the checks cost <= 3% of a step (bench.check_cost: " + args.cost_models + ")"] = \
            check_cost(["--models", args.cost_models]) == 0
    return targets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"{len(QUICK_CASES)} cases ({', '.join(QUICK_CASES)}) of 60 steps: a check that fits a "
                         f"loaded machine")
    ap.add_argument("--steps", type=int, default=None, help="steps of each run (default 120; --quick: 60)")
    ap.add_argument("--fault-step", type=int, default=None,
                    help="the step the fault starts (default 20; --quick: 15): after the door's warm-up")
    ap.add_argument("--cases", default=None, help=f"comma-separated, of: {', '.join(ALL_CASES)} (clean always runs)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds each run may take (default 40 + 2.5 x steps)")
    ap.add_argument("--cost-runs", type=int, default=None,
                    help="runs with and without the checks each, for their cost (default 2; --quick: 1)")
    ap.add_argument("--cost-models", default=None,
                    help="jobs whose checks' cost in a stage's step is measured and judged (bench.check_cost; "
                         "default tiny,125m; --quick: tiny; '' for none)")
    ap.add_argument("--out", default="bench-adversary", help="folder for the runs' logs")
    args = ap.parse_args()
    if args.cost_models is None:
        args.cost_models = "tiny" if args.quick else "tiny,125m"
    args.steps = args.steps or (60 if args.quick else 120)
    args.fault_step = args.fault_step or (15 if args.quick else 20)
    args.timeout = args.timeout or 40 + 2.5 * args.steps
    args.cost_runs = args.cost_runs or (1 if args.quick else 2)
    cases = [c.strip() for c in args.cases.split(",")] if args.cases else list(QUICK_CASES if args.quick else ALL_CASES)
    unknown = [c for c in cases if c not in ALL_CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; the cases are {', '.join(ALL_CASES)}")
    if "clean" not in cases and any(c not in OUTER for c in cases):
        cases.insert(0, "clean")
    if any(c in OUTER for c in cases):  # the outer variant's own baseline, before its first case
        cases.insert(min(cases.index(c) for c in OUTER if c in cases), "clean-outer")
    if args.fault_step >= args.steps - 10:
        ap.error(f"--fault-step {args.fault_step} leaves fewer than 10 of the {args.steps} steps after it")
    out = Path(args.out).resolve()
    print(f"adversary: the tiny job, {args.steps} steps, 2 stages x 3 replicas on 6 local nodes; one case per run, "
          f"the fault from step {args.fault_step} on node {FAULTY} (ATOLL_FAULT) or through a member's certificate")
    if any(c in OUTER for c in cases):
        print(f"  outer-mode variant: {len(OUTER_NODES)} one-node replica groups in {len(OUTER_NODES)} regions, "
              f"{OUTER_STEPS} steps in rounds of {OUTER_INNER_STEPS}, {POISONER} serving a poisoned pseudo-gradient")
    results = []
    for i, case in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {case} ...", flush=True)
        res = (run_outer_case if case == "clean-outer" or case in OUTER else run_case)(case, args, out)
        print(f"[{i}/{len(cases)}] {case}: {'not run (' + res.not_run + ')' if res.not_run else 'finished' if res.finished else 'NOT finished'}"
              f" in {res.wall_s:.0f}s; quarantined: {res.quarantined or '-'}", flush=True)
        results.append(res)
    extra = []
    for k in range(1, args.cost_runs):  # more runs with and without the checks, alternating, for their cost
        for case in ("checks-off", "clean"):
            print(f"[cost {k}/{args.cost_runs - 1}] {case} ...", flush=True)
            extra.append(run_case(case, args, out / f"cost{k}"))
    targets = report(results, args, extra)
    missed = [name for name, ok in targets.items() if not ok]
    print(f"targets met: {len(targets) - len(missed)}/{len(targets)}" + (f" (missed: {'; '.join(missed)})" if missed
                                                                           else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
