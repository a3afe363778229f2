"""Bad input files are refused with one line that names the file, the field, the value and what to do: job
specs whose numbers lie past what the wire and torch take (or are not finite), model shapes past generous size
limits, model JSON files and Hugging Face configs with fields of the wrong type, and files that are folders or
not UTF-8 text."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from atoll.hf import HF_PRESETS, HfConfigError, config_from_file, config_from_hf
from atoll.job import MAX_SEED, JobSpec, JobSpecError, resolve_token
from atoll.launch.cli import main
from atoll.models import load_model_config, preset
from atoll.modelspec import ModelConfig

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "examples" / "clusters" / "mixed-a100-v100.toml"

SECTIONS = {"job": ['name = "t"'], "model": ['preset = "tiny"'],
            "train": ["global_batch = 8", "seq_len = 32", "micro_batch = 2", "steps = 10"]}
"""A valid job spec, section by section."""


def _spec(section: str, line: str) -> str:
    """The spec of SECTIONS with `line` (`key = value`) in `section`, in place of that section's line of the key."""
    key = line.split(" =")[0]
    sections = {name: [x for x in lines if name != section or x.split(" =")[0] != key]
                for name, lines in SECTIONS.items()}
    sections.setdefault(section, []).append(line)
    return "".join(f"[{name}]\n" + "".join(f"{x}\n" for x in lines) for name, lines in sections.items())


BASE = _spec("job", 'name = "t"')

MODEL = preset("tiny").to_dict()
"""A valid model JSON object (the tiny preset)."""

LLAMA = HF_PRESETS["llama-3.2-1b"]
GPT2 = HF_PRESETS["gpt2"]


def _raises(error: type[Exception], *needles: str) -> Any:
    """pytest.raises for a message holding every needle, in that order."""
    return pytest.raises(error, match=".*".join(re.escape(n) for n in needles))


# --- 1. integers of the job spec bounded where the wire and torch stop ---------------------------------------

@pytest.mark.parametrize(("section", "line", "needles"), [
    ("train", "steps = 99999999999999999999999", ("train.steps must be at most 1,000,000,000,000", "got 9999")),
    ("train", "global_batch = 20000000", ("train.global_batch must be at most 16,777,216",)),
    ("train", "seed = 1099511627776", ("train.seed", "2**40 - 1", "signed 64-bit", "got 1099511627776")),
    ("train", "seed = 9223372036854775807", ("train.seed", "signed 64-bit")),
    ("train", "eval_every = 10000000000000", ("train.eval_every must be at most",)),
    ("train", "eval_batches = 1000000000", ("train.eval_batches must be at most 1,000,000",)),
    ("train", "loss_scale_window = 10000000000000", ("train.loss_scale_window must be at most",)),
    ("checkpoint", "interval = 10000000000000", ("checkpoint.interval must be at most",)),
    ("checkpoint", "keep = 10000000000000", ("checkpoint.keep must be at most",)),
    ("checkpoint", "replicas = 10000000", ("checkpoint.replicas must be at most 1,000,000",)),
    ("cluster", "expected_nodes = 10000000\nmin_nodes = 1", ("cluster.expected_nodes must be at most 1,000,000",)),
    ("outer", "inner_steps = 5000000000", ("outer.inner_steps must be at most 1,000,000,000",)),
    ("outer", "apply_after = 5000000000", ("outer.apply_after must be at most",)),
])
def test_job_integers_past_their_range_are_refused(section: str, line: str, needles: tuple[str, ...]) -> None:
    with _raises(JobSpecError, *needles):
        JobSpec.from_toml(_spec(section, line))


def test_job_tokens_must_fit_64_bits() -> None:
    text = BASE.replace("steps = 10", "steps = 1000000000000").replace("global_batch = 8", "global_batch = 16000000")
    with _raises(JobSpecError, "train.steps x train.global_batch x train.seq_len", "64-bit", "lower train.steps"):
        JobSpec.from_toml(text)


