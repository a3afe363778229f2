"""A geo-distributed testbed on one machine: regions of hosts joined by shaped wide-area links, each host
with its own share of the CPU. For tests and benchmarks; needs root.

    with geo_testbed(regions={"lab-a": 2, "lab-b": 2}, wan_bits_per_s=20e6, wan_latency_ms=50,
                     cpu_quota=0.45) as tb:
        tb.hosts                       # GeoHost: name ("lab-a-0"), region, ip, namespace, cgroup
        proc = tb.popen("lab-b-1", [sys.executable, "-c", "..."], stdout=subprocess.PIPE)
        tb.coordinator                 # a host for the coordinator, beside the first region's hosts

    with geo_testbed(...) as tb, LocalCluster(job_path=job, out=out) as cluster:
        cluster.start_coordinator(host=tb.coordinator)
        for host in tb.hosts:          # --listen on the host's IP, --region and --wan-latency-ms from it
            cluster.start_node(host.name, host=host)

What it builds (names prefixed `atl-<pid>-g<n>-`):
- a network namespace per host with one interface, `eth0`, on one flat subnet, 10.77.0.0/16 (host j of
  region r is 10.77.<r+1>.<j+1>, the coordinator 10.77.1.250), so every host reaches every other;
- a "switch" namespace per region: a bridge joining its hosts' veth links, and a veth link to every other
  region's switch shaped by `tc tbf` on both ends to that pair's rate (`wan_bits_per_s`, or the pair's entry
  in `wan_rates`). Switches route between regions (proxy ARP keeps the subnet flat); links within a
  region, and the coordinator's link to the first region's switch, are not shaped;
- a cgroup v1 CPU quota per host (`cpu_quota`: a fraction of one core, or one per region), so a region
  added adds compute instead of splitting a fixed pool. `popen` starts a command in the host's cgroup
  (a shell joins it and then execs) and namespace, so neither the command nor its children escape. It enters
  the namespace with `nsenter --net`, not `ip netns exec`: that one mounts a fresh /sys, without the cgroup
  hierarchies under /sys/fs/cgroup, and a node could not read its quota (`atoll.node.profiler.cpu_share`):
  it profiled at a whole core's speed and trained at its quota's.

Leaving the block (also by an exception) kills every process in the hosts' cgroups and deletes the
namespaces, with their bridges and links, and the cgroups. `geo_unavailable()` says why the testbed
cannot be built here (for `pytest.skip`); `remove_stale()` cleans up after a process that was killed.

What it emulates and what not:
- Bandwidth between regions: in the kernel, for all traffic (gRPC tensors, gloo collectives, probes).
- Latency: not in the kernel (netem is often missing). `wan_latency_ms` is recorded on the testbed and its
  hosts for the processes to emulate: `LocalCluster` passes it to nodes as `--wan-latency-ms`, and nodes
  hold each tensor sent to a peer of another region that long (`atoll.node.wan`). gloo collectives,
  rendezvous and link probes see the bandwidth but not the latency.
- Compute: CFS quotas bound each host's CPU time over 100 ms periods; they do not split caches or memory
  bandwidth, quotas adding up to more than the machine's cores are oversubscribed, and the kernel's
  packet work (bridges, tbf, routing) is charged to no host.
- Processes started in a host get `GLOO_SOCKET_IFNAME=eth0`, so gloo binds the host's interface rather
  than the machine's hostname, which resolves to no address inside the namespace.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.netns import PREFIX, _run, _tbf, netns_unavailable
from bench.netns import remove_stale as remove_stale_namespaces

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
"""The cgroup v1 cpu controller's hierarchy."""
PERIOD_US = 100_000
"""CFS period of every host's quota."""
DEVICE = "eth0"
"""Each host's interface."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")
_CLONE_NEWNET = 0x40000000
_counter = itertools.count()


def geo_unavailable() -> str | None:
    """None when the testbed can be built here, else the reason (for a test skip)."""
    reason = netns_unavailable()
    if reason:
        return reason
    if not (CPU_CGROUP / "cpu.cfs_quota_us").is_file():
        return f"no cgroup v1 cpu controller at {CPU_CGROUP}; the testbed's per-host CPU quotas need one"
    if shutil.which("nsenter") is None:
        return "no nsenter (util-linux) to start processes in the hosts' network namespaces"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        (CPU_CGROUP / probe).mkdir()
        (CPU_CGROUP / probe).rmdir()
    except OSError as e:
        return f"cannot create a cgroup under {CPU_CGROUP}: {e}"
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "-n", probe, "link", "add", "br0", "type", "bridge"])
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot create a bridge in a network namespace here: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


def _enter_namespace(name: str) -> None:
    """Move the calling thread (only) into network namespace `name`: sockets it creates live there."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


