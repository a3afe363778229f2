"""Outer mode: replica groups as threads with real gRPC peers (Peer.FetchOuter) and gloo groups, the round
decisions made by the coordinator's own `OuterRounds`, against synchronous data parallel in one process."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
import torch
from pipeline_harness import outer_arbiter, run_outer_plan, run_pinned_plan, stage, tiny_job

from atoll.job import JobSpec
from atoll.node.data import Batch, TokenDataset
from atoll.node.model import build_slice
from atoll.node.outer import group_holders, responsible
from atoll.node.runner import learning_rate, stage_config
from atoll.node.stage import PipelineStage
from atoll.node.inprocess import InProcessLinks
from atoll import plan as plan_mod
from atoll.plan import OuterPlan, PipelinePlan, Plan, ReplicaGroup
from atoll.v1 import atoll_pb2 as pb


class _RpcError(grpc.RpcError):
    """What a gRPC call raises: a status code and its details."""

    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _sync_data_parallel(job: JobSpec, groups: int) -> list[float]:
    """Synchronous data parallel over `groups` replicas, each on its own shard (the outer mode's data):
    one process, the replicas' batches concatenated, so the gradient is the replicas' average."""
    t = job.train
    module = build_slice(job.model, 0, job.model.n_layers + 2, seed=t.seed)
    cfg = stage_config(job, groups * t.global_batch // t.micro_batch, timedelta(seconds=60))
    stage = PipelineStage(module, stage=0, num_stages=1, transport=InProcessLinks(1).transport(0), config=cfg)
    data = TokenDataset.from_source(job.data.source, t.seq_len, seed=t.seed)
    out = []
    for step in range(t.steps):
        for g in stage.optimizer.param_groups:
            g["lr"] = learning_rate(job, step)
        parts = [data.rows(step * groups + g, t.global_batch, 0, t.global_batch) for g in range(groups)]
        batch = Batch(torch.cat([p.inputs for p in parts]), torch.cat([p.targets for p in parts]))
        out.append(float(stage.train_step(step, batch).loss))
    return out


@pytest.mark.timeout(150)
def test_outer_mode_with_h1_plain_averaging_tracks_synchronous_data_parallel(tmp_path: Path) -> None:
    """H = 1, outer lr 1, no momentum, identity codec, no overlap: the groups average their parameters after
    every step. Each group keeps its own AdamW moments, so this is not bit-equal to synchronous data parallel
    (one AdamW step on the averaged gradient); the losses stay within 2% over 8 steps."""
    steps = 8
    job = tiny_job(steps)
    outer = OuterPlan(inner_steps=1, codec="identity", lr=1.0, momentum=0.0, overlap=False, deadline_s=30.0)
    whole = [PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[stage((0, 6), ["a"])])]
    other = [PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[stage((0, 6), ["b"])])]
    run = run_outer_plan(job, [whole, other], outer, tmp_path)
    losses, params, rounds = run.losses, run.params, run.rounds
    expected = _sync_data_parallel(job, groups=2)
    for s in range(steps):
        got = (losses[(0, s)] + losses[(1, s)]) / 2
        assert abs(got - expected[s]) <= 0.02 * expected[s], (s, got, expected[s])
    # both groups end on the same outer parameters
    for name, t in params["a"].items():
        assert torch.allclose(t, params["b"][name], atol=1e-6), name
    assert rounds.latest_decided == steps - 1
    assert all(p.rounds_in == steps for p in rounds.progress.values())


@pytest.mark.timeout(150)
def test_groups_cut_differently_sync_compressed_and_overlapped(tmp_path: Path) -> None:
    """Two groups whose pipelines cut the model differently (and one stage with two replicas): each
    parameter is exchanged by one responsible node per group, int8 pseudo-gradients, one round of delay;
    every holder ends on the same parameters, and the loss falls."""
    steps = 12
    job = tiny_job(steps)
    job = replace(job, outer=replace(job.outer, apply_after=2))  # applied two steps into the next round
    outer = OuterPlan(inner_steps=3, codec="int8", lr=0.8, momentum=0.5, overlap=True, deadline_s=30.0)
    g0 = [PipelinePlan(micro_batch=8, num_micro_batches=2, stages=[stage((0, 3), ["a", "c"]), stage((3, 6), ["b", "d"])])]
    g1 = [PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[stage((0, 2), ["e"]), stage((2, 6), ["f"])])]
    run = run_outer_plan(job, [g0, g1], outer, tmp_path)
    plan, losses, params, rounds = run.plan, run.losses, run.params, run.rounds
    # the work is spread: both replicas of a stage exchange a share of its parameters
    holders = group_holders(plan, 0)
    owners = {responsible(n, holders) for n in params["a"]}
    assert owners == {"a", "c"}
    # replicas within a group agree, and the groups agree on every layer they both hold after the last round
    for n in params["a"]:
        assert torch.equal(params["a"][n], params["c"][n]), n
        other = params["e"] if n in params["e"] else params["f"]
        assert torch.allclose(params["a"][n], other[n], atol=1e-5), n
    assert losses[(0, steps - 1)] < losses[(0, 0)] and losses[(1, steps - 1)] < losses[(1, 0)]
    assert rounds.latest_decided == steps // 3 - 1


def test_round_decision_waits_for_every_group_then_the_deadline() -> None:
    from atoll.coordinator.outer import GroupInfo, RoundArrivals, round_decision

    groups = [GroupInfo(index=0, name="lab-a", nodes=frozenset({"a1", "a2"}), since_epoch=1),
              GroupInfo(index=1, name="lab-b", nodes=frozenset({"b1"}), since_epoch=1),
              GroupInfo(index=2, name="lab-c", nodes=frozenset({"c1"}), since_epoch=5)]
    arr = RoundArrivals(epoch=4)
    assert not round_decision(0.0, arr, groups, 10.0).decided
    arr.nodes["a1"] = (0, 100)
    assert not round_decision(0.0, arr, groups, 10.0).decided  # a group arrives when all its nodes have
    arr.nodes["a2"] = (0, 100)
    arr.completed[0] = 1.0
    d = round_decision(2.0, arr, groups, 10.0)
    assert not d.decided and "lab-b" in d.reason and "lab-c" not in d.reason  # lab-c formed after the round began
    arr.nodes["b1"] = (7, 60)  # an index from an older plan: the node counts by identity
    d = round_decision(3.0, arr, groups, 10.0)
    assert d.decided and [(p.group, p.tokens) for p in d.participants] == [(0, 100), (1, 60)]
    late = RoundArrivals(epoch=4, nodes={"a1": (0, 1), "a2": (0, 1)}, completed={0: 1.0})
    d = round_decision(11.5, late, groups, 10.0)
    assert d.decided and [p.group for p in d.participants] == [0] and "lab-b" in d.reason


def test_a_rejoining_group_fetches_again_the_parts_of_an_older_round(monkeypatch) -> None:
    """The running group's nodes apply each round a step or so apart: a part of round 7 beside one of round 8
    is fetched again until both are of round 8, not failed at once (which cost whole replans in a row)."""
    from types import SimpleNamespace

    from atoll.compression import CodecSpec
    from atoll.node import outer as outer_mod

    params = {"layers.0.w": torch.zeros(2), "layers.1.w": torch.zeros(2)}
    sync = outer_mod.OuterSync.__new__(outer_mod.OuterSync)
    sync._channels, sync._holder_pool = None, ThreadPoolExecutor(2)  # (what __init__ makes)
    sync.params = params
    sync.holders = {0: {0: ["a"], 1: ["b"]}}
    sync.plan = SimpleNamespace(node_addresses={"a": "a:1", "b": "b:1"})
    sync.cfg = outer_mod.OuterConfig(job_id="j", node_id="c", group=1, inner_steps=2, codec=CodecSpec("identity"),
                                     deadline=timedelta(seconds=5))
    rounds = {"a": [7, 8], "b": [8]}  # a lags one round on the first fetch
    calls: list[str] = []

    def fetch(address, request, *, node, **kw):
        calls.append(node)
        r = rounds[node].pop(0) if len(rounds[node]) > 1 else rounds[node][0]
        return {n: torch.full((2,), float(r)) for n in request.names}, r, 0

    loaded = {}
    monkeypatch.setattr(outer_mod, "fetch_outer", fetch)
    monkeypatch.setattr(sync, "load_state_dict", lambda state, params_too: loaded.update(state), raising=False)
    monkeypatch.setattr(outer_mod, "layer_of", lambda name: int(name.split(".")[1]))
    assert sync.fetch_state([0], {0: 3}) == 8
    assert sorted(calls) == ["a", "a", "b"]  # only the lagging part is fetched again
    assert loaded["round"] == 8 and all(float(t[0]) == 8.0 for t in loaded["anchor"].values())
    # a group whose nodes never agree within the retries is given up, saying which rounds it saw
    rounds.update(a=[1, 3, 5, 7, 9, 11, 13, 15, 17, 19], b=[2, 4, 6, 8, 10, 12, 14, 16, 18, 20])
    monkeypatch.setattr(outer_mod, "STATE_ROUND_RETRIES", 3)
    monkeypatch.setattr(outer_mod.time, "sleep", lambda s: None)
    with pytest.raises(outer_mod.OuterSyncError, match="no live group gave its outer state: .*rounds"):
        sync.fetch_state([0], {0: 3})


def test_a_rejoining_group_takes_the_outer_momentum_with_the_anchor(monkeypatch) -> None:
    """Every group applies the same outer update to the same anchor; a group that joins live ones takes their
    momentum with the anchor, or its first Nesterov step would move its anchor away from theirs for good. A holder
    without momentum yet (no round exchanged) serves the anchor alone."""
    from types import SimpleNamespace

    from atoll.compression import CodecSpec
    from atoll.node import outer as outer_mod

    outbox = outer_mod.OuterOutbox(job_id="j", epoch=3, node_id="a")
    outbox.put_state(8, {"anchor/layers.0.w": torch.ones(2), "momentum/layers.0.w": torch.full((2,), 0.5)})
    served = outbox.frames(pb.OuterFetchRequest(job_id="j", plan_epoch=3, kind="state",
                                                names=["anchor/layers.0.w", "momentum/layers.0.w",
                                                       "momentum/layers.9.w"]), wait=0.0)
    assert len(list(served)) >= 2  # the anchor and the momentum it holds; none for a parameter without
    with pytest.raises(KeyError):
        outbox.frames(pb.OuterFetchRequest(job_id="j", plan_epoch=3, kind="state", names=["anchor/layers.9.w"]),
                      wait=0.0)

    sync = outer_mod.OuterSync.__new__(outer_mod.OuterSync)

    sync._channels, sync._holder_pool = None, ThreadPoolExecutor(2)  # (what __init__ makes)
    sync.params = {"layers.0.w": torch.zeros(2), "layers.1.w": torch.zeros(2)}
    sync.holders = {0: {0: ["a"], 1: ["b"]}}
    sync.plan = SimpleNamespace(node_addresses={"a": "a:1", "b": "b:1"})
    sync.cfg = outer_mod.OuterConfig(job_id="j", node_id="c", group=1, inner_steps=2, codec=CodecSpec("identity"),
                                     deadline=timedelta(seconds=5), momentum=0.9, nesterov=True)
    asked: list[str] = []

    def fetch(address, request, *, node, **kw):
        asked.extend(request.names)
        held = {"a": {"anchor/layers.0.w": 1.0, "momentum/layers.0.w": 0.5}, "b": {"anchor/layers.1.w": 2.0}}[node]
        return {n: torch.full((2,), v) for n, v in held.items() if n in request.names}, 8, 0

    loaded = {}
    monkeypatch.setattr(outer_mod, "fetch_outer", fetch)
    monkeypatch.setattr(sync, "load_state_dict", lambda state, params_too: loaded.update(state), raising=False)
    monkeypatch.setattr(outer_mod, "layer_of", lambda name: int(name.split(".")[1]))
    assert sync.fetch_state([0], {0: 3}) == 8
    assert sorted(asked) == ["anchor/layers.0.w", "anchor/layers.1.w", "momentum/layers.0.w", "momentum/layers.1.w"]
    assert sorted(loaded["anchor"]) == ["layers.0.w", "layers.1.w"]
    assert list(loaded["momentum"]) == ["layers.0.w"] and float(loaded["momentum"]["layers.0.w"][0]) == 0.5


def test_a_stopped_run_gives_up_an_exchange_at_once(monkeypatch) -> None:
    """A run that a newer plan ends (its group is not kept) stops waiting for an outer exchange stuck on a peer
    that is gone: the wait and the fetch's retries end within a moment, not after their minutes-long deadline."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from atoll.compression import CodecSpec
    from atoll.node import outer as outer_mod

    sync = outer_mod.OuterSync.__new__(outer_mod.OuterSync)

    sync._channels, sync._holder_pool = None, ThreadPoolExecutor(2)  # (what __init__ makes)
    sync.plan = SimpleNamespace(node_addresses={"b1": "b1:1"})
    sync.plan_source = None
    sync.timeout = timedelta(seconds=120)
    sync.mine = ["layers.0.w"]
    sync.cfg = outer_mod.OuterConfig(job_id="j", node_id="a0", group=0, inner_steps=2, codec=CodecSpec("identity"),
                                     deadline=timedelta(seconds=30))
    sync.stop = threading.Event()
    sync._unreachable = {}
    part = outer_mod.Participant(group=1, tokens=8, since_epoch=1, nodes=("b1",))
    monkeypatch.setattr(sync, "_sources", lambda p, names=None: [("group 1", {"b1": ["layers.0.w"]}, {"b1": "b1:1"}, 1, "")],
                        raising=False)

    tries = []

    def fetch(*a, **kw):
        tries.append(1)
        if len(tries) == 3:
            sync.stop.set()
        raise _RpcError(grpc.StatusCode.UNAVAILABLE, "connection refused")

    monkeypatch.setattr(outer_mod, "fetch_outer", fetch)
    monkeypatch.setattr(outer_mod.time, "sleep", lambda s: None)
    with pytest.raises(outer_mod.OuterSyncError, match="stopped"):
        sync._fetch_contribution(part, 3)
    assert len(tries) == 3

    # the runner's wait for the pending exchange: without a stop it waits its bound, with one it ends at once
    pending: Future = Future()
    sync.stop.clear()
    with pytest.raises(outer_mod.FutureTimeout):
        sync._wait_pending(pending, 0.3)
    threading.Timer(0.2, sync.stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(outer_mod.OuterSyncError, match="stopped"):
        sync._wait_pending(pending, 120.0)
    assert time.monotonic() - t0 < 5.0
    pending.set_result("done")
    assert sync._wait_pending(pending, 1.0) == "done"


def test_a_contribution_is_fetched_from_any_holder_and_reported_out_of_reach_past_the_bound(monkeypatch) -> None:
    """A participant's node killed while it streams its round ends the stream with INTERNAL, CANCELLED or a truncated
    tensor: the fetch tries every node holding the contribution (the participant's own, then another group's that
    fetched it and serves it on) until one answers. Past the bound, or at once when the participant's group is in no
    plan any more and no relay has it, it is OutOfReach, for the coordinator to decide the round again: no node
    leaves a contribution out on its own (before, each node did, and the groups' anchors parted for good)."""
    from types import SimpleNamespace

    from atoll.compression import CodecError, CodecSpec
    from atoll.node import outer as outer_mod

    sync = outer_mod.OuterSync.__new__(outer_mod.OuterSync)

    sync._channels, sync._holder_pool = None, ThreadPoolExecutor(2)  # (what __init__ makes)
    newest = [SimpleNamespace(epoch=1)]
    sync.plan_source = lambda: newest[0]
    sync.timeout = timedelta(seconds=120)
    sync.mine = ["layers.0.w"]
    sync.cfg = outer_mod.OuterConfig(job_id="j", node_id="a0", group=0, inner_steps=2, codec=CodecSpec("identity"),
                                     deadline=timedelta(seconds=30))
    sync.stop = threading.Event()
    sync._unreachable = {}
    part = outer_mod.Participant(group=1, tokens=8, since_epoch=1, nodes=("b0", "b1"))
    sources = [("group 1", {"b1": ["layers.0.w"]}, {"b1": "b1:1"}, 1, ""),
               ("group 2 (a relay)", {"c0": ["layers.0.w"]}, {"c0": "c0:1"}, 1, outer_mod.origin_key(part))]
    monkeypatch.setattr(sync, "_sources", lambda p, names=None: sources, raising=False)
    in_plan = {1: True}
    monkeypatch.setattr(outer_mod, "_group_in", lambda plan, p: 1 if in_plan.get(plan.epoch) else None)

    def Broken(code: grpc.StatusCode) -> _RpcError:  # noqa: N802 - read as the error it makes
        return _RpcError(code, "RST_STREAM with error code 2")

    asked: list[tuple[str, str]] = []
    answers = [Broken(grpc.StatusCode.INTERNAL), Broken(grpc.StatusCode.UNAVAILABLE),  # b1, then the relay c0
               CodecError("stream ended inside tensor 'w': truncated"), None]  # b1 again, then c0 has it

    def fetch(address, request, *, node, **kw):
        asked.append((node, request.origin))
        a = answers.pop(0)
        if a is not None:
            raise a
        return {n: torch.ones(2) for n in request.names}, 3, 8

    monkeypatch.setattr(outer_mod, "fetch_outer", fetch)
    monkeypatch.setattr(outer_mod.time, "sleep", lambda s: None)
    tensors, nbytes = sync._fetch_contribution(part, 3)
    assert list(tensors) == ["layers.0.w"] and nbytes == 8
    assert asked == [("b1", ""), ("c0", "1/b0"), ("b1", ""), ("c0", "1/b0")]

    # nobody answers: out of reach once the bound passed
    clock = [0.0]
    monkeypatch.setattr(outer_mod.time, "monotonic", lambda: clock[0])

    def refused(*a, **kw):
        clock[0] += 4.0
        raise Broken(grpc.StatusCode.UNAVAILABLE)

    monkeypatch.setattr(outer_mod, "fetch_outer", refused)
    with pytest.raises(outer_mod.OutOfReach, match="within 30s"):
        sync._fetch_contribution(part, 3)
    assert clock[0] <= 30.0 + 8.0
    # a participant replanned away is out of reach after one pass over the holders, not after the bound
    newest[0] = SimpleNamespace(epoch=2)
    clock[0] = 0.0
    with pytest.raises(outer_mod.OutOfReach, match="in no plan any more"):
        sync._fetch_contribution(part, 3)
    assert clock[0] == 8.0


def test_an_arrival_the_coordinator_asks_to_repeat_under_the_next_plan_is_retried(monkeypatch) -> None:
    """FAILED_PRECONDITION ("wait for the next plan") from OuterSync is a retry under the newest adopted plan, not
    the end of the node's run; a refusal for good (INVALID_ARGUMENT) still ends it."""
    from types import SimpleNamespace

    from atoll.node.outer import RoundReport, RoundStats
    from atoll.node.runner import _arrive_via

    def Refused(code: grpc.StatusCode) -> _RpcError:  # noqa: N802 - read as the error it makes
        return _RpcError(code, "node n is not in group 1 (lab-b) of plan epoch 2; wait for the next plan")

    plans = [SimpleNamespace(job_id="j", epoch=1), SimpleNamespace(job_id="j", epoch=2)]
    seen = []

    def call(req):
        seen.append((req.plan_epoch, req.group))
        assert req.arrived  # every question repeats the arrival (a restarted coordinator hears it again)
        if req.plan_epoch == 1:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION)
        return pb.OuterSyncReply(decided=True, version=2, final=True, participants=[
            pb.OuterParticipant(group=0, tokens=5, since_epoch=1, node_ids=["n"])],
            checkpointer=pb.OuterParticipant(group=0, since_epoch=1, node_ids=["n"]))

    current = [plans[0]]
    import atoll.node.runner as runner_mod

    index = {1: 1, 2: 0}  # the node's group moved from index 1 to 0 in epoch 2
    monkeypatch.setattr(runner_mod, "group_index", lambda plan, node: index[plan.epoch])
    arrive = _arrive_via(call, lambda: current[0], "n")
    report = RoundReport(round=3, tokens=5, previous=RoundStats())
    assert arrive(report) is None  # asked to wait for the next plan: retried later
    current[0] = plans[1]  # adopted
    decision = arrive(report)
    assert decision is not None and decision.participants[0].nodes == ("n",)
    assert decision.version == 2 and decision.final and decision.checkpointer.nodes == ("n",)
    assert seen == [(1, 1), (2, 0)]
    bad = _arrive_via(lambda req: (_ for _ in ()).throw(Refused(grpc.StatusCode.INVALID_ARGUMENT)),
                      lambda: current[0], "n")
    with pytest.raises(grpc.RpcError):
        bad(report)


def test_a_group_that_goes_on_with_its_round_keeps_its_share_of_it() -> None:
    """A group planned afresh with other inner steps a round stands at the same share of its round, never at its
    start or end (the round still ends, and the steps it trained count)."""
    from atoll.node.runner import continuing_steps

    assert continuing_steps(11, 40, 40) == 11
    assert continuing_steps(11, 40, 27) == 7  # 11/40 of 27
    assert continuing_steps(1, 40, 10) == 1  # never back at the round's start
    assert continuing_steps(39, 40, 10) == 9  # never at its end
    assert continuing_steps(5, 10, 100) == 50


def _cut(monkeypatch, *, server: str, fetcher: str, rounds: set[int], relays_too: bool = False) -> list[int]:
    """The seam of a cut link: `server`'s peer server refuses `fetcher`'s FetchOuter of `rounds` as an unreachable
    peer would look (UNAVAILABLE), its own payloads only (a relay's too with `relays_too`); the rounds refused."""
    from atoll.node import outer as outer_mod

    frames = outer_mod.OuterOutbox.frames
    refused: list[int] = []

    def cut(self, request, wait):
        if (self.node_id == server and request.sender == fetcher and request.kind == "delta"
                and request.round in rounds and (relays_too or not request.origin)):
            refused.append(request.round)
            raise LookupError(f"(the test's cut link from {fetcher} to {server})")
        return frames(self, request, wait)

    monkeypatch.setattr(outer_mod.OuterOutbox, "frames", cut)
    return refused


def _same_anchors(plan_run_outer: dict, nodes: list[str]) -> None:
    first = plan_run_outer[nodes[0]]
    for n in nodes[1:]:
        for name, t in first.items():
            assert torch.equal(t, plan_run_outer[n][name]), (n, name, float((t - plan_run_outer[n][name]).abs().max()))


@pytest.mark.timeout(150)
def test_a_contribution_out_of_one_nodes_reach_is_decided_again_for_every_node(tmp_path: Path, monkeypatch) -> None:
    """Node a cannot fetch group b's contribution to round 1 (b's peer server refuses it, as a cut link would) for
    longer than its bound: a reports it, the coordinator decides round 1 again without b, and every node, b too
    (which holds its own contribution), applies that decision: both end on the same anchor, bit for bit, and the
    anchor hashes agreed at every round. Before, a failed its run (or, with b's group replanned, left b out alone
    while b kept its own contribution in: anchors apart for good)."""
    refused = _cut(monkeypatch, server="b", fetcher="a", rounds={1})
    monkeypatch.setattr(plan_mod, "FETCH_BOUND_MIN_S", 1.0)  # the bound is the deadline, 1.5 s: a fast test
    job = tiny_job(6)
    outer = OuterPlan(inner_steps=2, codec="int8", lr=0.7, momentum=0.5, overlap=False, deadline_s=1.5)
    run = run_outer_plan(job, [[PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
        stage((0, 6), ["a"])])], [PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[stage((0, 6), ["b"])])]],
        outer, tmp_path)
    losses, rounds = run.losses, run.rounds
    assert refused and set(refused) == {1}
    anchors = {n: r.outer.anchor for n, r in run.runners.items()}
    _same_anchors(anchors, ["a", "b"])
    assert (rounds.progress["region-1"].rounds_in, rounds.progress["region-1"].rounds_missed) == (2, 1)  # b left out of round 1 only
    assert rounds.latest_decided == 2 and rounds.anchor_mismatches == 0, rounds.last_mismatch
    assert len(losses) == 12


