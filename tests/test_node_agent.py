"""Node side: stable identity, the profiler, and agents against a real in-process coordinator."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from atoll.coordinator.islands import IslandOptions
from atoll.coordinator.linkmatrix import ProbeOptions
from atoll.coordinator.membership import MembershipOptions
from atoll.coordinator.service import CoordinatorService, ServiceConfig
from atoll.coordinator.state import CoordinatorOptions
from atoll.coordinator.status import fetch_status
from atoll.coordinator.store import MemoryStore
from atoll.job import JobSpec
from atoll.node.agent import AgentConfig, AgentError, NodeAgent, PlanRun, describe_plan
from atoll.node.checkpoint import RUN_FILE
from atoll.node.identity import load_node_id, load_or_create_node_id, save_node_id
from atoll.node.profiler import ProfileOptions, parse_device, profile_node
from atoll.plan import PipelinePlan, Plan, ReplicaGroup, StagePlan
from atoll.types import NodeProfile

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "node-test-token"


def test_node_id_is_created_once_and_kept(tmp_path: Path) -> None:
    assert load_node_id(tmp_path) is None
    first = load_or_create_node_id(tmp_path, hostname="gpu-box.example.org")
    assert first.startswith("gpu-box-")
    assert load_or_create_node_id(tmp_path) == first
    (tmp_path / "node_id").write_text("../../bad id\n")
    with pytest.raises(ValueError, match="delete the file"):
        load_node_id(tmp_path)
    with pytest.raises(ValueError):
        save_node_id(tmp_path, "bad id")


def test_profile_measures_the_jobs_layers_quickly() -> None:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    t0 = time.perf_counter()
    # one torch thread, as the local cluster's nodes run (`--threads 1`): the profiler then times each op by its
    # thread's CPU time, which another process's load does not inflate; with the test process's default threads
    # it times wall clock, and on a loaded CI machine a block's weight-gradient share read 0.009 and 0.034.
    # Three rounds, the median of each reading (the product takes seven)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        p = profile_node(job, "cpu", ProfileOptions(repeats=3))
    finally:
        torch.set_num_threads(threads)
    assert time.perf_counter() - t0 < 20  # seconds on a quiet machine; CI runners are shared
    assert p.device_kind == "cpu" and p.device_name and p.device_count == 1
    assert 0 < p.memory_free_bytes <= p.memory_total_bytes and p.cpu_count >= 1
    kinds = {(t.layer_kind, t.micro_batch) for t in p.layer_timings}
    assert kinds == {(k, b) for k in ("embedding", "block", "head") for b in (2, 4, 8)}
    assert all(t.seq_len == 64 and t.forward_seconds > 0 and t.backward_seconds > 0 for t in p.layer_timings)
    # the split backward of the layers a zero-bubble stage defers (blocks, the untied head): the weight-gradient
    # products' share of it; the embedding has none
    share = {t.layer_kind: t.weight_fraction for t in p.layer_timings}
    assert 0.05 < share["block"] < 0.95 and 0.05 < share["head"] < 0.95 and share["embedding"] == 0
    extra = {t.layer_kind: t.split_overhead for t in p.layer_timings}
    # (in the range the profiler reports, its cap included: a loaded machine can time the split path at it)
    assert 0 <= extra["block"] <= 2 and 0 <= extra["head"] <= 2 and extra["embedding"] == 0
    assert p.optimizer_step_seconds > 0


def test_the_profile_reports_what_splitting_the_backward_adds(monkeypatch) -> None:
    """A fused backward of 1 s split into 0.7 s of input gradients and 0.4 s of weight-gradient products: the
    products' share is 0.4 / 1.1 and the split costs 10% more than the fused pass; a split measured faster than
    the fused pass (noise) counts as none."""
    from atoll.node import profiler

    job = JobSpec.load(ROOT / "examples" / "tiny.toml")

    def timed(dev, fn, share=float("inf")):
        fn()
        return 1.0

    split = [(0.7, 0.4)]
    monkeypatch.setattr(profiler, "_timed", timed)
    monkeypatch.setattr(profiler, "_split_backward", lambda *a, **kw: split[0])
    p = profile_node(job, "cpu", ProfileOptions(repeats=2, micro_batches=(2,)))
    by_kind = {t.layer_kind: t for t in p.layer_timings}
    assert by_kind["block"].split_overhead == pytest.approx(0.1)
    assert by_kind["block"].weight_fraction == pytest.approx(0.4 / 1.1)
    assert by_kind["embedding"].split_overhead == 0
    split[0] = (0.5, 0.3)
    p = profile_node(job, "cpu", ProfileOptions(repeats=2, micro_batches=(2,)))
    assert {t.layer_kind: t.split_overhead for t in p.layer_timings}["head"] == 0


def test_a_machine_slowing_during_the_profile_leaves_the_ratios_between_sizes_alone(monkeypatch) -> None:
    """The profile times every size once a round: a machine slowing steadily while it profiles (each timed op
    1% slower than the one before it) slows every size alike, so a block at 8 sequences still costs 4x one at
    2 (times here proportional to the sequences). Timing each size's repeats back to back would give the last
    size the slowest moments: about 6x."""
    from atoll.node import profiler

    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    rows, calls = [0], [0]
    real_forward = profiler._forward

    def forward(layer, x, precision, dev):
        rows[0] = x.shape[0]
        return real_forward(layer, x, precision, dev)

    def timed(dev, fn, share=math.inf):
        fn()
        calls[0] += 1
        return rows[0] * (1.0 + calls[0] / 100)

    monkeypatch.setattr(profiler, "_forward", forward)
    monkeypatch.setattr(profiler, "_timed", timed)
    p = profile_node(job, "cpu", ProfileOptions(micro_batches=(2, 4, 8), repeats=7, budget=timedelta(minutes=5)))
    block = {t.micro_batch: t.forward_seconds for t in p.layer_timings if t.layer_kind == "block"}
    assert block[8] / block[2] == pytest.approx(4.0, rel=0.1)
    assert block[4] / block[2] == pytest.approx(2.0, rel=0.1)


def test_the_heads_timed_forward_includes_the_loss_as_the_last_stage_computes_it(monkeypatch) -> None:
    """The last stage's forward action computes the loss (logits to fp32, cross entropy over the vocabulary):
    the head's profiled forward must too, or a large vocabulary's loss goes unpriced."""
    from atoll.node import profiler

    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    inside, timed_with_loss = [False], [0]
    real_loss, real_timed = profiler.lm_loss, profiler._timed

    def loss(logits, targets):
        if inside[0]:
            timed_with_loss[0] += 1
        return real_loss(logits, targets)

    def timed(dev, fn, share=math.inf):
        inside[0] = True
        try:
            return real_timed(dev, fn, share)
        finally:
            inside[0] = False

    monkeypatch.setattr(profiler, "lm_loss", loss)
    monkeypatch.setattr(profiler, "_timed", timed)
    p = profile_node(job, "cpu", ProfileOptions(micro_batches=(2,), repeats=2))
    assert timed_with_loss[0] >= 3  # one a round: the warm-up and two timed
    assert {t.layer_kind for t in p.layer_timings} == {"embedding", "block", "head"}


def test_bad_devices_are_explained() -> None:
    with pytest.raises(ValueError, match="not a device"):
        parse_device("gpu7")
    with pytest.raises(ValueError, match="use cpu"):
        parse_device("meta")


def test_describe_plan_names_this_nodes_place() -> None:
    plan = Plan(model="tiny", global_batch=16, seq_len=64, epoch=3, job_id="j", pipelines=[PipelinePlan(
        micro_batch=4, num_micro_batches=4, stages=[StagePlan(island="cpu0", layers=(0, 3), nodes=["a"]),
                                                    StagePlan(island="cpu1", layers=(3, 6), nodes=["b", "c"], dp=2)])])
    text = describe_plan(plan, "c")
    assert "plan epoch 3" in text and "pipeline 0 stage 1 (layers [3, 6)) as rank 1 of 2" in text
    assert "idle" in describe_plan(plan, "zz")
    # a tp stage: the replica and the tp rank, not a rank past its dp; a rendezvous on every interface is shown at
    # the host the node dials the coordinator at, not as tcp://:PORT
    tp = Plan(model="tiny", global_batch=16, seq_len=64, epoch=4, job_id="j", pipelines=[PipelinePlan(
        micro_batch=8, num_micro_batches=2, stages=[
            StagePlan(island="cpu0", layers=(0, 3), nodes=["a"], dp_rendezvous="tcp://:29500"),
            StagePlan(island="cpu0", layers=(3, 6), nodes=["b", "c", "d", "e"], dp=2, tp=2,
                      dp_rendezvous="tcp://:29500")])])
    text = describe_plan(tp, "d", "coord.example")
    assert "as replica 1 of 2, tp rank 0 of 2" in text and "dp 2 x tp 2 on b, c, d, e" in text, text
    assert "rendezvous tcp://coord.example:29500" in text and "tcp://:" not in text, text
    # outer mode: the node's replica group, and why the plan trains in its mode
    outer = Plan(model="tiny", global_batch=16, seq_len=64, epoch=5, job_id="j", mode="outer",
                 mode_reason="outer: 1.8x the synchronous plan", groups=[
                     ReplicaGroup(name="lab-a", pipelines=[0]), ReplicaGroup(name="lab-b", pipelines=[1])],
                 pipelines=[PipelinePlan(micro_batch=4, num_micro_batches=2, stages=[
                     StagePlan(island=f"cpu{k}", layers=(0, 6), nodes=[f"n{k}"])]) for k in range(2)])
    text = describe_plan(outer, "n1")
    assert "outer mode: 2 replica groups" in text and "in replica group lab-b" in text
    assert "outer: 1.8x the synchronous plan" in text


# --- agents against a coordinator ------------------------------------------------------------------------

def fake_profile(host: str) -> NodeProfile:
    return NodeProfile(hostname=host, device_kind="cpu", device_name="test-cpu", memory_total_bytes=8 << 30,
                       memory_free_bytes=4 << 30, cpu_count=2)


def start_coordinator(listen: str = "127.0.0.1:0", store: MemoryStore | None = None) -> CoordinatorService:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    opts = CoordinatorOptions(membership=MembershipOptions(lease=timedelta(seconds=3), settle=timedelta(0)),
                              probes=ProbeOptions(probe_bytes=256 * 1024),
                              # loopback probes on a busy machine vary several-fold; this test is not about
                              # the clustering rule, so any measured link joins
                              islands=IslandOptions(relative_threshold=0.01))
    return CoordinatorService(job=job, token=TOKEN, options=opts, store=store or MemoryStore(),
                              config=ServiceConfig(listen=listen, tick=timedelta(milliseconds=50))).start()


def make_agent(address: str, state_dir: Path, host: str, checkpoint_dir: Path | None = None) -> NodeAgent:
    cfg = AgentConfig(coordinator=address, token=TOKEN, state_dir=state_dir, listen="127.0.0.1:0",
                      checkpoint_dir=checkpoint_dir,
                      connect_timeout=timedelta(seconds=20),
                      backoff=(timedelta(milliseconds=50), timedelta(milliseconds=500)))
    return NodeAgent(cfg, profile=fake_profile(host))


def wait_until(cond: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def run_in_thread(agent: NodeAgent) -> tuple[threading.Thread, list[BaseException]]:
    """`agent.run()` on a thread of its own; what it raised lands in the list."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            agent.run()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