class _Relay:
    """Listens on this process's loopback; relays each connection to `address` inside namespace `namespace`."""

    def __init__(self, namespace: str, address: str):
        host, port = address.rsplit(":", 1)
        self.namespace, self.target = namespace, (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, name=f"atl-relay-{address}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            _enter_namespace(self.namespace)  # this thread only; it ends with the connection
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
        except OSError:
            conn.close()
            return
        with self.lock:
            self.sockets |= {conn, upstream}
        back = threading.Thread(target=self._pump, args=(upstream, conn), daemon=True)
        back.start()
        self._pump(conn, upstream)
        back.join()
        with self.lock:
            self.sockets -= {conn, upstream}
        conn.close()
        upstream.close()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept
        except OSError:
            pass
        self.listener.close()
        with self.lock:
            for s in self.sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@dataclass
class GeoHost:
    """One machine of the testbed: a network namespace with one address, in a cgroup with its CPU quota."""

    name: str
    region: str
    ip: str
    namespace: str
    cgroup: Path
    cpu_quota: float | None
    """Cores' worth of CPU time (0.45: 45% of one core); None: not limited."""
    wan_latency_ms: float
    """One-way latency to other regions that processes here should emulate (not applied by the network)."""
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)
    _relays: dict[str, _Relay] = field(default_factory=dict, repr=False)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run in this host's cgroup and namespace: a shell joins the cgroup, then execs
        `nsenter --net` (the network namespace only: the mounts stay the machine's, /sys/fs/cgroup included),
        which execs `argv`; the process keeps its pid throughout."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.cgroup / "cgroup.procs"),
                "nsenter", f"--net=/run/netns/{self.namespace}", *argv]

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` on this host (Popen's keyword arguments apply); it is killed at teardown."""
        env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
        env.setdefault("GLOO_SOCKET_IFNAME", DEVICE)
        proc = subprocess.Popen(self.argv(argv), **{**kwargs, "env": env})
        self._procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, timeout: float = 60.0) -> str:
        """Run `argv` on this host to completion and return its stdout."""
        return _run(self.argv(argv), timeout=timeout)

    def reach(self, address: str) -> str:
        """An address on this process's loopback that relays TCP to `address` as seen from this host (e.g. a
        server listening inside it), for clients outside the testbed such as a status query."""
        if address not in self._relays:
            self._relays[address] = _Relay(self.namespace, address)
        return self._relays[address].address


@dataclass
class GeoTestbed:
    """The built testbed: its hosts, the coordinator's host and the WAN rate of every pair of regions."""

    hosts: list[GeoHost]
    coordinator: GeoHost
    switches: dict[str, str]
    """Region -> the namespace of its switch."""
    rates: dict[frozenset[str], float]
    """WAN rate in bits/s of each pair of regions."""
    wan_latency_ms: float
    """One-way latency between regions for the processes to emulate (see the module docstring)."""

    @property
    def regions(self) -> list[str]:
        return list(self.switches)

    def host(self, name: str) -> GeoHost:
        for h in [*self.hosts, self.coordinator]:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r}; the testbed has {[h.name for h in self.hosts]} and "
                       f"{self.coordinator.name!r}")

    def in_region(self, region: str) -> list[GeoHost]:
        return [h for h in self.hosts if h.region == region]

    def wan_bits_per_s(self, a: str, b: str) -> float:
        """The shaped rate between regions `a` and `b` (each direction)."""
        return self.rates[frozenset((a, b))]

    def popen(self, host: GeoHost | str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` on `host` (a GeoHost or its name); see `GeoHost.popen`."""
        return (self.host(host) if isinstance(host, str) else host).popen(argv, **kwargs)

    def set_wan(self, a: str, b: str, *, up: bool) -> None:
        """Cut the link between regions `a` and `b` (`up=False`: both ends down, so nothing passes either way and
        each switch answers "unreachable" for the other's hosts) or restore it, its routes added back (the kernel
        drops them with the link; the tbf shaping stays)."""
        names = self.regions
        i, k = names.index(a), names.index(b)
        ends = ((self.switches[a], f"w{k}", k + 1), (self.switches[b], f"w{i}", i + 1))
        for sw, dev, _ in ends:
            _run(["ip", "-n", sw, "link", "set", dev, "up" if up else "down"])
        if up:
            for sw, dev, subnet in ends:
                _run(["ip", "-n", sw, "route", "replace", f"10.77.{subnet}.0/24", "dev", dev])

    def set_rate(self, a: str, b: str, bits_per_s: float, *, burst_bytes: int | None = None,
                 queue_ms: int = 100) -> None:
        """Shape the link between regions `a` and `b` to `bits_per_s` each direction from now on (the tbf of both
        ends replaced; what is queued keeps its place)."""
        if not bits_per_s > 0:
            raise ValueError(f"bits_per_s must be positive, got {bits_per_s}")
        names = self.regions
        i, k = names.index(a), names.index(b)
        bucket = burst_bytes or max(32 * 1024, int(bits_per_s / 8 * 0.004))
        for sw, dev in ((self.switches[a], f"w{k}"), (self.switches[b], f"w{i}")):
            _run(["ip", "netns", "exec", sw, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                  f"{int(bits_per_s)}bit", "burst", str(bucket), "latency", f"{queue_ms}ms"])
        self.rates[frozenset((a, b))] = bits_per_s

    def wan_bytes(self) -> dict[tuple[str, str], int]:
        """Bytes sent so far over each link between regions, per direction: (from, to) -> the transmit counter of
        the `from` switch's WAN veth toward `to` (what its tbf let through, as the kernel counts it: IP packets,
        their headers included). Take it before and after a run; the difference is the run's wide-area traffic."""
        names = self.regions
        out = {}
        for i, a in enumerate(names):
            for k, b in enumerate(names):
                if i != k:  # switch a's end of the a-b link is named w<k>
                    stats = json.loads(_run(["ip", "-n", self.switches[a], "-s", "-j", "link", "show", "dev", f"w{k}"]))
                    out[(a, b)] = int(stats[0]["stats64"]["tx"]["bytes"])
        return out