@pytest.mark.timeout(150)
def test_a_contribution_is_fetched_through_another_group_when_its_own_is_out_of_reach(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """Three groups; node a cannot reach group b for rounds 0-1, but group c fetched b's contribution and serves it
    on: a takes it from c, no round is decided again, and all three end on the same anchor."""
    refused = _cut(monkeypatch, server="b", fetcher="a", rounds={0, 1})
    job = tiny_job(4)
    outer = OuterPlan(inner_steps=2, codec="int8", lr=0.7, momentum=0.5, overlap=True, deadline_s=20.0)
    run = run_outer_plan(job, [[PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
        stage((0, 6), [n])])] for n in ("a", "b", "c")], outer, tmp_path)
    rounds = run.rounds
    assert set(refused) == {0, 1}
    anchors = {n: r.outer.anchor for n, r in run.runners.items()}
    _same_anchors(anchors, ["a", "b", "c"])
    assert all((p.rounds_in, p.rounds_missed) == (2, 0) for p in rounds.progress.values()), rounds.progress
    assert rounds.anchor_mismatches == 0


def _writer_plan(job: JobSpec, *, overlap: bool) -> Plan:
    """Two one-node replica groups, lab-a (node a) and lab-b (node b), H=2: the checkpoint-writer tests' plan."""
    outer = OuterPlan(inner_steps=2, codec="identity", lr=1.0, momentum=0.0, overlap=overlap, deadline_s=30.0)
    return Plan(model="tiny", global_batch=job.train.global_batch, seq_len=job.train.seq_len, epoch=1, job_id="job",
                mode="outer", outer=outer, pipelines=[
                    PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[stage((0, 6), [n])]) for n in ("a", "b")],
                groups=[ReplicaGroup(name=f"lab-{n}", pipelines=[i], inner_steps=2, since_epoch=1)
                        for i, n in enumerate("ab")])


