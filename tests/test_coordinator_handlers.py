"""The coordinator's plain handlers and state with an injected clock, no gRPC involved."""

from __future__ import annotations

from pathlib import Path

import pytest

from atoll.coordinator import handlers as h
from atoll.coordinator.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unauthenticated
from atoll.coordinator.state import CoordinatorState
from atoll.coordinator.store import MemoryStore, StoreError
from atoll.job import JobSpec
from atoll.v1 import atoll_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret"


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def profile(host: str = "h1", name: str = "cpu-x", **kw) -> pb.NodeProfile:
    base = dict(hostname=host, device_kind="cpu", device_name=name, device_count=1, memory_total_bytes=16 << 30,
                memory_free_bytes=8 << 30, cpu_count=4,
                layer_timings=[pb.LayerTiming(layer_kind="block", micro_batch=4, seq_len=64, forward_seconds=0.01,
                                              backward_seconds=0.02)])
    base.update(kw)
    return pb.NodeProfile(**base)


def join(state: CoordinatorState, node_id: str = "", host: str = "h1", port: int = 5001, session: str = "",
         **kw) -> pb.JoinReply:
    return h.handle_join(pb.JoinRequest(token=TOKEN, node_id=node_id, profile=profile(host, **kw),
                                        peer_address=f"127.0.0.1:{port}", session=session), state)


@pytest.fixture
def job() -> JobSpec:
    return JobSpec.load(ROOT / "examples" / "tiny.toml")


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def state(job: JobSpec, clock: Clock) -> CoordinatorState:
    return CoordinatorState(store=MemoryStore(), job=job, token=TOKEN, clock=clock)


def probe_all(state: CoordinatorState, ids: list[str], bw: float = 2e9) -> None:
    for n in ids:
        reply = h.handle_heartbeat(pb.HeartbeatRequest(node_id=n), state)
        links = [pb.LinkMeasurement(src=n, dst=t.node_id, bandwidth_bytes_per_s=bw, rtt_seconds=1e-4)
                 for t in reply.probe]
        h.handle_report_probes(pb.ProbeReport(node_id=n, links=links), state)


def test_join_assigns_an_id_and_ships_the_spec(state: CoordinatorState, job: JobSpec) -> None:
    r = join(state)
    assert r.node_id.startswith("h1-")
    assert r.job.job_id == job.id and JobSpec.from_toml(r.job.spec_toml) == job
    assert r.lease_seconds == 10 and r.heartbeat_interval_seconds == 2.5
    again = join(state, node_id=r.node_id, port=5009)  # same node, new port: an update
    assert again.node_id == r.node_id
    m = state.store.get_member(r.node_id)
    assert m is not None and m.peer_address == "127.0.0.1:5009"
    assert len(state.store.list_members()) == 1


@pytest.mark.parametrize(
    ("mutate", "error", "needle"),
    [
        (lambda r: setattr(r, "token", "wrong"), Unauthenticated, "token"),
        (lambda r: setattr(r, "job_id", "other-job"), FailedPrecondition, "not 'other-job'"),
        (lambda r: r.profile.MergeFrom(pb.NodeProfile(memory_total_bytes=1 << 60)), InvalidArgument,
         "memory_total_bytes"),
        (lambda r: setattr(r.profile, "device_name", ""), InvalidArgument, "device_name is empty"),
        (lambda r: setattr(r.profile, "hostname", "x" * 10000), InvalidArgument, "hostname is 10000 characters"),
        (lambda r: r.profile.layer_timings.add(layer_kind="block", micro_batch=1, seq_len=1, forward_seconds=-1.0),
         InvalidArgument, "forward_seconds"),
        (lambda r: r.profile.layer_timings.add(layer_kind="block", micro_batch=1, seq_len=1, forward_seconds=1.0,
                                               backward_seconds=1.0, weight_fraction=1.5),
         InvalidArgument, "weight_fraction"),
        (lambda r: r.profile.layer_timings.add(layer_kind="block", micro_batch=1, seq_len=1, forward_seconds=1.0,
                                               backward_seconds=1.0, split_overhead=float("nan")),
         InvalidArgument, "split_overhead"),
        (lambda r: r.profile.layer_timings.extend([r.profile.layer_timings[0]] * 100), InvalidArgument,
         "layer_timings has"),
        (lambda r: setattr(r.profile, "device_kind", "tpu"), InvalidArgument, "device_kind"),
        (lambda r: setattr(r, "peer_address", "nowhere"), InvalidArgument, "HOST:PORT"),
        (lambda r: setattr(r, "peer_address", "0.0.0.0:4000"), InvalidArgument, "--advertise"),
        (lambda r: setattr(r, "node_id", "../../etc"), InvalidArgument, "node id"),
        (lambda r: setattr(r.profile, "memory_free_bytes", 1 << 40), InvalidArgument, "exceeds"),
    ],
)
def test_bad_joins_are_refused_with_a_reason(state: CoordinatorState, mutate, error, needle) -> None:
    req = pb.JoinRequest(token=TOKEN, profile=profile(), peer_address="127.0.0.1:5001")
    mutate(req)
    with pytest.raises(error, match=needle):
        h.handle_join(req, state)
    assert state.store.list_members() == []


