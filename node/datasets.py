"""Datasets from local files: text, JSONL, Parquet and `datasets` folders, streamed and packed into samples.

A source is one file or a folder of them (every `*.txt`, `*.jsonl` or `*.parquet` file in name order), or a
folder written by `datasets.Dataset.save_to_disk` (its Arrow shards, read with pyarrow; a `DatasetDict`
folder gives its "train" split). A row is a line of a text file, or the `[data] field` of a JSONL object, a
Parquet or `datasets` column: a document. Rows are read a chunk at a time and tokenized a chunk at a time,
never the whole corpus at once. (The shipped corpus, "builtin", is small and sampled in random windows by
`atoll.node.data.TokenDataset` instead.)

Packing: the documents' tokens, each followed by the tokenizer's end-of-text token when it has one (not
between the lines of a text file, one running text), make one stream, in source order, repeated epoch after
epoch. Sample `i` is the window of seq_len + 1 tokens starting at token `i * seq_len` of that stream, and step
`k` of a global batch `B` takes the samples in places `[k * B, (k + 1) * B)` of the training order; a
data-parallel replica takes its rows `[first, last)` of them. The order is the samples' own (`[data] shuffle =
false`) or shuffled (the default): the places are cut into windows of `W` (`shuffle_window`), and place `w W + j`
holds sample `w W + pi_w(j)`, `pi_w` a permutation of W drawn from (seed, w) by a fixed hash (`window_order`),
so the same on every node, in every process and on every version. A node reads a window's samples at once (it
holds W x seq_len tokens). So every node derives the same samples for a step from the step alone (the first
stage's inputs and the last stage's targets agree without exchanging data), replicas' rows are disjoint (a
permutation maps disjoint places to disjoint samples), and the data position of a step is a sample counter,
`k * B`, which a checkpoint records. A resumed job reads forward to that sample, tokenizing without
training, from the restart point its checkpoint holds (`StreamingDataset.save_cursor`) or from the first
row (`DataPosition` says which file, row and token it is), and continues at the exact row.

Held-out split: with `validation_fraction` f, a row is held out when its index in the corpus falls in the
held-out share of a low-discrepancy sequence (a fraction f of rows, spread over the whole corpus, the same on
every node and in every epoch); held-out rows make their own packed stream, and the first
`train.eval_batches` global batches of it are the validation set. A separate `[data] validation` source
gives the validation stream instead (all its rows).
"""

from __future__ import annotations

import bisect
import json
import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from atoll.fsutil import atomic_write_text, shown_path
from atoll.node.data import BUILTIN_CORPUS, Batch, TokenDataset

log = logging.getLogger("atoll.node.datasets")

FORMATS = ("auto", "text", "jsonl", "parquet", "datasets")
STREAMED = ("text", "jsonl", "parquet", "datasets")
CHUNK_ROWS = 512
"""Rows read and tokenized at a time."""
MARK_EVERY = 1 << 20
"""Stream tokens between remembered restart points (a chunk's first row each)."""
CURSOR_FILE = "data-cursor.json"
"""A checkpoint's record of where the training stream can start reading again (`StreamingDataset.save_cursor`)."""
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: i * _GOLDEN mod 2^64 spreads rows evenly over [0, 2^64)
_ODD = 0xD1B54A32D192ED03  # an odd 64-bit multiplier (R2's), so windows and seeds hash apart
_MASK = (1 << 64) - 1


class DataError(ValueError):
    """The data source or tokenizer does not fit the job; the message says what to change."""


class TextTokenizer(Protocol):
    """What packing needs of a tokenizer (`ByteTokenizer`, `atoll.node.tokenizer.HFTokenizer`)."""

    vocab_size: int
    eos_id: int | None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...


# --- sources ----------------------------------------------------------------------------------------------

