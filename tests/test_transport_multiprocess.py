"""Pipelined training with each stage in its own OS process, over loopback gRPC.

The tiny model cut into 3 stages trains 20 steps twice in the same processes: plan epoch 1 with the
identity codec on every link (the losses must equal the unsplit model's in one process) and plan epoch 2
with int8 on every link (the loss at step 20 within 2% of the identity run). Gradient norms are summed
across the stage processes over gloo.

This file is also the stage process: `python test_transport_multiprocess.py --worker '<json>'`.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from datetime import timedelta

import pytest

STEPS = 20
STAGES = 3
MICRO_BATCHES = 4
BATCH, SEQ = 8, 32
SEED = 7


def _stage_config():
    from atoll.node.stage import StageConfig
    return StageConfig(micro_batches=MICRO_BATCHES, lr=3e-3, recv_timeout=timedelta(seconds=30),
                       collective_timeout=timedelta(seconds=30))


def _batches():
    from atoll.models import preset
    from atoll.node.synthetic import synthetic_batch
    vocab = preset("tiny").vocab_size
    return [synthetic_batch(vocab_size=vocab, batch=BATCH, seq_len=SEQ, seed=SEED, step=k) for k in range(STEPS)]


# --- the stage process ----------------------------------------------------------------------------------

def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _worker(args: dict) -> None:
    import torch.distributed as dist

    from atoll.compression import CodecSpec
    from atoll.models import preset
    from atoll.node.dataparallel import gloo_group
    from atoll.node.grpc_transport import GrpcTransport, GrpcTransportConfig, PeerRef
    from atoll.node.inprocess import even_cuts
    from atoll.node.model import build_slice
    from atoll.node.norm_exchange import DistNormExchange
    from atoll.node.peer import PeerServer
    from atoll.node.stage import PipelineStage

    s, p, token = args["stage"], args["stages"], args["token"]
    config = preset("tiny")
    cuts = even_cuts(config.n_layers + 2, p)
    server = PeerServer(node_id=f"node{s}", listen="127.0.0.1:0", token=token)
    _emit({"address": server.address})
    peers = json.loads(sys.stdin.readline())["peers"]
    ref = {i: PeerRef(node_id=f"node{i}", address=a) for i, a in enumerate(peers)}
    store = dist.TCPStore("127.0.0.1", args["store_port"], is_master=False, timeout=timedelta(seconds=30))
    batches = _batches()
    report: dict = {"stage": s}
    for epoch, codec in ((1, "identity"), (2, "int8")):
        spec = CodecSpec(codec)
        transport = GrpcTransport(GrpcTransportConfig(
            job_id="job", node_id=f"node{s}", plan_epoch=epoch, stage=s, upstream=ref.get(s - 1),
            downstream=ref.get(s + 1), token=token, shape=(BATCH // MICRO_BATCHES, SEQ, config.d_model),
            micro_batches=MICRO_BATCHES, forward_codec=spec, backward_codec=spec), server)
        group = gloo_group(store, f"epoch{epoch}-norms", rank=s, size=p, timeout=timedelta(seconds=30))
        stage = PipelineStage(build_slice(config, cuts[s], cuts[s + 1], seed=SEED), stage=s, num_stages=p,
                              transport=transport, config=_stage_config(), norm_exchange=DistNormExchange(group))
        losses = []
        for k, batch in enumerate(batches):
            losses.append(stage.train_step(k, batch).loss)
        transport.flush(timedelta(seconds=30))
        links = [(x.direction, x.bytes_raw, x.bytes_wire, x.codec) for x in transport.link_stats()]
        transport.close()
        report[codec] = {"losses": losses, "links": links}
    server.stop()
    _emit(report)


# --- the test -------------------------------------------------------------------------------------------

def _read(proc: subprocess.Popen, deadline: float) -> dict:
    assert proc.stdout is not None
    while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, left))
        if not ready:
            raise TimeoutError(f"stage process {proc.pid} said nothing in time")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"stage process {proc.pid} exited with {proc.wait(5)}: {proc.stderr.read()}")
        if line.startswith("{"):
            return json.loads(line)


@pytest.fixture(scope="module")
def runs():
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = dict(os.environ, OMP_NUM_THREADS="1")  # three processes share two cores
    procs = [subprocess.Popen([sys.executable, __file__, "--worker",
                               json.dumps({"stage": s, "stages": STAGES, "token": "t0k",
                                           "store_port": store.port})],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env)
             for s in range(STAGES)]
    try:
        deadline = time.monotonic() + 60
        peers = [_read(p, deadline)["address"] for p in procs]
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(json.dumps({"peers": peers}) + "\n")
            p.stdin.flush()
        deadline = time.monotonic() + 150
        reports = [_read(p, deadline) for p in procs]
        for p in procs:
            assert p.wait(10) == 0
        yield reports
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_identity_links_give_the_losses_of_one_process(runs) -> None:
    from atoll.models import preset
    from atoll.node.reference import train_unsplit

    reference = train_unsplit(preset("tiny"), stage_config=_stage_config(), batches=_batches(), seed=SEED).losses
    losses = runs[-1]["identity"]["losses"]
    assert len(losses) == STEPS
    for k, (a, b) in enumerate(zip(losses, reference)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {k}: pipeline {a}, one process {b}"
    assert all(r["identity"]["losses"] == [None] * STEPS for r in runs[:-1])
    # every link carried every micro-batch of every step, byte for byte
    raw = STEPS * MICRO_BATCHES * (BATCH // MICRO_BATCHES) * SEQ * preset("tiny").d_model * 4
    for r in runs:
        for direction, bytes_raw, bytes_wire, codec in r["identity"]["links"]:
            assert (bytes_raw, bytes_wire, codec) == (raw, raw, "identity"), (r["stage"], direction)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_int8_links_stay_within_two_percent_of_identity(runs) -> None:
    identity, int8 = runs[-1]["identity"]["losses"], runs[-1]["int8"]["losses"]
    assert abs(int8[-1] - identity[-1]) <= 0.02 * identity[-1], (int8[-1], identity[-1])
    assert int8[-1] < int8[0]  # it trained
    for r in runs:
        for direction, bytes_raw, bytes_wire, codec in r["int8"]["links"]:
            assert codec == "int8" and bytes_wire < bytes_raw / 3, (r["stage"], direction, bytes_raw, bytes_wire)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(json.loads(sys.argv[2]))