def test_another_live_node_cannot_take_an_id(state: CoordinatorState, clock: Clock) -> None:
    r = join(state, host="h1")
    with pytest.raises(AlreadyExists, match="held by a live node"):
        join(state, node_id=r.node_id, host="h2")
    clock.t += 11  # h1's lease lapses: the id may move
    assert join(state, node_id=r.node_id, host="h2").node_id == r.node_id


def test_heartbeat_needs_membership(state: CoordinatorState) -> None:
    with pytest.raises(NotFound, match="join first"):
        h.handle_heartbeat(pb.HeartbeatRequest(node_id="ghost"), state)
    r = join(state)
    assert h.handle_heartbeat(pb.HeartbeatRequest(node_id=r.node_id, plan_epoch=5, step=3), state).plan_epoch == 0
    m = state.store.get_member(r.node_id)
    assert m is not None and (m.plan_epoch, m.step) == (5, 3)


def test_three_nodes_probe_form_one_island_and_get_a_plan(state: CoordinatorState, clock: Clock) -> None:
    ids = [join(state, host=f"h{i}", port=5000 + i).node_id for i in range(3)]
    state.tick()
    assert state.current_plan() is None
    probe_all(state, ids)
    # every pair measured once: the next heartbeats hand out nothing
    assert all(not h.handle_heartbeat(pb.HeartbeatRequest(node_id=n), state).probe for n in ids)
    events = state.tick()
    plan = state.current_plan()
    assert plan is not None and plan.epoch == 1 and any("plan epoch 1" in e for e in events)
    assert [i.nodes for i in plan.islands] == [sorted(ids)]
    plan.validate(6)
    for p in plan.pipelines:
        for s in p.stages:
            assert s.nodes and set(s.nodes) <= set(ids)
            assert s.nodes[0] in plan.node_addresses
    status = h.handle_status(pb.StatusRequest(), state)
    assert status.plan.epoch == 1 and len(status.members) == 3 and len(status.islands) == 1
    assert status.islands[0].inner_bandwidth_bytes_per_s == 2e9
    state.tick()
    assert state.current_plan().epoch == 1  # type: ignore[union-attr]  # nothing changed: no new epoch


