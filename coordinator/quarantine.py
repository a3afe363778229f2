"""Quarantine: a node whose tensors its neighbours keep rejecting (`atoll.node.door`) is taken out of the plan.

A node that rejects a tensor names its sender in its step report (`StepMetrics.offences`). The coordinator counts,
per sender, the distinct steps it was named for; a sender named for `offences` steps within `window_steps` steps
(3 within 100) is quarantined: its member state becomes "quarantined" (kept in the store, so a restart keeps it
out), the membership changes, and the next plan is made without it. Its heartbeats are answered with the reason,
and it waits, in no plan, until an operator lets it back (`atoll job release NODE`); joining again does not.

Why these numbers: each offence already costs the job one skipped step, so an honest link never needs three within
a hundred steps (the door's band is a factor of 20 from a link's running norm: a clean tiny run reports none), while
a node that sends NaN or huge tensors every step is out within 3 steps, and one that does so one step in 15 within
50. Slowness is no offence: the door judges what a tensor holds, never when it came.

A sender is counted only for what the plan lets it send to the reporter (a neighbour stage of the reporter's
pipeline); a stage's own bad loss names that stage but counts towards no quarantine (a diverging loss is the
model's, not one node's). Decisions are pure functions of (the offending steps, the newest step, the options).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from atoll.plan import Plan
from atoll.types import StepMetrics, TensorOffence
from atoll.v1 import atoll_pb2 as pb

QUARANTINED = "quarantined"
LOSS_VOTE = "loss-vote"
"""The kind of offence of a loss holder whose reported loss the other holders' median contradicts."""
MAX_OFFENCES_PER_REPORT = 64
"""Most offences one step report may carry (a step has two tensors per micro-batch and neighbour)."""


@dataclass(frozen=True, kw_only=True)
class QuarantineOptions:
    offences: int = 3
    """Distinct offending steps that quarantine a sender..."""
    window_steps: int = 100
    """...within this many steps of its newest offence."""

    def __post_init__(self) -> None:
        if self.offences < 1 or self.window_steps < 1:
            raise ValueError(f"offences and window_steps must be >= 1, got {self.offences}, {self.window_steps}")


def quarantine_reason(node: str, steps: Iterable[int], newest: str, options: QuarantineOptions) -> str | None:
    """Why `node`, named for the offending `steps`, is quarantined now; None while it is under the threshold."""
    steps = sorted(set(steps))
    if not steps:
        return None
    recent = [s for s in steps if s > steps[-1] - options.window_steps]
    if len(recent) < options.offences:
        return None
    return (f"{len(recent)} steps with tensors its neighbours rejected (or a loss the other loss holders "
            f"contradicted) within {options.window_steps} steps "
            f"(steps {', '.join(map(str, recent[-5:]))}); the newest: {newest}")


def offence_refusal(plan: Plan | None, reporter: str, pipeline: int, stage: int, o: TensorOffence) -> str:
    """Why an offence a node reports cannot be taken ("" when it can): the sender must be what the plan lets send to
    the reporter, a node of a neighbour stage of its pipeline (a local loss: the reporter itself)."""
    if o.kind == "loss":
        return "" if o.sender == reporter else f"a loss offence names {o.sender!r}, not the reporting node"
    if o.kind == "verify":  # a replica of the reporter's stage whose output its recomputation did not match
        if plan is None or not 0 <= pipeline < len(plan.pipelines) \
                or not 0 <= stage < len(plan.pipelines[pipeline].stages):
            return "no plan names the reporting node's stage"
        nodes = plan.pipelines[pipeline].stages[stage].nodes
        if o.sender == reporter or o.sender not in nodes or o.direction != "forward":
            return (f"a verification offence names {o.sender[:80]!r}, which is no other replica of stage {stage} "
                    f"of pipeline {pipeline} in plan epoch {plan.epoch}")
        return ""
    if o.kind not in ("non-finite", "norm") or o.direction not in ("forward", "backward"):
        return f"an offence of kind {o.kind[:20]!r}, direction {o.direction[:20]!r}"
    if plan is None or not 0 <= pipeline < len(plan.pipelines):
        return "no plan names the reporting node's pipeline"
    stages = plan.pipelines[pipeline].stages
    neighbour = stage - 1 if o.direction == "forward" else stage + 1
    if not 0 <= neighbour < len(stages) or o.sender not in stages[neighbour].nodes:
        return (f"{o.sender[:80]!r} sends no {o.direction} tensors to stage {stage} of pipeline {pipeline} in plan "
                f"epoch {plan.epoch}")
    return ""


@dataclass
class _Record:
    steps: set[int] = field(default_factory=set)
    newest: str = ""


