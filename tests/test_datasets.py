"""Streamed datasets: JSONL, Parquet and datasets folders packed into samples, exact resume, sharding over
replicas, the seeded shuffle, the held-out split, bad configs, and the validation loss of a pipeline run.

The tests of the packing itself (sample i is the stream's window i, where each starts) read in source order
(`shuffle=False`); the shuffled order is tested against it."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from pipeline_harness import run_pinned_plan, stage, tiny_job

from atoll.job import DataSpec, JobSpec, JobSpecError
from atoll.node.data import ByteTokenizer, TokenDataset, load_text
from atoll.node.datasets import DataError, StreamingDataset, check_data, held_out, open_dataset
from atoll.node.local import train_local
from atoll.node.model import lm_loss
from atoll.node.tokenizer import train_bpe
from atoll.plan import PipelinePlan

REPO = Path(__file__).resolve().parent.parent
B, L = 4, 32


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read and tokenize 8 rows at a time, so these small corpora cross many chunk boundaries."""
    import atoll.node.datasets

    monkeypatch.setattr(atoll.node.datasets, "CHUNK_ROWS", 8)


def _docs(n: int = 200) -> list[str]:
    """Documents of uneven length, each tagged <nnnn> so a window's text says which rows it came from."""
    paras = [p for p in load_text("builtin").split("\n\n") if p.strip()]
    return [f"<{i:04d}> " + paras[i % len(paras)][: 40 + (i * 37) % 300] for i in range(n)]


def _jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({"id": i, key: d}) + "\n" + ("\n" if i % 17 == 0 else "")
                            for i, d in enumerate(docs)))  # blank lines are skipped, not rows
    return path


def _parquet_folder(folder: Path, docs: list[str]) -> Path:
    folder.mkdir()
    half = len(docs) // 2  # two files, row groups of 7 rows: reading resumes inside a file and a group
    pq.write_table(pa.table({"text": docs[:half], "n": list(range(half))}), folder / "part-0.parquet", row_group_size=7)
    pq.write_table(pa.table({"text": docs[half:], "n": list(range(len(docs) - half))}), folder / "part-1.parquet",
                   row_group_size=7)
    return folder


def _expected_position(docs: list[str], encode, eos: int | None, sample: int) -> tuple[int, int]:
    """(row, token in row) where training sample `sample` starts, counted directly (one epoch, no split)."""
    offset, target = 0, sample * L
    for i, d in enumerate(docs):
        n = len(encode(d)) + (eos is not None)
        if offset + n > target:
            return i, target - offset
        offset += n
    raise AssertionError("sample beyond the first epoch")


def _check_resume(spec: DataSpec, docs: list[str], vocab: int, files_rows: list[int]) -> None:
    straight = open_dataset(spec, seq_len=L, vocab_size=vocab)
    assert isinstance(straight, StreamingDataset)
    straight.train.mark_every = 100  # remember a restart point every 100 tokens (a chunk's first row)
    batches = [straight.rows(k, B, 0, B) for k in range(40)]
    # going back (a rollback to an older checkpoint) restarts from the nearest remembered chunk
    assert len(straight.train._marks) > 3
    for k in (30, 3, 0, 20, 39):
        again = straight.rows(k, B, 1, 3)
        assert torch.equal(again.inputs, batches[k].inputs[1:3]) and torch.equal(again.targets, batches[k].targets[1:3])
    tok = straight.train.tokenizer
    # a resumed node: a fresh dataset asked for step 7 first (the checkpoint's position is 7 x B samples)
    resumed = open_dataset(spec, seq_len=L, vocab_size=vocab)
    for k in range(7, 12):
        got = resumed.rows(k, B, 0, B)
        assert torch.equal(got.inputs, batches[k].inputs) and torch.equal(got.targets, batches[k].targets)
    pos = resumed.position(7 * B)
    row, token = _expected_position(docs, lambda d: tok.encode_batch([d])[0], tok.eos_id, 7 * B)
    file = next(f for f, start in enumerate([0, *files_rows]) if start <= row < ([*files_rows, 10**9])[f])
    assert (pos.epoch, pos.row, pos.token) == (0, row - ([0, *files_rows])[file], token)
    assert pos.file.name == straight.train.source.files[file].name
    # the sample starts at that token of that row
    ids = tok.encode_batch([docs[row]])[0] + ([tok.eos_id] if tok.eos_id is not None else [])
    head = ids[token:token + L]
    assert batches[7].inputs[0, : len(head)].tolist() == head


