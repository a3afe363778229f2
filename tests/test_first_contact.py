"""First contact: a node that cannot reach its coordinator says so within seconds and what to check; a node whose
advertised address the coordinator cannot dial is told so at join and runs as one that accepts no connections."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from atoll.coordinator import handlers as h
from atoll.coordinator.dialback import dial_back
from atoll.coordinator.reachability import plan_address
from atoll.coordinator.state import CoordinatorState
from atoll.coordinator.store import MemoryStore
from atoll.job import JobSpec
from atoll.netcheck import diagnose
from atoll.node.first_contact import FirstContactWatch, process_age
from atoll.v1 import atoll_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_diagnose_tells_a_typo_from_a_stopped_coordinator_from_a_wrong_service() -> None:
    port = _closed_port()
    assert "refuses connections on port" in diagnose(f"127.0.0.1:{port}", tls=False)
    assert "does not resolve" in diagnose("no-such-host.invalid:7070", tls=False)
    assert "not HOST:PORT" in diagnose("nohostport", tls=False)
    assert "1-65535" in diagnose("h:99999", tls=False)  # the command line's own check of an address
    assert "wildcard" in diagnose("0.0.0.0:7070", tls=False)
    with socket.socket() as listener:  # something listens, but it is not a coordinator
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        addr = f"127.0.0.1:{listener.getsockname()[1]}"
        assert "does not answer as an Atoll coordinator" in diagnose(addr, tls=False)
        assert "--tls-ca" in diagnose(addr, tls=True)


def test_the_watch_speaks_once_after_its_delay_unless_done() -> None:
    said: list[str] = []
    done = FirstContactWatch(f"127.0.0.1:{_closed_port()}", tls=False, say=said.append)
    done.done()
    w = FirstContactWatch(f"127.0.0.1:{_closed_port()}", tls=False, say=said.append,
                          after=timedelta(milliseconds=50), least=timedelta(milliseconds=50))
    assert w.fired.wait(5)
    assert len(said) == 1 and "cannot reach the coordinator" in said[0] and "still retrying" in said[0]


def test_the_watch_counts_from_the_process_start() -> None:
    """A node whose start-up (imports, profile set-up) took long speaks soon after it first calls, so the line
    comes about FIRST_CONTACT_WARNING after the process started, whatever the machine's load."""
    age = process_age()
    assert 0.0 < age < 3600.0
    w = FirstContactWatch("127.0.0.1:1", tls=False, say=lambda line: None, after=timedelta(seconds=age + 30))
    w.done()
    assert age + 30 - w.delay == pytest.approx(process_age(), abs=0.5)
    late = FirstContactWatch("127.0.0.1:1", tls=False, say=lambda line: None, after=timedelta(seconds=1))
    late.done()
    assert late.delay == 0.5 if age > 1 else late.delay <= 1.0


