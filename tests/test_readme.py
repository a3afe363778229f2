"""The README's two commands are the ones CI runs."""

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