def test_jsonl_resumes_at_the_exact_row(tmp_path: Path) -> None:
    docs = _docs()
    spec = DataSpec(source=str(_jsonl(tmp_path / "c.jsonl", docs)), shuffle=False)
    _check_resume(spec, docs, 256, [])


def test_parquet_resumes_at_the_exact_row_with_a_trained_tokenizer(tmp_path: Path) -> None:
    docs = _docs()
    folder = _parquet_folder(tmp_path / "pq", docs)
    tok = train_bpe([folder], vocab_size=400, out=tmp_path / "tokenizer.json")
    spec = DataSpec(source=str(folder), tokenizer=str(tmp_path / "tokenizer.json"), shuffle=False)
    _check_resume(spec, docs, tok.vocab_size, [len(docs) // 2])


def test_text_file_streams_its_lines_and_resumes_at_the_exact_line(tmp_path: Path) -> None:
    lines = [d.replace("\n", " ") + "\n" for d in _docs()]
    (tmp_path / "c.txt").write_text("".join(lines))
    spec = DataSpec(source=str(tmp_path / "c.txt"), shuffle=False)
    _check_resume(spec, lines, 256, [])
    # one running text: no end-of-text token between lines, even with a tokenizer that has one
    tok = train_bpe([tmp_path / "c.txt"], vocab_size=400, out=tmp_path / "tokenizer.json")
    ds = open_dataset(DataSpec(source=str(tmp_path / "c.txt"), tokenizer=str(tmp_path / "tokenizer.json")),
                      seq_len=L, vocab_size=tok.vocab_size)
    assert tok.eos_id not in ds.global_batch(0, 64).inputs


def test_a_checkpoints_restart_point_skips_the_rows_before_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import atoll.node.datasets

    monkeypatch.setattr(atoll.node.datasets, "MARK_EVERY", 100)
    docs = _docs()
    spec = DataSpec(source=str(_jsonl(tmp_path / "c.jsonl", docs)), validation_fraction=0.1, shuffle=False)
    straight = open_dataset(spec, seq_len=L)
    batches = [straight.rows(k, B, 0, B) for k in range(30)]
    path = straight.save_cursor(tmp_path / "step", 25 * B)
    assert path is not None and path.name == "data-cursor.json"
    saved = json.loads(path.read_text())
    pos = straight.position(25 * B)
    assert saved["position"] == {"sample": 25 * B, "epoch": 0, "file": str(pos.file), "row": pos.row,
                                 "token": pos.token}
    assert 0 < saved["offset"] <= 25 * B * L
    resumed = open_dataset(spec, seq_len=L)
    encoded: list[str] = []
    encode = resumed.train.tokenizer.encode_batch
    monkeypatch.setattr(resumed.train.tokenizer, "encode_batch", lambda texts: encoded.extend(texts) or encode(texts))
    assert resumed.load_cursor(tmp_path / "step")
    for k in range(25, 30):
        assert torch.equal(resumed.rows(k, B, 0, B).inputs, batches[k].inputs)
    assert docs.index(encoded[0]) >= saved["row"] > 0  # it began reading at the restart point, not at row 0
    # a restart point of other data is ignored (the rows are the same either way)
    other = open_dataset(DataSpec(source=str(_jsonl(tmp_path / "o.jsonl", docs[:150]))), seq_len=L)
    assert not other.load_cursor(tmp_path / "step")
    assert not open_dataset(spec, seq_len=L).load_cursor(tmp_path / "nowhere")


def test_formats_give_the_same_samples(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")

    docs = _docs(80)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs})}).save_to_disk(str(tmp_path / "dd"))
    sources = [_jsonl(tmp_path / "c.jsonl", docs), _parquet_folder(tmp_path / "pq", docs), tmp_path / "ds",
               tmp_path / "dd"]
    got = [open_dataset(DataSpec(source=str(s)), seq_len=L).global_batch(5, B).inputs for s in sources]
    for g in got[1:]:
        assert torch.equal(g, got[0])
    # the packed stream is the documents end to end (bytes: no end-of-text token)
    first = open_dataset(DataSpec(source=str(sources[0]), shuffle=False), seq_len=L).rows(0, B, 0, B)
    assert ByteTokenizer().decode(first.inputs[0]) == "".join(docs)[:L]


