"""What a node checks at its start, before it profiles and joins.

A node's checkpoint folder belongs to one job: step folders are named by step alone, so a second job writing into
the folder of a first would overwrite its steps and prune the rest. The folder's JOB file names its job; a node
that joins another job with that folder is refused at the start, before it writes anything, with what to do. And a
node started for a job that has finished says so and exits instead of profiling, joining and standing by."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from test_node_agent import TOKEN, fake_profile, start_coordinator

from atoll.coordinator.status import fetch_status
from atoll.node.agent import AgentConfig, NodeAgent
from atoll.node.checkpoint import JOB_FILE, RUN_FILE, CheckpointDirTaken, claim_checkpoint_dir, step_dir


def test_a_folder_is_claimed_once_and_another_jobs_steps_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    assert claim_checkpoint_dir(root, "job-a")  # made and marked
    assert (root / JOB_FILE).read_text() == "job-a\n"
    assert not claim_checkpoint_dir(root, "job-a")  # the same job again: a restart, a resume
    step_dir(root, 300).mkdir()
    with pytest.raises(CheckpointDirTaken, match=r"holds the checkpoints of job job-a.*--checkpoint-dir"):
        claim_checkpoint_dir(root, "job-b")
    assert (root / JOB_FILE).read_text() == "job-a\n" and step_dir(root, 300).is_dir()  # nothing touched
    # once that job's steps are gone (moved, exported and removed), the folder is free again
    step_dir(root, 300).rmdir()
    assert claim_checkpoint_dir(root, "job-b") and (root / JOB_FILE).read_text() == "job-b\n"
    # steps written before JOB files were kept are taken as the job's that claims them first
    legacy = tmp_path / "legacy"
    step_dir(legacy, 100).mkdir(parents=True)
    assert claim_checkpoint_dir(legacy, "job-c") and step_dir(legacy, 100).is_dir()


def test_an_earlier_runs_steps_of_the_same_job_are_refused(tmp_path: Path) -> None:
    """A coordinator started on a fresh state dir runs the job afresh (another run id): a node whose folder holds
    the steps of the earlier run is refused rather than training from step 0 over them and pruning them."""
    root = tmp_path / "ckpt"
    assert claim_checkpoint_dir(root, "job-a", "run-1")
    assert (root / RUN_FILE).read_text() == "run-1\n"
    assert not claim_checkpoint_dir(root, "job-a", "run-1")  # a restart of the same run
    assert not claim_checkpoint_dir(root, "job-a", "run-2")  # no steps yet: nothing to lose, the folder follows
    assert (root / RUN_FILE).read_text() == "run-2\n"
    step_dir(root, 40).mkdir()
    step_dir(root, 60).mkdir()
    with pytest.raises(CheckpointDirTaken, match=r"holds steps 40-60 of an earlier run of job job-a \(run run-2\).*"
                                                 r"--state-dir.*atoll export.*--checkpoint-dir"):
        claim_checkpoint_dir(root, "job-a", "run-3")
    assert (root / RUN_FILE).read_text() == "run-2\n" and step_dir(root, 60).is_dir()  # nothing touched
    assert not claim_checkpoint_dir(root, "job-a")  # an older coordinator tells no run: not judged
    # steps written before RUN files were kept are taken as the run's that claims them first
    (root / RUN_FILE).unlink()
    assert not claim_checkpoint_dir(root, "job-a", "run-3") and (root / RUN_FILE).read_text() == "run-3\n"


@pytest.mark.timeout(60)
def test_a_node_whose_folder_holds_another_jobs_checkpoints_is_refused_before_it_joins(tmp_path: Path) -> None:
    coordinator = start_coordinator()
    try:
        root = tmp_path / "ckpt"
        claim_checkpoint_dir(root, "an-earlier-job")
        step_dir(root, 25).mkdir()
        agent = NodeAgent(AgentConfig(coordinator=coordinator.address, token=TOKEN, state_dir=tmp_path / "n",
                                      listen="127.0.0.1:0", checkpoint_dir=root,
                                      connect_timeout=timedelta(seconds=20)), profile=fake_profile("h"))
        with pytest.raises(CheckpointDirTaken, match="an-earlier-job"):
            agent.start()
        assert list(fetch_status(coordinator.address, token=TOKEN).members) == []  # it never joined
        agent.stop(leave=False)
        assert step_dir(root, 25).is_dir()
    finally:
        coordinator.stop()


@pytest.mark.timeout(60)
def test_a_node_started_for_a_finished_job_says_so_and_does_not_join(tmp_path: Path) -> None:
    from atoll.coordinator.store import JobControlRecord
    from atoll.node.agent import JobFinished

    coordinator = start_coordinator()
    try:
        coordinator.state.set_control(JobControlRecord(finished_unix=1000.0))
        agent = NodeAgent(AgentConfig(coordinator=coordinator.address, token=TOKEN, state_dir=tmp_path / "n",
                                      listen="127.0.0.1:0", connect_timeout=timedelta(seconds=20)),
                          profile=fake_profile("h"))
        with pytest.raises(JobFinished, match=r"finished after step 99: nothing is left to train"):
            agent.start()
        assert list(fetch_status(coordinator.address, token=TOKEN).members) == []
        agent.stop(leave=False)
    finally:
        coordinator.stop()
