"""The coordinator's state: the store plus what lives only in memory (probes in flight, the plan watchers).

`tick(now)` is the coordinator's heartbeat: it expires leases, refreshes the islands and, when
`plan_decision` says so, makes and publishes a new plan epoch. The service calls it from a background
loop; tests call it with their own clock. An operator may pin the plan (`atoll coordinator --plan`):
`load_pinned_plan` checks it against the job and `pinned_planner` publishes it in place of the planner's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Set
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

from atoll.coordinator.cadence import HeartbeatCadence
from atoll.coordinator.calibration import calibration_note, compound, epoch_compute, predicted_compute, speed_factors
from atoll.coordinator.challenges import JoinChallenges
from atoll.coordinator.checkpoints import complete_steps, copies_of, resume_step
from atoll.coordinator.claims import STEP_WINDOW, LossDecision, LossVotes, StepProgress, finished_nodes, job_ended
from atoll.coordinator.history import Sample, sample_of
from atoll.coordinator.replication_gaps import ReplicationGaps
from atoll.coordinator.quarantine import OffenceLog
from atoll.coordinator.drift import (UNSETTLED_STEPS, DriftOptions, describe, drifted, estimated_rate, speed_changes,
                                    switch_seconds, switch_verdict, unsettled)
from atoll.coordinator.islands import IslandOptions, device_class, form_islands, speed_class
from atoll.coordinator.linkmatrix import LinkGraph, ProbeOptions, sample_targets
from atoll.coordinator.machineprobe import MachineProbes, RoundTarget, machine_of
from atoll.coordinator.membership import (MembershipOptions, PlanDecision, RunFailureRecord, expire_leases,
                                          failure_decision, live_resume, plan_decision)
from atoll.coordinator.outer import OuterRounds
from atoll.coordinator.netfit import (CalibrationOptions, NetworkFit, describe_fit, fit_network, model_change,
                                      plan_step_under, replan_verdict, samples_from_steps)
from atoll.coordinator.planner.network import NOMINAL, NetworkModel
from atoll.coordinator.planning import PlanInputs, finish_plan, handing_over, make_plan
from atoll.coordinator import job_control
from atoll.coordinator.errors import FailedPrecondition
from atoll.coordinator.ratelimit import PerNodeLimit, RateOptions
from atoll.coordinator.reachability import plan_address, separate_unreachable, unreachable_nodes
from atoll.coordinator.sampling import SampleProgress
from atoll.coordinator.store import JobControlRecord, JobRecord, MemberRecord, Store, StoreError
from atoll.job import JobSpec
from atoll.plan import IslandInfo, Plan
from atoll.types import LinkMeasurement, StepMetrics

log = logging.getLogger("atoll.coordinator")

Planner = Callable[[PlanInputs], tuple[Plan, str]]


def run_id_of(job: JobRecord) -> str:
    """The run id of a job as a state dir holds it: made from when that state dir first held it, so the same dir
    gives the same id after any restart, and a fresh one another."""
    return hashlib.sha256(f"{job.job_id}/{job.created_unix!r}".encode()).hexdigest()[:12]


def _layout(plan: Plan, group: int) -> tuple:
    """How replica group `group` of `plan` runs: its pipelines' batches and stages (layers, nodes, parallelism)."""
    return tuple(sorted((p.micro_batch, p.num_micro_batches, tuple(
        (st.layers, tuple(st.nodes), st.dp, st.tp, st.zero, st.recompute, tuple(st.recompute_layers), st.lanes)
        for st in p.stages)) for p in (plan.pipelines[i] for i in plan.groups[group].pipelines)))


def unchanged_groups(old: Plan, new: Plan, nodes: frozenset[str]) -> list[str]:
    """The names of the replica groups of `old` that hold `nodes` when `new` runs every one of them as `old` does (the
    same nodes, stages and batches); empty when any of them would change."""
    names = []
    for g in range(len(old.groups)):
        members = old.group_nodes(g)
        if members.isdisjoint(nodes):
            continue
        twin = next((k for k in range(len(new.groups)) if new.group_nodes(k) == members), None)
        if twin is None or _layout(new, twin) != _layout(old, g):
            return []
        names.append(old.groups[g].name)
    return names


@dataclass(frozen=True)
class NodeSession:
    """A node process as the coordinator knows it: its session and when and from where it joined (0, "": heard
    first by a request other than a join): the peer address it advertised, and the host its join came from (the
    connection's address as the coordinator saw it, behind any NAT; for a process first heard by its heartbeat
    stream, the stream's; "" where not known)."""

    session: str
    joined_unix: float
    peer_address: str
    seen_from: str = ""


@dataclass(frozen=True, kw_only=True)
class CoordinatorOptions:
    """Timing and policy of one coordinator."""

    membership: MembershipOptions = field(default_factory=MembershipOptions)
    """Leases, restart grace and settling."""
    probes: ProbeOptions = field(default_factory=ProbeOptions)
    """Which links are probed and when again."""
    islands: IslandOptions = field(default_factory=IslandOptions)
    """The island clustering threshold."""
    heartbeat_interval: timedelta | None = None
    """How often nodes heartbeat; None means a quarter of the lease."""
    heartbeat_budget: float | None = 2000.0
    """Heartbeats a second the coordinator takes from all nodes together: past `budget x interval` members the
    interval and the lease stretch with the membership (`atoll.coordinator.cadence`). None: a fixed cadence."""
    drift: DriftOptions = field(default_factory=DriftOptions)
    calibration: CalibrationOptions = field(default_factory=CalibrationOptions)
    """When the network model fitted to the nodes' measured transfers replans (`atoll.coordinator.netfit`); checked
    with the drift, every `DriftOptions.interval`."""
    """When devices running slower or faster than planned make a new plan worth its switch (`atoll.coordinator.drift`)."""
    dial_back: bool = True
    """Dial each joining node's advertised address back (`atoll.coordinator.dialback`) and run one that does
    not answer as a node that accepts no connections. False trusts every advertised address."""
    failure_reports: RateOptions = field(default_factory=lambda: RateOptions(
        burst=2, every_s=30.0, penalty_s=60.0))
    """How often one node's failure reports are taken (each makes a new plan): fake ones from one node forced 4 plans
    in 20 s. An honest node's runs fail at most about once a plan, and a plan takes its settle time to start."""
    joins: RateOptions = field(default_factory=lambda: RateOptions(burst=4, every_s=15.0, penalty_s=30.0))
    """How often a join may claim one node id (a join that moves a member makes a new plan); a first join, which
    claims none, is not limited here."""

    def __post_init__(self) -> None:
        if self.heartbeat_interval is not None and not (
                timedelta(0) < self.heartbeat_interval < self.membership.lease):
            raise ValueError(f"heartbeat_interval ({self.heartbeat_interval}) must be positive and shorter than the "
                             f"lease ({self.membership.lease})")
        if self.heartbeat_budget is not None and not self.heartbeat_budget > 0:
            raise ValueError(f"heartbeat_budget must be positive (heartbeats a second) or None, "
                             f"got {self.heartbeat_budget}")

    @property
    def heartbeat(self) -> timedelta:
        return self.heartbeat_interval or self.membership.lease / 4


_SECONDS = re.compile(r"\d+(\.\d+)?s\b")
"""A countdown in a reason for not planning (compared without it, so the reason is logged once)."""


