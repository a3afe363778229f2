"""The stage boundary's WAN codecs: hadamard (rotation, then 2-4-bit codes) and lowrank (PowerSGD factors).

This file is also a stage process of the two-process runs: `python test_wan_codecs.py --worker '<json>'`.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from atoll.compression import CodecError, CodecSpec, decode_tensor, encode_tensor, get_codec
from atoll.compression.hadamard import ROTATION, fwht
from atoll.compression.lowrank import LowRankLink
from atoll.job import JobSpec
from atoll.plan import PipelinePlan
from pipeline_harness import run_pinned_plan, stage, tiny_job

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(0,), (3, 0), (), (1,), (7,), (5, 3), (3, 255), (2, 257), (33, 64), (4, 5, 6)]
SPECS = [CodecSpec("hadamard"), CodecSpec("hadamard", bits=2, block_size=128), CodecSpec("hadamard", bits=3, block_size=5),
         CodecSpec("lowrank"), CodecSpec("lowrank", rank=1, seed=9), CodecSpec("lowrank", bits=16),
         CodecSpec("lowrank", rank=5, bits=8)]


def _roundtrip(x: torch.Tensor, spec: CodecSpec) -> torch.Tensor:
    enc = encode_tensor(x, spec)
    assert enc.wire_bytes == get_codec(spec).wire_size(x.shape, x.dtype)
    y = decode_tensor(bytes(enc.payload), enc.shape, enc.dtype, spec)
    assert y.shape == x.shape and y.dtype == x.dtype
    return y


def test_fwht_is_orthonormal_and_its_own_inverse() -> None:
    x = torch.randn(3, ROTATION)
    h = fwht(torch.eye(8))
    assert torch.allclose(h @ h.T, torch.eye(8), atol=1e-6)
    assert torch.allclose(fwht(fwht(x)), x, atol=1e-5)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_roundtrip_within_bound_over_dtypes_and_odd_shapes(spec: CodecSpec, dtype: torch.dtype) -> None:
    codec = get_codec(spec)
    g = torch.Generator().manual_seed(1)
    for shape in SHAPES:
        for scale in (1e-3, 1.0, 300.0):
            x = (torch.randn(shape, generator=g) * scale).to(dtype)
            if x.numel() > 3:
                x.view(-1)[2] *= 40  # an outlier
            y = _roundtrip(x, spec)
            err = float((y.float() - x.float()).abs().max()) if x.numel() else 0.0
            assert err <= codec.error_bound(x), (shape, scale, err, codec.error_bound(x))


def test_rotation_beats_plain_int4_on_outlier_channels_and_2_bits_keep_a_usable_error() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 768, generator=g)
    x[:, :6] *= 50  # outlier channels, as transformer activations hold
    rel = {}
    for spec in (CodecSpec("int4"), CodecSpec("hadamard", bits=4), CodecSpec("hadamard", bits=2, block_size=128)):
        rel[spec.label()] = float((_roundtrip(x, spec) - x).norm() / x.norm())
    assert rel["hadamard/4b/64"] < 0.85 * rel["int4/64"], rel  # measured 0.072 against 0.091
    assert rel["hadamard/2b/128"] < 0.45, rel
    # Gaussian data: the measured error matches what the policy budgets with
    z = torch.randn(512, 768, generator=g)
    for bits in (2, 3, 4):
        spec = CodecSpec("hadamard", bits=bits)
        got = float((_roundtrip(z, spec) - z).norm() / z.norm())
        assert abs(got - get_codec(spec).expected_error) < 0.15 * got, (bits, got)


def test_lowrank_recovers_a_low_rank_tensor_and_its_link_warm_starts_and_feeds_back() -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(8, 512, generator=g)
    x = torch.randn(300, 8, generator=g) @ base
    assert float((_roundtrip(x, CodecSpec("lowrank", rank=8, bits=16)) - x).norm() / x.norm()) < 0.02
    assert float((_roundtrip(x, CodecSpec("lowrank", rank=8, bits=8)) - x).norm() / x.norm()) < 0.05
    assert float((_roundtrip(x, CodecSpec("lowrank", rank=8, bits=4)) - x).norm() / x.norm()) < 0.25
    # successive micro-batches share a subspace: the warm-started link does better than a cold start after a few
    spec = CodecSpec("lowrank", rank=4, bits=16)
    link = LowRankLink(spec, error_feedback=False)
    cold = warm = 0.0
    for i in range(6):
        t = (torch.randn(300, 8, generator=g) @ base) + 0.05 * torch.randn(300, 512, generator=g)
        enc = link.encode(t)
        got = decode_tensor(enc.payload, enc.shape, enc.dtype, spec)  # the receiver holds no state
        warm = float((got - t).norm() / t.norm())
        cold = float((_roundtrip(t, spec) - t).norm() / t.norm())
    assert warm < cold * 1.05
    # error feedback: the sum of what was sent tracks the sum of the true tensors within one residual
    link = LowRankLink(spec, error_feedback=True)
    sent = torch.zeros(64, 128)
    true = torch.zeros(64, 128)
    for _ in range(20):
        t = torch.randn(64, 128, generator=g)
        enc = link.encode(t)
        sent += decode_tensor(enc.payload, enc.shape, enc.dtype, spec)
        true += t
    assert torch.allclose(sent + link._residual, true, atol=1e-3)
    link.reset()
    assert link._q is None and link._residual is None


@pytest.mark.parametrize("spec, at_125m, at_7b", [
    (CodecSpec("hadamard", bits=4), 7.5, 7.5), (CodecSpec("hadamard", bits=2, block_size=128), 15.0, 15.0),
    (CodecSpec("lowrank", rank=16), 69.0, 170.0), (CodecSpec("lowrank", rank=4), 279.0, 682.0)],
    ids=lambda v: v.label() if isinstance(v, CodecSpec) else str(v))
def test_ratio_at_125m_and_7b_boundaries(spec: CodecSpec, at_125m: float, at_7b: float) -> None:
    """fp32 bytes over wire bytes of a 2,048-token boundary at d_model 768 and 4096 (bf16: half of it)."""
    codec = get_codec(spec)
    for (rows, cols), want in (((2048, 768), at_125m), ((2048, 4096), at_7b)):
        wire = codec.wire_size((rows, cols), torch.float32)
        assert rows * cols * 4 / wire >= want
        assert rows * cols * 2 / codec.wire_size((rows, cols), torch.bfloat16) >= want / 2


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
def test_malformed_payloads_raise_codec_error(spec: CodecSpec) -> None:
    codec = get_codec(spec)
    x = torch.randn(6, 300)
    good = bytearray(encode_tensor(x, spec).payload)
    with pytest.raises(CodecError):
        codec.decode(bytes(good[:-1]), x.shape, x.dtype)
    with pytest.raises(CodecError):
        codec.decode(bytes(good) + b"\0", x.shape, x.dtype)
    with pytest.raises(CodecError):
        codec.decode(bytes(good), (7, 400), x.dtype)
    with pytest.raises(CodecError):
        encode_tensor(torch.tensor([1.0, float("nan")]), spec)
    bad = bytearray(good)
    bad[0:2] = torch.tensor([float("inf")], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    with pytest.raises(CodecError, match="inf or NaN"):
        codec.decode(bytes(bad), x.shape, x.dtype)
    if spec.codec == "hadamard" or spec.bits < 16:
        bad[0:2] = torch.tensor([-1.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
        with pytest.raises(CodecError, match="negative"):
            codec.decode(bytes(bad), x.shape, x.dtype)
    if spec.codec == "lowrank" and spec.bits < 16:
        odd = torch.randn(3, 7)
        enc = bytearray(encode_tensor(odd, CodecSpec("lowrank", rank=3, bits=4)).payload)
        enc[-1] |= 0xF0  # Q' is 7 x 3 codes of 4 bits: half a byte of padding
        with pytest.raises(CodecError, match="padding"):
            get_codec(CodecSpec("lowrank", rank=3, bits=4)).decode(bytes(enc), odd.shape, odd.dtype)
    if spec.codec == "hadamard":
        if spec.bits == 3:  # 3 bits leave padding in the last byte
            bad = bytearray(good)
            bad[-1] |= 0x80
            with pytest.raises(CodecError, match="padding"):
                codec.decode(bytes(bad), x.shape, x.dtype)
    else:  # a product beyond float16's range
        big = torch.full((6, 300), 1e5)  # 4-bit factors decode a constant at (7.5 / 8)^2 of it
        with pytest.raises(CodecError, match="overflows"):
            codec.decode(encode_tensor(big, spec).payload, big.shape, torch.float16)
    # fuzzed bytes of the right size: a CodecError or a finite tensor of the right shape, never a crash
    rng = random.Random(3)
    for _ in range(30):
        fuzz = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            fuzz[rng.randrange(len(fuzz))] = rng.randrange(256)
        try:
            y = codec.decode(bytes(fuzz), x.shape, x.dtype)
        except CodecError:
            continue
        assert y.shape == x.shape and bool(torch.isfinite(y).all())


def test_spec_params_cross_the_wire_and_are_checked() -> None:
    spec = CodecSpec("hadamard", bits=3, block_size=32, seed=77)
    assert CodecSpec.from_proto(*spec.to_proto()) == spec
    spec = CodecSpec("lowrank", rank=5, seed=3)
    assert CodecSpec.from_proto(*spec.to_proto()) == spec
    for bad in (dict(bits=1), dict(bits=5), dict(rank=0), dict(seed=-1)):
        with pytest.raises(CodecError):
            CodecSpec("hadamard", **bad)
    # another seed draws other sign flips: a receiver must use the sender's
    x = torch.randn(4, 256)
    enc = encode_tensor(x, CodecSpec("hadamard", seed=1))
    wrong = decode_tensor(enc.payload, enc.shape, enc.dtype, CodecSpec("hadamard", seed=2))
    assert float((wrong - x).norm() / x.norm()) > 0.5


def test_selectable_as_the_jobs_compression_mode() -> None:
    for mode in ("hadamard", "lowrank"):
        assert tiny_job(2, mode=mode).compression.mode == mode
    with pytest.raises(ValueError):
        tiny_job(2, mode="lowrank9")
    assert JobSpec  # the job file's [compression] mode is CompressionSpec.mode


def _two_stages(job) -> list[PipelinePlan]:
    n = job.model.n_layers + 2
    return [PipelinePlan(micro_batch=job.train.micro_batch, num_micro_batches=job.train.num_micro_batches,
                         stages=[stage((0, n // 2), ["a"]), stage((n // 2, n), ["b"])])]


def test_training_loss_near_identity(tmp_path) -> None:
    """30 steps of the tiny job on two stages (threads): the mean loss of the last 5 steps through each codec
    stays within 3% of identity's (measured: hadamard +0.7%, lowrank +0.3%, the codec modules' LOSS_COST)."""
    def final(mode: str) -> float:
        job = tiny_job(30, mode=mode)
        run = run_pinned_plan(job, _two_stages(job), tmp_path / mode, timeout=timedelta(seconds=60), join=120)
        return sum(run.losses[s] for s in range(25, 30)) / 5

    base = final("identity")
    for mode in ("hadamard", "lowrank"):
        assert final(mode) <= base * 1.03, mode


def test_quality_aware_policy_takes_the_least_loss_cost_that_hides(tmp_path) -> None:
    from atoll.compression import LinkPolicy, PolicyConfig, losscost

    costs = {"identity": 0.0, "int8/64": 0.001, "lowrank/r32/4b": 0.004, "int4/64": 0.006, "hadamard/4b/64": 0.05}
    config = PolicyConfig.wan(costs)
    # hadamard is over the 3% cost budget; bf16 has no measured cost: neither is a candidate
    assert [c.label() for c in config.allowed("activation")] == ["identity", "int8/64", "lowrank/r32/4b", "int4/64"]
    assert "hadamard/4b/64" in [c.label() for c in config.allowed("weight_grad")]  # gradients keep the error budget
    shape = (2048, 768)
    raw = 2048 * 768 * 4
    picks = {}
    for overlap in (10.0, 2.0, 0.5):
        policy = LinkPolicy(config, 10e6, 0.05)  # 80 Mbit/s, 50 ms one way; fresh: no hysteresis
        d = policy.choose(raw, "activation", overlap, shape=shape)
        picks[overlap] = d.spec.label()
        assert "loss cost" in d.reason
    # identity takes 0.68 s, int8 0.21 s, lowrank 0.09 s: the least cost whose transfer hides
    assert picks == {10.0: "identity", 2.0: "identity", 0.5: "int8/64"}
    assert LinkPolicy(config, 10e6, 0.05).choose(raw, "activation", 0.1, shape=shape).spec.label() == "lowrank/r32/4b"
    # a bench's table over the shipped one
    path = tmp_path / "costs.json"
    losscost.write_table(path, {"int4/64": 0.002, "identity": -0.001}, note="test")
    table = losscost.table(path)
    assert table["int4/64"] == 0.002 and table["identity"] == 0.0 and "hadamard/4b/64" in table
    path.write_text('{"loss_cost": {"int4/64": "x"}}')
    with pytest.raises(ValueError, match="finite number"):
        losscost.table(path)


def test_atoll_plan_prints_each_boundary_codec_ratio_stall_and_loss_cost(capsys, monkeypatch, tmp_path) -> None:
    import re

    from atoll.compression import losscost
    from atoll.launch.cli import main

    cluster = Path(__file__).resolve().parent.parent / "examples" / "clusters" / "two-regions.toml"
    table = tmp_path / "costs.json"
    losscost.write_table(table, {"lowrank/r32/4b": 0.004, "int8/64": 0.001}, note="test")
    monkeypatch.setenv("ATOLL_LOSS_COST", str(table))
    assert main(["plan", "--model", "7b", "--cluster", str(cluster), "--outer", "sync", "--compression", "wan"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r" (\w+) ([\d.]+) MB ([\d.]+)x [^,]+, stall [^,]+, loss \+([\d.]+)%", out)
    assert rows, out
    # a 7B boundary between regions over 1 Gbit/s (tens of MB a micro-batch): only lowrank hides it, at the table's
    # 0.4%; its ratio is the one at the plan's shape (rows x 4096 bfloat16), over 100x
    wide = [r for r in rows if r[0] == "lowrank"]
    assert wide and all(float(r[2]) > 100 and r[3] == "0.4" for r in wide), rows
    raw = float(wide[0][1]) * 1e6 / 2  # bfloat16 elements
    rows_ = raw / 4096
    k, b = 32, 4
    want = raw * 2 / (2 * (rows_ + k) + rows_ * k * b / 8 + 4096 * k * b / 8)
    assert abs(float(wide[0][2]) / want - 1) < 0.01, (wide[0], want)


# --- two stages in two processes --------------------------------------------------------------------------

PROCESS_STEPS = 30
BOUND = {"hadamard": 0.03, "lowrank": 0.03}
"""Each codec's stated bound on the mean loss of the last 5 steps over identity's, minus one (its LOSS_COST is
measured well inside it)."""


def _process_job(mode: str):
    return tiny_job(PROCESS_STEPS, mode=mode)


def _worker(args: dict) -> None:
    """One stage of the tiny job's two-stage plan: its own PlanRunner and Peer server, meeting the other process at
    the test's store (where each publishes its server's address); prints each step's loss as a JSON line."""
    import threading

    import torch
    import torch.distributed as dist

    from atoll.node.peer import PeerServer
    from atoll.node.runner import PlanRunner, RunContext
    from atoll.plan import Plan

    torch.set_num_threads(1)
    stage_no, mode = args["stage"], args["mode"]
    node = "ab"[stage_no]
    store = dist.TCPStore("127.0.0.1", args["store_port"], is_master=False, timeout=timedelta(seconds=60))
    server = PeerServer(node_id=node, listen="127.0.0.1:0", token="t")
    store.set(f"{mode}/addr/{node}", server.address)
    addresses = {n: store.get(f"{mode}/addr/{n}").decode() for n in "ab"}
    job = _process_job(mode)
    plan = Plan(model=job.model.name, global_batch=job.train.global_batch, seq_len=job.train.seq_len,
                pipelines=_two_stages(job), epoch=1, job_id=f"wan-{mode}", node_addresses=addresses,
                rendezvous=f"127.0.0.1:{args['store_port']}")

    def report(m) -> bool:
        if m.loss is not None:
            print(json.dumps({"step": m.step, "loss": m.loss,
                              "links": [[x.direction, x.codec, x.bytes_raw, x.bytes_wire] for x in m.links]}),
                  flush=True)
        return False

    ctx = RunContext(node_id=node, job=job, peer_server=server, checkpoint_dir=Path(args["dir"]), report_step=report,
                     report_checkpoint=lambda c: None, token="t", timeout=timedelta(seconds=60))
    try:
        PlanRunner(ctx, plan).run(threading.Event())
    finally:
        server.stop()


