"""Stage state under mutual TLS, end to end: nodes that joined with the CA hash alone hand a leaving node's live
state over to a node that was idle (so the leaver, which follows no more plans, cannot know its layers), and
the job loses no step. The churn tests run the same scenarios in plaintext (`tests/test_no_rollback.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from atoll.coordinator.islands import IslandOptions
from atoll.coordinator.membership import MembershipOptions
from atoll.coordinator.service import CoordinatorService, ServiceConfig
from atoll.coordinator.state import CoordinatorOptions
from atoll.job import JobSpec
from scripted_cluster import TOKEN, ScriptedCluster, scripted_planner

REPO = Path(__file__).resolve().parent.parent
STEPS = 30


class TlsCluster(ScriptedCluster):
    """`ScriptedCluster` whose coordinator serves mutual TLS under its job CA and whose nodes get `--ca-hash`."""

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        options = CoordinatorOptions(membership=MembershipOptions(lease=timedelta(seconds=self.lease),
                                                                  settle=timedelta(seconds=0.5),
                                                                  join_settle=timedelta(seconds=1)),
                                     islands=IslandOptions(relative_threshold=0.001), dial_back=False)
        self.service = CoordinatorService(job=self.job, token=TOKEN, options=options,
                                          config=ServiceConfig(tick=timedelta(milliseconds=100), mutual_tls=True,
                                                               state_dir=self.out / "coordinator"),
                                          planner=scripted_planner(self.job, self.layouts)).start()
        self.procs: dict[str, subprocess.Popen] = {}
        (self.out / "token").write_text(TOKEN + "\n")

    def start_node(self, name: str, *, region: str, checkpoint_dir: Path | None = None) -> None:
        state = self.out / name
        state.mkdir(parents=True, exist_ok=True)
        (state / "node_id").write_text(name + "\n")
        args = [sys.executable, "-m", "atoll", "node", "--coordinator", self.service.address, "--token-file",
                str(self.out / "token"), "--ca-hash", self.service.authority.fingerprint, "--listen", "127.0.0.1:0",
                "--state-dir", str(state), "--checkpoint-dir", str(checkpoint_dir or state / "checkpoints"),
                "--threads", "1", "--profile-seconds", "1", "--region", region]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with open(self.out / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                start_new_session=True)


def _job(nodes: int) -> JobSpec:
    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    return replace(job, train=replace(job.train, steps=STEPS, warmup=5),
                   checkpoint=replace(job.checkpoint, interval=0),
                   compression=replace(job.compression, mode="identity"),
                   cluster=replace(job.cluster, expected_nodes=nodes, min_nodes=1),
                   outer=replace(job.outer, mode="sync"))


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_graceful_leave_hands_its_state_to_an_idle_node_over_mutual_tls(tmp_path: Path) -> None:
    layouts = {frozenset({"a", "b1", "c"}): [((0, 3), ["a"]), ((3, 6), ["b1"])],
               frozenset({"a", "c"}): [((0, 3), ["a"]), ((3, 6), ["c"])]}
    cluster = TlsCluster(job=_job(3), out=tmp_path, layouts=layouts)
    try:
        for n in ("a", "b1", "c"):
            cluster.start_node(n, region="lab")
        cluster.wait(lambda: cluster.top_step() >= 8, 150, "step 8")
        leaver = cluster.terminate("b1")
        left_at = cluster.top_step()
        cluster.wait(lambda: len(cluster.losses()) >= STEPS, 200, "the job to finish", dead=["b1"])
        assert leaver.wait(60) == 0
        runs = cluster.resumes("c")
        assert runs, cluster.log("c")
        step, how, was, back = runs[0]
        assert (how, back) == ("live state", 0) and step == was >= left_at, runs
        assert [src for _, src, _ in cluster.transfers("c")] == ["b1"]
        assert "PERMISSION_DENIED" not in cluster.log("a") + cluster.log("c") + cluster.log("b1")
    finally:
        cluster.stop()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_checkpoint_copies_and_their_fetch_pass_the_state_rules_over_mutual_tls(tmp_path: Path) -> None:
    """a1's checkpoint is copied to b1 (a1 grants the file, b1 takes it only from a1's own certificate); a1
    is killed and b2, idle until then, fetches layers [0, 3) from b1's copy: the plan now gives it them."""
    interval, steps = 5, 40
    layouts = {frozenset({"a1", "a2", "b1", "b2"}): [((0, 3), ["a1"]), ((3, 6), ["b1"])],
               frozenset({"a2", "b1", "b2"}): [((0, 3), ["b2"]), ((3, 6), ["b1"])]}
    job = _job(4)
    job = replace(job, train=replace(job.train, steps=steps), checkpoint=replace(job.checkpoint, interval=interval,
                                                                                 replicas=1))
    cluster = TlsCluster(job=job, out=tmp_path, layouts=layouts)
    try:
        for name in ("a1", "a2", "b1", "b2"):
            cluster.start_node(name, region=f"site-{name[0]}")

        def copied() -> bool:
            return any(r.node_id == "b1" and (r.layer_start, r.layer_end) == (0, 3) and r.step >= interval
                       for r in cluster.service.store.list_checkpoints())
        cluster.wait(copied, 150, "a copy of a1's checkpoint on b1")
        cluster.kill("a1")
        cluster.wait(lambda: len(cluster.losses()) >= steps, 200, "the job to finish", dead=["a1"])
        resumed = cluster.plan().resume_step
        moved = [t for t in cluster.transfers("b2") if "copy" not in t[2]]
        assert [(src, what) for _, src, what in moved] == [
            ("b1", f"checkpoint of step {resumed}, layers [0, 3)")], moved
        assert "PERMISSION_DENIED" not in "".join(cluster.log(n) for n in ("a1", "a2", "b1", "b2"))
    finally:
        cluster.stop()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_joiner_takes_a_running_stages_live_state_over_mutual_tls(tmp_path: Path) -> None:
    """b2 joins a running stage: b1 serves it its layers' live state once it too follows the plan naming b2."""
    # a joining process starts, profiles and is probed before it is planned: the job must outlast that under load
    # (200 steps, 11 s here, once ended before b2 was planned with another test running beside it); the test ends,
    # killing every process, as soon as b2 resumed
    steps = 5000
    layouts = {frozenset({"a", "b1"}): [((0, 3), ["a"]), ((3, 6), ["b1"])],
               frozenset({"a", "b1", "b2"}): [((0, 3), ["a"]), ((3, 6), ["b1", "b2"])]}
    job = _job(2)
    cluster = TlsCluster(job=replace(job, train=replace(job.train, steps=steps)), out=tmp_path, layouts=layouts)
    try:
        for n in ("a", "b1"):
            cluster.start_node(n, region="lab")
        cluster.wait(lambda: cluster.top_step() >= 3, 150, "step 3")
        cluster.start_node("b2", region="lab")
        cluster.wait(lambda: bool(cluster.resumes("b2")), 200, "b2 to resume")
        step, how, was, back = cluster.resumes("b2")[0]
        assert (how, back) == ("live state", 0), cluster.resumes("b2")
        assert [src for _, src, _ in cluster.transfers("b2")] == ["b1"]
        assert "PERMISSION_DENIED" not in "".join(cluster.log(n) for n in ("a", "b1", "b2"))
    finally:
        cluster.stop()
