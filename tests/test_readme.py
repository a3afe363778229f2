"""The README's two commands are the ones CI runs; the job snippets of the README and the docs load and train."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_readme_has_exactly_two_commands_and_ci_runs_them() -> None:
    readme = (REPO / "README.md").read_text()
    blocks = _bash_blocks(readme.split("## Quick start", 1)[1].split("\n## ", 1)[0])
    assert len(blocks) == 2, "the quick start is two commands: set up and run, then the tests"
    setup, tests = blocks
    ci = (REPO / ".ci" / "run").read_text()
    for step in setup.split(" && "):
        if "pip install" in step:
            assert step.replace("pip install", "pip install -q") in ci, f"CI does not run {step!r}"
    assert "torch==2.13.0" in setup
    assert tests in ci.splitlines(), f"CI does not run the README's test command {tests!r}"


def _toml_blocks() -> list[str]:
    """Every ```toml snippet of the README and of the documentation's pages (docs/**/*.md)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    return [b for page in pages for b in re.findall(r"```toml\n(.*?)```", page.read_text(), flags=re.S)]


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _to_toml(doc: dict) -> str:
    from atoll.job import _toml_value

    return "".join(f"[{name}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in table.items()) + "\n"
                   for name, table in doc.items())


def test_every_job_snippet_in_the_readme_and_the_docs_loads_and_a_whole_job_trains(
        tmp_path: Path, monkeypatch) -> None:
    """A snippet that is a whole job file (it has [job]) loads as the coordinator loads it and trains a few steps
    in the folder a node would read its relative paths from; a fragment (one section a paragraph explains) loads
    merged over the demo's job. A snippet that leaves out a required field fails here, not in a user's hands."""
    import json
    import tomllib
    from dataclasses import replace

    from atoll.job import JobSpec
    from atoll.launch.cli import main
    from atoll.node.local import train_local

    blocks = _toml_blocks()
    whole = [b for b in blocks if "[job]" in b]
    assert len(whole) >= 2, "the own-data and own-model snippets are whole job files"
    # what the whole jobs name: a corpus, a tokenizer trained on it, a Llama-shaped config.json
    monkeypatch.chdir(tmp_path)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly vexing bumps".split()
    rows = [" ".join(words[(i * 7 + j) % len(words)] for j in range(40)) for i in range(300)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    assert main(["tokenizer", "train", "--corpus", "corpus.jsonl", "--vocab-size", "400",
                 "--out", "tokenizer.json"]) == 0
    hf = tmp_path / "my-llama" / "config.json"
    hf.parent.mkdir()
    hf.write_text(json.dumps({"model_type": "llama", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
                              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                              "tie_word_embeddings": True}))
    for i, text in enumerate(whole):
        path = tmp_path / f"job{i}.toml"
        path.write_text(text.replace("/models/my-llama/config.json", str(hf)))
        job = JobSpec.load(path)
        # a few short steps: the snippet's batch and length are a real run's
        job = replace(job, train=replace(job.train, global_batch=4, micro_batch=2, seq_len=16, steps=2, warmup=0))
        losses, _ = train_local(job)
        assert len(losses) == 2 and all(loss == loss for loss in losses), (path, losses)

    tiny = tomllib.loads((REPO / "examples" / "tiny.toml").read_text())
    fragments = [b for b in blocks if "[job]" not in b]
    assert fragments, "the docs' section snippets ([outer], [train] precision) are checked too"
    for text in fragments:
        JobSpec.from_toml(_to_toml(_merge(tiny, tomllib.loads(text))))
