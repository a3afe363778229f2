"""Which nodes accept connections, and how the links of those that do not are measured, priced and routed.

A node accepts no connections when it says so (`atoll node --no-listen`: it advertises no address) or when
the coordinator cannot dial its advertised address back at join (`atoll.coordinator.dialback`). Such a node
opens the streams to its neighbours itself, so:

- probes go from it to nodes that accept connections, never to it (`probe_pairs_skipped`);
- between two such nodes nothing can be dialed: their link goes through a relay, a node that accepts
  connections, and is priced as the slower of its two legs (`relay_links`), which is what the planner sees;
- the plan names the relay of each such pair of neighbours (`plan_relays`);
- such a node is an island of its own (`separate_unreachable`): a stage's replicas average gradients in a
  gloo or NCCL group, which connects every pair directly.

Pure functions of the members and links; no gRPC here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dataclasses import replace

from atoll.plan import IslandInfo, Plan, RelayRoute
from atoll.types import LinkMeasurement, NodeProfile


def accepts_connections(profile: NodeProfile, peer_address: str) -> bool:
    return bool(peer_address) and not profile.unreachable


def plan_address(member) -> str:
    """What a plan lists as a member's (`MemberRecord`) address: "" for one that accepts no connections."""
    return member.peer_address if accepts_connections(member.profile, member.peer_address) else ""


def unreachable_nodes(members: Mapping[str, object]) -> set[str]:
    """Ids of members (`MemberRecord`s) that accept no connections."""
    return {n for n, m in members.items()
            if not accepts_connections(m.profile, m.peer_address)}  # type: ignore[attr-defined]


def probe_pairs_skipped(unreachable: Iterable[str]) -> set[frozenset[str]]:
    """Pairs never probed: both ends accept no connections (their link is a relay's, `relay_links`)."""
    u = sorted(set(unreachable))
    return {frozenset((a, b)) for i, a in enumerate(u) for b in u[i + 1:]}


def allowed_probe(src: str, dst: str, unreachable: set[str]) -> bool:
    """Whether `src` may dial `dst` to probe their link: only a node that accepts connections is dialed."""
    return dst not in unreachable


def _best(links: Iterable[LinkMeasurement]) -> dict[frozenset[str], LinkMeasurement]:
    """The measured link of each pair, either direction (the better measurement when both were taken)."""
    out: dict[frozenset[str], LinkMeasurement] = {}
    for x in links:
        if x.bandwidth_bytes_per_s <= 0:
            continue
        key = frozenset((x.src, x.dst))
        if key not in out or x.bandwidth_bytes_per_s > out[key].bandwidth_bytes_per_s:
            out[key] = x
    return out


def choose_relay(a: str, b: str, relays: Iterable[str],
                 links: Mapping[frozenset[str], LinkMeasurement]) -> tuple[str, float, float] | None:
    """(relay, bandwidth, rtt) of the best relay between `a` and `b`: the node that accepts connections whose
    slower leg is fastest (ties: the smaller round trip, then the id). None when no relay has both legs."""
    best: tuple[float, float, str] | None = None
    for r in sorted(relays):
        if r in (a, b):
            continue
        x, y = links.get(frozenset((a, r))), links.get(frozenset((r, b)))
        if x is None or y is None:
            continue
        bw = min(x.bandwidth_bytes_per_s, y.bandwidth_bytes_per_s)
        rtt = x.rtt_seconds + y.rtt_seconds
        if best is None or (bw, -rtt) > (best[0], -best[1]):
            best = (bw, rtt, r)
    return None if best is None else (best[2], best[0], best[1])


