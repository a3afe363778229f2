"""End to end, a full checkpoint disk: the nodes' checkpoint folder (a small tmpfs) fills up mid-run. Every node
keeps training, says so in a line per checkpoint (no traceback), and the job finishes.

The disk is a real one that fills (ENOSPC from the kernel), which takes mounting a tmpfs: the test skips where that
is not allowed (not root, or no mount in the container)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from atoll.job import JobSpec
from atoll.launch.localcluster import LocalCluster

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.integration


@contextmanager
def _small_disk(path: Path, size: str = "32m") -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill takes root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()[:200]}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def _fill(disk: Path) -> None:
    """Take every free byte of `disk`."""
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass


@pytest.mark.timeout(400)
def test_a_full_checkpoint_disk_mid_run_loses_no_node_and_the_job_finishes(tmp_path: Path) -> None:
    """The finding: a full checkpoint disk made every node exit with a "No space left on device" traceback, and the
    job died at step 19."""
    steps, interval = 60, 10
    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=steps, warmup=5),
                  checkpoint=replace(job.checkpoint, interval=interval),
                  cluster=replace(job.cluster, expected_nodes=2, min_nodes=2))
    path = tmp_path / "job.toml"
    path.write_text(job.to_toml())
    with _small_disk(tmp_path / "disk") as disk:
        cluster = LocalCluster(job_path=path, out=tmp_path / "run")
        try:
            cluster.start_coordinator()
            for name in ("node1", "node2"):
                cluster.start_node(name, extra=["--checkpoint-dir", str(disk / "checkpoints")])
            cluster.wait_status(lambda s: s.plan.epoch >= 1 and s.last_checkpoint_step >= interval, 200,
                                "the first checkpoint", poll=0.2)
            _fill(disk)
            final = cluster.wait_status(lambda s: len(cluster.losses()) >= steps, 250, "the job to finish", poll=0.3)
            assert sorted(cluster.losses()) == list(range(steps))
            assert final.last_checkpoint_step < steps  # the checkpoints after the disk filled were not written
            for name in ("node1", "node2"):
                proc = cluster.procs[name]
                assert proc.wait(120) == 0, cluster.log_tails(20)
            logs = "\n".join((tmp_path / "run" / f"{n}.log").read_text() for n in ("node1", "node2"))
            assert "Traceback" not in logs, logs[-4000:]
            assert "No space left on device" in logs and "training goes on" in logs
        finally:
            cluster.stop()


@pytest.mark.timeout(400)
def test_a_writers_full_disk_makes_its_stage_under_replicated_and_another_replica_writes_it(tmp_path: Path) -> None:
    """Issue 38, item 4 (node): stage 0 runs on a1 and a2 (a pinned plan), a1 writes its checkpoints onto a small disk
    that fills. a1 keeps training and says so in one line; the coordinator records the stage as under-replicated,
    shows it in the status, and asks a2 to write the stage's checkpoints, so complete checkpoints go on after the
    disk filled (without a2 they stopped at the last one before: the first test)."""
    from atoll.coordinator.status import format_status
    from atoll.plan import PipelinePlan, Plan, StagePlan

    steps, interval = 70, 10
    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=steps, warmup=5),
                  checkpoint=replace(job.checkpoint, interval=interval),
                  cluster=replace(job.cluster, expected_nodes=3, min_nodes=3))
    path, plan_path = tmp_path / "job.toml", tmp_path / "plan.json"
    path.write_text(job.to_toml())
    n = job.model_spec.num_layers
    Plan(model="tiny", global_batch=16, seq_len=64, pipelines=[PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
        StagePlan(island="a", layers=(0, n // 2), dp=2, nodes=["a1", "a2"]),
        StagePlan(island="b", layers=(n // 2, n), nodes=["b1"])])]).save(plan_path)
    with _small_disk(tmp_path / "disk") as disk:
        cluster = LocalCluster(job_path=path, out=tmp_path / "run", profile_seconds=1.0)
        try:
            cluster.start_coordinator(extra=["--plan", str(plan_path)])
            cluster.start_node("a1", node_id="a1", extra=["--checkpoint-dir", str(disk / "checkpoints")])
            cluster.start_node("a2", node_id="a2")
            cluster.start_node("b1", node_id="b1")
            first = cluster.wait_status(lambda s: s.plan.epoch >= 1 and s.last_checkpoint_step >= interval, 200,
                                        "the first checkpoint", poll=0.2)
            _fill(disk)
            filled_at = max(first.step, first.last_checkpoint_step)
            gap = cluster.wait_status(lambda s: bool(s.under_replicated), 200, "the stage recorded under-replicated",
                                      poll=0.3)
            line = gap.under_replicated[0]
            assert f"[0, {n // 2})" in line and "a1 could not write" in line and "a2 writes them instead" in line
            assert "UNDER-REPLICATED" in format_status(gap)
            later = cluster.wait_status(lambda s: s.last_checkpoint_step >= filled_at + 2 * interval, 250,
                                        "a complete checkpoint written by the stand-in", poll=0.3)
            assert later.last_checkpoint_step > filled_at
            cluster.wait_status(lambda s: len(cluster.losses()) >= steps, 250, "the job to finish", poll=0.3)
            assert sorted(cluster.losses()) == list(range(steps))
            log = (tmp_path / "run" / "a1.log").read_text()
            assert "Traceback" not in log, log[-4000:]
            assert "No space left on device" in log and "training goes on" in log
            assert "asks this node to write its stage's checkpoints too" in (tmp_path / "run" / "a2.log").read_text()
        finally:
            cluster.stop()
