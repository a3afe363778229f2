"""The documentation keeps up with the code: the generated reference pages list every subcommand, job-file field,
metric and wire declaration the code has (each checked against the code itself, not against the generator's own
walk), the README stays a short map into docs/, and the site builds under --strict where MkDocs is installed."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import sys
import typing
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
README_MAX_LINES = 150


@pytest.fixture(scope="module")
def gen() -> typing.Iterator[ModuleType]:
    """docs/gen_reference.py, imported without MkDocs (only its hook needs it)."""
    spec = importlib.util.spec_from_file_location("atoll_docs_gen_reference", REPO / "docs" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _subcommands(parser: argparse.ArgumentParser, prefix: str = "atoll") -> dict[str, argparse.ArgumentParser]:
    out = {prefix: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                out.update(_subcommands(child, f"{prefix} {name}"))
    return out


def test_the_cli_reference_lists_every_subcommand_and_option(gen: ModuleType) -> None:
    from atoll.launch.cli import build_parser

    page = gen.cli_page()
    commands = _subcommands(build_parser())
    assert {"atoll", "atoll coordinator", "atoll node", "atoll job stop"} <= set(commands)
    for name, parser in commands.items():
        heading = re.search(rf"^#+ `{re.escape(name)}` \{{#[\w-]+\}}$", page, flags=re.M)
        assert heading, f"the CLI reference has no section for {name!r}"
        section = page[heading.end():].split("\n#", 1)[0]
        assert f"usage: {name}" in " ".join(section.split()), f"{name!r}: no usage line"
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:  # hidden from --help on purpose
                continue
            for option in action.option_strings:
                assert option in section, f"the CLI reference of {name!r} lacks {option}"


def _job_dataclasses() -> dict[str, type]:
    """TOML section -> the dataclass JobSpec composes for it."""
    from atoll.job import JobSpec

    hints = typing.get_type_hints(JobSpec)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobSpec) if dataclasses.is_dataclass(hints[f.name])}


def _section(page: str, name: str) -> str:
    start = page.index(f"## `[{name}]`")
    end = page.find("\n## ", start + 1)
    return page[start:] if end < 0 else page[start:end]


def test_the_job_file_reference_lists_every_field_of_the_job_dataclasses(gen: ModuleType) -> None:
    from atoll.job import JobSpec

    page = gen.job_file_page()
    sections = _job_dataclasses()
    assert {"model", "data", "train", "checkpoint", "compression", "cluster", "outer"} <= set(sections)
    for section, cls in sections.items():
        text = _section(page, section)
        for f in dataclasses.fields(cls):
            row = re.search(rf"^\| (`\w+` \(or )?`{f.name}`\)? \|.*\| (?P<meaning>[^|]*(\\\|[^|]*)*) \|$", text,
                            flags=re.M)
            assert row, f"the job-file reference lacks {section}.{f.name}"
            assert row.group("meaning").strip(), f"{section}.{f.name} has no attribute docstring to show"
    # JobSpec's own fields: [job] name and id, [model] preset and pretrained; the rest are the sections above
    own = {f.name for f in dataclasses.fields(JobSpec)} - set(sections)
    assert own == {"name", "id", "model_preset", "pretrained"}, f"a JobSpec field the reference does not place: {own}"
    for section, key in (("job", "name"), ("job", "id"), ("model", "preset"), ("model", "pretrained")):
        assert f"| `{key}` |" in _section(page, section), f"the job-file reference lacks {section}.{key}"


def test_the_metrics_reference_lists_every_coordinator_metric(gen: ModuleType) -> None:
    from atoll.coordinator.metrics import CoordinatorMetrics

    metrics = CoordinatorMetrics()
    names = {m.name for m in metrics.registry.collect()}
    names |= {v._args[0] for v in vars(metrics).values() if hasattr(v, "_args")}  # those absent until set
    assert {"atoll_members", "atoll_loss", "atoll_coordinator_lease_seconds"} <= names
    page = gen.metrics_page()
    for name in names:
        assert f"| `{name}` |" in page, f"the metrics reference lacks {name}"


def test_the_protocol_reference_lists_every_service_rpc_message_and_field(gen: ModuleType) -> None:
    from atoll.v1 import atoll_pb2

    page = gen.protocol_page()
    schema = atoll_pb2.DESCRIPTOR
    for service in schema.services_by_name.values():
        assert f"### `{service.name}`" in page
        for method in service.methods:
            assert f"| `{method.name}` |" in page, f"the protocol reference lacks {service.name}.{method.name}"
    for message in schema.message_types_by_name.values():
        start = page.index(f"### `{message.name}` ")
        text = page[start:page.find("\n### ", start + 1)]
        for f in message.fields:
            assert f"| `{f.name}` |" in text, f"the protocol reference lacks {message.name}.{f.name}"
    for enum in schema.enum_types_by_name.values():
        for value in enum.values:
            assert f"| `{value.name}` |" in page, f"the protocol reference lacks {enum.name}.{value.name}"


def test_the_readme_is_a_short_map_into_the_docs() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, "the README links into docs/; move the detail there"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if "://" not in link:
            assert (REPO / link).is_file(), f"the README links to {link}, which does not exist"


def test_the_site_builds_strict(tmp_path: Path) -> None:
    """Every page in the nav, no broken link or anchor, the generated pages included (CI builds it as well)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    config = load_config(str(REPO / "mkdocs.yml"), strict=True, site_dir=str(tmp_path / "site"))
    build(config)  # raises mkdocs.exceptions.Abort on any warning under strict
    for page in ("reference/cli.html", "reference/job-file.html", "reference/metrics.html",
                 "reference/protocol.html", "ARCHITECTURE.html"):
        assert (tmp_path / "site" / page).is_file(), page
