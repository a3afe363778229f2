"""Islands: nodes of one device class joined by fast links.

The rule (complete-linkage agglomerative clustering with a relative threshold):
1. Nodes are grouped by device class, `device_kind` + `device_name` + the operator's region label; an
   island never mixes classes or regions. Where the runs measured some nodes computing more than `speed_split`
   times slower or faster, against their profiles, than the job's nodes do at the median
   (`atoll.coordinator.calibration`: a co-tenant, a throttled card), those nodes form a class of their own, by
   how far they drifted: an island is as fast as its slowest node, and one slow node would otherwise slow its
   whole island. Relative to the median, so a slowdown every node shares (nodes sharing a machine's cores)
   splits nothing.
2. The reference is the fastest link measured anywhere in the job. A link is *fast* when its bandwidth
   (the slower of its two directions) is at least `relative_threshold` x the reference and at least
   `min_bandwidth`.
3. Within a class, start from one island per node and repeatedly merge the two islands whose slowest
   link between them is the fastest, as long as that slowest link is fast. Complete linkage means every
   pair inside an island is joined by a fast link: an island never spans a slow link.
Links neither measured nor estimated (see `atoll.coordinator.linkmatrix.complete_matrix`) count as slow.
Links are taken at their slower direction, and an unmeasured pair at its widest path (`LinkGraph`).

At scale the rule is applied without comparing every pair: nodes of one class joined by a path of fast
measured links form a group, and nodes of different groups are slow to each other; a group with no slow
measured link inside is one island (every pair in it is fast), and only a group with one is clustered
pairwise (greedily past `EXACT_LINKAGE_UP_TO` nodes, still never spanning a slow measured link).

Each island reports its slowest inner link and fastest outward link. Ids are `<kind><k>` (cpu0, cuda1),
numbered in the order of their smallest node id, so they are stable while membership is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from atoll.coordinator.linkmatrix import LinkEstimate, LinkGraph
from atoll.plan import IslandInfo
from atoll.types import NodeProfile


@dataclass(frozen=True, kw_only=True)
class IslandOptions:
    """When two nodes of a class may share an island."""

    relative_threshold: float = 0.1
    """A link is fast when at least this fraction of the fastest link measured in the job. Islands part at
    order-of-magnitude gaps (a rack's 100 Gbit/s against a 1 Gbit/s WAN), not at the few-fold noise of
    probes on busy machines."""
    min_bandwidth: float = 0.0
    """A link is fast only when at least this many bytes/s, whatever the others."""
    speed_split: float = 1.25
    """Nodes whose measured speed factor lies outside [1 / speed_split, speed_split] leave their device class
    for one of nodes that drifted alike (factors within a power of `speed_split` of each other)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.relative_threshold <= 1.0:
            raise ValueError(f"relative_threshold must be in (0, 1], got {self.relative_threshold}")
        if self.min_bandwidth < 0:
            raise ValueError(f"min_bandwidth must be >= 0, got {self.min_bandwidth}")
        if not self.speed_split > 1.0:
            raise ValueError(f"speed_split must be above 1 (a factor), got {self.speed_split}")


def device_class(profile: NodeProfile) -> str:
    """Nodes of one class may share an island: same device kind and name, and the same region label."""
    base = f"{profile.device_kind}:{profile.device_name}"
    return f"{base}@{profile.region}" if profile.region else base


def speed_class(factor: float, split: float) -> int:
    """0 for a node running within [1 / split, split] of its profile, else its drift in powers of `split`
    (2: about split^2 times slower, -1: about split times faster)."""
    if 1.0 / split <= factor <= split:
        return 0
    return round(math.log(factor) / math.log(split)) or (1 if factor > 1 else -1)


def fast_threshold(matrix: Mapping[tuple[str, str], LinkEstimate], options: IslandOptions) -> float:
    best = matrix.best_measured if isinstance(matrix, LinkGraph) else max(
        (e.bandwidth_bytes_per_s for e in matrix.values() if e.measured), default=0.0)
    return max(options.relative_threshold * best, options.min_bandwidth)


EXACT_LINKAGE_UP_TO = 400
"""A group of candidates (one class, joined by fast paths) with a slow measured link inside is clustered by
complete linkage exactly (O(m^3) on m nodes) up to this size; a larger one greedily, node by node."""


def _fast_groups(profiles: Mapping[str, NodeProfile], graph: LinkGraph, threshold: float,
                 drift: Mapping[str, int]) -> list[list[str]]:
    """Nodes of one class joined by a path of fast measured links (through nodes of any class), sorted.

    Two nodes in different groups are slow to each other, measured or estimated; so complete linkage never
    merges across groups, and clusters each group on its own.
    """
    root = {n: n for n in graph.nodes}

    def find(n: str) -> str:
        while root[n] != n:
            root[n] = root[root[n]]
            n = root[n]
        return n

    for (a, b), w in graph.pairs.items():
        if w > 0 and w >= threshold:
            ra, rb = find(a), find(b)
            if ra != rb:
                root[ra] = rb
    groups: dict[tuple[str, str], list[str]] = {}
    for n in sorted(profiles):
        groups.setdefault((device_class(profiles[n]), drift.get(n, 0), find(n) if n in root else n), []).append(n)
    return list(groups.values())


def _complete_linkage(group: list[str], graph: LinkGraph, threshold: float) -> list[list[str]]:
    """Complete-linkage agglomerative clustering of `group` with the threshold, as the module describes."""
    m = len(group)
    sim = np.zeros((m, m))
    for i in range(m):
        for j in range(i + 1, m):
            sim[i, j] = sim[j, i] = graph.bandwidth(group[i], group[j])
    members = [[n] for n in group]
    active = np.ones(m, dtype=bool)
    upper = np.triu(np.ones((m, m), dtype=bool), 1)
    while active.sum() > 1:
        masked = np.where(upper & active[:, None] & active[None, :], sim, -1.0)
        flat = int(np.argmax(masked))  # the first best pair in (i, j) order, as the merges keep list order
        i, j = divmod(flat, m)
        best = masked[i, j]
        if best <= 0 or best < threshold:
            break
        members[i] = sorted(members[i] + members[j])
        sim[i, :] = sim[:, i] = np.minimum(sim[i, :], sim[j, :])
        active[j] = False
    return [members[i] for i in range(m) if active[i]]


def _greedy(group: list[str], slow: Mapping[str, set[str]]) -> list[list[str]]:
    """Each node, in order, joins the first cluster it has no slow measured link into, else starts one."""
    clusters: list[list[str]] = []
    for n in group:
        bad = slow.get(n, set())
        for c in clusters:
            if not bad.intersection(c):
                c.append(n)
                break
        else:
            clusters.append([n])
    return clusters


def form_islands(profiles: Mapping[str, NodeProfile], matrix: Mapping[tuple[str, str], LinkEstimate],
                 options: IslandOptions | None = None, speed: Mapping[str, float] | None = None) -> list[IslandInfo]:
    """Islands of the nodes in `profiles` (node id -> profile) under the rule of this module.

    `matrix` is a `LinkGraph` (what the coordinator passes: near-linear in the links) or a dense completed
    matrix (`complete_matrix`), whose measured entries are used alike. `speed`: node id -> its measured speed
    factor (1 or absent: as profiled), taken against the median node's.
    """
    options = options or IslandOptions()
    graph = matrix if isinstance(matrix, LinkGraph) else LinkGraph.from_matrix(profiles, matrix)
    threshold = fast_threshold(graph, options)
    factors = {n: f for n, f in (speed or {}).items() if n in profiles}
    median = float(np.median([factors.get(n, 1.0) for n in profiles])) if factors else 1.0
    drift = {n: k for n, f in factors.items() if (k := speed_class(f / median, options.speed_split))}
    groups = _fast_groups(profiles, graph, threshold, drift)
    group_of = {n: k for k, g in enumerate(groups) for n in g}
    slow: dict[str, set[str]] = {}  # measured links too slow for an island, between nodes of one group
    for (a, b), w in graph.pairs.items():
        if (w <= 0 or w < threshold) and a in group_of and group_of.get(a) == group_of.get(b):
            slow.setdefault(a, set()).add(b)
            slow.setdefault(b, set()).add(a)
    clusters: list[list[str]] = []
    for group in groups:
        if not any(n in slow for n in group):
            clusters.append(group)  # every pair is fast: complete linkage merges them all
        elif len(group) <= EXACT_LINKAGE_UP_TO:
            clusters += _complete_linkage(group, graph, threshold)
        else:
            clusters += _greedy(group, slow)

    clusters.sort(key=lambda g: g[0])
    island_of = {n: k for k, g in enumerate(clusters) for n in g}
    # slowest inner link: measured pairs inside, and the narrowest forest edge of the island's Steiner tree
    # (each pair's widest path runs along the forest; the paths between members in depth-first order cover it)
    inner = [math.inf if len(g) > 1 else 0.0 for g in clusters]
    for (a, b), w in graph.pairs.items():
        k = island_of.get(a)
        if k is not None and k == island_of.get(b):
            inner[k] = min(inner[k], w)
    for k, g in enumerate(clusters):
        if len(g) > 1:
            walk = sorted(g, key=graph.position)
            inner[k] = min([inner[k]] + [graph.bottleneck(x, y) for x, y in zip(walk, walk[1:])])
    # fastest way out: the widest forest edge leaving the island (every path out leaves along one, no wider)
    outer = [0.0] * len(clusters)
    for a, b, w in graph.forest:
        ka, kb = island_of.get(a), island_of.get(b)
        if ka != kb:
            for k in (ka, kb):
                if k is not None:
                    outer[k] = max(outer[k], w)
    counters: dict[str, int] = {}
    islands = []
    for k, group in enumerate(clusters):
        first = profiles[group[0]]
        kind = first.device_kind or "dev"
        n = counters.get(kind, 0)
        counters[kind] = n + 1
        islands.append(IslandInfo(id=f"{kind}{n}", group=first.region, device=first.device_name, nodes=list(group),
                                  gpus=sum(max(1, profiles[x].device_count) for x in group),
                                  inner_bandwidth=inner[k] if math.isfinite(inner[k]) else 0.0,
                                  outer_bandwidth=outer[k]))
    return islands