def test_a_lapsed_lease_and_a_new_node_each_make_a_new_epoch(state: CoordinatorState, clock: Clock) -> None:
    ids = [join(state, host=f"h{i}", port=5000 + i).node_id for i in range(3)]
    probe_all(state, ids)
    state.tick()
    assert state.epoch == 1
    clock.t += 5
    for n in ids[:2]:
        h.handle_heartbeat(pb.HeartbeatRequest(node_id=n, plan_epoch=1), state)
    clock.t += 6  # ids[2] silent for 11 s > lease 10 s
    events = state.tick()
    assert any(f"node {ids[2]} is gone" in e for e in events)
    assert state.epoch == 1  # settling
    clock.t += 2
    state.tick()
    assert state.epoch == 2
    assert {n for i in state.current_plan().islands for n in i.nodes} == set(ids[:2])  # type: ignore[union-attr]
    with pytest.raises(NotFound, match="marked gone"):
        h.handle_heartbeat(pb.HeartbeatRequest(node_id=ids[2]), state)
    # it comes back (same host), probes again, and a third epoch includes it
    join(state, node_id=ids[2], host="h2", port=5002)
    for n in ids[:2]:
        h.handle_heartbeat(pb.HeartbeatRequest(node_id=n, plan_epoch=2), state)
    clock.t += 2
    state.tick()
    assert state.epoch == 2  # a join alone waits for further joins (join_settle, 10 s)
    clock.t += 5
    for n in ids:
        h.handle_heartbeat(pb.HeartbeatRequest(node_id=n, plan_epoch=2), state)
    clock.t += 4
    state.tick()
    assert state.epoch == 3
    assert [h_.plan.epoch for h_ in state.store.plan_history()] == [1, 2, 3]


def test_a_planned_node_that_restarts_gets_a_new_epoch_not_its_old_plan(state: CoordinatorState, clock: Clock) -> None:
    """Every node of a job restarts (same ids, same addresses): the old plan, whose resume step is 0, is not handed to
    their new processes (they would train from step 0 again over newer checkpoints); once the settle time has passed
    a new epoch is made. A retried join of one process (same session) changes nothing."""
    ids = [join(state, host=f"h{i}", port=5000 + i, session=f"s{i}").node_id for i in range(3)]
    probe_all(state, ids)
    state.tick()
    assert state.epoch == 1

    def watched(node: str) -> list[int]:
        return [p.epoch for p in h.watch_plan(pb.WatchPlanRequest(node_id=node), state,
                                              active=iter([True, False]).__next__, poll_seconds=0.01)]

    first = state.store.get_member(ids[0]).joined_unix
    clock.t += 1
    join(state, node_id=ids[0], host="h0", port=5000, session="s0")  # a retry of the same process's join
    state.tick()
    assert state.epoch == 1 and watched(ids[0]) == [1]
    assert state.store.get_member(ids[0]).joined_unix == first  # the same process: it joined when it first did
    clock.t += 1
    for i, n in enumerate(ids):  # every node restarts at its old address
        join(state, node_id=n, host=f"h{i}", port=5000 + i, session=f"again{i}")
    # a new process joined now, its lease not lapsed (status and the fault benches read when each process joined)
    assert all(state.store.get_member(n).joined_unix == clock.t for n in ids)
    assert watched(ids[0]) == [] and watched(ids[1]) == []  # the plan whose runs are gone is withheld
    state.tick()
    assert state.epoch == 1  # settling: more may restart
    clock.t += 10
    for n in ids:
        h.handle_heartbeat(pb.HeartbeatRequest(node_id=n), state)
    events = state.tick()
    assert state.epoch == 2 and any("restarted" in e for e in events)
    assert watched(ids[0]) == [2]
    # an older node sends no session: its joins are not judged
    join(state, node_id=ids[1], host="h1", port=5001)
    state.tick()
    assert state.epoch == 2 and watched(ids[1]) == [2]


def test_restarted_members_get_a_new_plan_after_settling() -> None:
    from atoll.coordinator.membership import MembershipOptions, plan_decision
    from atoll.job import ClusterSpec

    kw = dict(alive={"a", "b"}, planned={"a", "b"}, unprobed=set(), cluster=ClusterSpec(expected_nodes=2),
              options=MembershipOptions(), restarted={"a", "b"})
    assert not plan_decision(10.5, last_change_unix=10.0, **kw).plan  # settling
    d = plan_decision(12.0, last_change_unix=10.0, **kw)
    assert d.plan and "a, b restarted" in d.reason


