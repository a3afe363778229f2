"""PlanRun: nodes as threads, real gRPC peers and gloo groups, against the job trained in one process."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from pipeline_harness import assert_losses_match, run_pinned_plan, stage, tiny_job

from atoll.job import JobSpec
from atoll.node.local import train_local
from atoll.node.peer import PeerServer
from atoll.node.runner import PlanRunner, RunContext
from atoll.plan import PipelinePlan, Plan

STEPS = 6


def _run(job: JobSpec, pipelines: list[PipelinePlan], tmp_path: Path, resume_step: int = 0,
         stop_after: int | None = None) -> dict[int, float]:
    return run_pinned_plan(job, pipelines, tmp_path / "ckpt", resume_step=resume_step, until_step=stop_after).losses


@pytest.mark.timeout(120)
def test_two_stage_pipeline_matches_one_process(tmp_path: Path) -> None:
    job = tiny_job(STEPS)
    expected, _ = train_local(job)
    got = _run(job, [PipelinePlan(micro_batch=4, num_micro_batches=4,
                                  stages=[stage((0, 3), ["a"]), stage((3, 6), ["b"])])], tmp_path)
    assert sorted(got) == list(range(STEPS))
    assert_losses_match(got, expected, 1e-4, range(STEPS))


@pytest.mark.timeout(150)
def test_two_pipelines_cut_differently_match_one_process(tmp_path: Path) -> None:
    """Pipelines with different cuts and shares average gradients per shared layer segment, by rows."""
    job = tiny_job(4)
    expected, _ = train_local(job)
    got = _run(job, [
        PipelinePlan(micro_batch=4, num_micro_batches=3, stages=[stage((0, 3), ["a"]), stage((3, 6), ["b"])]),
        PipelinePlan(micro_batch=2, num_micro_batches=2, stages=[stage((0, 2), ["c"]), stage((2, 6), ["d"])]),
    ], tmp_path)
    assert_losses_match(got, expected, 1e-4, range(4))


@pytest.mark.timeout(150)
def test_resume_from_checkpoint_under_another_cut(tmp_path: Path) -> None:
    """Checkpoint after 3 steps under one cut, resume under another: the same losses as straight through."""
    job = tiny_job(6, interval=3)
    expected, _ = train_local(job)
    first = _run(job, [PipelinePlan(micro_batch=4, num_micro_batches=4,
                                    stages=[stage((0, 2), ["a"]), stage((2, 6), ["b"])])], tmp_path, stop_after=3)
    assert sorted(first) == [0, 1, 2]
    assert (tmp_path / "ckpt" / "step-00000003" / "layers-0002-0006.pt").is_file()
    second = _run(job, [PipelinePlan(micro_batch=4, num_micro_batches=4,
                                     stages=[stage((0, 4), ["a"]), stage((4, 6), ["b"])])], tmp_path,
                  resume_step=3)
    got = {**first, **second}
    assert_losses_match(got, expected, 1e-4, range(6))


def test_a_missing_checkpoint_fails_the_run_and_says_where(tmp_path: Path) -> None:
    from atoll.node.runner import RunFailed

    job = tiny_job(STEPS)
    server = PeerServer(node_id="a", listen="127.0.0.1:0", token="t")
    try:
        plan = Plan(model="tiny", global_batch=16, seq_len=64, epoch=2, job_id="job", resume_step=5,
                    pipelines=[PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[stage((0, 6), ["a"])])])
        ctx = RunContext(node_id="a", job=job, peer_server=server, checkpoint_dir=tmp_path / "none",
                         report_step=lambda m: False, report_checkpoint=lambda c: None)
        with pytest.raises(RunFailed, match="no checkpoint of step 5"):
            PlanRunner(ctx, plan).run(threading.Event())
    finally:
        server.stop()
