"""The pipeline's norm exchange through the coordinator's rendezvous store, for pipelines with a node that
accepts no connections.

A gloo group connects every pair of its members directly, one of each pair dialing the other, so a node behind
NAT or a firewall cannot be in one with nodes it cannot reach. Every node dials the coordinator's store, though
(`Plan.rendezvous`), so the pipeline's one scalar per stage and step (`atoll.node.norm_exchange`) can meet
there instead: each member sets its value under the round's key, waits for the others' and sums them in rank
order. One store round trip per step, never tensors.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from atoll.node.norm_exchange import NormExchange, NormExchangeError


class StoreNormExchange(NormExchange):
    """`all_sum` over `size` members meeting at `store` under `prefix`; member `rank` is this one. Every member
    calls it once per round, in the same order, so round numbers agree."""

    def __init__(self, store: dist.Store, prefix: str, *, rank: int, size: int):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a group of {size}")
        self.store, self.prefix, self.rank, self.size = store, prefix, rank, size
        self._round = 0

    def _key(self, round_: int, rank: int) -> str:
        return f"{self.prefix}{round_}/{rank}"

    def all_sum(self, value: float, timeout: timedelta) -> float:
        r = self._round
        self._round += 1
        # a member in round r has read round r - 1, so nobody still needs this member's key of round r - 2
        if r >= 2:
            self.store.delete_key(self._key(r - 2, self.rank))
        self.store.set(self._key(r, self.rank), repr(float(value)))
        keys = [self._key(r, i) for i in range(self.size)]
        try:
            self.store.wait(keys, timeout)
        except RuntimeError as e:  # the store's own timeout, or the store went away
            missing = [i for i, k in enumerate(keys) if not self.store.check([k])]
            raise NormExchangeError(f"norm exchange round {r} through the rendezvous store timed out after "
                                    f"{timeout}: member(s) {missing} did not report their gradient norm ({e})") from e
        # summed in rank order, so every member adds the same floats in the same order
        return sum(float(self.store.get(k).decode()) for k in keys)
