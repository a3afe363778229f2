"""Prometheus gauges of one coordinator, in their own registry (several coordinators may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from atoll.coordinator.progress import throughput
from atoll.coordinator.state import CoordinatorState


class CoordinatorMetrics:
    """members, islands, plan epoch, step, tokens/s, last complete checkpoint and per-link bandwidth."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.members = Gauge("atoll_members", "Members of the job by state", ["state"], registry=r)
        self.islands = Gauge("atoll_islands", "Islands formed from the alive members", registry=r)
        self.plan_epoch = Gauge("atoll_plan_epoch", "Epoch of the current plan (0: none yet)", registry=r)
        self.step = Gauge("atoll_step", "Latest training step reported", registry=r)
        self.tokens_per_second = Gauge("atoll_tokens_per_second", "Training throughput over recent steps",
                                       registry=r)
        self.checkpoint_step = Gauge("atoll_last_checkpoint_step", "Latest complete checkpoint step", registry=r)
        self.link_bandwidth = Gauge("atoll_link_bandwidth_bytes_per_second", "Latest probe of each link",
                                    ["src", "dst"], registry=r)

    def update(self, state: CoordinatorState) -> None:
        counts = {"alive": 0, "gone": 0, "left": 0}
        for m in state.store.list_members():
            counts[m.state] = counts.get(m.state, 0) + 1
        for s, n in counts.items():
            self.members.labels(state=s).set(n)
        self.islands.set(len(state.store.get_islands()))
        self.plan_epoch.set(state.epoch)
        step, tps = throughput(state.store.recent_steps(256), state.epoch)
        self.step.set(step)
        self.tokens_per_second.set(tps)
        done = state.complete_checkpoint_steps()
        self.checkpoint_step.set(done[-1] if done else 0)
        self.link_bandwidth.clear()
        for x in state.store.list_links():
            self.link_bandwidth.labels(src=x.src, dst=x.dst).set(x.bandwidth_bytes_per_s)
