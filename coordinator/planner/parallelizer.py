"""The island parallelizer, the planner's narrow API: how well does a model slice run on an island?

`cost(slice, island) -> IslandCost | None` gives the best time per micro-batch and memory per device of
layers [start, end) on `slice.dp` devices of one island, choosing the ZeRO stage and recomputation (the
data-parallel degree and per-replica micro-batch come with the query, since a pipeline's stages share them);
None when no choice fits in memory. It knows nothing of other islands, so any other implementation (one
with tensor parallelism, say) can replace it.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Protocol

from atoll.coordinator.planner.cluster import Island
from atoll.coordinator.planner.costmodel import CostModel, LayerTable


@dataclass(frozen=True, kw_only=True)
class SliceQuery:
    """A model slice on an island, in the context of its pipeline."""

    start: int
    """First layer (0 is the embedding)."""
    end: int
    """Last layer, exclusive."""
    micro_batch: int
    """Sequences per replica per micro-batch."""
    dp: int
    """Data-parallel replicas of the slice (all on this island)."""
    in_flight: int
    """Micro-batches whose activations the stage holds at once (1F1B: min(p - i, m) at stage i)."""

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"slice [{self.start}, {self.end}) is empty or negative")
        if self.micro_batch < 1 or self.dp < 1 or self.in_flight < 1:
            raise ValueError("micro_batch, dp and in_flight must be >= 1")


@dataclass(frozen=True, kw_only=True)
class IslandCost:
    """The best way found to run a slice on an island."""

    forward_s: float
    """Forward time of one micro-batch on one replica (with ZeRO-3 weight gathers)."""
    backward_s: float
    """Backward time of one micro-batch (with recomputation and ZeRO-3 gathers when chosen)."""
    memory_bytes: float
    """Peak memory per device."""
    dp: int
    zero: int
    recompute: bool
    micro_batch: int

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s


class IslandParallelizer(Protocol):
    def cost(self, query: SliceQuery, island: Island) -> IslandCost | None: ...


class DefaultParallelizer:
    """Data parallelism within the island with the cheapest ZeRO stage and recomputation that fit."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cm = cost_model
        o = cost_model.options
        self.zeros = sorted(set(o.zero_stages))
        self.recompute = (False, True) if o.allow_recompute else (False,)
        self._time_cache: dict[tuple, tuple[list[float], float]] = {}
        self._mem_cache: dict[tuple, tuple[list[float], float]] = {}

    def _configs(self, dp: int) -> list[tuple[int, bool]]:
        zeros = [0] if dp == 1 else self.zeros
        return [(z, rc) for rc in self.recompute for z in zeros]

    def _eval(self, t: LayerTable, island: Island, a: int, b: int, dp: int, k: int, zero: int,
              rc: bool) -> tuple[float, float, float]:
        cm = self.cm
        f = t.forward(a, b)
        bw = t.backward(a, b) + (f if rc else 0.0)
        params = t.params_of(a, b)
        if zero >= 3 and dp > 1:
            g = cm.gather_seconds(params * cm.weight_bytes_per_param, dp, island)
            f += g
            bw += g
        if rc:
            act = k * (t.pact_rc[b] - t.pact_rc[a]) + t.max_layer_act
        else:
            act = k * (t.pact[b] - t.pact[a])
        return f, bw, cm.state_bytes(params, zero, dp) + act

    def cost(self, query: SliceQuery, island: Island) -> IslandCost | None:
        if query.end > self.cm.num_layers:
            raise ValueError(f"slice [{query.start}, {query.end}) is outside the model's {self.cm.num_layers} layers")
        t = self.cm.table(island, query.micro_batch)
        cap = self.cm.memory_capacity(island)
        best: IslandCost | None = None
        for zero, rc in self._configs(query.dp):
            f, b, mem = self._eval(t, island, query.start, query.end, query.dp, query.in_flight, zero, rc)
            if mem > cap:
                continue
            if best is None or f + b < best.time_s * (1 - 1e-12):
                best = IslandCost(forward_s=f, backward_s=b, memory_bytes=mem, dp=query.dp, zero=zero,
                                  recompute=rc, micro_batch=query.micro_batch)
        return best

    def reach(self, island: Island, micro_batch: int, dp: int, in_flight: int, end: int,
              limit_s: float) -> int:
        """Smallest start a such that [a, end) runs within `limit_s` per micro-batch and fits (end if none).

        Equivalent to the smallest a with `cost(...)` not None and `time_s <= limit_s`. Time and memory are
        linear in prefix sums over the layers, so each configuration is one binary search.
        """
        cap = self.cm.memory_capacity(island)
        best = end
        # ZeRO 0-2 cost the same time; the highest allowed one needs the least memory
        zeros = [0] if dp == 1 else self.zeros
        cheap = [z for z in zeros if z <= 2]
        zs = ([max(cheap)] if cheap else []) + ([3] if 3 in zeros and dp > 1 else [])
        for rc in self.recompute:
            for zero in zs:
                time_prefix, time_const = self._time_prefix(island, micro_batch, dp, zero, rc)
                mem_prefix, mem_const = self._memory_prefix(island, micro_batch, dp, zero, rc, in_flight)
                a_time = bisect_left(time_prefix, time_prefix[end] + time_const - limit_s, 0, end)
                a_mem = bisect_left(mem_prefix, mem_prefix[end] + mem_const - cap, 0, end)
                best = min(best, max(a_time, a_mem))
        return best

    def _time_prefix(self, island: Island, b: int, dp: int, zero: int, rc: bool) -> tuple[list[float], float]:
        key = (island.id, b, dp, zero, rc)
        got = self._time_cache.get(key)
        if got is None:
            t = self.cm.table(island, b)
            per_param, const = 0.0, 0.0
            if zero >= 3 and dp > 1:
                per_byte, lat = self.cm.allreduce_linear(dp, island)
                # a gather before forward and one before backward, each half an all-reduce
                per_param, const = per_byte * self.cm.weight_bytes_per_param, lat
            got = ([(2 if rc else 1) * f + bw + per_param * p for f, bw, p in zip(t.pf, t.pb, t.pparams)], const)
            self._time_cache[key] = got
        return got

    def _memory_prefix(self, island: Island, b: int, dp: int, zero: int, rc: bool,
                       k: int) -> tuple[list[float], float]:
        key = (island.id, b, dp, zero, rc, k)
        got = self._mem_cache.get(key)
        if got is None:
            t = self.cm.table(island, b)
            per_param, const = self.cm.state_linear(zero, dp)
            acts = t.pact_rc if rc else t.pact
            got = ([per_param * p + k * a for p, a in zip(t.pparams, acts)],
                   const + (t.max_layer_act if rc else 0.0))
            self._mem_cache[key] = got
        return got