def test_job_integers_at_their_limits_are_taken() -> None:
    job = JobSpec.from_toml(_spec("train", f"seed = {MAX_SEED}").replace("steps = 10", "steps = 1000000000000"))
    assert job.train.seed == 2**40 - 1 and job.train.steps == 10**12
    assert job.train.seed * 1_000_003 + 10_001 < 2**63  # the node's generator seed for the last layer fits


def test_an_integer_too_long_to_read_is_one_line() -> None:
    with _raises(JobSpecError, "not readable TOML", "digits"):
        JobSpec.from_toml(BASE.replace("steps = 10", "steps = " + "9" * 5000))


# --- 2. every float finite -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("section", "line", "field"), [
    ("train", "lr = inf", "train.lr"),
    ("train", "lr = nan", "train.lr"),
    ("train", "weight_decay = inf", "train.weight_decay"),
    ("train", "grad_clip = inf", "train.grad_clip"),
    ("train", "loss_scale = inf", "train.loss_scale"),
    ("data", "validation_fraction = nan", "data.validation_fraction"),
    ("outer", "lr = nan", "outer.lr"),
    ("outer", "momentum = nan", "outer.momentum"),
    ("outer", "topk_fraction = inf", "outer.topk_fraction"),
    ("outer", "deadline_seconds = inf", "outer.deadline_seconds"),
])
def test_job_floats_must_be_finite(section: str, line: str, field: str) -> None:
    with _raises(JobSpecError, f"{field} must be a finite number, got"):
        JobSpec.from_toml(_spec(section, line))


@pytest.mark.parametrize(("line", "needles"), [
    ("loss_scale = 1e300", ("train.loss_scale", "at most 2**64", "got 1e+300")),
    ("lr = -inf", ("train.lr must be a finite number",)),
])
def test_job_floats_past_their_range(line: str, needles: tuple[str, ...]) -> None:
    with _raises(JobSpecError, *needles):
        JobSpec.from_toml(_spec("train", line))


@pytest.mark.parametrize(("line", "needles"), [
    ('style = "llama"\nnorm_eps = inf', ("model.norm_eps must be a finite number", "got inf")),
    ('style = "llama"\nrope_theta = nan', ("model.rope_theta must be a finite number", "got nan")),
    ('style = "llama"\nrope_scaling = [inf, 1.0, 4.0, 8192]', ("model.rope_scaling must be a list",)),
])
def test_model_floats_in_a_job_must_be_finite(line: str, needles: tuple[str, ...]) -> None:
    with _raises(JobSpecError, *needles):
        JobSpec.from_toml(_spec("model", line))


# --- 3. model sizes bounded -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("field", "value", "limit"), [
    ("n_layers", 100_000_000, "10,000"),
    ("d_model", 2_000_000, "1,000,000"),
    ("vocab_size", 20_000_000, "10,000,000"),
    ("ffn_hidden", 20_000_000, "10,000,000"),
    ("seq_len", 200_000_000, "100,000,000"),
])
def test_model_sizes_past_their_limits(tmp_path: Path, field: str, value: int, limit: str) -> None:
    path = tmp_path / "model.json"
    path.write_text(json.dumps({**MODEL, field: value}))
    with _raises(ValueError, str(path), f"model.{field} must be at most {limit}", f"got {value}"):
        load_model_config(path)
    with _raises(JobSpecError, f"model.{field} must be at most {limit}"):
        JobSpec.from_toml(_spec("model", f"{field} = {value}"))


def test_model_heads_past_the_width_are_refused() -> None:
    with _raises(ValueError, "model.n_heads (128) must divide model.d_model (64)"):
        ModelConfig.from_dict({**MODEL, "n_heads": 128})


def test_hf_sizes_past_their_limits_name_the_hf_key() -> None:
    with _raises(HfConfigError, "cfg.json: num_hidden_layers must be an integer from 1 to 10,000", "100000000"):
        config_from_hf({**LLAMA, "num_hidden_layers": 100_000_000}, where="cfg.json")
    with _raises(HfConfigError, "cfg.json: n_positions must be an integer from 1 to 100,000,000"):
        config_from_hf({**GPT2, "n_positions": 10**9}, where="cfg.json")


