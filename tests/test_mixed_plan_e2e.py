"""One plan that uses every runtime feature at once, through `atoll coordinator --plan` and four `atoll node`
processes: unequal stage widths (2 then 1), ZeRO-1 on the first stage's two replicas, per-layer recomputation,
a deeper in-flight window, and a tensor-parallel (tp = 2) second stage. Its losses match one process."""

from __future__ import annotations

from pathlib import Path

import pytest
from pipeline_harness import tiny_job

STEPS = 5


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_plan_mixing_every_feature_runs_through_the_coordinator(tmp_path: Path) -> None:
    from atoll.launch.localcluster import LocalCluster
    from atoll.node.local import train_local
    from atoll.plan import PipelinePlan, Plan, StagePlan

    job = tiny_job(STEPS, nodes=4)
    job_path, plan_path, out = tmp_path / "job.toml", tmp_path / "plan.json", tmp_path / "cluster"
    job_path.write_text(job.to_toml())
    ids = {"node1": "first-0", "node2": "first-1", "node3": "second-tp0", "node4": "second-tp1"}
    plan = Plan(model="tiny", global_batch=16, seq_len=64, pipelines=[PipelinePlan(
        micro_batch=4, num_micro_batches=4, stages=[
            StagePlan(island="a", layers=(0, 3), dp=2, zero=1, recompute_layers=[1, 2], in_flight=1,
                      nodes=["first-0", "first-1"]),
            StagePlan(island="b", layers=(3, 6), dp=1, tp=2, nodes=["second-tp0", "second-tp1"])])])
    plan.validate(job.model.n_layers + 2)
    plan.save(plan_path)
    expected, _ = train_local(job)
    with LocalCluster(job_path=job_path, out=out, profile_seconds=1.0) as cluster:
        cluster.start_coordinator(extra=["--plan", str(plan_path)])
        for name, node_id in ids.items():  # known before the nodes start, so the plan can name them
            cluster.start_node(name, node_id=node_id)
        losses = cluster.wait_losses(STEPS, 200)
        status = cluster.status()
    stages = status.plan.pipelines[0].stages
    assert [(s.dp, s.tp, s.zero, list(s.recompute_layers), s.in_flight) for s in stages] == [
        (2, 1, 1, [1, 2], 1), (1, 2, 0, [], 0)]
    logs = "".join((out / f"{name}.log").read_text() for name in ("node1", "node2"))
    assert "stage 0: ZeRO-1 over its 2 replicas" in logs, "the first stage should shard its optimizer state"
    for s in range(STEPS):
        assert abs(losses[s] - expected[s]) <= 1e-4 * abs(expected[s]), (s, losses[s], expected[s])
