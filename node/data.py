"""Training data: a byte-level tokenizer, a token stream from a text file, deterministic batches.

Every node derives the same global batch for a step from (seed, step) alone, so the first stage (which
feeds token ids) and the last stage (which needs the targets) agree without exchanging data, and each
data-parallel replica takes its own contiguous share. The data position of a step is the number of
samples consumed before it: step x global batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

BUILTIN_CORPUS = "builtin"


class ByteTokenizer:
    """UTF-8 bytes as tokens: a vocabulary of 256, nothing to download or train."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)

    def decode(self, ids: torch.Tensor) -> str:
        return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def load_text(source: str) -> str:
    """The demo corpus shipped with atoll (`builtin`) or any UTF-8 text file."""
    if source == BUILTIN_CORPUS:
        return resources.files("atoll").joinpath("data/genesis-exodus.txt").read_text(encoding="utf-8")
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"data source {source!r} is not a file; give a UTF-8 text file or 'builtin'")
    return path.read_text(encoding="utf-8", errors="replace")


@dataclass(frozen=True)
class Batch:
    """Token ids and next-token targets, both (samples, seq_len) int64."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def micro_batches(self, n: int) -> list["Batch"]:
        if self.inputs.shape[0] % n:
            raise ValueError(f"{self.inputs.shape[0]} samples do not split into {n} micro-batches")
        return [Batch(i, t) for i, t in zip(self.inputs.chunk(n), self.targets.chunk(n))]


class TokenDataset:
    """Random windows of seq_len + 1 tokens from one token stream, drawn deterministically per step."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int = 0):
        if tokens.ndim != 1 or tokens.numel() < seq_len + 2:
            raise ValueError(f"the corpus has {tokens.numel()} tokens; it needs more than seq_len + 1 = {seq_len + 1}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed

    @classmethod
    def from_source(cls, source: str, seq_len: int, seed: int = 0) -> "TokenDataset":
        return cls(ByteTokenizer().encode(load_text(source)), seq_len, seed)

    def global_batch(self, step: int, global_batch: int) -> Batch:
        """The whole batch of `step` (the same on every node)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (global_batch,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        windows = self.tokens[idx]
        return Batch(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())

    def rows(self, step: int, global_batch: int, first: int, last: int) -> Batch:
        """Rows [first, last) of the step's global batch."""
        if not 0 <= first < last <= global_batch:
            raise ValueError(f"rows [{first}, {last}) are outside a global batch of {global_batch}")
        b = self.global_batch(step, global_batch)
        return Batch(b.inputs[first:last], b.targets[first:last])

    def replica_batch(self, step: int, global_batch: int, replica: int, replicas: int) -> Batch:
        """Data-parallel replica `replica`'s contiguous share of the step's global batch."""
        if global_batch % replicas:
            raise ValueError(f"global batch {global_batch} does not split over {replicas} data-parallel replicas")
        share = global_batch // replicas
        b = self.global_batch(step, global_batch)
        sl = slice(replica * share, (replica + 1) * share)
        return Batch(b.inputs[sl], b.targets[sl])