# --- 4. model JSON and Hugging Face configs: every field of its type ------------------------------------------

@pytest.mark.parametrize(("doc", "needles"), [
    ({**MODEL, "vocab_size": "256"}, ("model.vocab_size must be an integer, got '256'",)),
    ({**MODEL, "n_layers": 4.5}, ("model.n_layers must be an integer, got 4.5",)),
    ({**MODEL, "n_layers": True}, ("model.n_layers must be an integer, got True",)),
    ({**MODEL, "n_kv_heads": "2"}, ("model.n_kv_heads must be an integer (or left out)",)),
    ({**MODEL, "ffn_hidden": 256.0}, ("model.ffn_hidden must be an integer (or left out)",)),
    ({**MODEL, "tied_head": "no"}, ("model.tied_head must be true or false, got 'no'",)),
    ({**MODEL, "gelu_tanh": 1}, ("model.gelu_tanh must be true or false (or left out), got 1",)),
    ({**MODEL, "style": "llama", "qkv_bias": "yes"}, ("model.qkv_bias must be true or false",)),
    ({**MODEL, "norm_eps": "x"}, ("model.norm_eps must be a finite number (or left out), got 'x'",)),
    ({**MODEL, "norm_eps": float("inf")}, ("model.norm_eps must be a finite number",)),
    ({**MODEL, "style": "llama", "rope_scaling": 5}, ("model.rope_scaling must be a list [factor", "got 5")),
    ({**MODEL, "style": "llama", "rope_scaling": [32.0, 1.0, 4.0]}, ("model.rope_scaling must be a list",)),
    ({**MODEL, "style": "llama", "rope_scaling": [32.0, 1.0, 4.0, 8192.5]}, ("an integer", "got [32.0")),
    ({**MODEL, "style": "llama", "rope_scaling": {"factor": 32.0}}, ("model.rope_scaling must be a list",)),
    ({**MODEL, "style": "llama", "rope_scaling": [32.0, 4.0, 1.0, 8192]}, ("low < high",)),
    ({**MODEL, "name": 5}, ("model.name must be a string, got 5",)),
    ({**MODEL, "style": ["gpt"]}, ("model.style must be a string",)),
    ({k: v for k, v in MODEL.items() if k != "d_model"}, ("model field(s) d_model missing", "needs vocab_size")),
    ({}, ("model field(s) vocab_size, d_model, n_layers, n_heads, seq_len missing",)),
    ([1, 2], ("a model config must be an object of model fields", "got [1, 2]")),
    ("tiny", ("a model config must be an object of model fields", "got 'tiny'")),
    ({**MODEL, "dropout": 0.1}, ("unknown model field(s) ['dropout']",)),
])
def test_model_json_fields_are_type_checked(tmp_path: Path, doc: Any, needles: tuple[str, ...]) -> None:
    path = tmp_path / "model.json"
    path.write_text(json.dumps(doc))
    with _raises(ValueError, str(path), *needles):
        load_model_config(path)
    with _raises(ValueError, *needles):
        ModelConfig.from_dict(doc)


def test_model_json_numbers_written_as_integers_are_taken(tmp_path: Path) -> None:
    doc = {**MODEL, "style": "llama", "norm_eps": 1, "rope_theta": 500000, "rope_scaling": [32, 1, 4, 8192]}
    config = ModelConfig.from_dict(doc)
    assert config.norm_eps == 1.0 and isinstance(config.norm_eps, float)
    assert config.rope_scaling == (32.0, 1.0, 4.0, 8192)
    assert ModelConfig.from_dict(config.to_dict()) == config
    (tmp_path / "hf.json").write_text(json.dumps(LLAMA))
    assert load_model_config(tmp_path / "hf.json") == config_from_hf(LLAMA, where="x")  # a Hugging Face config too


