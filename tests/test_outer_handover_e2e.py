"""Outer mode, end to end on loopback: two regions of two nodes train as replica groups; one node of lab-b leaves
gracefully early in a round. lab-b is planned afresh while lab-a trains on, and the replanned group goes on
with the round from its own live state (the leaving node hands its layers over) instead of starting it again."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from atoll.job import JobSpec
from atoll.launch.localcluster import LocalCluster
from atoll.serde import plan_from_proto

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
INNER = 160
_GOES_ON = re.compile(r"replica group (\S+) goes on with round (\d+) at inner step (\d+) of \d+ \(step (\d+)\)")


def _job(tmp: Path) -> Path:
    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=20 * INNER, warmup=5),
                  checkpoint=replace(job.checkpoint, interval=10 * INNER),
                  cluster=replace(job.cluster, expected_nodes=4, min_nodes=1),
                  # without overlap the groups meet at every round's end, so they train the same round: a group
                  # planned afresh goes on with its round only while the others are still in it
                  outer=replace(job.outer, mode="outer", inner_steps=INNER, deadline_seconds=5.0, overlap=False))
    path = tmp / "job-outer-handover.toml"
    path.write_text(job.to_toml())
    return path


def _ids(cluster: LocalCluster, names: list[str]) -> list[str]:
    return [(cluster.out / n / "node_id").read_text().strip() for n in names]


@pytest.mark.timeout(300)
def test_a_replanned_group_goes_on_with_its_round(tmp_path: Path) -> None:
    cluster = LocalCluster(job_path=_job(tmp_path), out=tmp_path / "run")
    try:
        cluster.start_coordinator(extra=["--island-threshold", "0.001"])
        for name, region in (("a0", "lab-a"), ("a1", "lab-a"), ("b0", "lab-b"), ("b1", "lab-b")):
            cluster.start_node(name, region=region)
        first = cluster.wait_status(lambda s: s.plan.epoch >= 1, 90, "the plan")
        plan = plan_from_proto(first.plan)
        assert plan.mode == "outer" and len(plan.groups) == 2, (plan.mode, [g.name for g in plan.groups])
        b_ids = _ids(cluster, ["b0", "b1"])
        a_ids = _ids(cluster, ["a0", "a1"])

        def b_steps() -> set[int]:
            return {r.step for r in cluster.step_reports() if r.node_id in b_ids}

        def b_at() -> int:
            return max(b_steps(), default=-1)

        def b_early() -> bool:
            # rounds go by wall-clock time: a group paced to n < INNER steps a round trains its round's last n step
            # numbers, so how far it is into its round is counted from the steps it reported in it
            steps = b_steps()
            if not steps or max(steps) < INNER:
                return False
            start = (max(steps) + 1) // INNER * INNER
            return 8 <= len([x for x in steps if x >= start]) <= INNER // 4

        # lab-b early in its second round: lab-a, which trains the same round (the groups meet at its end), has
        # most of the round left while lab-b is replanned and looks for it (a busy machine slows that down)
        cluster.wait_status(lambda s: b_early(), 120, "lab-b early in a round", poll=0.1)
        left_at = b_at()
        proc = cluster.procs.pop("b1")
        proc.terminate()  # a graceful leave: it hands its layers over
        proc.wait(90)
        after = cluster.wait_status(lambda s: s.plan.epoch > first.plan.epoch and any(
            r.plan_epoch > first.plan.epoch for r in cluster.step_reports() if r.node_id == b_ids[0]), 120,
            "lab-b training under the new plan", poll=0.2)
        b0_log = (cluster.out / "b0.log").read_text()
        went_on = _GOES_ON.search(b0_log)
        resumed = min(r.step for r in cluster.step_reports() if r.node_id == b_ids[0] and r.plan_epoch > first.plan.epoch)
        print(f"\nb1 left at step {left_at} (inner step {(left_at + 1) % INNER} of round {(left_at + 1) // INNER}); "
              f"plan epoch {first.plan.epoch} -> {after.plan.epoch}; b0 trains on from step {resumed}: "
              f"{went_on.group(0) if went_on else 'started its round again'}")
        assert went_on, b0_log[-4000:]
        _, round_, inner, step = went_on.groups()
        assert int(round_) == (left_at + 1) // INNER and int(inner) > 0 and resumed == int(step)
        # lab-a trained on through the replan, never from a checkpoint
        for n in ("a0", "a1"):
            assert "loaded layers" not in (cluster.out / f"{n}.log").read_text()
        a_steps = [r.step for r in cluster.step_reports() if r.node_id == a_ids[0]]
        assert a_steps == sorted(a_steps)
        # the job goes on: lab-b ends the round it went on with
        new_inner = plan_from_proto(after.plan).groups
        h = next(g.inner_steps for g in new_inner if g.name == went_on.group(1))
        cluster.wait_status(lambda s: b_at() >= (int(round_) + 1) * h + 2, 120, "lab-b past the round's end",
                            dead=frozenset({"b1"}))
    finally:
        cluster.stop()