class CoordinatorState:
    """Everything the handlers read and change. Thread-safe."""

    def __init__(self, *, store: Store, job: JobSpec, token: str, options: CoordinatorOptions | None = None,
                 clock: Callable[[], float] = time.time, planner: Planner = make_plan, rendezvous: str = ""):
        if not token:
            raise ValueError("the coordinator needs a job token: pass --token-file or set ATOLL_TOKEN")
        self.store, self.job, self.token = store, job, token
        self.control = store.get_control()
        """`atoll job stop/extend` and the job's end (`atoll.coordinator.job_control`); changed by `set_control`."""
        self.options = options or CoordinatorOptions()
        self.clock, self.planner = clock, planner
        self.stalled: Callable[[float], float] = lambda window: 0.0
        """The longest the coordinator's server answered late within the last `window` seconds (the service sets it
        to its loop's `LoopLag.recent`); lease expiry allows for it."""
        self.rendezvous = rendezvous
        """The rendezvous store of this coordinator process; a stored plan naming another one is stale."""
        self.newest_backup: Callable[[], tuple[str, float] | None] = lambda: None
        """The newest online backup of the store, (path, when taken), for the status; the service that takes them
        sets it."""
        self.viewer_token: Callable[[], str] = lambda: ""
        """Makes (at the first call) and returns the dashboard's read-only token (`atoll job viewer-token`); the
        service sets it to its `atoll.coordinator.dashboard.access.ViewerToken`. "": this coordinator has none."""
        self.network: NetworkModel = NOMINAL
        """How the planner reads the probed links: as probed, or as a network fit replanned under (`_network_check`).
        Held in memory: a restarted coordinator plans from the probes again and re-fits from the next reports."""
        self.network_fit: NetworkFit | None = None
        """The newest fit of the running plan's reports (the status shows it)."""
        self.speed: dict[str, float] = store.get_speed()
        """Per node, the factor its profile was scaled by for the current plan (`atoll.coordinator.calibration`),
        kept in the store beside the plan so a restarted coordinator compounds from the same factors."""
        stored = store.get_job()
        if stored is not None and stored.job_id != job.id:
            raise StoreError(f"the state dir holds job {stored.job_id}, not {job.id}: the job spec changed since "
                             f"that state was written; restart with the original spec to resume that job, or give a "
                             f"new --state-dir (or empty this one) to start this job afresh")
        if stored is None:
            stored = JobRecord(job_id=job.id, name=job.name, spec_toml=job.to_toml(), created_unix=clock())
            store.put_job(stored)
        self.run_id = run_id_of(stored)
        """This state dir's run of the job (`JobInfo.run_id`): a coordinator started on a fresh state dir runs the
        job afresh under another one, and a node refuses to train it over the checkpoints of an earlier run
        (`atoll.node.checkpoint.claim_checkpoint_dir`)."""
        self.spec_toml = job.to_toml()
        self.started_unix = clock()
        self._cond = threading.Condition(threading.RLock())
        self._plan = store.latest_plan()
        self._in_flight: dict[str, dict[str, float]] = {}
        """node -> peer -> when a probe between them was handed out (both ways), until reported or timed out."""
        self._measured: dict[str, dict[str, float]] = {}
        """node -> peer -> when their link was last measured (both ways): each node's sample, read in O(its links)."""
        for x in store.list_links():
            self._note_measured(x.src, x.dst, x.measured_unix)
        self._probe_index: _ProbeIndex = _ProbeIndex.of({})
        self._index_version = -1
        self._indexed: dict[str, str] = {}
        """The members and classes of the probe index as last rebuilt."""
        self._members_version = 0
        """Counts membership changes (`membership_changed`): the probe index is rebuilt when it moved."""
        self._in_flight_pruned = float("-inf")
        self._samples = SampleProgress(self.options.probes)
        """Which members' samples of links are complete, checked again only where that may have changed."""
        self._rng = random.Random()
        self._unreachable: set[str] = set()
        """Alive members that accept no connections: never dialed by a probe (they probe the others)."""
        self._machines = MachineProbes(reprobe_after_s=self.options.probes.reprobe_after.total_seconds(),
                                       timeout_s=self.options.probes.in_flight_timeout.total_seconds(),
                                       figures=store.get_machine_flows(), on_figure=store.put_machine_flow)
        """Machine probes (`atoll.coordinator.machineprobe`): each machine's flow while all its nodes send."""
        self._sessions: dict[str, NodeSession] = {}
        """node -> the session (`JoinRequest.session`, one per node process) of its last join to this process, or of
        the first request heard from it (`check_session`)."""
        self._superseded: set[str] = set()
        """Sessions a newer process of the same node replaced: refused for good (`check_session`), a join too."""
        self._hosts: dict[str, str] = {}
        """session -> the host its process was first heard from by a request that says so (its heartbeat stream),
        for a process whose join this coordinator process did not see (`process_of`)."""
        self._restarted: dict[str, int] = {}
        """node -> the epoch of the plan that named it when it joined under a new session: its process restarted
        and its run of that plan is gone with it (`note_session`). The plan is withheld from it (`newer_plan`) and
        replaced once the settle time has passed (`membership.plan_decision`)."""
        self._last_change = self.started_unix
        self._stale_before = 0.0
        self._islands_dirty = True
        self._islands_pending = False
        self._islands_next = 0.0
        """While forming islands is slow, when (time.monotonic) they may be formed again for the status."""
        self._last_reason = ""
        self._drift_next = self.started_unix + self.options.drift.interval.total_seconds()
        self._end_hold_since: float | None = None
        """When the running plan's devices are next checked for drift (`_drift_check`)."""
        self._drift_backoff = 1
        self._ever_planned: set[str] | None = None
        """Every node any plan of this job named (built from the store when first needed)."""
        self._network_next = self._drift_next
        """When the network model is next fitted to the running plan's reports (`_network_check`)."""
        self._network_backoff = 1
        self.prune_checkpoints_before = 0
        """Checkpoint steps older than this are needed nowhere (`note_complete_checkpoints`); heartbeat replies
        carry it, and nodes delete their own and their copies of older steps (0: none yet)."""
        self.offences = OffenceLog()
        """Each sender's steps with tensors its neighbours rejected: past a threshold, a quarantine
        (`atoll.coordinator.quarantine`)."""
        self._failures: dict[int, RunFailureRecord] = {}
        self._old_plans: dict[int, Plan] = {}
        self._progress = StepProgress(keep_epochs=REACHED_EPOCHS)
        self._loss_votes = LossVotes(keep_epochs=REACHED_EPOCHS)
        """Each node's newest step per recent plan epoch: what its peers' claims are checked against
        (`atoll.coordinator.claims`). Seeded from the store's recent reports, so a restarted coordinator checks
        against what it heard before."""
        plans = {h.plan.epoch: h.plan for h in store.plan_history()[-REACHED_EPOCHS:]}
        for m in store.recent_steps(store.recent_steps_kept):
            self._progress.note(plans.get(m.plan_epoch), m.plan_epoch, m.node_id, m.step)
        """The first failure reported for each recent plan epoch (in memory: a restart makes a new epoch anyway)."""
        self._closed = False
        self._trained_unix = 0.0
        """When the job's last step was first reported (0: not yet): it finishes once its final checkpoint is held."""
        self.outer = OuterRounds(store, now=self.started_unix)
        """Outer-sync rounds of the replica groups (outer-mode plans), resumed from the store after a restart."""
        self.failure_limit = PerNodeLimit(self.options.failure_reports)
        """Failure reports per node (`atoll.coordinator.ratelimit`)."""
        self.join_limit = PerNodeLimit(self.options.joins)
        """Joins per claimed node id."""
        self.challenges = JoinChallenges()
        """Join challenges handed out and not taken yet (`atoll.coordinator.challenges`)."""
        self.replication_gaps = ReplicationGaps()
        """Stages whose checkpoint writer could not write (a full disk), and their stand-ins."""
        self.checkpoint_checksums: dict[tuple[int, str, int, int], int] = {}
        """(step, writer, layer start, layer end) -> the CRC-32 its writer reported (copies are checked against it;
        in memory: after a restart a copy is checked by its size alone)."""
        self._plan_listeners: list[Callable[[], None]] = []
        self.cadence = HeartbeatCadence(self.options.heartbeat.total_seconds(),
                                        self.options.membership.lease.total_seconds(), self.options.heartbeat_budget)
        """How often nodes heartbeat and how long a lease lasts, for the membership's size (updated by `tick`)."""
        self.cadence.update(sum(1 for m in store.members_view().values() if m.state == "alive"), self.started_unix)

    # --- plan ---------------------------------------------------------------------------------------

    def current_plan(self) -> Plan | None:
        with self._cond:
            return self._plan

    @property
    def epoch(self) -> int:
        plan = self._plan  # one reference read, atomic: every heartbeat asks, and a publish holds the lock while
        return plan.epoch if plan is not None else 0  # it writes the plan to disk

    def _returning(self, alive: Mapping[str, MemberRecord], planned: Set[str] | None) -> frozenset[str]:
        """Alive members the current plan does not name that an earlier plan did (`plan_decision`'s `returning`)."""
        joined = [n for n in alive if planned is not None and n not in planned]
        if not joined:
            return frozenset()
        if self._ever_planned is None:  # once per coordinator process, then kept by `publish`
            self._ever_planned = {n for h in self.store.plan_history() for p in h.plan.pipelines
                                  for st in p.stages for n in st.nodes}
        return frozenset(n for n in joined if n in self._ever_planned)

    def publish(self, plan: Plan, reason: str) -> None:
        with self._cond:
            self.store.add_plan(plan, created_unix=self.clock(), reason=reason)
            if self._ever_planned is not None:
                self._ever_planned.update(n for p in plan.pipelines for st in p.stages for n in st.nodes)
            self._plan = plan
            self._cond.notify_all()
        self._tell_plan_listeners()

    def newer_plan(self, known_epoch: int, node_id: str = "") -> Plan | None:
        """The current plan if its epoch exceeds `known_epoch` (and it is not stale), else None; never blocks.
        Not to `node_id` when it restarted since the plan was made (`restarted`): a new epoch follows."""
        plan = self._plan  # one reference read, atomic: no lock, so an event loop may call this
        if plan is not None and plan.epoch > known_epoch and not self._stale(plan) \
                and self._restarted.get(node_id) != plan.epoch:
            return plan
        return None

    def check_session(self, node_id: str, session: str, *, joining: bool = False, seen_from: str = "") -> None:
        """Refuse (FailedPrecondition) a request of a node process that no longer speaks for `node_id`: a newer
        process joined under its id since (a restart, or a second machine started from a copy of its state dir).
        A node's first request this coordinator process hears (it restarted since the join) records its session.
        A join (`joining`) is refused only under a session already replaced: a new one is a restart
        (`note_session`). A request without a session (an older node) is not judged. `seen_from`: the host the
        request came from, recorded with a session first heard this way. Cheap and lock-free: an event loop calls
        it."""
        if not session:
            return
        if session in self._superseded:
            raise FailedPrecondition(self._fenced(node_id))
        if joining:
            return
        current = self._sessions.get(node_id)
        if current is None:
            current = self._sessions.setdefault(node_id, NodeSession(session, 0.0, "", seen_from))
        if current.session != session:
            raise FailedPrecondition(self._fenced(node_id))
        if seen_from and not current.seen_from:  # first heard by a request that did not say where from
            self._hosts.setdefault(session, seen_from)  # (no lock on the event loop: `process_of` joins them)

    def process_of(self, node_id: str) -> NodeSession | None:
        """The node's current process as this coordinator process knows it (None: not heard from yet)."""
        current = self._sessions.get(node_id)
        if current is not None and not current.seen_from and current.session in self._hosts:
            return replace(current, seen_from=self._hosts[current.session])
        return current

    def _fenced(self, node_id: str) -> str:
        current = self._sessions.get(node_id)
        where = ""
        if current is not None and current.joined_unix:
            where = (f" at {time.strftime('%H:%M:%S', time.localtime(current.joined_unix))}"
                     + (f" from peer address {current.peer_address}" if current.peer_address else ""))
        return (f"another process joined as node {node_id}{where}, after this one, and speaks for the node now: "
                f"this process stops. Two machines share one node identity (one started from a copy of the other's "
                f"state dir): give this one a --state-dir of its own to join as a new node")

    def note_session(self, node_id: str, session: str, now: float, peer_address: str = "",
                     seen_from: str = "") -> None:
        """Record the session of a join. A member the current plan names that joins under a session other than its
        last one (or the first this process hears of it) restarted: its run of the plan, and the state that run
        held, are gone, so the plan is withheld from it and replaced by a new epoch, resumed from live state or
        the last complete checkpoint, once the settle time has passed. (Without that, a job whose nodes all
        restart would be handed its old plan and train again from that plan's resume step.) A join without a
        session (an older node) is not judged."""
        if not session:
            return
        with self._cond:
            last = self._sessions.get(node_id)
            before = last.session if last is not None else None
            self._sessions[node_id] = NodeSession(session, now, peer_address, seen_from)
            if before is not None and before != session:
                self._superseded.add(before)
                log.info("node %s joined from a new process (peer address %s); requests of its previous process "
                         "are refused from now on", node_id, peer_address or "none")
            plan = self._plan
            if before != session and plan is not None and not self._stale(plan) \
                    and any(node_id in i.nodes for i in plan.islands):
                self._restarted[node_id] = plan.epoch
                self._last_change = max(self._last_change, now)
                log.info("node %s restarted (a new process joined under its id): plan epoch %d is withheld from it "
                         "and replaced once the settle time has passed", node_id, plan.epoch)

    def restarted(self) -> set[str]:
        """Members the current plan names whose process restarted since it was made (`note_session`)."""
        plan = self._plan
        if plan is None:
            return set()
        with self._cond:
            return {n for n, e in self._restarted.items() if e == plan.epoch}

    def wait_for_plan(self, known_epoch: int, timeout: float, node_id: str = "") -> Plan | None:
        """The current plan once its epoch exceeds `known_epoch` (`newer_plan`), or None after `timeout` seconds or
        on close."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._closed:
                plan = self.newer_plan(known_epoch, node_id)
                if plan is not None:
                    return plan
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return None

    def add_plan_listener(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call `listener()` after every publish and on close, on the thread that did it; returns its remover.

        A listener must be quick and must not raise: it hands the news on (to an event loop, say) and returns.
        """
        with self._cond:
            self._plan_listeners.append(listener)

        def remove() -> None:
            with self._cond:
                if listener in self._plan_listeners:
                    self._plan_listeners.remove(listener)
        return remove

    def _tell_plan_listeners(self) -> None:
        with self._cond:
            listeners = list(self._plan_listeners)
        for listener in listeners:  # outside the lock: handlers that need it are not held up by a listener
            listener()

    def _stale(self, plan: Plan) -> bool:
        """A plan from before a coordinator restart: its rendezvous store is gone, so nodes cannot run it."""
        return bool(self.rendezvous) and plan.rendezvous != self.rendezvous

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._tell_plan_listeners()

    # --- membership -----------------------------------------------------------------------------------

    @property
    def members_version(self) -> int:
        """Counts membership changes (joins, leaves, lapsed leases, quarantines): a reader that saw the same count
        read the same members' states (the dashboard reads them again only when it moved)."""
        return self._members_version

    def membership_changed(self, now: float) -> None:
        with self._cond:
            self._last_change = now
            self._islands_dirty = True
            self._members_version += 1

    def alive_members(self) -> dict[str, MemberRecord]:
        """Alive members by id: the store's own records (read them, do not change them)."""
        return {n: m for n, m in self.store.members_view().items() if m.state == "alive"}

    # --- probes ---------------------------------------------------------------------------------------

    def _note_measured(self, a: str, b: str, when: float) -> None:
        if a != b:
            self._measured.setdefault(a, {})[b] = when
            self._measured.setdefault(b, {})[a] = when

    def _fresh_peers(self, node_id: str, now: float) -> set[str]:
        horizon = max(now - self.options.probes.reprobe_after.total_seconds(), self._stale_before)
        return {p for p, t in self._measured.get(node_id, {}).items() if t >= horizon}

    def assign_probes(self, node_id: str, now: float) -> list[MemberRecord]:
        """Peers `node_id` should probe now; they count as in flight until reported or timed out.

        O(the node's links + device classes): the peers are drawn from the index of alive members that `tick`
        rebuilds, and a node that joined since is added to it here.
        """
        index = self._probe_index
        if node_id not in index.class_of:
            member = self.store.get_member(node_id)
            if member is None or member.state != "alive":
                return []
            with self._cond:
                index.add(node_id, device_class(member.profile), machine_of(node_id, member.profile))
                if member.profile.unreachable:
                    self._unreachable.add(node_id)
        timeout = self.options.probes.in_flight_timeout.total_seconds()
        with self._cond:
            if self._samples.complete(node_id, now):  # most heartbeats, once the links are measured: O(1)
                return []
            counted = self._fresh_peers(node_id, now) | {
                p for p, t in self._in_flight.get(node_id, {}).items() if now - t < timeout} | \
                (self._unreachable - {node_id})  # see `atoll.coordinator.reachability`
            targets = sample_targets(node_id, index.class_of, index.by_class, index.everyone, counted,
                                     self.options.probes, self._rng)
            for peer in targets:
                self._in_flight.setdefault(node_id, {})[peer] = now
                self._in_flight.setdefault(peer, {})[node_id] = now
        return [m for m in (self.store.get_member(p) for p in targets) if m is not None]

    def assign_machine_probe(self, node_id: str, now: float, lead_s: float) -> tuple[MemberRecord, RoundTarget] | None:
        """`node_id`'s part of its machine's probe round (`atoll.coordinator.machineprobe`), with the member it
        probes; None when it has none to send now."""
        index = self._probe_index
        machine = index.machine_of.get(node_id)
        # (one machine, or a node alone on its machine: nothing to probe; O(1) and no lock on most calls)
        if machine is None or len(index.by_machine) < 2 or len(index.by_machine.get(machine, ())) < 2:
            return None
        timeout = self.options.probes.in_flight_timeout.total_seconds()

        def quiet(nodes: list[str]) -> bool:  # no lone probe from or to the machine's nodes in flight
            return not any(now - t < timeout for n in nodes for t in self._in_flight.get(n, {}).values())

        with self._cond:
            unreachable = self._unreachable
            got = self._machines.target(node_id, machine, index.by_machine, lambda n: n not in unreachable, now,
                                        lead_s, self._stale_before, quiet, index.machines_after)
        if got is None:
            return None
        member = self.store.get_member(got.receiver)
        return None if member is None else (member, got)

    def record_probes(self, links: list[LinkMeasurement]) -> None:
        rounds = [x for x in links if x.flows > 1]
        if rounds:
            with self._cond:
                for x in rounds:
                    outcome = self._machines.record(x, self._probe_index.machine_of.get(x.src, x.src), x.measured_unix)
                    if outcome is not None:
                        log.info("machine probe: %s", outcome)
            links = [x for x in links if x.flows <= 1]
        self.store.put_links(links)
        with self._cond:
            for x in links:
                self._in_flight.get(x.src, {}).pop(x.dst, None)
                self._in_flight.get(x.dst, {}).pop(x.src, None)
                self._note_measured(x.src, x.dst, x.measured_unix)
                self._samples.measured((x.src, x.dst))
            self._islands_dirty = True

    def request_reprobe(self, now: float) -> None:
        """Treat every link measured before `now` as stale, so all are probed again."""
        with self._cond:
            self._stale_before = now
            self._islands_dirty = True

    def unprobed(self, alive: Mapping[str, MemberRecord], now: float, index: _ProbeIndex | None = None) -> set[str]:
        """Alive members whose sample of links is incomplete (probes in flight count as missing); `index`: the
        probe index of `alive`, when built already."""
        with self._cond:  # (handlers add joiners to the probe index and the unreachable set under it)
            if index is None or index.class_of.keys() != alive.keys():
                index = _ProbeIndex.of(alive)
            sizes = {c: len(v) for c, v in index.by_class.items()}
            skip = frozenset(unreachable_nodes(alive) if index is not self._probe_index else self._unreachable)
            # only the members whose answer may have changed are checked (`SampleProgress`), on a copy of their
            # measurements, so heartbeats wait on the lock for the copy's time only
            todo, incomplete = self._samples.due(alive, index.class_of, sizes, skip, now, self._stale_before)
            measured = {n: dict(self._measured.get(n, {})) for n in todo}
            stale_before = self._stale_before
        # and the machines whose nodes have not yet probed another machine all at once
        machines = self._machines.missing(index.by_machine, lambda n: n not in skip, now, stale_before)
        return (incomplete | machines
                | self._samples.check(todo, index.class_of, sizes, measured, skip, now, stale_before))

    def _refresh_probe_index(self, alive: Mapping[str, MemberRecord], now: float) -> None:
        """Rebuild the probe index when membership changed (O(members)), and drop timed-out probes in flight
        every quarter of their timeout (O(probes in flight)); a round with neither costs O(1)."""
        timeout = self.options.probes.in_flight_timeout.total_seconds()
        with self._cond:  # (handlers add joiners to the index under it)
            version = self._members_version
            changed = version != self._index_version or self._probe_index.class_of.keys() != alive.keys()
        if changed:
            new = self._probe_index = _ProbeIndex.of(alive)
            self._index_version = version
            # (not the old index's own keys: `assign_probes` adds joiners to it between rebuilds)
            before, self._indexed = self._indexed, dict(new.class_of)
            with self._cond:
                self._unreachable = unreachable_nodes(alive)
                # a member that left, came back or changed class changes its own sample and those of the peers
                # that measured it
                for n in (before.keys() ^ new.class_of.keys()) | {
                        n for n, c in new.class_of.items() if before.get(n, c) != c}:
                    self._samples.forget(self._measured.get(n, {}))
                    self._samples.forget((n,))
        if now - self._in_flight_pruned < timeout / 4:
            return
        self._in_flight_pruned = now
        with self._cond:
            for node in list(self._in_flight):
                live = {p: t for p, t in self._in_flight[node].items() if now - t < timeout}
                if live:
                    self._in_flight[node] = live
                else:
                    del self._in_flight[node]

    # --- failures -------------------------------------------------------------------------------------

    def record_failure(self, failure: RunFailureRecord) -> bool:
        """Record that a node's run of the current plan failed; the next `tick` decides on a new epoch.

        Returns False (and records nothing) for another epoch than the current one, or when this epoch's
        failure is already recorded (the first report of an epoch is the one that counts).
        """
        with self._cond:
            if failure.epoch != self.epoch or failure.epoch in self._failures:
                return False
            self._failures[failure.epoch] = failure
            for old in [e for e in self._failures if e < failure.epoch - 64]:
                del self._failures[old]
            return True

    def failures(self) -> dict[int, RunFailureRecord]:
        with self._cond:
            return dict(self._failures)

    # --- step reports ---------------------------------------------------------------------------------

    def record_step(self, metrics: StepMetrics) -> None:
        """Keep a step report (its claims checked: `step_refusal`) and what it says of its node's progress."""
        self.store.add_step(metrics)
        plan = self.plan_of(metrics.plan_epoch)
        with self._cond:
            self._progress.note(plan, metrics.plan_epoch, metrics.node_id, metrics.step)

    def step_refusal(self, plan: Plan, node_id: str, step: int, window: int = STEP_WINDOW) -> str:
        """Why `node_id`'s report of `step` under `plan` is out of line with its peers' ("": it is not)."""
        with self._cond:
            return self._progress.refusal(plan, node_id, step, window)

    def reached_in(self, epoch: int) -> dict[str, int]:
        """node -> the newest step it reported under plan epoch `epoch`."""
        with self._cond:
            return self._progress.reached(epoch)

    def plan_of(self, epoch: int) -> Plan | None:
        """The plan of `epoch`: the current one, or an earlier one from the plan history (the newest few cached)."""
        plan = self._plan
        if plan is not None and plan.epoch == epoch:
            return plan
        with self._cond:
            if epoch in self._old_plans:
                return self._old_plans[epoch]
        found = next((p.plan for p in self.store.plan_history() if p.plan.epoch == epoch), None)
        if found is not None:
            with self._cond:
                self._old_plans[epoch] = found
                while len(self._old_plans) > REACHED_EPOCHS:
                    del self._old_plans[min(self._old_plans)]
        return found

    # --- loss history ---------------------------------------------------------------------------------

    def record_history(self, metrics: StepMetrics) -> list[LossDecision]:
        """Add a step report's loss, tokens/s and validation loss to the whole job's history (a report with
        neither is not part of it). Under a plan the report is a vote (`atoll.coordinator.claims.LossVotes`): what
        is recorded is each step's decision, once made; the decisions this report made are returned."""
        sample = sample_of(metrics, self.job.train.global_batch * self.job.train.seq_len)
        if sample is None:
            return []
        plan = self.plan_of(metrics.plan_epoch) if metrics.plan_epoch else None
        if plan is None:  # before the first plan: no voters to ask
            self.store.add_history(sample)
            return []
        with self._cond:
            decisions = self._loss_votes.add(plan, metrics.node_id, metrics.pipeline, sample.step, sample.loss,
                                             sample.val_loss, sample.tokens_per_second)
        for d in decisions:
            if d.loss is not None or d.val_loss is not None:
                self.store.add_history(Sample(step=d.step, epoch=d.epoch, loss=d.loss,
                                              tokens_per_second=d.tokens_per_second, val_loss=d.val_loss))
        return decisions

    # --- checkpoints ----------------------------------------------------------------------------------

    def complete_checkpoint_steps(self) -> list[int]:
        plans = {h.plan.epoch: h.plan for h in self.store.plan_history()}
        return complete_steps(self.store.list_checkpoints(), plans)

    @property
    def waiting_reason(self) -> str:
        """Why the coordinator made no plan at its last tick where it is waiting for something before its first
        (nodes, probes), for the status; "" once a plan runs or when it waits for nothing."""
        return self._last_reason if self.current_plan() is None and self._last_reason.startswith("waiting") else ""

    def note_complete_checkpoints(self, done: list[int]) -> None:
        """After a checkpoint report: the steps older than the `checkpoint.keep`-th newest complete one are needed
        nowhere but the running plan's resume step (`keep_checkpoint_step`); nodes hear both with their heartbeats.
        Only ever raised: a node never keeps fewer than `keep` complete checkpoints job-wide. (Bounded by the resume
        step instead, nodes holding copies kept every step since it for as long as a plan ran.)"""
        keep = self.job.checkpoint.keep
        if keep < 1 or len(done) < keep:
            return
        self.prune_checkpoints_before = max(self.prune_checkpoints_before, done[-keep])

    @property
    def keep_checkpoint_step(self) -> int:
        """The running plan's resume step, which nodes keep however old it is (its nodes may still load it)."""
        plan = self.current_plan()
        return plan.resume_step if plan is not None else 0

    @property
    def target_steps(self) -> int:
        """The step the job ends at: the spec's `train.steps`, or as `atoll job stop/extend` changed it."""
        return job_control.target_steps(self.job.train.steps, self.control)

    def set_control(self, control: JobControlRecord) -> None:
        self.store.put_control(control)
        self.control = control

    def last_step(self) -> int:
        """The job's last step: `target_steps - 1`; in outer mode the end of the last round, (target // H) x H - 1 for
        every group however many inner steps each trains a round (a round's steps are numbered to end at a multiple
        of H: `atoll.node.outer.OuterSync.next_step`)."""
        plan = self.current_plan()
        if plan is not None and plan.mode == "outer" and plan.outer is not None:
            return plan.outer.end_step(self.target_steps) - 1
        return self.target_steps - 1

    def final_checkpoint_steps(self) -> set[int]:
        """The steps one of whose complete checkpoints is the job's final one: the last step (outer mode: the end of
        the last round, (train.steps // H) x H for every group, however many inner steps each trains a round: a round's
        steps are numbered to end at a multiple of H); none expected of a synchronous job without a checkpoint
        interval."""
        plan = self.current_plan()
        if plan is not None and plan.mode == "outer" and plan.outer is not None:
            return {self.last_step() + 1}
        return {self.target_steps} if self.job.checkpoint.interval else set()

    def final_checkpoint_step(self) -> int:
        """The step of the checkpoint the job is to end with (the status's): the writing group's last step."""
        plan = self.current_plan()
        if plan is not None and plan.mode == "outer" and plan.outer is not None and plan.groups:
            return self.last_step() + 1
        return min(self.final_checkpoint_steps(), default=0)

    def note_trained(self, now: float) -> None:
        """The job's last step was reported: it finishes once its final checkpoint is held (`try_finish`)."""
        if not self._trained_unix:
            self._trained_unix = now
        self.try_finish(now)

    def try_finish(self, now: float) -> None:
        """Mark the job finished once it trained its steps and holds its final checkpoint, or, bounded, without it
        (`job_control.finish_with_checkpoint`; the log and the status then name the newest checkpoint held)."""
        if self.control.finished_unix or not self._trained_unix:
            return
        finals = self.final_checkpoint_steps()
        done = set(self.complete_checkpoint_steps()) if finals else set()
        bound = job_control.FINAL_CHECKPOINT_LEASES * self.options.membership.lease.total_seconds()
        ok, why = job_control.finish_with_checkpoint(now, trained_unix=self._trained_unix, final_steps=finals,
                                                     done_steps=done, writers_busy=self._writers_busy(),
                                                     bound_s=bound)
        if not ok:
            return
        if why:
            log.error("%s", why)
        finished = job_control.finished(self.control, complete=True, now=now)
        if finished is not None:
            self.set_control(finished)

    def _writers_busy(self) -> bool:
        """Outer mode: a node of the checkpoint-writing group (the plan's first) is alive and its group has not reported
        its last step yet (other groups may finish first)."""
        plan = self.current_plan()
        if plan is None or plan.mode != "outer" or plan.outer is None or not plan.groups:
            return False
        first = plan.groups[0]
        alive = {n for n, m in self.store.members_view().items() if m.state == "alive"}
        if not alive & plan.group_nodes(0):
            return False
        last = self.last_step()
        return not any(s.step >= last and s.pipeline in first.pipelines and s.plan_epoch == plan.epoch
                       for s in self.store.recent_steps(64))

    def job_complete(self) -> bool:
        """The last step has been trained, as more than one node says (`claims.job_ended`; outer mode: a replica
        group's own last inner step, of its (train.steps // H) rounds): no more plans are made."""
        plan = self.current_plan()
        if job_ended(plan, self.reached_in(plan.epoch if plan is not None else 0), self.target_steps,
                     lambda: self.alive_members().keys()):
            return True
        # an earlier plan's nodes that trained to the end while this coordinator was away deliver their last
        # reports when it is back, one node after another: the first to have delivered leaves, and the plan made
        # around its departure must not hide the end the others' reports corroborate under the plan they ran
        with self._cond:
            earlier = [e for e in self._progress.epochs() if plan is None or e < plan.epoch]
        for epoch in earlier:
            old = self.plan_of(epoch)
            if old is not None and job_ended(old, self.reached_in(epoch), self.target_steps, lambda: ()):
                return True
        return False

    # --- the loop -------------------------------------------------------------------------------------

    def islands_now(self, alive: Mapping[str, MemberRecord], graph: LinkGraph | None = None,
                    speed: Mapping[str, float] | None = None) -> list[IslandInfo]:
        """Islands of `alive`, nodes that drifted from their profile apart (`speed`: each node's factor; default
        the ones the current plan was made with)."""
        if graph is None:  # (not `graph or ...`: a graph's length counts every pair)
            graph = LinkGraph(alive, self.store.links_view())
        islands = form_islands({n: m.profile for n, m in alive.items()}, graph, self.options.islands,
                               self.speed if speed is None else speed)
        return separate_unreachable(islands, alive)  # no data-parallel group has to dial a node behind NAT

    def membership_options(self, now: float) -> MembershipOptions:
        """The membership options with the lease that expiry uses at `now` (`HeartbeatCadence.expiry_lease`)."""
        lease = self.cadence.expiry_lease(now)
        base = self.options.membership
        return base if lease == base.lease.total_seconds() else replace(base, lease=timedelta(seconds=lease))

    def tick(self, now: float | None = None) -> list[str]:
        """One round of decisions at `now`; returns what changed, as readable lines."""
        now = self.clock() if now is None else now
        events: list[str] = []
        self.store.flush()
        membership = self.membership_options(now)
        stalled = self.stalled(membership.lease.total_seconds())
        for t in expire_leases(now, self.store.members_view().values(), self.started_unix, membership, stalled):
            self.store.set_member_state(t.node_id, t.state, t.reason)
            self.membership_changed(now)
            events.append(f"node {t.node_id} is {t.state}: {t.reason}")
        alive = self.alive_members()
        cadence = self.cadence.update(len(alive), now)
        if cadence is not None:
            events.append(f"{len(alive)} members: nodes heartbeat every {cadence.interval:.1f}s, lease "
                          f"{cadence.lease:.1f}s (heartbeat budget {self.options.heartbeat_budget:g}/s)")
        self._refresh_probe_index(alive, now)
        with self._cond:
            for outcome in self._machines.expire(now):
                log.info("machine probe: %s", outcome)
            dirty, self._islands_dirty = self._islands_dirty, False
            last_change = self._last_change
        formed = None  # (links, graph, islands) of this round, for a replan in it
        if dirty or self._islands_pending:
            started = time.monotonic()
            if started >= self._islands_next:
                links = self.store.links_view()
                graph = LinkGraph(alive, links)
                formed = (links, graph, self.islands_now(alive, graph))
                self.store.put_islands(formed[2])
                took = time.monotonic() - started
                # thousands of members take seconds to form islands of: while they keep joining and probing, the
                # islands (for the status) are formed again at most every ten times that; a replan forms them now
                self._islands_next = started + (10 * took if took > 0.2 else 0.0)
            self._islands_pending = formed is None
        plan = self.current_plan()
        planned = None if plan is None else {n for i in plan.islands for n in i.nodes}
        if self.job_complete():
            decision = PlanDecision(False, f"the job has completed its {self.target_steps} steps")
            if not self.control.finished_unix:  # (also after a restart between the last step and its checkpoint)
                self.note_trained(now)
        else:
            # a plan from before a restart is replaced once all its members have been heard from since, and
            # a plan naming a member's old peer address once that member is back at its new one
            stale = plan is not None and self._stale(plan) and planned is not None and planned <= {
                n for n, m in alive.items() if m.last_heartbeat_unix >= self.started_unix}
            moved = set() if plan is None else {
                n for n, addr in plan.node_addresses.items() if n in alive and plan_address(alive[n]) != addr}
            restarted = self.restarted() & alive.keys()
            # which members lack probes matters only while membership differs from the plan (O(links) to find)
            changed = planned is None or planned != alive.keys()
            unprobed = self.unprobed(alive, now, self._probe_index) if changed else set()
            decision = plan_decision(now, alive=set(alive), planned=planned, unprobed=unprobed,
                                     last_change_unix=last_change, cluster=self.job.cluster,
                                     options=membership, stale=stale, moved=moved, restarted=restarted,
                                     first_join_unix=min((m.joined_unix for n, m in alive.items()
                                                          if planned is not None and n not in planned),
                                                         default=None) if changed else None,
                                     returning=self._returning(alive, planned) if changed else frozenset())
            failures = self.failures()
            if not decision.plan and plan is not None and plan.epoch in failures:
                # every member alive, yet a run failed: only a new epoch (fresh groups, from the last
                # complete checkpoint) gets the job going again
                decision = failure_decision(
                    now, epoch=plan.epoch, failures=failures, alive=set(alive), planned=planned or set(),
                    last_heard={n: m.last_heartbeat_unix for n, m in alive.items()}, options=membership)
        if decision.plan and plan is not None and (hold := self._end_hold(plan, alive, now)):
            decision = PlanDecision(False, hold)
        if decision.plan:
            events.append(self._replan(alive, now, decision.reason, formed))
        else:
            # once per reason, not once per tick: a countdown in it ("settling for 0.3s more") changes every tick
            if _SECONDS.sub("", decision.reason) != _SECONDS.sub("", self._last_reason):
                log.info("not planning: %s", decision.reason)
            if plan is not None and planned == alive.keys() and not self.job_complete() and now >= self._drift_next:
                # drift first: a node whose compute slowed also slows its transfers, and a network fit would read
                # that as the network; the network check leaves out such nodes' links (and runs on its own backoff)
                events.extend(self._drift_check(plan, alive, now)
                              or (self._network_check(plan, alive, now) if now >= self._network_next else []))
        self._last_reason = decision.reason
        for e in events:
            log.info("%s", e)
        return events

    def _end_hold(self, plan: Plan, alive: Mapping[str, MemberRecord], now: float) -> str:
        """Why a replan waits ("": it does not): a node of `plan` trained the job's last step and left, so the
        others are at the end too and deliver their last reports (after a coordinator outage, one node after
        another); a plan made around the departure would stop them short of the end the reports are about to
        corroborate. Bounded by `END_HOLD_S` from the first such departure: a node that died at the end instead
        is planned around then."""
        gone = finished_nodes(plan, self.reached_in(plan.epoch), self.target_steps) - alive.keys()
        if not gone:
            self._end_hold_since = None
            return ""
        if self._end_hold_since is None:
            self._end_hold_since = now
        if now - self._end_hold_since > END_HOLD_S:
            return ""
        return (f"{', '.join(sorted(gone))} trained the job's last step and left; waiting up to "
                f"{END_HOLD_S - (now - self._end_hold_since):.0f}s for the other nodes' last reports")

    def _replan(self, alive: dict[str, MemberRecord], now: float, reason: str,
                formed: tuple[list[LinkMeasurement], LinkGraph, list[IslandInfo]] | None = None) -> str:
        inputs = self._plan_inputs(alive, now, formed)
        plan, how = self.planner(inputs)
        return self._adopt(plan, how, inputs, reason)

    def _adopt(self, plan: Plan, how: str, inputs: PlanInputs, reason: str) -> str:
        self.publish(plan, reason)
        speed = inputs.speed
        if speed != self.speed:  # (a row per node: written only when a run moved them)
            self.store.put_speed(speed)
        self.speed = speed
        stages = ", ".join(f"{s.island}[{s.layers[0]}, {s.layers[1]})x{s.dp}" + (f" tp{s.tp}" if s.tp > 1 else "")
                           + (f" in {s.lanes} lanes" if s.lanes > 1 else "")
                           for p in plan.pipelines for s in p.stages)
        mode = f"; outer mode, {len(plan.groups)} replica groups" if plan.mode == "outer" else ""
        why = f"; {plan.mode_reason}" if plan.mode_reason else ""
        return (f"plan epoch {plan.epoch} ({reason}; {how}{mode}): {stages}{why}"
                f"{calibration_note(speed, inputs.members)}")

    def _reached(self) -> int:
        """Steps the job has trained: the newest step reported under the newest plan epoch that reported, + 1 (a
        report an outage held back arrives late; one of an older epoch may be of steps rolled back since)."""
        recent = self.store.recent_steps(256)
        if not recent:
            return 0
        epoch = max(m.plan_epoch for m in recent)
        return max(m.step for m in recent if m.plan_epoch == epoch) + 1

    def _drift_check(self, plan: Plan, alive: dict[str, MemberRecord], now: float) -> list[str]:
        """Replan when the running plan's devices have drifted from their planned speed and the plan the planner
        makes now is worth the switch (`atoll.coordinator.drift`); at most once every `DriftOptions.interval`,
        and after each check that ran the planner for nothing twice as long as before (up to `DRIFT_BACKOFF_MAX`
        intervals: a drift no plan can help does not cost a planner run a minute on a large cluster)."""
        opts = self.options.drift
        self._drift_next = now + opts.interval.total_seconds() * self._drift_backoff
        outer = plan.mode == "outer" and plan.outer is not None and bool(plan.groups)
        if not opts.enabled or (plan.mode != "sync" and not outer) or plan.predicted.step_time_s <= 0:
            return []
        steps = self._reports_of(plan, max(CALIBRATION_REPORTS_PER_NODE, 2 * opts.min_steps + 2))
        off = drifted(speed_changes(epoch_compute(plan, steps), opts.min_steps), opts.threshold)
        if not off:
            return []
        # outer mode: the replica groups of the nodes that slowed are planned afresh from their recent speeds (their
        # nodes' factors; the others' predictions stand) and every other group runs on as it is (`kept_groups`). A
        # node that became faster holds no round back, and a group planned afresh may start the round it was in again
        # (where the others have moved on to the next), so a speed-up counts only where the node had been
        # planned slower than its profile (it recovered: its group can train more inner steps a round again)
        if outer:
            slowed = {n for n, f in off.items() if f > 1.0 or self.speed.get(n, 1.0) > 1.0}
            groups = [plan.group_nodes(g) for g in range(len(plan.groups))]
            replan = frozenset(n for g in groups if not g.isdisjoint(slowed) for n in g)
            if not replan:
                return []
        else:
            replan = frozenset()
        factors = speed_factors(plan, steps, min_steps=opts.min_steps, recent=opts.min_steps,
                                nodes=replan if outer else None)
        at = max((m.step for m in steps if m.plan_epoch == plan.epoch), default=plan.resume_step)
        inputs = self._plan_inputs(alive, now, speed=compound(self.speed, factors))  # calibrated from the recent steps
        if outer:
            inputs = replace(inputs, replan=replan)
        new, how = self.planner(inputs)
        if outer and (same := unchanged_groups(plan, new, replan)):
            # the group would run as it runs: planned afresh it would only start its round again (a rollback of the
            # steps it trained in it), where its inner steps a round already follow its live pace
            log.info("drift: %s; not replanning: replica group(s) %s would run as they do; their inner steps a round "
                     "follow their live pace", describe(off), ", ".join(same))
            self._drift_backoff = min(2 * self._drift_backoff, DRIFT_BACKOFF_MAX)
            self._drift_next = now + opts.interval.total_seconds() * self._drift_backoff
            return []
        # compared per global batch of tokens: a synchronous step, or an outer-mode plan's tokens/s over its groups
        tokens = plan.global_batch * plan.seq_len
        current_rate, new_rate = estimated_rate(plan, factors), estimated_rate(new, {})
        verdict = switch_verdict(current_s=tokens / current_rate if current_rate > 0 else 0.0,
                                 new_s=tokens / new_rate if new_rate > 0 else 0.0,
                                 steps_left=max(0, self.target_steps - at - 1),
                                 switch_s=switch_seconds([(h.plan.epoch, h.created_unix)
                                                          for h in self.store.plan_history()[-4:]], steps),
                                 min_gain=opts.min_gain,
                                 per="a global batch over the replica groups" if outer else "a step")
        if not verdict.go:
            log.info("drift: %s; not replanning: %s", describe(off), verdict.why)
            self._drift_backoff = min(2 * self._drift_backoff, DRIFT_BACKOFF_MAX)
            self._drift_next = now + opts.interval.total_seconds() * self._drift_backoff
            return []
        self._drift_backoff = 1
        return [self._adopt(new, how, inputs, f"drift: {describe(off)}; {verdict.why}")]

    def _network_check(self, plan: Plan, alive: dict[str, MemberRecord], now: float) -> list[str]:
        """Fit the network model to the running plan's step reports (`atoll.coordinator.netfit`) and replan under
        the fit when it moved from the model the plan was made under and the plan it gives is worth it
        (`netfit.replan_verdict`); the fit is kept for the status either way."""
        opts = self.options.calibration
        if not opts.enabled or plan.mode != "sync" or plan.predicted.step_time_s <= 0:
            return []
        steps = [m for m in self._reports_of(plan, CALIBRATION_REPORTS_PER_NODE) if m.plan_epoch == plan.epoch]
        # a node whose compute moved from its plan (a CPU quota cut, a throttled GPU) also moves and receives on the
        # starved host: its transfers and its peers' waits on it read as a slow network. Its links say nothing about
        # the network, and the drift check (run first) is the one to plan around it; so do those of a node whose
        # newest steps began to move before the drift check has a window of them (`unsettled`)
        compute = epoch_compute(plan, self._reports_of(
            plan, max(CALIBRATION_REPORTS_PER_NODE, 2 * self.options.drift.min_steps + 2)))
        window, threshold = self.options.drift.min_steps, self.options.drift.threshold
        if any(len(compute.get(n, ())) < window + UNSETTLED_STEPS for n in predicted_compute(plan)):
            # too early in the epoch to tell a node's compute moving from its network (`unsettled` needs these
            # steps): a fit of the first steps read CPU nodes' starved transfers under load as a 29x slower network
            return []
        starved = set(drifted(speed_changes(compute, window), threshold)) | unsettled(compute, window, threshold)
        link_of = {(x.src, x.dst): (x.bandwidth_bytes_per_s, x.rtt_seconds / 2)
                   for x in self.store.links_view() if x.bandwidth_bytes_per_s > 0
                   and x.src not in starved and x.dst not in starved}
        steps = [m for m in steps if m.node_id not in starved]
        group_of = {n: list(st.nodes) for p in plan.pipelines for st in p.stages for n in st.nodes}
        from atoll.coordinator.planner.options import PlannerOptions

        samples = samples_from_steps(steps, link_of, group_of, PlannerOptions().link_efficiency, self.network)
        fit = fit_network(samples, self.network, min_samples=opts.min_samples)
        self.network_fit = fit
        typical = {k: f.measured_s for k, f in fit.kinds.items()}
        if model_change(fit.model, self.network, typical) <= opts.change:
            return []
        inputs = replace(self._plan_inputs(alive, now), network=fit.model)
        new, how = self.planner(inputs)
        verdict = replan_verdict(fitted=fit.model, planned=self.network, running_s=plan_step_under(
            plan, self.network, fit.model), best_s=new.predicted.step_time_s, options=opts, typical_s=typical)
        # each fit that replanned, or ran the planner for nothing, waits twice as long for the next (up to
        # `DRIFT_BACKOFF_MAX` intervals): a fit that moves again right after its replan is unsettled (the new plan
        # moves other bytes over other links), and chasing it would leave no plan long enough to be measured
        self._network_backoff = min(2 * self._network_backoff, DRIFT_BACKOFF_MAX)
        self._network_next = now + self.options.drift.interval.total_seconds() * self._network_backoff
        if not verdict.go:
            log.info("network fit: not replanning: %s", verdict.why)
            return []
        self.network = fit.model
        self._drift_next = now + self.options.drift.interval.total_seconds()
        return [self._adopt(new, how, inputs, f"network fit: {verdict.why}")]

    def network_fit_lines(self) -> list[str]:
        """The status's lines of the newest network fit: per kind, predicted against measured."""
        if self.network_fit is None:
            return []
        return [f"planned under {self.network.describe()}"] + describe_fit(self.network_fit)

    def _plan_inputs(self, alive: dict[str, MemberRecord], now: float,
                     formed: tuple[list[LinkMeasurement], LinkGraph, list[IslandInfo]] | None = None,
                     speed: dict[str, float] | None = None) -> PlanInputs:
        """What the planner is given for a plan of `alive` at `now` (islands formed now unless `formed`, or unless
        the runs moved a node's speed factor across an island's bounds); `speed`: the nodes' factors when the
        caller has calibrated them already, else `_calibrated`'s."""
        previous = self.current_plan()
        speed = self._calibrated(previous) if speed is None else speed
        if formed is not None and any(speed_class(speed.get(n, 1.0), self.options.islands.speed_split)
                                      != speed_class(self.speed.get(n, 1.0), self.options.islands.speed_split)
                                      for n in alive):
            formed = None  # a node drifted into another class: its island changes
        if formed is None:
            started = time.monotonic()
            links = self.store.links_view()
            matrix = LinkGraph(alive, links)
            islands = self.islands_now(alive, matrix, speed)
            self.store.put_islands(islands)
            # what this tick left pending is formed now: not again (for the status) once its wait is over, unless
            # probes arrive meanwhile (at 10,000 members forming them holds the server's loop back for seconds)
            took = time.monotonic() - started
            self._islands_pending = False
            self._islands_next = started + (10 * took if took > 0.2 else 0.0)
        else:  # formed this round from the same members (thousands of them take seconds to form again)
            links, matrix, islands = formed
        failed = {f.node_id for f in self.failures().values() if previous is not None and f.epoch == previous.epoch}
        failed |= self.restarted()  # (outer mode: a restarted node's replica group is planned afresh, not kept)
        records = self.store.list_checkpoints()
        resume = resume_step(records, {h.plan.epoch: h.plan for h in self.store.plan_history()}, set(alive))
        inputs = PlanInputs(job=self.job, members=alive, islands=islands, matrix=matrix, links=links, speed=speed,
                            epoch=self.store.latest_epoch() + 1, resume_step=resume, reached_step=self._reached(),
                            live_resume=previous is None or live_resume(previous.epoch, self.failures()),
                            rendezvous=self.rendezvous,
                            previous=previous if previous is not None and not self._stale(previous) else None,
                            failed=frozenset(failed),
                            checkpoint_copies=copies_of(records, resume, {n: m.peer_address for n, m in alive.items()
                                                                         if m.peer_address}),
                            handover=handing_over(previous, self.store.members_view().values(), now),
                            machine_flows=self._machines.per_flow(), live_step_s=self.outer.live_step_times(now),
                            network=self.network)
        return inputs

    def _calibrated(self, previous: Plan | None) -> dict[str, float]:
        """Each node's speed factor for the next plan: the one the previous plan was made with, times what the
        runs of that plan measured against its prediction (`calibration.speed_factors`)."""
        if previous is None:
            return dict(self.speed)
        return compound(self.speed, speed_factors(previous, self._reports_of(previous, CALIBRATION_REPORTS_PER_NODE)))

    def _reports_of(self, plan: Plan, per_node: int) -> list[StepMetrics]:
        """The newest step reports, oldest first, reaching back until each node of `plan` has `per_node` of its
        epoch among them, or to the epoch's start, or to the most kept (`CALIBRATION_REPORTS_MAX`, the store's
        `recent_steps_kept`). Not a fixed count over all nodes: nodes report as fast as they step, so a node that
        slowed down (outer mode: its replica group falling behind the others') would have the fewest reports in
        such a window just when its speed matters, and too few to be judged at all."""
        nodes = {n for p in plan.pipelines for st in p.stages for n in st.nodes}
        most = min(CALIBRATION_REPORTS_MAX, self.store.recent_steps_kept)
        limit = min(per_node * len(nodes), most)
        while True:
            steps = self.store.recent_steps(limit)
            counts = Counter(m.node_id for m in steps if m.plan_epoch == plan.epoch)
            if (len(steps) < limit or limit >= most or any(m.plan_epoch < plan.epoch for m in steps)
                    or all(counts[n] >= per_node for n in nodes)):
                return steps
            limit = min(2 * limit, most)