@pytest.mark.parametrize(("base", "change", "needles"), [
    (LLAMA, {"hidden_size": "4096"}, ("hidden_size must be an integer from 1 to 1,000,000", "got '4096'")),
    (LLAMA, {"num_attention_heads": 32.0}, ("num_attention_heads must be an integer", "got 32.0")),
    (LLAMA, {"num_key_value_heads": 2.5}, ("num_key_value_heads must be an integer",)),
    (LLAMA, {"intermediate_size": True}, ("intermediate_size must be an integer",)),
    (LLAMA, {"head_dim": "64"}, ("head_dim must be an integer",)),
    (LLAMA, {"tie_word_embeddings": "no"}, ("tie_word_embeddings must be true or false, got 'no'",)),
    (LLAMA, {"attention_bias": "false"}, ("attention_bias must be true or false",)),
    (LLAMA, {"rms_norm_eps": "x"}, ("rms_norm_eps must be a finite positive number, got 'x'",)),
    (LLAMA, {"rms_norm_eps": float("nan")}, ("rms_norm_eps must be a finite positive number",)),
    (LLAMA, {"rope_theta": float("inf")}, ("rope_theta must be a finite positive number",)),
    (LLAMA, {"rope_scaling": 5}, ("rope_scaling must be an object", "got 5")),
    (LLAMA, {"rope_parameters": [1]}, ("rope_parameters must be an object",)),
    (LLAMA, {"rope_scaling": {"rope_type": "llama3", "factor": 32.0}},
     ("rope_scaling of type 'llama3' has no low_freq_factor, high_freq_factor, original_max_position_embeddings",)),
    (LLAMA, {"rope_scaling": {**LLAMA["rope_scaling"], "factor": "32"}},
     ("rope_scaling.factor must be a finite positive number",)),
    (LLAMA, {"rope_scaling": {**LLAMA["rope_scaling"], "original_max_position_embeddings": 8192.0}},
     ("rope_scaling.original_max_position_embeddings must be an integer",)),
    (LLAMA, {"model_type": "mistral", "sliding_window": "4096"}, ("sliding_window must be an integer",)),
    (LLAMA, {"num_attention_heads": 30, "head_dim": None}, ("model.n_heads (30) must divide model.d_model (2048)",)),
    (GPT2, {"n_embd": "768"}, ("n_embd must be an integer",)),
    (GPT2, {"n_inner": 3072.0}, ("n_inner must be an integer",)),
    (GPT2, {"layer_norm_epsilon": "1e-5"}, ("layer_norm_epsilon must be a finite positive number",)),
    (GPT2, {"scale_attn_by_inverse_layer_idx": "yes"}, ("scale_attn_by_inverse_layer_idx must be true or false",)),
])
def test_hf_config_fields_are_type_checked(base: dict[str, Any], change: dict[str, Any],
                                           needles: tuple[str, ...]) -> None:
    with _raises(HfConfigError, "cfg.json: ", *needles):
        config_from_hf({**base, **change}, where="cfg.json")


def test_hf_config_of_the_wrong_shape(tmp_path: Path) -> None:
    with _raises(HfConfigError, "cfg.json must hold a JSON object, got [1, 2]"):
        config_from_hf([1, 2], where="cfg.json")  # type: ignore[arg-type]
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with _raises(HfConfigError, str(path), "must hold a JSON object"):
        config_from_file(path)
    path.write_text('{"model_type": "llama", "vocab_size": 1' + "0" * 5000 + "}")
    with _raises(HfConfigError, str(path), "is not valid JSON"):
        config_from_file(path)


def test_hf_config_errors_in_a_job_name_the_spec_field(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "hidden_size": "4096"}))
    spec = tmp_path / "job.toml"
    spec.write_text(BASE.replace('preset = "tiny"', f'hf_config = "{path}"'))
    with _raises(JobSpecError, f"{spec}: model.hf_config: {path}: hidden_size must be an integer", "'4096'"):
        JobSpec.load(spec)
    path.write_bytes(b'{"model_type": "\xff"}')
    with _raises(JobSpecError, f"{spec}: model.hf_config: Hugging Face config {path} is not UTF-8 text"):
        JobSpec.load(spec)


def test_job_model_fields_of_the_wrong_type() -> None:
    with _raises(JobSpecError, "model.rope_scaling must be an array, got 5"):
        JobSpec.from_toml(_spec("model", 'style = "llama"\nrope_scaling = 5'))
    with _raises(JobSpecError, "model.tied_head must be true or false"):
        JobSpec.from_toml(_spec("model", 'tied_head = "no"'))


