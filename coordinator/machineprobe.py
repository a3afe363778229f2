"""What one GPU's flow reaches while every GPU of its machine sends at once: machine probes.

The planner reads a link figure inside a region *per GPU flow, with every GPU of its node sending at once*
(`atoll.coordinator.planner.cluster`): a stage's replicas each send their own stream, and an all-reduce moves
one per GPU. A probe between two nodes measures one flow alone. On a machine whose GPUs (one `atoll node`
each) share one network card, the flows of its nodes divide that card's rate; a lone probe then overstates
every link leaving the machine by up to its node count. On a machine with a card per GPU it does not.

Which one a machine is cannot be told without sending at once, so the coordinator does: for each machine
(the `hostname` nodes join with, `atoll node --machine` where containers hide it) holding two or more alive
nodes while another machine holds some, one *round* has every node of the machine probe a node of one other
machine at the same moment (`ProbeTarget.start_unix`, on the coordinator's clock, which each heartbeat reply
carries so nodes can correct theirs). The median of the round's flows is the machine's per-flow figure; the
planner's links between two machines are then at most the smaller of their two figures (`per_flow_links`).
Links within a machine keep their lone probe. A round taken again after `reprobe_after`, like links. The
figures live in the coordinator's store (`machine_flows`), so a restarted coordinator plans from them at once
instead of measuring every machine again first.

A round starts `lead` seconds after it is formed, so each node can hear of it on a heartbeat first; a node whose
heartbeat comes too late sends nothing, and the round counts the flows that did run (`LinkMeasurement.flows`).
A round whose reports do not all come within `timeout` ends with those that did; one with none leaves the
machine without a figure until it is tried again (the planner then reads the lone probes, as before).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from atoll.types import LinkMeasurement, NodeProfile

MIN_LEAD_S = 2.0
"""The least time between forming a round and its start (the heartbeats that announce it come within it)."""
LATE_S = 0.25
"""A node told of a round less than this before its start sends nothing: it could not start with the others."""


def machine_of(node_id: str, profile: NodeProfile) -> str:
    """The machine a node runs on: the hostname it joined with (`atoll node --machine` sets it), else itself."""
    return profile.hostname or node_id


@dataclass
class _Round:
    machine: str
    start: float
    receivers: dict[str, str]
    """Sender node -> the node of the other machine it probes."""
    told: set[str] = field(default_factory=set)
    flows: dict[str, float] = field(default_factory=dict)
    """Sender -> bytes/s it reported (0: its probe failed)."""


@dataclass(frozen=True)
class RoundTarget:
    """A sender's part of a round: probe `receiver` at `start_unix` (the coordinator's clock), one of `flows`."""

    receiver: str
    start_unix: float
    flows: int


class MachineProbes:
    """The rounds in flight and each machine's per-flow figure (bytes/s, with when it was taken). Not
    thread-safe: the coordinator calls it under its lock."""

    def __init__(self, *, reprobe_after_s: float, timeout_s: float,
                 figures: Mapping[str, tuple[float | None, float]] | None = None,
                 on_figure: Callable[[str, float | None, float], None] | None = None):
        self.reprobe_after_s, self.timeout_s = reprobe_after_s, timeout_s
        self.figures: dict[str, tuple[float | None, float]] = dict(figures or {})
        """Machine -> (per-flow bytes/s, or None where no flow of its round got through; when taken): `figures`
        to start from (those a restarted coordinator's store kept), each due again as any after `reprobe_after_s`."""
        self._on_figure = on_figure
        """Called with each round's outcome (machine, figure, when): the coordinator keeps it in its store."""
        self.rounds: dict[str, _Round] = {}

    def _due(self, machine: str, now: float, stale_before: float) -> bool:
        got = self.figures.get(machine)
        return got is None or got[1] < stale_before or now - got[1] > self.reprobe_after_s

    def needs(self, by_machine: Mapping[str, list[str]], now: float, stale_before: float = float("-inf")) -> set[str]:
        """The machines a round should measure now: two or more alive nodes, another machine to probe, and no
        current figure (a round in flight counts as missing)."""
        if len(by_machine) < 2:
            return set()
        return {m for m, nodes in by_machine.items() if len(nodes) >= 2 and self._due(m, now, stale_before)}

    def missing(self, by_machine: Mapping[str, list[str]], accepts: Callable[[str], bool], now: float,
                stale_before: float = float("-inf")) -> set[str]:
        """The nodes of the machines still to be measured (`needs`) whose round can be formed (another machine
        has a node that accepts connections): the coordinator plans once they are measured. O(nodes)."""
        due = self.needs(by_machine, now, stale_before)
        if not due:
            return set()
        receiving = [m for m, nodes in by_machine.items() if any(accepts(n) for n in nodes)]
        out: set[str] = set()
        for m in due:
            if len(receiving) > 1 or (receiving and receiving[0] != m):
                out.update(by_machine[m])
        return out

    def target(self, node_id: str, machine: str, by_machine: Mapping[str, list[str]], accepts: Callable[[str], bool],
               now: float, lead_s: float, stale_before: float = float("-inf"),
               quiet: Callable[[list[str]], bool] = lambda nodes: True,
               after: Callable[[str], Iterable[str]] | None = None) -> RoundTarget | None:
        """`node_id`'s part of its machine's round, forming the round when it is due and none is in flight;
        None when there is nothing for it to send (no round, told already, or too late to start with the
        others). `accepts`: whether a node accepts connections (a round's receivers are drawn from those);
        `quiet(nodes)`: whether the machine's nodes probe nothing else now (their lone probes would share the
        card with the round's flows), asked before forming one; `after(machine)`: the other machines in the
        order to look for receivers in (default: `by_machine`'s), each machine starting after itself so that
        rounds formed at once spread over the machines rather than all meet at the first. O(1) for most calls
        (every heartbeat makes one); forming a round costs O(the nodes looked at)."""
        rnd = self.rounds.get(machine)
        if rnd is None:
            if (len(by_machine) < 2 or len(by_machine.get(machine, ())) < 2
                    or not self._due(machine, now, stale_before) or not quiet(by_machine[machine])):
                return None
            others = after(machine) if after is not None else (m for m in by_machine if m != machine)
            rnd = self._form(machine, by_machine, others, accepts, now + max(lead_s, MIN_LEAD_S))
            if rnd is None:
                return None
            self.rounds[machine] = rnd
        receiver = rnd.receivers.get(node_id)
        if receiver is None or node_id in rnd.told or now > rnd.start - LATE_S:
            return None
        rnd.told.add(node_id)
        return RoundTarget(receiver=receiver, start_unix=rnd.start, flows=len(rnd.receivers))

    @staticmethod
    def _form(machine: str, by_machine: Mapping[str, list[str]], others: Iterable[str], accepts: Callable[[str], bool],
              start: float) -> _Round | None:
        senders = sorted(by_machine[machine])
        # another machine with a receiver for every sender where one has as many nodes accepting connections
        # (the first found), else the one with the most
        best: list[str] = []
        for m in others:
            if m == machine:
                continue
            got = sorted(n for n in by_machine.get(m, ()) if accepts(n))
            if len(got) > len(best):
                best = got
            if len(best) >= len(senders):
                break
        if not best:
            return None
        return _Round(machine=machine, start=start,
                      receivers={s: best[i % len(best)] for i, s in enumerate(senders)})

    def record(self, link: LinkMeasurement, machine: str, now: float) -> str | None:
        """A flow of `machine`'s round reported; the round's outcome ("machine m: ...") once it is complete."""
        rnd = self.rounds.get(machine)
        if rnd is None or link.src not in rnd.told or rnd.receivers.get(link.src) != link.dst:
            return None
        rnd.flows[link.src] = link.bandwidth_bytes_per_s
        if rnd.told <= rnd.flows.keys() and now >= rnd.start:
            return self._finish(rnd, now)
        return None

    def expire(self, now: float) -> list[str]:
        """End the rounds past their start whose every flow reported, and those whose reports are overdue (with
        the flows that came); their outcomes."""
        done = []
        for rnd in list(self.rounds.values()):
            # (the flows share the machine's card: each takes up to their number of lone probes' time)
            overdue = now > rnd.start + self.timeout_s * max(1, len(rnd.told))
            if now >= rnd.start and (rnd.told <= rnd.flows.keys() or overdue):
                done.append(self._finish(rnd, now))
        return done

    def _finish(self, rnd: _Round, now: float) -> str:
        del self.rounds[rnd.machine]
        got = sorted(bw for bw in rnd.flows.values() if bw > 0)
        figure = statistics.median(got) if got else None
        self.figures[rnd.machine] = (figure, now)
        if self._on_figure is not None:
            self._on_figure(rnd.machine, figure, now)
        if not rnd.told:
            return (f"machine {rnd.machine}: none of its {len(rnd.receivers)} nodes heard of its round in time; its "
                    "links keep their lone probes")
        if figure is None:
            return (f"machine {rnd.machine}: none of its {len(rnd.told)} flows sent at once got through; its "
                    "links keep their lone probes")
        return (f"machine {rnd.machine}: {len(got)} flows sent at once reach {figure * 8 / 1e6:.1f} Mbit/s each "
                f"(median; {len(rnd.told)} of its {len(rnd.receivers)} nodes took part)")

    def per_flow(self) -> dict[str, float]:
        """Machine -> per-flow bytes/s, for the machines whose round measured one."""
        return {m: bw for m, (bw, _) in self.figures.items() if bw is not None}


def per_flow_links(links: Iterable[LinkMeasurement], machine_of: Mapping[str, str],
                   per_flow: Mapping[str, float]) -> list[LinkMeasurement]:
    """The links as the planner reads them: one between two machines at most the smaller of the two machines'
    per-flow figures (what a flow gets while every GPU of both machines sends), links within a machine and
    those of machines without a figure as probed."""
    out = []
    for x in links:
        a, b = machine_of.get(x.src, x.src), machine_of.get(x.dst, x.dst)
        cap = min(per_flow.get(a, float("inf")), per_flow.get(b, float("inf"))) if a != b else float("inf")
        out.append(replace(x, bandwidth_bytes_per_s=cap) if 0 < cap < x.bandwidth_bytes_per_s else x)
    return out