def detect_format(path: Path) -> str:
    """The format of a source path: "text", "jsonl", "parquet" or "datasets" (a save_to_disk folder)."""
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return "datasets"
        kinds = {_suffix_format(p) for p in path.iterdir() if p.is_file()} - {None}
        if len(kinds) == 1:
            return kinds.pop()  # type: ignore[return-value]
        raise DataError(f"data source {path} is a folder of {'mixed' if kinds else 'no'} data files "
                        f"({', '.join(sorted(k for k in kinds if k)) or 'none'}); give a folder of *.jsonl or "
                        f"*.parquet files, a datasets.save_to_disk folder, or set [data] format")
    kind = _suffix_format(path)
    return kind or "text"


def _suffix_format(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.txt", ".ndjson")):
        return "jsonl"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    if name.endswith(".txt"):
        return "text"
    return None


@dataclass(frozen=True)
class Source:
    """A resolved streamed source: its format, its shard files in order, and the field to read."""

    path: Path
    format: str
    field: str
    files: tuple[Path, ...]

    @classmethod
    def open(cls, path: str | Path, fmt: str = "auto", field: str = "text") -> "Source":
        p = Path(path)
        if not p.exists():
            raise DataError(f"data source {shown_path(p)} does not exist; give a text, JSONL or Parquet file, a folder of them, "
                            f"or a datasets.save_to_disk folder (each node reads it from its own disk)")
        kind = detect_format(p) if fmt == "auto" else fmt
        if kind not in STREAMED:
            raise DataError(f"data source {p} is {kind}; streamed sources are {', '.join(STREAMED)}")
        if kind == "datasets":
            files = _arrow_files(p)
        elif p.is_dir():
            files = tuple(sorted(f for f in p.iterdir() if f.is_file() and _suffix_format(f) == kind))
        else:
            files = (p,)
        if not files:
            raise DataError(f"data source {p} holds no {kind} files")
        src = cls(p, kind, field, files)
        src.check_field()
        return src

    def check_field(self) -> None:
        """Raise DataError unless the first file has the field (a JSONL key, a column; text has none)."""
        f = self.files[0]
        if self.format == "text":
            return
        if self.format == "jsonl":
            for _, row in _jsonl_rows(f, 0, 0, None):  # the first row
                if not isinstance(row, dict) or self.field not in row:
                    keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                    raise DataError(f"data.field {self.field!r} is not in the first row of {f} (its keys: "
                                    f"{keys}); set [data] field to the key holding the text")
                return
            return
        names = _schema(self.format, f).names
        if self.field not in names:
            raise DataError(f"data.field {self.field!r} is not a column of {f} (columns: {names}); set [data] "
                            f"field to the column holding the text")

    def rows(self, file: int = 0, row: int = 0, byte: int = 0) -> Iterator[tuple["RowCursor", list[str]]]:
        """Chunks of rows' texts from (file, row) on, to the end of the source: (cursor of the chunk's first
        row, its texts). `byte` is the JSONL offset of that row (0: count lines from the file's start)."""
        for fi in range(file, len(self.files)):
            start_row, start_byte = (row, byte) if fi == file else (0, 0)
            yield from self._file_rows(fi, start_row, start_byte)

    def _file_rows(self, fi: int, row: int, byte: int) -> Iterator[tuple["RowCursor", list[str]]]:
        path = self.files[fi]
        if self.format in ("jsonl", "text"):
            lines = _jsonl_rows(path, row, byte, self.field) if self.format == "jsonl" else _text_rows(path, row, byte)
            chunk: list[str] = []
            first: RowCursor | None = None
            for (r, off), obj in lines:
                if first is None:
                    first = RowCursor(fi, r, off)
                chunk.append(obj)
                if len(chunk) == CHUNK_ROWS:
                    yield first, chunk
                    chunk, first = [], None
            if chunk and first is not None:
                yield first, chunk
            return
        for r, batch in _arrow_batches(self.format, path, self.field, row):
            n = batch.num_rows
            if r + n <= row:
                continue
            column = batch.column(0).to_pylist()
            skip = max(0, row - r)
            for a in range(skip, n, CHUNK_ROWS):
                texts = column[a:a + CHUNK_ROWS]
                for k, t in enumerate(texts):
                    if not isinstance(t, str):
                        raise DataError(f"row {r + a + k} of {path}: column {self.field!r} holds "
                                        f"{type(t).__name__}, not text; set [data] field to a text column")
                yield RowCursor(fi, r + a, 0), texts


@dataclass(frozen=True, order=True)
class RowCursor:
    """Where a row starts: its file (index into `Source.files`), its row in that file, and for JSONL the
    byte offset of its line (so reading can seek there)."""

    file: int
    row: int
    byte: int = 0


def _jsonl_rows(path: Path, row: int, byte: int, field: str | None) -> Iterator[tuple[tuple[int, int], object]]:
    """((row, byte offset), text or object) for each non-empty line (a row) from `row` on (`byte`: its
    offset)."""
    with open(path, "rb") as f:
        r, line_no = 0, 0  # line numbers (blank lines too) are known when reading from the file's start
        if byte:
            f.seek(byte)
            r = row
        while True:
            off = f.tell()
            line = f.readline()
            line_no += 1
            if not line:
                return
            if not line.strip():
                continue
            if r < row:
                r += 1
                continue
            where = f"line {line_no} of {path}" if not byte else f"the line at byte {off} of {path}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where} is not JSON ({e}); each line must be one JSON object") from None
            if field is not None:
                if not isinstance(obj, dict) or field not in obj:
                    raise DataError(f"data.field {field!r} is not in {where}; set [data] field to the key holding "
                                    f"the text")
                obj = obj[field]
                if not isinstance(obj, str):
                    raise DataError(f"{where}: field {field!r} holds {type(obj).__name__}, not text")
            yield (r, off), obj
            r += 1


