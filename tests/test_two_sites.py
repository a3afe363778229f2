"""Two sites that share no file system: a node of site A dies and a node of site B takes its layers over from a
checkpoint copy held by a peer.

Site A runs a1 and a2, site B b1 and b2, each node with its own checkpoint folder. The plan runs layers [0, 3) on
a1 and [3, 6) on b1 (a2 and b2 stand by); each checkpoint is copied to one node of the other site
(`[checkpoint] replicas = 1`). a1 is SIGKILLed: no live copy of its layers is left, so the next plan (layers
[0, 3) on b2) resumes from the newest checkpoint whose copies alive nodes hold; b2 fetches a1's file from b1's
copy over gRPC, b1 reads its own.

The comparison: a checkpoint holds the weights and AdamW state after its step, and the data of a step depends
only on the step, so from the resume step on the run retrains exactly what the uninterrupted run trained: every
step's loss (the steps between the checkpoint and the kill were trained twice, the same both times) equals one
process's to 1e-4, as for any pipeline.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from atoll.job import JobSpec
from atoll.node.checkpoint import step_dir
from atoll.node.local import train_local
from scripted_cluster import ScriptedCluster, close

REPO = Path(__file__).resolve().parent.parent
STEPS = 200
INTERVAL = 10

pytestmark = pytest.mark.integration


def _job() -> JobSpec:
    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    return replace(job, train=replace(job.train, steps=STEPS, warmup=5),
                   checkpoint=replace(job.checkpoint, interval=INTERVAL, replicas=1),
                   compression=replace(job.compression, mode="identity"),
                   cluster=replace(job.cluster, expected_nodes=4, min_nodes=1),
                   outer=replace(job.outer, mode="sync"))


@pytest.mark.timeout(300)
def test_a_site_a_node_dies_and_site_b_loads_its_layers_from_a_peer_copy(tmp_path: Path) -> None:
    layouts = {frozenset({"a1", "a2", "b1", "b2"}): [((0, 3), ["a1"]), ((3, 6), ["b1"])],
               frozenset({"a2", "b1", "b2"}): [((0, 3), ["b2"]), ((3, 6), ["b1"])]}
    job = _job()
    cluster = ScriptedCluster(job=job, out=tmp_path, layouts=layouts)
    try:
        for name in ("a1", "a2", "b1", "b2"):
            cluster.start_node(name, region=f"site-{name[0]}")
        index = cluster.service.store

        def copied() -> bool:  # a1's layers saved, and copied to site B
            return any(r.node_id == "b1" and (r.layer_start, r.layer_end) == (0, 3) and r.step >= 2 * INTERVAL
                       for r in index.list_checkpoints())
        cluster.wait(copied, 150, "a copy of a1's checkpoint on b1")
        first = cluster.plan()
        cluster.kill("a1")
        killed_at = cluster.top_step()
        cluster.wait(lambda: len(cluster.losses()) >= STEPS, 200, "the job to finish", dead=["a1"])
        later = cluster.plan()
        assert later.epoch > first.epoch and later.pipelines[0].stages[0].nodes == ["b2"]
        resumed = later.resume_step
        assert INTERVAL <= resumed <= killed_at + 1
        # b2 loaded layers [0, 3) from b1's copy of a1's file; b1 read its own file
        step, how, was, back = cluster.resumes("b2")[-1]
        assert (step, how) == (resumed, "checkpoint") and back == was - resumed, cluster.resumes("b2")
        moved = [t for t in cluster.transfers("b2") if "copy" not in t[2]]  # not the copies b2 takes of b1's
        assert [(src, what) for _, src, what in moved] == [
            ("b1", f"checkpoint of step {resumed}, layers [0, 3)")], moved
        assert cluster.resumes("b1")[-1][:2] == (resumed, "checkpoint")
        assert not [t for t in cluster.transfers("b1") if "copy" not in t[2]]
        # the folders are separate: b2 holds the fetched file, b1 its own and its copy, a2 nothing
        ckpt = {n: tmp_path / n / "checkpoints" for n in ("a1", "a2", "b1", "b2")}
        assert (step_dir(ckpt["b2"], resumed) / "layers-0000-0003.pt").is_file()
        assert {p.name for p in step_dir(ckpt["b1"], resumed).iterdir()} >= {"layers-0000-0003.pt",
                                                                              "layers-0003-0006.pt"}
        assert not any(ckpt["a2"].rglob("*.pt"))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the test process's own threads would fight the nodes for the cores
        try:
            reference = train_local(job)[0]
        finally:
            torch.set_num_threads(threads)
        close(cluster.losses(), reference, range(STEPS), 1e-4)
        print(f"\na1 killed at step {killed_at}; b2 took layers [0, 3) from b1's copy of the checkpoint of step "
              f"{resumed} ({moved[0][0]} bytes); {back} steps retrained, the losses equal one process's")
    finally:
        cluster.stop()
