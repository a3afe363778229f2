"""`atoll status`: progress summaries from hand-built step reports, the reply, its table and the watch loop."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
from google.protobuf.json_format import MessageToDict

from atoll.launch.cli import build_parser
from atoll.coordinator import handlers as h
from atoll.coordinator.progress import step_times, summarize, throughput
from atoll.coordinator.state import CoordinatorState
from atoll.coordinator.status import CLEAR_SCREEN, format_status, run_status_cli, status_json, watch
from atoll.coordinator.store import MemoryStore
from atoll.coordinator.outer import GroupInfo
from atoll.job import JobSpec
from atoll.plan import OuterPlan, PipelinePlan, Plan, ReplicaGroup, StagePlan
from atoll.serde import plan_to_proto
from atoll.types import LinkStats, StepMetrics
from atoll.v1 import atoll_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]


def report(node: str, step: int, stage: int, *, epoch: int = 1, pipeline: int = 0, t0: float = 1000.0,
           period: float = 0.5, **kw) -> StepMetrics:
    base = dict(job_id="j", node_id=node, plan_epoch=epoch, step=step, pipeline=pipeline, stage=stage,
                tokens=256, step_seconds=0.4, compute_seconds=0.3, wait_seconds=0.05,
                unix_time=t0 + period * step + (0.01 if node == "c" else 0.0))
    base.update(kw)
    return StepMetrics(**base)


def two_stage_job(steps: int = 5, **kw) -> list[StepMetrics]:
    """Stage 0 on node a (its rows: the whole batch), stage 1 on b and c (half each); b reports the loss."""
    out = []
    for s in range(steps):
        out.append(report("a", s, 0, tokens=512, links=[
            LinkStats(peer="b", direction="forward", bytes_raw=4000, bytes_wire=1000, seconds=0.01, codec="int8",
                      bandwidth_bytes_per_s=1e5 + s),
            LinkStats(peer="c", direction="forward", bytes_raw=4000, bytes_wire=2000, seconds=0.02, codec="fp16",
                      bandwidth_bytes_per_s=2e5)], **kw))
        out.append(report("b", s, 1, loss=5.0 - s, compute_seconds=0.2, wait_seconds=0.15, links=[
            LinkStats(peer="a", direction="backward", bytes_raw=4000, bytes_wire=4000, seconds=0.04)], **kw))
        out.append(report("c", s, 1, compute_seconds=0.2, wait_seconds=0.15, **kw))
    return out


def test_summary_of_a_two_stage_job() -> None:
    p = summarize(two_stage_job(), epoch=1)
    assert (p.step, p.loss, p.loss_step) == (4, 1.0, 4)
    # step 0 has no step before it: its longest step time; the others the 0.5 s between reports
    assert step_times(two_stage_job()) == pytest.approx({0: 0.4, 1: 0.5, 2: 0.5, 3: 0.5, 4: 0.5})
    assert p.measured_step_seconds == pytest.approx(0.5) and p.measured_steps == 5
    # both last-stage replicas' rows count: 512 tokens a step
    assert p.tokens_per_second == pytest.approx(5 * 512 / (0.4 + 4 * 0.5))
    assert [(u.pipeline, u.stage, u.node_id, u.steps) for u in p.stages] == [(0, 0, "a", 5), (0, 1, "b", 5),
                                                                            (0, 1, "c", 5)]
    a, b = p.stages[0], p.stages[1]
    assert (a.step_seconds, a.compute_seconds, a.wait_seconds) == pytest.approx((0.4, 0.3, 0.05))
    assert a.utilisation == pytest.approx(0.75) and b.utilisation == pytest.approx(0.5)
    assert [(x.src, x.dst, x.direction, x.codec) for x in p.links] == [
        ("a", "b", "forward", "int8"), ("a", "c", "forward", "fp16"), ("b", "a", "backward", "identity")]
    ab = p.links[0]
    assert (ab.steps, ab.bytes_raw, ab.bytes_wire, ab.seconds) == pytest.approx((5, 4000, 1000, 0.01))
    assert ab.achieved_bytes_per_s == pytest.approx(1e5)
    assert ab.estimate_bytes_per_s == 1e5 + 4  # the latest step's estimate


def test_wall_time_counts_what_step_seconds_leave_out() -> None:
    # nodes spend 0.4 s in the step but report every 1.0 s (all-reduce, optimizer, checkpoints)
    p = summarize(two_stage_job(period=1.0), epoch=1)
    assert p.measured_step_seconds == pytest.approx(1.0)
    # a slow step (a checkpoint) does not move the median
    reports = two_stage_job(6)
    for r in reports:
        if r.step == 5:
            r.unix_time += 3.0
    assert summarize(reports, epoch=1).measured_step_seconds == pytest.approx(0.5)


def test_a_step_half_reported_does_not_look_slow() -> None:
    reports = two_stage_job(4) + [report("a", 4, 0, tokens=512), report("b", 4, 1, loss=0.5)]  # c not yet
    p = summarize(reports, epoch=1)
    assert p.step == 4 and p.loss == 0.5
    assert p.tokens_per_second == pytest.approx(4 * 512 / (0.4 + 3 * 0.5))
    assert throughput(reports, epoch=1, window=2) == (4, pytest.approx(1024.0))


def test_only_the_current_epoch_and_window_are_summarised() -> None:
    old = two_stage_job(3, epoch=1, t0=0.0)
    new = [report("a", s, 0, epoch=2, t0=2000.0, step_seconds=0.2, compute_seconds=0.1) for s in range(3, 20)]
    p = summarize(old + new, epoch=2, window=4)
    # one stage: its own reports are the last stage's; only the last 4 steps are summarised
    assert [(u.node_id, u.steps) for u in p.stages] == [("a", 4)] and p.links == []
    assert p.measured_step_seconds == pytest.approx(0.5) and p.measured_steps == 4
    assert p.tokens_per_second == pytest.approx(256 / 0.5)
    assert (p.step, p.loss, p.loss_step) == (19, 3.0, 2)  # the latest loss, though from the old epoch
    empty = summarize([], epoch=0)
    assert (empty.step, empty.loss, empty.tokens_per_second, empty.measured_step_seconds) == (0, None, 0.0, 0.0)


def test_each_pipeline_is_summarised_over_its_own_last_steps() -> None:
    """Outer mode: replica groups step at their own pace. The group that fell behind (pipeline 1, at step 9 while
    pipeline 0 is at 30) keeps its stages and links in the summary, over its own last steps."""
    ahead = [report("a", s, 0, pipeline=0, period=0.2) for s in range(31)]
    behind = [report("b", s, 0, pipeline=1, period=0.7, step_seconds=0.7, compute_seconds=0.6,
                     links=[LinkStats(peer="x", direction="forward", bytes_raw=10, bytes_wire=10, seconds=0.1)])
              for s in range(10)]
    p = summarize(sorted(ahead + behind, key=lambda r: r.unix_time), epoch=1, window=4)
    assert [(u.pipeline, u.node_id, u.steps) for u in p.stages] == [(0, "a", 4), (1, "b", 4)]
    assert p.stages[1].compute_seconds == pytest.approx(0.6)
    assert [(x.src, x.pipeline, x.steps) for x in p.links] == [("b", 1, 4)]
    # each pipeline's tokens over its own steps' times: 256 every 0.2 s and 256 every 0.7 s
    assert p.tokens_per_second == pytest.approx(256 / 0.2 + 256 / 0.7)


def test_handle_status_carries_the_summary() -> None:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    state = CoordinatorState(store=MemoryStore(), job=job, token="t", clock=lambda: 1000.0)
    for r in two_stage_job(epoch=0):
        state.store.add_step(r)
    s = h.handle_status(pb.StatusRequest(), state)
    assert s.step == 4 and s.has_loss and s.loss == 1.0 and s.loss_step == 4
    assert s.measured_step_seconds == pytest.approx(0.5) and s.measured_steps == 5
    assert [(u.node_id, u.stage) for u in s.stage_usage] == [("a", 0), ("b", 1), ("c", 1)]
    assert s.stage_usage[0].utilisation == pytest.approx(0.75)
    x = s.link_usage[0]
    assert (x.src, x.dst, x.direction, x.codec) == ("a", "b", pb.DIRECTION_FORWARD, pb.CODEC_INT8_BLOCK)
    assert x.achieved_bytes_per_s == pytest.approx(1e5)
    assert not s.group_usage  # no outer-mode plan


def outer_plan() -> Plan:
    """Three replica groups: lab-a (node a), lab-b (nodes b and c, one pipeline of two stages), lab-c (node d)."""
    def stage(node: str, layers: tuple[int, int] = (0, 4)) -> StagePlan:
        return StagePlan(island=f"i-{node}", layers=layers, nodes=[node])

    return Plan(model="tiny", global_batch=8, seq_len=64, epoch=1, mode="outer", pipelines=[
        PipelinePlan(micro_batch=2, num_micro_batches=4, stages=[stage("a")]),
        PipelinePlan(micro_batch=2, num_micro_batches=4, stages=[stage("b", layers=(0, 2)), stage("c", layers=(2, 4))]),
        PipelinePlan(micro_batch=2, num_micro_batches=4, stages=[stage("d")])],
        groups=[ReplicaGroup(name="lab-a", pipelines=[0], inner_steps=50),
                ReplicaGroup(name="lab-b", pipelines=[1], inner_steps=40),
                ReplicaGroup(name="lab-c", pipelines=[2], inner_steps=50)],
        outer=OuterPlan(inner_steps=50, codec="int4", lr=0.7, momentum=0.9, nesterov=True, overlap=True,
                        deadline_s=30.0, sync_s=11.2, round_s=14.0, bytes_per_round=1 << 30))


def test_handle_status_carries_the_groups_in_outer_mode() -> None:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    state = CoordinatorState(store=MemoryStore(), job=job, token="t", clock=lambda: 1000.0)
    plan = outer_plan()
    state.publish(plan, "test")
    # before any round every planned group is there, at zero
    s = h.handle_status(pb.StatusRequest(), state)
    assert [(g.group, g.name, g.round, g.rounds_in, g.sync_bytes) for g in s.group_usage] == [
        (0, "lab-a", 0, 0, 0.0), (1, "lab-b", 0, 0, 0.0), (2, "lab-c", 0, 0, 0.0)]
    groups = [GroupInfo(index=i, name=g.name, since_epoch=1,
                        nodes=frozenset(n for k in g.pipelines for st in plan.pipelines[k].stages for n in st.nodes))
              for i, g in enumerate(plan.groups)]

    def arrive(now: float, round_: int, node: str, group: int, step: int, sync: tuple[int, float, float]) -> None:
        state.outer.arrive(now, round_=round_, node=node, group=group, tokens=1000 * (group + 1), inner_step=step,
                           groups=groups, deadline_s=30.0,
                           stats={"bytes": sync[0], "seconds": sync[1], "late": sync[2]})

    # round 0: lab-a and lab-b arrive, lab-c never does and is left out at the deadline; round 1: only lab-a
    arrive(0.0, 0, "a", 0, 50, (1000, 2.0, 0.5))
    arrive(1.0, 0, "b", 1, 40, (600, 3.0, 0.1))
    arrive(2.0, 0, "c", 1, 40, (400, 1.0, 0.7))
    state.outer.arrive(31.0, round_=0, node="", group=0, tokens=0, inner_step=0, groups=groups, deadline_s=30.0)
    arrive(40.0, 1, "a", 0, 100, (1100, 2.5, 0.0))
    state.outer.arrive(71.0, round_=1, node="", group=0, tokens=0, inner_step=0, groups=groups, deadline_s=30.0)
    s = h.handle_status(pb.StatusRequest(), state)
    a, b, c = s.group_usage
    assert (a.name, a.inner_step, a.tokens, a.round, a.rounds_in, a.rounds_missed) == ("lab-a", 100, 2000, 1, 2, 0)
    assert (a.sync_bytes, a.sync_seconds, a.late_seconds) == (1100.0, 2.5, 0.0)  # the newest exchange
    assert (b.name, b.inner_step, b.tokens, b.round, b.rounds_in, b.rounds_missed) == ("lab-b", 40, 2000, 0, 1, 1)
    # bytes summed over the group's nodes; seconds of its slowest node
    assert (b.sync_bytes, b.sync_seconds, b.late_seconds) == (1000.0, 3.0, 0.7)
    assert (c.name, c.tokens, c.rounds_in, c.rounds_missed, c.sync_bytes) == ("lab-c", 0, 0, 2, 0.0)


def test_status_rows_stay_with_their_group_after_a_replan_reorders_the_groups() -> None:
    """Rows are kept by the group's name: a replan that lists the groups in another order (a kept group first) must
    not give a row another group's figures. Each row shows its inner steps and seconds waited per round and its
    share of the tokens, and the inner steps a round the newest decision gives it from its live step time."""
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    state = CoordinatorState(store=MemoryStore(), job=job, token="t", clock=lambda: 1000.0)
    first = outer_plan()  # lab-a (a), lab-b (b, c), lab-c (d): 512 tokens a step
    state.publish(first, "test")

    def infos(plan: Plan) -> list[GroupInfo]:
        return [GroupInfo(index=i, name=g.name, since_epoch=1, nodes=frozenset(
                    n for k in g.pipelines for st in plan.pipelines[k].stages for n in st.nodes))
                for i, g in enumerate(plan.groups)]

    pace = {"lab-a": 0.1, "lab-b": 0.25, "lab-c": 0.5}  # seconds an inner step

    def round_(plan: Plan, r: int, now: float, figures: dict[str, tuple[int, float]]) -> None:
        """Every group arrives at round r: {name: (inner steps it trained, seconds it waited on the exchange)}."""
        groups = infos(plan)
        for g in groups:
            steps, late = figures[g.name]
            for n in sorted(g.nodes):
                state.outer.arrive(now, round_=r, node=n, group=g.index, tokens=512 * steps, inner_step=10 * (r + 1),
                                   groups=groups, deadline_s=30.0, stats={"bytes": 100, "seconds": 1.0, "late": late},
                                   h=6, step_seconds=pace[g.name], round_steps=steps)

    round_(first, 0, 0.0, {"lab-a": (6, 0.0), "lab-b": (3, 0.0), "lab-c": (1, 0.0)})
    round_(first, 1, 10.0, {"lab-a": (6, 4.0), "lab-b": (3, 2.0), "lab-c": (1, 0.5)})
    # the replan lists lab-c first, then lab-a and lab-b (their pipelines in that order)
    second = outer_plan()
    second.epoch = 2
    second.pipelines = [second.pipelines[2], second.pipelines[0], second.pipelines[1]]
    second.groups = [replace(second.groups[2], pipelines=[0]), replace(second.groups[0], pipelines=[1]),
                     replace(second.groups[1], pipelines=[2])]
    second.validate(4)
    state.publish(second, "test")
    round_(second, 2, 20.0, {"lab-a": (6, 2.0), "lab-b": (3, 1.0), "lab-c": (1, 1.5)})
    s = h.handle_status(pb.StatusRequest(), state)
    rows = {g.name: g for g in s.group_usage}
    assert [(g.group, g.name) for g in s.group_usage] == [(0, "lab-c"), (1, "lab-a"), (2, "lab-b")]
    a, b, c = rows["lab-a"], rows["lab-b"], rows["lab-c"]
    assert (a.tokens, b.tokens, c.tokens) == (3 * 6 * 512, 3 * 3 * 512, 3 * 512)
    assert all(g.planned and g.rounds_in == 3 and g.round == 2 for g in (a, b, c))
    assert (a.steps_per_round, b.steps_per_round, c.steps_per_round) == (6.0, 3.0, 1.0)
    assert (a.token_share, b.token_share, c.token_share) == pytest.approx((0.6, 0.3, 0.1))
    # waits reported at rounds 1 and 2 (round 0 follows no exchange)
    assert (a.wait_seconds_per_round, b.wait_seconds_per_round, c.wait_seconds_per_round) == pytest.approx(
        (3.0, 1.5, 1.0))
    text = format_status(s, now=0.0)
    lines = text.splitlines()
    header = next(line for line in lines if line.split()[:2] == ["GROUP", "NAME"])
    row = next(line.split() for line in lines[lines.index(header):] if line.split()[1:2] == ["lab-a"])
    assert row[:10] == ["1", "lab-a", "30", "6.0", "6", "100", "ms", "3.00", "s", "60%"]
    # rounds of 6 x 0.1 s: lab-b trains 2 steps of 0.25 s, lab-c 1 of 0.5 s
    assert (a.assigned_steps, b.assigned_steps, c.assigned_steps) == (6, 2, 1)
    assert (a.step_seconds, b.step_seconds, c.step_seconds) == pytest.approx((0.1, 0.25, 0.5))
    assert "a target of 600 ms a round" in text


def status_reply() -> pb.StatusReply:
    s = pb.StatusReply(
        job=pb.JobInfo(job_id="j1", name="tiny", run_id="r9"), step=4, tokens_per_second=1067.0, has_loss=True, loss=1.0,
        loss_step=4, measured_step_seconds=0.5, measured_steps=5,
        stage_usage=[pb.StageUsage(node_id="a", pipeline=0, stage=0, steps=5, step_seconds=0.4,
                                   compute_seconds=0.3, wait_seconds=0.05, utilisation=0.75)],
        link_usage=[pb.LinkUsage(src="a", dst="b", direction=pb.DIRECTION_FORWARD, steps=5,
                                 codec=pb.CODEC_INT8_BLOCK, bytes_raw=4 << 20, bytes_wire=33792, seconds=0.01,
                                 achieved_bytes_per_s=1048576e2, estimate_bytes_per_s=9e7)])
    s.plan.epoch = 1
    s.plan.predicted.step_time_seconds = 0.4
    # a's stage: 0.1 s per micro-batch predicted, 2 micro-batches a step
    s.plan.pipelines.append(pb.Pipeline(index=0, micro_batch=4, num_micro_batches=2, stages=[
        pb.Stage(index=0, island="x", node_ids=["a"], layer_start=0, layer_end=6, dp=1, tp=1, compute_seconds=0.1)]))
    return s


def test_the_table_shows_progress_stages_and_links() -> None:
    text = format_status(status_reply(), now=0.0)
    assert text.startswith("job tiny (j1, run r9)   plan epoch 1")
    assert "step 4   loss 1.0000 (step 4)   1,067 tokens/s" in text
    assert "measured 500 ms (median of 5 steps), predicted 400 ms; measured / predicted 1.25" in text
    stage = next(line for line in text.splitlines() if line.split()[:3] == ["0", "0", "a"])
    assert stage.split()[-1] == "75%" and "300 ms" in stage and "50 ms" in stage
    # 300 ms of compute a step against the plan's 2 x 100 ms
    assert "1.50x" in stage.split() and "compute: measured / predicted 1.50 per node" in text
    link = next(line for line in text.splitlines() if " forward " in line)
    assert "int8_block" in link and "4.0 MiB" in link and "33.0 KiB" in link and "124.12x" in link
    assert "104.86 MB/s" in link and "90.00 MB/s" in link
    data = json.loads(status_json(status_reply()))
    assert data["stage_usage"][0]["utilisation"] == 0.75 and data["link_usage"][0]["codec"] == "CODEC_INT8_BLOCK"
    assert data["measured_step_seconds"] == 0.5
    bare = format_status(pb.StatusReply(job=pb.JobInfo(name="tiny")))
    assert "step time: measured -, predicted -" in bare and "no plan yet" in bare and "last checkpoint -" in bare
    # a checkpoint by its folder (what `atoll export --step` takes) and the step it follows (as the logs number it)
    assert "last checkpoint step-00000100 (after step 99)" in format_status(
        pb.StatusReply(job=pb.JobInfo(name="tiny"), last_checkpoint_step=100))
    # across regions: why the plan is synchronous, and each member's and island's region
    r = status_reply()
    r.plan.mode_reason = "sync: replica groups per region would give 1.02x the synchronous plan's tokens/s"
    r.members.add(node_id="a", state="alive", profile=pb.NodeProfile(region="lab-b", device_kind="cpu"))
    r.islands.add(id="cpu0", group="lab-b", device_name="EPYC", gpus=1)
    regions = format_status(r, now=0.0)
    assert "  sync: replica groups per region would give 1.02x" in regions
    assert [line.split()[2] for line in regions.splitlines() if line.startswith("  a ")] == ["lab-b"]
    assert [line.split()[1] for line in regions.splitlines() if line.startswith("  cpu0 ")] == ["lab-b"]
    assert "outer mode" not in text and "replica group" not in text and data["group_usage"] == []
    # for scripts: 64-bit integers are numbers, and zeros are written (a stage's pipeline 0, layer_start 0)
    assert isinstance(data["plan"]["epoch"], int) and data["stage_usage"][0]["pipeline"] == 0
    assert all("layer_start" in st for p in data["plan"]["pipelines"] for st in p["stages"])


def outer_status_reply() -> pb.StatusReply:
    s = status_reply()
    s.plan.CopyFrom(plan_to_proto(outer_plan()))
    s.group_usage.add(group=0, name="lab-a", inner_step=100, tokens=2_048_000, round=1, rounds_in=2, rounds_missed=0,
                      sync_bytes=float(3 << 29), sync_seconds=12.5, late_seconds=0.25, steps_per_round=50.0,
                      wait_seconds_per_round=0.5, token_share=2 / 3, planned=True, step_seconds=0.28, assigned_steps=50,
                      round_target_seconds=14.0)
    s.group_usage.add(group=1, name="lab-b", inner_step=80, tokens=1_024_000, round=1, rounds_in=1, rounds_missed=1,
                      sync_bytes=float(3 << 29), sync_seconds=13.0, late_seconds=4.0, steps_per_round=40.0,
                      wait_seconds_per_round=4.0, token_share=1 / 3, planned=True, step_seconds=0.35, assigned_steps=40,
                      round_target_seconds=14.0)
    s.group_usage.add(group=2, name="lab-c", planned=True)
    s.group_usage.add(name="lab-d", inner_step=20, rounds_missed=2)  # no longer planned
    return s


def test_the_table_shows_outer_mode_and_its_groups() -> None:
    text = format_status(outer_status_reply(), now=0.0)
    # the headline's step is each group's, not the newest report's (the fastest group's)
    assert "step 80-100 (slowest-fastest of 2 groups training)" in text.splitlines()[0]
    assert ("outer mode: 3 replica groups, H=50, int4 pseudo-gradients, lr 0.7 momentum 0.9 nesterov, overlapped, "
            "deadline 30 s; predicted sync 11.20 s per round vs 14.00 s of compute") in text
    lines = text.splitlines()
    header = next(line for line in lines if line.split()[:2] == ["GROUP", "NAME"])
    assert header.split() == ["GROUP", "NAME", "INNER-STEP", "STEPS/ROUND", "NEXT", "STEP-S", "WAIT/ROUND", "SHARE",
                              "TOKENS", "ROUND", "IN/MISSED", "SYNC-BYTES", "SYNC-S", "LATE-S"]
    rows = [line.split() for line in lines[lines.index(header) + 1:lines.index(header) + 5]]
    assert rows[0] == ["0", "lab-a", "100", "50.0", "50", "280", "ms", "500", "ms", "67%", "2,048,000", "1", "2/0",
                       "1.5", "GiB", "12.50", "s", "250", "ms"]
    assert rows[1][:12] == ["1", "lab-b", "80", "40.0", "40", "350", "ms", "4.00", "s", "33%", "1,024,000", "1"]
    assert rows[1][-2:] == ["4.00", "s"]
    assert rows[2] == ["2", "lab-c", "0", "-", "-", "-", "-", "-", "0", "0", "0/0", "-", "-", "-"]
    assert rows[3] == ["-", "lab-d", "20", "-", "-", "-", "-", "-", "0", "0", "0/2", "-", "-", "-"]
    assert "a target of 14.00 s a round" in text
    assert "pipeline 1: micro-batch 2 x 4, replica group lab-b" in text
    data = json.loads(status_json(outer_status_reply()))
    assert data["plan"]["mode"] == "outer"
    assert [(g["name"], g["rounds_missed"]) for g in data["group_usage"]] == [("lab-a", 0), ("lab-b", 1), ("lab-c", 0),
                                                                             ("lab-d", 2)]
    assert data["group_usage"][0]["sync_seconds"] == 12.5
    blocking = outer_status_reply()
    blocking.plan.outer.overlap = False
    blocking.plan.outer.momentum = 0.0
    blocking.plan.outer.codec = pb.CODEC_TOPK
    blocking.plan.outer.codec_params.topk_fraction = 0.02
    assert "topk 0.02 pseudo-gradients, lr 0.7, blocking, deadline 30 s" in format_status(blocking)


class Stop(Exception):
    pass


def run_watch(replies: list, *, clear: bool, json_lines: bool = False) -> tuple[str, list[float]]:
    out, slept = io.StringIO(), []
    answers = iter(replies)

    def fetch() -> pb.StatusReply:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == len(replies):
            raise Stop

    with pytest.raises(Stop):
        if json_lines:
            watch(fetch, lambda s: status_json(s, indent=None), interval=3.0, out=out, clear=clear, sleep=sleep,
                  unanswered=lambda why: json.dumps({"error": why}))
        else:
            watch(fetch, format_status, interval=3.0, out=out, clear=clear, sleep=sleep)
    return out.getvalue(), slept


def test_watch_redraws_on_a_terminal_and_appends_otherwise() -> None:
    text, slept = run_watch([status_reply(), ConnectionError("coordinator gone"), status_reply()], clear=True)
    assert text.count(CLEAR_SCREEN) == 3 and text.count("job tiny") == 2 and "no answer: coordinator gone" in text
    assert len(slept) == 3 and all(0 < s <= 3.0 for s in slept)
    text, _ = run_watch([status_reply(), status_reply()], clear=False)
    assert CLEAR_SCREEN not in text and "\x1b" not in text and text.count("job tiny") == 2
    text, _ = run_watch([status_reply(), ConnectionError("gone"), status_reply()], clear=False, json_lines=True)
    assert [json.loads(line).get("step") for line in text.splitlines()] == [4, None, 4]
    assert json.loads(text.splitlines()[1]) == {"error": "gone"}


def test_watch_option() -> None:
    parse = build_parser().parse_args
    assert parse(["status", "--coordinator", "h:1"]).watch is None
    assert parse(["status", "--watch", "--coordinator", "h:1"]).watch == 2.0
    assert parse(["status", "--coordinator", "h:1", "--watch", "0.5", "--json"]).watch == 0.5
    with pytest.raises(ValueError, match="positive number of seconds"):
        run_status_cli(parse(["status", "--coordinator", "h:1", "--token", "t", "--watch", "0"]))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_json_without_a_coordinator_is_json_on_stdout(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from atoll.launch.cli import main

    address = f"127.0.0.1:{_free_port()}"  # nothing listens there
    monkeypatch.setenv("ATOLL_TOKEN", "t")
    assert main(["status", "--coordinator", address, "--insecure", "--json", "--timeout", "0.5"]) == 2
    out, err = capsys.readouterr()
    assert "nothing listens there" in json.loads(out)["error"] and err == ""
    assert main(["status", "--coordinator", address, "--json"]) == 2  # no job CA to verify it with
    out, err = capsys.readouterr()
    assert "--tls-ca" in json.loads(out)["error"] and err == ""
    assert main(["status", "--coordinator", address, "--token-file", "/nonexistent/token", "--json"]) == 2
    out, err = capsys.readouterr()
    assert "runs/coordinator/token" in json.loads(out)["error"] and err == ""
    assert main(["status", "--coordinator", address, "--token-file", str(Path(__file__).parent), "--json"]) == 2
    out, err = capsys.readouterr()
    assert "is a folder" in json.loads(out)["error"] and err == ""  # an OSError of any kind, as JSON too
    assert main(["status", "--coordinator", address, "--token", "t", "--json", "--watch", "0"]) == 2
    assert "positive number of seconds" in json.loads(capsys.readouterr().out)["error"]


def _keys(d: object) -> set[str]:
    if isinstance(d, dict):
        return set(d) | {k for v in d.values() for k in _keys(v)}
    if isinstance(d, list):
        return {k for v in d for k in _keys(v)}
    return set()


def test_table_headers_are_the_json_field_names() -> None:
    s = status_reply()
    s.members.add(node_id="a", peer_address="127.0.0.1:7171", state="alive", last_heartbeat_unix=1.0,
                  profile=pb.NodeProfile(device_kind="cpu", device_count=1, device_name="EPYC",
                                         memory_total_bytes=1 << 30))
    s.islands.add(id="cpu0", device_name="EPYC", node_ids=["a"], gpus=1, inner_bandwidth_bytes_per_s=1e9,
                  outer_bandwidth_bytes_per_s=0.0)
    del s.plan.pipelines[:]  # one pipeline of one stage
    stage = s.plan.pipelines.add(index=0, micro_batch=2, num_micro_batches=2).stages.add(
        index=0, island="cpu0", layer_start=0, layer_end=6, dp=1, node_ids=["a"], dp_rendezvous="tcp://h:1")
    assert stage.island == "cpu0"
    text = format_status(s, now=2.0)
    # every field of the schema, zeros included (the JSON leaves out fields at their zero value)
    keys = _keys(MessageToDict(s, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))
    derived = {"RATIO", "OTHER-S", "COMPUTE-VS-PLAN", "LAYERS", "PLANNED-CODEC", "DEVICES", "PROFILE"}  # format_status says
    headers = [line.split() for line in text.splitlines() if line.strip().split()[:1] and line.strip().isupper()]
    assert len(headers) == 5  # stages, links, members, islands, the plan's stages
    for header in (x for row in headers for x in row if x not in derived):
        name = header.lower().replace("-", "_")
        candidates = {name, name.removesuffix("_s") + "_seconds", name + "_bytes_per_s", name + "_bytes",
                      name + "_unix"}
        assert candidates & keys, f"header {header} names no JSON field"
    assert "GPUS" not in text and "DEVICES" in text


def test_status_says_what_the_coordinator_waits_for_before_its_first_plan() -> None:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    assert job.cluster.expected_nodes == 3
    state = CoordinatorState(store=MemoryStore(), job=job, token="t", clock=lambda: 1000.0)
    for host in ("a", "b"):
        h.handle_join(pb.JoinRequest(token="t", profile=pb.NodeProfile(
            hostname=host, device_kind="cpu", device_name="x", device_count=1, memory_total_bytes=1 << 30,
            cpu_count=1), peer_address=""), state)
    state.tick()
    reply = h.handle_status(pb.StatusRequest(), state)
    assert "waiting for nodes: 2 of 3 joined" in reply.waiting and "cluster.expected_nodes" in reply.waiting
    assert "no plan yet: waiting for nodes: 2 of 3" in format_status(reply)
    assert json.loads(status_json(reply))["waiting"] == reply.waiting


def test_durations_keep_three_digits_in_the_unit_that_shows_them() -> None:
    from atoll.units import duration

    assert [duration(x) for x in (0.0, 4.2e-4, 0.0123, 0.5, 4.2, 1234.0)] == \
        ["0 s", "420 µs", "12.3 ms", "500 ms", "4.20 s", "1,234 s"]
    from atoll.units import counted

    assert (counted(1, "node"), counted(3, "node"), counted(1, "micro-batch", "micro-batches")) == \
        ("1 node", "3 nodes", "1 micro-batch")


def test_the_plan_line_says_live_state_resumes_past_the_checkpoint() -> None:
    """After a graceful leave the plan's resume step is the newest checkpoint (400), but the nodes that hold live
    state go on from where the job had reached (409): the line says both, not "resume at step 400" alone."""
    s = status_reply()
    s.plan.resume_step, s.plan.reached_step = 400, 409
    text = format_status(s, now=0.0)
    assert "resume at step 409 from live state where the nodes hold it, else at step 400" in text
    s.plan.reached_step = 400  # nothing trained past the checkpoint
    assert "resume at step 400;" in format_status(s, now=0.0)