def _text_rows(path: Path, row: int, byte: int) -> Iterator[tuple[tuple[int, int], str]]:
    """((row, byte offset), line with its newline) for each line of a UTF-8 text file from `row` on."""
    with open(path, "rb") as f:
        r = 0
        if byte:
            f.seek(byte)
            r = row
        while True:
            off = f.tell()
            line = f.readline()
            if not line:
                return
            if r >= row:
                yield (r, off), line.decode("utf-8", errors="replace")
            r += 1


def _arrow_files(path: Path) -> tuple[Path, ...]:
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8")).get("splits", [])
        if "train" not in splits:
            raise DataError(f"{path} is a DatasetDict with splits {splits} and no 'train'; point [data] source at "
                            f"the split's folder")
        path = path / "train"
    state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    return tuple(path / f["filename"] for f in state.get("_data_files", []))


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("Parquet and datasets folders are read with pyarrow, which is not installed: "
                        "pip install 'atoll[data]'") from None
    return pa, pq


def _schema(fmt: str, path: Path):
    pa, pq = _pyarrow()

    if fmt == "parquet":
        return pq.read_schema(path)
    with pa.memory_map(str(path)) as src:
        return pa.ipc.open_stream(src).schema


def _arrow_batches(fmt: str, path: Path, field: str, row: int = 0):
    """(first row, record batch of one column), read a batch at a time (a Parquet row group slice, an Arrow
    batch), from the batch holding `row` on; Parquet row groups wholly before `row` are not read."""
    pa, pq = _pyarrow()

    if fmt == "parquet":
        pf = pq.ParquetFile(path)
        groups = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
        first, r = 0, 0
        while first < len(groups) and r + groups[first] <= row:
            r += groups[first]
            first += 1
        for batch in pf.iter_batches(batch_size=4096, columns=[field], row_groups=range(first, len(groups))):
            yield r, batch
            r += batch.num_rows
        return
    with pa.memory_map(str(path)) as src:  # the datasets library's Arrow files are IPC streams
        reader = pa.ipc.open_stream(src)
        index = reader.schema.get_field_index(field)
        r = 0
        for batch in reader:
            yield r, pa.record_batch([batch.column(index)], names=[field])
            r += batch.num_rows


# --- packing ----------------------------------------------------------------------------------------------

def held_out(row: int, fraction: float) -> bool:
    """Whether corpus row `row` is in the held-out split of `fraction` (the same on every node)."""
    return fraction > 0 and ((row + 1) * _GOLDEN % (1 << 64)) < fraction * (1 << 64)