@pytest.fixture
def coordinator() -> Iterator[CoordinatorService]:
    svc = start_coordinator()
    yield svc
    svc.stop()


@pytest.mark.timeout(60)
def test_three_agents_probe_get_a_plan_and_replan_when_one_leaves(coordinator: CoordinatorService,
                                                                 tmp_path: Path) -> None:
    runs: dict[str, list[int]] = {}
    lock = threading.Lock()

    def on_plan(run: PlanRun) -> None:
        with lock:
            runs.setdefault(run.node_id, []).append(run.plan.epoch)
        assert run.job.name == "tiny" and run.peer.node_id == run.node_id
        run.superseded.wait(30)  # "train" until a newer plan arrives

    agents = [make_agent(coordinator.address, tmp_path / f"n{i}", f"host{i}") for i in range(3)]
    threads = [threading.Thread(target=a.run, args=(on_plan,), daemon=True) for a in agents]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: len(runs) == 3, what="every agent to run plan epoch 1")
        status = fetch_status(coordinator.address, token=TOKEN)
        assert status.plan.epoch == 1
        assert [sorted(i.node_ids) for i in status.islands] == [sorted(a.node_id for a in agents)]
        assert len(status.links) >= 3 and all(x.bandwidth_bytes_per_s > 0 for x in status.links)
        agents[2].stop()
        wait_until(lambda: all(runs[a.node_id][-1] == 2 for a in agents[:2]), what="epoch 2 on the others")
        status = fetch_status(coordinator.address, token=TOKEN)
        assert {m.node_id: m.state for m in status.members}[agents[2].node_id] == "left"
        assert runs[agents[2].node_id] == [1]
    finally:
        for a in agents:
            a.stop()
        for t in threads:
            t.join(5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("again", [False, True])
def test_a_graceful_stop_lets_the_step_in_flight_finish_unless_stopped_again(coordinator: CoordinatorService,
                                                                             tmp_path: Path, again: bool) -> None:
    """stop() first lets the run finish the step it is in (its stage's other nodes finish it too), then leaves; a
    second stop() (Ctrl-C again) ends that step at once."""
    from atoll.node.state_transfer import StateHolder

    finished: dict[str, str] = {}

    def on_plan(run: PlanRun) -> None:
        if run.peer.state is None:
            run.peer.state = StateHolder(node_id=run.node_id)
        held = run.peer.state
        held.begin_run(run.plan.epoch)
        try:
            while not run.agent.draining and not run.superseded.is_set():  # steps go on until a stop
                time.sleep(0.05)
            cut = run.superseded.wait(6.0)  # the step in flight takes 6 s more, unless cut short
            finished.setdefault(run.node_id, "cut short" if cut else "finished")
        finally:
            held.end_run(run.plan.epoch)

    agents = [make_agent(coordinator.address, tmp_path / f"n{i}", f"host{i}") for i in range(3)]
    threads = [threading.Thread(target=a.run, args=(on_plan,), daemon=True) for a in agents]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: all(a.plan is not None and a.peer.state is not None and a.peer.state.stepping
                               for a in agents), what="every agent stepping in plan epoch 1")
        stopping = threading.Thread(target=agents[0].stop)
        started = time.monotonic()
        stopping.start()
        if again:
            time.sleep(0.3)
            agents[0].stop()
        stopping.join(20)
        took = time.monotonic() - started
        assert finished[agents[0].node_id] == ("cut short" if again else "finished"), finished
        # (cut short: the second stop 0.3 s in, then the Leave and the threads' ends, well under the step's 6 s)
        assert (took < 4.0) if again else (took >= 5.9), took
        status = fetch_status(coordinator.address, token=TOKEN)
        assert {m.node_id: m.state for m in status.members}[agents[0].node_id] == "left"
    finally:
        for a in agents:
            a.stop()
        for t in threads:
            t.join(5)


