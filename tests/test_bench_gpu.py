"""`python -m bench.gpu`: its skip line where there is no GPU, and the pieces its table is made of (the
`--device cpu` run itself takes minutes, so it is not part of the suite)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atoll.job import JobSpec
from bench import gpu
from bench.gpu import Check, group_lines, parse_targets, report

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: bench.gpu runs its checks")
@pytest.mark.timeout(120)
def test_without_a_gpu_it_says_why_in_one_line_and_exits_0(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.gpu"], cwd=REPO, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench.gpu: skipped: no CUDA device: torch "), proc.stdout
    build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    assert build in lines[0]


def test_why_cuda_is_missing_names_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert gpu.cuda_missing() == f"no CUDA device: torch {torch.__version__} is a CPU-only build"
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert "built for CUDA 12.8, but it finds no GPU" in (gpu.cuda_missing() or "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpu.cuda_missing() is None


def test_the_table_counts_met_and_missed_targets_and_leaves_skipped_ones_out() -> None:
    checks = [Check("profile", "9 timings", "all > 0", True), Check("memory: stage 0", "+30.0%", "within 15%", False),
              gpu.skipped("NCCL", "1 GPU on this machine"), Check("the whole check", "95 s", "under 10 min", True)]
    lines, met, total = report(checks)
    assert (met, total) == (2, 3)
    assert lines[0].split() == ["check", "figure", "target", "met"] and set(lines[1]) <= {"-", " "}
    rows = {line.split("  ")[0]: line for line in lines[2:]}
    assert rows["memory: stage 0"].endswith("NO") and rows["profile"].endswith("yes")
    assert rows["NCCL"].rstrip().endswith("-") and "skipped: 1 GPU on this machine" in rows["NCCL"]
    assert len({line.index(c.figure) for line, c in zip(lines[2:], checks)}) == 1  # the columns line up
    assert report([]) == (["check  figure  target  met", "-----  ------  ------  ---"], 0, 0)


def test_a_check_that_raises_is_one_missed_row_and_the_others_still_run() -> None:
    def boom() -> list[Check]:
        raise RuntimeError("the coordinator exited with code 1\nsee its log")

    rows = gpu.guarded("pipeline on cuda", "losses within 0.001", boom)
    assert rows == [Check("pipeline on cuda", "failed: RuntimeError: the coordinator exited with code 1",
                          "losses within 0.001", False)]


def test_bench_tp_targets_and_the_nodes_group_lines_are_read_back() -> None:
    out = ("\n  [met] tp=2 losses within 0.0001 of one process: worst relative difference 3.1e-07\n"
           "  [MISSED] each tp rank holds <= 60% of the stage's state: 61%\n"
           "targets met: 1/2 (missed: each tp rank holds <= 60% of the stage's state)\n")
    assert parse_targets(out) == [
        ("tp=2 losses within 0.0001 of one process", "worst relative difference 3.1e-07", True),
        ("each tp rank holds <= 60% of the stage's state", "61%", False)]
    log = ("2026-01-01 10:00:00 INFO atoll.node.runner: group 9f2c/e1/norm-0 of 2 ranks runs over gloo: ranks 0 and 1 "
           "share one GPU (h/cuda/GPU-1), and NCCL needs a device per rank: gloo carries the group's collectives\n"
           "2026-01-01 10:00:01 INFO atoll.node.runner: pipeline 0 stage 0: step 1\n"
           "INFO atoll.node.runner: group 9f2c/e1/loss of 2 ranks runs over nccl: 2 ranks on 2 GPUs\n")
    assert group_lines([log]) == ["2 ranks runs over gloo: ranks 0 and 1 share one GPU (h/cuda/GPU-1), and NCCL "
                                  "needs a device per rank: gloo carries the group's collectives",
                                  "2 ranks runs over nccl: 2 ranks on 2 GPUs"]


def test_the_jobs_it_trains_parse_and_the_cost_model_predicts_each_stage() -> None:
    for device, (preset, extra, seq) in gpu.MODELS.items():
        job = JobSpec.from_toml(gpu.JOB.format(preset=preset, model_extra=extra, seq=seq, steps=5))
        assert (job.model.name, job.train.seq_len, job.train.dtype) == (preset, seq, "fp32"), device
    job = JobSpec.from_toml(gpu.JOB.format(preset="tiny", model_extra="", seq=64, steps=5))
    first, last = gpu.stage_predictions(job, [(0, 3), (3, 6)])
    assert 0 < last < first  # the first stage holds two micro-batches' activations under 1F1B, the last one
