"""The link matrix: which peers each node should probe, and the matrix completed from what was measured.

Sampling (`probe_targets`): with few nodes (at most `all_pairs_up_to`) every unordered pair is probed
once, by whichever side asks first. With many, each node measures `per_class` peers of every device class
(the candidate islands) plus `random_extra` random peers, so probes grow as O(n) rather than O(n^2).
A pair counts as measured in both directions (links are assumed symmetric until both sides are probed)
and goes stale after `reprobe_after`, when it is sampled again.

Completion (`complete_matrix`): a measured pair keeps its measurement; an unmeasured pair gets the
bottleneck bandwidth of the widest path through measured links (what relaying through a third node
would reach) and the round-trip time of the fastest path; pairs with no path stay unknown (absent).

At thousands of nodes the same answers come sparse: `LinkGraph` holds the measured pairs and estimates the
others when asked (the coordinator's form), and `sample_targets` / `sample_deficit` draw and check a node's
sample in O(its links + device classes) instead of scanning every peer.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterable, Iterator, Mapping, Set
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
    max_per_round: int = 12
    """Most probes handed to one node in one heartbeat reply: a whole sample (`per_class` of up to five device
    classes and the extras), so a joining node is measured after its first heartbeat rather than its third, and
    thousands of nodes that join at once are planned a heartbeat after the last one, not several."""
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


# --- the sparse form, for thousands of nodes ---------------------------------------------------------


class LinkGraph(Mapping[tuple[str, str], LinkEstimate]):
    """The link matrix held sparse: the measured pairs, with the others estimated only when asked.

    It answers what `complete_matrix` answers, in O(links log links) to build instead of O(n^3), and without
    the n^2 table: an unmeasured pair's bandwidth is the bottleneck of the widest path through measured links,
    read off a maximum spanning forest (the widest path between two nodes runs along that forest) in
    O(log n); its round-trip time is the fastest path's, searched when asked. Pairs are taken at their slower
    direction on the way (a pair measured both ways, at two speeds, is as fast as its slower direction).
    Iterating over every pair is O(n^2): the islands and the planner never do.
    """

    def __init__(self, nodes: Iterable[str], links: Iterable[LinkMeasurement]):
        self.nodes = sorted(set(nodes))
        self._index = {n: i for i, n in enumerate(self.nodes)}
        latest: dict[tuple[str, str], LinkMeasurement] = {}
        for x in links:
            if x.src in self._index and x.dst in self._index and x.src != x.dst:
                key = (x.src, x.dst)
                if key not in latest or x.measured_unix >= latest[key].measured_unix:
                    latest[key] = x
        self._direct: dict[tuple[str, str], tuple[float, float]] = {
            k: (x.bandwidth_bytes_per_s, x.rtt_seconds) for k, x in latest.items()}
        for (s, d), x in latest.items():  # the reverse direction, where it was not measured itself
            self._direct.setdefault((d, s), (x.bandwidth_bytes_per_s, x.rtt_seconds))
        self.best_measured = max((bw for bw, _ in self._direct.values()), default=0.0)
        """The fastest link measured, in either direction."""
        self.pairs: dict[tuple[str, str], float] = {}
        """Each measured unordered pair (a < b) and its bandwidth (the slower direction)."""
        for a, b in self._direct:
            if a < b:
                self.pairs[(a, b)] = min(self._direct[(a, b)][0], self._direct[(b, a)][0])
        self._build_forest()
        self._rtt_cache: dict[str, dict[str, float]] = {}

    @classmethod
    def from_matrix(cls, nodes: Iterable[str], matrix: Mapping[tuple[str, str], LinkEstimate]) -> LinkGraph:
        """The graph of a dense matrix's measured entries (`complete_matrix`'s output, say)."""
        links = [LinkMeasurement(src=a, dst=b, bandwidth_bytes_per_s=e.bandwidth_bytes_per_s,
                                 rtt_seconds=e.rtt_seconds) for (a, b), e in matrix.items() if e.measured]
        return cls(set(nodes) | {a for a, _ in matrix} | {b for _, b in matrix}, links)

    def _build_forest(self) -> None:
        n = len(self.nodes)
        parent_uf = list(range(n))

        def find(i: int) -> int:
            while parent_uf[i] != i:
                parent_uf[i] = parent_uf[parent_uf[i]]
                i = parent_uf[i]
            return i

        adj: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        self.forest: list[tuple[str, str, float]] = []
        """The maximum spanning forest's edges (a, b, bandwidth)."""
        for (a, b), w in sorted(self.pairs.items(), key=lambda kv: -kv[1]):
            if w <= 0:
                break
            i, j = self._index[a], self._index[b]
            ri, rj = find(i), find(j)
            if ri != rj:
                parent_uf[ri] = rj
                adj[i].append((j, w))
                adj[j].append((i, w))
                self.forest.append((a, b, w))
        # root every tree, number nodes in depth-first order, and build the binary-lifting tables
        parent = list(range(n))
        up_w = [math.inf] * n
        depth = [0] * n
        tree = [-1] * n
        self.order = [0] * n
        """Depth-first position of each node (by index): a set's Steiner tree is the union of the paths
        between its members taken in this order."""
        seen = 0
        for root in range(n):
            if tree[root] >= 0:
                continue
            tree[root] = root
            stack = [root]
            while stack:
                v = stack.pop()
                self.order[v] = seen
                seen += 1
                for u, w in adj[v]:
                    if tree[u] < 0:
                        tree[u], parent[u], up_w[u], depth[u] = root, v, w, depth[v] + 1
                        stack.append(u)
        self._tree, self._depth = tree, depth
        self._up, self._min = [parent], [up_w]
        for _ in range(max(1, (max(depth, default=0)).bit_length())):
            prev_up, prev_min = self._up[-1], self._min[-1]
            self._up.append([prev_up[prev_up[v]] for v in range(n)])
            self._min.append([min(prev_min[v], prev_min[prev_up[v]]) for v in range(n)])

    def bottleneck(self, a: str, b: str) -> float:
        """The widest path's narrowest link between `a` and `b` through measured links (0: no path)."""
        i, j = self._index[a], self._index[b]
        if self._tree[i] != self._tree[j]:
            return 0.0
        if i == j:
            return math.inf
        best = math.inf
        depth = self._depth
        if depth[i] < depth[j]:
            i, j = j, i
        diff, k = depth[i] - depth[j], 0
        while diff:
            if diff & 1:
                best, i = min(best, self._min[k][i]), self._up[k][i]
            diff, k = diff >> 1, k + 1
        if i == j:
            return best
        for k in range(len(self._up) - 1, -1, -1):
            if self._up[k][i] != self._up[k][j]:
                best = min(best, self._min[k][i], self._min[k][j])
                i, j = self._up[k][i], self._up[k][j]
        return min(best, self._min[0][i], self._min[0][j])

    def bandwidth(self, a: str, b: str) -> float:
        """A pair's bandwidth at its slower direction: measured, else the widest path's (0: unknown)."""
        key = (a, b) if a < b else (b, a)
        measured = self.pairs.get(key)
        return measured if measured is not None else self.bottleneck(a, b)

    def position(self, node: str) -> int:
        return self.order[self._index[node]]

    def _rtt_from(self, a: str) -> dict[str, float]:
        """Fastest round trips from `a` through measured links (Dijkstra), kept for a few sources."""
        if a not in self._rtt_cache:
            if len(self._rtt_cache) > 64:
                self._rtt_cache.pop(next(iter(self._rtt_cache)))
            out_edges: dict[str, list[tuple[str, float]]] = {}
            for (s, d), (_, rtt) in self._direct.items():  # every measured link, as `complete_matrix` does
                out_edges.setdefault(s, []).append((d, rtt))
            dist = {a: 0.0}
            heap = [(0.0, a)]
            while heap:
                t, v = heapq.heappop(heap)
                if t > dist.get(v, math.inf):
                    continue
                for u, rtt in out_edges.get(v, ()):
                    if t + rtt < dist.get(u, math.inf):
                        dist[u] = t + rtt
                        heapq.heappush(heap, (t + rtt, u))
            self._rtt_cache[a] = dist
        return self._rtt_cache[a]

    def __getitem__(self, pair: tuple[str, str]) -> LinkEstimate:
        a, b = pair
        if a == b or a not in self._index or b not in self._index:
            raise KeyError(pair)
        direct = self._direct.get((a, b))
        if direct is not None:
            return LinkEstimate(direct[0], direct[1], True)
        wide = self.bottleneck(a, b)
        if wide <= 0:
            raise KeyError(pair)
        return LinkEstimate(wide, self._rtt_from(a).get(b, math.inf), False)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        for a in self.nodes:
            for b in self.nodes:
                if a != b and ((a, b) in self._direct or self.bottleneck(a, b) > 0):
                    yield (a, b)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, pair: object) -> bool:
        try:
            self[pair]  # type: ignore[index]
        except (KeyError, TypeError, ValueError):
            return False
        return True


