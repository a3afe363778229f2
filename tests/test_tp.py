"""Tensor parallelism: tp stages in their own OS processes (gloo), against the job trained in one process.

Each node is a process running `PlanRunner` with its own gRPC peer server, as `atoll node` does; a tp rank
makes its tp group its process's default group (`atoll.node.tp`). Losses must match the unsharded run in one
process to 1e-4 relative: DTensor's row-wise matmuls add each output's two halves after the all-reduce
rather than in one sum, and the vocab-parallel loss pieces arrive in another order, so float sums differ in
their last bits and the difference grows slowly with AdamW steps (measured: below 3e-6 over these steps).

This file is also the node process: `python test_tp.py --worker '<json>'`.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from pipeline_harness import run_pinned_plan, tiny_job

RTOL = 1e-4


def _job(steps: int, interval: int = 0, model: dict | None = None):
    from atoll.modelspec import ModelConfig

    job = tiny_job(steps, interval=interval)
    if model is not None:
        job = replace(job, model=ModelConfig(**model), model_preset=None)
    return job


# a llama-style model with grouped-query attention (2 kv heads for 4 query heads) and SwiGLU: the fused
# qkv and gate|up weights are the ones tp reorders before splitting
GQA = dict(name="gqa", style="llama", vocab_size=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
           ffn_hidden=96, seq_len=64)


# --- the node process -----------------------------------------------------------------------------------

def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _worker(args: dict) -> None:
    import torch

    from atoll.job import JobSpec
    from atoll.node.peer import PeerServer
    from atoll.node.runner import PlanRunner, RunContext
    from atoll.plan import Plan

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")  # to the node's log
    node = args["node"]
    job = JobSpec.from_toml(args["job"])
    server = PeerServer(node_id=node, listen="127.0.0.1:0", token="t")
    _emit({"address": server.address})
    plan = Plan.from_json(json.loads(sys.stdin.readline())["plan"])
    losses: dict[int, float] = {}

    def report(m) -> bool:
        if m.loss is not None:
            losses[m.step] = m.loss
        return False

    ctx = RunContext(node_id=node, job=job, peer_server=server, checkpoint_dir=Path(args["checkpoint_dir"]),
                     report_step=report, report_checkpoint=lambda c: None, token="t",
                     timeout=timedelta(seconds=45))
    try:
        PlanRunner(ctx, plan).run(threading.Event(), until_step=args.get("until"))
        _emit({"node": node, "losses": losses})
    except BaseException as e:  # the test shows it
        _emit({"node": node, "error": f"{e!r}\n{traceback.format_exc()}"})
    finally:
        server.stop()


def _module_worker(args: dict) -> None:
    """Two tp ranks shard one model (no pipeline) and train it beside its unsharded twin on a fixed batch."""
    import torch
    import torch.distributed as dist

    from atoll.modelspec import ModelConfig
    from atoll.node.model import build_slice, lm_loss
    from atoll.node.tp import TensorParallel

    torch.set_num_threads(1)
    config = ModelConfig(**args["model"])
    store = dist.TCPStore("127.0.0.1", args["store_port"], is_master=False, timeout=timedelta(seconds=30))
    tp = TensorParallel.join(store, "tp/", rank=args["rank"], size=2, device=torch.device("cpu"),
                             timeout=timedelta(seconds=30))

    def adamw(m):
        return torch.optim.AdamW(m.parameters(), lr=3e-3, foreach=False)

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (4, config.seq_len), generator=g)
    tgt = torch.randint(0, config.vocab_size, (4, config.seq_len), generator=g)
    whole = build_slice(config, 0, config.n_layers + 2, seed=5)
    whole_opt = adamw(whole)
    sharded = build_slice(config, 0, config.n_layers + 2, seed=5, recompute=[1, 2])  # collectives replayed
    opt = tp.shard(sharded, adamw(sharded), adamw)
    before = tp.full_state(sharded)  # gathered and put back in order: bit for bit the whole model's
    exact = before is None or all(torch.equal(before["tensors"][n], t) for n, t in whole.state_dict().items())
    rows = []
    for _ in range(3):
        whole_opt.zero_grad()
        opt.zero_grad()
        a = lm_loss(whole(ids), tgt)
        a.backward()
        b = lm_loss(sharded(ids), tgt)
        b.backward()
        norm = torch.tensor([tp.squared_norm(list(sharded.parameters()))], dtype=torch.float64)
        dist.all_reduce(norm)
        whole_norm = sum(float(p.grad.double().pow(2).sum()) for p in whole.parameters())
        rows.append([float(a), float(b.detach()), whole_norm, float(norm)])
        whole_opt.step()
        opt.step()
    # zero-bubble: a twin of the sharded model deferring its weight gradients gets the same ones, DTensors placed
    # as the weights are, and holds what the planner's cost model counts per tp rank until they are applied
    from torch.distributed.tensor import DTensor

    from atoll.node.wgrad import WeightGradients, attach

    plain = build_slice(config, 0, config.n_layers + 2, seed=5, recompute=[1, 2])
    tp.shard(plain, adamw(plain), adamw)
    split = build_slice(config, 0, config.n_layers + 2, seed=5, recompute=[1, 2])
    tp.shard(split, adamw(split), adamw)
    sink = WeightGradients()
    attach(split, sink)
    lm_loss(plain(ids), tgt).backward()
    lm_loss(split(ids), tgt).backward()
    pending = sink.take()
    stash = WeightGradients.nbytes(pending)
    WeightGradients.apply(pending)
    deferred_err = 0.0
    for a, b in zip(plain.parameters(), split.parameters()):
        assert isinstance(a.grad, DTensor) == isinstance(b.grad, DTensor)
        if isinstance(a.grad, DTensor):
            assert a.grad.placements == b.grad.placements
        ga, gb = (g.to_local() if isinstance(g, DTensor) else g for g in (a.grad, b.grad))
        deferred_err = max(deferred_err, float((ga - gb).abs().max()))
    state = tp.full_state(sharded, opt)
    # the handover's gather over a group of its own gives the same whole layers (uneven vocabulary shards too)
    fresh = dist.ProcessGroupGloo(dist.PrefixStore("handover/", store), args["rank"], 2, timedelta(seconds=30))
    handed = tp.full_state(sharded, opt, {"step": 3}, group=fresh, timeout=timedelta(seconds=30))
    out: dict = {"rank": args["rank"], "steps": rows, "exact": exact, "deferred": len(pending),
                 "deferred_err": deferred_err, "stash": stash, "handed": handed is not None,
                 "vocab_parallel": isinstance(sharded.layers["0"].tok.weight, DTensor)}
    if state is not None and handed is not None:
        out["handover_equal"] = (
            sorted(handed["tensors"]) == sorted(state["tensors"]) and handed["extra"] == {"step": 3}
            and all(torch.equal(handed["tensors"][n], t) for n, t in state["tensors"].items())
            and sorted(handed["optimizer"]) == sorted(state["optimizer"])
            and all(torch.equal(handed["optimizer"][n][k], v) for n, st in state["optimizer"].items()
                    for k, v in st.items()))
    if state is not None:
        ref = {n: p.detach() for n, p in whole.state_dict().items()}
        out["same_names"] = sorted(state["tensors"]) == sorted(ref)
        out["weights"] = max(float((state["tensors"][n] - t).abs().max()) for n, t in ref.items())
        out["exp_avg"] = max(float((state["optimizer"][n]["exp_avg"] - whole_opt.state[p]["exp_avg"]).abs().max())
                             for n, p in whole.named_parameters())
    out["zero"] = {stage: _zero_under_tp(tp, config, ids, tgt, stage) for stage in (1, 2)}
    tp.close()
    _emit(out)


def _zero_under_tp(tp, config, ids, tgt, stage: int) -> dict | None:
    """ZeRO over a sharded model (a group of one replica per tp rank) against AdamW over the whole model: the
    squared norm summed over the tp ranks (replicated parameters counted on rank 0 only), then the gathered
    weights and AdamW state after two steps (None on rank 1, which gathers nothing)."""
    import torch
    import torch.distributed as dist

    from atoll.node.dataparallel import gloo_group
    from atoll.node.model import build_slice, lm_loss
    from atoll.node.zero import ZeroConfig, ZeroOptimizer

    def adamw(m):
        return torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)

    whole = build_slice(config, 0, config.n_layers + 2, seed=5)
    whole_opt = adamw(whole)
    sharded = build_slice(config, 0, config.n_layers + 2, seed=5)
    group = gloo_group(dist.HashStore(), f"zero{stage}/", rank=0, size=1, timeout=timedelta(seconds=30))
    zero = ZeroOptimizer.from_adamw(tp.shard(sharded, adamw(sharded), adamw), group,
                                    ZeroConfig(stage=stage, lr=3e-3, betas=(0.9, 0.95)), count_replicated=tp.rank == 0)
    norm_err = 0.0
    for _ in range(2):
        whole_opt.zero_grad()
        zero.zero_grad()
        lm_loss(whole(ids), tgt).backward()
        lm_loss(sharded(ids), tgt).backward()
        zero.backward_done()
        zero.reduce_gradients()
        norm = torch.tensor([zero.squared_norm()], dtype=torch.float64)
        dist.all_reduce(norm)
        whole_norm = sum(float(p.grad.double().pow(2).sum()) for p in whole.parameters())
        norm_err = max(norm_err, abs(float(norm) - whole_norm) / whole_norm)
        whole_opt.step()
        zero.step()
    state = tp.full_state(sharded, zero.consolidated_state(to=0))
    if state is None:
        return None
    return {"norm": norm_err,
            "weights": max(float((state["tensors"][n] - t.detach()).abs().max()) for n, t in whole.state_dict().items()),
            "exp_avg": max(float((state["optimizer"][n]["exp_avg"] - whole_opt.state[p]["exp_avg"]).abs().max())
                           for n, p in whole.named_parameters())}


# --- the harness ----------------------------------------------------------------------------------------

def _read(proc: subprocess.Popen, deadline: float, log: Path) -> dict:
    assert proc.stdout is not None
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"node process {proc.pid} said nothing in time; its log: {log}")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"node process {proc.pid} exited with {proc.wait(5)}: {log.read_text()[-3000:]}")
        if line.startswith("{"):
            return json.loads(line)


def _stage(layers: tuple[int, int], nodes: list[str], tp: int = 1, defer_weights: int = 0, zero: int = 0,
           lanes: int = 1):
    from atoll.plan import StagePlan
    return StagePlan(island="i", layers=layers, dp=len(nodes) // tp, tp=tp, nodes=list(nodes),
                     defer_weights=defer_weights, zero=zero, lanes=lanes)


def run_processes(job, pipelines, tmp_path: Path, *, resume_step: int = 0, until: int | None = None
                  ) -> dict[int, float]:
    """Run every node of `pipelines` as its own process through one plan; return the reported loss per step."""
    import torch.distributed as dist

    from atoll.plan import Plan

    nodes = sorted({n for p in pipelines for s in p.stages for n in s.nodes})
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = dict(os.environ, OMP_NUM_THREADS="1")  # several processes share two cores
    logs = {n: tmp_path / f"node-{n}.log" for n in nodes}
    procs = {}
    try:
        for n in nodes:
            args = {"node": n, "job": job.to_toml(), "checkpoint_dir": str(tmp_path / "ckpt"), "until": until}
            procs[n] = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(args)], text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=logs[n].open("w"), env=env)
        deadline = time.monotonic() + 60
        addresses = {n: _read(p, deadline, logs[n])["address"] for n, p in procs.items()}
        plan = Plan(model=job.model.name, global_batch=job.train.global_batch, seq_len=job.train.seq_len,
                    pipelines=pipelines, epoch=1, job_id="job", resume_step=resume_step, node_addresses=addresses,
                    rendezvous=f"127.0.0.1:{store.port}")
        for p in procs.values():
            assert p.stdin is not None
            p.stdin.write(json.dumps({"plan": plan.to_json(indent=None)}) + "\n")
            p.stdin.flush()
        deadline = time.monotonic() + 120
        reports = {n: _read(p, deadline, logs[n]) for n, p in procs.items()}
        errors = {n: r["error"] for n, r in reports.items() if "error" in r}
        assert not errors, "\n".join(f"node {n}: {e}" for n, e in errors.items())
        for n, p in procs.items():
            assert p.wait(20) == 0, f"node {n} exited with {p.returncode}: {logs[n].read_text()[-3000:]}"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(5)
    losses: dict[int, float] = {}
    for r in reports.values():
        losses.update({int(k): v for k, v in r["losses"].items()})
    return losses


def _assert_match(got: dict[int, float], expected: list[float], steps) -> None:
    assert sorted(got) == list(steps), got
    for s in steps:
        assert abs(got[s] - expected[s]) <= RTOL * abs(expected[s]), (s, got[s], expected[s])


# --- the tests ------------------------------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.timeout(180)
def test_tp2_second_stage_matches_one_process_and_its_checkpoint_resumes_under_tp1(tmp_path: Path) -> None:
    """Stage 1 of a two-stage pipeline sharded over two processes (the tiny GPT: biases, learned positions, a
    vocab-parallel head), both stages deferring their weight gradients (zero-bubble; the tp stage's products
    are of its shards, DTensors); its checkpoint holds whole layers, so one unsharded process resumes from it."""
    from atoll.node.local import train_local
    from atoll.node.slice_state import read_slice
    from atoll.plan import PipelinePlan

    job = _job(steps=5, interval=3)
    expected, _ = train_local(job)
    t0 = time.monotonic()
    got = run_processes(job, [PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
        _stage((0, 3), ["a"], defer_weights=1), _stage((3, 6), ["b", "c"], tp=2, defer_weights=2)])], tmp_path,
        until=3)
    print(f"tp=2 as the second stage of two: 3 steps in {time.monotonic() - t0:.1f} s (3 processes)")
    _assert_match(got, expected, range(3))

    saved = read_slice(tmp_path / "ckpt" / "step-00000003" / "layers-0003-0006.pt")
    full = {n: tuple(p.shape) for n, p in _unsharded(job).named_parameters() if n.startswith(("layers.3.",
                                                                                               "layers.4.",
                                                                                               "layers.5."))}
    assert {n: tuple(t.shape) for n, t in saved["tensors"].items()} == full
    assert set(saved["optimizer"]) == set(full)

    # resume the rest in this process, unsharded, one stage
    resumed = _run_in_process(job, tmp_path, resume_step=3)
    _assert_match({**got, **resumed}, expected, range(5))


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_tied_model_on_one_tp2_stage_matches_one_process_and_resumes_unsharded(tmp_path: Path) -> None:
    """A tied model (the tiny GPT with tied_head) kept whole on one stage sharded over two processes: its token
    table vocab-parallel, and the head's matmul with that sharded table (its gradient the sum of both uses'); the
    checkpoint holds the whole table, and one unsharded process resumes from it."""
    from atoll.node.local import train_local
    from atoll.node.slice_state import read_slice
    from atoll.plan import PipelinePlan

    job = _job(steps=4, interval=2)
    job = replace(job, model=replace(job.model, tied_head=True), model_preset=None)
    expected, _ = train_local(job)
    total = job.model.n_layers + 2
    got = run_processes(job, [PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
        _stage((0, total), ["a", "b"], tp=2)])], tmp_path, until=2)
    _assert_match(got, expected, range(2))
    saved = read_slice(tmp_path / "ckpt" / "step-00000002" / f"layers-0000-{total:04d}.pt")
    assert tuple(saved["tensors"]["layers.0.tok.weight"].shape) == (job.model.vocab_size, job.model.d_model)
    assert f"layers.{total - 1}.lm.weight" not in saved["tensors"]  # one tensor, no copy
    resumed = _run_in_process(job, tmp_path, resume_step=2)
    _assert_match({**got, **resumed}, expected, range(4))


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_tp2_replicas_in_two_lanes_match_one_process(tmp_path: Path) -> None:
    """Lanes of tensor-parallel replicas: stage 1's two replicas of two processes each take alternate
    micro-batches (lane 0 the even ones), only each replica's tp rank 0 exchanging them with stage 0."""
    from atoll.node.local import train_local
    from atoll.plan import PipelinePlan

    job = _job(steps=3)
    expected, _ = train_local(job)
    t0 = time.monotonic()
    got = run_processes(job, [PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
        _stage((0, 3), ["a"]), _stage((3, 6), ["b", "c", "d", "e"], tp=2, lanes=2)])], tmp_path)
    print(f"tp=2 replicas in 2 lanes: 3 steps in {time.monotonic() - t0:.1f} s (5 processes)")
    _assert_match(got, expected, range(3))


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_tp2_by_dp2_single_stage_matches_one_process(tmp_path: Path) -> None:
    """A one-stage pipeline of two replicas, each sharded over two processes (a llama-style model with
    grouped-query attention and SwiGLU): gradients are averaged per tp rank, the clipping norm counts every
    shard once, and a resume from a whole-layer checkpoint shards the loaded weights and AdamW state."""
    from atoll.node.local import train_local
    from atoll.plan import PipelinePlan

    job = _job(steps=4, interval=2, model=GQA)
    expected, _ = train_local(job)
    first = _run_in_process(job, tmp_path, until=2)  # whole layers, unsharded, written at step 2
    t0 = time.monotonic()
    got = run_processes(job, [PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
        _stage((0, GQA["n_layers"] + 2), ["a", "b", "c", "d"], tp=2)])], tmp_path, resume_step=2)
    print(f"tp=2 x dp=2, one stage: 2 steps in {time.monotonic() - t0:.1f} s (4 processes)")
    _assert_match({**first, **got}, expected, range(4))


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero", [1, 2])
def test_zero_under_tp2_by_dp2_trains_as_one_process_and_checkpoints_whole_layers(tmp_path: Path, zero: int) -> None:
    """ZeRO under tensor parallelism: two replicas of one stage, each sharded over two processes, and each tp rank
    shards its own shards' AdamW states (ZeRO-1; ZeRO-2: and gradients) over the replicas of its tp rank. The run
    resumes from an unsharded checkpoint (its whole AdamW state cut to tp shards, then to ZeRO chunks), matches
    one process step for step (the clipping norm counts replicated parameters once over the tp group), and writes
    a checkpoint of whole layers and whole AdamW states that one unsharded process resumes from. The ZeRO-1 run
    also defers its weight gradients (zero-bubble): they land in the DTensor gradients before ZeRO copies them."""
    from atoll.node.local import train_local
    from atoll.plan import PipelinePlan

    job = _job(steps=6, interval=2, model=GQA)
    expected, _ = train_local(job)
    first = _run_in_process(job, tmp_path, until=2)
    t0 = time.monotonic()
    got = run_processes(job, [PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
        _stage((0, GQA["n_layers"] + 2), ["a", "b", "c", "d"], tp=2, zero=zero,
               defer_weights=1 if zero == 1 else 0)])], tmp_path, resume_step=2, until=4)
    print(f"ZeRO-{zero} under tp=2 x dp=2: 2 steps in {time.monotonic() - t0:.1f} s (4 processes)")
    for n, k in (("a", 0), ("b", 1), ("c", 0), ("d", 1)):  # the stage ran ZeRO, not plain AdamW beside its plan
        log = (tmp_path / f"node-{n}.log").read_text()
        assert f"ZeRO-{zero} over its 2 replicas" in log and f"of tp rank {k}'s shards" in log, log[-2000:]
    rest = _run_in_process(job, tmp_path, resume_step=4)
    _assert_match({**first, **got, **rest}, expected, range(6))


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_coordinator_and_nodes_run_a_pinned_plan_with_a_tp_stage(tmp_path: Path) -> None:
    """`atoll coordinator --plan` and three `atoll node` processes: one node runs the first stage, two run the
    second as tp ranks 0 and 1 (the plan lists them in rank order); the losses match one process."""
    from atoll.launch.localcluster import LocalCluster
    from atoll.node.local import train_local
    from atoll.plan import PipelinePlan, Plan

    steps = 5
    job = tiny_job(steps, nodes=3)
    job_path, plan_path, out = tmp_path / "job.toml", tmp_path / "plan.json", tmp_path / "cluster"
    job_path.write_text(job.to_toml())
    ids = {"node1": "first-0", "node2": "second-tp0", "node3": "second-tp1"}
    Plan(model="tiny", global_batch=16, seq_len=64, pipelines=[PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
        _stage((0, 3), ["first-0"]), _stage((3, 6), ["second-tp0", "second-tp1"], tp=2)])]).save(plan_path)
    expected, _ = train_local(job)
    with LocalCluster(job_path=job_path, out=out, profile_seconds=1.0) as cluster:
        cluster.start_coordinator(extra=["--plan", str(plan_path)])
        for name, node_id in ids.items():  # known before the nodes start, so the plan can name them
            cluster.start_node(name, node_id=node_id)
        losses = cluster.wait_losses(steps, 120)
        status = cluster.status()
    stages = status.plan.pipelines[0].stages
    assert [(list(s.node_ids), s.dp, s.tp) for s in stages] == [(["first-0"], 1, 1),
                                                                (["second-tp0", "second-tp1"], 1, 2)]
    _assert_match({s: losses[s] for s in range(steps)}, expected, range(steps))


