"""`atoll plan` with the Hugging Face presets as a new user runs it: a training sequence length by default, and a
refusal that names its real cause and the file as typed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atoll.coordinator.planner.cli import default_seq_len, load_model
from atoll.hf import HF_PRESETS
from atoll.launch.cli import main
from atoll.plan import Plan

MIXED = "examples/clusters/mixed-a100-v100.toml"


def test_default_seq_len_of_presets_and_configs(tmp_path: Path) -> None:
    assert default_seq_len("llama-3.2-1b", load_model("llama-3.2-1b"))[0] == 2048  # of 131,072 positions
    assert default_seq_len("Qwen2.5-0.5B", load_model("Qwen2.5-0.5B"))[0] == 2048  # of 32,768
    seq, said = default_seq_len("gpt2", load_model("gpt2"))
    assert seq == 1024 and said.startswith("seq_len 1,024 (the preset's training default;")  # its n_positions
    # Atoll's own presets are lengths they train at
    assert default_seq_len("7b", load_model("7b")) == (4096, "")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(HF_PRESETS["qwen2.5-0.5b"]))
    seq, said = default_seq_len(str(config), load_model(str(config)))
    assert seq == 2048 and "Hugging Face config's training default of its 32,768-token context" in said


def test_llama_preset_plans_most_gpus_without_seq_len(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-3.2-1b", "--cluster", MIXED, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "seq_len 2,048 (the preset's training default of its 131,072-token context; --seq-len to change)" in text
    plan = Plan.from_json(out.read_text())
    assert plan.seq_len == 2048
    placed = sum(s.dp * s.tp for p in plan.pipelines for s in p.stages)
    assert placed >= 0.9 * 96, f"{placed} of 96 GPUs placed"


def test_full_context_refusal_names_memory_per_sequence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # from a folder without examples/: the installed example is found, and named as the user typed it
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "llama-3.2-1b", "--cluster", MIXED, "--seq-len", "131072"]) == 2
    err = capsys.readouterr().err
    assert f"cannot be placed on {MIXED}: one sequence of 131,072 tokens fits on no device" in err
    # the head's fp32 log-probabilities: 131,072 x 128,256 x 4 bytes
    assert "the head (layer 17)" in err and "67.2 GB of them the fp32 log-probabilities" in err
    assert "A100-80GB, has 72.0 GB usable" in err and "--seq-len (or train.seq_len in a job) 65,536 fits" in err
    assert "divisors" not in err and "power of two" not in err
