"""The shaped-link helper: namespaces joined by a tbf-limited veth pair, and their clean-up."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench tree is not installed
from bench.netns import netns_unavailable, remove_stale, shaped_link  # noqa: E402

_REASON = netns_unavailable()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

_SINK = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen()
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0
while (d := c.recv(1 << 20)): n += len(d)
c.sendall(b"k"); print(n, flush=True)
"""
_SOURCE = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
block = b"x" * (1 << 20); t = time.perf_counter()
for _ in range(int(sys.argv[3])): s.sendall(block)
s.shutdown(socket.SHUT_WR); s.recv(1)
print(int(sys.argv[3]) * len(block) / (time.perf_counter() - t))
"""


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.mark.timeout(60)
def test_link_is_shaped_and_cleaned_up() -> None:
    rate = 40e6  # bits/s; 3 MiB take ~0.6 s
    with shaped_link(rate_bits_per_s=rate) as link:
        assert {link.a.name, link.b.name} <= _namespaces()
        sink = link.b.popen([sys.executable, "-c", _SINK, link.b.ip], stdout=subprocess.PIPE, text=True)
        port = sink.stdout.readline().strip()
        t0 = time.perf_counter()
        achieved = float(link.a.run([sys.executable, "-c", _SOURCE, link.b.ip, port, "3"], timeout=30))
        assert time.perf_counter() - t0 < 20
        assert sink.stdout.readline().strip() == str(3 << 20)
        # tbf holds the rate: well above half of it, never far beyond it
        assert 0.5 * rate / 8 < achieved < 1.15 * rate / 8, achieved * 8
        leftover = link.a.popen(["sleep", "60"])
    assert leftover.poll() is not None  # processes started inside are killed on exit
    assert not {link.a.name, link.b.name} & _namespaces()


def test_namespaces_of_other_links_do_not_clash() -> None:
    with shaped_link(rate_bits_per_s=10e6) as one, shaped_link(rate_bits_per_s=10e6) as two:
        assert len({one.a.name, one.b.name, two.a.name, two.b.name}) == 4
        assert two.b.ip in two.b.run(["ip", "-brief", "addr", "show", two.b.device])
        assert "tbf" in one.a.run(["tc", "qdisc", "show", "dev", one.a.device])


def test_stale_namespaces_of_dead_processes_are_removed() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"atl-{dead.pid}-0-a"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    assert name in remove_stale()
    assert name not in _namespaces()


def test_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rate_bits_per_s"):
        with shaped_link(rate_bits_per_s=0):
            pass