@dataclass(frozen=True)
class DataPosition:
    """Where a sample starts in its source: epoch, file, row of that file and token of that row."""

    epoch: int
    file: Path
    row: int
    token: int

    def __str__(self) -> str:
        return f"epoch {self.epoch}, {self.file.name} row {self.row}, token {self.token}"


@dataclass(frozen=True)
class _Mark:
    """A row boundary in the packed stream: where to start reading again to reach `offset`."""

    offset: int
    """Stream token offset of the row's first token."""
    epoch: int
    ordinal: int
    """The row's index in the corpus (over all files)."""
    cursor: RowCursor


class PackedStream:
    """The tokens of a source's selected rows, packed end to end, epoch after epoch, read forward on demand.

    `tokens(a, b)` returns stream tokens [a, b); only the tokens from the earliest still-needed offset on are
    held. Reading again from before that offset restarts from the nearest row boundary remembered on the way
    (one every `mark_every` tokens), or from the start; a restart point taken from a checkpoint
    (`seed_restart_point`) lets a new process begin there instead of at the start.
    """

    def __init__(self, source: Source, tokenizer: TextTokenizer, *, keep: Callable[[int], bool] = lambda r: True,
                 mark_every: int | None = None, name: str = "train"):
        self.source, self.tokenizer, self.keep, self.name = source, tokenizer, keep, name
        self.mark_every = MARK_EVERY if mark_every is None else mark_every
        self._marks: list[_Mark] = []
        self._restart(_Mark(0, 0, 0, RowCursor(0, 0, 0)))

    def _restart(self, mark: _Mark) -> None:
        self._base = mark.offset  # stream offset of self._buf[0]
        self._buf = np.zeros(0, dtype=np.int64)
        self._rows: deque[tuple[int, _Mark]] = deque()  # (offset, row mark) of rows starting in the buffer
        self._reader = self._read(mark)

    def _read(self, mark: _Mark) -> Iterator[tuple[_Mark, list[int], _Mark | None]]:
        """(row mark, tokens, chunk mark) for each kept row from `mark` on, forever (epoch after epoch); the
        chunk mark (where reading can start again: the chunk's first row, a JSONL line's byte offset) comes
        with the first kept row of each chunk, else None."""
        epoch, ordinal, cursor, offset = mark.epoch, mark.ordinal, mark.cursor, mark.offset
        # a text file's lines are one running text: no end-of-text token between them
        eos = self.tokenizer.eos_id if self.source.format != "text" else None
        while True:
            whole_epoch, kept_any = ordinal == 0, False
            for first, texts in self.source.rows(cursor.file, cursor.row, cursor.byte):
                # rows of a chunk are consecutive in one file; the cursor of row k is (file, row + k)
                picked = [(k, t) for k, t in enumerate(texts) if self.keep(ordinal + k)]
                encoded = self.tokenizer.encode_batch([t for _, t in picked]) if picked else []
                chunk: _Mark | None = _Mark(offset, epoch, ordinal, first)
                for (k, _), ids in zip(picked, encoded):
                    if eos is not None:
                        ids = [*ids, eos]
                    if not ids:
                        continue
                    kept_any = True
                    row_mark = _Mark(offset, epoch, ordinal + k, RowCursor(first.file, first.row + k))
                    yield row_mark, ids, chunk
                    chunk = None
                    offset += len(ids)
                ordinal += len(texts)
            if whole_epoch and not kept_any:
                raise DataError(f"the {self.name} split of {self.source.path} has no tokens (every row is empty or "
                                f"held out); give more data or a smaller data.validation_fraction")
            epoch, ordinal, cursor = epoch + 1, 0, RowCursor(0, 0, 0)

    def tokens(self, start: int, end: int) -> np.ndarray:
        """Stream tokens [start, end)."""
        i = bisect.bisect_right([m.offset for m in self._marks], start) - 1
        if start < self._base:
            self._restart(self._marks[i] if i >= 0 else _Mark(0, 0, 0, RowCursor(0, 0, 0)))
        elif i >= 0 and self._marks[i].offset > self._base + self._buf.size:
            self._restart(self._marks[i])  # a restart point (from a checkpoint) beyond what was read: jump there
        # drop what lies before `start` (steps come in order; an earlier start restarts above)
        if start > self._base:
            cut = min(start - self._base, self._buf.size)
            self._buf = self._buf[cut:]
            self._base += cut
        parts = [self._buf]
        have = self._base + self._buf.size
        while have < end:
            mark, ids, chunk = next(self._reader)
            if chunk is not None and (not self._marks or chunk.offset >= self._marks[-1].offset + self.mark_every):
                self._marks.append(chunk)
            self._rows.append((mark.offset, mark))
            while len(self._rows) > 1 and self._rows[1][0] <= start:
                self._rows.popleft()
            arr = np.asarray(ids, dtype=np.int64)
            if mark.offset + arr.size <= start:  # wholly before the window: skip it
                self._base = mark.offset + arr.size
                parts = [np.zeros(0, dtype=np.int64)]
            elif mark.offset < start:
                self._base = start
                parts = [arr[start - mark.offset:]]
            else:
                parts.append(arr)
            have = mark.offset + arr.size
        self._buf = np.concatenate(parts) if len(parts) > 1 else parts[0]
        while len(self._rows) > 1 and self._rows[1][0] <= self._base:
            self._rows.popleft()
        return self._buf[start - self._base:end - self._base]

    def restart_point(self, offset: int) -> dict | None:
        """The latest remembered place to start reading again at or before stream token `offset`, as JSON
        (None: none remembered but the start). `seed_restart_point` takes it in another process."""
        i = bisect.bisect_right([m.offset for m in self._marks], offset) - 1
        if i < 0 or self._marks[i].offset == 0:
            return None
        m = self._marks[i]
        return {"source": self._identity(), "offset": m.offset, "epoch": m.epoch, "ordinal": m.ordinal,
                "file": m.cursor.file, "row": m.cursor.row, "byte": m.cursor.byte}

    def seed_restart_point(self, point: dict) -> bool:
        """Remember a restart point written by `restart_point` (from a checkpoint), so reading to a later
        offset starts there instead of at the beginning; False (and nothing changes) when it was written for
        other files or another split."""
        if point.get("source") != self._identity():
            return False
        mark = _Mark(int(point["offset"]), int(point["epoch"]), int(point["ordinal"]),
                     RowCursor(int(point["file"]), int(point["row"]), int(point["byte"])))
        offsets = [m.offset for m in self._marks]
        if mark.offset not in offsets:
            self._marks.insert(bisect.bisect_left(offsets, mark.offset), mark)
        return True

    def _identity(self) -> list:
        """What a restart point is only valid for: the files (name and size), the field, the split and the
        tokenizer's vocabulary size."""
        return [[f.name, f.stat().st_size] for f in self.source.files] + [self.source.field, self.name,
                                                                            self.tokenizer.vocab_size]

    def position(self, offset: int) -> DataPosition:
        """Where stream token `offset` lies in the source (read forward to it if need be)."""
        self.tokens(offset, offset + 1)
        for row_start, mark in reversed(self._rows):
            if row_start <= offset:
                return DataPosition(mark.epoch, self.source.files[mark.cursor.file], mark.cursor.row,
                                    offset - row_start)
        raise AssertionError("the row holding a buffered token is always kept")  # pragma: no cover


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise over uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def window_order(seed: int, window: int, size: int) -> np.ndarray:
    """The permutation of `size` places of shuffled window `window`: the places sorted by a 64-bit hash of
    (seed, window, place). Plain integer arithmetic, so every node, process and library version draws the same."""
    # splitmix64 twice: a key from (seed, window), then one hash per place from the key's own sequence
    key = _mix64(np.array([(seed * _GOLDEN + window * _ODD + _ODD) & _MASK], dtype=np.uint64))
    with np.errstate(over="ignore"):
        hashed = _mix64(key + np.arange(1, size + 1, dtype=np.uint64) * np.uint64(_GOLDEN))
    return np.argsort(hashed, kind="stable")


