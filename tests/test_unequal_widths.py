"""Pipelines whose stages have different widths: row slices over gRPC, exact gradients and losses.

Nodes run as threads with real gRPC peers and gloo groups (`PlanRunner`), and are compared with the job
trained in one process: per-step losses, and the gradients every node holds after each step (Adam hides a
constant factor on a stage's gradients from the losses; the gradients do not).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from pipeline_harness import assert_losses_match, run_pinned_plan, stage, tiny_job

from atoll.compression import CodecSpec
from atoll.job import JobSpec
from atoll.node import local, runner
from atoll.node.grpc_transport import GrpcTransport, GrpcTransportConfig, PeerRef, RowPeer
from atoll.node.local import train_local
from atoll.node.peer import PeerServer
from atoll.node.stage import PipelineStage
from atoll.node.transport import TensorKey, TransportError
from atoll.plan import PipelinePlan, Plan, StagePlan

REPO = Path(__file__).resolve().parent.parent
STEPS = 4


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


def _check(job: JobSpec, pipelines: list[PipelinePlan], tmp_path: Path, monkeypatch, *, grads: bool = True) -> None:
    """`grads=False` for plans with ZeRO, whose replicas keep only their own chunk of the reduced gradient (the
    losses still tell a gradient off by a factor: the clipping norm is the whole pipeline's)."""
    ref, got = _Grads(), _Grads()
    monkeypatch.setattr(local, "PipelineStage", ref.stage_class())
    expected, _ = train_local(job)
    monkeypatch.setattr(runner, "PipelineStage", got.stage_class())
    losses = run_pinned_plan(job, pipelines, tmp_path / "ckpt", timeout=timedelta(seconds=40)).losses
    assert sorted(losses) == list(range(job.train.steps))
    assert_losses_match(losses, expected, 1e-4, range(job.train.steps))
    for s in range(job.train.steps if grads else 0):
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
    _check(tiny_job(STEPS), [PipelinePlan(micro_batch=4, num_micro_batches=4,
                                 stages=[stage((0, 3), ["a", "b"]), stage((3, 6), ["c"])])], tmp_path, monkeypatch)


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_one_replica_feeds_two(tmp_path: Path, monkeypatch) -> None:
    """Widths 1 then 2: the first stage splits each activation by rows and assembles the gradients."""
    _check(tiny_job(STEPS), [PipelinePlan(micro_batch=4, num_micro_batches=4,
                                 stages=[stage((0, 2), ["a"]), stage((2, 6), ["b", "c"])])], tmp_path, monkeypatch)


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_two_replicas_feed_three_with_uneven_shares(tmp_path: Path, monkeypatch) -> None:
    """Widths 2 then 3 on micro-batches of 8 rows: shares 4+4 then 3+3+2, so the middle replica of the
    second stage takes rows from both senders, and the replicas train different numbers of rows."""
    _check(tiny_job(STEPS), [PipelinePlan(micro_batch=8, num_micro_batches=2,
                                 stages=[stage((0, 3), ["a", "b"]), stage((3, 6), ["c", "d", "e"])])],
           tmp_path, monkeypatch)


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_three_stages_of_widths_one_two_one_beside_a_second_pipeline(tmp_path: Path, monkeypatch) -> None:
    """A middle stage wider than its neighbours, and a second pipeline cut elsewhere: segment averaging
    weighted by rows and the norm exchange stay exact."""
    _check(tiny_job(STEPS), [
        PipelinePlan(micro_batch=4, num_micro_batches=3,
                     stages=[stage((0, 2), ["a"]), stage((2, 4), ["b", "c"]), stage((4, 6), ["d"])]),
        PipelinePlan(micro_batch=2, num_micro_batches=2, stages=[stage((0, 3), ["e"]), stage((3, 6), ["f"])]),
    ], tmp_path, monkeypatch)


@pytest.mark.integration
@pytest.mark.timeout(150)
@pytest.mark.parametrize("fields", [{"defer_weights": 2}, {"zero": 1}])
def test_a_middle_stage_in_two_lanes(tmp_path: Path, monkeypatch, fields) -> None:
    """Lanes: the middle stage's replicas b and c take alternate micro-batches (b the even ones, c the odd), so
    a sends and d receives each micro-batch to and from its lane; b and c train different micro-batches but
    average their gradients (plainly, or ZeRO-1 over both lanes), with their weight gradients deferred or not:
    exact all the same (each replica's loss is the mean over its own micro-batches, so the gradients crossing a
    laned stage's boundaries are scaled by the lanes on either side)."""
    _check(tiny_job(STEPS), [PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
        stage((0, 2), ["a"]), stage((2, 4), ["b", "c"], lanes=2, **fields), stage((4, 6), ["d"])])],
        tmp_path, monkeypatch, grads="zero" not in fields)


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_first_and_last_stages_in_lanes_of_two_replicas(tmp_path: Path, monkeypatch) -> None:
    """A first stage of two lanes of one replica reads its lane's rows of the batch; a last stage of two lanes
    of two replicas each (four replicas, wider than the micro-batch of 2 rows) splits each micro-batch's rows
    within its lane and weighs its loss and gradients by the rows it trained."""
    _check(tiny_job(STEPS), [PipelinePlan(micro_batch=2, num_micro_batches=8, stages=[
        stage((0, 3), ["a", "b"], lanes=2), stage((3, 6), ["c", "d", "e", "f"], lanes=2)])], tmp_path, monkeypatch)


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_a_laned_zero_stage_checkpoints_whole_and_a_plan_without_lanes_resumes_it(tmp_path: Path) -> None:
    """ZeRO-1 over two lanes gathers its optimizer states whole into the checkpoint of step 2; a plan of other
    widths and no lanes resumes from it, and the losses of all four steps are one process's."""
    job = tiny_job(STEPS, interval=2)
    expected, _ = train_local(job)
    laned = [PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
        stage((0, 3), ["a", "b"], lanes=2, zero=1), stage((3, 6), ["c"])])]
    first = run_pinned_plan(job, laned, tmp_path / "ckpt", until_step=2, timeout=timedelta(seconds=40)).losses
    plain = [PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[stage((0, 2), ["d"]), stage((2, 6), ["e", "f"])])]
    rest = run_pinned_plan(job, plain, tmp_path / "ckpt", resume_step=2, timeout=timedelta(seconds=40)).losses
    assert sorted(first) == [0, 1] and sorted(rest) == [2, 3]
    assert_losses_match({**first, **rest}, expected, 1e-4, range(STEPS))


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