# --- 5. files that are folders or not UTF-8 -------------------------------------------------------------------

def test_job_spec_that_is_not_utf8_or_a_folder(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'[job]\nname = "\xff"\n')
    with _raises(JobSpecError, f"job spec {bad} is not UTF-8 text", "at byte 14", "save it as UTF-8"):
        JobSpec.load(bad)
    folder = tmp_path / "folder.toml"
    folder.mkdir()
    with _raises(IsADirectoryError, f"job spec {folder} is a folder, not a file", "pass a TOML file"):
        JobSpec.load(folder)
    with _raises(FileNotFoundError, "job spec", "no such file"):
        JobSpec.load(tmp_path / "none.toml")


def test_model_json_that_is_not_utf8_or_a_folder(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe{}")
    with _raises(ValueError, f"model file {bad} is not UTF-8 text"):
        load_model_config(bad)
    folder = tmp_path / "folder.json"
    folder.mkdir()
    with _raises(IsADirectoryError, f"model file {folder} is a folder, not a file"):
        load_model_config(folder)
    with _raises(FileNotFoundError, "model file", "no such file"):
        load_model_config(tmp_path / "none.json")
    (tmp_path / "broken.json").write_text("{")
    with _raises(ValueError, "broken.json: not valid JSON"):
        load_model_config(tmp_path / "broken.json")


def test_hf_config_that_is_not_utf8_or_a_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes(b"\xff")
    with _raises(HfConfigError, f"Hugging Face config {tmp_path / 'config.json'} is not UTF-8 text"):
        config_from_file(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").mkdir()
    with _raises(IsADirectoryError, "is a folder, not a file"):
        config_from_file(tmp_path)


def test_token_file_that_is_not_utf8_or_a_folder(tmp_path: Path) -> None:
    with _raises(IsADirectoryError, f"token file {tmp_path} is a folder, not a file"):
        resolve_token(token_file=tmp_path)
    bad = tmp_path / "token"
    bad.write_bytes(b"\xff\xff")
    with _raises(ValueError, f"token file {bad} is not UTF-8 text"):
        resolve_token(token_file=bad)


# --- the command line: one line, no traceback -----------------------------------------------------------------

@pytest.mark.parametrize(("content", "needles"), [
    (_spec("train", "lr = inf"), ("train.lr must be a finite number",)),
    (BASE.replace("steps = 10", "steps = 99999999999999999999999"), ("train.steps must be at most",)),
    (b"\xff\xfe", ("is not UTF-8 text",)),
    (None, ("is a folder, not a file",)),
])
def test_coordinator_refuses_a_bad_spec_at_start(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 content: str | bytes | None, needles: tuple[str, ...]) -> None:
    spec = tmp_path / "bad.toml"
    if content is None:
        spec.mkdir()
    elif isinstance(content, bytes):
        spec.write_bytes(content)
    else:
        spec.write_text(content)
    argv = ["coordinator", "--job", str(spec), "--insecure", "--listen", "127.0.0.1:0",
            "--state-dir", str(tmp_path / "state")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(spec) in err and all(n in err for n in needles) and "Traceback" not in err, err


@pytest.mark.parametrize(("doc", "needles"), [
    ({**MODEL, "n_layers": 100_000_000}, ("model.n_layers must be at most 10,000",)),
    ({**MODEL, "vocab_size": "256"}, ("model.vocab_size must be an integer",)),
    ([1, 2], ("a model config must be an object",)),
    ({**LLAMA, "hidden_size": "4096"}, ("hidden_size must be an integer",)),
])
def test_plan_refuses_a_bad_model_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], doc: Any,
                                       needles: tuple[str, ...]) -> None:
    path = tmp_path / "model.json"
    path.write_text(json.dumps(doc))
    assert main(["plan", "--model", str(path), "--cluster", str(CLUSTER), "--global-batch", "64"]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in needles) and "Traceback" not in err, err
