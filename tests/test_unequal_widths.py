"""Pipelines whose stages have different widths: row slices over gRPC, exact gradients and losses.

Nodes run as threads with real gRPC peers and gloo groups (`PlanRunner`), and are compared with the job
trained in one process: per-step losses, and the gradients every node holds after each step (Adam hides a
constant factor on a stage's gradients from the losses; the gradients do not).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from atoll.compression import CodecSpec
from atoll.job import JobSpec
from atoll.node import local, runner
from atoll.node.grpc_transport import GrpcTransport, GrpcTransportConfig, PeerRef, RowPeer
from atoll.node.local import train_local
from atoll.node.peer import PeerServer
from atoll.node.runner import PlanRunner, RunContext
from atoll.node.stage import PipelineStage
from atoll.node.transport import TensorKey, TransportError
from atoll.plan import PipelinePlan, Plan, StagePlan

REPO = Path(__file__).resolve().parent.parent
STEPS = 4


def _job(steps: int = STEPS) -> JobSpec:
    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    return replace(job, train=replace(job.train, steps=steps, warmup=2),
                   checkpoint=replace(job.checkpoint, interval=0),
                   compression=replace(job.compression, mode="identity"))


def _stage(layers, nodes):
    return StagePlan(island="i", layers=layers, dp=len(nodes), nodes=list(nodes))


class _Grads:
    """Records, per node thread, the gradient of every parameter after each step (clipped, averaged)."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, list[torch.Tensor]]] = {}
        self.lock = threading.Lock()

    def stage_class(self):
        grads = self

        class Recording(PipelineStage):
            def train_step(self, step, batch=None):
                result = super().train_step(step, batch)
                with grads.lock:
                    got = grads.by_step.setdefault(step, {})
                    for name, p in self.module.named_parameters():
                        if p.grad is not None:
                            got.setdefault(name, []).append(p.grad.detach().clone())
                return result
        return Recording


def _run(job: JobSpec, pipelines: list[PipelinePlan], tmp_path: Path) -> dict[int, float]:
    nodes = sorted({n for p in pipelines for s in p.stages for n in s.nodes})
    servers = {n: PeerServer(node_id=n, listen="127.0.0.1:0", token="t") for n in nodes}
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    plan = Plan(model="tiny", global_batch=job.train.global_batch, seq_len=job.train.seq_len, pipelines=pipelines,
                epoch=1, job_id="job", node_addresses={n: s.address for n, s in servers.items()},
                rendezvous=f"127.0.0.1:{store.port}")
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
                         timeout=timedelta(seconds=40))
        try:
            PlanRunner(ctx, plan).run(threading.Event())
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=node, args=(n,)) for n in nodes]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    finally:
        for s in servers.values():
            s.stop()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a node thread did not finish"
    return losses


def _check(job: JobSpec, pipelines: list[PipelinePlan], tmp_path: Path, monkeypatch) -> None:
    ref, got = _Grads(), _Grads()
    monkeypatch.setattr(local, "PipelineStage", ref.stage_class())
    expected, _ = train_local(job)
    monkeypatch.setattr(runner, "PipelineStage", got.stage_class())
    losses = _run(job, pipelines, tmp_path)
    assert sorted(losses) == list(range(job.train.steps))
    for s in range(job.train.steps):
        assert abs(losses[s] - expected[s]) <= 1e-4 * abs(expected[s]), (s, losses[s], expected[s])
        want = {name: g[0] for name, g in ref.by_step[s].items()}
        have = got.by_step[s]
        assert set(have) == set(want), sorted(set(have) ^ set(want))
        for name, copies in have.items():
            for g in copies:  # every holder of a parameter holds the whole batch's gradient
                err = torch.linalg.vector_norm(g - want[name]) / torch.linalg.vector_norm(want[name]).clamp_min(1e-12)
                assert err <= 1e-4, (s, name, float(err))


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_two_replicas_feed_one(tmp_path: Path, monkeypatch) -> None:
    """Widths 2 then 1: the second stage assembles each micro-batch from two senders' row slices."""
    _check(_job(), [PipelinePlan(micro_batch=4, num_micro_batches=4,
                                 stages=[_stage((0, 3), ["a", "b"]), _stage((3, 6), ["c"])])], tmp_path, monkeypatch)


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_one_replica_feeds_two(tmp_path: Path, monkeypatch) -> None:
    """Widths 1 then 2: the first stage splits each activation by rows and assembles the gradients."""
    _check(_job(), [PipelinePlan(micro_batch=4, num_micro_batches=4,
                                 stages=[_stage((0, 2), ["a"]), _stage((2, 6), ["b", "c"])])], tmp_path, monkeypatch)


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_two_replicas_feed_three_with_uneven_shares(tmp_path: Path, monkeypatch) -> None:
    """Widths 2 then 3 on micro-batches of 8 rows: shares 4+4 then 3+3+2, so the middle replica of the
    second stage takes rows from both senders, and the replicas train different numbers of rows."""
    _check(_job(), [PipelinePlan(micro_batch=8, num_micro_batches=2,
                                 stages=[_stage((0, 3), ["a", "b"]), _stage((3, 6), ["c", "d", "e"])])],
           tmp_path, monkeypatch)


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_three_stages_of_widths_one_two_one_beside_a_second_pipeline(tmp_path: Path, monkeypatch) -> None:
    """A middle stage wider than its neighbours, and a second pipeline cut elsewhere: segment averaging
    weighted by rows and the norm exchange stay exact."""
    _check(_job(), [
        PipelinePlan(micro_batch=4, num_micro_batches=3,
                     stages=[_stage((0, 2), ["a"]), _stage((2, 4), ["b", "c"]), _stage((4, 6), ["d"])]),
        PipelinePlan(micro_batch=2, num_micro_batches=2, stages=[_stage((0, 3), ["e"]), _stage((3, 6), ["f"])]),
    ], tmp_path, monkeypatch)