def _run_processes(mode: str, tmp_path) -> dict[int, float]:
    """step -> loss of the tiny job's two stages trained in two processes over loopback gRPC with codec `mode`."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker",
                               json.dumps({"stage": i, "mode": mode, "store_port": store.port,
                                           "dir": str(tmp_path / mode)})],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=Path(__file__).parent)
             for i in (0, 1)]
    deadline = time.monotonic() + 150
    try:
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, f"a {mode} stage process failed:\n{err[-3000:]}"
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    rows = [json.loads(x) for x in outs[1].splitlines() if x.startswith("{")]
    # the last stage's reports carry its link (backward) and the loss; the codec on the wire is the job's
    assert rows and all(link[1] == mode for r in rows for link in r["links"] if link[3]), rows[-1]
    return {r["step"]: r["loss"] for r in rows}


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_two_stage_processes_loss_within_bound_of_identity(tmp_path) -> None:
    """30 steps of the tiny job, each stage its own process, through each codec both ways: the mean loss of the
    last 5 steps within the codec's stated bound of identity's (the transport's lowrank runs PowerSGD with a warm
    start and error feedback on the gradients)."""
    losses = {mode: _run_processes(mode, tmp_path) for mode in ("identity", *BOUND)}
    assert all(len(v) == PROCESS_STEPS for v in losses.values()), {k: len(v) for k, v in losses.items()}
    tail = {mode: sum(v[s] for s in range(PROCESS_STEPS - 5, PROCESS_STEPS)) / 5 for mode, v in losses.items()}
    for mode, bound in BOUND.items():
        assert tail[mode] <= tail["identity"] * (1 + bound), (mode, tail)
    # a codec that sends nothing useful is caught: the untrained loss is far above identity's trained one
    assert losses["identity"][0] > tail["identity"] * (1 + max(BOUND.values())), losses["identity"][0]


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _worker(json.loads(sys.argv[2]))