def _unsharded(job):
    from atoll.node.model import build_slice
    return build_slice(job.model, 0, job.model.n_layers + 2, seed=job.train.seed)


def _run_in_process(job, tmp_path: Path, *, resume_step: int = 0, until: int | None = None) -> dict[int, float]:
    """One unsharded node training the whole model, in this process (a thread of it)."""
    from atoll.plan import PipelinePlan, Plan

    plan = Plan(model=job.model.name, global_batch=job.train.global_batch, seq_len=job.train.seq_len, epoch=2,
                job_id="job", resume_step=resume_step, pipelines=[PipelinePlan(
                    micro_batch=4, num_micro_batches=4, stages=[_stage((0, job.model.n_layers + 2), ["solo"])])])
    # RunContext's own bound on waits; the test's timeout bounds the run
    return run_pinned_plan(job, plan, tmp_path / "ckpt", until_step=until, timeout=timedelta(seconds=120),
                           join=120).losses


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize("tied,qkv_bias,wide", [(False, False, False), (True, False, False), (False, True, False),
                                               (False, False, True)],
                         ids=["vocab-parallel", "tied-vocab-parallel", "qkv-bias", "head-dim-qk-norm"])
def test_sharded_model_trains_as_the_whole_one(tmp_path: Path, tied: bool, qkv_bias: bool, wide: bool) -> None:
    """The sharding itself, two processes, no pipeline: the vocab-parallel embedding and head over an odd
    vocabulary (uneven shards), untied or tied (the head's matmul with the sharded table), GQA and SwiGLU blocks,
    two of them recomputed in backward (their collectives run again); losses, the clipping norm (each element
    once), the gathered weights and AdamW state after three steps."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    model = {**GQA, "tied_head": tied, "seq_len": 32, "vocab_size": 255}  # an odd vocabulary: uneven shards
    if qkv_bias:  # Qwen2's q/k/v biases are cut with the fused qkv rows
        model["qkv_bias"] = True
    if wide:  # heads twice d_model / n_heads wide (whole heads per rank), Qwen3's q/k norms (each rank's gradient
        # of their weights a partial sum over its heads) and Gemma's norms, scaled embedding and tanh-GELU gate
        model.update(head_dim=32, qk_norm=True, norm_unit_offset=True, embed_scale=True, gelu_tanh=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logs = [tmp_path / f"rank-{r}.log" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, __file__, "--module-worker",
                               json.dumps({"rank": r, "store_port": store.port, "model": model})],
                              text=True, stdout=subprocess.PIPE, stderr=logs[r].open("w"), env=env)
             for r in range(2)]
    try:
        deadline = time.monotonic() + 90
        out = sorted((_read(p, deadline, log) for p, log in zip(procs, logs)), key=lambda o: o["rank"])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(5)
    assert out[0]["exact"]
    for k, (whole, sharded, whole_norm, norm) in enumerate(out[0]["steps"]):
        # the first step differs only by the order of the sharded sums. AdamW then amplifies that: an element
        # whose gradient is near zero steps by lr * g / (|g| + eps), which flips with the last bits of g, so
        # later gradients (their norm more than the loss) drift a little
        assert abs(sharded - whole) <= (1e-6 if k == 0 else 1e-4) * whole, (k, sharded, whole, out[0])
        assert abs(norm - whole_norm) <= (1e-6 if k == 0 else 1e-3) * whole_norm, (k, norm, whole_norm, out[0])
    assert out[0]["steps"] == out[1]["steps"]  # the ranks agree exactly
    assert all(o["vocab_parallel"] for o in out)  # the token table sharded, tied or not
    for stage, got in out[0]["zero"].items():  # ZeRO over the shards steps as AdamW over the whole model
        assert got["norm"] <= 1e-4 and got["weights"] < 2e-3 and got["exp_avg"] < 1e-5, (stage, got)
    # zero-bubble under tp: every linear layer's product deferred, the same gradients, the planner's bytes
    from atoll.coordinator.planner import TrainSpec, parse_cluster
    from atoll.coordinator.planner.costmodel import CostModel
    from atoll.modelspec import ModelConfig, ModelSpec

    spec = ModelSpec.from_config(ModelConfig(**model))
    cm = CostModel(spec, TrainSpec(global_batch=4, seq_len=model["seq_len"], dtype="fp32"))
    island = parse_cluster('[[group]]\nname = "g"\ndevice = "A100-80GB"\ncount = 2\n').islands[0]
    predicted = cm.table(island, 4, 2).stash(0, spec.num_layers)
    for o in out:
        assert o["deferred"] == 4 * GQA["n_layers"] + (0 if tied else 1) and o["deferred_err"] <= 1e-6, o
        assert abs(o["stash"] - predicted) <= 0.02 * predicted, (o["stash"], predicted)
    # weights are ~0.02; a shard put back in the wrong place would be off by that much
    assert out[0]["same_names"] and out[0]["weights"] < 2e-3 and out[0]["exp_avg"] < 1e-5, out[0]
    assert "weights" not in out[1]  # rank 0 alone holds the gathered state
    assert out[0]["handed"] and not out[1]["handed"] and out[0]["handover_equal"], out[0]


def _join_worker(args: dict) -> None:
    """Rank 0 first fails to form a tp group (its peer never comes), then both ranks form another one."""
    import torch
    import torch.distributed as dist

    from atoll.node.tp import TensorParallel

    store = dist.TCPStore("127.0.0.1", args["store_port"], is_master=False, timeout=timedelta(seconds=30))
    cpu = torch.device("cpu")
    if args["rank"] == 0:
        with pytest.raises(Exception, match="did not come"):  # a peer that never came: an error that says so
            TensorParallel.join(store, "lonely/", rank=0, size=2, device=cpu, timeout=timedelta(seconds=1))
        # torch's own init failing once (the peer came to the rendezvous, then died) raises its name counter
        with pytest.raises(Exception):  # noqa: B017 - whichever error torch gives a peer that is gone
            dist.init_process_group("gloo", store=dist.PrefixStore("torch-alone/", store), rank=0, world_size=2,
                                    timeout=timedelta(seconds=1))
        assert not dist.is_initialized()
        store.set("failed-once", "1")
    else:
        store.wait(["failed-once"], timedelta(seconds=30))
    tp = TensorParallel.join(store, "together/", rank=args["rank"], size=2, device=cpu, timeout=timedelta(seconds=10))
    t = torch.tensor([float(args["rank"] + 1)])
    dist.all_reduce(t, group=tp.group)
    waited = None
    if args["rank"] == 1:  # waits for an activation rank 0 never shares: the plan is superseded meanwhile
        from atoll.node.dataparallel import CollectiveCancelled, cancel_collectives_on

        superseded = threading.Event()
        threading.Timer(0.5, superseded.set).start()
        start = time.monotonic()
        with cancel_collectives_on(superseded), pytest.raises(CollectiveCancelled):
            tp.share(None)
        waited = time.monotonic() - start
        store.set("cancelled", "1")
    else:
        store.wait(["cancelled"], timedelta(seconds=30))
    tp.close()  # rank 1's abandoned broadcast ends as rank 0's group goes
    # the next plans make this process the other tp rank: a column-parallel layer with a replicated output
    # must give each rank its own rows' gradient in both (DTensor's caches once kept the first group's rank)
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    rows = []
    for name, rank in (("cut-a/", args["rank"]), ("cut-b/", 1 - args["rank"])):
        tp = TensorParallel.join(store, name, rank=rank, size=2, device=cpu, timeout=timedelta(seconds=10))
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 6, bias=False)
        parallelize_module(lin, tp.mesh, ColwiseParallel(output_layouts=Replicate()))
        (lin(torch.arange(8.0).reshape(2, 4)) * torch.arange(6.0)).sum().backward()
        rows.append([rank, lin.weight.grad.to_local().sum(1).tolist()])
        tp.close()
    _emit({"rank": args["rank"], "sum": float(t), "waited": waited, "rows": rows})


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_rank_whose_tp_group_once_failed_to_form_still_meets_its_peers(tmp_path: Path) -> None:
    """torch names a default group after a per-process counter that a failed init raises too: without resetting
    it, a rank that once waited in vain for its peer (a late rank after a replan) looked for the next group under
    another name than its peers, and every later plan's tp group timed out. And a rank waiting for rank 0's
    activation leaves that wait as soon as its plan is superseded (it was late for the handover and the next
    plan's group before). And a process that is tp rank 1 of one group and rank 0 of the next gets rank 0's
    gradient rows (DTensor's caches kept the first group's rank: the ranks swapped their head's gradients)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    logs = [tmp_path / f"rank-{r}.log" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, __file__, "--join-worker",
                               json.dumps({"rank": r, "store_port": store.port})],
                              text=True, stdout=subprocess.PIPE, stderr=logs[r].open("w"),
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
             for r in range(2)]
    try:
        deadline = time.monotonic() + 45
        out = [_read(p, deadline, log) for p, log in zip(procs, logs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(5)
    assert [o["sum"] for o in out] == [3.0, 3.0], out
    # d(sum_j j * y_j)/dW_jk = j * sum_i x_ik: rows j = 0..2 on tp rank 0, 3..5 on tp rank 1, whichever process
    own = {0: [0.0, 28.0, 56.0], 1: [84.0, 112.0, 140.0]}
    for o in out:
        assert [own[rank] == got for rank, got in o["rows"]] == [True, True], o
    # a superseded plan ends rank 1's wait for rank 0's activation at once, not at the group's 10 s timeout
    assert out[1]["waited"] < 3.0, out


def test_placement_of_a_tp_stage() -> None:
    from atoll.node.placement import PlacementError, place
    from atoll.plan import PipelinePlan, Plan

    # stage 0: 2 replicas x tp 2 (a b | c d); stage 1: 2 replicas (e | f)
    plan = Plan(model="tiny", global_batch=16, seq_len=64, pipelines=[PipelinePlan(
        micro_batch=8, num_micro_batches=2, stages=[_stage((0, 3), ["a", "b", "c", "d"], tp=2),
                                                    _stage((3, 6), ["e", "f"])])])
    c, d, f = place(plan, "c", 6), place(plan, "d", 6), place(plan, "f", 6)
    assert (c.replica, c.tp, c.tp_rank, c.tp_group, c.rows) == (1, 2, 0, ("c", "d"), (8, 16))
    assert (d.replica, d.tp_rank, d.tp_group, d.rows) == (1, 1, ("c", "d"), (8, 16))
    assert [n.node_id for n in c.downstream] == ["f"] and d.downstream == () and d.upstream == ()
    assert [n.node_id for n in f.upstream] == ["c"]  # the neighbour stage talks to tp rank 0 only
    assert f.loss_group == ("e", "f")
    # gradients are averaged between the same tp rank of each replica
    assert [(s.holders, s.tp_rank) for s in c.segments] == [(("a", "c"), 0)]
    assert [(s.holders, s.tp_rank) for s in d.segments] == [(("b", "d"), 1)]

    wrong = Plan(model="tiny", global_batch=16, seq_len=64, pipelines=[PipelinePlan(
        micro_batch=8, num_micro_batches=2, stages=[_stage((0, 6), ["a", "b", "c"], tp=2)])])
    wrong.pipelines[0].stages[0].dp = 2
    with pytest.raises(PlacementError, match=r"dp = 2 x tp = 2 needs 4 nodes"):
        place(wrong, "a", 6)
    mixed = Plan(model="tiny", global_batch=16, seq_len=64, pipelines=[
        PipelinePlan(micro_batch=4, num_micro_batches=2, stages=[_stage((0, 6), ["a", "b"], tp=2)]),
        PipelinePlan(micro_batch=4, num_micro_batches=2, stages=[_stage((0, 6), ["c"])])])
    with pytest.raises(PlacementError, match="tp degrees"):
        place(mixed, "c", 6)


def test_a_model_tp_cannot_split_is_refused_with_what_to_change() -> None:
    from atoll.modelspec import ModelConfig
    from atoll.node.tp import check_shardable

    check_shardable(ModelConfig(**GQA), 2)
    with pytest.raises(ValueError, match="n_kv_heads"):
        check_shardable(ModelConfig(**GQA), 4)
    with pytest.raises(ValueError, match="n_heads"):
        check_shardable(ModelConfig(**{**GQA, "n_kv_heads": None}), 3)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(json.loads(sys.argv[2]))
if __name__ == "__main__" and sys.argv[1:2] == ["--join-worker"]:
    _join_worker(json.loads(sys.argv[2]))
if __name__ == "__main__" and sys.argv[1:2] == ["--module-worker"]:
    _module_worker(json.loads(sys.argv[2]))
