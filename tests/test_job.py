"""The job spec: loading, validation messages that name the field, and the TOML round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from atoll.job import JobSpec, JobSpecError
from atoll.models import preset

ROOT = Path(__file__).resolve().parents[1]

BASE = """
[job]
name = "t"
[model]
preset = "tiny"
[train]
global_batch = 8
seq_len = 32
micro_batch = 2
steps = 10
"""


def test_tiny_example_loads_with_the_demo_settings() -> None:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    assert job.model == preset("tiny")
    assert (job.train.global_batch, job.train.seq_len, job.train.micro_batch) == (16, 64, 4)
    assert job.checkpoint.interval == 25
    assert job.compression.mode == "adaptive"
    assert job.cluster.expected_nodes == 3
    assert job.train.num_micro_batches == 4


def test_round_trip_keeps_everything_including_the_derived_id() -> None:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    again = JobSpec.from_toml(job.to_toml())
    assert again == job
    assert job.id.startswith("tiny-")


def test_explicit_model_and_preset_overrides() -> None:
    job = JobSpec.from_toml(BASE.replace('preset = "tiny"', 'preset = "tiny"\nn_layers = 6'))
    assert job.model.n_layers == 6 and job.model.d_model == preset("tiny").d_model
    assert JobSpec.from_toml(job.to_toml()) == job
    explicit = BASE.replace('preset = "tiny"', "vocab_size = 256\nd_model = 32\nn_layers = 2\nn_heads = 2\nseq_len = 32")
    job2 = JobSpec.from_toml(explicit)
    assert job2.model_preset is None and job2.model.d_model == 32
    assert JobSpec.from_toml(job2.to_toml()) == job2


def test_id_depends_on_content_and_can_be_given() -> None:
    a = JobSpec.from_toml(BASE)
    b = JobSpec.from_toml(BASE.replace("steps = 10", "steps = 11"))
    assert a.id != b.id
    c = JobSpec.from_toml(BASE.replace('name = "t"', 'name = "t"\nid = "run-7"'))
    assert c.id == "run-7"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (("micro_batch = 2", "micro_batch = 3"), "train.micro_batch"),
        (("seq_len = 32", "seq_len = 4096"), "train.seq_len"),
        (("steps = 10", 'steps = "ten"'), "train.steps must be an integer"),
        (("steps = 10", "steps = 10\nlearning_rate = 1"), "learning_rate"),
        (('preset = "tiny"', 'preset = "huge"'), "preset"),
        (('preset = "tiny"', 'preset = "tiny"\nn_heads = 5'), "model.n_heads"),
        (('name = "t"', 'name = "a b"'), "job.name"),
        (("[train]", '[compression]\nmode = "zip"\n[train]'), "compression.mode"),
        (("[train]", "[cluster]\nexpected_nodes = 2\nmin_nodes = 3\n[train]"), "cluster.min_nodes"),
        (("[train]", '[data]\ntokenizer = "bpe"\n[train]'), "data.tokenizer"),
        (("[train]", "[extra]\nx = 1\n[train]"), "unknown section"),
        (("steps = 10", "steps = 10\ndtype = \"fp8\""), "train.dtype"),
        (("steps = 10", "steps = 10\nschedule = \"zb\""), "train.schedule"),
        (("micro_batch = 2\n", ""), "train.micro_batch"),
        (("global_batch = 8", "global_batch = 8\n[oops"), "not valid TOML"),
    ],
)
def test_invalid_specs_name_the_field(change: tuple[str, str], needle: str) -> None:
    text = BASE.replace(*change)
    assert text != BASE
    with pytest.raises(JobSpecError, match=needle.replace("[", r"\[")):
        JobSpec.from_toml(text)


def test_an_unknown_train_field_lists_precision_as_the_examples_spell_it() -> None:
    with pytest.raises(JobSpecError, match=r"'precision \(or dtype\)'") as e:
        JobSpec.from_toml(BASE.replace("steps = 10", 'steps = 10\nprecison = "bf16"'))
    assert "'dtype'" not in str(e.value)


def test_missing_train_and_name_and_file() -> None:
    with pytest.raises(JobSpecError, match=r"\[train\] is missing"):
        JobSpec.from_toml('[job]\nname = "x"\n[model]\npreset = "tiny"\n')
    with pytest.raises(JobSpecError, match="job.name is missing"):
        JobSpec.from_toml(BASE.replace('name = "t"', ""))
    with pytest.raises(FileNotFoundError, match="tiny.toml"):
        JobSpec.load("/nonexistent/tiny.toml")


def test_load_prefixes_the_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(BASE.replace("steps = 10", "steps = 0"))
    with pytest.raises(JobSpecError, match=r"bad\.toml: train\.steps must be positive"):
        JobSpec.load(p)