def _writers(job: JobSpec, plan: Plan, root: Path, outer_sync) -> list[tuple[str, int]]:
    """Run `plan` under `outer_sync`: the (node, step) of every checkpoint written."""
    written: list[tuple[str, int]] = []
    run_pinned_plan(job, plan, root, join=150, outer_sync=outer_sync,
                    # (a writer asks for copies of what it wrote: the seam that says which node wrote)
                    node_context=lambda n: {"replicate": lambda plan, step, layers, n=n: written.append((n, step))})
    return written


def _one_checkpoint_each(root: Path, steps) -> None:
    for step in steps:
        assert sorted(f.name for f in (root / f"step-{step:08d}").iterdir()) == [
            "layers-0000-0006.pt", "outer-0000-0006.pt"], step


@pytest.mark.timeout(150)
def test_the_checkpoint_writer_is_the_group_the_coordinators_plan_lists_first(tmp_path: Path) -> None:
    """The coordinator's newest plan lists lab-b first (a replan that kept both groups running reordered them, as a
    kept group is listed first); the nodes run on their older plan, which lists lab-a first. Every round's decision
    names lab-b as the writer, so b writes every checkpoint and a none. Before, each node took the writer from its
    own run plan (a), and after a replan that kept the groups running the writer could be no group at all."""
    job = tiny_job(6, interval=2)
    plan = _writer_plan(job, overlap=False)
    newest = replace(plan, epoch=2, groups=list(reversed(plan.groups)))
    call, _ = outer_arbiter(newest)
    written = _writers(job, plan, tmp_path / "ckpt", call)
    assert sorted(written) == [("b", 2), ("b", 4), ("b", 6)], written