@pytest.mark.timeout(90)
def test_a_node_pointed_at_nothing_says_so_and_what_to_check(tmp_path: Path) -> None:
    """The line is due FIRST_CONTACT_WARNING (5 s) after the process started (see the test above); on a loaded
    machine the interpreter alone may take longer to start, so this waits up to 60 s for it."""
    port = _closed_port()
    proc = subprocess.Popen([sys.executable, "-m", "atoll", "node", "--coordinator", f"127.0.0.1:{port}",
                             "--token", "t", "--insecure", "--state-dir", str(tmp_path / "node")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    start = time.monotonic()
    try:
        while time.monotonic() - start < 60 and not any("cannot reach the coordinator" in x for x in lines):
            time.sleep(0.1)
        said = "".join(lines)
        assert "cannot reach the coordinator" in said, said
        assert f"127.0.0.1 refuses connections on port {port}" in said and "coordinator running" in said
    finally:
        proc.kill()
        proc.wait(10)


# --- at join -------------------------------------------------------------------------------------------------


def test_dial_back_answers_for_a_listening_address_and_says_why_not_otherwise() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert dial_back(f"127.0.0.1:{listener.getsockname()[1]}") is None
    why = dial_back(f"127.0.0.1:{_closed_port()}")
    assert why is not None and "refused" in why.lower()
    assert dial_back("") == "no address advertised"
    assert "OverflowError" in dial_back("127.0.0.1:1180591620717411303424")  # said, not raised


@pytest.fixture
def state() -> CoordinatorState:
    return CoordinatorState(store=MemoryStore(), job=JobSpec.load(ROOT / "examples" / "tiny.toml"), token=TOKEN,
                            clock=lambda: 1000.0)


def _profile() -> pb.NodeProfile:
    return pb.NodeProfile(hostname="h", device_kind="cpu", device_name="x", device_count=1,
                          memory_total_bytes=1 << 30, cpu_count=1)


def test_a_node_the_coordinator_cannot_dial_is_told_what_to_set(state: CoordinatorState) -> None:
    reply = h.handle_join(pb.JoinRequest(token=TOKEN, profile=_profile(), peer_address="10.1.2.3:7171"), state,
                          dial_back=lambda address: "no answer within 3s")
    assert not reply.reachable
    assert "10.1.2.3:7171" in reply.reachability and "no answer within 3s" in reply.reachability
    assert "--advertise" in reply.reachability and "--no-listen" in reply.reachability
    member = state.store.get_member(reply.node_id)
    assert member is not None and member.profile.unreachable and plan_address(member) == ""
    ok = h.handle_join(pb.JoinRequest(token=TOKEN, profile=_profile(), peer_address="10.1.2.4:7171"), state,
                       dial_back=lambda address: None)
    assert ok.reachable and "reached" in ok.reachability
    quiet = h.handle_join(pb.JoinRequest(token=TOKEN, profile=_profile(), peer_address=""), state)
    assert not quiet.reachable and "--no-listen" in quiet.reachability


def test_diagnose_tells_a_wrong_token_a_wrong_ca_and_the_wrong_side_of_insecure_apart(tmp_path: Path) -> None:
    """Against a coordinator with mutual TLS, a TLS handshake of diagnose's own names what is wrong: another job's
    CA file, a token that is not the job's (its bootstrap certificate is refused), or --insecure; and against
    one that runs --insecure, --tls-ca."""
    from atoll.coordinator.service import CoordinatorService, ServiceConfig
    from atoll.tls import bootstrap_rpc

    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    tls = CoordinatorService(job=job, token=TOKEN, config=ServiceConfig(
        listen="127.0.0.1:0", state_dir=tmp_path / "tls", mutual_tls=True)).start()
    other = CoordinatorService(job=job, token=TOKEN, config=ServiceConfig(
        listen="127.0.0.1:0", state_dir=tmp_path / "other", mutual_tls=True)).start()
    plain = CoordinatorService(job=job, token=TOKEN, config=ServiceConfig(listen="127.0.0.1:0")).start()
    try:
        ca = (tmp_path / "tls" / "ca.pem").read_bytes()
        wrong_ca = (tmp_path / "other" / "ca.pem").read_bytes()
        right = diagnose(tls.address, tls=True, mtls=bootstrap_rpc(TOKEN, ca).mtls)
        assert "refuses this client's certificate" not in right and "not signed" not in right, right
        said = diagnose(tls.address, tls=True, mtls=bootstrap_rpc("not-the-token", ca).mtls)
        assert "the token is not this job's" in said and "--token-file" in said, said
        said = diagnose(tls.address, tls=True, mtls=bootstrap_rpc(TOKEN, wrong_ca).mtls)
        assert "not signed by the job CA this command trusts (--tls-ca" in said, said
        said = diagnose(tls.address, tls=False)
        assert "leave out --insecure" in said, said
        said = diagnose(plain.address, tls=True, mtls=bootstrap_rpc(TOKEN, ca).mtls)
        assert "runs --insecure" in said, said
        # atoll status and atoll job say such a refusal at once, not after their timeout: waiting cannot mend it
        from atoll.coordinator.status import fetch_status
        from atoll.launch.job import control_job

        t0 = time.monotonic()
        with pytest.raises(PermissionError, match="the token is not this job's"):
            fetch_status(tls.address, token="not-the-token", rpc=bootstrap_rpc("not-the-token", ca),
                         timeout=timedelta(seconds=30))
        with pytest.raises(ConnectionError, match="not signed by the job CA"):
            control_job(tls.address, "stop", token=TOKEN, rpc=bootstrap_rpc(TOKEN, wrong_ca),
                        timeout=timedelta(seconds=30))
        assert time.monotonic() - t0 < 15
        assert fetch_status(tls.address, token=TOKEN, rpc=bootstrap_rpc(TOKEN, ca)).job.name == job.name
    finally:
        for svc in (tls, other, plain):
            svc.stop()