def test_replica_shards_are_deterministic_and_disjoint(tmp_path: Path) -> None:
    spec = DataSpec(source=str(_jsonl(tmp_path / "c.jsonl", _docs())), shuffle=False)
    whole = open_dataset(spec, seq_len=L).global_batch(3, 8)
    for cuts in ([0, 8], [0, 4, 8], [0, 1, 3, 8], [0, 2, 4, 6, 8]):
        # each replica is its own node: its own dataset, asked only for its rows
        parts = [open_dataset(spec, seq_len=L).rows(3, 8, a, b) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat([p.inputs for p in parts]), whole.inputs)
        assert torch.equal(torch.cat([p.targets for p in parts]), whole.targets)
    # samples are disjoint windows of the stream: consecutive rows continue where the previous one ended
    rows = whole.inputs
    for r in range(7):
        assert rows[r + 1, 0] == whole.targets[r, -1]
    # and steps follow each other: step 4's first row continues step 3's last
    nxt = open_dataset(spec, seq_len=L).rows(4, 8, 0, 1)
    assert nxt.inputs[0, 0] == whole.targets[7, -1]


def _samples(batches: list) -> list[tuple[int, ...]]:
    return [tuple(row.tolist()) for b in batches for row in b.inputs]


def test_shuffle_is_seeded_sharded_and_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import atoll.node.datasets

    monkeypatch.setattr(atoll.node.datasets, "MARK_EVERY", 100)
    docs = _docs()
    W = 10  # samples per shuffled window: steps of B = 4 straddle windows
    spec = DataSpec(source=str(_jsonl(tmp_path / "c.jsonl", docs)), shuffle_window=W)
    assert spec.shuffle  # the default
    steps = 30
    source = _samples([open_dataset(replace(spec, shuffle=False, shuffle_window=1024), seq_len=L).rows(k, B, 0, B)
                       for k in range(steps)])
    straight = open_dataset(spec, seq_len=L, seed=5)
    shuffled = [straight.rows(k, B, 0, B) for k in range(steps)]
    order = _samples(shuffled)
    assert order != source
    # each window is a permutation of the source's samples in it: none dropped, none repeated
    for w in range(steps * B // W):
        assert sorted(order[w * W:(w + 1) * W]) == sorted(source[w * W:(w + 1) * W])
        assert order[w * W:(w + 1) * W] != source[w * W:(w + 1) * W]
    for b in shuffled:  # targets are still the inputs shifted by one token of the same sample
        assert torch.equal(b.inputs[:, 1:], b.targets[:, :-1])
    # the same seed gives the same order in another process; another seed another order
    assert _samples([open_dataset(spec, seq_len=L, seed=5).rows(k, B, 0, B) for k in range(steps)]) == order
    assert _samples([open_dataset(spec, seq_len=L, seed=6).rows(k, B, 0, B) for k in range(steps)]) != order
    # replicas, each its own node asking only for its rows: disjoint, and together the global batch
    for cuts in ([0, 2, 4], [0, 1, 3, 4]):
        parts = [open_dataset(spec, seq_len=L, seed=5).rows(7, B, a, b) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat([p.inputs for p in parts]), shuffled[7].inputs)
        assert torch.equal(torch.cat([p.targets for p in parts]), shuffled[7].targets)
    # a resumed node: a fresh dataset asked for step 17 first gives the batches an uninterrupted run read, and
    # the checkpoint's restart point (before the window of step 17's first sample) spares reading from row 0
    path = straight.save_cursor(tmp_path / "step", 17 * B)
    assert path is not None
    saved = json.loads(path.read_text())
    assert 0 < saved["offset"] <= 17 * B // W * W * L
    pos = straight.position(17 * B)  # the position of the sample in place 17 B, not of source sample 17 B
    assert saved["position"] == {"sample": 17 * B, "epoch": pos.epoch, "file": str(pos.file), "row": pos.row,
                                 "token": pos.token}
    assert straight.sample_at(17 * B) != 17 * B
    resumed = open_dataset(spec, seq_len=L, seed=5)
    encoded: list[str] = []
    encode = resumed.train.tokenizer.encode_batch
    monkeypatch.setattr(resumed.train.tokenizer, "encode_batch", lambda texts: encoded.extend(texts) or encode(texts))
    assert resumed.load_cursor(tmp_path / "step")
    for k in range(17, steps):
        got = resumed.rows(k, B, 0, B)
        assert torch.equal(got.inputs, shuffled[k].inputs) and torch.equal(got.targets, shuffled[k].targets)
    assert docs.index(encoded[0]) >= saved["row"] > 0
    # going back (a rollback) reads the same batches again
    for k in (3, 16, 29):
        assert torch.equal(straight.rows(k, B, 1, 3).inputs, shuffled[k].inputs[1:3])


def test_shuffle_options_are_checked_and_jobs_without_them_keep_their_ids(tmp_path: Path) -> None:
    with pytest.raises(JobSpecError, match='do not apply to data.source = "builtin"'):
        DataSpec(shuffle=False)
    with pytest.raises(JobSpecError, match="data.shuffle_window applies when data.shuffle is true"):
        DataSpec(source="c.jsonl", shuffle=False, shuffle_window=64)
    with pytest.raises(JobSpecError, match="data.shuffle_window must be an integer from 1"):
        DataSpec(source="c.jsonl", shuffle_window=0)
    text = (REPO / "examples" / "tiny.toml").read_text()
    job = JobSpec.from_toml(text)
    assert "shuffle" not in job.to_toml()  # written only when set: a job file from before keeps its id
    own = JobSpec.from_toml(text.replace('source = "builtin"', f'source = "{tmp_path}/c.jsonl"'))
    pinned = JobSpec.from_toml(text.replace('source = "builtin"', f'source = "{tmp_path}/c.jsonl"\nshuffle = false'))
    assert own.data.shuffle and not pinned.data.shuffle and pinned.id != own.id
    assert JobSpec.from_toml(pinned.to_toml()) == pinned


def _tags(ids: torch.Tensor) -> set[int]:
    return {int(t) for t in re.findall(r"<(\d{4})>", ByteTokenizer().decode(ids.flatten()))}


def test_held_out_rows_never_reach_training(tmp_path: Path) -> None:
    docs = _docs(200)
    held = {i for i in range(200) if held_out(i, 0.25)}
    assert 35 <= len(held) <= 65
    ds = open_dataset(DataSpec(source=str(_jsonl(tmp_path / "c.jsonl", docs)), validation_fraction=0.25), seq_len=L)
    assert ds.has_validation
    trained = set().union(*(_tags(ds.rows(k, B, 0, B).inputs) for k in range(200)))  # more than an epoch
    kept = set(range(200)) - held
    assert trained <= kept and len(trained) >= 0.9 * len(kept)  # (a tag cut by a window boundary is missed)
    validated = set().union(*(_tags(ds.validation_rows(j, B, 0, B).inputs) for j in range(20)))
    assert validated and validated <= held
    # the same held-out batches at every evaluation, on every node
    again = open_dataset(DataSpec(source=str(tmp_path / "c.jsonl"), validation_fraction=0.25), seq_len=L)
    assert torch.equal(again.validation_rows(1, B, 1, 3).inputs, ds.validation_rows(1, B, 0, B).inputs[1:3])
    # a separate validation source
    other = _jsonl(tmp_path / "v.jsonl", [f"<{9000 + i}> held out text" for i in range(30)])
    sep = open_dataset(DataSpec(source=str(tmp_path / "c.jsonl"), validation=str(other)), seq_len=L)
    assert _tags(sep.validation_rows(0, B, 0, B).inputs) <= set(range(9000, 9030))


def test_text_source_holds_out_its_tail() -> None:
    tokens = torch.arange(10_000)
    ds = TokenDataset(tokens, seq_len=L, seed=3, validation_fraction=0.1)
    for step in range(50):
        assert int(ds.global_batch(step, B).targets.max()) < 9_000
    for j in range(5):
        assert int(ds.validation_rows(j, B, 0, B).inputs.min()) >= 9_000
    # with no split, the default dataset is unchanged: windows over the whole stream
    assert not TokenDataset(tokens, seq_len=L).has_validation
    with pytest.raises(DataError, match=r"the held-out data has \d+ tokens; it needs more than seq_len \+ 1 = 33: raise data.validation_fraction"):
        open_dataset(DataSpec(validation_fraction=1e-5), seq_len=L)


def test_bad_configs_give_one_clear_error(tmp_path: Path) -> None:
    docs = _docs(20)
    src = _jsonl(tmp_path / "c.jsonl", docs)
    with pytest.raises(DataError, match=r"data.field 'body' is not in the first row of .*c.jsonl \(its keys: "
                                        r"\['id', 'text'\]\)"):
        open_dataset(DataSpec(source=str(src), field="body"), seq_len=L)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n\n{"text": 3}\n')
    with pytest.raises(DataError, match=r"line 3 of .*bad.jsonl: field 'text' holds int, not text"):
        open_dataset(DataSpec(source=str(bad)), seq_len=L).rows(0, B, 0, B)
    folder = _parquet_folder(tmp_path / "pq", docs)
    with pytest.raises(DataError, match=r"data.field 'body' is not a column of .*part-0.parquet \(columns: \['text', 'n'\]\)"):
        open_dataset(DataSpec(source=str(folder), field="body"), seq_len=L)
    with pytest.raises(DataError, match="nope.jsonl does not exist"):
        open_dataset(DataSpec(source=str(tmp_path / "nope.jsonl")), seq_len=L)
    train_bpe([src], vocab_size=400, out=tmp_path / "tokenizer.json")
    with pytest.raises(DataError, match=r"model.vocab_size \(256\) is below the"):
        open_dataset(DataSpec(source=str(src), tokenizer=str(tmp_path / "tokenizer.json")), seq_len=L, vocab_size=256)
    with pytest.raises(DataError, match="holds no parquet files"):
        (tmp_path / "empty").mkdir()
        open_dataset(DataSpec(source=str(tmp_path / "empty"), format="parquet"), seq_len=L)
    with pytest.raises(DataError, match="has no tokens"):
        open_dataset(DataSpec(source=str(_jsonl(tmp_path / "e.jsonl", [""] * 3))), seq_len=L).rows(0, B, 0, B)
    # a node checks its data once, before it joins, reading no more than the first rows
    check_data(DataSpec(source=str(src)), vocab_size=256)
    check_data(DataSpec(), vocab_size=256)
    with pytest.raises(DataError, match="data.field 'body' is not a column"):
        check_data(DataSpec(source=str(folder), field="body"), vocab_size=256)
    with pytest.raises(DataError, match="v.jsonl does not exist"):
        check_data(DataSpec(source=str(src), validation=str(tmp_path / "v.jsonl")), vocab_size=256)
    with pytest.raises(DataError, match=r"model.vocab_size \(300\) is below"):
        check_data(DataSpec(source=str(src), tokenizer=str(tmp_path / "tokenizer.json")), vocab_size=300)
    base = JobSpec.load(REPO / "examples" / "tiny.toml").to_toml()
    with pytest.raises(JobSpecError, match="train.eval_every needs held-out data"):
        JobSpec.from_toml(base.replace('schedule = "1f1b"', 'schedule = "1f1b"\neval_every = 5'))
    with pytest.raises(JobSpecError, match="not both"):
        JobSpec.from_toml(base.replace('tokenizer = "bytes"', 'tokenizer = "bytes"\nvalidation_fraction = 0.1\n'
                                       'validation = "v.jsonl"'))
    with pytest.raises(JobSpecError, match="data.validation_fraction must be in"):
        JobSpec.from_toml(base.replace('tokenizer = "bytes"', 'tokenizer = "bytes"\nvalidation_fraction = 1.0'))
    spec = JobSpec.from_toml(base.replace('tokenizer = "bytes"', 'tokenizer = "bytes"\nfield = "body"\n'
                                          'validation_fraction = 0.05'))
    assert JobSpec.from_toml(spec.to_toml()) == spec


# --- through the pipeline ---------------------------------------------------------------------------------

def _pipeline_job(tmp_path: Path, steps: int, interval: int = 0) -> JobSpec:
    job = tiny_job(steps, interval=interval, warmup=1)
    # shuffled in windows of 24 samples: a step of 16 straddles two, and a resume at step 2 starts inside the second
    return replace(job, data=DataSpec(source=str(_jsonl(tmp_path / "c.jsonl", _docs(300))), validation_fraction=0.2,
                                      shuffle_window=24),
                   train=replace(job.train, eval_every=2, eval_batches=2))  # together: eval_every needs held-out data


def _run(job: JobSpec, tmp_path: Path, *, resume_step: int = 0, stop_after: int | None = None,
         widths: tuple[str, ...] = ("a", "b"), lanes: tuple[int, int] = (1, 1)) -> dict[int, tuple[float, float | None]]:
    """Two stages, the nodes of each given by `widths` ("a", "bc": a second stage two replicas wide), in `lanes`;
    step -> (loss, val_loss)."""
    pipeline = PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[stage((0, 3), widths[0], lanes=lanes[0]),
                                                                      stage((3, 6), widths[1], lanes=lanes[1])])
    run = run_pinned_plan(job, [pipeline], tmp_path / "ckpt", resume_step=resume_step, until_step=stop_after)
    return {m.step: (m.loss, m.val_loss) for m in run.reports if m.loss is not None}


