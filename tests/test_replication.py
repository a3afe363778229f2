"""State between nodes: checksummed, resumable fetches over real gRPC Peer servers; checkpoint copies to k
peers; the choice of copy holders; the coordinator's index of copies; the resume point of a new plan."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
import torch

from atoll.coordinator.checkpoints import complete_steps, copies_of, replication, resume_step
from atoll.coordinator.planning import handing_over
from atoll.coordinator.store import CheckpointRecord, MemberRecord
from atoll.models import preset
from atoll.node import state_transfer
from atoll.node.checkpoint import load_layers, save_layers
from atoll.node.live_state import Holder, ResumePoint, agree, gather_held, resume_point, slice_part, sources
from atoll.node.model import build_slice
from atoll.node.peer import PeerServer
from atoll.node.replication import Replicator, fetch_checkpoint, replica_targets
from atoll.node.slice_state import load_slice, slice_state
from atoll.node.stage import StageConfig, build_optimizer
from atoll.node.state_transfer import (LiveState, StateHolder, StateTransferError, checkpoint_file,
                                       deserialize_state, fetch_state, fetch_state_to_file)
from atoll.plan import CheckpointCopy, IslandInfo, PipelinePlan, Plan, StagePlan
from atoll.types import NodeProfile
from atoll.v1 import atoll_pb2 as pb

pytestmark = pytest.mark.timeout(60)

TOKEN = "t0ken"
MODEL = preset("tiny")  # 6 layers counting embedding and head


def _trained(start: int, end: int, seed: int = 0):
    module = build_slice(MODEL, start, end, seed=seed)
    opt = build_optimizer(module, StageConfig(micro_batches=1))
    for p in module.parameters():
        p.grad = torch.randn_like(p) * 0.01
    opt.step()
    return module, opt


def _server(node: str, root: Path | None = None) -> PeerServer:
    server = PeerServer(node_id=node, listen="127.0.0.1:0", token=TOKEN)
    server.state = StateHolder(node_id=node, checkpoint_dir=root)
    return server


def _request(kind: str, step: int, layers: tuple[int, int]) -> pb.StateFetchRequest:
    return pb.StateFetchRequest(job_id="j", kind=kind, step=step, layer_start=layers[0], layer_end=layers[1],
                                sender="asker")


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(state_transfer, "CHUNK_BYTES", 4096)


def test_live_state_fetch_is_checksummed_and_loads_bit_identical(small_chunks) -> None:
    module, opt = _trained(0, 3)
    with _server("a") as server:
        server.state.end_run(1, LiveState.of(slice_state(module, opt), step=7, epoch=1))
        data, stats = fetch_state(server.address, _request("live", 7, (0, 3)), source="a", token=TOKEN)
    assert stats.bytes == len(data) == len(server.state.live.data) and stats.attempts == 1
    other = build_slice(MODEL, 1, 3, seed=5)
    other_opt = build_optimizer(other, StageConfig(micro_batches=1))
    load_slice(other, [slice_part(deserialize_state(data, "a"), (1, 3))], other_opt)
    for name, p in other.named_parameters():
        assert torch.equal(p, dict(module.named_parameters())[name])
        assert torch.equal(other_opt.state[p]["exp_avg"], opt.state[dict(module.named_parameters())[name]]["exp_avg"])


class _Flaky(StateHolder):
    """Breaks its first stream after two chunks, and corrupts one chunk of its second."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[int] = []

    def chunks(self, request) -> Iterator[pb.StateChunk]:
        self.calls.append(request.offset)
        inner = super().chunks(request)
        call = len(self.calls)

        def gen():
            for i, c in enumerate(inner):
                if call == 1 and i == 2:
                    raise RuntimeError("the link dropped")
                if call == 2 and i == 1:
                    c = pb.StateChunk(**{f.name: getattr(c, f.name) for f in c.DESCRIPTOR.fields})
                    c.data = bytes([c.data[0] ^ 0xFF]) + c.data[1:]  # (a byte set to b"x" may have been one already)
                yield c
        return gen()


