"""A CPU-limited node profiles at the speed it will train at: its cgroup quota scales thread CPU times."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

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


# --- on the geo testbed: a host's quota seen from inside its network namespace ---------------------------------

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench tree is not installed
from bench.geo import geo_testbed, geo_unavailable  # noqa: E402

_GEO = geo_unavailable()
QUOTA = 0.25
_PROFILE = """
import json, statistics, sys, time
import torch
torch.set_num_threads(1)  # as a CPU node trains
from atoll.job import JobSpec
from atoll.node.model import build_layer
from atoll.node.profiler import ProfileOptions, cpu_share, profile_node
job = JobSpec.load(sys.argv[1])
mb = job.train.micro_batch
prof = profile_node(job, "cpu", ProfileOptions(micro_batches=(mb,), repeats=5))
t = next(x for x in prof.layer_timings if x.layer_kind == "block" and x.micro_batch == mb)
# the speed it trains at: a block's forward and backward in wall time, over many of the quota's 100 ms periods
block = build_layer(job.model, 1)
x = torch.randn(mb, job.train.seq_len, job.model.d_model)
runs, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < 2.0:
    block(x.requires_grad_(True)).square().mean().backward()
    runs += 1
print(json.dumps({"share": cpu_share(), "profiled": t.forward_seconds + t.backward_seconds,
                  "wall": (time.perf_counter() - t0) / runs}))
"""


@pytest.mark.netns
@pytest.mark.timeout(180)
@pytest.mark.skipif(_GEO is not None, reason=_GEO or "")
def test_a_node_in_a_testbed_host_profiles_at_its_quotas_speed() -> None:
    """A node started in a testbed host (its network namespace and its CPU cgroup) reads the host's quota, and its
    profile's block times are what a block takes there in wall time: not a whole core's speed (with `ip netns
    exec`, whose fresh /sys hides /sys/fs/cgroup, it profiled 1 / QUOTA times too fast)."""
    job = Path(__file__).resolve().parents[1] / "examples" / "tiny.toml"
    with geo_testbed(regions={"q": 1}, cpu_quota=QUOTA) as tb:
        out = tb.hosts[0].run([sys.executable, "-c", _PROFILE, str(job)], timeout=150)
    got = json.loads(out.strip().splitlines()[-1])
    assert math.isclose(got["share"], QUOTA)
    # the profile predicts the wall time within the noise of a shared machine: a second test worker can slow the
    # timed runs after the profile (0.597 seen), so the bound sits at 0.4; a profile blind to the quota reads 1 /
    # QUOTA = 4x too fast (0.25 at most, less under load)
    assert 0.4 < got["profiled"] / got["wall"] < 1.6, got