class OffenceLog:
    """The coordinator's count of each sender's offending steps (in memory; a quarantine itself is in the store).
    Thread-safe."""

    def __init__(self, options: QuarantineOptions | None = None) -> None:
        self.options = options or QuarantineOptions()
        self._lock = threading.Lock()
        self._by_sender: dict[str, _Record] = {}
        self.since: dict[str, float] = {}
        """node -> when this coordinator quarantined it (a restart forgets it: the store keeps the state)."""

    def record(self, offences: Iterable[TensorOffence]) -> list[tuple[str, str]]:
        """Count `offences` (checked against the plan already); the (sender, reason) of each sender they put over
        the threshold."""
        out = []
        with self._lock:
            for o in offences:
                if o.kind == "loss":
                    continue
                rec = self._by_sender.setdefault(o.sender, _Record())
                rec.steps.add(o.step)
                rec.newest = o.describe()
                newest = max(rec.steps)
                rec.steps = {s for s in rec.steps if s > newest - self.options.window_steps}
            for sender, rec in self._by_sender.items():
                if sender in self.since:
                    continue
                why = quarantine_reason(sender, rec.steps, rec.newest, self.options)
                if why is not None:
                    out.append((sender, why))
        return out

    def note_quarantined(self, node: str, now: float) -> None:
        with self._lock:
            self.since[node] = now

    def release(self, node: str) -> None:
        """Forget `node`'s offences (an operator let it back)."""
        with self._lock:
            self._by_sender.pop(node, None)
            self.since.pop(node, None)

    def summary(self) -> dict[str, tuple[int, str]]:
        """sender -> (offending steps within the window, the newest offence in words)."""
        with self._lock:
            return {n: (len(r.steps), r.newest) for n, r in self._by_sender.items()}


# --- acting on the coordinator's state (called by the handlers) ----------------------------------------------------

def take_offences(state, metrics: StepMetrics) -> list[str]:
    """Count the offences of a step report (refusing what the plan of its epoch does not let the reporter name) and
    quarantine the senders they put over the threshold; the lines to log."""
    from atoll.coordinator.errors import InvalidArgument

    plan = state.current_plan()
    if plan is not None and plan.epoch != metrics.plan_epoch:
        plan = next((h.plan for h in state.store.plan_history() if h.plan.epoch == metrics.plan_epoch), None)
    if len(metrics.offences) > MAX_OFFENCES_PER_REPORT:
        raise InvalidArgument(f"{len(metrics.offences)} offences in one step report; at most {MAX_OFFENCES_PER_REPORT}")
    for o in metrics.offences:
        why = offence_refusal(plan, metrics.node_id, metrics.pipeline, metrics.stage, o)
        if why:
            raise InvalidArgument(f"step report of node {metrics.node_id}: {why}; the report is refused")
    lines = [f"node {metrics.node_id} (pipeline {metrics.pipeline} stage {metrics.stage}) rejected: {o.describe()}"
             for o in metrics.offences[:4]]
    return lines + _quarantine(state, state.offences.record(metrics.offences))


def take_loss_liars(state, decisions) -> list[str]:
    """Count each voter whose loss the other loss holders' median contradicted (`atoll.coordinator.claims.decide`)
    as an offence of that step, quarantining as the door's offences do; the lines to log (a step whose voters
    disagree with no majority is said too)."""
    offences = [TensorOffence(sender=node, kind=LOSS_VOTE, direction="loss", step=d.step, norm=loss,
                              detail=f"(the other loss holders: {d.loss:.6g})")
                for d in decisions for node, loss in d.liars]
    lines = [f"node {o.sender} reported a loss the others contradict: {o.describe()}" for o in offences[:4]]
    lines += [d.note for d in decisions if d.note][:4]
    return lines + (_quarantine(state, state.offences.record(offences)) if offences else [])


def _quarantine(state, over: list[tuple[str, str]]) -> list[str]:
    """Quarantine each (node, reason) put over the threshold; the lines to log."""
    lines = []
    now = state.clock()
    for node, reason in over:
        member = state.store.get_member(node)
        if member is None or member.state == QUARANTINED:
            continue
        state.store.set_member_state(node, QUARANTINED, reason)
        state.offences.note_quarantined(node, now)
        state.membership_changed(now)
        lines.append(f"node {node} is quarantined: {reason}; it is left out of the next plan until `atoll job "
                     f"release {node}`")
    return lines


def release(state, node_id: str) -> str:
    """`atoll job release NODE`: let a quarantined node back (alive when it still heartbeats, else gone: it joins
    again); what was done, in words."""
    from atoll.coordinator.errors import FailedPrecondition, NotFound

    member = state.store.get_member(node_id)
    if member is None:
        raise NotFound(f"node {node_id[:80]!r} is not a member of this job; `atoll job quarantine` lists the "
                       f"quarantined nodes")
    if member.state != QUARANTINED:
        raise FailedPrecondition(f"node {node_id} is not quarantined (it is {member.state}); nothing to release")
    now = state.clock()
    lease = state.cadence.current.lease
    back = "alive" if now - member.last_heartbeat_unix <= lease else "gone"
    state.store.set_member_state(node_id, back, "released from quarantine by the operator")
    state.offences.release(node_id)
    state.membership_changed(now)
    how = "it heartbeats, and the next plan may include it" if back == "alive" else \
        "it has not heartbeat for a lease: it joins again when it comes back"
    return f"node {node_id} is released from quarantine ({member.reason}); {how}"


def offenders(state) -> list[pb.Offender]:
    """The quarantined members and the senders with offences in the window, for the status and `atoll job
    quarantine`."""
    counts = state.offences.summary()
    out = []
    quarantined = {n: m for n, m in state.store.members_view().items() if m.state == QUARANTINED}
    for n in sorted(set(counts) | set(quarantined)):
        count, newest = counts.get(n, (0, ""))
        m = quarantined.get(n)
        out.append(pb.Offender(node_id=n, offences=count, newest=newest, quarantined=m is not None,
                               reason=m.reason if m is not None else "", since_unix=state.offences.since.get(n, 0.0)))
    return out