def test_leave_marks_left_and_watch_yields_newer_plans(state: CoordinatorState) -> None:
    ids = [join(state, host=f"h{i}", port=5000 + i).node_id for i in range(3)]
    probe_all(state, ids)
    state.tick()
    plans = list(h.watch_plan(pb.WatchPlanRequest(node_id=ids[0]), state, active=iter([True, False]).__next__,
                              poll_seconds=0.01))
    assert [p.epoch for p in plans] == [1]
    assert list(h.watch_plan(pb.WatchPlanRequest(node_id=ids[0], known_epoch=1), state,
                             active=iter([True, False]).__next__, poll_seconds=0.01)) == []
    h.handle_leave(pb.LeaveRequest(node_id=ids[1], reason="maintenance"), state)
    assert state.store.get_member(ids[1]).state == "left"  # type: ignore[union-attr]


def test_probe_reports_are_checked(state: CoordinatorState) -> None:
    a, b = join(state, host="a").node_id, join(state, host="b", port=5002).node_id
    bad = [pb.LinkMeasurement(src=b, dst=a, bandwidth_bytes_per_s=1.0),
           pb.LinkMeasurement(src=a, dst=b, bandwidth_bytes_per_s=float("nan")),
           pb.LinkMeasurement(src=a, dst=a, bandwidth_bytes_per_s=1.0),
           pb.LinkMeasurement(src=a, dst=b, bandwidth_bytes_per_s=1.0, rtt_seconds=-1)]
    for link in bad:
        with pytest.raises(InvalidArgument):
            h.handle_report_probes(pb.ProbeReport(node_id=a, links=[link]), state)
    ack = h.handle_report_probes(pb.ProbeReport(node_id=a, links=[
        pb.LinkMeasurement(src=a, dst=b, bandwidth_bytes_per_s=1e9),
        pb.LinkMeasurement(src=a, dst="unknown-node", bandwidth_bytes_per_s=1e9)]), state)
    assert ack.message == "1 links recorded"


def test_checkpoints_complete_when_every_stage_reported(state: CoordinatorState) -> None:
    ids = [join(state, host=f"h{i}", port=5000 + i).node_id for i in range(3)]
    probe_all(state, ids)
    state.tick()
    plan = state.current_plan()
    assert plan is not None
    stages = plan.pipelines[0].stages
    first = stages[0]
    ack = h.handle_report_checkpoint(pb.CheckpointReport(
        job_id=state.job.id, node_id=first.nodes[0], plan_epoch=1, step=25, layer_start=first.layers[0],
        layer_end=first.layers[1], path="/ck/25/s0"), state)
    assert ack.message.startswith("checkpoint of step 25 " + ("complete" if len(stages) == 1 else "recorded"))
    assert f"copies: [{first.layers[0]}, {first.layers[1]}) on 1 (wanted 2 each)" in ack.message
    for s in stages[1:]:
        h.handle_report_checkpoint(pb.CheckpointReport(
            job_id=state.job.id, node_id=s.nodes[0], plan_epoch=1, step=25, layer_start=s.layers[0],
            layer_end=s.layers[1]), state)
    assert state.complete_checkpoint_steps() == [25]
    assert h.handle_status(pb.StatusRequest(), state).last_checkpoint_step == 25
    with pytest.raises(InvalidArgument, match="outside the model"):
        h.handle_report_checkpoint(pb.CheckpointReport(node_id=ids[0], plan_epoch=1, step=1, layer_start=0,
                                                       layer_end=99), state)
    with pytest.raises(FailedPrecondition, match="epoch 7"):
        h.handle_report_checkpoint(pb.CheckpointReport(node_id=ids[0], plan_epoch=7, step=1, layer_end=1), state)


def test_step_reports_feed_status(state: CoordinatorState) -> None:
    ids = [join(state, host=f"h{i}", port=5000 + i).node_id for i in range(3)]
    probe_all(state, ids)
    state.tick()
    for step in range(3):
        ack = h.handle_report_step(pb.StepMetrics(job_id=state.job.id, node_id=ids[0], plan_epoch=1, step=step,
                                                  has_loss=True, loss=5.0, tokens=1024, step_seconds=0.5), state)
        assert ack.plan_epoch == 1 and not ack.stop
    status = h.handle_status(pb.StatusRequest(), state)
    assert status.step == 2 and status.tokens_per_second == pytest.approx(2048)
    assert h.handle_report_step(pb.StepMetrics(node_id=ids[0], plan_epoch=1, step=99), state).stop
    with pytest.raises(FailedPrecondition):
        h.handle_report_step(pb.StepMetrics(node_id=ids[0], plan_epoch=3), state)