def test_a_broken_or_corrupted_stream_resumes_from_its_offset(small_chunks) -> None:
    module, opt = _trained(0, 2)
    live = LiveState.of(slice_state(module, opt), step=3, epoch=2)
    with PeerServer(node_id="a", listen="127.0.0.1:0", token=TOKEN) as server:
        server.state = holder = _Flaky(node_id="a")
        holder.end_run(2, live)
        data, stats = fetch_state(server.address, _request("live", 3, (0, 2)), source="a", token=TOKEN)
    assert data == live.data
    assert stats.attempts == 3, (stats, holder.calls)
    # resumed at the bytes that checked out: after the two chunks of the broken stream, then after one more
    assert holder.calls == [0, 2 * 4096, 3 * 4096]
    assert stats.bytes == len(live.data) + 4096  # only the corrupted chunk came twice


class _Trickle(StateHolder):
    """Breaks every stream after `after` chunks, as a call's deadline does over a link too slow for the whole
    state."""

    def __init__(self, *a, after: int = 2, **kw):
        super().__init__(*a, **kw)
        self.calls: list[int] = []
        self.after = after

    def chunks(self, request) -> Iterator[pb.StateChunk]:
        self.calls.append(request.offset)
        inner = super().chunks(request)

        def gen():
            for i, c in enumerate(inner):
                if i == self.after:
                    raise RuntimeError("deadline")
                yield c
        return gen()


def test_a_fetch_that_moves_on_each_call_is_not_bounded_by_its_attempts(small_chunks) -> None:
    """Attempts bound the calls in a row that bring nothing: a state many calls long (each broken off after two
    chunks) arrives whole, while a holder that sends nothing fails after `attempts` calls."""
    module, opt = _trained(0, 2)
    live = LiveState.of(slice_state(module, opt), step=3, epoch=2)
    assert len(live.data) > 8 * 2 * 4096
    with PeerServer(node_id="a", listen="127.0.0.1:0", token=TOKEN) as server:
        server.state = holder = _Trickle(node_id="a")
        holder.end_run(2, live)
        data, stats = fetch_state(server.address, _request("live", 3, (0, 2)), source="a", token=TOKEN, attempts=2)
        assert data == live.data and stats.bytes == len(live.data)
        assert stats.attempts == len(holder.calls) > 8
        assert holder.calls == [2 * 4096 * i for i in range(len(holder.calls))]
        server.state = holder = _Trickle(node_id="a", after=0)
        holder.end_run(2, live)
        with pytest.raises(StateTransferError, match="2 attempts in a row brought less than 4096 bytes"):
            fetch_state(server.address, _request("live", 3, (0, 2)), source="a", token=TOKEN, attempts=2)
        assert holder.calls == [0, 0]


def test_a_file_fetch_resumes_from_its_part_file_and_a_wrong_request_is_refused(tmp_path: Path, small_chunks) -> None:
    module, opt = _trained(0, 2)
    path, size = save_layers(module, opt, tmp_path / "a", 10, data_position=0)
    dest = tmp_path / "b" / "copy.pt"
    dest.parent.mkdir()
    dest.with_name("copy.pt.part").write_bytes(path.read_bytes()[:10000])  # an earlier fetch broke off here
    with _server("a", tmp_path / "a") as server:
        stats = fetch_state_to_file(server.address, _request("checkpoint", 10, (0, 2)), dest, source="a", token=TOKEN)
        assert dest.read_bytes() == path.read_bytes() and stats.bytes == size - 10000
        with pytest.raises(StateTransferError, match="NOT_FOUND.*holds no checkpoint of layers \\[0, 3\\)"):
            fetch_state(server.address, _request("checkpoint", 10, (0, 3)), source="a", token=TOKEN)
        with pytest.raises(StateTransferError, match="NOT_FOUND.*holds nothing"):
            fetch_state(server.address, _request("live", 10, (0, 2)), source="a", token=TOKEN)
        with pytest.raises(StateTransferError, match="INVALID_ARGUMENT.*kind must be"):
            fetch_state(server.address, _request("other", 10, (0, 2)), source="a", token=TOKEN)
        with pytest.raises(StateTransferError, match="UNAUTHENTICATED"):
            fetch_state(server.address, _request("live", 10, (0, 2)), source="a", token="wrong")
    assert not dest.with_name("copy.pt.part").exists()


