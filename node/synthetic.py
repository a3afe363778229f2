"""Deterministic synthetic token data for tests and benchmarks: the same (seed, step) gives the same
batch on every node, with no corpus to read (`atoll.node.data` serves real text)."""

from __future__ import annotations

import torch

from atoll.node.data import Batch


def synthetic_batch(*, vocab_size: int, batch: int, seq_len: int, seed: int, step: int) -> Batch:
    """A (batch, seq_len) batch of token ids and their next-token targets.

    Each row is an arithmetic progression modulo the vocabulary from a random start with a random
    stride (1..8), with 10% of the tokens replaced by noise: learnable in context, so the loss falls.
    """
    if vocab_size < 2 or batch < 1 or seq_len < 1:
        raise ValueError(f"need vocab_size >= 2, batch >= 1, seq_len >= 1; got {vocab_size}, {batch}, {seq_len}")
    g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab_size, (batch, 1), generator=g)
    stride = torch.randint(1, 9, (batch, 1), generator=g)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab_size
    noise = torch.rand(batch, seq_len + 1, generator=g) < 0.1
    tokens = torch.where(noise, torch.randint(0, vocab_size, (batch, seq_len + 1), generator=g), tokens)
    return Batch(inputs=tokens[:, :-1].contiguous(), targets=tokens[:, 1:].contiguous())


def replica_batch(batch: Batch, replica: int, replicas: int) -> Batch:
    """The rows of `batch` that data-parallel replica `replica` of `replicas` trains on."""
    if not 0 <= replica < replicas:
        raise ValueError(f"replica {replica} is outside {replicas} replicas")

    rows = batch.inputs.shape[0]
    if rows % replicas:
        raise ValueError(f"a batch of {rows} rows does not split evenly over {replicas} replicas")
    share = rows // replicas
    sl = slice(replica * share, (replica + 1) * share)
    return Batch(batch.inputs[sl], batch.targets[sl])