@pytest.mark.timeout(150)
def test_each_rounds_checkpoint_is_written_by_a_group_alive_after_it(tmp_path: Path) -> None:
    """Round 0's decision names lab-a the writer, rounds 1 and 2 name lab-b (as when lab-a's region is killed after it
    arrived at round 0: it takes no part from round 1). The checkpoint of round r's end is written by the group the
    decision of round r + 1 names, one alive after that end: both groups keep their round-end checkpoints aside
    until it lands (with the overlapped exchange, a round or two later), and b writes steps 2, 4 and 6, each once;
    the step folders hold nothing else and nothing is left aside. Before, each node wrote by the newest decision it
    held at the round's end (round 0's at step 4), and a writer killed after it arrived at a round lost the round's
    checkpoint (bench.regions (c): step 360 missing)."""
    job = tiny_job(6, interval=2)
    plan = _writer_plan(job, overlap=True)
    call, _ = outer_arbiter(plan)

    def names_b_from_round_1(req: pb.OuterSyncRequest) -> pb.OuterSyncReply:
        reply = call(req)
        if reply.decided and req.round >= 1:
            reply.checkpointer.CopyFrom(pb.OuterParticipant(group=1, since_epoch=1, node_ids=["b"]))
        return reply

    root = tmp_path / "ckpt"
    written = _writers(job, plan, root, names_b_from_round_1)
    assert sorted(written) == [("b", 2), ("b", 4), ("b", 6)], written
    _one_checkpoint_each(root, (2, 4, 6))
    assert not any((root / ".aside").rglob("*.pt"))  # nothing left aside