@pytest.mark.timeout(60)
def test_transport_splits_and_assembles_row_slices(tmp_path: Path) -> None:
    """Two senders of 2 rows each and one receiver of 4 rows: the receiver gets the rows in order; its
    activation-gradients go back split, each scaled by 4 / 2 (the receiver's rows over the sender's)."""
    names = ["a", "b", "c"]
    servers = {n: PeerServer(node_id=n, listen="127.0.0.1:0", token="t") for n in names}
    ref = {n: PeerRef(node_id=n, address=s.address) for n, s in servers.items()}
    shape = (2, 3, 5)
    base = dict(job_id="j", plan_epoch=1, shape=shape, micro_batches=2, token="t",
                forward_codec=CodecSpec("identity"), backward_codec=CodecSpec("identity"))
    senders = {n: GrpcTransport(GrpcTransportConfig(
        node_id=n, stage=0, replica=r, upstream=None, downstream=(RowPeer(peer=ref["c"], rows=(0, 4)),),
        rows=(2 * r, 2 * r + 2), **base), servers[n]) for r, n in enumerate(["a", "b"])}
    receiver = GrpcTransport(GrpcTransportConfig(
        node_id="c", stage=1, upstream=(RowPeer(peer=ref["a"], rows=(0, 2)), RowPeer(peer=ref["b"], rows=(2, 4))),
        downstream=None, rows=(0, 4), **{**base, "shape": (4, 3, 5)}), servers["c"])
    try:
        x = torch.randn(4, 3, 5)
        senders["b"].send(TensorKey(0, 1, "forward"), x[2:])
        senders["a"].send(TensorKey(0, 1, "forward"), x[:2])
        assert torch.equal(receiver.recv(TensorKey(0, 1, "forward"), timedelta(seconds=10)), x)
        g = torch.randn(4, 3, 5)
        receiver.send(TensorKey(0, 1, "backward"), g)
        assert torch.equal(senders["a"].recv(TensorKey(0, 1, "backward"), timedelta(seconds=10)), g[:2] * 2)
        assert torch.equal(senders["b"].recv(TensorKey(0, 1, "backward"), timedelta(seconds=10)), g[2:] * 2)
        # a slice of the wrong shape is refused, and the receiver keeps waiting for the right one
        senders["a"].send(TensorKey(0, 0, "forward"), torch.randn(2, 3, 5))
        with pytest.raises(TransportError):
            senders["b"].send(TensorKey(0, 0, "forward"), torch.randn(3, 3, 5))
            senders["b"].flush(timedelta(seconds=10))
        with pytest.raises(TransportError, match="from b"):
            receiver.recv(TensorKey(0, 0, "forward"), timedelta(seconds=0.5))
    finally:
        for t in [*senders.values(), receiver]:
            t.close()
        for s in servers.values():
            s.stop()


def test_row_peers_must_cover_this_replicas_rows() -> None:
    p = {n: PeerRef(node_id=n, address=f"127.0.0.1:{i + 1}") for i, n in enumerate("abc")}
    base = dict(job_id="j", plan_epoch=1, node_id="c", stage=1, downstream=None, rows=(0, 4), shape=(4, 3, 5))
    with pytest.raises(ValueError, match="cover"):  # rows 2..4 have no sender
        GrpcTransportConfig(upstream=(RowPeer(peer=p["a"], rows=(0, 2)),), **base)
    with pytest.raises(ValueError, match="row order"):
        GrpcTransportConfig(upstream=(RowPeer(peer=p["b"], rows=(2, 4)), RowPeer(peer=p["a"], rows=(0, 2))), **base)
    with pytest.raises(ValueError, match="shape"):
        GrpcTransportConfig(upstream=(RowPeer(peer=p["a"], rows=(0, 4)),), **{**base, "shape": None})
    with pytest.raises(ValueError, match="empty tuple"):
        GrpcTransportConfig(upstream=(), **base)
