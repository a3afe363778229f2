"""The cluster as the planner sees it: islands of identical devices and the links between them.

Built either from a cluster file (TOML, `load_cluster` / `parse_cluster`):

    [[group]]
    name = "a100-east"         # unique
    device = "A100-80GB"       # a catalog name, or give tflops and memory_gb (tflops_tf32, tflops_fp32,
                               # memory_gbps optional; memory_gbps, the memory bandwidth in GB/s, prices the
                               # loss and the optimizer step)
    count = 32                 # GPUs in the group (all groups together: at most 1,000,000)
    gpus_per_node = 8          # default 8 (count when smaller; a larger one is read as count, with a note)
    region = "us-east"         # default "default"
    intra_node_gbps = 600      # per GPU, to another GPU of its node (default 600: NVLink 3 on an A100)
    inter_node_gbps = 200      # per GPU, to a GPU on another node of the group (default 100)
    latency_ms = 0.02          # one way between nodes of the group (default 0.02)
    [[link]]
    between = ["us-east", "eu-west"]   # two different regions or group names; one [[link]] per pair
    gbps = 1.0                 # between regions: the link's whole capacity; between two groups: per GPU
    latency_ms = 80

where every group is one island and every number is finite (nan and inf are refused), or from live measurements
(`Cluster.from_nodes`): groups of node ids (one device each), their profiles and the measured link matrix.

Units. Every figure is a line rate in Gbit/s (stored in bytes/s), and the planner counts `link_efficiency`
of it (0.96) as reachable. Inside a region every figure is *per GPU flow*: what one GPU's traffic to one
other GPU reaches while every GPU of its node sends at once. On nodes with a NIC per GPU (DGX-style rails:
200 Gbit/s HDR per A100, 400 Gbit/s NDR per H100) that is the NIC's rate; on a node whose GPUs share one
NIC it is the NIC's rate divided by gpus_per_node (a 100 Gbit/s NIC shared by 4 GPUs: 25); for live nodes,
one device each, it is what a probe between two nodes measured, and between two machines at most what one flow
reached while every node of the machine probed another machine at once (`atoll.coordinator.machineprobe`). So a stage's replicas each send their own
stream at the figure, and a hierarchical all-reduce across k nodes moves gpus_per_node streams per node at
once. Between two groups of one region without a [[link]] entry the link is the smaller of their
inter-node figures; a [[link]] between two groups gives it per GPU flow too. A [[link]] between regions is
a shared capacity: every stream crossing it at once divides it (and none runs faster than its GPU's own
inter-node figure). Groups of different regions with no [[link]] are not connected.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from atoll.coordinator.planner.catalog import DeviceSpec, device
from atoll.fsutil import read_text_file
from atoll.modelspec import shown
from atoll.types import LinkMeasurement, NodeProfile

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GBPS = 1e9 / 8  # bytes/s in one Gbit/s
INTRA_NODE_LATENCY_S = 5e-6
INTER_NODE_LATENCY_S = 2e-5
LONE_NODE_BANDWIDTH = 100 * GBPS
"""The link figure of a cluster of one node, which has no link to measure (none of it is ever used)."""


@dataclass(frozen=True, kw_only=True)
class Link:
    """A link between two islands (or inside one)."""

    bandwidth: float
    """Bytes/s of line rate: per GPU flow when `shared` is False, the whole capacity when True."""
    latency_s: float
    """One-way latency, seconds."""
    shared: bool = False
    """True for a region-to-region link whose capacity every stream crossing it shares."""


@dataclass(frozen=True, kw_only=True)
class Island:
    """Devices of one class with fast links among them; never spans a slow link."""

    id: str
    """Unique id (the group name for a cluster file)."""
    group: str
    """Cluster-file group (or the coordinator's island label)."""
    device: DeviceSpec
    """Device model (catalog entry, or one made from a node's profile)."""
    gpus: int
    """Devices in the island."""
    gpus_per_node: int = 1
    """Devices sharing one host (and its network interface)."""
    region: str = "default"
    """Region; links between regions come from [[link]] entries."""
    intra_node_bandwidth: float | None = 600 * GBPS
    """Bytes/s of line rate from one device to another of its host; None where each host holds one device and
    nothing measured it (a live island of one node)."""
    inter_node_bandwidth: float | None = 100 * GBPS
    """Bytes/s of line rate from one device to a device on another host of the island, per GPU flow (every
    device of a host sending at once; see the module docstring); None for an island of one host with no such
    figure (a live island of one node has no link inside it to measure: its links all lead out of it). No stage
    on the island needs it then: its replicas share a host (dp 1 on one node)."""
    latency_s: float = INTER_NODE_LATENCY_S
    """One-way latency between hosts of the island."""
    nodes: tuple[str, ...] = ()
    """Host ids: measured node ids (live), or `group-k` names for a cluster file."""
    hosts: tuple[str, ...] = ()
    """Live: the machine each of `nodes` runs on (the nodes of one machine next to each other), where nodes
    that share a machine may run a stage tensor-parallel (`gpus_per_node` is then the fewest nodes any of its
    machines holds); empty: every node its own machine."""
    profile_key: str = ""
    """Key of this island's timings in a ProfileSet (the device name by default)."""

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"island {self.id!r}: gpus must be >= 1, got {self.gpus}")
        if self.gpus_per_node < 1:
            raise ValueError(f"island {self.id!r}: gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.hosts and len(self.hosts) != len(self.nodes):
            raise ValueError(f"island {self.id!r}: {len(self.hosts)} hosts for {len(self.nodes)} nodes")
        for what, bw in (("intra-node", self.intra_node_bandwidth), ("inter-node", self.inter_node_bandwidth)):
            if bw is None:
                continue
            if not (bw > 0 and math.isfinite(bw)):  # (NaN fails both)
                raise ValueError(f"island {self.id!r}: the {what} bandwidth must be a positive finite number of "
                                 f"bytes/s, got {bw}")
        if self.intra_node_bandwidth is None and self.gpus_per_node > 1:
            raise ValueError(f"island {self.id!r}: {self.gpus_per_node} devices per host need an intra-node bandwidth")
        if self.inter_node_bandwidth is None and self.gpus > self.gpus_per_node:
            raise ValueError(f"island {self.id!r}: {self.gpus} devices over several hosts need an inter-node bandwidth")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"island {self.id!r}: latency must be a finite number of seconds >= 0, got {self.latency_s}")

    @property
    def timing_key(self) -> str:
        return self.profile_key or self.device.name


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Islands and the links between them."""

    islands: tuple[Island, ...]
    """The islands, in the order they were given."""
    links: Mapping[frozenset[str], Link] = field(default_factory=dict)
    """Link between two island ids (either order); see `link`."""
    source: str = ""
    """Where the cluster came from (a file name, or "live")."""
    notes: tuple[str, ...] = ()
    """What reading a cluster file changed from what it says, one line each (`atoll plan` prints them)."""

    def __post_init__(self) -> None:
        if not self.islands:
            raise ValueError(f"{self.source or 'cluster'}: no islands (a cluster file needs at least one [[group]])")
        ids = [i.id for i in self.islands]
        dup = {x for x in ids if ids.count(x) > 1}
        if dup:
            raise ValueError(f"{self.source or 'cluster'}: island ids must be unique, repeated: {sorted(dup)}")
        # each island's link to itself, made once (the search asks for it hundreds of thousands of times); an
        # island of one node has none
        object.__setattr__(self, "_inner", {i.id: Link(bandwidth=i.inter_node_bandwidth, latency_s=i.latency_s)
                                            for i in self.islands if i.inter_node_bandwidth is not None})

    def island(self, island_id: str) -> Island:
        for i in self.islands:
            if i.id == island_id:
                return i
        raise KeyError(f"no island {island_id!r}; islands: {[i.id for i in self.islands]}")

    def link(self, a: str, b: str) -> Link | None:
        """The link between islands a and b (inside a when a == b), or None when they are not connected (a == b:
        an island of one node, which has no link inside it)."""
        if a == b:
            got = self._inner.get(a)  # type: ignore[attr-defined]
            if got is None:
                self.island(a)  # raises KeyError naming the islands
            return got
        return self.links.get(frozenset((a, b)))

    @property
    def total_gpus(self) -> int:
        return sum(i.gpus for i in self.islands)

    @property
    def regions(self) -> list[str]:
        return list(dict.fromkeys(i.region for i in self.islands))

    def subset(self, island_ids: Iterable[str]) -> "Cluster":
        """The cluster restricted to some islands (for baselines and per-region plans)."""
        keep = set(island_ids)
        islands = tuple(i for i in self.islands if i.id in keep)
        links = {k: v for k, v in self.links.items() if k <= keep}
        return replace(self, islands=islands, links=links)

    @classmethod
    def from_nodes(cls, islands: Mapping[str, Sequence[str]], profiles: Mapping[str, NodeProfile],
                   links: Iterable[LinkMeasurement] | Mapping[tuple[str, str], tuple[float, float]],
                   *, regions: Mapping[str, str] | None = None, hosts: Mapping[str, str] | None = None) -> "Cluster":
        """A cluster from live measurements.

        `islands` maps an island id to its node ids (one device per node); `profiles` maps node id to the
        profile it joined with (device name, memory, layer timings; timings are looked up under the island
        id, see `ProfileSet.from_node_profiles`); `links` are measurements, or (src, dst) ->
        (bandwidth bytes/s, latency seconds). Inside an island the slowest measured link counts; between
        islands the median of the measured pairs. Unmeasured pairs fall back to the slowest measured link. An
        island of one node has no link inside it: its intra- and inter-node figures are None (the slowest link
        measured anywhere, a wide-area one, stood in for them before and made every one-node region look as slow
        inside as the links between regions).

        `hosts` (node id -> machine) groups the nodes of each island by machine: the island's `gpus_per_node` is
        then the fewest nodes any of its machines holds (the planner's tp bound), its intra-node bandwidth the
        slowest measured link between nodes of one machine and its inter-node bandwidth the slowest between
        machines. Without it every node is its own machine (tp 1).
        """
        if isinstance(links, Mapping):
            items = [(s, d, bw, lat) for (s, d), (bw, lat) in links.items()]
        else:
            items = [(m.src, m.dst, m.bandwidth_bytes_per_s, m.rtt_seconds / 2) for m in links]
        alone = sum(len(v) for v in islands.values()) == 1
        if not items and not alone:
            raise ValueError("no link measurements: probe at least one pair of nodes before planning")
        # a lone node talks to no one: its (unused) links get a figure that constrains nothing
        floor_bw, floor_lat = (float("inf"), 0.0) if items else (LONE_NODE_BANDWIDTH, 0.0)

        # the measurements inside each island and between each pair of islands, in one pass over the links
        # (not over every pair of nodes: thousands of nodes make millions of pairs, and few are measured)
        island_of = {n: iid for iid, node_ids in islands.items() for n in node_ids}
        inside: dict[str, list[tuple[float, float]]] = {}
        same_host: dict[str, list[tuple[float, float]]] = {}  # between nodes of one machine, per island
        across: dict[tuple[str, str], list[tuple[float, float]]] = {}  # (lower island id, higher)
        for s, d, bw, lat in items:
            if bw <= 0:
                raise ValueError(f"link {s} -> {d}: bandwidth must be positive, got {bw}")
            floor_bw, floor_lat = min(floor_bw, bw), max(floor_lat, lat)
            ia, ib = island_of.get(s), island_of.get(d)
            if s == d or ia is None or ib is None:
                continue
            if ia == ib:
                if hosts is not None and hosts.get(s, s) == hosts.get(d, d):
                    same_host.setdefault(ia, []).append((bw, lat))
                else:
                    inside.setdefault(ia, []).append((bw, lat))
            else:
                across.setdefault((ia, ib) if ia < ib else (ib, ia), []).append((bw, lat))

        built: list[Island] = []
        for iid, node_ids in islands.items():
            if not node_ids:
                raise ValueError(f"island {iid!r} has no nodes")
            missing = [n for n in node_ids if n not in profiles]
            if missing:
                raise ValueError(f"island {iid!r}: no profile for node(s) {missing}")
            profs = [profiles[n] for n in node_ids]
            mem_gb = min((p.memory_free_bytes or p.memory_total_bytes) for p in profs) / 1e9
            if mem_gb <= 0:
                raise ValueError(f"island {iid!r}: the nodes' profiles report no memory")
            name = profs[0].device_name or profs[0].device_kind
            try:
                base = device(name)
                dev = replace(base, memory_gb=mem_gb)
            except ValueError:
                dev = DeviceSpec(name=name, tflops_16=0.0, tflops_32=0.0, memory_gb=mem_gb, source="node profile")
            # with machines, `inside` holds the links between them; unmeasured, those within them stand in, as
            # every link of the island did before
            inner = inside.get(iid, []) or same_host.get(iid, [])
            lone = len(node_ids) == 1  # no link inside to measure, nor to make up
            bw: float | None = None if lone else min((b for b, _ in inner), default=floor_bw)
            lat = 0.0 if lone else max((t for _, t in inner), default=floor_lat)
            per_node, intra, order, machines = 1, bw, tuple(node_ids), ()
            if hosts is not None:
                by_host: dict[str, list[str]] = {}
                for n in node_ids:  # the machines in the order their first node came, each one's nodes together
                    by_host.setdefault(hosts.get(n, n), []).append(n)
                order = tuple(n for ns in by_host.values() for n in ns)
                machines = tuple(h for h, ns in by_host.items() for _ in ns)
                per_node = min(len(ns) for ns in by_host.values())
                intra = None if lone else min((b for b, _ in same_host.get(iid, [])), default=bw)
            built.append(Island(id=iid, group=iid, device=dev, gpus=len(node_ids), gpus_per_node=per_node,
                                region=(regions or {}).get(iid, "default"), intra_node_bandwidth=intra,
                                inter_node_bandwidth=bw, latency_s=lat, nodes=order, hosts=machines,
                                profile_key=iid))
        between: dict[frozenset[str], Link] = {}
        for a in built:
            for b in built:
                if a.id >= b.id:
                    continue
                got = sorted(across.get((a.id, b.id), []))
                if got:
                    bw, lat = got[len(got) // 2]
                else:
                    bw, lat = floor_bw, floor_lat
                between[frozenset((a.id, b.id))] = Link(bandwidth=bw, latency_s=lat)
        return cls(islands=tuple(built), links=between, source="live")


# --- cluster files -------------------------------------------------------------------------------------

GROUP_FIELDS = {"name", "device", "count", "gpus_per_node", "region", "intra_node_gbps", "inter_node_gbps",
                "tflops", "tflops_tf32", "tflops_fp32", "memory_gb", "memory_gbps", "latency_ms"}
LINK_FIELDS = {"between", "gbps", "latency_ms"}
MAX_CLUSTER_GPUS = 1_000_000
"""The most GPUs a cluster file may describe, all its groups together: far beyond any cluster there is, so a larger
count is a typo, refused before the planner names every node of it."""


class ClusterFileError(ValueError):
    """A cluster file that cannot be used; the message names the file, line and field."""


def load_cluster(path: str | Path, *, source: str | None = None) -> Cluster:
    """Read a cluster file (TOML); `source` names it in messages and `Cluster.source` (default: `path`), e.g. as
    the user typed it where `path` is the installed example it found (`atoll.inputs.input_path`)."""
    text = read_text_file(path, "cluster file", "name a cluster file (TOML), e.g. examples/clusters/two-regions.toml",
                          ClusterFileError, listing="*.toml")
    return parse_cluster(text, source=str(path) if source is None else source)


def _table_lines(text: str, header: str) -> list[int]:
    """1-based line numbers of each `[[header]]` table, in order."""
    pat = re.compile(r"^\s*\[\[\s*" + re.escape(header) + r"\s*\]\]")
    return [n for n, line in enumerate(text.splitlines(), 1) if pat.match(line)]


def _top_line(text: str, key: str) -> str:
    """`:N` for the first line that starts a `[key]` table or sets `key = ...` ("" when there is none)."""
    pat = re.compile(r"^\s*(\[\s*" + re.escape(key) + r"\s*\]|" + re.escape(key) + r"\s*=)")
    return next((f":{n}" for n, line in enumerate(text.splitlines(), 1) if pat.match(line)), "")


def _field_line(text: str, start: int, key: str) -> int:
    """Line of `key = ...` in the table starting at line `start` (the header's line when absent)."""
    lines = text.splitlines()
    pat = re.compile(r"^\s*" + re.escape(key) + r"\s*=")
    for n in range(start, len(lines)):
        line = lines[n]
        if re.match(r"^\s*\[", line):
            break
        if pat.match(line):
            return n + 1
    return start


def _tables(doc: dict[str, Any], text: str, source: str, key: str, what: str) -> list[dict[str, Any]]:
    """The `[[key]]` tables of the file, or a ClusterFileError that says how to write them."""
    v = doc.get(key, [])
    where = f"{source}{_top_line(text, key)}"
    if isinstance(v, dict):
        raise ClusterFileError(f"{where}: [{key}] is a single table; write [[{key}]] (double brackets: an array of "
                               f"tables), one for each {what}")
    if not isinstance(v, list):
        raise ClusterFileError(f"{where}: {key} = {shown(v)} is not a table; write a [[{key}]] table for each {what}")
    bad = next((t for t in v if not isinstance(t, dict)), None)
    if bad is not None:
        raise ClusterFileError(f"{where}: {key} = [...] holds {shown(bad)}, not a table; write a [[{key}]] table "
                               f"for each {what}")
    return v


def parse_cluster(text: str, source: str = "<cluster>") -> Cluster:
    """Parse a cluster file's text; errors name the line, the [[group]] / [[link]] and the field."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ClusterFileError(f"{source}: not valid TOML: {e}") from None
    unknown_top = set(doc) - {"group", "link"}
    if unknown_top:
        raise ClusterFileError(f"{source}: unknown table(s) {sorted(unknown_top)}; a cluster file has [[group]] "
                               "and [[link]] tables")
    groups = _tables(doc, text, source, "group", "group of GPUs")
    if not groups:
        raise ClusterFileError(f"{source}: no [[group]] tables; add at least one group of GPUs")
    group_lines = _table_lines(text, "group")
    islands: list[Island] = []
    notes: list[str] = []
    total = 0
    for gi, g in enumerate(groups):
        start = group_lines[gi] if gi < len(group_lines) else 1
        label = f"[[group]] #{gi + 1}" + (f" {g.get('name')!r}" if isinstance(g.get("name"), str) else "")

        def err(key: str, msg: str) -> ClusterFileError:
            return ClusterFileError(f"{source}:{_field_line(text, start, key)}: {label}: field {key!r} {msg}")

        unknown = set(g) - GROUP_FIELDS
        if unknown:
            key = sorted(unknown)[0]
            raise err(key, f"is unknown; known fields: {', '.join(sorted(GROUP_FIELDS))}")
        island = _parse_group(g, err, start, source, gi, notes)
        total += island.gpus
        if total > MAX_CLUSTER_GPUS:
            raise err("count", f"brings the file to {total:,} GPUs, more than the {MAX_CLUSTER_GPUS:,} a cluster file "
                      "may describe; check the count")
        islands.append(island)
    names = [i.id for i in islands]
    for gi, n in enumerate(names):
        if names.index(n) != gi:
            start = group_lines[gi] if gi < len(group_lines) else 1
            raise ClusterFileError(f"{source}:{_field_line(text, start, 'name')}: [[group]] #{gi + 1}: "
                                   f"field 'name' {n!r} repeats [[group]] #{names.index(n) + 1}; names must be unique")

    link_lines = _table_lines(text, "link")
    by_region: dict[str, list[Island]] = {}
    for i in islands:
        by_region.setdefault(i.region, []).append(i)
    explicit: dict[frozenset[str], Link] = {}
    seen: dict[frozenset[str], int] = {}  # the ends a [[link]] names -> its index
    for li, raw in enumerate(_tables(doc, text, source, "link", "link between two regions or groups")):
        start = link_lines[li] if li < len(link_lines) else 1

        def lerr(key: str, msg: str) -> ClusterFileError:
            return ClusterFileError(f"{source}:{_field_line(text, start, key)}: [[link]] #{li + 1}: field {key!r} {msg}")

        unknown = set(raw) - LINK_FIELDS
        if unknown:
            raise lerr(sorted(unknown)[0], f"is unknown; known fields: {', '.join(sorted(LINK_FIELDS))}")
        between = raw.get("between")
        if (not isinstance(between, list) or len(between) != 2
                or not all(isinstance(x, str) for x in between)):
            raise lerr("between", f"must be a list of two region or group names, got {shown(between)}")
        ends = []
        for name in between:
            if name in names:
                ends.append([islands[names.index(name)]])
            elif name in by_region:
                ends.append(by_region[name])
            else:
                raise lerr("between", f"names {name!r}, which is neither a region ({', '.join(by_region)}) "
                           f"nor a group ({', '.join(names)})")
        if between[0] == between[1]:
            inside = ("inside a group, its inter_node_gbps and latency_ms set the links" if between[0] in names else
                      "inside a region, give a [[link]] between two of its groups")
            raise lerr("between", f"names {between[0]!r} twice; a [[link]] joins two different regions or groups "
                       f"({inside})")
        pair = frozenset(between)
        if pair in seen:
            first = seen[pair]
            at = link_lines[first] if first < len(link_lines) else 1
            raise lerr("between", f"repeats [[link]] #{first + 1} (line {at}) between {between[0]!r} and "
                       f"{between[1]!r}; give each pair one [[link]]")
        seen[pair] = li
        gbps = _positive(raw, "gbps", None, lerr)
        lat = _nonneg(raw, "latency_ms", 1.0, lerr) / 1e3
        shared = ends[0][0].region != ends[1][0].region or len(ends[0]) > 1
        for a in ends[0]:
            for b in ends[1]:
                if a.id != b.id:
                    explicit[frozenset((a.id, b.id))] = Link(bandwidth=gbps * GBPS, latency_s=lat, shared=shared)

    links: dict[frozenset[str], Link] = {}
    for a in islands:
        for b in islands:
            if a.id >= b.id:
                continue
            key = frozenset((a.id, b.id))
            if key in explicit:
                links[key] = explicit[key]
            elif a.region == b.region:
                links[key] = Link(bandwidth=min(a.inter_node_bandwidth, b.inter_node_bandwidth),
                                  latency_s=max(a.latency_s, b.latency_s))
    return Cluster(islands=tuple(islands), links=links, source=source, notes=tuple(notes))


def _number(d: dict[str, Any], key: str, default: float | None, err: Any, *, zero: bool) -> float:
    """`d[key]` (else `default`) as a finite number, > 0 (>= 0 with `zero`); NaN and inf are refused by name."""
    v = d.get(key, default)
    if v is None:
        raise err(key, "is missing")
    want = "a finite number >= 0" if zero else "a positive finite number"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise err(key, f"must be {want}, got {shown(v)}")
    if math.isnan(v) or math.isinf(v):
        too_big = " (TOML reads numbers beyond 1.8e308 as inf too)" if math.isinf(v) else ""
        raise err(key, f"must be {want}, got {v}{too_big}")
    if v < 0 or (v == 0 and not zero):
        raise err(key, f"must be {want}, got {v!r}")
    return float(v)


def _positive(d: dict[str, Any], key: str, default: float | None, err: Any) -> float:
    return _number(d, key, default, err, zero=False)


def _nonneg(d: dict[str, Any], key: str, default: float, err: Any) -> float:
    return _number(d, key, default, err, zero=True)


def _parse_group(g: dict[str, Any], err: Any, start: int, source: str, gi: int, notes: list[str]) -> Island:
    """The island of one [[group]]; `err(field, message)` makes the error to raise, and `notes` gets a line for each
    value read otherwise than written."""
    name = g.get("name")
    if not isinstance(name, str) or not name.strip():
        raise err("name", f"must be a non-empty string, got {shown(name)}")
    count = g.get("count")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise err("count", f"must be a positive integer (GPUs in the group), got {shown(count)}")
    if count > MAX_CLUSTER_GPUS:
        raise err("count", f"is {count:,}, more than the {MAX_CLUSTER_GPUS:,} GPUs a cluster file may describe; "
                  "check the count")
    gpn = g.get("gpus_per_node", min(8, count))
    if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
        raise err("gpus_per_node", f"must be a positive integer, got {shown(gpn)}")
    if gpn > count:  # a group of fewer GPUs than its machine holds: they share one node
        notes.append(str(err("gpus_per_node", f"is {gpn}, more than the group's count ({count}): read as "
                             f"gpus_per_node = {count}, all of its GPUs on one node; write that to silence this note")))
        gpn = count
    region = g.get("region", "default")
    if not isinstance(region, str) or not region:
        raise err("region", f"must be a non-empty string, got {shown(region)}")
    dev_name = g.get("device")
    if dev_name is not None and not isinstance(dev_name, str):
        raise err("device", f"must be a string (a catalog name), got {shown(dev_name)}")
    custom = {k: g[k] for k in ("tflops", "tflops_tf32", "tflops_fp32", "memory_gb", "memory_gbps") if k in g}
    if dev_name is None and not {"tflops", "memory_gb"} <= set(custom):
        raise err("device", "is missing: give a catalog device name, or tflops and memory_gb")
    base: DeviceSpec | None = None
    if dev_name is not None:
        try:
            base = device(dev_name)
        except ValueError as e:
            if not {"tflops", "memory_gb"} <= set(custom):
                raise err("device", f"is not in the catalog: {e}") from None
    t16 = _positive(g, "tflops", base.tflops_16 if base else None, err)
    t32 = _positive(g, "tflops_fp32", base.tflops_32 if base else t16 / 8, err)
    tf32 = _nonneg(g, "tflops_tf32", base.tflops_tf32 if base else 0.0, err)  # 0: no TF32 tensor cores
    mem = _positive(g, "memory_gb", base.memory_gb if base else None, err)
    mem_bw = _nonneg(g, "memory_gbps", base.memory_gbps if base else 0.0, err)  # 0: not known
    dev = DeviceSpec(name=base.name if base else str(dev_name or name), tflops_16=t16, tflops_32=t32,
                     tflops_tf32=tf32, memory_gb=mem, memory_gbps=mem_bw, source=base.source if base and not custom else f"{source} [[group]] #{gi + 1}")
    intra = _positive(g, "intra_node_gbps", 600.0, err) * GBPS
    inter = _positive(g, "inter_node_gbps", 100.0, err) * GBPS
    lat = _nonneg(g, "latency_ms", INTER_NODE_LATENCY_S * 1e3, err) / 1e3
    hosts = -(-count // gpn)
    return Island(id=name, group=name, device=dev, gpus=count, gpus_per_node=gpn, region=region,
                  intra_node_bandwidth=intra, inter_node_bandwidth=inter, latency_s=lat,
                  nodes=tuple(f"{name}-{k}" for k in range(hosts)))