# --- the coordinator's side ----------------------------------------------------------------------------


def _live_inputs(groups: dict[str, list[str]]):
    """PlanInputs for a live cluster: one island per device name, measured timings, fast links inside."""
    from atoll.coordinator.islands import form_islands
    from atoll.coordinator.linkmatrix import complete_matrix
    from atoll.coordinator.planning import PlanInputs
    from atoll.coordinator.store import MemberRecord
    from atoll.types import LayerTiming, LinkMeasurement, NodeProfile

    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    lt = [LayerTiming(layer_kind=k, micro_batch=b, seq_len=64, forward_seconds=1e-3 * b, backward_seconds=2e-3 * b)
          for k in ("embedding", "block", "head") for b in (1, 2, 4, 8)]
    members = {n: MemberRecord(node_id=n, peer_address=f"10.0.{i}.1:5000", profile=NodeProfile(
        hostname=n, device_kind="cpu", device_name=device, memory_total_bytes=8 << 30, memory_free_bytes=8 << 30,
        layer_timings=lt)) for i, (device, n) in enumerate((d, n) for d, ns in groups.items() for n in ns)}
    ids = sorted(members)
    links = [LinkMeasurement(src=a, dst=b, rtt_seconds=1e-4, bandwidth_bytes_per_s=1e9 if
                             members[a].profile.device_name == members[b].profile.device_name else 1e8)
             for a in ids for b in ids if a < b]
    matrix = complete_matrix(ids, links)
    islands = form_islands({n: m.profile for n, m in members.items()}, matrix)
    return PlanInputs(job=job, members=members, islands=islands, matrix=matrix, links=links, epoch=3,
                      rendezvous="10.0.9.9:29400")


@pytest.mark.parametrize("groups", [
    {"x": ["a1", "a2"], "y": ["b1"]},
    {"x": ["a1", "a2", "a3"]},
    {"x": ["a1", "a2", "a3"], "y": ["b1", "b2"]},
    {"x": ["a1", "a2", "a3", "a4"], "y": ["b1"], "z": ["c1", "c2"]},
])
def test_every_plan_the_coordinator_makes_is_one_the_runtime_places(groups) -> None:
    """The planner may give stages of one pipeline different widths (and shares that differ by a row); every
    node of the plan it makes finds its place, with distinct nodes per stage."""
    from atoll.coordinator.planning import make_plan
    from atoll.node.placement import place

    inputs = _live_inputs(groups)
    plan, how = make_plan(inputs)
    assert how == "planner", how
    nodes = [n for p in plan.pipelines for s in p.stages for n in s.nodes]
    assert len(nodes) == len(set(nodes))
    for n in nodes:
        assert place(plan, n, inputs.job.model_spec.num_layers) is not None


def test_finish_plan_gives_stages_on_one_island_nodes_of_their_own() -> None:
    from atoll.coordinator.planning import finish_plan

    inputs = _live_inputs({"x": ["a1", "a2", "a3"]})
    island = inputs.islands[0].id
    plan = Plan(model="tiny", global_batch=16, seq_len=64, pipelines=[PipelinePlan(
        micro_batch=4, num_micro_batches=4, stages=[StagePlan(island=island, layers=(0, 3), dp=2),
                                                    StagePlan(island=island, layers=(3, 6), dp=1)])])
    plan = finish_plan(plan, inputs)
    assert [s.nodes for s in plan.pipelines[0].stages] == [["a1", "a2"], ["a3"]]
    plan.pipelines[0].stages[1].nodes = ["a1"]
    with pytest.raises(ValueError, match="node a1 is listed in stage 0 of pipeline 0 and again in stage 1"):
        finish_plan(plan, inputs)
    plan.pipelines[0].stages[1].nodes, plan.pipelines[0].stages[1].dp = [], 2
    with pytest.raises(ValueError, match="needs 2 nodes of island"):
        finish_plan(plan, inputs)


