"""The command framework: `atoll --help`, `--help` of every subcommand, `atoll version`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from atoll import __version__
from atoll.launch.cli import build_parser, main

REPO = Path(__file__).resolve().parent.parent


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


def test_examples_are_found_from_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from atoll.inputs import examples_dir, input_path

    monkeypatch.chdir(tmp_path)
    # the installed examples are the repository's examples/ folder
    assert (examples_dir() / "tiny.toml").read_bytes() == (REPO / "examples" / "tiny.toml").read_bytes()
    assert input_path("examples/tiny.toml") == examples_dir() / "tiny.toml"
    assert input_path("examples/clusters/two-regions.toml").is_file()
    # a file of that name in the current folder wins, made absolute; a missing one is left for the caller to name
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "tiny.toml").write_text("[job]\n")
    assert input_path("examples/tiny.toml") == tmp_path / "examples" / "tiny.toml"
    assert input_path("mine.toml") == Path("mine.toml")


def test_plan_runs_outside_the_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "350m", "--cluster", "examples/clusters/mixed-a100-v100.toml"]) == 0
    assert "pipeline 0:" in capsys.readouterr().out


def test_coordinator_on_another_jobs_state_dir_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from atoll.coordinator.store import JobRecord, SqliteStore

    monkeypatch.chdir(tmp_path)
    store = SqliteStore(tmp_path / "state" / "coordinator.db")
    store.put_job(JobRecord(job_id="tiny-00000000", name="tiny", spec_toml=""))
    store.close()
    assert main(["coordinator", "--job", "examples/tiny.toml", "--listen", "127.0.0.1:0", "--state-dir", "state"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "state: the state dir holds job tiny-00000000" in lines[0] and "new --state-dir" in lines[0]


def test_metrics_bind_loopback_unless_asked() -> None:
    from atoll.coordinator.service import ServiceConfig

    args = build_parser().parse_args(["coordinator", "--job", "j.toml", "--metrics-port", "0"])
    assert args.metrics_host == "127.0.0.1" and ServiceConfig().metrics_host == "127.0.0.1"


def test_every_option_with_a_value_says_its_default() -> None:
    """`atoll SUBCOMMAND --help` names each option's default where its own text does not."""
    import argparse

    from atoll.launch.cli import build_parser

    def parsers(p: argparse.ArgumentParser):
        yield p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for child in dict.fromkeys(a.choices.values()):
                    yield from parsers(child)

    unsaid = []
    for p in list(parsers(build_parser()))[1:]:
        text = p.format_help()
        text = text[text.index("options:"):]  # past the usage lines
        for a in p._actions:
            if a.option_strings and a.default not in (None, False, True, argparse.SUPPRESS, "") \
                    and a.help != argparse.SUPPRESS:
                chunk = text[text.index(a.option_strings[-1]):]
                following = [m for m in (chunk.find("\n  -", 1),) if m > 0]  # up to the next option
                if "default" not in chunk[:following[0] if following else None].lower():
                    unsaid.append(f"{p.prog} {a.option_strings[-1]}")
    assert not unsaid, unsaid
    node = next(p for p in parsers(build_parser()) if p.prog == "atoll node").format_help()
    assert "(default: cpu)" in " ".join(node.split())