def test_held_state_waits_for_older_runs_to_end() -> None:
    with _server("a") as server:
        holder = server.state
        holder.begin_run(4)
        module, opt = _trained(0, 2)
        threading.Timer(0.5, lambda: holder.end_run(4, LiveState.of(slice_state(module, opt), step=9, epoch=4))).start()
        started = time.monotonic()
        reply = state_transfer.held_state(server.address, job_id="j", epoch=5, sender="b", token=TOKEN,
                                          timeout=timedelta(seconds=10))
        assert time.monotonic() - started >= 0.4
        assert (reply.holds, reply.step, reply.layer_start, reply.layer_end) == (True, 9, 0, 2)
        holder.begin_run(5)  # a run of the asked epoch itself does not hold the answer back
        assert state_transfer.held_state(server.address, job_id="j", epoch=5, sender="b", token=TOKEN).step == 9


def _plan(regions: dict[str, str], stages: list[tuple[tuple[int, int], list[str]]], addresses: dict[str, str]) -> Plan:
    islands = {}
    for n, r in regions.items():
        islands.setdefault(r, []).append(n)
    return Plan(model="tiny", global_batch=4, seq_len=8, epoch=3, job_id="j",
                islands=[IslandInfo(id=f"i-{r}", group=r, nodes=ns) for r, ns in islands.items()],
                pipelines=[PipelinePlan(micro_batch=4, num_micro_batches=1, stages=[
                    StagePlan(island=f"i-{regions[ns[0]]}", layers=layers, dp=len(ns), nodes=ns) for layers, ns in stages])],
                node_addresses=addresses)


def test_copies_go_to_another_region_first() -> None:
    regions = {"a1": "east", "a2": "east", "b1": "west", "b2": "west"}
    plan = _plan(regions, [((0, 3), ["a1", "a2"]), ((3, 6), ["b1", "b2"])], {n: f"h:{i}" for i, n in enumerate(regions)})
    assert replica_targets(plan, "a1", (0, 3), 1) == ["b1"]
    assert replica_targets(plan, "a1", (0, 3), 3) == ["b1", "b2", "a2"]
    assert replica_targets(plan, "b2", (3, 6), 2) == ["a1", "a2"]
    assert replica_targets(plan, "a1", (0, 3), 0) == []
    plan.node_addresses["b1"] = ""  # behind NAT: cannot be dialled
    assert replica_targets(plan, "a1", (0, 3), 1) == ["b2"]


def test_a_checkpoint_is_replicated_to_k_peers_and_reported_as_theirs(tmp_path: Path) -> None:
    module, opt = _trained(0, 3)
    servers = {n: _server(n, tmp_path / n) for n in ("a1", "a2", "b1")}
    try:
        path, _ = save_layers(module, opt, tmp_path / "a1", 20, data_position=0)
        plan = _plan({"a1": "east", "a2": "east", "b1": "west"}, [((0, 3), ["a1"]), ((3, 6), ["a2"])],
                     {n: s.address for n, s in servers.items()})
        plan.pipelines[0].stages[1].nodes = ["a2"]
        made = []
        rep = Replicator(node_id="a1", address=servers["a1"].address, job_id="j", token=TOKEN, rpc=servers["a1"].rpc,
                         report=made.append)
        rep.submit(plan, 20, (0, 3), 2)
        rep.close(timedelta(seconds=30))
        assert sorted(m.node_id for m in made) == ["a2", "b1"]
        for m in made:
            assert Path(m.path) == checkpoint_file(tmp_path / m.node_id, 20, (0, 3))
            assert Path(m.path).read_bytes() == path.read_bytes() and m.bytes == path.stat().st_size
        # a copy loads like the original
        other = build_slice(MODEL, 0, 3, seed=9)
        other_opt = build_optimizer(other, StageConfig(micro_batches=1))
        load_layers(other, other_opt, tmp_path / "b1", 20)
        assert all(torch.equal(p, q) for p, q in zip(other.parameters(), module.parameters()))
    finally:
        for s in servers.values():
            s.stop()