def _pinned(nodes: tuple[list[str], list[str]], lanes: int = 1) -> Plan:
    return Plan(model="tiny", global_batch=16, seq_len=64, pipelines=[PipelinePlan(
        micro_batch=4, num_micro_batches=4, stages=[StagePlan(island="wide", layers=(0, 3), dp=len(nodes[0]),
                                                              nodes=nodes[0], lanes=lanes),
                                                    StagePlan(island="narrow", layers=(3, 6), dp=len(nodes[1]),
                                                              nodes=nodes[1])])])


def test_a_pinned_plan_is_checked_against_the_job_and_filled_in(tmp_path: Path) -> None:
    from atoll.coordinator.state import load_pinned_plan, pinned_planner

    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    path = tmp_path / "plan.json"
    _pinned((["a1", "a2"], ["b1"])).save(path)
    pinned = load_pinned_plan(path, job)
    inputs = _live_inputs({"x": ["a1", "a2"], "y": ["b1"]})
    plan, how = pinned_planner(pinned)(inputs)
    assert how == "the pinned plan (--plan)"
    assert [(s.nodes, s.dp) for s in plan.pipelines[0].stages] == [(["a1", "a2"], 2), (["b1"], 1)]
    assert (plan.epoch, plan.rendezvous, plan.job_id) == (3, "10.0.9.9:29400", job.id)
    assert plan.node_addresses == {n: m.peer_address for n, m in inputs.members.items()}
    assert {s.island for s in plan.pipelines[0].stages} == {i.id for i in inputs.islands}
    # a pinned node that is not alive: the planner plans, and says why
    plan, how = pinned_planner(pinned)(_live_inputs({"x": ["a1", "a2"], "y": ["b2"]}))
    assert "not the pinned plan: b1 not alive" in how
    assert "b1" not in {n for p in plan.pipelines for s in p.stages for n in s.nodes}
    # what a pinned plan must get right, each refused with what to change
    unnamed = _pinned((["a1", "a2"], ["b1"]))
    unnamed.pipelines[0].stages[1].nodes = []
    for bad, match in [(unnamed, "lists 0 node ids; with dp = 1 and tp = 1 it needs 1"),
                       (_pinned((["a1", "a1"], ["b1"])), "runs another stage"),
                       (_pinned((["a1", "a2", "a3", "a4", "a5"], ["b1"])), "cannot share a micro-batch of 4")]:
        bad.save(path)
        with pytest.raises(ValueError, match=match):
            load_pinned_plan(path, job)
    wrong_batch = _pinned((["a1"], ["b1"]))
    wrong_batch.global_batch = 32
    wrong_batch.save(path)
    with pytest.raises(ValueError, match="train.global_batch"):
        load_pinned_plan(path, job)
    path.write_text('{"model": "tiny"}')
    with pytest.raises(ValueError, match="is not a plan"):
        load_pinned_plan(path, job)


E2E_STEPS = 8


@pytest.mark.integration
@pytest.mark.timeout(150)
@pytest.mark.parametrize("lanes", [1, 2])
def test_coordinator_publishes_a_pinned_plan_of_widths_two_then_one(tmp_path: Path, lanes: int) -> None:
    """`atoll coordinator --plan` and three `atoll node` processes: two nodes run the first stage (sharing each
    micro-batch, or in two lanes taking alternate micro-batches), one the second; the losses match one
    process."""

    from atoll.launch.localcluster import LocalCluster

    job = tiny_job(E2E_STEPS, nodes=3)
    job_path, plan_path, out = tmp_path / "job.toml", tmp_path / "plan.json", tmp_path / "cluster"
    job_path.write_text(job.to_toml())
    ids = {"node1": "wide-0", "node2": "wide-1", "node3": "narrow-0"}
    _pinned((["wide-0", "wide-1"], ["narrow-0"]), lanes).save(plan_path)
    expected, _ = train_local(job)
    with LocalCluster(job_path=job_path, out=out, profile_seconds=1.0) as cluster:
        cluster.start_coordinator(extra=["--plan", str(plan_path)])
        for name, node_id in ids.items():  # known before the nodes start, so the plan can name them
            cluster.start_node(name, node_id=node_id)
        losses = cluster.wait_losses(E2E_STEPS, 120)
        status = cluster.status()
    stages = status.plan.pipelines[0].stages
    assert [(list(s.node_ids), s.dp, s.lanes or 1) for s in stages] == [(["wide-0", "wide-1"], 2, lanes),
                                                                        (["narrow-0"], 1, 1)]
    assert_losses_match(losses, expected, 1e-4, range(E2E_STEPS))