def _sysctl(ns: str, values: Mapping[str, str]) -> None:
    # /proc/sys/net shows the namespace of the process that opens it
    script = "; ".join(f"echo {v} > /proc/sys/{k.replace('.', '/')}" for k, v in values.items())
    _run(["ip", "netns", "exec", ns, "sh", "-ec", script])


def _make_cgroup(path: Path, quota: float | None) -> None:
    path.mkdir()
    (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (path / "cpu.cfs_quota_us").write_text(str(-1 if quota is None else max(1000, round(quota * PERIOD_US))))


def _empty_cgroup(path: Path, timeout: float = 10.0) -> None:
    """SIGKILL everything in cgroup `path` (also what was forked meanwhile) and remove it."""
    end = time.monotonic() + timeout
    while path.exists():
        try:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
            if not pids:
                path.rmdir()
                return
        except FileNotFoundError:
            return
        except OSError:  # busy: exiting processes still counted
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > end:
            raise RuntimeError(f"could not empty cgroup {path} within {timeout:.0f}s")
        time.sleep(0.02)


def _quotas(cpu_quota: float | Mapping[str, float] | None, regions: Sequence[str]) -> dict[str, float | None]:
    if cpu_quota is None or isinstance(cpu_quota, (int, float)):
        per = {r: cpu_quota for r in regions}
    else:
        unknown = set(cpu_quota) - set(regions)
        if unknown:
            raise ValueError(f"cpu_quota names regions {sorted(unknown)} that are not in regions {list(regions)}")
        per = {r: cpu_quota.get(r) for r in regions}
    for r, q in per.items():
        if q is not None and q <= 0:
            raise ValueError(f"cpu_quota of {r} must be a positive fraction of a core (or None: unlimited), got {q}")
    return per


def _pair_rates(regions: Sequence[str], default: float,
                overrides: Mapping[tuple[str, str], float] | None) -> dict[frozenset[str], float]:
    rates = {frozenset(p): default for p in itertools.combinations(regions, 2)}
    for pair, rate in (overrides or {}).items():
        key = frozenset(pair)
        if key not in rates:
            raise ValueError(f"wan_rates key {pair} must be two different regions of {list(regions)}")
        rates[key] = rate
    for key, rate in rates.items():
        if rate <= 0:
            raise ValueError(f"the WAN rate between {sorted(key)} must be positive bits/s, got {rate}")
    return rates


@contextmanager
def geo_testbed(*, regions: Mapping[str, int], wan_bits_per_s: float = 20e6,
                wan_rates: Mapping[tuple[str, str], float] | None = None, wan_latency_ms: float = 0.0,
                cpu_quota: float | Mapping[str, float] | None = 0.45, coordinator_cpu_quota: float | None = None,
                burst_bytes: int | None = None, queue_ms: int = 100, prefix: str | None = None
                ) -> Iterator[GeoTestbed]:
    """Build the testbed (see the module docstring); tear it all down on leaving.

    `regions`: hosts per region, in order (the coordinator joins the first). `wan_bits_per_s`: the rate of
    every pair of regions, each direction, unless `wan_rates` has the pair (`{("lab-a", "lab-b"): 5e6}`, in
    either order). `wan_latency_ms`: recorded for processes to emulate. `cpu_quota`: a fraction of one core
    per host (a float, a `{region: fraction}` dict, or None: unlimited); `coordinator_cpu_quota` likewise
    for the coordinator's host. `burst_bytes`: the tbf bucket (default 4 ms of traffic, at least 32 KiB);
    `queue_ms`: how long a packet may queue in tbf before it is dropped.
    """
    if not regions:
        raise ValueError("regions must name at least one region: {name: number of hosts}")
    for region, count in regions.items():
        if not _NAME.fullmatch(region):
            raise ValueError(f"region {region!r} must be 1-32 letters, digits, '_', '.' or '-', starting with a "
                             f"letter or digit")
        if not 1 <= count <= 200:
            raise ValueError(f"region {region!r} needs 1 to 200 hosts, got {count}")
    if len(regions) > 200:
        raise ValueError(f"at most 200 regions, got {len(regions)}")
    if wan_bits_per_s <= 0:
        raise ValueError(f"wan_bits_per_s must be positive, got {wan_bits_per_s}")
    if wan_latency_ms < 0:
        raise ValueError(f"wan_latency_ms must be >= 0, got {wan_latency_ms}")
    if coordinator_cpu_quota is not None and coordinator_cpu_quota <= 0:
        raise ValueError(f"coordinator_cpu_quota must be positive or None, got {coordinator_cpu_quota}")
    names = list(regions)
    quotas = _quotas(cpu_quota, names)
    rates = _pair_rates(names, wan_bits_per_s, wan_rates)
    if os.geteuid() != 0:
        raise RuntimeError(geo_unavailable() or "the testbed needs root")
    prefix = prefix or f"{PREFIX}{os.getpid()}-g{next(_counter)}-"

    switches = {r: f"{prefix}sw{i}" for i, r in enumerate(names)}
    hosts = [GeoHost(name=f"{r}-{j}", region=r, ip=f"10.77.{i + 1}.{j + 1}", namespace=f"{prefix}{r}-{j}",
                     cgroup=CPU_CGROUP / f"{prefix}{r}-{j}", cpu_quota=quotas[r], wan_latency_ms=wan_latency_ms)
             for i, r in enumerate(names) for j in range(regions[r])]
    coordinator = GeoHost(name="coordinator", region=names[0], ip="10.77.1.250", namespace=f"{prefix}coordinator",
                          cgroup=CPU_CGROUP / f"{prefix}coordinator", cpu_quota=coordinator_cpu_quota,
                          wan_latency_ms=wan_latency_ms)
    namespaces: list[str] = []
    cgroups: list[Path] = []
    everyone = [*hosts, coordinator]
    try:
        def add_namespace(name: str) -> None:
            _run(["ip", "netns", "add", name])
            namespaces.append(name)
            _run(["ip", "-n", name, "link", "set", "lo", "up"])

        for i, r in enumerate(names):
            sw = switches[r]
            add_namespace(sw)
            _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", sw, "addr", "add", f"10.77.{i + 1}.254/24", "dev", "br0"])
            _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for h in everyone:
            _make_cgroup(h.cgroup, h.cpu_quota)
            cgroups.append(h.cgroup)
            add_namespace(h.namespace)
            sw = switches[h.region]
            port = "hc" if h is coordinator else f"h{h.name.rsplit('-', 1)[1]}"
            # veth ends are created straight inside the namespaces, so their names never clash in the root one
            _run(["ip", "link", "add", DEVICE, "netns", h.namespace, "type", "veth", "peer", "name", port,
                  "netns", sw])
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0", "up"])
            _run(["ip", "-n", h.namespace, "addr", "add", f"{h.ip}/16", "dev", DEVICE])
            _run(["ip", "-n", h.namespace, "link", "set", DEVICE, "up"])
        for (i, a), (k, b) in itertools.combinations(enumerate(names), 2):
            rate = rates[frozenset((a, b))]
            bucket = burst_bytes or max(32 * 1024, int(rate / 8 * 0.004))
            # switch a's end is w<k>, switch b's end is w<i>; tbf on each end shapes what leaves that switch
            _run(["ip", "link", "add", f"w{k}", "netns", switches[a], "type", "veth", "peer", "name", f"w{i}",
                  "netns", switches[b]])
            for sw, dev, subnet in ((switches[a], f"w{k}", k + 1), (switches[b], f"w{i}", i + 1)):
                _run(["ip", "-n", sw, "link", "set", dev, "up"])
                _tbf(sw, dev, rate, bucket, queue_ms)
                _run(["ip", "-n", sw, "route", "add", f"10.77.{subnet}.0/24", "dev", dev])
        for i, r in enumerate(names):
            # the switch answers ARP for other regions' addresses (proxy ARP, at once rather than after a random
            # delay of up to 0.8 s) and forwards between its bridge and its WAN links
            devs = ["br0"] + [f"w{k}" for k in range(len(names)) if k != i]
            _sysctl(switches[r], {"net.ipv4.ip_forward": "1", "net.ipv4.conf.all.proxy_arp": "1",
                                  **{f"net.ipv4.neigh.{d}.proxy_delay": "0" for d in devs}})
        yield GeoTestbed(hosts=hosts, coordinator=coordinator, switches=switches, rates=rates,
                         wan_latency_ms=wan_latency_ms)
    finally:
        for h in everyone:
            for relay in h._relays.values():
                relay.close()
            for proc in h._procs:
                if proc.poll() is None:
                    proc.kill()
        for h in everyone:
            for proc in h._procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        errors = []
        for path in cgroups:
            try:
                _empty_cgroup(path)
            except (RuntimeError, OSError) as e:
                errors.append(str(e))
        for name in namespaces:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        if errors:
            raise RuntimeError("; ".join(errors))


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces and cgroups named `<prefix><pid>-...` whose creating process is gone (a testbed
    whose process was killed), killing what still runs in those cgroups; return their names."""
    removed = remove_stale_namespaces(prefix)
    if CPU_CGROUP.is_dir():
        for path in CPU_CGROUP.glob(f"{prefix}*"):
            pid = path.name[len(prefix):].split("-", 1)[0]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                _empty_cgroup(path)
                removed.append(path.name)
    return removed
