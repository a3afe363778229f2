"""No rollback when a copy is live: a replica killed, a replica joining and a graceful leave each resume at the
step training had reached, taking layers from live nodes over gRPC, with the losses of an uninterrupted run.

The jobs write no checkpoints at all, so any rollback would go back to step 0 and show in the logs' `resume:`
lines and in the step reports. Nodes are processes around a scripted coordinator (`scripted_cluster`).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from atoll.coordinator.membership import MembershipOptions, plan_decision
from atoll.job import ClusterSpec, JobSpec
from atoll.node.local import train_local
from scripted_cluster import ScriptedCluster, close

REPO = Path(__file__).resolve().parent.parent
STEPS = 40


def _job(nodes: int, steps: int = STEPS) -> JobSpec:
    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    return replace(job, train=replace(job.train, steps=steps, warmup=5),
                   checkpoint=replace(job.checkpoint, interval=0),
                   compression=replace(job.compression, mode="identity"),
                   cluster=replace(job.cluster, expected_nodes=nodes, min_nodes=1),
                   outer=replace(job.outer, mode="sync"))


def one_process(job: JobSpec, steps: int | None = None) -> list[float]:
    """The job's losses trained in one process, on one thread (threads of their own would fight the node
    processes for the machine's cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_local(job, steps=steps)[0]
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return one_process(_job(3))


JOIN_STEPS = 5000
"""The join test's job: a joining process starts, profiles and is probed before it is planned, and the job must
outlast that under load (300 steps, about 15 s here, is too close with another test running beside it); the test
ends, killing every process, ten steps after the join's plan resumed."""


@pytest.mark.timeout(10)
def test_ten_joins_within_a_minute_cause_one_replan() -> None:
    opts = MembershipOptions()  # join_settle 10 s, join_settle_max 60 s
    cluster = ClusterSpec(expected_nodes=1, min_nodes=1)
    planned, joins, replans = {"a"}, [1.0 + 6 * k for k in range(10)], []
    for tick in range(0, 150):
        now = float(tick)
        alive = {"a"} | {f"j{k}" for k, t in enumerate(joins) if t <= now}
        last = max([t for t in joins if t <= now], default=0.0)
        first = min((t for k, t in enumerate(joins) if t <= now and f"j{k}" not in planned), default=None)
        d = plan_decision(now, alive=alive, planned=planned, unprobed=set(), last_change_unix=last, cluster=cluster,
                          options=opts, first_join_unix=first)
        if d.plan:
            replans.append((now, len(alive - planned)))
            planned = set(alive)
    assert replans == [(61.0, 10)]  # one replan, 60 s after the first join, with all ten
    # a departure is not debounced: the stage it ran is stalled
    d = plan_decision(100.0, alive={"a"}, planned={"a", "b"}, unprobed=set(), last_change_unix=98.0, cluster=cluster,
                      options=opts, first_join_unix=None)
    assert d.plan and d.reason == "gone: b"
    with pytest.raises(ValueError, match="join_settle"):
        MembershipOptions(join_settle=timedelta(seconds=90))


def test_a_region_back_from_a_restart_is_planned_without_the_join_debounce() -> None:
    """Both nodes of a region killed and restarted rejoin: the cluster is whole again (the job's expected nodes), and
    they are planned after the settle time, not the 10 s join debounce; a newcomer, or a returning node while the
    cluster is still short, waits for the debounce as before."""
    opts = MembershipOptions()  # settle 1 s, join_settle 10 s
    cluster = ClusterSpec(expected_nodes=5, min_nodes=1)
    planned, alive = {"a0", "a1", "c0"}, {"a0", "a1", "c0", "b0", "b1"}
    back = plan_decision(20.0, alive=alive, planned=planned, unprobed=set(), last_change_unix=18.5, cluster=cluster,
                         options=opts, first_join_unix=18.0, returning={"b0", "b1"})
    assert back.plan and "whole again" in back.reason
    for returning, nodes in [(set(), alive), ({"b0"}, alive), ({"b0"}, {"a0", "a1", "c0", "b0"})]:
        d = plan_decision(20.0, alive=nodes, planned=planned, unprobed=set(), last_change_unix=18.5, cluster=cluster,
                          options=opts, first_join_unix=18.0, returning=returning)
        assert not d.plan and "replanning once none has joined" in d.reason


