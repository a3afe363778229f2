"""docker-compose.yml stays in step with the CLI: every service's command parses with atoll's own parser."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from atoll.launch.cli import build_parser

REPO = Path(__file__).resolve().parent.parent


def _services() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]


def test_topology_is_a_coordinator_and_three_nodes() -> None:
    services = _services()
    assert "coordinator" in services
    nodes = [s for s in services.values() if s["command"][:2] == ["atoll", "node"]]
    assert len(nodes) == 3


@pytest.mark.parametrize("name", sorted(_services()))
def test_service_command_parses(name: str) -> None:
    command = _services()[name]["command"]
    assert command[0] == "atoll", f"service {name} must run the atoll CLI"
    args = build_parser().parse_args(command[1:])
    assert callable(args.func)


def test_referenced_files_exist() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    for secret in compose.get("secrets", {}).values():
        assert (REPO / secret["file"]).is_file()
    for service in compose["services"].values():
        cmd = service["command"]
        if "--job" in cmd:
            assert (REPO / cmd[cmd.index("--job") + 1]).is_file()
    assert (REPO / "Dockerfile").is_file()
