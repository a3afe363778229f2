"""Hugging Face tokenizers: training a byte-level BPE (`atoll tokenizer train`), loading it, fitting the model."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from atoll.job import JobSpec, JobSpecError
from atoll.launch.cli import main
from atoll.node.data import ByteTokenizer, load_text
from atoll.node.datasets import DataError
from atoll.node.tokenizer import EOS_TOKEN, HFTokenizer, corpus_texts, load_tokenizer, train_bpe

REPO = Path(__file__).resolve().parent.parent


def _paragraphs(n: int = 120) -> list[str]:
    return [p for p in load_text("builtin").split("\n\n") if p.strip()][:n]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": p}) + "\n" for i, p in enumerate(_paragraphs())))
    return path


def test_trained_bpe_round_trips_text_and_compresses_it(tmp_path: Path, corpus: Path) -> None:
    seen: list[tuple[int, int]] = []
    tok = train_bpe([corpus], vocab_size=600, out=tmp_path / "tok" / "tokenizer.json",
                    progress=lambda d, b: seen.append((d, b)))
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    assert 300 < tok.vocab_size <= 600
    assert tok.eos_id == 0 and tok.tok.id_to_token(0) == EOS_TOKEN
    assert seen and seen[-1][0] == 120  # every document was read, in chunks
    loaded = load_tokenizer(str(tmp_path / "tok" / "tokenizer.json"), vocab_size=600)
    assert isinstance(loaded, HFTokenizer) and loaded.vocab_size == tok.vocab_size
    text = _paragraphs()[3] + " ünïcode ✓ and words never seen: qzxv"
    ids = loaded.encode(text)
    assert loaded.decode(ids) == text  # byte-level: any text round-trips
    assert ids.numel() < 0.6 * len(text.encode("utf-8"))  # merges learnt on the corpus shorten it
    assert loaded.encode_batch([text, "In the beginning"])[0] == ids.tolist()


def test_trains_on_text_parquet_and_datasets_folders(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")

    paras = _paragraphs(60)
    (tmp_path / "a.txt").write_text("\n".join(paras[:20]))
    pq.write_table(pa.table({"body": paras[20:40]}), tmp_path / "b.parquet")
    datasets.Dataset.from_dict({"body": paras[40:]}).save_to_disk(str(tmp_path / "c"))
    docs = [t for chunk in corpus_texts([tmp_path / "a.txt", tmp_path / "b.parquet", tmp_path / "c"], field="body")
            for t in chunk]
    assert docs[-40:] == paras[20:]
    tok = train_bpe([tmp_path / "a.txt", tmp_path / "b.parquet", tmp_path / "c"], vocab_size=400,
                    out=tmp_path / "t.json", field="body")
    assert tok.decode(tok.encode(paras[50])) == paras[50]


def test_cli_trains_and_prints_progress(tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tokenizer.json"
    assert main(["tokenizer", "train", "--corpus", str(corpus), "--vocab-size", "500", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "read 120 documents" in captured.err
    assert f"wrote {out}" in captured.out and "model.vocab_size >= " in captured.out
    assert HFTokenizer(out).vocab_size <= 500


def test_cli_errors_are_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tokenizer", "train", "--corpus", str(tmp_path / "nope.jsonl"), "--vocab-size", "500",
                 "--out", str(tmp_path / "t.json")]) != 0
    assert "nope.jsonl does not exist" in capsys.readouterr().err
    with pytest.raises(DataError, match="too small"):
        train_bpe([tmp_path], vocab_size=100, out=tmp_path / "t.json")


def test_model_vocabulary_must_fit_the_tokenizer(tmp_path: Path, corpus: Path) -> None:
    train_bpe([corpus], vocab_size=600, out=tmp_path / "tokenizer.json")
    n = HFTokenizer(tmp_path / "tokenizer.json").vocab_size
    with pytest.raises(DataError, match=rf"model.vocab_size \(300\) is below the {n} tokens.*set model.vocab_size = {n}"):
        load_tokenizer(str(tmp_path / "tokenizer.json"), vocab_size=300)
    with pytest.raises(DataError, match="does not exist; train one with `atoll tokenizer train"):
        load_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError, match="is not a tokenizers file"):
        load_tokenizer(str(tmp_path / "bad.json"))
    assert isinstance(load_tokenizer("bytes", vocab_size=256), ByteTokenizer)


def test_job_spec_takes_a_tokenizer_path() -> None:
    base = JobSpec.load(REPO / "examples" / "tiny.toml")
    text = base.to_toml().replace('tokenizer = "bytes"', 'tokenizer = "tok/tokenizer.json"')
    job = JobSpec.from_toml(text)
    assert job.data.tokenizer == "tok/tokenizer.json"
    with pytest.raises(JobSpecError, match='data.tokenizer must be "bytes" or the path of a tokenizer.json'):
        JobSpec.from_toml(base.to_toml().replace('tokenizer = "bytes"', 'tokenizer = "gpt2"'))
    # jobs that set none of the new data fields keep their ids
    assert replace(base, id="").id == base.id


def test_the_progress_line_rewrites_itself_on_a_terminal_and_logs_sparingly_elsewhere() -> None:
    import io

    from atoll.node.tokenizer import ProgressLine

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, log = Tty(), io.StringIO()
    for stream in (tty, log):
        line = ProgressLine(stream, interval=0.0, log_interval=3600.0)
        line(10, 1000)
        line(20, 2000, final=True)
    assert tty.getvalue().count("\r") == 1 and tty.getvalue().endswith("\n")
    # a log (a file, a pipe) gets the final line alone from a run shorter than log_interval, and no carriage return
    assert log.getvalue().count("\n") == 1 and "\r" not in log.getvalue() and "20 documents" in log.getvalue()


def test_a_missing_relative_path_is_named_with_the_folder_it_was_read_in(tmp_path, monkeypatch) -> None:
    """A job spec's paths are read from the folder the command runs in: the message says which."""
    import pytest

    from atoll.hf import load_hf_config
    from atoll.node.datasets import DataError
    from atoll.node.tokenizer import load_tokenizer

    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=f"tokenizer file tok.json \\(in {tmp_path}\\) does not exist"):
        load_tokenizer("tok.json")
    with pytest.raises(FileNotFoundError, match=f"models/x/config.json \\(in {tmp_path}\\)"):
        load_hf_config("models/x/config.json")