def _after(cluster: ScriptedCluster, name: str, epoch_runs: int) -> tuple[int, str, int, int]:
    runs = cluster.resumes(name)
    assert len(runs) >= epoch_runs, (name, runs)
    return runs[epoch_runs - 1]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_killed_replica_costs_no_step(tmp_path: Path, reference: list[float]) -> None:
    """Stage [3, 6) runs on b1 and b2; b2 is SIGKILLed mid-run. The next plan cuts at layer 2, so b1 takes layer 2
    from a's live state; both resume at the step training had reached."""
    layouts = {frozenset({"a", "b1", "b2"}): [((0, 3), ["a"]), ((3, 6), ["b1", "b2"])],
               frozenset({"a", "b1"}): [((0, 2), ["a"]), ((2, 6), ["b1"])]}
    cluster = ScriptedCluster(job=_job(3), out=tmp_path, layouts=layouts)
    try:
        for n in ("a", "b1", "b2"):
            cluster.start_node(n, region="lab")
        cluster.wait(lambda: cluster.top_step() >= 10, 150, "step 10")
        first = cluster.plan()
        cluster.kill("b2")
        killed_at = cluster.top_step()
        cluster.wait(lambda: cluster.top_step() >= STEPS - 1, 200, "the job to finish", dead=["b2"])
        later = cluster.plan()
        assert later.epoch > first.epoch and set(later.node_addresses) == {"a", "b1"}
        for n in ("a", "b1"):
            step, how, was, back = _after(cluster, n, 2)
            assert (how, back) == ("live state", 0), cluster.resumes(n)
            assert killed_at <= step == was, (killed_at, step, was)
        moved = cluster.transfers("b1")
        assert [src for _, src, _ in moved] == ["a"] and "layers [0, 3)" in moved[0][2]
        assert cluster.transfers("a") == []  # a kept its own layers
        # the first step of each run after the kill says so in its report, for the coordinator and the churn bench
        firsts = {s.node_id: s for s in cluster.steps() if s.plan_epoch == later.epoch and s.restored_from}
        assert {n: (s.restored_from, s.steps_rolled_back, s.step) for n, s in firsts.items()} == {
            "a": ("live", 0, step), "b1": ("live", 0, step)}
        assert firsts["b1"].restore_bytes == moved[0][0] and firsts["a"].restore_bytes == 0
        # every step trained once, as in one process. The step b2 died in may have no loss: b1 finished it
        # (its optimizer stepped, so the run resumes after it) but the loss all-reduce with b2 broke
        losses = cluster.losses()
        missing = [s for s in range(STEPS) if s not in losses]
        assert missing in ([], [step - 1]), (missing, step)
        close(losses, reference, [s for s in range(STEPS) if s in losses], 1e-4)
        print(f"\nkilled b2 at step {killed_at}; resumed at step {step} (0 rolled back); b1 fetched "
              f"{moved[0][0]} bytes from a")
    finally:
        cluster.stop()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_join_to_a_running_stage_costs_no_step(tmp_path: Path) -> None:
    """b2 joins while a and b1 train: the next plan runs stage [3, 6) on b1 and b2, and b2 takes its layers (and
    their optimizer state) from b1's live state."""
    layouts = {frozenset({"a", "b1"}): [((0, 3), ["a"]), ((3, 6), ["b1"])],
               frozenset({"a", "b1", "b2"}): [((0, 3), ["a"]), ((3, 6), ["b1", "b2"])]}
    job = _job(2, JOIN_STEPS)
    cluster = ScriptedCluster(job=job, out=tmp_path, layouts=layouts)
    try:
        for n in ("a", "b1"):
            cluster.start_node(n, region="lab")
        cluster.wait(lambda: cluster.top_step() >= 3, 150, "step 3")
        first = cluster.plan()
        joined_at = cluster.top_step()
        cluster.start_node("b2", region="lab")
        cluster.wait(lambda: bool(cluster.resumes("b2")), 200, "b2 to resume")
        step, how, was, back = _after(cluster, "b2", 1)
        cluster.wait(lambda: len(cluster.losses()) >= step + 10, 200, "ten steps of the stage of two replicas")
        later = cluster.plan()
        assert later.epoch > first.epoch and later.pipelines[0].stages[1].nodes == ["b1", "b2"]
        assert (how, back) == ("live state", 0) and step == was >= joined_at, cluster.resumes("b2")
        for n in ("a", "b1"):
            assert _after(cluster, n, 2)[1:] == ("live state", step, 0), cluster.resumes(n)
        moved = cluster.transfers("b2")
        assert [src for _, src, _ in moved] == ["b1"], moved
        # the steps up to ten past the join, as one process trains them
        upto = step + 10
        close(cluster.losses(), one_process(job, upto), range(upto), 1e-4)
        print(f"\nb2 joined at step {joined_at}; the stage of two replicas resumed at step {step} (0 rolled back); "
              f"b2 fetched {moved[0][0]} bytes from b1")
    finally:
        cluster.stop()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_graceful_leave_hands_its_state_over(tmp_path: Path, reference: list[float]) -> None:
    """b1, the only holder of layers [3, 6), gets SIGTERM: it stops at a step boundary, leaves, and serves its
    state until c (idle until then) has taken it; c runs [3, 6) from the step training had reached."""
    layouts = {frozenset({"a", "b1", "c"}): [((0, 3), ["a"]), ((3, 6), ["b1"])],
               frozenset({"a", "c"}): [((0, 3), ["a"]), ((3, 6), ["c"])]}
    cluster = ScriptedCluster(job=_job(3), out=tmp_path, layouts=layouts)
    try:
        for n in ("a", "b1", "c"):
            cluster.start_node(n, region="lab")
        cluster.wait(lambda: cluster.top_step() >= 10, 150, "step 10")
        leaver = cluster.terminate("b1")
        left_at = cluster.top_step()
        cluster.wait(lambda: len(cluster.losses()) >= STEPS, 200, "the job to finish", dead=["b1"])
        assert leaver.wait(60) == 0
        step, how, was, back = _after(cluster, "c", 1)
        assert (how, back) == ("live state", 0) and step == was >= left_at, cluster.resumes("c")
        assert [src for _, src, _ in cluster.transfers("c")] == ["b1"]
        assert "leaving: the live state was handed over" in cluster.log("b1")
        close(cluster.losses(), reference, range(STEPS), 1e-4)
    finally:
        cluster.stop()