def test_a_resume_fetches_missing_checkpoint_files_from_the_nearest_holder(tmp_path: Path) -> None:
    module, opt = _trained(3, 6)
    path, _ = save_layers(module, opt, tmp_path / "far", 30, data_position=0)
    save_layers(module, opt, tmp_path / "near", 30, data_position=0)
    with _server("far", tmp_path / "far") as far, _server("near", tmp_path / "near") as near:
        plan = _plan({"me": "east", "near": "east", "far": "west"}, [((0, 3), ["far"]), ((3, 6), ["me"])],
                     {"me": "h:1", "near": near.address, "far": far.address})
        plan.resume_step = 30
        plan.checkpoint_copies = [CheckpointCopy(node_id="far", layers=(3, 6), address=far.address),
                                  CheckpointCopy(node_id="near", layers=(3, 6), address=near.address)]
        fetched = fetch_checkpoint(plan, tmp_path / "me", (3, 6), node_id="me", token=TOKEN, rpc=far.rpc,
                                   timeout=timedelta(seconds=20))
        assert [f.source for f in fetched] == ["near"]
        assert checkpoint_file(tmp_path / "me", 30, (3, 6)).read_bytes() == path.read_bytes()
        assert fetch_checkpoint(plan, tmp_path / "me", (3, 6), node_id="me", token=TOKEN, rpc=far.rpc,
                                timeout=timedelta(seconds=20)) == []  # held now: nothing fetched
        near.stop()  # the nearest holder is gone: the next one gives it
        fetched = fetch_checkpoint(plan, tmp_path / "me2", (3, 6), node_id="me2", token=TOKEN, rpc=far.rpc,
                                   timeout=timedelta(seconds=5))
        assert [f.source for f in fetched] == ["far"]


# --- the coordinator's index ------------------------------------------------------------------------------


def _rec(step: int, node: str, a: int, b: int, epoch: int = 1) -> CheckpointRecord:
    return CheckpointRecord(step=step, plan_epoch=epoch, node_id=node, layer_start=a, layer_end=b)


def test_the_index_counts_copies_and_resumes_where_alive_nodes_hold_every_layer() -> None:
    plan = _plan({"a": "x", "b": "x", "c": "y"}, [((0, 3), ["a"]), ((3, 6), ["b"])], {})
    plans = {1: plan}
    records = [_rec(10, "a", 0, 3), _rec(10, "b", 3, 6), _rec(10, "c", 0, 3),
               _rec(20, "a", 0, 3), _rec(20, "b", 3, 6), _rec(20, "c", 3, 6)]
    assert complete_steps(records, plans) == [10, 20]
    assert replication(records, 20) == {(0, 3): 1, (3, 6): 2}
    assert resume_step(records, plans, {"a", "b", "c"}) == 20
    # a dies: step 20's layers [0, 3) had no other copy, step 10's had one on c
    assert complete_steps(records, plans, holders={"b", "c"}) == [10]
    assert resume_step(records, plans, {"b", "c"}) == 10
    assert resume_step(records, plans, {"b"}) == 20  # no complete step on alive nodes: a shared folder may hold it
    assert copies_of(records, 10, {"b": "hb", "c": "hc"}) == [
        CheckpointCopy(node_id="b", layers=(3, 6), address="hb"), CheckpointCopy(node_id="c", layers=(0, 3), address="hc")]


def test_nodes_that_left_gracefully_are_named_for_handover() -> None:
    prev = _plan({"a": "x", "b": "x"}, [((0, 3), ["a"]), ((3, 6), ["b"])], {"a": "ha", "b": "hb"})
    members = [MemberRecord(node_id="a", peer_address="ha", profile=NodeProfile(), state="left", last_heartbeat_unix=95.0),
               MemberRecord(node_id="b", peer_address="hb", profile=NodeProfile(), state="gone", last_heartbeat_unix=95.0),
               MemberRecord(node_id="c", peer_address="hc", profile=NodeProfile(), state="left", last_heartbeat_unix=95.0)]
    assert handing_over(prev, members, now=100.0) == {"a": "ha"}
    assert handing_over(prev, members, now=1000.0) == {}
    assert handing_over(None, members, now=100.0) == {}


# --- the resume point ----------------------------------------------------------------------------------------


