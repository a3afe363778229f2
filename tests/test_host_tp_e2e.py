"""End to end: two node processes on this machine with `[cluster] host_tp = true` train a job whose two nodes
pay only as one tensor-parallel stage (one sequence a step: no data parallelism; a pipeline of one micro-batch
runs its stages in turn). The coordinator plans tp 2 over the machine's two nodes and the losses match one
process."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from atoll.job import JobSpec
from atoll.launch.localcluster import LocalCluster
from atoll.node.local import train_local
from atoll.serde import plan_from_proto

REPO = Path(__file__).resolve().parent.parent
STEPS = 6

pytestmark = pytest.mark.integration


def _job() -> JobSpec:
    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    return replace(job, model=replace(job.model, d_model=256, n_heads=4, ffn_hidden=1024),
                   train=replace(job.train, steps=STEPS, warmup=2, global_batch=1, micro_batch=1),
                   checkpoint=replace(job.checkpoint, interval=0),
                   cluster=replace(job.cluster, expected_nodes=2, min_nodes=2, host_tp=True),
                   outer=replace(job.outer, mode="sync"))


@pytest.mark.timeout(240)
def test_two_nodes_of_one_machine_run_a_tensor_parallel_stage(tmp_path: Path) -> None:
    job = _job()
    path = tmp_path / "job.toml"
    path.write_text(job.to_toml())
    with LocalCluster(job_path=path, out=tmp_path / "run") as cluster:
        cluster.start_coordinator()
        for name in ("n1", "n2"):
            cluster.start_node(name, extra=["--threads", "1"])
        status = cluster.wait_status(lambda s: s.plan.epoch >= 1, 120, "a plan")
        plan = plan_from_proto(status.plan)
        stages = [s for p in plan.pipelines for s in p.stages]
        assert [(s.dp, s.tp) for s in stages] == [(1, 2)], (plan.predicted, [(s.layers, s.dp, s.tp) for s in stages])
        cluster.wait_status(lambda s: len(cluster.losses()) >= STEPS, 150, f"{STEPS} steps")
        got = cluster.losses()
    want, _ = train_local(job)
    for step in range(STEPS):
        assert got[step] == pytest.approx(want[step], rel=1e-4), (step, got[step], want[step])
