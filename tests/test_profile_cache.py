"""A node restarted on the same machine reuses its profile (`atoll.node.profiler.cached_profile`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from atoll.node import profiler
from atoll.node.profiler import PROFILE_CACHE, ProfileOptions, cached_profile, profile_key, save_profile
from atoll.types import LayerTiming, NodeProfile
from pipeline_harness import tiny_job

PROFILE = NodeProfile(hostname="h", device_kind="cpu", device_name="x", cpu_count=2, memory_total_bytes=1 << 30,
                      layer_timings=[LayerTiming(layer_kind="block", micro_batch=4, seq_len=64, forward_seconds=0.01,
                                                 backward_seconds=0.02, weight_fraction=0.5)],
                      optimizer_step_seconds=0.001, region="lab-a")


def test_a_saved_profile_is_reused_where_the_key_matches(tmp_path: Path) -> None:
    key = profile_key(tiny_job(10), "cpu", ProfileOptions())
    save_profile(tmp_path, key, PROFILE, now=1000.0)
    assert cached_profile(tmp_path, key, now=1000.0 + 3600) == PROFILE
    assert cached_profile(tmp_path, "another", now=1000.0) is None  # another job, device, quota or version
    assert cached_profile(tmp_path, key, now=1000.0 + 25 * 3600) is None  # older than a day: measured again
    assert cached_profile(tmp_path / "nowhere", key) is None


def test_an_unusable_saved_profile_is_measured_again(tmp_path: Path) -> None:
    save_profile(tmp_path, "k", dataclasses.replace(PROFILE, layer_timings=[]), now=0.0)
    assert cached_profile(tmp_path, "k", now=0.0) is None
    save_profile(tmp_path, "k", dataclasses.replace(
        PROFILE, layer_timings=[LayerTiming(layer_kind="block", micro_batch=4, seq_len=64, forward_seconds=0.0,
                                backward_seconds=0.02)]), now=0.0)
    assert cached_profile(tmp_path, "k", now=0.0) is None
    (tmp_path / PROFILE_CACHE).write_text("{not json")
    assert cached_profile(tmp_path, "k", now=0.0) is None


def test_the_key_follows_what_was_measured(monkeypatch) -> None:
    job = tiny_job(10)
    key = profile_key(job, "cpu", ProfileOptions())
    assert profile_key(job, "cpu", ProfileOptions()) == key
    assert profile_key(dataclasses.replace(job, train=dataclasses.replace(job.train, micro_batch=8)), "cpu",
                       ProfileOptions()) != key
    monkeypatch.setattr(profiler, "cpu_share", lambda: 0.25)  # a CPU quota set since: its speed is another
    assert profile_key(job, "cpu", ProfileOptions()) != key
