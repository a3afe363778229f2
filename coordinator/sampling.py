"""Which alive members still lack their sample of links, kept up to date instead of worked out afresh.

The coordinator's loop asks every round (four times a second) which members are unprobed while membership
differs from the plan. Checking each member's sample (`sample_deficit`) is O(its links), so asking it of
10,000 members each round cost a good part of a core while they joined and probed. `SampleProgress` remembers
each member's answer and checks again only those whose answer may have changed:

- a member whose links were measured since (a probe report names it at either end);
- a member one of whose measured peers left the alive set (it counted that peer);
- a complete member once its oldest counted measurement goes stale (`reprobe_after`);
- every member when what the rule depends on changes: the device classes and their sizes (as far as the
  rule reads them), the number of peers (when few), the members that accept no connections, or a reprobe
  request. An incomplete member stays incomplete until one of these happens, so it is not checked in between.

The answers are those of checking every member each round (tests compare the two).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set

from atoll.coordinator.linkmatrix import ProbeOptions, sample_deficit

INCOMPLETE = -1.0


class SampleProgress:
    """Per member: complete until when (state-clock seconds), or INCOMPLETE. `measured`, `forget` and `due` run
    under the caller's lock; `check` runs outside it, on the one thread that calls `due`."""

    def __init__(self, options: ProbeOptions):
        self.options = options
        self._until: dict[str, float] = {}
        self._dirty: set[str] = set()
        self._signature: tuple | None = None

    def measured(self, nodes: Iterable[str]) -> None:
        """Links of `nodes` were measured (or their measurements changed): check them again."""
        self._dirty.update(nodes)

    def forget(self, nodes: Iterable[str]) -> None:
        """Check `nodes` again (a peer they counted left, say)."""
        self._dirty.update(nodes)

    def complete(self, node: str, now: float) -> bool:
        """Whether `node`'s sample was complete at the last `check` and nothing since may have changed that (a
        heartbeat of a complete node then needs no look at its links)."""
        until = self._until.get(node)
        return until is not None and until != INCOMPLETE and now <= until and node not in self._dirty

    def _rule_signature(self, class_of: Mapping[str, str], class_sizes: Mapping[str, int],
                        unreachable: Set[str], stale_before: float) -> tuple:
        o = self.options
        # `sample_deficit` reads a class's size only up to `per_class` (plus the node's own class), and the
        # number of peers only up to the sample's whole size or the all-pairs bound
        cap = max(o.per_class * len(class_sizes) + o.random_extra, o.all_pairs_up_to) + 1
        sizes = tuple(sorted((c, min(s, o.per_class + 1)) for c, s in class_sizes.items()))
        return sizes, min(len(class_of), cap), frozenset(unreachable), stale_before

    def due(self, alive: Iterable[str], class_of: Mapping[str, str], class_sizes: Mapping[str, int],
            unreachable: Set[str], now: float, stale_before: float) -> tuple[list[str], set[str]]:
        """(members to check now, members known to be incomplete): O(members), a dict lookup each. Call it under
        the lock that guards `measured`/`forget`; `check` the first list after (it needs no lock).

        class_of / class_sizes: device class of each alive member and members per class; unreachable: alive
        members that accept no connections.
        """
        signature = self._rule_signature(class_of, class_sizes, unreachable, stale_before)
        if signature != self._signature:
            self._signature = signature
            self._until.clear()
        dirty, self._dirty = self._dirty, set()
        for n in dirty:
            self._until.pop(n, None)
        todo: list[str] = []
        incomplete: set[str] = set()
        for n in alive:
            until = self._until.get(n)
            if until is None or (until != INCOMPLETE and now > until):
                todo.append(n)
            elif until == INCOMPLETE:
                incomplete.add(n)
        return todo, incomplete

    def check(self, todo: Iterable[str], class_of: Mapping[str, str], class_sizes: Mapping[str, int],
              measured: Mapping[str, Mapping[str, float]], unreachable: Set[str], now: float,
              stale_before: float) -> set[str]:
        """Check the members `due` named against their measurements (`measured`: node -> peer -> when their link
        was last measured) and remember the answers; returns the incomplete ones."""
        reprobe = self.options.reprobe_after.total_seconds()
        horizon = max(now - reprobe, stale_before)
        out: set[str] = set()
        for n in todo:
            fresh = {p: t for p, t in measured.get(n, {}).items() if t >= horizon}
            counted = fresh.keys() | (unreachable - {n}) if unreachable else fresh.keys()
            if sample_deficit(n, class_of, class_sizes, counted, self.options)[1] > 0:
                self._until[n] = INCOMPLETE
                out.add(n)
            else:  # complete until its oldest fresh measurement goes stale
                self._until[n] = min(fresh.values(), default=float("inf")) + reprobe
        return out
