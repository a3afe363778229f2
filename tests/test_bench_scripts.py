"""Every benchmark script runs both ways, `python -m bench.NAME` and `python bench/NAME.py`, from any folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in (REPO / "bench").glob("*.py") if 'if __name__ == "__main__"' in p.read_text())

# Loads the script as `python PATH --help` does (its folder, not the checkout, on sys.path), then imports what
# it imports lazily from `bench`: a script that needs the package must make it importable itself (at import,
# or in its main before those imports, which --help does not reach: such a script is taken at its word).
PROBE = """
import importlib, runpy, sys
path, lazy = sys.argv[1], sys.argv[2:]
sys.path[0] = str(__import__("pathlib").Path(path).parent)
sys.argv = [path, "--help"]
try:
    runpy.run_path(path, run_name="__main__")
except SystemExit as e:
    assert e.code in (0, None), f"--help exited with {e.code}"
for name in lazy:
    importlib.import_module(name)
"""


def test_there_are_scripts() -> None:
    assert {"codecs", "transport", "pipeline", "planner", "e2e"} <= {p.stem for p in SCRIPTS}


@pytest.mark.timeout(180)
def test_every_script_runs_as_a_path(tmp_path: Path) -> None:
    procs = {}
    for script in SCRIPTS:
        text = script.read_text()
        lazy = sorted({line.split()[1] for line in text.splitlines()
                       if line.strip().startswith("from bench.") and len(line.split()) > 1})
        if "sys.path.insert" in text.split("\ndef main", 1)[-1] and "def main" in text:
            lazy = []
        procs[script.name] = subprocess.Popen([sys.executable, "-c", PROBE, str(script), *lazy], cwd=tmp_path,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    failed = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=150)
        if proc.returncode != 0 or "usage:" not in out:
            failed[name] = err.strip().splitlines()[-1:] or out[-200:]
    assert not failed, failed