REACHED_EPOCHS = 8
END_HOLD_S = 60.0
"""How long replans wait after a node of the plan left having trained the job's last step (`_end_hold`): the
others deliver their last reports within it (they retry every few seconds once the coordinator is reachable)."""
"""Plan epochs whose nodes' newest steps are kept in memory (`CoordinatorState.record_step`), and old plans cached."""
DRIFT_BACKOFF_MAX = 16
"""A drift that no plan helps is checked again after at most this many `DriftOptions.interval`s."""
CALIBRATION_REPORTS_PER_NODE = 24
"""Step reports read per node of the previous plan to calibrate its devices' speed when planning again."""
CALIBRATION_REPORTS_MAX = 20_000
"""At most this many (a very large job calibrates the nodes whose reports are among the newest)."""


@dataclass(frozen=True)
class _ProbeIndex:
    """Alive members by device class and by machine, for drawing probe peers in O(1): rebuilt by each `tick`."""

    class_of: dict[str, str]
    by_class: dict[str, list[str]]
    everyone: list[str]
    machine_of: dict[str, str] = field(default_factory=dict)
    by_machine: dict[str, list[str]] = field(default_factory=dict)
    machines: list[str] = field(default_factory=list)
    machine_index: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, alive: Mapping[str, MemberRecord]) -> _ProbeIndex:
        index = cls({}, {}, [])
        for n, m in alive.items():
            index.add(n, device_class(m.profile), machine_of(n, m.profile))
        return index

    def add(self, node_id: str, cls: str, machine: str) -> None:
        """A member that joined after the index was built (one that left stays listed until the next build)."""
        if node_id not in self.class_of:
            self.class_of[node_id] = cls
            self.by_class.setdefault(cls, []).append(node_id)
            self.everyone.append(node_id)
            self.machine_of[node_id] = machine
            if machine not in self.by_machine:
                self.machine_index[machine] = len(self.machines)
                self.machines.append(machine)
            self.by_machine.setdefault(machine, []).append(node_id)

    def machines_after(self, machine: str) -> Iterator[str]:
        """The other machines, from the one after `machine` round to the one before it (lazily: O(1) a step)."""
        i, n = self.machine_index[machine], len(self.machines)
        return (self.machines[(i + j) % n] for j in range(1, n))