def _h(node: str, step: int, a: int, b: int, region: str = "") -> Holder:
    return Holder(node_id=node, address=f"{node}:1", step=step, layers=(a, b), region=region)


def test_resume_point_is_the_newest_step_every_layer_has_a_live_copy_at() -> None:
    held = [_h("a", 42, 0, 3), _h("b", 42, 3, 6), _h("c", 42, 3, 6)]
    p = resume_point(held, total_layers=6, checkpoint_step=40)
    assert (p.step, p.live, p.rolled_back) == (42, True, 0)
    # the only holder of [0, 3) is gone: back to the checkpoint, 2 steps lost, and the reason names the layers
    p = resume_point(held[1:], total_layers=6, checkpoint_step=40)
    assert (p.step, p.live, p.rolled_back) == (40, False, 2)
    assert "no live copy of layer(s) 0-2 at step 42" in p.reason
    # a new node's cut differs: any ranges that cover the model do
    assert resume_point([_h("a", 5, 0, 2), _h("b", 5, 1, 6)], total_layers=6, checkpoint_step=0).live
    assert not resume_point([], total_layers=6, checkpoint_step=0).live
    assert not resume_point([_h("a", 3, 0, 6)], total_layers=6, checkpoint_step=10).live


def test_sources_prefer_this_node_then_its_region() -> None:
    point = ResumePoint(step=7, live=True, reason="", holders=(
        _h("a", 7, 0, 3, "x"), _h("b", 7, 0, 3, "y"), _h("c", 7, 3, 6, "y"), _h("d", 7, 2, 6, "x")))
    assert [(h.node_id, r) for h, r in sources(point, (0, 6), "b", "y")] == [("b", (0, 3)), ("c", (3, 6))]
    assert [(h.node_id, r) for h, r in sources(point, (1, 5), "z", "x")] == [("a", (1, 3)), ("d", (3, 5))]
    assert ResumePoint.from_json(point.to_json()) == point


def test_nodes_agree_on_the_first_published_point_and_gather_over_grpc() -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    first = ResumePoint(step=9, live=True, reason="r", holders=(_h("a", 9, 0, 6),))
    assert agree(store, "k", first) == first
    assert agree(store, "k", ResumePoint(step=3, live=False, reason="later")) == first
    module, opt = _trained(0, 3)
    with _server("a") as a, _server("b") as b, _server("gone") as gone:
        a.state.end_run(1, LiveState.of(slice_state(module, opt), step=11, epoch=1))
        gone_address = gone.address
        gone.stop()
        plan = _plan({"a": "x", "b": "x", "me": "x"}, [((0, 3), ["a"]), ((3, 6), ["b", "me"])],
                     {"a": a.address, "b": b.address, "me": "unused"})
        plan.epoch, plan.handover = 2, {"gone": gone_address}
        own = pb.HeldStateReply(holds=True, step=11, layer_start=3, layer_end=6, node_id="me")
        held = gather_held(plan, "me", own, token=TOKEN, rpc=a.rpc, timeout=timedelta(seconds=5))
        assert [(h.node_id, h.step, h.layers, h.address) for h in held] == [
            ("a", 11, (0, 3), a.address), ("me", 11, (3, 6), "unused")]
        plan.node_addresses["me"] = ""  # behind NAT: nobody can fetch from it, so nobody counts its state
        held = gather_held(plan, "me", own, token=TOKEN, rpc=a.rpc, timeout=timedelta(seconds=5))
        assert [h.node_id for h in held] == ["a"]


def test_a_superseded_plan_abandons_its_resume_agreement_at_once() -> None:
    """A plan that names a node which is gone (a restarted coordinator republishes the plan of the nodes that
    died) would keep its resume leader asking it for the whole timeout, and every other node waiting on the
    store for the point: a newer plan ends both at once."""
    import threading
    import time

    import torch.distributed as dist

    from atoll.node.dataparallel import CollectiveCancelled, cancel_collectives_on
    from atoll.node.live_state import await_point

    with _server("gone") as gone:
        gone_address, rpc = gone.address, gone.rpc
        gone.stop()
    plan = _plan({"gone": "x", "me": "x"}, [((0, 6), ["gone", "me"])], {"gone": gone_address, "me": "unused"})
    own = pb.HeldStateReply(holds=False, node_id="me")
    store = dist.HashStore()
    for wait in (lambda: gather_held(plan, "me", own, token=TOKEN, rpc=rpc, timeout=timedelta(seconds=60)),
                 lambda: await_point(store, "resume", timedelta(seconds=60))):
        superseded = threading.Event()
        threading.Timer(0.5, superseded.set).start()
        started = time.monotonic()
        with cancel_collectives_on(superseded), pytest.raises(CollectiveCancelled, match="superseded"):
            wait()
        assert time.monotonic() - started < 5.0