class StreamingDataset:
    """Packed samples of a streamed source, addressed like `TokenDataset`: the rows of a step's global batch.

    `shuffle_window` W > 0 reads the training samples in the seeded order of the module docstring (0: in source
    order); held-out samples are read in source order."""

    def __init__(self, train: PackedStream, seq_len: int, validation: PackedStream | None = None, *,
                 shuffle_window: int = 0, seed: int = 0):
        if shuffle_window < 0:
            raise ValueError(f"shuffle_window must be 0 (source order) or positive, got {shuffle_window}")
        self.train, self.validation, self.seq_len = train, validation, seq_len
        self.shuffle_window, self.seed = shuffle_window, seed
        self._windows: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # window -> (its order, its tokens)

    def sample_at(self, place: int) -> int:
        """The training sample in place `place` of the training order (shuffled: its window is read, as the step
        that trains on it will)."""
        if not self.shuffle_window:
            return place
        w, j = divmod(place, self.shuffle_window)
        return w * self.shuffle_window + int(self._window(w)[0][j])

    def _window(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        """(order, tokens) of shuffled window `w`, the tokens its samples end to end, plus one. The two read last
        are kept: a step's rows lie in at most two, read in order."""
        held = self._windows.pop(w, None)
        if held is not None:
            self._windows[w] = held  # now the most recently read
            return held
        n = self.shuffle_window * self.seq_len
        order, flat = window_order(self.seed, w, self.shuffle_window), self.train.tokens(w * n, (w + 1) * n + 1)
        self._windows[w] = (order, flat)
        while len(self._windows) > 2:  # the least recently read goes
            del self._windows[next(iter(self._windows))]
        return order, flat

    def _shuffled(self, first_place: int, count: int) -> Batch:
        L, W = self.seq_len, self.shuffle_window
        inputs, targets = torch.empty(count, L, dtype=torch.int64), torch.empty(count, L, dtype=torch.int64)
        for r, place in enumerate(range(first_place, first_place + count)):
            w, j = divmod(place, W)
            order, flat = self._window(w)
            k = int(order[j]) * L  # the sample's first token within its window
            inputs[r] = torch.from_numpy(flat[k:k + L].copy())
            targets[r] = torch.from_numpy(flat[k + 1:k + L + 1].copy())
        return Batch(inputs, targets)

    def _samples(self, stream: PackedStream, first_sample: int, count: int) -> Batch:
        L = self.seq_len
        flat = stream.tokens(first_sample * L, (first_sample + count) * L + 1)
        # sample i is flat[i L : i L + L + 1]: its inputs and targets are two shifted views of the same tokens
        inputs = torch.from_numpy(flat[:count * L].reshape(count, L).copy())
        targets = torch.from_numpy(flat[1:count * L + 1].reshape(count, L).copy())
        return Batch(inputs, targets)

    def rows(self, step: int, global_batch: int, first: int, last: int) -> Batch:
        """Rows [first, last) of the global batch of `step`: the samples in places step * global_batch + [first,
        last) of the training order."""
        if not 0 <= first < last <= global_batch:
            raise ValueError(f"rows [{first}, {last}) are outside a global batch of {global_batch}")
        if self.shuffle_window:
            return self._shuffled(step * global_batch + first, last - first)
        return self._samples(self.train, step * global_batch + first, last - first)

    def global_batch(self, step: int, global_batch: int) -> Batch:
        return self.rows(step, global_batch, 0, global_batch)

    def validation_rows(self, batch: int, global_batch: int, first: int, last: int) -> Batch:
        """Rows [first, last) of held-out batch `batch` (the same batches at every evaluation)."""
        if self.validation is None:
            raise DataError("this job has no held-out data: set data.validation_fraction or data.validation")
        if not 0 <= first < last <= global_batch:
            raise ValueError(f"rows [{first}, {last}) are outside a global batch of {global_batch}")
        return self._samples(self.validation, batch * global_batch + first, last - first)

    @property
    def has_validation(self) -> bool:
        return self.validation is not None

    def position(self, sample: int) -> DataPosition:
        """Where the training sample in place `sample` of the training order (the data position of step k is
        k x global batch) starts."""
        return self.train.position(self.sample_at(sample) * self.seq_len)

    def save_cursor(self, folder: Path, sample: int) -> Path | None:
        """Write where to start reading to reach the training sample in place `sample` (and, shuffled, the rest of
        its window) into `folder` (a checkpoint's step folder; atomically), with the sample's position for people;
        None when there is nothing to save."""
        W = self.shuffle_window
        first = sample // W * W if W else sample  # a shuffled window is read from its start
        point = self.train.restart_point(first * self.seq_len)
        if point is None:
            return None
        pos = self.position(sample)
        point["position"] = {"sample": sample, "epoch": pos.epoch, "file": str(pos.file), "row": pos.row,
                             "token": pos.token}
        path = Path(folder) / CURSOR_FILE
        atomic_write_text(path, json.dumps(point, indent=1) + "\n")
        return path

    def load_cursor(self, folder: Path) -> bool:
        """Take the restart point a checkpoint's step folder holds, if any (and if it fits this source); the
        rows are the same either way, only reading to them is quicker."""
        path = Path(folder) / CURSOR_FILE
        if not path.is_file():
            return False
        try:
            point = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return self.train.seed_restart_point(point)


# --- a job's dataset ----------------------------------------------------------------------------------------

def open_dataset(data, *, seq_len: int, seed: int = 0, vocab_size: int | None = None
                 ) -> StreamingDataset | TokenDataset:
    """The dataset of a job's `[data]` section (`atoll.job.DataSpec`): random windows of the shipped corpus
    ("builtin", held in memory) or packed samples of a streamed source (text, JSONL, Parquet, datasets),
    tokenized by the job's tokenizer; `vocab_size` (the model's) must fit it. Raises DataError saying what to
    change."""
    from atoll.node.tokenizer import load_tokenizer

    tok = load_tokenizer(data.tokenizer, vocab_size=vocab_size)
    kind = _kind(data.source, data.format)
    if data.source == BUILTIN_CORPUS:
        held = data.validation
        if held and (held == BUILTIN_CORPUS or _kind(held, "auto") != "text" or not Path(held).is_file()):
            raise DataError(f"data.validation {held} is not a text file; with the builtin corpus give a text file "
                            f"(or data.validation_fraction)")
        try:
            return TokenDataset.from_source(data.source, seq_len, seed, tokenizer=tok,
                                            validation_fraction=data.validation_fraction, validation=held)
        except (FileNotFoundError, ValueError) as e:  # no such file; too few tokens for a sample
            raise DataError(str(e)) from None
    source = Source.open(data.source, kind, data.field)
    fraction = data.validation_fraction
    train = PackedStream(source, tok, keep=lambda r: not held_out(r, fraction), name="training")
    validation = None
    if data.validation:
        validation = PackedStream(Source.open(data.validation, "auto", data.field), tok, name="validation")
    elif fraction:
        validation = PackedStream(source, tok, keep=lambda r: held_out(r, fraction), name="validation")
    return StreamingDataset(train, seq_len, validation, shuffle_window=data.shuffle_window if data.shuffle else 0,
                            seed=seed)


def _kind(source: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if source == BUILTIN_CORPUS:
        return "text"
    p = Path(source)
    if not p.exists():
        raise DataError(f"data source {shown_path(p)} does not exist; give a text, JSONL or Parquet file, a folder of them or a "
                        f"datasets.save_to_disk folder (each node reads it from its own disk)")
    return detect_format(p)


def check_data(data, *, vocab_size: int) -> None:
    """Raise DataError now, before training, when this node cannot read the job's `[data]`: a missing file, a
    field its rows lack, a tokenizer that is missing or larger than the model's vocabulary. Reads no more
    than each source's first rows (nothing is tokenized)."""
    from atoll.node.tokenizer import load_tokenizer

    load_tokenizer(data.tokenizer, vocab_size=vocab_size)
    for source, fmt in ((data.source, data.format), (data.validation, "auto")):
        if not source:
            continue
        if source != BUILTIN_CORPUS:
            Source.open(source, _kind(source, fmt), data.field)