def _one_process_val_loss(job: JobSpec, module: torch.nn.Module) -> float:
    data = open_dataset(job.data, seq_len=job.train.seq_len, seed=job.train.seed)
    m = job.train.global_batch // job.train.micro_batch
    losses = []
    with torch.no_grad():
        for j in range(job.train.eval_batches):
            b = data.validation_rows(j, job.train.global_batch, 0, job.train.global_batch)
            for x, y in zip(b.inputs.chunk(m), b.targets.chunk(m)):
                losses.append(float(lm_loss(module(x), y)))
    return sum(losses) / len(losses)


@pytest.mark.timeout(240)
def test_pipeline_reports_validation_loss_and_resumes_at_the_exact_row(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import atoll.node.datasets

    monkeypatch.setattr(atoll.node.datasets, "MARK_EVERY", 200)
    job = _pipeline_job(tmp_path, steps=4, interval=2)
    expected, trained = train_local(job)
    first = _run(job, tmp_path, stop_after=2)
    cursor = json.loads((tmp_path / "ckpt" / "step-00000002" / "data-cursor.json").read_text())
    assert cursor["position"]["sample"] == 2 * job.train.global_batch and cursor["offset"] > 0
    second = _run(job, tmp_path, resume_step=2)
    got = {**first, **second}
    assert sorted(got) == [0, 1, 2, 3]
    # the JSONL stream resumed at sample 2 x global batch: the same losses as one process straight through
    for s in range(4):
        assert abs(got[s][0] - expected[s]) <= 1e-4 * abs(expected[s]), (s, got[s], expected[s])
    # a validation pass after steps 2 and 4 (eval_every = 2, and the last step), forward only through both stages
    assert [s for s in range(4) if got[s][1] is not None] == [1, 3]
    for s, module in ((1, train_local(job, steps=2)[1]), (3, trained)):
        want = _one_process_val_loss(job, module)
        assert abs(got[s][1] - want) <= 1e-4 * want, (s, got[s][1], want)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("lanes", [(1, 1), (2, 2)])
def test_validation_loss_over_a_stage_of_two_replicas(tmp_path: Path, lanes: tuple[int, int]) -> None:
    """The last stage two replicas wide: each takes its rows of every held-out micro-batch from the one replica
    upstream, and their row-weighted mean is the batch's validation loss. In lanes (both stages two replicas in
    two lanes): each replica passes its lane's held-out micro-batches, whole."""
    job = _pipeline_job(tmp_path, steps=2)
    expected, trained = train_local(job)
    got = _run(job, tmp_path, widths=("a", "bc") if lanes == (1, 1) else ("ad", "bc"), lanes=lanes)
    assert sorted(got) == [0, 1] and got[0][1] is None
    for s in range(2):
        assert abs(got[s][0] - expected[s]) <= 1e-4 * abs(expected[s]), (s, got[s], expected[s])
    want = _one_process_val_loss(job, trained)
    assert abs(got[1][1] - want) <= 1e-4 * want, (got[1][1], want)
