"""A CPU-limited node profiles at the speed it will train at: its cgroup quota scales thread CPU times."""

from __future__ import annotations

import math
from pathlib import Path

from atoll.node.profiler import cpu_share


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("12:memory:/x\n4:cpu,cpuacct:/atl-1/lab-a-0\n")
    base = tmp_path / "fs" / "cpu,cpuacct" / "atl-1" / "lab-a-0"
    base.mkdir(parents=True)
    (base / "cpu.cfs_quota_us").write_text("30000\n")
    (base / "cpu.cfs_period_us").write_text("100000\n")
    assert math.isclose(cpu_share(proc, tmp_path / "fs"), 0.3)
    (base / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert cpu_share(proc, tmp_path / "fs") == math.inf


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/jobs/node\n")
    base = tmp_path / "fs" / "jobs" / "node"
    base.mkdir(parents=True)
    (base / "cpu.max").write_text("50000 100000\n")
    assert math.isclose(cpu_share(proc, tmp_path / "fs"), 0.5)
    (base / "cpu.max").write_text("max 100000\n")
    assert cpu_share(proc, tmp_path / "fs") == math.inf


def test_no_cgroup_file_means_no_quota(tmp_path: Path) -> None:
    assert cpu_share(tmp_path / "missing", tmp_path) == math.inf