def relay_links(links: list[LinkMeasurement], nodes: Iterable[str], unreachable: set[str],
                now: float = 0.0) -> tuple[list[LinkMeasurement], dict[frozenset[str], tuple[str, float]]]:
    """The links the planner should see, and the relay of each pair of nodes that both accept no connections.

    Measured links are kept; each pair of unreachable nodes gets the link through its best relay (both
    directions), priced as the slower leg with the legs' round trips added, so the planner counts the relay's
    bandwidth. A pair with no relay gets no link (the planner treats it as unmeasured and slow).
    """
    nodes = set(nodes)
    if len(unreachable & nodes) < 2:  # no pair to relay (the common case: no pass over every link)
        return list(links), {}
    measured = _best(links)
    relays = nodes - unreachable
    extra: list[LinkMeasurement] = []
    routes: dict[frozenset[str], tuple[str, float]] = {}
    u = sorted(unreachable & nodes)
    for i, a in enumerate(u):
        for b in u[i + 1:]:
            best = choose_relay(a, b, relays, measured)
            if best is None:
                continue
            via, bw, rtt = best
            routes[frozenset((a, b))] = (via, bw)
            extra += [LinkMeasurement(src=a, dst=b, bandwidth_bytes_per_s=bw, rtt_seconds=rtt, measured_unix=now),
                      LinkMeasurement(src=b, dst=a, bandwidth_bytes_per_s=bw, rtt_seconds=rtt, measured_unix=now)]
    return [x for x in links if frozenset((x.src, x.dst)) not in routes] + extra, routes


def plan_relays(plan: Plan, unreachable: set[str],
                routes: Mapping[frozenset[str], tuple[str, float]]) -> tuple[list[RelayRoute], list[str]]:
    """The relay of every pair of neighbouring stages' nodes that both accept no connections, and a line for
    each such pair that has none (no node that accepts connections has measured links to both)."""
    out: dict[frozenset[str], RelayRoute] = {}
    missing: list[str] = []
    for p_index, pipeline in enumerate(plan.pipelines):
        for s_index, (up, down) in enumerate(zip(pipeline.stages, pipeline.stages[1:])):
            for a in up.nodes:
                for b in down.nodes:
                    if a not in unreachable or b not in unreachable or frozenset((a, b)) in out:
                        continue
                    route = routes.get(frozenset((a, b)))
                    if route is None:
                        missing.append(
                            f"pipeline {p_index}: {a} (stage {s_index}) and {b} (stage {s_index + 1}) both accept no "
                            f"connections and no node that does has measured links to both to relay between them; "
                            f"start a node that accepts connections (a public --advertise address)")
                        continue
                    out[frozenset((a, b))] = RelayRoute(a=a, b=b, via=route[0], bandwidth_bytes_per_s=route[1])
    return list(out.values()), missing


def separate_unreachable(islands: list[IslandInfo], members: Mapping[str, object]) -> list[IslandInfo]:
    """`islands` with every node that accepts no connections (`members`: id -> `MemberRecord`) moved out of a
    shared island into one of its own (id `<island>-u<k>`), so no data-parallel group needs to dial it."""
    unreachable = unreachable_nodes(members)
    out: list[IslandInfo] = []
    for island in islands:
        alone = [n for n in island.nodes if n in unreachable]
        if len(island.nodes) < 2 or not alone:
            out.append(island)
            continue
        rest = [n for n in island.nodes if n not in unreachable]
        count = {n: max(1, members[n].profile.device_count) for n in island.nodes}  # type: ignore[attr-defined]
        if rest:
            out.append(replace(island, nodes=rest, gpus=sum(count[n] for n in rest),
                               inner_bandwidth=island.inner_bandwidth if len(rest) > 1 else 0.0))
        for k, n in enumerate(alone):
            out.append(replace(island, id=f"{island.id}-u{k}", nodes=[n], gpus=count[n], inner_bandwidth=0.0,
                               outer_bandwidth=max(island.outer_bandwidth, island.inner_bandwidth)))
    return out


def unreachable_advice(address: str, why: str) -> str:
    """What a node whose advertised address the coordinator cannot dial is told at join."""
    where = f"its advertised address {address}" if address else "no address (it listens nowhere)"
    if not address:
        return ("this node accepts no connections (--no-listen): it opens the streams to its neighbours itself, "
                "and a node that accepts connections relays between it and others like it")
    return (f"the coordinator could not dial this node back at {where} ({why}); it runs as a node that accepts no "
            f"connections: it opens the streams to its neighbours itself. If other machines should reach it, set "
            f"--advertise to an address they can dial and open that port in the firewall; to skip this check, "
            f"start it with --no-listen")
