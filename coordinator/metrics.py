"""Prometheus gauges of one coordinator, in their own registry (several coordinators may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from atoll.coordinator.progress import throughput
from atoll.coordinator.state import CoordinatorState


LATEST_ROWS = 2000
"""Newest history rows searched for the latest loss and validation loss."""


class _UntilSet:
    """A gauge that is absent from the exposition until its first value (a plain Gauge reads 0.0 from the start,
    which a dashboard cannot tell from a real 0: no loss yet, no validation pass, no fp16 loss scale)."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry):
        self._args = (name, documentation)
        self._registry = registry
        self._gauge: Gauge | None = None

    def set(self, value: float) -> None:
        if self._gauge is None:
            self._gauge = Gauge(*self._args, registry=self._registry)
        self._gauge.set(value)


class CoordinatorMetrics:
    """members, islands, plan epoch, step, tokens/s, last complete checkpoint, per-link bandwidth, and the
    latest loss and validation loss."""

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
        self.loss = _UntilSet("atoll_loss", "Training loss of the latest step reported (cross entropy, nats/token; "
                              "absent before the first)", registry=r)
        self.loss_step = _UntilSet("atoll_loss_step", "Step of atoll_loss", registry=r)
        self.val_loss = _UntilSet("atoll_val_loss", "Validation loss of the latest validation pass (absent before "
                                  "the first)", registry=r)
        self.val_loss_step = _UntilSet("atoll_val_loss_step", "Step of atoll_val_loss", registry=r)
        self.loss_scale = _UntilSet("atoll_loss_scale", "fp16: the loss scale of the latest step reported (absent "
                                    "under fp32 and bf16)", registry=r)
        self.loop_lag = Gauge("atoll_coordinator_loop_lag_seconds", "How late the coordinator's server loop ran "
                              "(the largest over the last minute); lease expiry allows for it", registry=r)
        self.heartbeat_interval = Gauge("atoll_coordinator_heartbeat_interval_seconds", "The heartbeat interval "
                                        "the coordinator announces (it stretches with the membership to keep "
                                        "heartbeats within --heartbeat-budget)", registry=r)
        self.lease = Gauge("atoll_coordinator_lease_seconds", "The lease the coordinator expires members by",
                           registry=r)

    def update(self, state: CoordinatorState) -> None:
        counts = {"alive": 0, "gone": 0, "left": 0}
        for m in state.store.members_view().values():
            counts[m.state] = counts.get(m.state, 0) + 1
        for s, n in counts.items():
            self.members.labels(state=s).set(n)
        self.islands.set(len(state.store.get_islands()))
        self.plan_epoch.set(state.epoch)
        self.heartbeat_interval.set(state.cadence.current.interval)
        self.lease.set(state.cadence.expiry_lease(state.clock()))
        recent_steps = state.store.recent_steps(256)
        step, tps = throughput(recent_steps, state.epoch)
        scaled = [m for m in recent_steps if m.loss_scale is not None]
        if scaled:
            self.loss_scale.set(max(scaled, key=lambda m: m.step).loss_scale)
        self.step.set(step)
        self.tokens_per_second.set(tps)
        done = state.complete_checkpoint_steps()
        self.checkpoint_step.set(done[-1] if done else 0)
        self.link_bandwidth.clear()
        for x in state.store.list_links():
            self.link_bandwidth.labels(src=x.src, dst=x.dst).set(x.bandwidth_bytes_per_s)
        # the newest rows of the history hold the latest losses (validation passes are sparser: look further)
        recent = state.store.history(newest=LATEST_ROWS)
        loss = next((r for r in reversed(recent) if r.loss is not None), None)
        if loss is not None:
            self.loss.set(loss.loss)
            self.loss_step.set(loss.last)
        val = next((r for r in reversed(recent) if r.val_loss is not None), None)
        if val is not None:
            self.val_loss.set(val.val_loss)
            self.val_loss_step.set(val.last)
