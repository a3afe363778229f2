"""End to end across regions: two regions of two hosts on the geo testbed (20 Mbit/s, 50 ms between them)
train as outer-mode replica groups; one node of lab-b is SIGKILLed mid-run. lab-a trains on without
restarting while lab-b is replanned, and the job finishes."""

from __future__ import annotations

import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench tree is not installed
from bench.geo import geo_testbed, geo_unavailable  # noqa: E402

from atoll.job import JobSpec  # noqa: E402
from atoll.launch.localcluster import LocalCluster  # noqa: E402
from atoll.serde import plan_from_proto  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STEPS = 70
INNER = 5
_REASON = geo_unavailable()

pytestmark = [pytest.mark.integration, pytest.mark.netns, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

NODES = {"a0": "lab-a-0", "a1": "lab-a-1", "b0": "lab-b-0", "b1": "lab-b-1"}
_LOADED = re.compile(r"loaded layers \[\d+, \d+\) from the checkpoint")


def _job(tmp: Path) -> Path:
    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=STEPS, warmup=5),
                  checkpoint=replace(job.checkpoint, interval=10),
                  cluster=replace(job.cluster, expected_nodes=4, min_nodes=1),
                  outer=replace(job.outer, mode="outer", inner_steps=INNER, deadline_seconds=5.0))
    path = tmp / "job-regions.toml"
    path.write_text(job.to_toml())
    return path


def _node_ids(cluster: LocalCluster) -> dict[str, str]:
    out = {}
    for name in NODES:
        f = cluster.out / name / "node_id"
        if f.is_file() and f.read_text().strip():
            out[name] = f.read_text().strip()
    return out


def _reports(cluster: LocalCluster) -> list:
    """Every step report kept by the coordinator, in the order it stored them."""
    from atoll.coordinator.store import SqliteStore

    if not cluster.state_db.is_file():
        return []
    store = SqliteStore(cluster.state_db, read_only=True)
    try:
        return store.recent_steps(limit=1_000_000)
    finally:
        store.close()


def _why(cluster: LocalCluster, name: str) -> str:
    """What a failed assertion needs to be understood: the coordinator's plans and the node's warnings."""
    plans = [ln for ln in (cluster.out / "coordinator.log").read_text().splitlines()
             if "plan epoch" in ln or "failed" in ln]
    node = [ln for ln in (cluster.out / f"{name}.log").read_text().splitlines()
            if " W " in ln or " E " in ln or "epoch" in ln]
    return "coordinator:\n" + "\n".join(plans[-20:]) + f"\n{name}:\n" + "\n".join(node[-30:])


def _latest(cluster: LocalCluster, ids: list[str]) -> int:
    return max((r.step for r in _reports(cluster) if r.node_id in ids), default=-1)




@pytest.mark.timeout(240)
def test_a_region_loses_a_node_and_the_other_trains_on(tmp_path: Path) -> None:
    with geo_testbed(regions={"lab-a": 2, "lab-b": 2}, wan_bits_per_s=20e6, wan_latency_ms=50,
                     cpu_quota=0.45) as tb, LocalCluster(job_path=_job(tmp_path), out=tmp_path / "run") as cluster:
        # the regions define the islands (probes of a busy 2-core machine vary too much to part them)
        cluster.start_coordinator(host=tb.coordinator, extra=["--island-threshold", "0.001"])
        for name, host in NODES.items():
            cluster.start_node(name, host=tb.host(host))

        first = cluster.wait_status(lambda s: s.plan.epoch >= 1 and len(_node_ids(cluster)) == 4, 60, "the plan", dead=frozenset())
        plan = plan_from_proto(first.plan)
        assert plan.mode == "outer", plan.mode
        assert len(plan.groups) == 2, [g.name for g in plan.groups]
        ids = _node_ids(cluster)
        a_ids, b_ids = [ids["a0"], ids["a1"]], [ids["b0"], ids["b1"]]
        groups = sorted(sorted(n for p in g.pipelines for st in plan.pipelines[p].stages for n in st.nodes)
                        for g in plan.groups)
        assert groups == sorted([sorted(a_ids), sorted(b_ids)]), (groups, ids)  # one group per region
        # each group trains STEPS // H rounds, however many inner steps a round (a round's steps are numbered to end
        # at a multiple of H)
        a_last = max(1, STEPS // plan.outer.inner_steps) * plan.outer.inner_steps - 1

        # a few rounds in both groups
        cluster.wait_status(lambda s: min(_latest(cluster, a_ids), _latest(cluster, b_ids)) >= 3 * INNER, 90,
              f"both groups at step {3 * INNER}", dead=frozenset())
        loaded_before = {n: len(_LOADED.findall((cluster.out / f"{n}.log").read_text())) for n in ("a0", "a1")}
        victim = "b1"
        cluster.procs[victim].kill()
        cluster.procs[victim].wait(10)
        dead = frozenset({victim})
        killed_at, a_at_kill = time.monotonic(), _latest(cluster, a_ids)
        assert a_at_kill < a_last, f"lab-a had finished ({a_at_kill}) before the kill; raise STEPS"

        # lab-a keeps stepping while lab-b is replanned
        cluster.wait_status(lambda s: _latest(cluster, a_ids) >= a_at_kill + 3, 30, "lab-a to step on after the kill",
              dead=dead)
        a_soon = _latest(cluster, a_ids)
        soon_s = time.monotonic() - killed_at

        # the job finishes: lab-a reports its last step (each round may wait out the deadline for the replanned
        # lab-b, whose speed the coordinator has not measured yet: on a slow machine that is minutes)
        final = cluster.wait_status(lambda s: _latest(cluster, a_ids) >= a_last, 150, f"lab-a's last step {a_last}",
                                    dead=dead)
        replanned = plan_from_proto(final.plan)
        reports = _reports(cluster)

        # lab-a never restarted: no new "loaded layers" line, its steps never went backwards
        for n in ("a0", "a1"):
            text = (cluster.out / f"{n}.log").read_text()
            assert len(_LOADED.findall(text)) == loaded_before[n], f"{n} reloaded a checkpoint:\n{text[-3000:]}"
            steps = [r.step for r in reports if r.node_id == ids[n]]
            assert steps == sorted(steps), (f"{n}'s steps went backwards: {steps}\n{_why(cluster, n)}")
        assert a_soon > a_at_kill, (a_at_kill, a_soon, soon_s)
        assert replanned.epoch > plan.epoch, "lab-b was never replanned"
        assert ids[victim] not in replanned.node_addresses
        # no process but the killed one exited with an error
        errors = {n: p.returncode for n, p in cluster.procs.items() if n != victim and p.poll() not in (None, 0)}
        assert not errors, f"exited with errors: {errors}; logs in {cluster.out}"