def _a_node_leaves(tmp_path: Path, reference: list[float], layouts: dict, nodes: tuple[str, ...], leaver: str,
                   runs: dict[str, int], logged: list[str], c_took_from: list[str]) -> None:
    """`nodes` train under the scripted `layouts` (no checkpoints, so any rollback would show); `leaver` gets
    SIGTERM at step 10 or later and exits 0; each node of `runs` resumes its run number `runs[n]` from live state
    at the step training had reached, with 0 rolled back; b1's log holds every line of `logged`; c took its state
    from `c_took_from`; the losses are those of one process."""
    cluster = ScriptedCluster(job=_job(len(nodes)), out=tmp_path, layouts=layouts)
    try:
        for n in nodes:
            cluster.start_node(n, region="lab")
        cluster.wait(lambda: cluster.top_step() >= 10, 150, "step 10")
        process = cluster.terminate(leaver)
        left_at = cluster.top_step()
        cluster.wait(lambda: len(cluster.losses()) >= STEPS, 200, "the job to finish", dead=[leaver])
        assert process.wait(60) == 0
        for n, run in runs.items():
            step, how, was, back = _after(cluster, n, run)
            assert (how, back) == ("live state", 0) and step == was >= left_at, (n, cluster.resumes(n))
        for line in logged:
            assert line in cluster.log("b1")
        assert sorted({src for _, src, _ in cluster.transfers("c")}) == c_took_from
        close(cluster.losses(), reference, range(STEPS), 1e-4)
    finally:
        cluster.stop()


def _a_leaves_and_stage_b_hands_over(tmp_path: Path, reference: list[float], sharded: tuple, logged: list[str],
                                     stage: tuple[str, ...] = ("b1", "b2")) -> None:
    """Stage [3, 6) runs on `stage` (b1, b2, ...) with its state spread over them (`sharded`: the layout's ZeRO
    stage and tp). a leaves gracefully; the next plan keeps them and gives a's layers to c. They gather the
    stage's state whole on b1, which serves it, so nothing is rolled back (without it, these layers would go
    back to step 0: no checkpoints); b1's log holds every line of `logged`."""
    layouts = {frozenset({"a", *stage, "c"}): [((0, 3), ["a"]), ((3, 6), list(stage), *sharded)],
               frozenset({*stage, "c"}): [((0, 3), ["c"]), ((3, 6), list(stage), *sharded)]}
    _a_node_leaves(tmp_path, reference, layouts, ("a", *stage, "c"), "a", {**{n: 2 for n in stage}, "c": 1}, logged,
                   ["a"])


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_tensor_parallel_stage_hands_its_gathered_shards_over(tmp_path: Path, reference: list[float]) -> None:
    """Stage [3, 6) runs tp 2 on b1 and b2 (each holds half of every block's matrices and their AdamW state): the
    superseded tp ranks gather their shards into whole layers on b1."""
    _a_leaves_and_stage_b_hands_over(tmp_path, reference, (0, 2),
                                     ["tp rank 0 of 2", "tp shards of stage 1 gathered whole"])


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_zero_stage_under_tp_hands_its_gathered_state_over(tmp_path: Path, reference: list[float]) -> None:
    """Stage [3, 6) runs 2 replicas of tp 2 under ZeRO-1 (b1 b2 | b3 b4): each tp rank's replicas gather its
    shards' AdamW state on replica 0, whose tp ranks then gather the shards whole on b1."""
    _a_leaves_and_stage_b_hands_over(tmp_path, reference, (1, 2),
                                     ["ZeRO-1 over its 2 replicas", "ZeRO state of stage 1 gathered whole",
                                      "tp shards of stage 1 gathered whole"], stage=("b1", "b2", "b3", "b4"))


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_zero_stage_hands_its_gathered_state_over(tmp_path: Path, reference: list[float]) -> None:
    """Stage [3, 6) runs ZeRO-1 on b1 and b2 (each holds half its AdamW state): the superseded ZeRO replicas
    gather their state whole on b1."""
    _a_leaves_and_stage_b_hands_over(tmp_path, reference, (1,),
                                     ["ZeRO-1 over its 2 replicas", "ZeRO state of stage 1 gathered whole"])


