"""Tokenizers: UTF-8 bytes (the zero-download default) or a Hugging Face `tokenizers` file.

`load_tokenizer("bytes")` is the byte tokenizer (vocabulary 256); `load_tokenizer("path/tokenizer.json")`
loads any `tokenizers` file (one trained by `train_bpe` / `atoll tokenizer train`, or a model's own).
`train_bpe` trains a byte-level BPE on local text, JSONL, Parquet or `datasets` folders, reading them a
chunk at a time.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import torch

from atoll.fsutil import atomic_write, shown_path
from atoll.node.data import ByteTokenizer
from atoll.node.datasets import DataError, Source, detect_format

EOS_TOKEN = "<|endoftext|>"
"""The end-of-text token `train_bpe` adds (id 0); packing appends it after every document."""
_EOS_NAMES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` read from a local `tokenizer.json`."""

    def __init__(self, path: str | Path):
        Tokenizer = _tokenizers().Tokenizer
        p = Path(path)
        if not p.is_file():
            raise DataError(f"tokenizer file {shown_path(p)} does not exist; train one with `atoll tokenizer train --corpus FILE "
                            f"--vocab-size N --out {p}` or copy a model's tokenizer.json there (each node reads it "
                            f"from its own disk)")
        try:
            self.tok = Tokenizer.from_file(str(p))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own Exception subclasses
            raise DataError(f"{p} is not a tokenizers file ({e}); give a tokenizer.json written by the "
                            f"Hugging Face tokenizers library") from None
        self.path = p
        self.vocab_size: int = self.tok.get_vocab_size(with_added_tokens=True)
        ids = [self.tok.token_to_id(n) for n in _EOS_NAMES]
        self.eos_id: int | None = next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tok.encode(text, add_special_tokens=False).ids, dtype=torch.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: torch.Tensor) -> str:
        return self.tok.decode(ids.tolist(), skip_special_tokens=False)


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DataError("Hugging Face tokenizer files need the tokenizers package, which is not installed: "
                        "pip install 'atoll[data]'") from None
    return tokenizers


def load_tokenizer(name: str, *, vocab_size: int | None = None) -> ByteTokenizer | HFTokenizer:
    """"bytes" or the path of a tokenizer.json; with `vocab_size` (the model's), check the tokenizer fits it."""
    tok: ByteTokenizer | HFTokenizer = ByteTokenizer() if name == "bytes" else HFTokenizer(name)
    if vocab_size is not None and vocab_size < tok.vocab_size:
        raise DataError(f"model.vocab_size ({vocab_size}) is below the {tok.vocab_size} tokens of tokenizer {name}; "
                        f"set model.vocab_size = {tok.vocab_size} or more")
    return tok


def corpus_texts(paths: Iterable[str | Path], *, field: str = "text", fmt: str = "auto") -> Iterator[list[str]]:
    """Chunks of documents from local files: text files (a chunk of lines at a time), JSONL, Parquet or
    `datasets` folders (the `field` of each row)."""
    for path in paths:
        p = Path(path)
        if not p.exists():
            raise DataError(f"corpus {p} does not exist")
        kind = detect_format(p) if fmt == "auto" else fmt
        if kind == "text":
            with open(p, encoding="utf-8", errors="replace") as f:
                lines: list[str] = []
                for line in f:
                    lines.append(line)
                    if len(lines) == 1024:
                        yield lines
                        lines = []
                if lines:
                    yield lines
        else:
            for _, texts in Source.open(p, kind, field).rows():
                yield texts


def train_bpe(paths: Sequence[str | Path], *, vocab_size: int, out: str | Path, field: str = "text",
              fmt: str = "auto", min_frequency: int = 2,
              progress: Callable[[int, int], None] | None = None) -> HFTokenizer:
    """Train a byte-level BPE of `vocab_size` tokens (256 byte tokens and EOS_TOKEN among them) on the
    corpus files and write it to `out` (atomically); `progress(documents, bytes)` is called as they are read."""
    tk = _tokenizers()
    Tokenizer, decoders, models, pre_tokenizers, trainers = tk.Tokenizer, tk.decoders, tk.models, \
        tk.pre_tokenizers, tk.trainers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise DataError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least "
                        f"{len(alphabet) + 1} tokens (256 bytes and {EOS_TOKEN})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=alphabet, show_progress=False)
    counts = [0, 0]

    def texts() -> Iterator[list[str]]:
        for chunk in corpus_texts(paths, field=field, fmt=fmt):
            counts[0] += len(chunk)
            counts[1] += sum(len(t) for t in chunk)
            if progress is not None:
                progress(counts[0], counts[1])
            yield chunk

    tok.train_from_iterator(texts(), trainer=trainer)
    if counts[0] == 0:
        raise DataError(f"the corpus {', '.join(map(str, paths))} holds no documents")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = tok.to_str(pretty=False).encode("utf-8")
    atomic_write(out, lambda f: f.write(data))
    return HFTokenizer(out)


class ProgressLine:
    """One status line on a terminal, rewritten at most every `interval` seconds; into a file or a pipe (a log),
    a line of its own at most every `log_interval` seconds, the first after that long, so a short run logs the
    final line alone."""

    def __init__(self, stream=None, interval: float = 0.5, log_interval: float = 30.0):
        self.stream = stream if stream is not None else sys.stderr
        tty = getattr(self.stream, "isatty", lambda: False)()
        self._rewrite = tty
        self.interval = interval if tty else log_interval
        self._t0 = time.monotonic()
        self._last = 0.0 if tty else self._t0

    def __call__(self, documents: int, nbytes: int, *, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._last < self.interval:
            return
        self._last = now
        rate = nbytes / max(now - self._t0, 1e-9) / 1e6
        end = "\n" if final or not self._rewrite else "\r"
        self.stream.write(f"read {documents:,} documents, {nbytes / 1e6:,.1f} MB ({rate:.1f} MB/s){end}")
        self.stream.flush()
