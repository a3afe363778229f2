"""Shaped links for tests and benchmarks: two network namespaces joined by a rate-limited veth pair.

As root: `with shaped_link(rate_bits_per_s=100e6) as link:` creates namespaces `<prefix>a` and
`<prefix>b` (prefix `atl-<pid>-<n>-`), a veth pair between them with a `tc tbf` qdisc on both ends, and
addresses `link.a.ip` / `link.b.ip`. `link.a.popen([...])` runs a command inside a namespace
(`ip netns exec`). Leaving the block kills what it started there and deletes both namespaces (the veth
pair goes with them). `netns_unavailable()` says why this cannot work here, for `pytest.skip`.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

PREFIX = "atl-"
_counter = itertools.count()


def _run(argv: Sequence[str], *, timeout: float = 10.0) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def netns_unavailable() -> str | None:
    """None when namespaces and tbf can be built here, else the reason (for a test skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root; run as root to test shaped links"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed; install iproute2 to test shaped links"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", probe])
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot create a network namespace here: {e}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


@dataclass
class Namespace:
    """One end of the link: a namespace, its veth device and its address."""

    name: str
    device: str
    ip: str
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run inside this namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` inside this namespace; it is killed when the link is torn down."""
        proc = subprocess.Popen(self.argv(argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, timeout: float = 60.0) -> str:
        """Run `argv` inside this namespace to completion and return its stdout."""
        return _run(self.argv(argv), timeout=timeout)


@dataclass
class ShapedLink:
    a: Namespace
    b: Namespace
    rate_bits_per_s: float

    @property
    def rate_bytes_per_s(self) -> float:
        return self.rate_bits_per_s / 8


def _tbf(ns: str, dev: str, rate_bits_per_s: float, burst_bytes: int, latency_ms: int) -> None:
    _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
          "rate", f"{int(rate_bits_per_s)}bit", "burst", str(burst_bytes), "latency", f"{latency_ms}ms"])


@contextmanager
def shaped_link(*, rate_bits_per_s: float, burst_bytes: int | None = None, latency_ms: int = 100,
                prefix: str | None = None) -> Iterator[ShapedLink]:
    """Two namespaces joined by a veth pair shaped to `rate_bits_per_s` in each direction.

    `burst_bytes` is the tbf bucket (default: 4 ms of traffic, at least 32 KiB); `latency_ms` bounds how
    long a packet may queue in tbf before it is dropped.
    """
    if rate_bits_per_s <= 0:
        raise ValueError(f"rate_bits_per_s must be positive, got {rate_bits_per_s}")
    reason = None if os.geteuid() == 0 else netns_unavailable()
    if reason:
        raise RuntimeError(reason)
    prefix = prefix or f"{PREFIX}{os.getpid()}-{next(_counter)}-"
    burst = burst_bytes or max(32 * 1024, int(rate_bits_per_s / 8 * 0.004))
    a = Namespace(name=f"{prefix}a", device="veth-a", ip="10.201.0.1")
    b = Namespace(name=f"{prefix}b", device="veth-b", ip="10.201.0.2")
    created: list[str] = []
    try:
        for ns in (a, b):
            _run(["ip", "netns", "add", ns.name])
            created.append(ns.name)
        # the pair is created straight inside the namespaces, so its names never clash in the root one
        _run(["ip", "link", "add", a.device, "netns", a.name, "type", "veth", "peer", "name", b.device,
              "netns", b.name])
        for ns in (a, b):
            _run(["ip", "-n", ns.name, "addr", "add", f"{ns.ip}/24", "dev", ns.device])
            _run(["ip", "-n", ns.name, "link", "set", ns.device, "up"])
            _run(["ip", "-n", ns.name, "link", "set", "lo", "up"])
            _tbf(ns.name, ns.device, rate_bits_per_s, burst, latency_ms)
        yield ShapedLink(a=a, b=b, rate_bits_per_s=rate_bits_per_s)
    finally:
        for ns in (a, b):
            for proc in ns._procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
        for name in created:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces named `<prefix><pid>-...` whose creating process is gone; return their names."""
    removed = []
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
            removed.append(name)
    return removed