def test_state_refuses_a_store_of_another_job(job: JobSpec) -> None:
    store = MemoryStore()
    CoordinatorState(store=store, job=job, token=TOKEN)
    other = JobSpec.from_toml(job.to_toml().replace("steps = 100", "steps = 101").replace(f'id = "{job.id}"\n', ""))
    with pytest.raises(StoreError, match="state dir holds job"):
        CoordinatorState(store=store, job=other, token=TOKEN)
    with pytest.raises(ValueError, match="token"):
        CoordinatorState(store=MemoryStore(), job=job, token="")


def test_reprobe_on_request_and_when_stale(state: CoordinatorState, clock: Clock) -> None:
    ids = [join(state, host=f"h{i}", port=5000 + i).node_id for i in range(2)]
    probe_all(state, ids)
    assert not any(h.handle_heartbeat(pb.HeartbeatRequest(node_id=n), state).probe for n in ids)
    clock.t += 1
    state.request_reprobe(clock.t)
    assert sum(len(h.handle_heartbeat(pb.HeartbeatRequest(node_id=n), state).probe) for n in ids) == 1
    probe_all(state, ids)
    clock.t += 601  # older than reprobe_after (10 min)
    for n in ids:
        state.store.heartbeat(n, clock.t, 0, 0)
    assert sum(len(h.handle_heartbeat(pb.HeartbeatRequest(node_id=n), state).probe) for n in ids) == 1


def test_an_outer_sync_under_the_plan_a_node_has_not_replaced_yet_finds_its_moved_group(
        state: CoordinatorState) -> None:
    """Plan epoch 2 keeps lab-a's group running (listed first now) and replans lab-b. A node of lab-a that arrives
    at a round before adopting epoch 2 names its group by epoch 1's index (1); the coordinator finds the group
    that holds it and ran unchanged since then. Before, it read the index against epoch 2 (lab-b) and refused,
    which failed the node's run and sent lab-a back to its round's start (CI: test_regions_e2e)."""
    from atoll.plan import OuterPlan, PipelinePlan, Plan, ReplicaGroup, StagePlan

    ids = [join(state, host=f"h{i}", port=5001 + i).node_id for i in range(3)]
    a0, a1, b0 = ids

    def pipe(nodes: list[str]) -> PipelinePlan:
        return PipelinePlan(micro_batch=16 // len(nodes) * len(nodes), num_micro_batches=1,
                            stages=[StagePlan(island="i", layers=(0, 6), dp=len(nodes), nodes=nodes)])

    plan = Plan(model="tiny", global_batch=16, seq_len=64, epoch=2, job_id=state.job.id, mode="outer",
                pipelines=[pipe([a0, a1]), pipe([b0])], outer=OuterPlan(inner_steps=5, deadline_s=5.0),
                groups=[ReplicaGroup(name="lab-a", pipelines=[0], inner_steps=5, since_epoch=1),
                        ReplicaGroup(name="lab-b", pipelines=[1], inner_steps=5, since_epoch=2)])
    state._plan = plan  # noqa: SLF001 - the published plan, as the planning loop would set it

    def arrive(node: str, epoch: int, group: int) -> pb.OuterSyncReply:
        return h.handle_outer_sync(pb.OuterSyncRequest(job_id=state.job.id, node_id=node, plan_epoch=epoch,
                                                       round=3, group=group, arrived=True, tokens=100), state)

    arrive(a0, 1, 1)  # epoch 1's index of lab-a: taken as group 0 of epoch 2
    arrive(a1, 2, 0)
    # under the newest plan the index is read as it is
    with pytest.raises(FailedPrecondition, match="not in group 1"):
        arrive(a0, 2, 1)
    # b0's group was replanned in epoch 2 (since epoch 2): under epoch 1 it has no group that ran on
    with pytest.raises(FailedPrecondition, match="not in group 0"):
        arrive(b0, 1, 0)
    with pytest.raises(InvalidArgument, match="group 7 does not exist"):
        arrive(a0, 2, 7)


