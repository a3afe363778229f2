"""Replanning on drift, end to end: `bench.drift` at a small size (a coordinator and three node processes, each in
a cgroup of its own; one node's CPU quota cut mid-run). Needs root and the cgroup v1 cpu controller."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.geo import CPU_CGROUP  # noqa: E402


@pytest.mark.integration
@pytest.mark.timeout(420)
@pytest.mark.skipif(os.geteuid() != 0 or not (CPU_CGROUP / "cpu.cfs_quota_us").is_file(),
                    reason="needs root and the cgroup v1 cpu controller (per-node CPU quotas)")
def test_a_node_slowed_mid_run_is_planned_around_without_rollback(tmp_path: Path, capsys) -> None:
    from bench.drift import main

    rc = main(["--steps", "200", "--before", "16", "--settle", "3", "--after", "10", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "targets met: 3/3" in out, out
