"""Outer mode with a tied model whose replica groups cut it differently: a group that keeps embedding and head on one
stage holds the tied weight once, a group that cuts it into stages holds it twice (the embedding, and the head's copy
`layers.<last>.lm.weight`, `atoll.node.tied`). The copy's outer state travels under the embedding's name
(`OuterSync(aliases=...)`), so every group applies the same update to it."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from pipeline_harness import outer_arbiter, run_pinned_plan, stage, tiny_job

from atoll import plan as plan_mod
from atoll.node.checkpoint import load_layers
from atoll.node.data import TokenDataset
from atoll.node.model import build_slice, lm_loss
from atoll.plan import OuterPlan, PipelinePlan, Plan, ReplicaGroup

TIED_COPY = "layers.5.lm.weight"
EMBEDDING = "layers.0.tok.weight"


@pytest.mark.timeout(120)
def test_a_tied_model_cut_differently_by_its_groups_syncs_the_heads_copy_as_the_embedding(
        tmp_path: Path, monkeypatch) -> None:
    """Group 0 keeps the tied model whole (no copy), group 1 cuts it [0, 4) -> [4, 6) (the head's stage holds the
    copy). Before, the copy's holder asked group 0 for `layers.5.lm.weight`, which it does not have: every round
    waited out the fetch bound and was decided again without group 0 (its training thrown away each round), and
    the groups' anchor hashes of the head's layer differed. Now every round has both
    groups, the copy stays equal to the embedding, every group ends on the same model, and the checkpoint holds
    the model the groups trained."""
    # a round that waits out the fetch bound (the failure) costs 10 s, not the 30 s minimum
    monkeypatch.setattr(plan_mod, "FETCH_BOUND_MIN_S", 10.0)
    steps, h = 12, 4
    job = tiny_job(steps, interval=steps)
    job = replace(job, model=replace(job.model, tied_head=True))
    outer = OuterPlan(inner_steps=h, codec="int8", lr=1.0, momentum=0.0, overlap=True, deadline_s=10.0)
    whole = PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[stage((0, 6), ["a"])])
    cut = PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[stage((0, 4), ["b"]), stage((4, 6), ["c"])])
    plan = Plan(model="tiny", global_batch=job.train.global_batch, seq_len=job.train.seq_len, pipelines=[whole, cut],
                epoch=1, job_id="job", mode="outer", outer=outer,
                groups=[ReplicaGroup(name="region-0", pipelines=[0], inner_steps=h, since_epoch=1),
                        ReplicaGroup(name="region-1", pipelines=[1], inner_steps=h, since_epoch=1)])
    plan.validate(job.model.n_layers + 2)
    call, rounds = outer_arbiter(plan)
    run = run_pinned_plan(job, plan, tmp_path / "ckpt", join=100, outer_sync=call)
    params = {n: {k: t.detach() for k, t in r.outer.params.items()} for n, r in run.runners.items()}
    assert TIED_COPY in params["c"] and TIED_COPY not in params["a"]

    # every round had both groups, and their anchors agreed on every layer
    assert {p.name: p.rounds_in for p in rounds.progress.values()} == {"region-0": steps // h, "region-1": steps // h}
    assert rounds.anchor_mismatches == 0, rounds.last_mismatch
    anchors = {n: r.outer.anchor for n, r in run.runners.items()}
    assert torch.equal(anchors["c"][TIED_COPY], anchors["b"][EMBEDDING])
    assert torch.equal(anchors["c"][TIED_COPY], anchors["a"][EMBEDDING])
    # the copy is the embedding, in group 1 and against group 0, and every group ends on the same model
    assert torch.equal(params["c"][TIED_COPY], params["b"][EMBEDDING])
    for n, t in params["a"].items():
        other = params["b"] if n in params["b"] else params["c"]
        torch.testing.assert_close(t, other[n], rtol=0, atol=1e-5, msg=n)

    # the checkpoint (written by group 0) evaluates as the model group 1 holds, below where training began
    data = TokenDataset.from_source(job.data.source, job.train.seq_len, seed=job.train.seed)
    batch = data.global_batch(10 ** 6, 32)

    def evaluate(module) -> float:
        module.eval()
        with torch.no_grad():
            return float(lm_loss(module(batch.inputs), batch.targets))

    saved = build_slice(job.model, 0, 6, seed=job.train.seed)
    load_layers(saved, torch.optim.AdamW(saved.parameters()), tmp_path / "ckpt", steps)
    first, head = build_slice(job.model, 0, 4, seed=job.train.seed), build_slice(job.model, 4, 6, seed=job.train.seed)
    first.load_state_dict(params["b"], strict=False)
    head.load_state_dict(params["c"], strict=False)
    first.eval()
    head.eval()
    with torch.no_grad():
        held = float(lm_loss(head(first(batch.inputs)), batch.targets))
    got = evaluate(saved)
    losses = {(plan.group_of(m.pipeline), m.step): m.loss for m in run.reports if m.loss is not None}
    assert abs(got - held) < 1e-3, (got, held)
    assert got < 0.8 * losses[(0, 0)], (got, losses[(0, 0)])
    assert getattr(run.runners["c"].outer, "aliases", None) == {TIED_COPY: EMBEDDING}


def test_a_heads_copy_takes_its_outer_state_as_the_embedding(monkeypatch) -> None:
    """A head's stage [3, 6) of a tied model taking the outer state from a group that keeps the model whole asks the
    holder of layer 0 for the embedding's anchor and momentum (the whole group has no copy), and loads them into the
    copy; a checkpoint's outer state written by such a group restores the copy from the embedding's, too."""
    from atoll.compression import CodecSpec
    from atoll.node import outer as outer_mod

    sync = outer_mod.OuterSync.__new__(outer_mod.OuterSync)

    sync._channels, sync._holder_pool = None, ThreadPoolExecutor(2)  # (what __init__ makes)
    sync.params = {"layers.3.w": torch.zeros(2), TIED_COPY: torch.zeros(2)}
    sync.aliases = {TIED_COPY: EMBEDDING}
    sync.anchor = {n: t.clone() for n, t in sync.params.items()}
    sync.mine = sorted(sync.params)
    sync.holders = {0: {layer: ["a"] for layer in range(6)}}
    sync.plan = SimpleNamespace(node_addresses={"a": "a:1"})
    sync.outbox = outer_mod.OuterOutbox(job_id="j", epoch=3, node_id="c")
    sync.cfg = outer_mod.OuterConfig(job_id="j", node_id="c", group=1, inner_steps=2, codec=CodecSpec("identity"),
                                     deadline=timedelta(seconds=5), momentum=0.9)
    held = {"anchor/layers.3.w": 1.0, "momentum/layers.3.w": 0.125, f"anchor/{EMBEDDING}": 2.0,
            f"momentum/{EMBEDDING}": 0.25}
    asked: list[str] = []

    def fetch(address, request, *, node, **kw):
        asked.extend(request.names)
        missing = [n for n in request.names if n not in held]
        if missing:
            raise KeyError(f"node {node} holds no outer state for {missing[0]!r}")
        return {n: torch.full((2,), held[n]) for n in request.names}, 8, 0

    monkeypatch.setattr(outer_mod, "fetch_outer", fetch)
    assert sync.fetch_state([0], {0: 3}) == 8
    assert sorted(asked) == sorted(held)
    assert float(sync.anchor[TIED_COPY][0]) == 2.0 and float(sync.params[TIED_COPY][0]) == 2.0
    assert float(sync.momentum[TIED_COPY][0]) == 0.25 and float(sync.anchor["layers.3.w"][0]) == 1.0

    # a checkpoint's outer state: the embedding's where the writer kept no copy, else the copy's own
    sync.load_state_dict({"round": 5, "anchor": {EMBEDDING: torch.full((2,), 3.0), "layers.3.w": torch.ones(2)},
                          "momentum": {EMBEDDING: torch.full((2,), 0.375)}})
    assert float(sync.anchor[TIED_COPY][0]) == 3.0 and float(sync.momentum[TIED_COPY][0]) == 0.375
    sync.load_state_dict({"round": 6, "anchor": {TIED_COPY: torch.full((2,), 4.0), "layers.3.w": torch.ones(2)}})
    assert float(sync.anchor[TIED_COPY][0]) == 4.0 and sync.round == 6
    # the copy is left out of the anchor hashes (a whole group has none in the head's layer to compare with)
    sync._pending, sync.snapshot, sync.checkpointer = None, dict(sync.anchor), None
    sync.last = outer_mod.RoundStats()
    done: Future = Future()
    done.set_result(outer_mod._Result(round=6, anchor=dict(sync.anchor), stats=outer_mod.RoundStats()))
    sync._pending, sync.stop = done, None
    sync.timeout = timedelta(seconds=5)
    sync._land()
    assert sync._hashes == outer_mod.anchor_hashes({"layers.3.w": sync.anchor["layers.3.w"]}, 6)