@pytest.mark.timeout(150)
def test_a_round_its_writer_took_no_part_after_still_has_its_checkpoint(tmp_path: Path) -> None:
    """Decision 1 names lab-b the writer (of round 0's checkpoint), and round 2 is decided without lab-b, naming
    lab-a (as when b's region died after it arrived at round 1). Round 1's checkpoint (step 4) and the last (step
    6) are a's; step 2 is written once, by b (it landed decision 1 before round 2) or by a standing in for it where
    b had not written it; every step folder holds one checkpoint and nothing is left aside."""
    job = tiny_job(6, interval=2)
    plan = _writer_plan(job, overlap=True)
    call, _ = outer_arbiter(plan)

    def b_gone_from_round_2(req: pb.OuterSyncRequest) -> pb.OuterSyncReply:
        reply = call(req)
        if reply.decided and req.round == 1:
            reply.checkpointer.CopyFrom(pb.OuterParticipant(group=1, since_epoch=1, node_ids=["b"]))
        if reply.decided and req.round >= 2:
            kept = [p for p in reply.participants if list(p.node_ids) != ["b"]]
            del reply.participants[:]
            reply.participants.extend(kept)
            reply.checkpointer.CopyFrom(pb.OuterParticipant(group=0, since_epoch=1, node_ids=["a"]))
        return reply

    root = tmp_path / "ckpt"
    written = _writers(job, plan, root, b_gone_from_round_2)
    assert sorted(s for n, s in written if n == "a" and s > 2) == [4, 6], written
    assert not any(n == "b" and s > 2 for n, s in written), written
    assert len([s for _, s in written if s == 2]) == 1, written
    _one_checkpoint_each(root, (2, 4, 6))
    assert not any((root / ".aside").rglob("*.pt"))