def sample_deficit(node_id: str, class_of: Mapping[str, str], class_sizes: Mapping[str, int],
                   counted: Iterable[str], options: ProbeOptions) -> tuple[dict[str, int], int]:
    """What `node_id`'s sample of links still lacks, in O(its links + classes): per device class, how many more
    peers to probe, and how many more in all (random extras included).

    class_of: alive node id -> device class; class_sizes: alive nodes per class; counted: peers measured
    recently or being probed now. The rule is `probe_targets`'s: every pair with few nodes, else `per_class`
    of each class plus `random_extra`.
    """
    peers = len(class_of) - (1 if node_id in class_of else 0)
    have: dict[str, int] = {}
    total = 0
    for p in counted:
        c = class_of.get(p)
        if c is not None and p != node_id:
            have[c] = have.get(c, 0) + 1
            total += 1
    if len(class_of) <= options.all_pairs_up_to:
        return {}, peers - total
    mine = class_of.get(node_id)
    per_class: dict[str, int] = {}
    n_classes = 0
    for c, size in class_sizes.items():
        avail = size - (1 if c == mine else 0)
        if avail <= 0:
            continue
        n_classes += 1
        want = min(options.per_class, avail) - have.get(c, 0)
        if want > 0:
            per_class[c] = want
    overall = min(options.per_class * n_classes + options.random_extra, peers) - total
    return per_class, max(overall, sum(per_class.values()))


