"""Islands: nodes of one device class joined by fast links.

The rule (complete-linkage agglomerative clustering with a relative threshold):
1. Nodes are grouped by device class, `device_kind` + `device_name` + the operator's region label; an
   island never mixes classes or regions.
2. The reference is the fastest link measured anywhere in the job. A link is *fast* when its bandwidth
   (the slower of its two directions) is at least `relative_threshold` x the reference and at least
   `min_bandwidth`.
3. Within a class, start from one island per node and repeatedly merge the two islands whose slowest
   link between them is the fastest, as long as that slowest link is fast. Complete linkage means every
   pair inside an island is joined by a fast link: an island never spans a slow link.
Links neither measured nor estimated (see `atoll.coordinator.linkmatrix.complete_matrix`) count as slow.

Each island reports its slowest inner link and fastest outward link. Ids are `<kind><k>` (cpu0, cuda1),
numbered in the order of their smallest node id, so they are stable while membership is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from atoll.coordinator.linkmatrix import LinkEstimate, symmetric_bandwidth
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

    def __post_init__(self) -> None:
        if not 0.0 < self.relative_threshold <= 1.0:
            raise ValueError(f"relative_threshold must be in (0, 1], got {self.relative_threshold}")
        if self.min_bandwidth < 0:
            raise ValueError(f"min_bandwidth must be >= 0, got {self.min_bandwidth}")


def device_class(profile: NodeProfile) -> str:
    """Nodes of one class may share an island: same device kind and name, and the same region label."""
    base = f"{profile.device_kind}:{profile.device_name}"
    return f"{base}@{profile.region}" if profile.region else base


def fast_threshold(matrix: Mapping[tuple[str, str], LinkEstimate], options: IslandOptions) -> float:
    measured = [e.bandwidth_bytes_per_s for e in matrix.values() if e.measured]
    best = max(measured, default=0.0)
    return max(options.relative_threshold * best, options.min_bandwidth)


def form_islands(profiles: Mapping[str, NodeProfile], matrix: Mapping[tuple[str, str], LinkEstimate],
                 options: IslandOptions | None = None) -> list[IslandInfo]:
    """Islands of the nodes in `profiles` (node id -> profile) under the rule of this module."""
    options = options or IslandOptions()
    threshold = fast_threshold(matrix, options)
    by_class: dict[str, list[str]] = {}
    for node_id in sorted(profiles):
        by_class.setdefault(device_class(profiles[node_id]), []).append(node_id)

    def bw(a: str, b: str) -> float:
        return symmetric_bandwidth(matrix, a, b)

    clusters: list[list[str]] = []
    for nodes in by_class.values():
        groups = [[n] for n in nodes]
        while len(groups) > 1:
            best, pair = -1.0, (0, 0)
            for i in range(len(groups)):
                for j in range(i + 1, len(groups)):
                    link = min(bw(a, b) for a in groups[i] for b in groups[j])
                    if link > best:
                        best, pair = link, (i, j)
            if best <= 0 or best < threshold:
                break
            i, j = pair
            groups[i] = sorted(groups[i] + groups[j])
            del groups[j]
        clusters += groups

    clusters.sort(key=lambda g: g[0])
    counters: dict[str, int] = {}
    islands = []
    everyone = sorted(profiles)
    for group in clusters:
        first = profiles[group[0]]
        kind = first.device_kind or "dev"
        k = counters.get(kind, 0)
        counters[kind] = k + 1
        inner = min((bw(a, b) for a in group for b in group if a < b), default=0.0)
        outside = [n for n in everyone if n not in group]
        outer = max((bw(a, b) for a in group for b in outside), default=0.0)
        islands.append(IslandInfo(id=f"{kind}{k}", group=first.region, device=first.device_name, nodes=list(group),
                                  gpus=sum(max(1, profiles[n].device_count) for n in group),
                                  inner_bandwidth=inner, outer_bandwidth=outer))
    return islands
