"""The island parallelizer, the planner's narrow API: how well does a model slice run on an island?

`cost(slice, island) -> IslandCost | None` gives the best time per micro-batch and memory per device of
layers [start, end) on `slice.dp` devices of one island, choosing how the devices split into data-parallel
replicas of `tp` tensor-parallel devices each (dp x tp = the devices; tp within one node), the ZeRO stage
and recomputation (the devices and the pipeline's micro-batch come with the query, since a pipeline's
stages share the micro-batch); None when no choice fits in memory. It knows nothing of other islands, so
any other implementation can replace it.

Lanes (`SliceQuery.lanes` = L, `atoll.plan`): the stage runs L lanes of `dp` devices each, lane i % L taking
micro-batch i; the times are one lane's per micro-batch, the devices of every lane shard the optimizer states
(ZeRO-1) and average the gradients, and ZeRO-2/3 (a collective per micro-batch, which would hold the lanes in
step) are not used.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Protocol

from atoll.coordinator.planner.cluster import Island
from atoll.coordinator.planner.tied import holds_tied_weight, tied_copy_params
from atoll.coordinator.planner.costmodel import CostModel, LayerTable


@dataclass(frozen=True, kw_only=True)
class SliceQuery:
    """A model slice on an island, in the context of its pipeline."""

    start: int
    """First layer (0 is the embedding)."""
    end: int
    """Last layer, exclusive."""
    micro_batch: int
    """Sequences per device when every device is its own replica (ignored when `batch` is given)."""
    dp: int
    """Devices the slice runs on (all on this island): its data-parallel replicas, or dp / tp replicas of tp
    devices each when the parallelizer picks tensor parallelism."""
    in_flight: int
    """Micro-batches whose activations the stage holds at once (1F1B: min(p - i, m) at stage i)."""
    batch: int = 0
    """Sequences of the pipeline's micro-batch, shared by the stage's replicas as evenly as possible (shares
    differ by at most one); 0: micro_batch x dp."""
    lanes: int = 1
    """Lanes of `dp` devices each the stage runs on (`in_flight` is then a lane's)."""

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"slice [{self.start}, {self.end}) is empty or negative")
        if self.micro_batch < 1 or self.dp < 1 or self.in_flight < 1 or self.batch < 0 or self.lanes < 1:
            raise ValueError("micro_batch, dp, in_flight and lanes must be >= 1, batch >= 0")

    @property
    def rows(self) -> int:
        """Sequences of the pipeline micro-batch the stage's devices share."""
        return self.batch or self.micro_batch * self.dp


@dataclass(frozen=True, kw_only=True)
class IslandCost:
    """The best way found to run a slice on an island."""

    forward_s: float
    """Forward time of one micro-batch on one replica (with ZeRO-3 weight gathers and tp collectives); with lanes,
    on a replica of its lane."""
    backward_s: float
    """Backward time of one micro-batch (with recomputation, ZeRO-3 gathers and tp collectives)."""
    memory_bytes: float
    """Peak memory per device."""
    dp: int
    """Data-parallel replicas (of every lane)."""
    zero: int
    recompute: bool
    micro_batch: int
    """Sequences of the busiest replica per micro-batch (shares differ by at most one)."""
    tp: int = 1
    """Tensor-parallel devices per replica (one node's GPUs at most)."""
    recompute_layers: tuple[int, ...] = ()
    """The blocks recomputed in backward: the shortest prefix of the slice's blocks that makes it fit
    (`recompute` is set when that is all of them)."""
    lanes: int = 1
    """Lanes the replicas form (`SliceQuery.lanes`)."""

    @property
    def time_s(self) -> float:
        """A lane's forward and backward of one micro-batch."""
        return self.forward_s + self.backward_s

    @property
    def pace_s(self) -> float:
        """The stage's time per micro-batch of the pipeline: its lanes work on that many at once."""
        return self.time_s / self.lanes

    @property
    def gpus(self) -> int:
        return self.dp * self.tp


class IslandParallelizer(Protocol):
    def cost(self, query: SliceQuery, island: Island) -> IslandCost | None: ...