def sample_targets(node_id: str, class_of: Mapping[str, str], by_class: Mapping[str, list[str]],
                   everyone: list[str], counted: Set[str], options: ProbeOptions, rng: random.Random) -> list[str]:
    """Peers `node_id` should probe now (at most `max_per_round`), drawn at random from `by_class` (alive node
    ids of each class) and `everyone` (all of them), skipping itself and the `counted` peers (measured recently
    or in flight).

    The same sample as `probe_targets`, found by drawing rather than by scanning every peer, so one call costs
    O(probes + classes) however many nodes there are.
    """
    per_class, overall = sample_deficit(node_id, class_of, {c: len(v) for c, v in by_class.items()}, counted,
                                        options)
    if overall <= 0:
        return []
    if len(class_of) <= options.all_pairs_up_to:
        return sorted(p for p in class_of if p != node_id and p not in counted)[:options.max_per_round]
    chosen: list[str] = []
    taken = set(counted) | {node_id}

    def draw(pool: list[str], want: int) -> None:
        if len(pool) <= 4 * want + 16:  # a small pool: shuffle it once
            candidates = [p for p in pool if p not in taken]
            rng.shuffle(candidates)
            picks = candidates[:want]
        else:  # a large one: draw until enough (few draws miss, as few peers are taken)
            picks = []
            for _ in range(8 * want + 16):
                if len(picks) == want:
                    break
                p = pool[rng.randrange(len(pool))]
                if p not in taken:
                    picks.append(p)
                    taken.add(p)
        taken.update(picks)
        chosen.extend(picks)

    for c in sorted(per_class):
        draw(by_class[c], per_class[c])
    rest = overall - len(chosen)
    if rest > 0:
        draw(everyone, rest)
    return chosen[:options.max_per_round]