@pytest.mark.timeout(60)
def test_agents_rejoin_by_themselves_when_the_coordinator_forgot_them(tmp_path: Path) -> None:
    first = start_coordinator()
    address = first.address
    agents = [make_agent(address, tmp_path / f"n{i}", f"host{i}", checkpoint_dir=tmp_path / f"c{i}")
              for i in range(3)]
    try:
        for a in agents:
            a.start()
        wait_until(lambda: all(a.plan is not None for a in agents), what="plan epoch 1")
        ids = sorted(a.node_id for a in agents)
        assert (tmp_path / "c0" / RUN_FILE).read_text() == f"{first.state.run_id}\n"
        first.stop()
        second = start_coordinator(listen=address, store=MemoryStore())  # same address, no memory of anyone
        try:
            wait_until(lambda: all(a.joins == 2 for a in agents), what="automatic re-joins")
            status = fetch_status(address, token=TOKEN)
            assert sorted(m.node_id for m in status.members) == ids  # the same stable ids
            wait_until(lambda: second.state.epoch == 1, what="a plan from the new coordinator")
            # its epoch 1 is not the old epoch 1: every agent takes it
            wait_until(lambda: all(a.plan_serial == 2 for a in agents), what="agents to take the new plan")
            assert all(a.plan == second.state.current_plan() for a in agents)
            # the agents go on under the new coordinator's run, and so do their checkpoint folders: a node started
            # on one later joins that run instead of being refused as an earlier run's
            assert second.state.run_id != first.state.run_id
            assert all((tmp_path / f"c{i}" / RUN_FILE).read_text() == f"{second.state.run_id}\n" for i in range(3))
        finally:
            second.stop()
    finally:
        for a in agents:
            a.stop(leave=False)