# --- an operator's pinned plan -----------------------------------------------------------------------


def load_pinned_plan(path: Path, job: JobSpec) -> Plan:
    """The plan in `path` (JSON, as `atoll plan --json` writes it), checked against `job`: the model's layers,
    the global batch and sequence length, and every stage naming its nodes (dp x tp node ids, no node twice,
    at least one row of each micro-batch per replica). Raises ValueError saying what to change."""
    try:
        plan = Plan.from_json(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read the plan file {path}: {e}") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a plan (the JSON `atoll plan --json` writes): {type(e).__name__}: {e}") from None
    try:
        plan.validate(job.model_spec.num_layers)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if (plan.global_batch, plan.seq_len) != (job.train.global_batch, job.train.seq_len):
        raise ValueError(f"{path} plans a global batch of {plan.global_batch} x {plan.seq_len} tokens; the job trains "
                         f"{job.train.global_batch} x {job.train.seq_len} (train.global_batch, train.seq_len)")
    groups = [g.pipelines for g in plan.groups] if plan.mode == "outer" else [range(len(plan.pipelines))]
    for pipelines in groups:
        rows = sum(plan.pipelines[p].micro_batch * plan.pipelines[p].num_micro_batches for p in pipelines)
        if rows != plan.global_batch:
            raise ValueError(f"{path}: pipelines {list(pipelines)} train {rows} sequences per step (micro_batch x "
                             f"num_micro_batches summed); the global batch is {plan.global_batch}")
    seen: set[str] = set()
    for p, pipe in enumerate(plan.pipelines):
        for k, st in enumerate(pipe.stages):
            where = f"{path}: pipeline {p} stage {k}"
            if st.dp < 1 or st.tp < 1:
                raise ValueError(f"{where} has dp = {st.dp} and tp = {st.tp}; both must be at least 1")
            if len(st.nodes) != st.dp * st.tp:
                raise ValueError(f"{where} lists {len(st.nodes)} node ids; with dp = {st.dp} and tp = {st.tp} it needs "
                                 f"{st.dp * st.tp} (a pinned plan names every stage's nodes: their `atoll node` ids)")
            if st.dp // st.lanes > pipe.micro_batch:
                raise ValueError(f"{where}: {st.dp // st.lanes} replicas (per lane) cannot share a micro-batch of "
                                 f"{pipe.micro_batch} sequences; give the stage lanes (micro-batch i to lane i % lanes)")
            if seen & set(st.nodes) or len(set(st.nodes)) != len(st.nodes):
                raise ValueError(f"{where} lists a node that runs another stage too; a node runs one stage")
            seen.update(st.nodes)
    return plan