def test_peer_rpcs_refuse_calls_without_a_deadline() -> None:
    with _server("a") as server:
        from atoll.rpc import make_channel
        from atoll.v1 import atoll_pb2_grpc as pb_grpc

        channel = make_channel(server.address, token=TOKEN, streaming_deadline=False)
        try:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.PeerStub(channel).Replicate(pb.ReplicateRequest(step=1, layer_start=0, layer_end=2),
                                                    timeout=1000.0)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.PeerStub(channel).Replicate(pb.ReplicateRequest(step=1, layer_start=0, layer_end=2),
                                                    timeout=10.0)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "writer's node id" in e.value.details()
        finally:
            channel.close()


def test_a_leaving_node_waits_for_its_state_to_be_taken_or_for_nobody_to_want_it() -> None:
    module, opt = _trained(0, 2)
    live = LiveState.of(slice_state(module, opt), step=4, epoch=1)
    holder = StateHolder(node_id="a")
    holder.end_run(1, live)
    holder.held(1, wait=0.0)  # a question from before the leave does not count
    started = time.monotonic()
    out = holder.wait_handed_over(most=timedelta(seconds=5), idle=timedelta(seconds=1),
                                  unasked=timedelta(seconds=0.5))
    assert not out.taken and out.said == "no node asked for the live state within 0s"
    assert time.monotonic() - started < 2.0
    threading.Timer(0.3, lambda: list(holder.chunks(_request("live", 4, (0, 2))))).start()
    assert holder.wait_handed_over(most=timedelta(seconds=5), idle=timedelta(seconds=1)).said == \
        "the live state was handed over (1 fetch)"
    # a ZeRO stage's gathered state goes to each of the next plan's replicas: the node serves until nobody
    # fetched for `idle`, not only until the first fetch
    fetch = lambda: list(holder.chunks(_request("live", 4, (0, 2))))  # noqa: E731
    threading.Timer(0.3, fetch).start()
    threading.Timer(1.0, fetch).start()
    started = time.monotonic()
    assert holder.wait_handed_over(most=timedelta(seconds=5), idle=timedelta(seconds=1)).said == \
        "the live state was handed over (2 fetches)"
    assert 2.0 <= time.monotonic() - started < 3.5
    threading.Timer(0.3, lambda: holder.held(2, wait=0.0)).start()  # asked, then fetched from a replica instead
    out = holder.wait_handed_over(most=timedelta(seconds=5), idle=timedelta(seconds=1))
    assert out.taken and out.said == "the new plan's nodes took the state from another holder"
    holder.forget_live()
    out = holder.wait_handed_over(most=timedelta(seconds=5), idle=timedelta(seconds=1))
    assert not out.taken and out.said == "no live state to hand over"


def test_a_checkpoint_pruned_between_the_check_and_the_read_is_not_found(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`prune_checkpoints` runs beside the Peer server: a file gone after `is_file` answers KeyError (NOT_FOUND),
    not a FileNotFoundError the server would turn into UNKNOWN."""
    path = checkpoint_file(tmp_path, 6, (0, 2))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"state")
    holder = StateHolder(node_id="a", checkpoint_dir=tmp_path)
    assert b"".join(c.data for c in holder.chunks(_request("checkpoint", 6, (0, 2)))) == b"state"
    real = state_transfer._file_chunks

    def pruned(p: Path, request):
        p.unlink()  # the prune lands between the check and the read
        return real(p, request)

    monkeypatch.setattr(state_transfer, "_file_chunks", pruned)
    with pytest.raises(KeyError, match="pruned"):
        holder.chunks(_request("checkpoint", 6, (0, 2)))
