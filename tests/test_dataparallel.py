"""Gradient averaging and the norm exchange over real torch.distributed groups (gloo), in threads and
in separate processes."""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from pipeline_harness import in_threads

from atoll.models import preset
from atoll.node.dataparallel import (CollectiveError, DataParallelConfig, GradientAverager, arrive_on_devices,
                                     collective_backend, device_identity, free_port, gloo_group, init_distributed)
from atoll.node.inprocess import train_threaded
from atoll.node.norm_exchange import DistNormExchange, NormExchangeError
from atoll.node.reference import train_unsplit
from atoll.node.stage import StageConfig
from atoll.node.synthetic import replica_batch, synthetic_batch

TIMEOUT = timedelta(seconds=30)


@pytest.mark.timeout(60)
def test_gradient_averager_averages_over_buckets_and_fills_missing_grads():
    store = dist.HashStore()

    def replica(r: int) -> list[torch.Tensor]:
        group = gloo_group(store, "g", rank=r, size=3, timeout=TIMEOUT)
        params = [torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(2, 3)),
                  torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))]
        params[0].grad = torch.full((5,), float(r))
        params[1].grad = torch.full((2, 3), float(10 * r))
        if r != 1:
            params[2].grad = torch.full((4,), 3.0, dtype=torch.float64)
        # 24-byte buckets split the float32 parameters apart; the float64 one gets its own
        GradientAverager(group, config=DataParallelConfig(bucket_bytes=24)).average_(params, TIMEOUT)
        return [p.grad for p in params]  # type: ignore[misc]

    for grads in in_threads(3, replica):
        assert torch.equal(grads[0], torch.full((5,), 1.0))
        assert torch.equal(grads[1], torch.full((2, 3), 10.0))
        assert torch.equal(grads[2], torch.full((4,), 2.0, dtype=torch.float64))


@pytest.mark.timeout(60)
def test_collectives_time_out_with_a_clear_error():
    store = dist.HashStore()
    group = gloo_group(store, "lonely", rank=0, size=1, timeout=TIMEOUT)
    p = torch.nn.Parameter(torch.ones(3))
    GradientAverager(group).average_([p], TIMEOUT)  # a group of one: the gradient becomes zeros, no collective
    assert torch.equal(p.grad, torch.zeros(3))  # type: ignore[arg-type]

    short = timedelta(milliseconds=300)
    checked = threading.Event()

    def member(r: int) -> str:
        # the group itself is built with time to spare (a loaded machine connects slowly); the collectives get
        # the short timeout
        g = gloo_group(store, "pair", rank=r, size=2, timeout=TIMEOUT)
        if r == 1:
            checked.wait(50)  # joins the group, never enters the all-reduce, and stays until rank 0 has seen it
            del g
            return "absent"
        try:
            with pytest.raises(CollectiveError, match="timed out"):
                GradientAverager(g).average_([torch.nn.Parameter(torch.ones(2))], short)
            with pytest.raises(NormExchangeError, match="timed out"):
                DistNormExchange(g).all_sum(1.0, short)
        finally:
            checked.set()
        return "ok"

    assert in_threads(2, member) == ["ok", "absent"]


def test_dataparallel_config_validation():
    with pytest.raises(ValueError, match="bucket_bytes"):
        DataParallelConfig(bucket_bytes=0)


def test_ranks_sharing_a_gpu_meet_over_gloo_and_ranks_on_their_own_gpus_over_nccl():
    gpu = ["h1/cuda/GPU-a", "h1/cuda/GPU-b", "h2/cuda/GPU-a"]
    assert collective_backend("cuda", gpu, nccl_available=True) == ("nccl", "3 ranks on 3 GPUs")
    # two node processes on one GPU (a 2-stage pipeline on one card): NCCL refuses them, gloo carries the group
    backend, why = collective_backend("cuda", ["h1/cuda/GPU-a", "h1/cuda/GPU-b", "h1/cuda/GPU-a"],
                                      nccl_available=True)
    assert backend == "gloo" and "ranks 0 and 2 share one GPU (h1/cuda/GPU-a)" in why
    assert collective_backend("cuda", gpu, nccl_available=False) == ("gloo", "this torch has no NCCL")
    assert collective_backend("cpu", [], nccl_available=True)[0] == "gloo"


@pytest.mark.timeout(60)
def test_ranks_tell_each_other_their_devices_as_they_arrive():
    """Every rank of a group decides the same backend from what the others announced (CPU: gloo, nothing said)."""
    store = dist.HashStore()
    got = in_threads(2, lambda r: arrive_on_devices(dist.PrefixStore("g/", store), rank=r, size=2,
                                                    device=torch.device("cpu"), timeout=TIMEOUT))
    assert got == [("gloo", "cpu tensors")] * 2
    assert device_identity(torch.device("cpu")).endswith("/cpu")


TINY = preset("tiny")
CONFIG = StageConfig(micro_batches=2, lr=3e-3, max_grad_norm=0.5)
STEPS = 8


def _batches():
    return [synthetic_batch(vocab_size=TINY.vocab_size, batch=8, seq_len=TINY.seq_len, seed=3, step=i)
            for i in range(STEPS)]


def _replica_process(rank: int, port: int, out: str) -> None:
    """One data-parallel replica: a 2-stage pipeline in threads, averaging each stage over gloo groups."""
    torch.set_num_threads(1)
    init_distributed(rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout=TIMEOUT, backend="gloo")
    try:
        groups = [dist.new_group([0, 1], timeout=TIMEOUT, backend="gloo") for _ in range(2)]
        # the norm exchange over a process group, as separate stage processes use it
        total = DistNormExchange(dist.new_group([0, 1], timeout=TIMEOUT)).all_sum(rank + 0.5, TIMEOUT)
        batches = [replica_batch(b, rank, 2) for b in _batches()]
        run = train_threaded(TINY, cuts=[0, 3, 6], stage_config=CONFIG, batches=batches, stage_groups=groups)
        state = {k: v for st in run.stages[0] for k, v in st.module.state_dict().items()}
        torch.save(state, Path(out) / f"state{rank}.pt")
        (Path(out) / f"losses{rank}.json").write_text(json.dumps({"losses": run.losses(), "norm_sum": total}))
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_two_replica_processes_match_one_process_with_the_full_batch(tmp_path):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_replica_process, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(100)
    assert [p.exitcode for p in procs] == [0, 0]

    ref = train_unsplit(TINY, stage_config=CONFIG, batches=_batches())
    results = [json.loads((tmp_path / f"losses{r}.json").read_text()) for r in range(2)]
    assert results[0]["norm_sum"] == results[1]["norm_sum"] == 2.0
    mean = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"])]
    for step, (got, want) in enumerate(zip(mean, ref.losses)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want}"
    states = [torch.load(tmp_path / f"state{r}.pt") for r in range(2)]
    want_state = ref.module.state_dict()
    for name, want in want_state.items():
        assert torch.equal(states[0][name], states[1][name]), f"replicas diverged on {name}"
        # half batches summed by the all-reduce round differently from the full batch; where a weight's gradient is
        # that rounding's size (an embedding row of a token seen once or twice), AdamW's normalised step still moves
        # it by a fair part of the learning rate, either way: up to lr / 10 apart, on AVX-512 kernels for one
        # element of 12,288 (1.1e-4). A wrong average would move every element far more.
        torch.testing.assert_close(states[0][name], want, rtol=1e-4, atol=CONFIG.lr / 10)