def test_a_replaced_node_process_is_fenced_out(state: CoordinatorState, clock: Clock) -> None:
    """Two processes with one node id (a restart, or a second machine started from a copy of the state dir that
    kept its hostname): the one that joined last speaks for the node; every request of the other is refused with
    FAILED_PRECONDITION, its Leave does not remove the node, and it cannot take the id back by joining again."""
    node = join(state, host="h0", port=5000, session="first").node_id
    h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, session="first"), state)
    clock.t += 1
    join(state, node_id=node, host="h0", port=6000, session="second")
    h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, session="second"), state)
    stale = [
        lambda: h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, session="first"), state),
        lambda: h.handle_report_step(pb.StepMetrics(job_id=state.job.id, node_id=node, step=1, session="first"),
                                     state),
        lambda: h.handle_report_failure(pb.RunFailure(job_id=state.job.id, node_id=node, plan_epoch=1,
                                                      session="first"), state),
        lambda: h.open_watch(pb.WatchPlanRequest(node_id=node, session="first"), state),
        lambda: h.handle_leave(pb.LeaveRequest(node_id=node, session="first"), state),
        lambda: join(state, node_id=node, host="h0", port=5000, session="first"),
    ]
    for call in stale:
        with pytest.raises(FailedPrecondition, match=f"another process joined as node {node} .* from peer address "
                                                     "127.0.0.1:6000.*--state-dir"):
            call()
    assert state.store.get_member(node).state == "alive"
    assert state.store.get_member(node).peer_address == "127.0.0.1:6000"
    h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, session="second"), state)
    h.handle_heartbeat(pb.HeartbeatRequest(node_id=node), state)  # an older node sends none: not judged
    h.handle_leave(pb.LeaveRequest(node_id=node, session="second"), state)
    assert state.store.get_member(node).state == "left"


def test_a_restarted_coordinator_takes_the_first_process_it_hears_from(job: JobSpec, clock: Clock) -> None:
    """A coordinator that restarted knows no sessions: the first request of a member records its session, and a
    second process speaking for the same node is refused."""
    store = MemoryStore()
    first = CoordinatorState(store=store, job=job, token=TOKEN, clock=clock)
    node = join(first, host="h0", session="a").node_id
    again = CoordinatorState(store=store, job=job, token=TOKEN, clock=clock)
    h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, session="a"), again)
    with pytest.raises(FailedPrecondition, match="another process joined as node"):
        h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, session="b"), again)
    h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, session="a"), again)


def test_a_copy_on_another_host_is_refused_while_the_node_lives(state: CoordinatorState, clock: Clock) -> None:
    """A second machine started from a copy of a node's state dir (a cloned VM: same hostname, another address)
    joins while the node heartbeats: the copy is refused, not taken for a restart (which would fence the running
    node out, and two supervised machines would take the id from each other for ever). Once the node's lease has
    lapsed the copy takes its place; a new process on the node's own host is a restart."""
    node = h.handle_join(pb.JoinRequest(token=TOKEN, profile=profile("vm"), peer_address="10.0.0.1:5000",
                                        session="first"), state).node_id

    def copy(session: str, address: str = "10.0.0.2:5000") -> pb.JoinReply:
        return h.handle_join(pb.JoinRequest(token=TOKEN, node_id=node, profile=profile("vm"), peer_address=address,
                                            session=session), state)

    clock.t += 2
    h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, session="first"), state)
    with pytest.raises(AlreadyExists, match=r"held by a live process at 10.0.0.1:5000 .* this one at 10.0.0.2:5000 "
                                            r"started from a copy of its state dir.*--state-dir"):
        copy("clone")
    h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, session="first"), state)  # the node trains on
    assert state.store.get_member(node).peer_address == "10.0.0.1:5000"
    copy("restarted", "10.0.0.1:5001")  # its own host: a restart, the old process is fenced
    with pytest.raises(FailedPrecondition):
        h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, session="first"), state)
    clock.t += 3600  # the node is gone: its lease lapsed, the copy may take its place
    copy("clone")
    assert state.store.get_member(node).peer_address == "10.0.0.2:5000"


