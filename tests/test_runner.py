"""PlanRun: nodes as threads, real gRPC peers and gloo groups, against the job trained in one process."""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from atoll.job import JobSpec
from atoll.node.local import train_local
from atoll.node.peer import PeerServer
from atoll.node.runner import PlanRunner, RunContext
from atoll.plan import PipelinePlan, Plan, StagePlan

REPO = Path(__file__).resolve().parent.parent
STEPS = 6


def _job(steps: int = STEPS, interval: int = 0, mode: str = "identity") -> JobSpec:
    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    return replace(job, train=replace(job.train, steps=steps, warmup=2),
                   checkpoint=replace(job.checkpoint, interval=interval),
                   compression=replace(job.compression, mode=mode))


def _stage(layers, nodes):
    return StagePlan(island="i", layers=layers, dp=len(nodes), nodes=list(nodes))


def _run(job: JobSpec, pipelines: list[PipelinePlan], tmp_path: Path, resume_step: int = 0,
         stop_after: int | None = None) -> dict[int, float]:
    nodes = sorted({n for p in pipelines for s in p.stages for n in s.nodes})
    servers = {n: PeerServer(node_id=n, listen="127.0.0.1:0", token="t") for n in nodes}
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    plan = Plan(model="tiny", global_batch=job.train.global_batch, seq_len=job.train.seq_len, pipelines=pipelines,
                epoch=1, job_id="job", resume_step=resume_step,
                node_addresses={n: s.address for n, s in servers.items()}, rendezvous=f"127.0.0.1:{store.port}")
    losses: dict[int, float] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def report(m):
        if m.loss is not None:
            with lock:
                losses[m.step] = m.loss
        return False

    def node(n: str) -> None:
        ctx = RunContext(node_id=n, job=job, peer_server=servers[n], checkpoint_dir=tmp_path / "ckpt",
                         report_step=report, report_checkpoint=lambda c: None, token="t",
                         timeout=timedelta(seconds=30))
        try:
            PlanRunner(ctx, plan).run(threading.Event(), until_step=stop_after)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=node, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for s in servers.values():
        s.stop()
    assert not errors, errors
    return losses


@pytest.mark.timeout(120)
def test_two_stage_pipeline_matches_one_process(tmp_path: Path) -> None:
    job = _job()
    expected, _ = train_local(job)
    got = _run(job, [PipelinePlan(micro_batch=4, num_micro_batches=4,
                                  stages=[_stage((0, 3), ["a"]), _stage((3, 6), ["b"])])], tmp_path)
    assert sorted(got) == list(range(STEPS))
    for s in range(STEPS):
        assert abs(got[s] - expected[s]) <= 1e-4 * abs(expected[s]), (s, got[s], expected[s])


@pytest.mark.timeout(150)
def test_two_pipelines_cut_differently_match_one_process(tmp_path: Path) -> None:
    """Pipelines with different cuts and shares average gradients per shared layer segment, by rows."""
    job = _job(steps=4)
    expected, _ = train_local(job)
    got = _run(job, [
        PipelinePlan(micro_batch=4, num_micro_batches=3, stages=[_stage((0, 3), ["a"]), _stage((3, 6), ["b"])]),
        PipelinePlan(micro_batch=2, num_micro_batches=2, stages=[_stage((0, 2), ["c"]), _stage((2, 6), ["d"])]),
    ], tmp_path)
    for s in range(4):
        assert abs(got[s] - expected[s]) <= 1e-4 * abs(expected[s]), (s, got[s], expected[s])


@pytest.mark.timeout(150)
def test_resume_from_checkpoint_under_another_cut(tmp_path: Path) -> None:
    """Checkpoint after 3 steps under one cut, resume under another: the same losses as straight through."""
    job = _job(steps=6, interval=3)
    expected, _ = train_local(job)
    first = _run(job, [PipelinePlan(micro_batch=4, num_micro_batches=4,
                                    stages=[_stage((0, 2), ["a"]), _stage((2, 6), ["b"])])], tmp_path, stop_after=3)
    assert sorted(first) == [0, 1, 2]
    assert (tmp_path / "ckpt" / "step-00000003" / "layers-0002-0006.pt").is_file()
    second = _run(job, [PipelinePlan(micro_batch=4, num_micro_batches=4,
                                     stages=[_stage((0, 4), ["a"]), _stage((4, 6), ["b"])])], tmp_path,
                  resume_step=3)
    got = {**first, **second}
    for s in range(6):
        assert abs(got[s] - expected[s]) <= 1e-4 * abs(expected[s]), (s, got[s], expected[s])


def test_a_missing_checkpoint_fails_the_run_and_says_where(tmp_path: Path) -> None:
    from atoll.node.runner import RunFailed

    job = _job()
    server = PeerServer(node_id="a", listen="127.0.0.1:0", token="t")
    try:
        plan = Plan(model="tiny", global_batch=16, seq_len=64, epoch=2, job_id="job", resume_step=5,
                    pipelines=[PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[_stage((0, 6), ["a"])])])
        ctx = RunContext(node_id="a", job=job, peer_server=server, checkpoint_dir=tmp_path / "none",
                         report_step=lambda m: False, report_checkpoint=lambda c: None)
        with pytest.raises(RunFailed, match="no checkpoint of step 5"):
            PlanRunner(ctx, plan).run(threading.Event())
    finally:
        server.stop()
