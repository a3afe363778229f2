"""Byte tokenizer, the shipped corpus and deterministic, replica-sharded batches."""

from __future__ import annotations

import pytest
import torch

from atoll.node.data import ByteTokenizer, TokenDataset, load_text


def test_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "In the beginning — ünïcode too"
    ids = tok.encode(text)
    assert ids.dtype == torch.int64 and int(ids.max()) < tok.vocab_size
    assert tok.decode(ids) == text


def test_builtin_corpus_ships() -> None:
    text = load_text("builtin")
    assert 100_000 < len(text) < 5_000_000 and "In the beginning" in text


def test_missing_file_says_what_to_do(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="builtin"):
        load_text(str(tmp_path / "nope.txt"))


def test_batches_are_deterministic_and_shifted() -> None:
    ds = TokenDataset.from_source("builtin", seq_len=32, seed=7)
    a, b = ds.global_batch(5, 8), ds.global_batch(5, 8)
    assert torch.equal(a.inputs, b.inputs)
    assert not torch.equal(a.inputs, ds.global_batch(6, 8).inputs)
    assert torch.equal(a.inputs[:, 1:], a.targets[:, :-1])
    assert a.inputs.shape == (8, 32)


def test_replicas_partition_the_global_batch() -> None:
    ds = TokenDataset.from_source("builtin", seq_len=16)
    full = ds.global_batch(3, 8)
    parts = [ds.replica_batch(3, 8, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([p.inputs for p in parts]), full.inputs)
    with pytest.raises(ValueError, match="does not split"):
        ds.replica_batch(3, 9, 0, 2)
    assert len(full.micro_batches(4)) == 4