def test_a_copy_of_a_node_that_accepts_no_connections_is_judged_by_where_its_join_came_from(
        state: CoordinatorState, clock: Clock) -> None:
    """A `--no-listen` node advertises no peer address, so its copy on another machine is told apart by the host
    its join's connection came from; a new process from the node's own host is still a restart, and a join from
    an unknown host (the connection's address not known) is not judged."""
    from atoll.coordinator.ratelimit import PerNodeLimit, RateOptions

    # six joins of one node id within seconds: what is judged here is where each came from, not how often
    # (`test_claims.py` covers the rate)
    state.join_limit = PerNodeLimit(RateOptions(burst=10, every_s=15.0, penalty_s=30.0))
    node = h.handle_join(pb.JoinRequest(token=TOKEN, profile=profile("vm"), session="first"), state,
                         seen_from="198.51.100.7").node_id

    def copy(session: str, seen_from: str) -> pb.JoinReply:
        return h.handle_join(pb.JoinRequest(token=TOKEN, node_id=node, profile=profile("vm"), session=session),
                             state, seen_from=seen_from)

    clock.t += 2
    h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, session="first"), state)
    with pytest.raises(AlreadyExists, match=r"live process at host 198.51.100.7 .* this one at host 203.0.113.9 "
                                            r"started from a copy"):
        copy("clone", "203.0.113.9")
    h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, session="first"), state)  # the node trains on
    copy("restarted", "198.51.100.7")  # its own host: a restart
    with pytest.raises(FailedPrecondition):
        h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, session="first"), state)
    h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, session="restarted"), state)
    copy("v6", "2001:db8::7")  # another address family: one dual-stack machine may connect either way
    assert state.process_of(node).session == "v6"
    h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, session="v6"), state)
    copy("again", "")  # where the join came from is not known: taken for a restart
    assert state.process_of(node).session == "again"
    h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, session="again"), state)
    # a node that advertises an address now, and a copy that does not: told apart by where their joins came from
    h.handle_join(pb.JoinRequest(token=TOKEN, node_id=node, profile=profile("vm"), peer_address="10.0.0.1:5000",
                                 session="listening"), state, seen_from="2001:db8::7")
    h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, session="listening"), state)
    with pytest.raises(AlreadyExists, match=r"live process at 10.0.0.1:5000 .* this one at host 2001:db8::9"):
        copy("clone-2", "2001:db8::9")


def test_a_restarted_coordinator_learns_where_a_no_listen_node_is_from_its_heartbeats(job: JobSpec,
                                                                                     clock: Clock) -> None:
    """A coordinator restarted since a `--no-listen` node joined learns the node's host from the first heartbeat
    stream it hears (`HeartbeatStreams.serve` passes the stream's host to `check_session`), so a copy joining from
    another host is still refused."""
    store = MemoryStore()
    first = CoordinatorState(store=store, job=job, token=TOKEN, clock=clock)
    node = h.handle_join(pb.JoinRequest(token=TOKEN, profile=profile("vm"), session="a"), first,
                         seen_from="198.51.100.7").node_id
    again = CoordinatorState(store=store, job=job, token=TOKEN, clock=clock)
    h.handle_heartbeat(pb.HeartbeatRequest(node_id=node, session="a"), again)  # heard first without a host
    assert again.process_of(node).seen_from == ""
    again.check_session(node, "a", seen_from="198.51.100.7")  # then its heartbeat stream
    with pytest.raises(AlreadyExists, match=r"live process at host 198.51.100.7 .* this one at host 203.0.113.9"):
        h.handle_join(pb.JoinRequest(token=TOKEN, node_id=node, profile=profile("vm"), session="clone"), again,
                      seen_from="203.0.113.9")