class DefaultParallelizer:
    """Data parallelism within the island, tensor parallelism within a node where it pays, with the cheapest
    ZeRO stage and recomputation that fit."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cm = cost_model
        o = cost_model.options
        self.zeros = sorted(set(o.zero_stages))
        self.recompute = o.allow_recompute
        c = cost_model.model.config
        # Megatron's layout (atoll.node.tp) splits heads, kv heads and the MLP's hidden width over the ranks
        self.tps = [t for t in range(1, o.max_tp + 1)
                    if c.n_heads % t == 0 and c.kv_heads % t == 0 and c.ffn % t == 0]
        self.max_rows = max(o.micro_batches)
        self.sizes = set(o.micro_batches)
        self._time_cache: dict[tuple, tuple[list[float], float]] = {}
        self._mem_cache: dict[tuple, tuple[list[float], tuple[int, ...], float]] = {}
        self._split_cache: dict[tuple, list[tuple[int, int, int]]] = {}
        self._floor_cache: dict[tuple, float] = {}
        self._rate_cache: dict[str, float] = {}
        self._entry_cache: dict[tuple, list[tuple]] = {}
        self._saving_cache: dict[int, list[int]] = {}

    def splits(self, island: Island, gpus: int, batch: int) -> list[tuple[int, int, int]]:
        """(tp, dp, rows of the busiest replica) for every way to run `gpus` devices of the island on a
        pipeline micro-batch of `batch` sequences: tp within a node and dividing the model's heads; every
        replica takes at least one sequence and at most tp x the largest allowed micro-batch (exactly an
        allowed one, and the same on every replica, under `equal_widths`, where tp is 1: a stage's dp is then its
        width, the same on every stage)."""
        key = (island.gpus_per_node, gpus, batch)
        got = self._split_cache.get(key)
        if got is None:
            got = []
            for tp in self.tps:
                if tp > island.gpus_per_node or gpus % tp:
                    continue
                dp = gpus // tp
                rows = -(-batch // dp)
                if batch < dp or rows > self.max_rows * tp:
                    continue
                # equal widths: every stage's dp is the pipeline's width, so no stage may trade replicas for tp
                if self.cm.options.equal_widths and (tp > 1 or batch % dp or rows not in self.sizes):
                    continue
                got.append((tp, dp, rows))
            self._split_cache[key] = got
        return got

    def best_rate(self, island: Island) -> float:
        """Sequences per second one device of the island computes through the whole model (forward and
        backward) at its most efficient shape: the best over every tensor-parallel degree it may use (within a
        node) and every per-replica micro-batch that degree may take (1 to tp x the largest allowed), the tp
        collectives counted as the cost model counts them. No stage of any plan computes faster per device:
        a bound for the search and the benchmark's ceiling."""
        got = self._rate_cache.get(island.id)
        if got is None:
            got = 0.0
            for tp in (t for t in self.tps if t <= island.gpus_per_node):
                for b in range(1, self.max_rows * tp + 1):
                    t = self.cm.table(island, b, tp)
                    got = max(got, b / max(1e-12, t.pf[-1] + t.pb[-1]) / tp)
            self._rate_cache[island.id] = got
        return got

    def compute_floor(self, island: Island, gpus: int, batch: int) -> float:
        """The least time a micro-batch can take through the whole model on a stage of `gpus` devices of the
        island (any split; inf when none is allowed): a ranking key and lower bound for the composer."""
        key = (island.id, gpus, batch)
        got = self._floor_cache.get(key)
        if got is None:
            got = float("inf")
            for tp, _, rows in self.splits(island, gpus, batch):
                t = self.cm.table(island, rows, tp)
                got = min(got, t.pf[-1] + t.pb[-1])
            self._floor_cache[key] = got
        return got

    def path_floor(self, island: Island, gpus: int, batch: int) -> float:
        """The least time one micro-batch's own path through the whole model can take on a stage of `gpus` devices
        of the island: its forwards and input gradients. A stage that defers its weight-gradient products runs
        them off that path (zero-bubble), so with deferral allowed each layer counts the shorter of its backward
        and its split backward without the products (`compute_floor` otherwise)."""
        if not self.cm.options.zero_bubble:
            return self.compute_floor(island, gpus, batch)
        key = (island.id, gpus, batch, "path")
        got = self._floor_cache.get(key)
        if got is None:
            got = float("inf")
            for tp, _, rows in self.splits(island, gpus, batch):
                t = self.cm.table(island, rows, tp)
                input_grads = sum(min(b, b + t.split(n, n + 1) - t.weight(n, n + 1)) for n, b in enumerate(t.bwd))
                got = min(got, t.pf[-1] + input_grads)
            self._floor_cache[key] = got
        return got

    def _blocks(self, a: int, b: int) -> tuple[int, int]:
        """The blocks [first, last) of slice [a, b), the only layers the runtime recomputes (empty: first = last)."""
        # (comparisons, not max/min: called a million times in a large search)
        first = a if a > 1 else 1
        last = self.cm.num_layers - 1
        if b < last:
            last = b
        return first, (last if last > first else first)

    def _savings(self, t: LayerTable) -> list[int]:
        """Prefix sums of what recomputing each layer saves per micro-batch in flight (0 off the blocks)."""
        got = self._saving_cache.get(id(t))  # tables live as long as the cost model: ids stay theirs
        if got is None:
            got = self._saving_cache[id(t)] = [x - y for x, y in zip(t.pact, t.pact_rc)]
        return got

    def _recompute_upto(self, t: LayerTable, a: int, e: int, k: int, over: float) -> int | None:
        """The end j of the shortest prefix [first block, j) of the slice's blocks whose recomputation takes
        `over` bytes off its memory (k micro-batches in flight; the working set of one recomputed block comes
        back in backward); None when recomputing all of them is not enough."""
        first, last = self._blocks(a, e)
        if last <= first:
            return None
        d = self._savings(t)
        j = bisect_left(d, d[first] + (over + t.max_layer_act) / k, first + 1, last + 1)
        return j if j <= last else None

    def _eval(self, t: LayerTable, island: Island, a: int, b: int, dp: int, tp: int, k: int, zero: int,
              rows: int, upto: int) -> tuple[float, float, float]:
        """(forward, backward, memory per device) of [a, b) recomputing its blocks up to `upto`."""
        cm = self.cm
        f = t.forward(a, b)
        first, _ = self._blocks(a, b)
        bw = t.backward(a, b) + (t.pf[upto] - t.pf[first])  # a recomputed block runs forward again
        params = t.params_of(a, b)
        per_node = max(1, island.gpus_per_node // tp)
        if zero >= 3 and dp > 1:
            g = cm.allreduce_seconds(params * cm.weight_bytes_per_param, dp, island, per_node=per_node) / 2
            f += g
            bw += g
        elif zero == 2 and dp > 1:  # each micro-batch's gradient is reduce-scattered: half an all-reduce
            bw += cm.allreduce_seconds(params * cm.grad_bytes_per_param, dp, island, per_node=per_node) / 2
        d = self._savings(t)
        act = k * (t.pact[b] - t.pact[a] - (d[upto] - d[first]) + cm.stage_output_bytes(b, rows))
        if upto > first:
            act += t.max_layer_act
        return f, bw, cm.state_bytes(params, zero, dp) + act

    def cost(self, query: SliceQuery, island: Island) -> IslandCost | None:
        if query.end > self.cm.num_layers:
            raise ValueError(f"slice [{query.start}, {query.end}) is outside the model's {self.cm.num_layers} layers")
        cap = self.cm.memory_capacity(island)
        a, e, k = query.start, query.end, query.in_flight
        best: IslandCost | None = None
        best_t = 0.0
        copy = tied_copy_params(self.cm.model, a, e)  # a tied head's copy of the embedding (node/tied.py)
        lanes = query.lanes
        for tp, dp, rows, zero, tpre, tc, states, acts, mc, _ in self._entries(island, query.dp, query.rows, False,
                                                                               lanes):
            if (zero > 0 or tp > 1) and holds_tied_weight(self.cm.model, a, e):
                continue  # the runtime trains a stage holding a copy of a tied weight with plain AdamW, unsharded
            # time first (prefix sums; ZeRO 0-1 cost the same): a config that cannot beat the best needs no more,
            # and recomputation only adds time
            if best is not None and tpre[e] - tpre[a] + tc >= best_t * (1 - 1e-12):
                continue
            t = self.cm.table(island, rows, tp)
            first, last = self._blocks(a, e)
            upto: int | None = first
            over = states[e] - states[a] + k * (acts[e] - acts[a] + self.cm.stage_output_bytes(e, rows)) + mc - cap \
                + copy * self.cm.state_linear(zero, dp * lanes)[0]
            if over > 0:  # recompute the fewest blocks that make it fit
                upto = self._recompute_upto(t, a, e, k, over) if self.recompute else None
                if upto is None:
                    continue
            f, b, mem = self._eval(t, island, a, e, dp * lanes, tp, k, zero, rows, upto)
            mem += copy * self.cm.state_linear(zero, dp * lanes)[0]
            if best is not None and f + b >= best_t * (1 - 1e-12):
                continue
            best = IslandCost(forward_s=f, backward_s=b, memory_bytes=mem, dp=dp * lanes, zero=zero,
                              recompute=upto == last > first, micro_batch=rows, tp=tp,
                              recompute_layers=tuple(range(first, upto)), lanes=lanes)
            best_t = best.time_s
        return best

    def evaluate(self, query: SliceQuery, island: Island, *, zero: int, recompute_blocks: int = 0,
                 tp: int = 1) -> IslandCost:
        """The cost of one given configuration, fitting or not (a plan fixed by hand, a benchmark's prediction):
        `query.dp` devices as dp / tp replicas, a ZeRO stage and the first `recompute_blocks` blocks of the
        slice recomputed."""
        if query.dp % tp:
            raise ValueError(f"tp = {tp} does not divide the slice's {query.dp} devices")
        dp = query.dp // tp
        rows = -(-query.rows // dp)
        first, last = self._blocks(query.start, query.end)
        if not 0 <= recompute_blocks <= last - first:
            raise ValueError(f"slice [{query.start}, {query.end}) has {last - first} blocks to recompute, not "
                             f"{recompute_blocks}")
        upto = first + recompute_blocks
        f, b, mem = self._eval(self.cm.table(island, rows, tp), island, query.start, query.end, dp, tp,
                               query.in_flight, zero if dp > 1 else 0, rows, upto)
        mem += tied_copy_params(self.cm.model, query.start, query.end) * self.cm.state_linear(zero if dp > 1 else 0, dp)[0]
        return IslandCost(forward_s=f, backward_s=b, memory_bytes=mem, dp=dp, zero=zero if dp > 1 else 0,
                          recompute=upto == last > first, micro_batch=rows, tp=tp,
                          recompute_layers=tuple(range(first, upto)))

    def _entries(self, island: Island, gpus: int, batch: int, reach: bool, lanes: int = 1) -> list[tuple]:
        """Every configuration of a stage of `gpus` devices (per lane) on a micro-batch of `batch` sequences:
        (tp, dp, rows, zero, time prefix, time constant, states prefix, activations prefix (per micro-batch in
        flight, nothing recomputed), memory constant, first of its split), dp a lane's replicas. For `reach` only
        the configurations that can matter: per split, the highest ZeRO stage of 0-1 (the least memory for their
        common time), ZeRO-2 and ZeRO-3 (each slower). Recomputation is chosen per slice on top of any of them."""
        key = (island.id, island.gpus_per_node, gpus, batch, reach, lanes)
        got = self._entry_cache.get(key)
        if got is None:
            got = []
            for tp, dp, rows in self.splits(island, gpus, batch):
                # ZeRO-1 before 0: the same time for less memory and a shorter optimizer step, so it wins ties.
                # Under tensor parallelism each tp rank shards its own shards over its dp peers (`atoll.node.zero`);
                # lanes shard over every lane's replicas, and take no ZeRO-2/3 (see the module docstring)
                group = dp * lanes
                zeros = [0] if group == 1 else sorted((z for z in self.zeros if lanes == 1 or z <= 1),
                                                      key=lambda z: (z > 1, -z))
                if reach:
                    low = [z for z in zeros if z <= 1]
                    zeros = ([max(low)] if low else []) + [z for z in zeros if z >= 2]
                for n, zero in enumerate(zeros):
                    got.append((tp, dp, rows, zero, *self._time_prefix(island, rows, group, tp, zero),
                                *self._memory_prefix(island, rows, group, tp, zero), n == 0))
            self._entry_cache[key] = got
        return got

    def reach(self, island: Island, micro_batch: int, dp: int, in_flight: int, end: int,
              limit_s: float, batch: int = 0, lanes: int = 1) -> int:
        """Smallest start a such that [a, end) runs within `limit_s` per micro-batch and fits (end if none),
        on `dp` devices sharing a pipeline micro-batch of `batch` sequences (0: micro_batch x dp), in `lanes`
        lanes of them (`limit_s` then a lane's time).

        Equivalent to the smallest a with `cost(...)` not None and `time_s <= limit_s`. Time and memory are
        linear in prefix sums over the layers, so each configuration is one binary search; where memory binds
        before time, one more over the starts that fit by recomputing a prefix of their blocks (the longer
        the slice, the more it recomputes and the slower it is, so those starts are a range too).
        """
        cap = self.cm.memory_capacity(island)
        best = end
        skip = -1  # a split whose quickest configuration reached its time bound: the others cannot do better
        k = in_flight
        # a tied model cut into stages (node/tied.py): the head's stage holds a copy of the tied weight (counted
        # for every start, a little cautious for a = 0), and stages holding either copy run without ZeRO or tp
        copy = tied_copy_params(self.cm.model, 1, end)
        tied = holds_tied_weight(self.cm.model, 0, end) or copy > 0
        for n, (tp, lane_dp, rows, zero, tpre, tc, states, acts, mc, first) in enumerate(
                self._entries(island, dp, batch or micro_batch * dp, True, lanes)):
            if first:
                skip = -1
            elif skip >= 0:
                continue
            if tied and (zero > 0 or tp > 1) and copy > 0:
                continue
            a_time = bisect_left(tpre, tpre[end] + tc - limit_s, 0, end)
            if tied and (zero > 0 or tp > 1):  # [0, end) would hold the embedding's copy
                a_time = max(a_time, 1)
            if a_time >= best:
                continue
            # memory of [a, end) is states + k x activations, both prefix sums: the smallest a that fits
            out = k * self.cm.stage_output_bytes(end, rows) + copy * self.cm.state_linear(zero, lane_dp * lanes)[0]
            target = states[end] + k * acts[end] + out + mc - cap
            lo, hi = 0, end
            while lo < hi:
                mid = (lo + hi) // 2
                if states[mid] + k * acts[mid] < target:
                    lo = mid + 1
                else:
                    hi = mid
            a_mem = lo
            if a_mem > a_time and self.recompute:  # starts in [a_time, a_mem) fit only by recomputing
                a_mem = self._reach_recomputing(self.cm.table(island, rows, tp), tpre, tc, states, acts,
                                                mc + out - cap, k, end, limit_s, a_time, a_mem)
            best = min(best, max(a_time, a_mem))
            if first and a_mem <= a_time:  # recomputation or ZeRO-2/3 would only cost time
                skip = n
        if copy > 0 and best > 0:
            # the whole tied model on one stage holds no copy and may shard its states (ZeRO), which the bounds above
            # (for a cut model's last stage) refuse it: where memory binds it may fit when no cut of it does
            whole = self.cost(SliceQuery(start=0, end=end, micro_batch=micro_batch, dp=dp, in_flight=k, batch=batch,
                                         lanes=lanes), island)
            if whole is not None and whole.time_s <= limit_s:
                return 0
        return best

    def _reach_recomputing(self, t: LayerTable, tpre: list[float], tc: float, states: list[float],
                           acts: tuple[int, ...], extra: float, k: int, end: int, limit_s: float, lo: int,
                           hi: int) -> int:
        """The smallest start in [lo, hi) whose slice fits within `limit_s` by recomputing a prefix of its blocks
        (hi when none does); `extra`: the memory constant less the capacity."""
        def ok(a: int) -> bool:
            over = states[end] - states[a] + k * (acts[end] - acts[a]) + extra
            upto = self._recompute_upto(t, a, end, k, over)
            if upto is None:
                return False
            return tpre[end] - tpre[a] + tc + t.pf[upto] - t.pf[a if a > 1 else 1] <= limit_s  # `_blocks`' first

        while lo < hi:
            mid = (lo + hi) // 2
            if ok(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _time_prefix(self, island: Island, b: int, dp: int, tp: int, zero: int) -> tuple[list[float], float]:
        """(prefix of forward + backward time, constant seconds) per micro-batch, nothing recomputed."""
        key = (island.id, island.gpus_per_node, b, dp, tp, zero)
        got = self._time_cache.get(key)
        if got is None:
            t = self.cm.table(island, b, tp)
            per_param, const = 0.0, 0.0
            if zero >= 2 and dp > 1:
                per_byte, lat = self.cm.allreduce_linear(dp, island, max(1, island.gpus_per_node // tp))
                if zero >= 3:  # a gather before forward and one before backward, each half an all-reduce
                    per_param, const = per_byte * self.cm.weight_bytes_per_param, lat
                else:  # the micro-batch's gradient reduce-scattered: half an all-reduce
                    per_param, const = per_byte * self.cm.grad_bytes_per_param / 2, lat / 2
            got = ([f + bw + per_param * p for f, bw, p in zip(t.pf, t.pb, t.pparams)], const)
            self._time_cache[key] = got
        return got

    def _memory_prefix(self, island: Island, b: int, dp: int, tp: int,
                       zero: int) -> tuple[list[float], tuple[int, ...], float]:
        """(states prefix, activations prefix per micro-batch in flight, constant bytes) per device, nothing
        recomputed."""
        key = (island.id, b, dp, tp, zero)
        got = self._mem_cache.get(key)
        if got is None:
            t = self.cm.table(island, b, tp)
            per_param, const = self.cm.state_linear(zero, dp)
            got = ([per_param * p for p in t.pparams], t.pact, const)
            self._mem_cache[key] = got
        return got
