"""A coordinator killed with SIGKILL and restarted on its state dir resumes the job, members and plan epoch,
and its nodes carry on heartbeating without joining again. The restarted coordinator binds its rendezvous store
at the address the plan names again, so the plan stays current (no new epoch, no rollback); only when that port
is taken does it replace the epoch (whose rendezvous store died with the old process) by the next one."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

from atoll.coordinator.status import fetch_status as _fetch_status
from atoll.node.agent import AgentConfig, NodeAgent
from atoll.tls import bootstrap_rpc
from atoll.types import NodeProfile

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "restart-token"


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


_state_dirs: list[Path] = []
"""State dir of the coordinator the running test started: the job CA there verifies it, before and after a restart."""


def fetch_status(address: str, *, token: str):
    return _fetch_status(address, token=token, rpc=bootstrap_rpc(token, (_state_dirs[-1] / "ca.pem").read_bytes()))


def start(tmp: Path, listen: str, log_name: str) -> subprocess.Popen:
    _state_dirs.append(tmp / "state")
    addr = tmp / "addr"
    addr.unlink(missing_ok=True)
    log = open(tmp / log_name, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "atoll", "coordinator", "--job", str(ROOT / "examples" / "tiny.toml"), "--listen",
         listen, "--state-dir", str(tmp / "state"), "--token-file", str(tmp / "token"), "--address-file", str(addr),
         "--lease", "10"], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "ATOLL_LOG_LEVEL": "DEBUG"})
    wait_until(lambda: addr.exists() or proc.poll() is not None, 30, "the coordinator to listen")
    assert proc.poll() is None, (tmp / log_name).read_text()
    return proc


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_sigkill_and_restart_keeps_job_members_and_epoch(tmp_path: Path) -> None:
    (tmp_path / "token").write_text(TOKEN + "\n")
    proc = start(tmp_path, "127.0.0.1:0", "first.log")
    address = (tmp_path / "addr").read_text().strip()
    agents = []
    try:
        for i in range(3):
            cfg = AgentConfig(coordinator=address, token=TOKEN, state_dir=tmp_path / f"n{i}", listen="127.0.0.1:0",
                              tls_ca=(tmp_path / "state" / "ca.pem").read_bytes(),  # kept across the restart
                              connect_timeout=timedelta(seconds=30),
                              backoff=(timedelta(milliseconds=50), timedelta(milliseconds=500)))
            agents.append(NodeAgent(cfg, profile=NodeProfile(hostname=f"h{i}", device_kind="cpu", device_name="c",
                                                             memory_total_bytes=1 << 30, cpu_count=1)).start())
        wait_until(lambda: all(a.plan is not None for a in agents), 30, "plan epoch 1")
        before = fetch_status(address, token=TOKEN)
        assert before.plan.epoch == 1

        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc = start(tmp_path, address, "second.log")  # same port, same state dir
        after = fetch_status(address, token=TOKEN)
        assert after.job.job_id == before.job.job_id
        assert after.plan.epoch == 1 and after.plan.rendezvous == before.plan.rendezvous
        assert sorted(m.node_id for m in after.members) == sorted(m.node_id for m in before.members)
        restarted = time.time()
        wait_until(lambda: all(m.last_heartbeat_unix > restarted
                               for m in fetch_status(address, token=TOKEN).members), 20, "heartbeats to resume")
        assert all(a.joins == 1 for a in agents)  # nobody had to join again
        time.sleep(2.0)  # several rounds of the coordinator's loop with every member heard from
        kept = fetch_status(address, token=TOKEN)
        assert kept.plan.epoch == 1 and all(m.state == "alive" for m in kept.members)
        assert all(a.plan is not None and a.plan.epoch == 1 for a in agents)

        # the rendezvous port taken while the coordinator is down: a new store, and the plan naming the old
        # one is replaced once every member is heard from
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        squatter = socket.socket()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", int(before.plan.rendezvous.rsplit(":", 1)[1])))
        squatter.listen()
        try:
            proc = start(tmp_path, address, "third.log")
            wait_until(lambda: fetch_status(address, token=TOKEN).plan.epoch == 2, 20, "the next epoch")
        finally:
            squatter.close()
        final = fetch_status(address, token=TOKEN)
        assert all(m.state == "alive" for m in final.members)
        assert final.plan.rendezvous != before.plan.rendezvous
        wait_until(lambda: all(a.plan is not None and a.plan.epoch == 2 for a in agents), 20, "nodes to get epoch 2")
    finally:
        for a in agents:
            a.stop(leave=False)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