def _b1_leaves_its_stage(tmp_path: Path, reference: list[float], sharded: tuple, gathered: str) -> None:
    """Stage [3, 6) runs on b1 and b2 with its state spread over them (`sharded`: the layout's ZeRO stage and tp),
    and b1 gets SIGTERM: it finishes the step in flight and leaves; b2, superseded by the plan without b1, meets it
    to gather the stage's state whole on b1 (its log says `gathered`), which serves it until b2 and c, the next
    plan's pair, have taken it. Without the gather, b1's part would leave with it and the stage would go back to
    step 0 (the job writes no checkpoints)."""
    layouts = {frozenset({"a", "b1", "b2", "c"}): [((0, 3), ["a"]), ((3, 6), ["b1", "b2"], *sharded)],
               frozenset({"a", "b2", "c"}): [((0, 3), ["a"]), ((3, 6), ["b2", "c"], *sharded)]}
    _a_node_leaves(tmp_path, reference, layouts, ("a", "b1", "b2", "c"), "b1", {"a": 2, "b2": 2, "c": 1},
                   [gathered, "leaving: the live state was handed over (2 fetches)"], ["b1"])


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_leaving_zero_replica_hands_its_gathered_state_over(tmp_path: Path, reference: list[float]) -> None:
    """b1 is replica 0 of a ZeRO-1 pair (each holds half the stage's AdamW state)."""
    _b1_leaves_its_stage(tmp_path, reference, (1,), "ZeRO state of stage 1 gathered whole")


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_leaving_tp_rank_hands_its_gathered_shards_over(tmp_path: Path, reference: list[float]) -> None:
    """b1 is tp rank 0 of a tp pair (each holds half of every block's matrices); b2 becomes tp rank 0 of the next
    pair, so it also checks that a process whose tp rank changed trains as one process (`forget_meshes`)."""
    _b1_leaves_its_stage(tmp_path, reference, (0, 2), "tp shards of stage 1 gathered whole")


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_plan_told_to_skip_live_state_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    """After plans that failed to fetch the live state they agreed on, the coordinator's next plan resumes from the
    checkpoint (`Plan.live_resume` False, `membership.live_resume`): its nodes hold live state of the step the
    job reached, and leave it, loading the newest checkpoint, and say why."""
    from atoll.coordinator.planning import PlanInputs

    from scripted_cluster import scripted_planner

    layouts = {frozenset({"a", "b1", "b2"}): [((0, 3), ["a"]), ((3, 6), ["b1", "b2"])],
               frozenset({"a", "b1"}): [((0, 3), ["a"]), ((3, 6), ["b1"])]}
    job = _job(3)
    job = replace(job, checkpoint=replace(job.checkpoint, interval=5))
    cluster = ScriptedCluster(job=job, out=tmp_path, layouts=layouts)
    scripted = scripted_planner(job, layouts)

    def planner(inputs: PlanInputs):
        if frozenset(inputs.members) == frozenset({"a", "b1"}):
            inputs = replace(inputs, live_resume=False)  # as after two plans that failed to fetch it
        return scripted(inputs)

    cluster.service.state.planner = planner
    try:
        for n in ("a", "b1", "b2"):
            cluster.start_node(n, region="lab")
        cluster.wait(lambda: cluster.top_step() >= 12, 150, "step 12")
        cluster.kill("b2")
        killed_at = cluster.top_step()
        cluster.wait(lambda: cluster.top_step() >= STEPS - 1, 200, "the job to finish", dead=["b2"])
        later = cluster.plan()
        assert not later.live_resume and set(later.node_addresses) == {"a", "b1"}
        for n in ("a", "b1"):
            step, how, was, back = _after(cluster, n, 2)
            assert how == "checkpoint" and step % 5 == 0 and 10 <= step <= killed_at and back == was - step > 0, \
                cluster.resumes(n)
            assert "could not fetch the live state they agreed on" in cluster.log(n), n
        moved = cluster.transfers("a") + cluster.transfers("b1")
        assert not [t for t in moved if "live state" in t[2]], moved  # (checkpoint copies replicate as ever)
    finally:
        cluster.stop()
