"""Replanning on drift, end to end: `bench.drift` at a small size (a coordinator and three node processes, or four in
two regions as outer-mode replica groups, each in a cgroup of its own; one node's CPU quota cut mid-run). Needs root
and the cgroup v1 cpu controller."""

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

    # the three nodes take 1.05 cores at most: under the suite's other worker they still get their quotas, so the
    # slowed node runs its 4.4x slower against them (at 0.6 each they shared the one core left, and it ran 2x)
    rc = main(["--steps", "200", "--share", "0.35", "--quota", "0.08", "--before", "16", "--settle", "3", "--after", "10",
               "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "targets met: 3/3" in out, out


@pytest.mark.integration
@pytest.mark.timeout(420)
@pytest.mark.skipif(os.geteuid() != 0 or not (CPU_CGROUP / "cpu.cfs_quota_us").is_file(),
                    reason="needs root and the cgroup v1 cpu controller (per-node CPU quotas)")
def test_a_node_slowed_in_outer_mode_has_its_group_replanned_while_the_other_runs_on(tmp_path: Path, capsys) -> None:
    """Two regions of two nodes as outer-mode replica groups; one node's quota cut: its group is planned afresh from
    the measured speeds, the other group trains on through the replan, and the rounds are short again."""
    from bench.drift import main

    rc = main(["--nodes", "4", "--regions", "2", "--share", "0.45", "--quota", "0.1", "--steps", "200",
               "--before", "16", "--settle", "3", "--after", "10", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "targets met: 3/3" in out and "kept running" in out and "planned afresh" in out, out
