"""The command framework: `atoll --help`, `--help` of every subcommand, `atoll version`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from atoll import __version__
from atoll.launch.cli import build_parser, main


def _subcommands() -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sorted(sub.choices)


def test_version_prints_versions(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    out = capsys.readouterr().out
    assert f"atoll {__version__}" in out and "atoll.v1" in out and "torch" in out


@pytest.mark.parametrize("command", _subcommands())
def test_every_subcommand_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert "usage: atoll " + command in capsys.readouterr().out


def test_no_command_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


def test_python_dash_m_atoll_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "atoll", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "version" in out.stdout
