"""Outer mode, end to end on loopback: two regions of one node each train as replica groups, and the coordinator is
SIGKILLed mid-round and restarted a few seconds later on its state dir. The round in flight resumes at once: its
arrivals were in the coordinator's store, and the nodes repeat theirs with every question. No replan, no rollback;
checkpoints go on through the last step, the job finishes with its final checkpoint, and the groups' anchor hashes
agreed at every round. Before, arrivals lived in the coordinator's memory and each node told its own once: every
region idled until its round's deadline (minutes), then replans and a rollback, and no checkpoint after."""

from __future__ import annotations

import re
import time
from dataclasses import replace
from pathlib import Path

import pytest

from atoll.coordinator.checkpoints import complete_steps
from atoll.job import JobSpec
from atoll.launch.localcluster import LocalCluster
from atoll.serde import plan_from_proto

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
INNER = 10
ROUNDS = 12
INTERVAL = 3 * INNER
OUTAGE_S = 6.0
_LOADED = re.compile(r"loaded layers \[\d+, \d+\) from the checkpoint")


def _job(tmp: Path) -> Path:
    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=ROUNDS * INNER, warmup=5, eval_every=0),
                  checkpoint=replace(job.checkpoint, interval=INTERVAL),
                  cluster=replace(job.cluster, expected_nodes=2, min_nodes=2),
                  outer=replace(job.outer, mode="outer", inner_steps=INNER, deadline_seconds=5.0))
    path = tmp / "job-outer-restart.toml"
    path.write_text(job.to_toml())
    return path


@pytest.mark.timeout(300)
def test_a_coordinator_killed_mid_round_resumes_the_round_without_a_rollback(tmp_path: Path) -> None:
    cluster = LocalCluster(job_path=_job(tmp_path), out=tmp_path / "run")
    try:
        cluster.start_coordinator(extra=["--island-threshold", "0.001"])
        cluster.start_node("a0", region="lab-a")
        cluster.start_node("b0", region="lab-b")
        first = cluster.wait_status(lambda s: s.plan.epoch >= 1, 90, "the plan")
        plan = plan_from_proto(first.plan)
        assert plan.mode == "outer" and len(plan.groups) == 2, (plan.mode, [g.name for g in plan.groups])
        ids = {n: (cluster.out / n / "node_id").read_text().strip() for n in ("a0", "b0")}

        def at(node: str) -> int:
            return max((r.step for r in cluster.step_reports() if r.node_id == ids[node]), default=-1)

        started = time.monotonic()
        cluster.wait_status(lambda s: min(at("a0"), at("b0")) >= 3 * INNER, 120, "both groups in round 3", poll=0.2)
        round_s = (time.monotonic() - started) / 3  # (an upper bound: the first rounds include start-up)
        killed = {n: at(n) for n in ids}  # (before the kill: a reader closing the store while the coordinator is
        cluster.kill_coordinator()        # down checkpoints and removes its write-ahead log, which it then misses)
        # each group's own inner steps a round (the planner gives a group it measured slower fewer)
        h = {n: plan.groups[plan.group_of(next(p for p, pp in enumerate(plan.pipelines)
                                                if ids[n] in pp.stages[0].nodes))].inner_steps for n in ids}
        last = {n: ROUNDS * h[n] - 1 for n in ids}
        assert all(killed[n] < last[n] - 3 * h[n] for n in ids), f"too near the end at the kill: {killed}; raise ROUNDS"
        time.sleep(OUTAGE_S)  # the groups reach their round's end meanwhile and wait for its decision
        cluster.restart_coordinator()
        back = time.monotonic()

        # both groups past two more round ends: the round in flight at the kill, and one decided wholly after
        cluster.wait_status(lambda s: all(at(n) >= (killed[n] // h[n] + 2) * h[n] for n in ids), 90,
                            "both groups two rounds on after the restart", poll=0.2)
        resumed_s = time.monotonic() - back
        print(f"\nkilled at steps {killed} (H {h}); both groups two rounds on {resumed_s:.1f}s after the restart "
              f"(a round took at most {round_s:.1f}s before)")
        # the restarted coordinator's start-up and a heartbeat or two, beside two rounds of training
        assert resumed_s < 2 * round_s + 15.0, (resumed_s, round_s)

        final = cluster.wait_status(lambda s: s.job_state == "finished", 180, "the job to finish", poll=0.5,
                                    dead=frozenset())
        steps = cluster.step_reports()
        with cluster.read_store() as store:
            plans = {h.plan.epoch: h.plan for h in store.plan_history()}
            done = complete_steps(store.list_checkpoints(), plans)
        # no replan, no rollback: one plan epoch, every node's steps in order, no checkpoint loaded
        assert final.plan.epoch == first.plan.epoch, f"replanned: epoch {first.plan.epoch} -> {final.plan.epoch}"
        for n in ids:
            mine = [r.step for r in steps if r.node_id == ids[n]]
            assert mine == sorted(mine), f"{n}'s steps went back: {mine}"
            assert not _LOADED.search((cluster.out / f"{n}.log").read_text()), f"{n} loaded a checkpoint"
        # checkpoints at every interval through the last step, written by the plan's first group
        # (a round's steps end at a multiple of the plan's H whatever a group's inner steps a round: `next_step`; at
        # the round ends within a round past each interval: PlanRunner.run's `due` in outer mode. Counted from the
        # first group's inner steps this expected steps 30, 60 and 72 where the planner gave that group 6 of 10)
        h0 = plan.outer.inner_steps
        writer_last = ROUNDS * h0
        wanted = {k * h0 for k in range(1, ROUNDS + 1) if (k * h0) % INTERVAL < h0} | {writer_last}
        assert wanted <= set(done), f"complete checkpoints {done}, wanted {sorted(wanted)}"
        assert final.final_checkpoint_step == writer_last and final.last_checkpoint_step == writer_last
        assert final.anchor_mismatches == 0, final.anchor_mismatch
        coordinator_log = (cluster.out / "coordinator.log").read_text()
        assert "outer rounds resumed from the store" in coordinator_log
    finally:
        cluster.stop()
