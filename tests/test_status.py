"""`atoll status`: progress summaries from hand-built step reports, the reply, its table and the watch loop."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from atoll.launch.cli import build_parser
from atoll.coordinator import handlers as h
from atoll.coordinator.progress import step_times, summarize, throughput
from atoll.coordinator.state import CoordinatorState
from atoll.coordinator.status import CLEAR_SCREEN, format_status, run_status_cli, status_json, watch
from atoll.coordinator.store import MemoryStore
from atoll.job import JobSpec
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


def status_reply() -> pb.StatusReply:
    s = pb.StatusReply(
        job=pb.JobInfo(job_id="j1", name="tiny"), step=4, tokens_per_second=1067.0, has_loss=True, loss=1.0,
        loss_step=4, measured_step_seconds=0.5, measured_steps=5,
        stage_usage=[pb.StageUsage(node_id="a", pipeline=0, stage=0, steps=5, step_seconds=0.4,
                                   compute_seconds=0.3, wait_seconds=0.05, utilisation=0.75)],
        link_usage=[pb.LinkUsage(src="a", dst="b", direction=pb.DIRECTION_FORWARD, steps=5,
                                 codec=pb.CODEC_INT8_BLOCK, bytes_raw=4 << 20, bytes_wire=33792, seconds=0.01,
                                 achieved_bytes_per_s=1048576e2, estimate_bytes_per_s=9e7)])
    s.plan.epoch = 1
    s.plan.predicted.step_time_seconds = 0.4
    return s


def test_the_table_shows_progress_stages_and_links() -> None:
    text = format_status(status_reply(), now=0.0)
    assert "step 4   loss 1.0000 (step 4)   1,067 tokens/s" in text
    assert "measured 500.0 ms (median of 5 steps), predicted 400.0 ms; measured / predicted 1.25" in text
    stage = next(line for line in text.splitlines() if line.split()[:3] == ["0", "0", "a"])
    assert stage.split()[-1] == "75%" and "300.0 ms" in stage and "50.0 ms" in stage
    link = next(line for line in text.splitlines() if " forward " in line)
    assert "int8_block" in link and "4.0 MiB" in link and "33.0 KiB" in link and "124.12x" in link
    assert "104.86 MB/s" in link and "90.00 MB/s" in link
    data = json.loads(status_json(status_reply()))
    assert data["stage_usage"][0]["utilisation"] == 0.75 and data["link_usage"][0]["codec"] == "CODEC_INT8_BLOCK"
    assert data["measured_step_seconds"] == 0.5
    bare = format_status(pb.StatusReply(job=pb.JobInfo(name="tiny")))
    assert "step time: measured -, predicted -" in bare and "no plan yet" in bare


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
    assert [json.loads(line).get("step") for line in text.splitlines()] == ["4", None, "4"]
    assert json.loads(text.splitlines()[1]) == {"error": "gone"}


def test_watch_option() -> None:
    parse = build_parser().parse_args
    assert parse(["status", "--coordinator", "h:1"]).watch is None
    assert parse(["status", "--watch", "--coordinator", "h:1"]).watch == 2.0
    assert parse(["status", "--coordinator", "h:1", "--watch", "0.5", "--json"]).watch == 0.5
    with pytest.raises(ValueError, match="positive number of seconds"):
        run_status_cli(parse(["status", "--coordinator", "h:1", "--token", "t", "--watch", "0"]))
