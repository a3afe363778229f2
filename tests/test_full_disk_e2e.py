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