@pytest.mark.timeout(300)
def test_a_group_slower_than_planned_trains_fewer_steps_a_round_and_the_fast_group_stops_waiting(
        tmp_path: Path, monkeypatch) -> None:
    """The plan gives both groups H=24 inner steps a round (their profiles said they were alike), but group b (a
    two-stage pipeline) is about 3x slower: its node b1 sleeps 0.3 s in every step (a seam in
    `PipelineStage.train_step`), a 0.06 s (small batches, so that the sleeps and not a loaded machine's compute set
    the pace: at 0.16 s, compute slowed 4x by the suite's other worker brought b within 1.3x of a). For rounds 0-1
    (the plan's figure) a waits out most of each round for b; the decision of round 0 gives b the steps that fit a
    round at its measured pace from round 2 on, both of b's nodes switch at the same step (or their pipeline would
    hang), and a's wait drops below 10% of its round. Every node ends on the same anchor, and both groups end at step
    rounds x H - 1. Before, b trained 24 steps every round and a waited about half of each."""
    h, n_rounds = 24, 7
    sleeps = {"node-a": 0.06, "node-b1": 0.3}
    train_step = PipelineStage.train_step

    def slowed(self, step, batch):
        time.sleep(sleeps.get(threading.current_thread().name, 0.0))
        return train_step(self, step, batch)

    monkeypatch.setattr(PipelineStage, "train_step", slowed)
    job = tiny_job(h * n_rounds, global_batch=4, seq_len=16)
    outer = OuterPlan(inner_steps=h, codec="int8", lr=0.7, momentum=0.5, overlap=True, deadline_s=60.0)
    arrived: dict[tuple[str, int], float] = {}
    run = run_outer_plan(job, [
        [PipelinePlan(micro_batch=4, num_micro_batches=1, stages=[stage((0, 6), ["a"])])],
        [PipelinePlan(micro_batch=4, num_micro_batches=1, stages=[stage((0, 3), ["b0"]), stage((3, 6), ["b1"])])]],
        outer, tmp_path, paced=True, arrived=arrived)
    losses, rounds = run.losses, run.rounds
    a, b = rounds.progress["region-0"], rounds.progress["region-1"]
    tokens_per_step = job.train.global_batch * job.train.seq_len
    b_steps = {r: t // tokens_per_step for r, t in sorted(b.round_tokens.items())}
    assert [b_steps[r] for r in (0, 1)] == [h, h]  # the plan's figure until a decision names one
    fit = h * a.step_s / b.step_s  # b's steps in a round of H of a's, at the pace the newest decision took
    assert all(b_steps[r] <= h * 0.75 for r in range(2, n_rounds)), (b_steps, a.step_s, b.step_s)
    # (steps over the fit are kept while within the figures' noise, `pace.NOISE_SIGMAS` standard errors: a few
    # percent once both groups have rounds of figures, more on a loaded machine)
    assert 0.9 * fit - 1 <= b.assigned_steps <= 1.12 * fit + 0.1, (b.assigned_steps, fit, a.step_s, b.step_s)
    assert all(t // tokens_per_step == h for t in a.round_tokens.values())
    # a's wait per round (for b's exchange of the round before) against its round's wall time
    round_s = {r: arrived[("a", r)] - arrived[("a", r - 1)] for r in range(1, n_rounds)}
    waits = dict(a.round_waits)
    before = waits[2] / round_s[2]
    after = sum(waits[r] for r in range(4, n_rounds)) / sum(round_s[r] for r in range(4, n_rounds))
    print(f"\nb's steps a round {b_steps}; step times a {a.step_s:.3f} s, b {b.step_s:.3f} s; a waited "
          f"{before:.0%} of round 2, {after:.0%} of rounds 4-{n_rounds - 1}")
    assert before > 0.15, (waits, round_s)  # the slow group did pace the rounds before (measured 37-58%)
    assert after < 0.1, (waits, round_s)  # (measured 0%)
    anchors = {n: r.outer.anchor for n, r in run.runners.items()}
    _same_anchors(anchors, ["b0", "a"])
    _same_anchors(anchors, ["b1", "a"])
    assert rounds.anchor_mismatches == 0 and rounds.latest_decided == n_rounds - 1
    last = {g: max(s for gg, s in losses if gg == g) for g in (0, 1)}
    assert last == {0: h * n_rounds - 1, 1: h * n_rounds - 1}, last
