"""A coordinator in the test process whose plans follow a script, and `atoll node` processes around it.

The churn tests need to know which node runs which layers before and after an event (a kill, a join, a
leave), so the coordinator's planner is a table: alive node set -> stages (layer range, node ids), one
pipeline; any other set is planned by the real planner. Nodes are real processes (`python -m atoll node`,
plaintext gRPC) with fixed ids and their own checkpoint folders, so killing one is a real failure.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from atoll.coordinator.islands import IslandOptions
from atoll.coordinator.membership import MembershipOptions
from atoll.coordinator.planning import PlanInputs, finish_plan, make_plan
from atoll.coordinator.service import CoordinatorService, ServiceConfig
from atoll.coordinator.state import CoordinatorOptions
from atoll.job import JobSpec
from atoll.plan import PipelinePlan, Plan, StagePlan
from atoll.types import StepMetrics

TOKEN = "churn-token"
Layout = Sequence[tuple]
"""Per stage: (layers, node names), (layers, node names, ZeRO stage) or (layers, node names, ZeRO stage, tp): with
tp, the names are dp x tp nodes, replica-major."""

RESUME = re.compile(r"resume: step (\d+) \((live state|checkpoint); (.*?)\); the job was at step (\d+): (\d+) steps "
                    r"rolled back")
TRANSFER = re.compile(r"state transfer: (\d+) bytes from (\S+) in ([\d.]+) s \((.*)\)$", re.MULTILINE)


def scripted_planner(job: JobSpec, layouts: Mapping[frozenset[str], Layout]):
    """A `Planner`: the layout for the alive set when the script has one, else the real planner."""
    def plan(inputs: PlanInputs) -> tuple[Plan, str]:
        layout = layouts.get(frozenset(inputs.members))
        if layout is None:
            return make_plan(inputs)
        island_of = {n: i.id for i in inputs.islands for n in i.nodes}
        # 2 micro-batches of 8 rows: a stage of 2 replicas runs 4 rows of each
        p = Plan(model=job.model.name, global_batch=job.train.global_batch, seq_len=job.train.seq_len,
                 islands=list(inputs.islands), pipelines=[PipelinePlan(
                     micro_batch=job.train.global_batch // 2, num_micro_batches=2,
                     stages=[StagePlan(island=island_of[nodes[0]], layers=layers,
                                       dp=len(nodes) // (more[1] if len(more) > 1 else 1), nodes=list(nodes),
                                       zero=more[0] if more else 0, tp=more[1] if len(more) > 1 else 1)
                             for layers, nodes, *more in layout])])
        p = finish_plan(p, inputs)
        p.validate(job.model_spec.num_layers)
        return p, "scripted"
    return plan


@dataclass
class ScriptedCluster:
    job: JobSpec
    out: Path
    layouts: Mapping[frozenset[str], Layout]
    lease: float = 4.0

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        options = CoordinatorOptions(membership=MembershipOptions(lease=timedelta(seconds=self.lease),
                                                                  settle=timedelta(seconds=0.5),
                                                                  join_settle=timedelta(seconds=1)),
                                     islands=IslandOptions(relative_threshold=0.001), dial_back=False)
        self.service = CoordinatorService(job=self.job, token=TOKEN, options=options,
                                          config=ServiceConfig(tick=timedelta(milliseconds=100)),
                                          planner=scripted_planner(self.job, self.layouts)).start()
        self.procs: dict[str, subprocess.Popen] = {}

    def start_node(self, name: str, *, region: str, checkpoint_dir: Path | None = None) -> None:
        state = self.out / name
        state.mkdir(parents=True, exist_ok=True)
        (state / "node_id").write_text(name + "\n")
        args = [sys.executable, "-m", "atoll", "node", "--coordinator", self.service.address, "--token", TOKEN,
                "--insecure", "--listen", "127.0.0.1:0", "--state-dir", str(state), "--checkpoint-dir",
                str(checkpoint_dir or state / "checkpoints"), "--threads", "1", "--profile-seconds", "1",
                "--region", region]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with open(self.out / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                start_new_session=True)

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def terminate(self, name: str) -> subprocess.Popen:
        proc = self.procs[name]
        proc.send_signal(signal.SIGTERM)
        return proc

    def plan(self) -> Plan | None:
        return self.service.state.current_plan()

    def steps(self) -> list[StepMetrics]:
        return self.service.store.recent_steps(limit=1_000_000)

    def losses(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for s in sorted(self.steps(), key=lambda s: s.unix_time):
            if s.loss is not None:
                out[s.step] = s.loss
        return out

    def top_step(self) -> int:
        return max((s.step for s in self.steps()), default=-1)

    def wait(self, until: Callable[[], bool], timeout: float, what: str, dead: Sequence[str] = ()) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if name not in dead and p.poll() is not None and p.returncode != 0:
                    raise AssertionError(f"{name} exited with code {p.returncode}: see {self.out}/{name}.log")
            if until():
                return
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; logs in {self.out}")

    def log(self, name: str) -> str:
        return (self.out / f"{name}.log").read_text(errors="replace")

    def resumes(self, name: str) -> list[tuple[int, str, int, int]]:
        """(step resumed at, "live state" | "checkpoint", step the job was at, steps rolled back) per plan run."""
        return [(int(m[1]), m[2], int(m[4]), int(m[5])) for m in RESUME.finditer(self.log(name))]

    def transfers(self, name: str) -> list[tuple[int, str, str]]:
        """(bytes, source node, what) per state transfer the node made."""
        return [(int(m[1]), m[2], m[4]) for m in TRANSFER.finditer(self.log(name))]

    def stop(self) -> None:
        for name, p in list(self.procs.items()):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
        self.service.stop()


def close(got: Mapping[int, float], expected: Sequence[float], steps, rel: float) -> None:
    for s in steps:
        assert s in got, f"no loss reported for step {s}"
        assert abs(got[s] - expected[s]) <= rel * abs(expected[s]), (s, got[s], expected[s])
