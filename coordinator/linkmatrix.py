"""The link matrix: which peers each node should probe, and the matrix completed from what was measured.

Sampling (`probe_targets`): with few nodes (at most `all_pairs_up_to`) every unordered pair is probed
once, by whichever side asks first. With many, each node measures `per_class` peers of every device class
(the candidate islands) plus `random_extra` random peers, so probes grow as O(n) rather than O(n^2).
A pair counts as measured in both directions (links are assumed symmetric until both sides are probed)
and goes stale after `reprobe_after`, when it is sampled again.

Completion (`complete_matrix`): a measured pair keeps its measurement; an unmeasured pair gets the
bottleneck bandwidth of the widest path through measured links (what relaying through a third node
would reach) and the round-trip time of the fastest path; pairs with no path stay unknown (absent).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass
from datetime import timedelta

import numpy as np

from atoll.types import LinkMeasurement

Pair = frozenset[str]


@dataclass(frozen=True, kw_only=True)
class ProbeOptions:
    """How links are sampled and refreshed."""

    probe_bytes: int = 4 * 1024 * 1024
    """Payload of one bandwidth probe."""
    all_pairs_up_to: int = 8
    """Probe every pair while the job has at most this many alive nodes."""
    per_class: int = 2
    """With more nodes: peers each node probes in every device class."""
    random_extra: int = 2
    """With more nodes: further random peers each node probes."""
    max_per_round: int = 4
    """Most probes handed to one node in one heartbeat reply."""
    reprobe_after: timedelta = timedelta(minutes=10)
    """A measurement older than this is taken again."""
    in_flight_timeout: timedelta = timedelta(seconds=30)
    """A probe handed out but not reported within this long is handed out again."""

    def __post_init__(self) -> None:
        if self.probe_bytes < 1024:
            raise ValueError(f"probe_bytes must be at least 1024, got {self.probe_bytes}")
        for name in ("all_pairs_up_to", "per_class", "max_per_round"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.random_extra < 0:
            raise ValueError(f"random_extra must be >= 0, got {self.random_extra}")
        if self.reprobe_after <= timedelta(0) or self.in_flight_timeout <= timedelta(0):
            raise ValueError("reprobe_after and in_flight_timeout must be positive")


def fresh_pairs(links: Iterable[LinkMeasurement], now: float, options: ProbeOptions,
                stale_before: float = 0.0) -> set[Pair]:
    """Unordered pairs with a measurement newer than `reprobe_after` and than `stale_before`."""
    horizon = max(now - options.reprobe_after.total_seconds(), stale_before)
    return {frozenset((x.src, x.dst)) for x in links if x.measured_unix >= horizon and x.src != x.dst}


def probe_targets(node_id: str, classes: Mapping[str, str], fresh: Set[Pair], in_flight: Set[Pair],
                  options: ProbeOptions, rng: random.Random | None = None) -> list[str]:
    """Peers `node_id` should probe now, at most `max_per_round`.

    classes: alive node id -> device class; fresh: pairs measured recently; in_flight: pairs handed out
    and not yet reported. An empty answer with nothing in flight means the node's links are complete.
    """
    peers = sorted(p for p in classes if p != node_id)
    todo = [p for p in peers if frozenset((node_id, p)) not in fresh]
    if len(classes) <= options.all_pairs_up_to:
        chosen = todo
    else:
        rng = rng or random.Random(node_id)
        have: dict[str, int] = {}
        for p in peers:
            if frozenset((node_id, p)) in fresh:
                have[classes[p]] = have.get(classes[p], 0) + 1
        chosen = []
        for cls in sorted(set(classes[p] for p in peers)):
            candidates = [p for p in todo if classes[p] == cls]
            rng.shuffle(candidates)
            chosen += candidates[:max(0, options.per_class - have.get(cls, 0))]
        n_classes = len(set(classes[p] for p in peers))
        target = options.per_class * n_classes + options.random_extra
        rest = [p for p in todo if p not in chosen]
        rng.shuffle(rest)
        covered = sum(have.values()) + len(chosen)
        chosen += rest[:max(0, min(target, len(peers)) - covered)]
    chosen = [p for p in chosen if frozenset((node_id, p)) not in in_flight]
    return chosen[:options.max_per_round]


def needs_probes(node_id: str, classes: Mapping[str, str], fresh: Set[Pair], options: ProbeOptions) -> bool:
    """Whether the node's sample of links is incomplete (in-flight probes count as missing)."""
    return bool(probe_targets(node_id, classes, fresh, set(), options))


@dataclass(frozen=True)
class LinkEstimate:
    bandwidth_bytes_per_s: float
    rtt_seconds: float
    measured: bool


def complete_matrix(nodes: list[str], links: Iterable[LinkMeasurement]) -> dict[tuple[str, str], LinkEstimate]:
    """Directed estimates for every ordered pair of `nodes` that is measured or reachable through measured
    links. A pair measured in one direction only is taken as symmetric."""
    index = {n: i for i, n in enumerate(nodes)}
    n = len(nodes)
    bw = np.zeros((n, n))
    rtt = np.full((n, n), np.inf)
    direct = np.zeros((n, n), dtype=bool)
    latest: dict[tuple[str, str], LinkMeasurement] = {}
    for x in links:
        if x.src in index and x.dst in index and x.src != x.dst:
            key = (x.src, x.dst)
            if key not in latest or x.measured_unix >= latest[key].measured_unix:
                latest[key] = x
    for (s, d), x in latest.items():
        i, j = index[s], index[d]
        bw[i, j], rtt[i, j], direct[i, j] = x.bandwidth_bytes_per_s, x.rtt_seconds, True
    for (s, d), x in latest.items():  # the reverse direction, where it was not measured itself
        i, j = index[s], index[d]
        if not direct[j, i]:
            bw[j, i], rtt[j, i] = x.bandwidth_bytes_per_s, x.rtt_seconds
    measured = direct | direct.T
    # widest path (max-min) for bandwidth and shortest path for rtt, over measured links
    wide, fast = bw.copy(), rtt.copy()
    for k in range(n):
        wide = np.maximum(wide, np.minimum(wide[:, k:k + 1], wide[k:k + 1, :]))
        fast = np.minimum(fast, fast[:, k:k + 1] + fast[k:k + 1, :])
    out: dict[tuple[str, str], LinkEstimate] = {}
    for i, a in enumerate(nodes):
        for j, b in enumerate(nodes):
            if i == j:
                continue
            if measured[i, j]:
                out[(a, b)] = LinkEstimate(float(bw[i, j]), float(rtt[i, j]), True)
            elif wide[i, j] > 0:
                out[(a, b)] = LinkEstimate(float(wide[i, j]), float(fast[i, j]), False)
    return out


def symmetric_bandwidth(matrix: Mapping[tuple[str, str], LinkEstimate], a: str, b: str) -> float:
    """The slower direction of a pair (0 when unknown)."""
    ab, ba = matrix.get((a, b)), matrix.get((b, a))
    if ab is None or ba is None:
        return 0.0
    return min(ab.bandwidth_bytes_per_s, ba.bandwidth_bytes_per_s)
