"""Model slices: seeded per-layer initialisation, slices that compose into the whole model, and
saving/loading slice state by layer across different cuts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from atoll.models import preset
from atoll.modelspec import ModelSpec
from atoll.node.inprocess import train_threaded
from atoll.node.model import build_slice, lm_loss
from atoll.node.reference import train_unsplit
from atoll.node.slice_state import SliceStateError, layer_of, load_slice, read_slice, save_slice, slice_state
from atoll.node.stage import StageConfig, build_optimizer
from atoll.node.synthetic import synthetic_batch

TINY = preset("tiny")
LLAMA = replace(TINY, name="tiny-llama", style="llama", n_kv_heads=2)


@pytest.mark.parametrize("config", [TINY, LLAMA], ids=["gpt", "llama"])
def test_slices_hold_only_their_layers_and_compose_into_the_whole_model(config):
    total = config.n_layers + 2
    whole = build_slice(config, 0, total, seed=5)
    parts = [build_slice(config, a, b, seed=5) for a, b in [(0, 2), (2, 3), (3, total)]]
    spec = ModelSpec.from_config(config)
    for part in parts:
        assert {layer_of(n) for n in part.state_dict()} == set(range(part.start, part.end))
        assert sum(p.numel() for p in part.parameters()) == spec.slice_params(part.start, part.end)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    x = ids
    for part in parts:
        x = part(x)
    torch.testing.assert_close(x, whole(ids), rtol=0, atol=0)


def test_initialisation_depends_on_layer_and_seed_only():
    a, b = build_slice(TINY, 1, 4, seed=3), build_slice(TINY, 2, 3, seed=3)
    assert torch.equal(a.state_dict()["layers.2.qkv.weight"], b.state_dict()["layers.2.qkv.weight"])
    assert not torch.equal(a.state_dict()["layers.1.qkv.weight"], a.state_dict()["layers.2.qkv.weight"])
    c = build_slice(TINY, 2, 3, seed=4)
    assert not torch.equal(c.state_dict()["layers.2.qkv.weight"], b.state_dict()["layers.2.qkv.weight"])


def test_tied_head_uses_the_embedding_or_holds_a_copy():
    tied = replace(TINY, tied_head=True)
    m = build_slice(tied, 0, tied.n_layers + 2)
    assert m.layers[str(tied.n_layers + 1)].lm is None
    assert sum(p.numel() for p in m.parameters()) == ModelSpec.from_config(tied).total_params
    # cut from the embedding, the head's stage holds a copy of the tied weight (atoll.node.tied), built equal
    head = build_slice(tied, 3, tied.n_layers + 2)
    assert head.tied_copy is not None and torch.equal(head.tied_copy, m.layers["0"].tok.weight)


def test_slice_rejects_ranges_outside_the_model():
    with pytest.raises(ValueError, match="outside"):
        build_slice(TINY, 2, 9)


def test_lm_loss_of_uniform_logits_is_log_vocab():
    logits = torch.zeros(2, 3, 10)
    assert float(lm_loss(logits, torch.zeros(2, 3, dtype=torch.int64))) == pytest.approx(torch.log(torch.tensor(10.0)))


@pytest.mark.timeout(60)
def test_training_resumes_on_another_cut_from_saved_slices(tmp_path: Path):
    cfg = StageConfig(micro_batches=2, lr=3e-3, max_grad_norm=0.5)
    batches = [synthetic_batch(vocab_size=TINY.vocab_size, batch=4, seq_len=32, seed=9, step=i) for i in range(6)]
    ref = train_unsplit(TINY, stage_config=cfg, batches=batches)

    first = train_threaded(TINY, cuts=[0, 3, 6], stage_config=cfg, batches=batches[:3])
    for s, stage in enumerate(first.stages[0]):
        save_slice(tmp_path / f"stage{s}.pt", stage.module, stage.optimizer, extra={"step": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage0.pt", "stage1.pt"]  # no temporary files left

    # rebuild as four stages with other boundaries and continue from step 3
    sources = [read_slice(tmp_path / "stage0.pt"), read_slice(tmp_path / "stage1.pt")]
    assert load_slice(build_slice(TINY, 2, 4), sources) == {"step": 3}
    resumed = train_threaded(TINY, cuts=[0, 2, 4, 5, 6], stage_config=cfg, batches=batches[3:], first_step=3,
                             resume_from=sources)
    assert resumed.losses() == pytest.approx(ref.losses[3:], rel=1e-5)
    assert first.losses() == pytest.approx(ref.losses[:3], rel=1e-5)


def test_load_checks_coverage_model_and_optimizer_state(tmp_path: Path):
    a, b = build_slice(TINY, 0, 3), build_slice(TINY, 3, 6)
    sa, sb = slice_state(a), slice_state(b)
    target = build_slice(TINY, 2, 5, seed=1)
    with pytest.raises(SliceStateError, match=r"layer\(s\) \[3, 4\]"):
        load_slice(target, [sa])
    with pytest.raises(SliceStateError, match="more than one"):
        load_slice(target, [sa, sb, slice_state(build_slice(TINY, 2, 4))])
    other = slice_state(build_slice(replace(TINY, name="other", d_model=32, n_heads=2), 0, 6))
    with pytest.raises(SliceStateError, match="another model"):
        load_slice(build_slice(TINY, 0, 2), [other])
    with pytest.raises(SliceStateError, match="no optimizer state"):
        load_slice(target, [sa, sb], build_optimizer(target, StageConfig()))
    load_slice(target, [sa, sb])
    assert torch.equal(target.state_dict()["layers.2.fc.weight"], a.state_dict()["layers.2.fc.weight"])
    assert torch.equal(target.state_dict()["layers.4.fc.weight"], b.state_dict()["layers.4.fc.weight"])
    with pytest.raises(FileNotFoundError, match="no saved slice"):
        read_slice(tmp_path / "absent.pt")
    (tmp_path / "junk.pt").write_bytes(b"")
    torch.save({"hello": 1}, tmp_path / "junk.pt")
    with pytest.raises(SliceStateError, match="not a saved slice"):
        read_slice(tmp_path / "junk.pt")
    with pytest.raises(SliceStateError, match="layer-keyed"):
        layer_of("tok.weight")


def test_optimizer_state_round_trips_exactly(tmp_path: Path):
    m = build_slice(TINY, 1, 3)
    opt = build_optimizer(m, StageConfig())
    m(torch.randn(2, 8, TINY.d_model)).sum().backward()
    opt.step()
    save_slice(tmp_path / "s.pt", m, opt)
    m2 = build_slice(TINY, 1, 3, seed=99)
    opt2 = build_optimizer(m2, StageConfig())
    load_slice(m2, [tmp_path / "s.pt"], opt2)
    for (n, p), p2 in zip(m.named_parameters(), m2.parameters()):
        assert torch.equal(p, p2), n
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], opt2.state[p2][k]), (n, k)