def test_a_wrong_token_stops_the_agent_with_a_clear_error(coordinator: CoordinatorService, tmp_path: Path) -> None:
    cfg = AgentConfig(coordinator=coordinator.address, token="wrong", state_dir=tmp_path, listen="127.0.0.1:0",
                      connect_timeout=timedelta(seconds=5))
    agent = NodeAgent(cfg, profile=fake_profile("h"))
    with pytest.raises(AgentError, match="UNAUTHENTICATED: missing or wrong job token"):
        agent.start()
    agent.stop()


@pytest.mark.timeout(30)
def test_stop_while_waiting_for_a_coordinator_ends_run_quietly(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port with nothing behind it
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    agent = make_agent(address, tmp_path, "h")
    t, errors = run_in_thread(agent)
    time.sleep(0.5)
    agent.stop()
    t.join(5)
    assert not t.is_alive() and errors == [] and agent.peer is None


@pytest.mark.timeout(30)
def test_run_raises_when_the_coordinator_later_refuses_the_node(coordinator: CoordinatorService,
                                                               tmp_path: Path) -> None:
    agent = make_agent(coordinator.address, tmp_path, "h")
    t, errors = run_in_thread(agent)
    wait_until(lambda: agent.joins == 1, what="the join")
    coordinator.state.token = "rotated"  # every later call is refused
    t.join(15)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], AgentError) and "token" in str(errors[0])
    coordinator.state.token = TOKEN


