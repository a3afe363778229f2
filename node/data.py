"""Training data: a byte-level tokenizer, a token stream from a text file, deterministic batches.

(Streamed JSONL, Parquet and `datasets` sources: `atoll.node.datasets`; Hugging Face tokenizers:
`atoll.node.tokenizer`; `atoll.node.datasets.open_dataset` picks the dataset of a job.)

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
    eos_id = None
    """No end-of-text token: packed documents follow each other directly."""

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

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
    """Random windows of seq_len + 1 tokens from one token stream, drawn deterministically per step.

    Held-out data: the last `validation_fraction` of the stream (training windows never reach into it), or
    a separate `validation` stream; held-out batch j is drawn from it the same way on every node.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int = 0, *, validation_fraction: float = 0.0,
                 validation: torch.Tensor | None = None):
        if validation_fraction:
            cut = int(tokens.numel() * (1 - validation_fraction))
            tokens, validation = tokens[:cut], tokens[cut:]
        if tokens.ndim != 1 or tokens.numel() < seq_len + 2:
            raise ValueError(f"the corpus has {tokens.numel()} tokens; it needs more than seq_len + 1 = {seq_len + 1}")
        if validation is not None and validation.numel() < seq_len + 2:
            raise ValueError(f"the held-out data has {validation.numel()} tokens; it needs more than seq_len + 1 = "
                             f"{seq_len + 1}: raise data.validation_fraction or give a longer data.validation")
        self.tokens, self.seq_len, self.seed, self.validation = tokens, seq_len, seed, validation

    @classmethod
    def from_source(cls, source: str, seq_len: int, seed: int = 0, *, tokenizer=None,
                    validation_fraction: float = 0.0, validation: str = "") -> "TokenDataset":
        """A text source (`load_text`) tokenized by `tokenizer` (default: bytes); held-out data as above."""
        tok = tokenizer or ByteTokenizer()
        held = _encode(tok, load_text(validation)) if validation else None
        return cls(_encode(tok, load_text(source)), seq_len, seed, validation_fraction=validation_fraction,
                   validation=held)

    @property
    def has_validation(self) -> bool:
        return self.validation is not None

    def global_batch(self, step: int, global_batch: int) -> Batch:
        """The whole batch of `step` (the same on every node)."""
        return self._windows(self.tokens, self.seed * 1_000_003 + step, global_batch)

    def validation_rows(self, batch: int, global_batch: int, first: int, last: int) -> Batch:
        """Rows [first, last) of held-out batch `batch` (the same batches at every evaluation)."""
        if self.validation is None:
            raise ValueError("this job has no held-out data: set data.validation_fraction or data.validation")
        if not 0 <= first < last <= global_batch:
            raise ValueError(f"rows [{first}, {last}) are outside a global batch of {global_batch}")
        b = self._windows(self.validation, (1 << 62) + self.seed * 1_000_003 + batch, global_batch)
        return Batch(b.inputs[first:last], b.targets[first:last])

    def _windows(self, tokens: torch.Tensor, seed: int, count: int) -> Batch:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, tokens.numel() - self.seq_len - 1, (count,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        windows = tokens[idx]
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


def _encode(tokenizer, text: str) -> torch.Tensor:
    """The whole text's tokens, encoded a chunk of lines at a time."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text)
    lines = text.splitlines(keepends=True)
    ids: list[int] = []
    for i in range(0, len(lines), 4096):
        for row in tokenizer.encode_batch(["".join(lines[i:i + 4096])]):
            ids.extend(row)
    return torch.tensor(ids, dtype=torch.int64)
