"""The whole job's loss history: bounded in the store, never truncated; shown by `atoll status` (a sparkline,
--plot) and the metrics endpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from atoll.coordinator import handlers as h
from atoll.coordinator.history import (KEEP_FULL, MAX_BUCKETS, Sample, add_sample, compact, downsample,
                                       from_proto, resolution, sample_of, sparkline, to_proto)
from atoll.coordinator.metrics import CoordinatorMetrics
from atoll.coordinator.state import CoordinatorState
from atoll.coordinator.status import format_status, history_lines, plot_history, status_json
from atoll.coordinator.store import MemoryStore, SqliteStore, Store
from atoll.job import JobSpec
from atoll.types import StepMetrics
from atoll.v1 import atoll_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent


def loss_of(step: int) -> float:
    return 5.0 / (1.0 + step / 500) + 0.01 * math.sin(step)


@pytest.fixture(params=["memory", "sqlite"])
def store(request, tmp_path) -> Store:
    s: Store = MemoryStore() if request.param == "memory" else SqliteStore(tmp_path / "state.db")
    yield s
    s.close()


@pytest.mark.timeout(60)
def test_ten_thousand_steps_are_kept_whole_in_bounded_rows(store: Store):
    store.history_keep_full, store.history_max_buckets = 500, 100
    steps = 10_000
    for k in range(steps):
        store.add_history(Sample(step=k, epoch=1, loss=loss_of(k), tokens_per_second=1000.0 + k,
                                 val_loss=loss_of(k) + 0.1 if k % 1000 == 999 else None))
    rows = store.history()
    assert len(rows) <= 500 + 500 // 4 + 100 + 1, f"{len(rows)} rows"
    # the first and the last steps are there, nothing in between is lost: every report is counted once
    assert rows[0].first == 0 and rows[-1].first == steps - 1 and rows[-1].width == 1
    assert sum(r.count for r in rows) == steps
    assert sum(r.loss_sum for r in rows) == pytest.approx(sum(loss_of(k) for k in range(steps)), rel=1e-9)
    assert min(r.loss_min for r in rows) == pytest.approx(min(loss_of(k) for k in range(steps)))
    assert max(r.loss_max for r in rows) == pytest.approx(max(loss_of(k) for k in range(steps)))
    assert sum(r.val_count for r in rows) == 10
    # rows tile the steps without overlapping; the newest 500 are one row per step
    for a, b in zip(rows, rows[1:]):
        assert a.first + a.width <= b.first
    assert [r.first for r in rows[-500:]] == list(range(steps - 500, steps))
    text = resolution(rows)
    assert "buckets of" in text and f"-{steps - 1} every step" in text
    # the latest rows alone, for the metrics endpoint
    assert [r.first for r in store.history(newest=3)] == [steps - 3, steps - 2, steps - 1]


def test_the_store_keeps_the_history_across_a_restart(tmp_path):
    s = SqliteStore(tmp_path / "state.db")
    for k in range(5):
        s.add_history(Sample(step=k, epoch=1, loss=float(k)))
    s.close()
    again = SqliteStore(tmp_path / "state.db")
    assert [r.loss for r in again.history()] == [0.0, 1.0, 2.0, 3.0, 4.0]
    again.close()


def test_a_step_trained_again_under_a_newer_plan_replaces_the_old_report(store: Store):
    store.add_history(Sample(step=7, epoch=1, loss=3.0))
    store.add_history(Sample(step=7, epoch=1, loss=5.0))  # another replica group's report of the step
    assert store.history()[0].loss == 4.0 and store.history()[0].count == 2
    store.add_history(Sample(step=7, epoch=2, loss=2.5))  # rolled back to a checkpoint and trained again
    assert store.history()[0].loss == 2.5 and store.history()[0].count == 1
    store.add_history(Sample(step=7, epoch=2, val_loss=2.7))
    (row,) = store.history()
    assert (row.loss, row.val_loss) == (2.5, 2.7)


def test_compact_with_the_defaults_bounds_a_long_job():
    rows = [add_sample(None, Sample(step=k, epoch=1, loss=1.0)) for k in range(50_000)]
    kept = compact(rows)
    assert len(kept) <= KEEP_FULL + MAX_BUCKETS + 1
    assert kept[0].first == 0 and kept[-1].first == 49_999 and sum(r.count for r in kept) == 50_000
    assert compact(kept) == kept  # stable


def test_samples_come_from_reports_with_a_loss_or_a_validation_loss():
    m = StepMetrics(job_id="j", node_id="a", plan_epoch=2, step=9, loss=2.0, step_seconds=0.5)
    s = sample_of(m, tokens_per_step=1024)
    assert s == Sample(step=9, epoch=2, loss=2.0, tokens_per_second=2048.0, val_loss=None)
    assert sample_of(StepMetrics(job_id="j", node_id="b", plan_epoch=2, step=9), 1024) is None
    v = sample_of(StepMetrics(job_id="j", node_id="a", plan_epoch=2, step=9, val_loss=2.2), 1024)
    assert v is not None and v.val_loss == 2.2 and v.loss is None


def test_sparkline_and_downsampling():
    assert sparkline([1.0, 2.0, 3.0, 4.0]) == "▁▃▆█"
    assert sparkline([2.0, 2.0]) == "▁▁"
    assert sparkline([1.0, None, 3.0]) == "▁ █"
    assert len(sparkline([float(k) for k in range(1000)], width=40)) == 40
    rows = [add_sample(None, Sample(step=k, epoch=1, loss=float(k))) for k in range(100)]
    few = downsample(rows, 10)
    assert len(few) == 10 and few[0].first == 0 and few[-1].first + few[-1].width == 100
    assert few[0].loss_min == 0.0 and few[-1].loss_max == 99.0 and sum(p.count for p in few) == 100
    p = rows[3]
    assert from_proto(to_proto(p)).loss == p.loss


def _state_with_history(steps: int) -> CoordinatorState:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    state = CoordinatorState(store=MemoryStore(), job=job, token="t", clock=lambda: 1000.0)
    for k in range(steps):
        m = StepMetrics(job_id=job.id, node_id="b", plan_epoch=1, step=k, stage=1, loss=loss_of(k),
                        step_seconds=0.25, val_loss=loss_of(k) + 0.2 if k % 50 == 49 else None)
        state.store.add_step(m)
        state.record_history(m)
    return state


def test_status_carries_the_history_and_shows_a_sparkline():
    state = _state_with_history(300)
    s = h.handle_status(pb.StatusRequest(), state)
    assert 0 < len(s.history) <= 120 and s.history_rows == 300
    assert s.history[0].first_step == 0 and s.history[-1].last_step == 299
    assert sum(p.count for p in s.history) == 300
    assert s.history_resolution == "steps 0-299 every step (300 rows)"
    tokens = state.job.train.global_batch * state.job.train.seq_len
    assert s.history[0].tokens_per_second == pytest.approx(tokens / 0.25)
    whole = h.handle_status(pb.StatusRequest(history_points=1_000_000), state)
    assert len(whole.history) == 300
    lines = history_lines(s)
    assert lines[0].startswith("loss history ") and "steps 0-299" in lines[0]
    assert lines[1].startswith("val loss") and "(6 points)" in lines[1]
    table = format_status(s)
    assert "loss history" in table and "every step" in table
    doc = json.loads(status_json(s))
    assert doc["history_rows"] == 300 and len(doc["history"]) == len(s.history)
    assert doc["history"][-1]["last_step"] == 299


def test_plot_writes_the_whole_history_as_a_png(tmp_path):
    state = _state_with_history(120)
    s = h.handle_status(pb.StatusRequest(history_points=1_000_000), state)
    out = plot_history(s, tmp_path / "curves" / "loss.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = h.handle_status(pb.StatusRequest(), CoordinatorState(
        store=MemoryStore(), job=state.job, token="t", clock=lambda: 1000.0))
    with pytest.raises(ValueError, match="no loss"):
        plot_history(empty, tmp_path / "none.png")


def test_prometheus_exports_the_latest_loss_and_validation_loss():
    # before any step (and without validation, or under fp32): absent, not a 0.0 a dashboard would plot
    empty = CoordinatorMetrics()
    empty.update(CoordinatorState(store=MemoryStore(), job=_state_with_history(1).job, token="t",
                                  clock=lambda: 1000.0))
    text = generate_latest(empty.registry).decode()
    assert "atoll_step 0.0" in text
    for name in ("atoll_loss", "atoll_loss_step", "atoll_val_loss", "atoll_val_loss_step", "atoll_loss_scale"):
        assert f"\n{name} " not in text and f"# HELP {name} " not in text, name
    state = _state_with_history(120)
    metrics = CoordinatorMetrics()
    metrics.update(state)
    text = generate_latest(metrics.registry).decode()
    assert f"atoll_loss {loss_of(119)!r}" in text or f"atoll_loss {loss_of(119)}" in text
    assert "atoll_loss_step 119.0" in text
    assert "atoll_val_loss_step 99.0" in text
    assert f"atoll_val_loss {loss_of(99) + 0.2}" in text


def test_the_demo_draws_the_whole_history_when_it_gives_up_early(tmp_path, capsys):
    from atoll.launch.demo import _draw, _history

    db = tmp_path / "state.db"
    s = SqliteStore(db)
    s.history_keep_full, s.history_max_buckets = 100, 50
    for k in range(1000):  # far more steps than the recent reports (and the full-resolution rows) hold
        s.add_history(Sample(step=k, epoch=1, loss=loss_of(k)))
    s.close()
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    _draw(job, {}, tmp_path, None, steps=1500, elapsed=600.0, history=_history(db))
    out = capsys.readouterr().out
    assert "over 1000 steps in 600 s" in out and "buckets of" in out
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_fp16_loss_scale_and_skipped_steps_show_in_status_and_metrics():
    from atoll.coordinator.errors import InvalidArgument
    from atoll.coordinator.store import MemberRecord
    from atoll.serde import step_metrics_to_proto
    from atoll.types import NodeProfile

    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    state = CoordinatorState(store=MemoryStore(), job=job, token="t", clock=lambda: 1000.0)
    for k in range(6):
        for node, stage in (("a", 0), ("b", 1)):
            m = StepMetrics(job_id=job.id, node_id=node, plan_epoch=0, step=k, stage=stage, step_seconds=0.2,
                            loss=4.0 if node == "b" else None, loss_scale=1024.0 if k <= 3 else 512.0,
                            skipped=k == 3)
            state.store.add_step(m)
            state.record_history(m)
    s = h.handle_status(pb.StatusRequest(), state)
    assert "fp16 loss scale 512 at step 5; 1 of the last 6 steps skipped for an overflow (step 3)" in format_status(s)
    metrics = CoordinatorMetrics()
    metrics.update(state)
    assert "atoll_loss_scale 512.0" in generate_latest(metrics.registry).decode()
    bad = step_metrics_to_proto(StepMetrics(job_id=job.id, node_id="a", plan_epoch=0, step=6, loss_scale=1.0))
    bad.loss_scale = float("nan")
    state.store.put_member(MemberRecord(node_id="a", peer_address="127.0.0.1:1",
                                        profile=NodeProfile(hostname="h", device_kind="cpu"), state="alive",
                                        joined_unix=1000.0, last_heartbeat_unix=1000.0, reason=""))
    with pytest.raises(InvalidArgument, match="loss_scale = nan"):
        h.handle_report_step(bad, state)


@pytest.mark.timeout(60)
def test_atoll_status_plot_draws_a_live_coordinators_history(tmp_path, capsys):
    from datetime import timedelta

    from atoll.coordinator.membership import MembershipOptions
    from atoll.coordinator.service import CoordinatorService, ServiceConfig
    from atoll.coordinator.state import CoordinatorOptions
    from atoll.launch.cli import main

    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    svc = CoordinatorService(job=job, token="tok", options=CoordinatorOptions(
        membership=MembershipOptions(lease=timedelta(seconds=30), settle=timedelta(0)), dial_back=False),
        config=ServiceConfig(listen="127.0.0.1:0", metrics_port=0, tick=timedelta(milliseconds=50))).start()
    try:
        for k in range(3000):  # more than the status's default points: --plot asks for every row
            svc.store.add_history(Sample(step=k, epoch=1, loss=loss_of(k), val_loss=2.0 if k % 500 == 0 else None))
        out = tmp_path / "loss.png"
        assert main(["status", "--coordinator", svc.address, "--token", "tok", "--insecure", "--plot", str(out)]) == 0
        printed = capsys.readouterr().out
        assert f"loss curve of job tiny written to {out}" in printed and "-2999 every step" in printed
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert main(["status", "--coordinator", svc.address, "--token", "tok", "--insecure"]) == 0
        assert "loss history " in capsys.readouterr().out
    finally:
        svc.stop()


def test_downsampling_a_compacted_history_is_even_in_steps():
    rows = compact([add_sample(None, Sample(step=k, epoch=1, loss=float(k))) for k in range(10_000)],
                   keep_full=2000, max_buckets=500)
    assert any(r.width > 1 for r in rows) and any(r.width == 1 for r in rows)
    few = downsample(rows, 100)
    assert len(few) <= 100 and sum(p.count for p in few) == 10_000
    # each point spans about a hundredth of the job, bucketed or not: the newest fifth of the steps gets about a
    # fifth of the points, not the share of the rows it has
    assert all(p.width <= 100 + 16 for p in few), sorted(p.width for p in few)[-3:]
    recent = [p for p in few if p.first >= 8000]
    assert 18 <= len(recent) <= 22