@pytest.mark.timeout(60)
def test_a_leaving_node_prunes_what_reports_it_just_delivered_made_needless(coordinator: CoordinatorService,
                                                                            tmp_path: Path) -> None:
    """A node holding copies of the last checkpoint hears that older steps are needless only with a heartbeat
    reply; at the job's end none comes after its last reports, so it asks once more as it leaves."""
    agent = make_agent(coordinator.address, tmp_path / "n0", "host0")
    pruned: list[int] = []
    agent.on_prune = lambda before, keep: pruned.append(before)
    try:
        agent.start()
        wait_until(lambda: agent.joins == 1, what="the join")
        time.sleep(0.2)  # a heartbeat or two with no horizon yet
        coordinator.state.prune_checkpoints_before = 300  # a report raised it after the last heartbeat
        agent.heartbeat_interval = 3600.0
        agent.stop()
        assert pruned and pruned[-1] == 300
    finally:
        agent.stop()


def test_a_request_carries_the_session_only_where_it_speaks_for_this_node(tmp_path: Path) -> None:
    """The report of a copy another node took of this node's checkpoint is sent by this process but speaks for that
    node: stamped with this process's session, the coordinator would take this process for that node's."""
    from atoll.v1 import atoll_pb2 as pb

    agent = make_agent("127.0.0.1:9", tmp_path, "h")
    sent: list = []

    class Stub:
        def __getattr__(self, method: str):
            return lambda request, timeout: sent.append(request)

    agent._stub = Stub()  # type: ignore[assignment]
    try:
        agent.call("ReportCheckpoint", pb.CheckpointReport(node_id=agent.node_id, step=10))
        agent.call("ReportCheckpoint", pb.CheckpointReport(node_id="other-node", step=10, copy_of=agent.node_id))
        agent.call("Leave", pb.LeaveRequest(node_id=agent.node_id))
        assert [r.session for r in sent] == [agent.session, "", agent.session] and agent.session
    finally:
        agent.stop(leave=False)


@pytest.mark.timeout(60)
def test_an_agent_replaced_by_a_second_process_of_its_node_stops_with_why(coordinator: CoordinatorService,
                                                                         tmp_path: Path) -> None:
    """Two processes under one node id (the second started from a copy of the first's state dir): the first is
    refused from then on, and its run ends with an AgentError that says so; the second carries on."""
    import shutil

    first = make_agent(coordinator.address, tmp_path / "a", "h")
    t, errors = run_in_thread(first)
    wait_until(lambda: first.joins == 1, what="the first join")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    second = make_agent(coordinator.address, tmp_path / "b", "h")
    assert second.node_id == first.node_id
    try:
        second.start()
        t.join(20)
        assert not t.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], AgentError), errors
        assert f"another process joined as node {first.node_id}" in str(errors[0])
        assert coordinator.state.store.get_member(second.node_id).state == "alive"
        time.sleep(1.0)  # the second keeps heartbeating unrefused
        assert second.error is None and not second.stopped
    finally:
        second.stop()
        first.stop()


def test_a_leave_is_retried_while_the_coordinator_is_away(tmp_path: Path) -> None:
    """A node stopped while its coordinator restarts: its Leave is retried for a while (only a Leave the coordinator
    took lets the next plan's nodes fetch the node's live state), then given up with a warning."""
    import grpc

    class Unavailable(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "restarting"

    agent = make_agent("127.0.0.1:9", tmp_path, "h")
    answers: list = [Unavailable(), Unavailable(), None]
    calls: list[float] = []

    class Stub:
        def Leave(self, request, timeout):  # noqa: N802 - the gRPC method's name
            calls.append(time.monotonic())
            answer = answers.pop(0) if answers else Unavailable()
            if answer is not None:
                raise answer
            return None

    agent._stub = Stub()  # type: ignore[assignment]
    try:
        assert agent._send_leave(timedelta(seconds=10)) and len(calls) == 3
        calls.clear()
        t0 = time.monotonic()
        assert not agent._send_leave(timedelta(seconds=1.5))  # the coordinator stays away
        assert len(calls) >= 2 and time.monotonic() - t0 < 3.0
    finally:
        agent.stop(leave=False)