def pinned_planner(pinned: Plan, otherwise: Planner = make_plan) -> Planner:
    """A `Planner` that publishes `pinned`, with this epoch's number, job id, resume step, islands, peer
    addresses and rendezvous filled in (`finish_plan`), while every node it names is an alive member;
    otherwise it plans with `otherwise` and its reason says which pinned nodes are missing."""
    named = {n for pipe in pinned.pipelines for st in pipe.stages for n in st.nodes}

    def plan(inputs: PlanInputs) -> tuple[Plan, str]:
        missing = sorted(named - set(inputs.members))
        if missing:
            log.warning("the pinned plan names nodes that are not alive members (%s); planning instead",
                        ", ".join(missing))
            made, how = otherwise(inputs)
            return made, f"{how}; not the pinned plan: {', '.join(missing)} not alive"
        made = Plan.from_json_dict(pinned.to_json_dict())  # a copy per epoch
        made.node_addresses, made.islands = {}, list(inputs.islands)
        island_of = {n: i.id for i in inputs.islands for n in i.nodes}
        for pipe in made.pipelines:
            for st in pipe.stages:
                st.island = island_of.get(st.nodes[0], st.island)
        for g in made.groups:
            g.since_epoch = 0
        made = finish_plan(made, inputs)
        made.validate(inputs.job.model_spec.num_layers)
        return made, "the pinned plan (--plan)"
    return plan
