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


def test_nodes_exit_when_the_job_is_done() -> None:
    """The default (`--stay` keeps a node up); the compose file says nothing it need not."""
    for name, service in _services().items():
        if service["command"][:2] == ["atoll", "node"]:
            args = build_parser().parse_args(service["command"][1:])
            assert not args.stay and "--exit-when-done" not in service["command"], name


def test_ports_are_published_on_loopback_only() -> None:
    for name, service in _services().items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
    coordinator = build_parser().parse_args(_services()["coordinator"]["command"][1:])
    # inside its container the endpoint must listen beyond loopback for the published port to reach it
    assert coordinator.metrics_port is not None and coordinator.metrics_host == "0.0.0.0"


def test_no_committed_token() -> None:
    """The coordinator makes the token in its state volume; the nodes read it from there, mounted read-only."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert "secrets" not in compose and not list(REPO.glob("examples/*token*"))
    services = compose["services"]
    coordinator = build_parser().parse_args(services["coordinator"]["command"][1:])
    assert coordinator.token_file is None  # generated into --state-dir
    state = next(v.split(":")[0] for v in services["coordinator"]["volumes"] if v.split(":")[1] == coordinator.state_dir)
    health = services["coordinator"]["healthcheck"]["test"]
    assert health[0] == "CMD" and callable(build_parser().parse_args(health[2:]).func)
    assert health[health.index("--token-file") + 1] == f"{coordinator.state_dir}/token"
    for name, service in services.items():
        if service["command"][:2] != ["atoll", "node"]:
            continue
        node = build_parser().parse_args(service["command"][1:])
        mount = next(v for v in service["volumes"] if v.startswith(state + ":"))
        assert mount.endswith(":ro") and node.token_file == mount.split(":")[1] + "/token", name
        assert service["depends_on"]["coordinator"]["condition"] == "service_healthy", name


def test_dockerignore_keeps_the_build_context_small() -> None:
    ignored = {line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".venv", "runs", ".git", "*.egg-info"} <= ignored


def test_every_call_is_mutual_tls_under_the_coordinators_ca() -> None:
    services = _services()
    coordinator = build_parser().parse_args(services["coordinator"]["command"][1:])
    assert not coordinator.insecure
    health = services["coordinator"]["healthcheck"]["test"]
    assert health[health.index("--tls-ca") + 1] == f"{coordinator.state_dir}/ca.pem"
    for name, service in services.items():
        if service["command"][:2] == ["atoll", "node"]:
            node = build_parser().parse_args(service["command"][1:])
            assert not node.insecure and node.tls_ca == str(Path(node.token_file).parent / "ca.pem"), name
