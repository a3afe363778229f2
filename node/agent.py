"""The node agent: fetch the job spec, profile, start the peer server, join, then keep three loops going:

- heartbeats (renew the lease, report the epoch and step, receive probe requests),
- probes (measure the links the coordinator asks for and report them),
- the plan watch (a WatchPlan stream, reconnected with backoff),
- the outbox (checkpoint and failure reports, kept and retried with backoff through a coordinator outage),

while `run(on_plan=...)` hands each new plan to a callback on the calling thread. A coordinator that
restarts on its state dir still knows the node, so heartbeats simply resume; one that answers NOT_FOUND
(it lost the node, or marked it gone) gets a fresh join under the same stable id.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import secrets
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import grpc

from atoll.job import TOKEN_ENV, JobSpec, resolve_token
from atoll.node.credentials import NodeCredentials
from atoll.node.identity import StateDirLock, load_or_create_node_id
from atoll.netcheck import diagnose
from atoll.node.first_contact import FirstContactWatch
from atoll.node.heartbeat_stream import HeartbeatSender
from atoll.node.peer import PeerServer, ProbeError, probe_peer
from atoll.node.profiler import (PROFILE_CACHE, ProfileOptions, cached_profile, profile_key, profile_node,
                                 save_profile)
from atoll.node.signals import handle_on_thread, stuck_main_thread
from atoll.plan import Plan, resume_words
from atoll.fsutil import shown_path
from atoll.preflight import check_dial_address, check_listen, usable_state_dir
from atoll.rpc import RpcOptions, make_channel, retry_after
from atoll.tls import CertificateError, cert_from_pem, find_ca, fingerprint
from atoll.serde import (link_to_proto, plan_from_packed, plan_from_proto, profile_to_proto,
                         step_metrics_to_proto)
from atoll.types import LinkMeasurement, NodeProfile, StepMetrics
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc

log = logging.getLogger("atoll.node")

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL)
_REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNIMPLEMENTED,
            grpc.StatusCode.OUT_OF_RANGE)
"""Answers that a report will never be accepted: the outbox logs and drops it. Any other is retried."""
MAX_FAILURE_REASON = 1000
"""Longest failure reason sent; the coordinator refuses longer ones."""
STEP_BACKLOG = 4096
"""Step reports kept while the coordinator is away; beyond it the oldest are dropped (and the node says so)."""
FINISHED_GRACE = timedelta(minutes=2)
"""How long after the job finished a node running a stage may take to end its run (its last checkpoint) before
it is stopped anyway."""
LEAVE_RETRY = timedelta(seconds=15)
"""How long a node stopped while its coordinator is away retries its Leave (`NodeAgent._send_leave`)."""
STUCK_AFTER_STOP = timedelta(seconds=30)
"""How long the main thread of a stopped node (`atoll node`) may stay inside a blocking call before the process
exits without it (`run_node_cli`)."""


def step_wait_timeout(step_seconds: Sequence[float], default: timedelta, *,
                      floor: timedelta = timedelta(seconds=10), factor: float = 10.0) -> timedelta:
    """The bound of each wait on a neighbour, a collective or the rendezvous in the next plan.

    `default` until a step has been measured; then `factor` x the median measured step time, at least
    `floor`, so a stalled neighbour is noticed in a few step times rather than after a fixed two minutes,
    and a slow model still gets waits long enough for its steps.
    """
    if not step_seconds:
        return default
    return max(floor, timedelta(seconds=factor * statistics.median(step_seconds)))


class AgentError(RuntimeError):
    """The coordinator refused the node for good (wrong token, another job, invalid profile)."""


class JobFinished(Exception):
    """The job this node was started for has finished already (a node started after its end)."""


class AgentStopped(Exception):
    """`stop()` was called while the agent was still starting or re-joining."""


MACHINE_PROBE_MAX_WAIT_S = 120.0
"""The longest a node waits for a machine probe's start (a later one is a clock gone wrong: it is skipped)."""


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """How a node reaches its coordinator and serves its peers."""

    coordinator: str
    """HOST:PORT of the coordinator."""
    token: str
    """The job token."""
    state_dir: Path
    """Folder that keeps the node's stable id."""
    device: str = "cpu"
    """cpu, cuda or cuda:N."""
    listen: str | None = "127.0.0.1:0"
    """HOST:PORT of the peer server (port 0 picks one); None: accept no connections (`--no-listen`, a node
    behind NAT: it opens the streams to its neighbours itself, `atoll.node.reverse`)."""
    advertise: str | None = None
    """HOST:PORT peers dial; None: the listen address, a wildcard host replaced by this machine's hostname."""
    rpc: RpcOptions = field(default_factory=RpcOptions)
    """Message limits, keepalive and TLS of the channel to the coordinator."""
    peer_rpc: RpcOptions = field(default_factory=RpcOptions)
    """Message limits, keepalive and TLS of the peer server and of probes to other nodes' peer servers."""
    call_timeout: timedelta = timedelta(seconds=10)
    """Deadline of each unary call to the coordinator."""
    connect_timeout: timedelta = timedelta(minutes=2)
    """How long to keep retrying the first contact (and each re-join) before giving up."""
    watch_timeout: timedelta = timedelta(minutes=5)
    """Deadline of one WatchPlan stream; it is reopened when it ends."""
    backoff: tuple[timedelta, timedelta] = (timedelta(milliseconds=200), timedelta(seconds=5))
    """First and largest wait between retries; each retry doubles the wait. Once joined, the largest is also at
    most one heartbeat interval (a quarter of the coordinator's lease), so every call is retried several times
    within a lease and a coordinator that comes back is found within an interval."""
    probe_timeout: timedelta = timedelta(seconds=20)
    """Bound of one link probe."""
    profile: ProfileOptions = field(default_factory=ProfileOptions)
    """How long the start-up profile measures."""
    reprofile: bool = True
    """Measure at start-up even where the state dir holds a matching profile (`atoll.node.profiler.cached_profile`);
    the command line reuses one unless `--reprofile` is given."""
    region: str = ""
    """Site label (a lab, a datacenter, a cloud region): islands never span two."""
    machine: str = ""
    """The machine this node runs on, in place of its hostname in the profile ("": the hostname)."""
    wan_latency: timedelta = timedelta(0)
    """Testbeds only: one-way latency added to each tensor sent to a peer of another region
    (`atoll.node.wan.wan_delay`); zero: off."""
    tls_ca: bytes | None = None
    """The job CA (PEM) the coordinator is verified with: every channel is then mutual TLS, under the certificate
    the join brings (`atoll.node.credentials`). None: plaintext, for a coordinator that runs --insecure."""

    checkpoint_dir: Path | None = None
    """Where the node writes its checkpoints: claimed for the job at the start (`claim_checkpoint_dir`), so that a
    folder holding another job's checkpoints is refused before they are overwritten. None: not checked here."""
    handover: timedelta = timedelta(seconds=30)
    """A graceful leave serves this node's live state until the next plan's nodes took it, at most this long."""
    final_reports: timedelta = timedelta(minutes=2)
    """How long a node whose job is done waits for the coordinator to take its last reports (the job's last steps
    and checkpoints) before it exits: a job that ends while the coordinator is away is recorded complete once it
    is back. A stop for any other reason (a signal) waits 5 s."""

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("the node needs the job token: --token, --token-file or ATOLL_TOKEN")
        for name in ("call_timeout", "connect_timeout", "watch_timeout", "probe_timeout", "final_reports"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive")
        if self.wan_latency < timedelta(0):
            raise ValueError(f"wan_latency must be >= 0 (--wan-latency-ms), got {self.wan_latency}")
        if not timedelta(0) < self.backoff[0] <= self.backoff[1]:
            raise ValueError(f"backoff must be (first, largest) with 0 < first <= largest, got {self.backoff}")


@dataclass
class PlanRun:
    """What a plan callback gets: the plan, the job, this node, and ways to report back."""

    plan: Plan
    job: JobSpec
    node_id: str
    peer: PeerServer
    """The node's peer server: a stage attaches its receiver here."""
    superseded: threading.Event
    """Set when a newer plan arrives (or the agent stops): the callback should wind down and return."""
    agent: NodeAgent
    latest: Plan | None = None
    """The newest plan adopted without a restart (outer mode: a replan that keeps this node's replica
    group as it runs); None: `plan`."""

    @property
    def current(self) -> Plan:
        return self.latest or self.plan

    def outer_sync(self, request: pb.OuterSyncRequest) -> pb.OuterSyncReply:
        """One OuterSync call (the outer-sync thread retries on UNAVAILABLE); its deadline covers the hold it asks
        for (`hold_seconds`, a long poll)."""
        return self.agent.call("OuterSync", request, timeout=self.agent.config.call_timeout
                               + timedelta(seconds=min(request.hold_seconds, 5.0)))

    def report_step(self, metrics: StepMetrics) -> pb.StepAck:
        """Send step metrics now (the caller runs it off the step's path); see `NodeAgent.report_step`."""
        self.agent.set_progress(metrics.plan_epoch, metrics.step)
        self.agent.record_step_seconds(metrics.step_seconds)
        return self.agent.report_step(metrics)

    def report_checkpoint(self, report: pb.CheckpointReport, on_delivered: Callable[[], None] | None = None) -> None:
        """Queue a checkpoint report; the agent delivers it, retrying until the coordinator takes it, the
        plan is superseded or the coordinator refuses it for good. `on_delivered` runs once it is taken."""
        what = f"checkpoint of step {report.step}" + (f" (this node's copy of {report.copy_of}'s)" if report.copy_of
                                                       else "")
        self.agent.send_later("ReportCheckpoint", report, epoch=self.current.epoch, what=what,
                              on_delivered=on_delivered)

    def report_failure(self, *, step: int, reason: str, lost_checkpoint_step: int = 0) -> None:
        """Queue a report that this node's run of the plan failed at `step`, so the coordinator replans
        (`lost_checkpoint_step`: this node's files of that checkpoint are missing or unreadable)."""
        self.agent.send_later("ReportFailure", pb.RunFailure(
            job_id=self.plan.job_id, node_id=self.node_id, plan_epoch=self.current.epoch, step=step,
            reason=reason[:MAX_FAILURE_REASON], lost_checkpoint_step=lost_checkpoint_step), epoch=self.current.epoch,
            what=f"failure of plan epoch {self.current.epoch}")

    def wait_timeout(self, default: timedelta) -> timedelta:
        """The bound of each wait in this plan: `step_wait_timeout` of the step times this node measured."""
        return step_wait_timeout(self.agent.step_seconds(), default)


OnPlan = Callable[[PlanRun], None]


@dataclass
class _Outgoing:
    """A report waiting in the outbox."""

    method: str
    request: object
    epoch: int
    """Plan epoch it belongs to: dropped once a newer plan has arrived."""
    what: str
    on_delivered: Callable[[], None] | None = None


def _rendezvous_shown(address: str, coordinator_host: str) -> str:
    """`tcp://:PORT` (every interface: the host the nodes dial the coordinator at) with that host filled in."""
    if address.startswith("tcp://:"):
        return f"tcp://{coordinator_host or '<the coordinator host>'}:{address[len('tcp://:'):]}"
    return address


def describe_plan(plan: Plan, node_id: str, coordinator_host: str = "") -> str:
    """A readable account of a plan, with this node's place in it. A rendezvous address without a host (a
    coordinator listening on every interface) is shown at `coordinator_host`, where the node dials it."""
    mode = f", outer mode: {len(plan.groups)} replica groups" if plan.mode == "outer" else ""
    lines = [f"plan epoch {plan.epoch} for job {plan.job_id}: {len(plan.pipelines)} pipeline(s){mode}, global batch "
             f"{plan.global_batch}, seq {plan.seq_len}, {resume_words(plan.resume_step, plan.reached_step, plan.live_resume)}"]
    if plan.mode_reason:
        lines.append(f"  {plan.mode_reason}")
    group_of = {k: g.name for g in plan.groups for k in g.pipelines} if plan.mode == "outer" else {}
    mine = "this node is idle in this plan"
    for p_index, pipeline in enumerate(plan.pipelines):
        lines.append(f"  pipeline {p_index}: micro-batch {pipeline.micro_batch} x {pipeline.num_micro_batches}")
        for s_index, stage in enumerate(pipeline.stages):
            send = f", sends {stage.send.codec}" if stage.send else ""
            lines.append(f"    stage {s_index}: island {stage.island}, layers [{stage.layers[0]}, {stage.layers[1]}), "
                         f"dp {stage.dp}" + (f" in {stage.lanes} lanes" if stage.lanes > 1 else "")
                         + (f" x tp {stage.tp}" if stage.tp > 1 else "")
                         + f" on {', '.join(stage.nodes)}{send}"
                         + (f"; rendezvous {_rendezvous_shown(stage.dp_rendezvous, coordinator_host)}"
                            if stage.dp_rendezvous else ""))
            if node_id in stage.nodes:
                index = stage.nodes.index(node_id)
                place = (f"as replica {index // stage.tp} of {stage.dp}, tp rank {index % stage.tp} of {stage.tp}"
                         if stage.tp > 1 else f"as rank {index} of {stage.dp}")
                mine = (f"this node runs pipeline {p_index} stage {s_index} (layers [{stage.layers[0]}, "
                        f"{stage.layers[1]})) {place}"
                        + (f", in replica group {group_of[p_index]}" if p_index in group_of else ""))
    lines.append(f"  {mine}")
    return "\n".join(lines)


WAITING_LINE_EVERY_S = 30.0
"""While a node has no plan to run, it says so this often."""


class NodeAgent:
    """One node of a job. `run()` blocks until `stop()`; see the module docstring for what it does."""

    def __init__(self, config: AgentConfig, *, profile: NodeProfile | None = None):
        self.config = config
        self._given_profile = profile
        # one live process per state dir (and so per node id); held until stop()
        self._state_lock = StateDirLock(config.state_dir)
        try:
            self.node_id = load_or_create_node_id(config.state_dir)
            self.credentials = (NodeCredentials(config.state_dir, node_id=self.node_id, token=config.token,
                                                coordinator_ca_pem=config.tls_ca) if config.tls_ca else None)
        except BaseException:
            self._state_lock.release()
            raise
        self.peer_rpc = config.peer_rpc if self.credentials is None else self.credentials.peer_rpc(config.peer_rpc)
        """Options of the peer server and of every channel to a peer (mutual TLS under the job CA when set)."""
        self._channel = make_channel(config.coordinator, self._coordinator_rpc(), token=config.token)
        self._old_channels: list[grpc.Channel] = []
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._heartbeats = HeartbeatSender(
            lambda requests, life: self._stub.HeartbeatStream(requests, timeout=life),
            lambda req, seconds: self.call("Heartbeat", req, timeout=timedelta(seconds=seconds)))
        """Heartbeats on one stream to the coordinator (unary calls where it has none)."""
        self._stop = threading.Event()
        self._leaving = threading.Event()
        """Set by a graceful stop (`stop(leave=True)`) before its Leave goes out."""
        self._draining = threading.Event()
        """Set by a graceful stop: the run finishes the step in flight (with its stage's other nodes) and trains no
        more; `_stop` then ends it, also where that step does not finish in time."""
        self._leave_answered = threading.Event()
        self._left = False
        """The coordinator took this node's Leave: its next plan hands this node's live state over."""
        self._cond = threading.Condition()
        self._join_lock = threading.Lock()
        self._probes: queue.Queue[pb.ProbeTarget] = queue.Queue()
        self._queued: set[str] = set()
        self._clock_offset = 0.0
        """The coordinator's clock less this node's, as the last heartbeat reply showed it (machine probes)."""
        self._threads: list[threading.Thread] = []
        self.job: JobSpec | None = None
        self.profile: NodeProfile | None = None
        self.peer: PeerServer | None = None
        self.heartbeat_interval = 1.0
        self.plan: Plan | None = None
        self.plan_serial = 0
        """Counts the plans accepted; a plan callback runs once per serial."""
        self._after_rejoin = False
        self.run_id = ""
        """The coordinator's run of the job (`JobInfo.run_id`), known once the job is fetched."""
        self._away_since: float | None = None
        """When (time.monotonic) the heartbeats stopped getting through; None while they do."""
        self.session = secrets.token_hex(8)
        """This process's session (`JoinRequest.session`): the same on each of its joins, another after a restart."""
        self.epoch = 0
        self.step = 0
        self.joins = 0
        self._stream: grpc.Future | None = None
        self._watch_wake = threading.Event()  # set when the coordinator is reachable again, and on stop
        self._packed_plans = True
        """Watch with WatchPlanPacked; False once the coordinator said it has none."""
        self._outbox: deque[_Outgoing] = deque()
        self._step_backlog: deque[_Outgoing] = deque(maxlen=STEP_BACKLOG)
        """Step reports that met an outage; the outbox sends them after its other reports."""
        self._dropped_steps = 0
        """Step reports the full backlog dropped (`_backlog_step`)."""
        self._refused_steps = 0
        self._outbox_cond = threading.Condition()
        self._step_seconds: deque[float] = deque(maxlen=64)
        self.error: Exception | None = None
        self.write_checkpoints = False
        """The coordinator asks this node to write its stage's checkpoints too (their writer cannot: a full disk)."""
        self.job_finished = threading.Event()
        self.quarantined = False
        """The coordinator quarantined this node (repeated offences, `atoll.coordinator.quarantine`): it is in no
        plan and waits until an operator releases it."""
        """Set once a heartbeat says the job has trained its last step."""
        self.target_steps = 0
        """The step the job ends at as the latest heartbeat said (`atoll job stop/extend`); 0: not heard yet."""
        self.prune_checkpoints_before = 0
        """Checkpoint steps older than this are needed nowhere, as the latest heartbeat said (0: not heard yet)."""
        self.on_prune: Callable[[int, int], None] | None = None
        """Called (on a thread of its own) with (`prune_checkpoints_before`, `keep_checkpoint_step`) each time the first
        rises: deletes older step folders but the second."""
        """What stopped the agent from inside (a refusal, a dead loop); `run()` raises it."""

    # --- calls --------------------------------------------------------------------------------------

    def _coordinator_rpc(self) -> RpcOptions:
        return self.config.rpc if self.credentials is None else self.credentials.coordinator_rpc(self.config.rpc)

    def _use_certificate(self, reply: pb.JoinReply) -> None:
        """Keep the certificate the join brought; move the coordinator channel onto it from the bootstrap one."""
        if self.credentials is None:
            return
        had = self.credentials.has_certificate
        try:
            self.credentials.accept(reply.certificate_pem, reply.ca_pem)
        except CertificateError as e:
            raise AgentError(f"the join brought no usable certificate: {e}") from None
        if not had:
            # calls open on the bootstrap channel finish there; it is closed with the agent
            self._old_channels.append(self._channel)
            self._channel = make_channel(self.config.coordinator, self._coordinator_rpc(), token=self.config.token)
            self._stub = pb_grpc.CoordinatorStub(self._channel)
            self._heartbeats.reset()  # the next heartbeat stream opens on the certificate's channel

    def call(self, method: str, request, timeout: timedelta | None = None):
        """One unary call to the coordinator with the configured deadline; a request that speaks for this node
        carries this process's session (`HeartbeatRequest.session`). One for another node (the report of a copy
        it took of this node's checkpoint) carries none: this process does not speak for it."""
        if "session" in request.DESCRIPTOR.fields_by_name and not request.session \
                and request.node_id == self.node_id:
            request.session = self.session
        return getattr(self._stub, method)(request, timeout=(timeout or self.config.call_timeout).total_seconds())

    def _backoff_cap(self) -> float:
        """Seconds of the longest wait between two retries (see `AgentConfig.backoff`)."""
        first, largest = (b.total_seconds() for b in self.config.backoff)
        return max(first, min(largest, self.heartbeat_interval))

    def _retrying(self, what: str, fn: Callable[[], object]) -> object:
        """`fn()` retried with backoff on transient failures, for at most connect_timeout."""
        deadline = time.monotonic() + self.config.connect_timeout.total_seconds()
        wait = self.config.backoff[0].total_seconds()
        while True:
            if self._stop.is_set():
                raise AgentStopped(f"stopped while {what}")
            try:
                return fn()
            except ValueError:
                if self._stop.is_set():  # stop() closed the channel under this call
                    raise AgentStopped(f"stopped while {what}") from None
                raise
            except grpc.RpcError as e:
                if e.code() not in _RETRYABLE or time.monotonic() + wait > deadline or self._stop.is_set():
                    if e.code() in _RETRYABLE:
                        raise ConnectionError(f"{what}: no answer from the coordinator at {self.config.coordinator} "
                                              f"({e.code().name}: {e.details()})") from None
                    raise
                log.debug("%s: %s, retrying in %.1fs", what, e.code().name, wait)
                self._stop.wait(wait)
                wait = min(2 * wait, self._backoff_cap())

    # --- start-up -----------------------------------------------------------------------------------

    def _fetch_job(self) -> JobSpec:
        # the first contact: if it has not answered in a few seconds, say why it may not and keep trying
        mtls = self._coordinator_rpc().mtls  # a TLS handshake of its own can tell a wrong token or CA apart
        watch = FirstContactWatch(self.config.coordinator, tls=self.config.tls_ca is not None, mtls=mtls)
        try:
            def ask() -> object:
                if watch.wrong_token:  # a wrong token never becomes right: no point retrying
                    why = watch.said.split(", but ", 1)[-1].removeprefix("it ")
                    raise AgentError(f"the coordinator at {self.config.coordinator} {why}")
                return self.call("GetStatus", pb.StatusRequest())

            status = self._retrying("fetching the job spec", ask)
        except grpc.RpcError as e:
            raise AgentError(f"the coordinator at {self.config.coordinator} refused to tell the job: "
                             f"{e.code().name}: {e.details()}") from None
        except ConnectionError as e:
            why = diagnose(self.config.coordinator, tls=self.config.tls_ca is not None, mtls=mtls)
            raise ConnectionError(f"{e}; {why}") from None
        finally:
            watch.done()
        if watch.fired.is_set():
            log.info("reached the coordinator at %s", self.config.coordinator)
        job = JobSpec.from_toml(status.job.spec_toml)  # type: ignore[attr-defined]
        self.run_id = status.job.run_id  # type: ignore[attr-defined]
        if status.job_state == "finished":  # type: ignore[attr-defined]
            # nothing left to train: no profiling, no join, no plan to stand by in
            raise JobFinished(f"job {job.id} ({job.name}) finished after step "
                              f"{status.target_steps - 1}: nothing is left to train; "  # type: ignore[attr-defined]
                              f"`atoll status` shows it, `atoll export` makes a model of its last checkpoint")
        return job

    def _advertise(self, peer: PeerServer) -> str:
        if not peer.listening:
            return ""  # --no-listen: neighbours send over the streams this node opens
        if self.config.advertise:
            return self.config.advertise
        host, port = peer.address.rsplit(":", 1)
        if host in ("0.0.0.0", "[::]", ""):
            host = socket.gethostname()
        return f"{host}:{port}"

    def join(self) -> pb.JoinReply:
        """Join (or re-join) under the stable id; raises AgentError when refused for good."""
        assert self.profile is not None and self.peer is not None and self.job is not None
        req = pb.JoinRequest(token=self.config.token, node_id=self.node_id, job_id=self.job.id,
                             profile=profile_to_proto(self.profile), peer_address=self._advertise(self.peer),
                             session=self.session)

        def attempt() -> object:
            if self.credentials is not None:  # a signing request bound to a fresh challenge, for each try
                req.csr_pem = self.credentials.csr(self._join_challenge())
            return self.call("Join", req)

        with self._join_lock:
            again = False
            while True:
                try:
                    reply = self._retrying("joining", attempt)
                    break
                except grpc.RpcError as e:
                    copy = e.code() == grpc.StatusCode.ALREADY_EXISTS
                    limited = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    if copy and again:
                        raise AgentError(f"the coordinator refused the join again once the lease it named had "
                                         f"passed, so the process holding the node id lives: {e.details()}") from None
                    # a refusal that may pass later (another process holds the id, its lease not yet lapsed: this
                    # may be that node restarted from another address; or joins came faster than the coordinator
                    # takes them from one node) is tried again when it says
                    after = retry_after(e) if copy or limited else None
                    if after is None:
                        raise AgentError(f"the coordinator refused the join: {e.code().name}: {e.details()}") from None
                    # a copy's refusal is tried once: a second one means the holder lives (above)
                    log.warning("the coordinator refused the join (%s); trying %s in %.0fs", e.details(),
                                "once more" if copy else "again", after)
                    if self._stop.wait(after):
                        raise AgentStopped("stopped while waiting to join again") from None
                    again = again or copy
            self._use_certificate(reply)  # type: ignore[arg-type]
            self._follow_run(reply.job.run_id)  # type: ignore[attr-defined]
            self.heartbeat_interval = reply.heartbeat_interval_seconds or 1.0  # type: ignore[attr-defined]
            self.joins += 1
            log.info("joined job %s as %s (peer address %s, heartbeat every %.1fs)", self.job.id, self.node_id,
                     req.peer_address or "none", self.heartbeat_interval)
            if reply.reachability:  # type: ignore[attr-defined]
                (log.info if reply.reachable or not req.peer_address else log.warning)(  # type: ignore[attr-defined]
                    "%s", reply.reachability)  # type: ignore[attr-defined]
            return reply  # type: ignore[return-value]

    def _join_challenge(self) -> str:
        """A fresh challenge for the next join; "" from a coordinator that hands out none (an older one)."""
        try:
            reply = self.call("JoinChallenge", pb.JoinChallengeRequest(token=self.config.token, node_id=self.node_id))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return ""
            raise
        return reply.challenge  # type: ignore[attr-defined]

    def _follow_run(self, run_id: str) -> None:
        """A re-join to a coordinator that runs the job under another run (it lost its state dir and started afresh):
        this process goes on with its live state under that run, so its checkpoint folder does too (`RUN_FILE`);
        a node started later on the folder then joins the run rather than being refused as an earlier run's."""
        if not run_id or run_id == self.run_id:
            return
        before, self.run_id = self.run_id, run_id
        if before and self.config.checkpoint_dir is not None:
            from atoll.node.checkpoint import mark_run

            log.warning("the coordinator runs the job under a new run (%s, was %s: it started on a fresh state dir); "
                        "this node goes on with its live state, and its checkpoints with it", run_id, before)
            if self.config.checkpoint_dir.is_dir():
                mark_run(self.config.checkpoint_dir, run_id)

    def start(self) -> NodeAgent:
        """Fetch the spec, profile, start the peer server, join and start the loops."""
        self.job = self._fetch_job()
        log.info("job %s (%s): model %s, %d steps", self.job.id, self.job.name, self.job.model.name,
                 self.job.train.steps)
        from atoll.node.datasets import check_data

        check_data(self.job.data, vocab_size=self.job.model.vocab_size)  # a DataError says what to fix, once
        if self.job.pretrained:
            from atoll.node.pretrained import check_pretrained

            check_pretrained(self.job.model, self.job.pretrained)  # before profiling and joining, like the data
        if self.config.checkpoint_dir is not None:
            from atoll.node.checkpoint import claim_checkpoint_dir

            # raises on another job's steps, or an earlier run's of this job
            if claim_checkpoint_dir(self.config.checkpoint_dir, self.job.id, self.run_id):
                log.info("checkpoints of job %s go to %s", self.job.id, self.config.checkpoint_dir)
        if self._given_profile is not None:
            self.profile = self._given_profile
        else:
            t0 = time.perf_counter()
            key = profile_key(self.job, self.config.device, self.config.profile)
            cached = None if self.config.reprofile else cached_profile(self.config.state_dir, key)
            self.profile = cached or profile_node(self.job, self.config.device, self.config.profile)
            if cached is None:
                save_profile(self.config.state_dir, key, self.profile)
            self.profile.region = self.config.region
            block = [t for t in self.profile.layer_timings if t.layer_kind == "block"]
            log.info("%s %s %s%s: block fwd+bwd %s", "reused the profile of" if cached else "profiled",
                     self.profile.device_kind, self.profile.device_name,
                     f" from {shown_path(self.config.state_dir / PROFILE_CACHE)} (same job, device, CPU quota and "
                     f"versions; --reprofile measures again)" if cached else f" in {time.perf_counter() - t0:.1f}s",
                     ", ".join(f"{(t.forward_seconds + t.backward_seconds) * 1e3:.1f} ms @ {t.micro_batch}"
                               for t in block))
        self.profile.hostname = self.config.machine or self.profile.hostname  # the machine it shares a card on
        self.peer = PeerServer(node_id=self.node_id, listen=self.config.listen, token=self.config.token,
                               rpc=self.peer_rpc)
        self.join()
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._probe_loop, "probe"),
                             (self._watch_loop, "watch"), (self._outbox_loop, "outbox")):
            t = threading.Thread(target=self._guard(target), name=f"atoll-node-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _guard(self, loop: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                loop()
            except AgentStopped:
                pass
            except AgentError as e:
                self.error = e
                self.stop(leave=False)
            except Exception as e:  # noqa: BLE001 - a dead loop must stop the agent visibly, not silently
                log.exception("node loop failed")
                self.error = e
                self.stop(leave=False)
        return run

    def _rejoin(self, why: str) -> None:
        log.warning("the coordinator does not know this node (%s); joining again as %s", why, self.node_id)
        with self._cond:
            # a coordinator that lost its state numbers its epochs afresh: take its current plan whatever it
            # is. Set before joining, so no plan watch opened after the join asks only for newer epochs.
            self._after_rejoin = True
        self.join()
        self._heartbeats.reset()  # the next heartbeat stream speaks for the node as it joined now
        stream = self._stream
        if stream is not None:
            stream.cancel()  # a watch opened before the join reconnects, asking for the current plan

    # --- loops --------------------------------------------------------------------------------------

    def set_progress(self, epoch: int, step: int) -> None:
        with self._cond:
            self.epoch, self.step = epoch, step

    def record_step_seconds(self, seconds: float) -> None:
        if seconds > 0:
            with self._cond:
                self._step_seconds.append(seconds)

    def step_seconds(self) -> list[float]:
        """The latest measured step times of this node (any plan)."""
        with self._cond:
            return list(self._step_seconds)

    def _heartbeat_loop(self) -> None:
        self._away_since = None
        # the first heartbeat goes at once: its reply hands this node the peers to probe, and a plan waits for
        # every member's probes (after a full interval, the last node to join held the plan back by as long)
        wait = 0.0
        while not self._stop.wait(wait):
            wait = self.heartbeat_interval
            req = self._heartbeat_request()
            # a heartbeat stuck on a reconnecting channel is not worth more than the next one: bound its
            # deadline by two intervals, so an outage is retried well within the lease
            deadline = min(self.config.call_timeout, timedelta(seconds=max(1.0, 2 * self.heartbeat_interval)))
            try:
                reply = self._heartbeats.beat(req, deadline.total_seconds())
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    self._rejoin(e.details() or "")
                elif e.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise AgentError(f"heartbeat refused: {e.details()}") from None
                elif e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # another process speaks for this node now
                    raise AgentError(f"stopping: {e.details()}") from None
                elif self._away_since is None:
                    self._away_since = time.monotonic()
                    log.warning("heartbeat failed (%s: %s); retrying", e.code().name, e.details())
                continue
            if self._away_since is not None:
                log.info("coordinator reachable again after %.1fs", time.monotonic() - self._away_since)
                self._away_since = None
                with self._outbox_cond:
                    self._outbox_cond.notify_all()  # deliver what waited for the coordinator now
                self._watch_wake.set()  # and reopen the plan watch if it is waiting to retry
            if 0 < reply.heartbeat_interval_seconds < 3600 and reply.heartbeat_interval_seconds != self.heartbeat_interval:
                # the coordinator stretches the cadence with the membership's size (and back)
                log.info("the coordinator asks for a heartbeat every %.1fs (was %.1fs; lease %.1fs)",
                         reply.heartbeat_interval_seconds, self.heartbeat_interval, reply.lease_seconds)
                self.heartbeat_interval = reply.heartbeat_interval_seconds
            if reply.coordinator_unix > 0:  # (the reply's one-way delay is small against a probe's length)
                self._clock_offset = reply.coordinator_unix - time.time()
            for target in reply.probe:
                if target.flows > 1:  # a machine probe: at its start, with the other nodes of this machine
                    threading.Thread(target=self._machine_probe, args=(target,), name="atoll-machine-probe",
                                     daemon=True).start()
                    continue
                if target.node_id not in self._queued:
                    self._queued.add(target.node_id)
                    self._probes.put(target)
            self.target_steps = reply.target_steps or self.target_steps
            self._heard_prune(reply, wait=False)
            if reply.write_checkpoints != self.write_checkpoints:
                self.write_checkpoints = reply.write_checkpoints
                log.info("the coordinator %s", "asks this node to write its stage's checkpoints too: their writer "
                         "cannot" if reply.write_checkpoints else "no longer needs this node to write its stage's "
                         "checkpoints")
            if reply.quarantined != self.quarantined:
                self.quarantined = reply.quarantined
                if reply.quarantined:  # in no plan from now on; it waits here, heartbeating, and never rejoins itself
                    log.warning("QUARANTINED by the coordinator: %s. This node is in no plan and waits; an operator "
                                "lets it back with `atoll job release %s`", reply.quarantine_reason, self.node_id)
                else:
                    log.info("released from quarantine: the next plan may include this node again")
            if reply.job_finished and not self.job_finished.is_set():
                log.info("the coordinator says the job has finished its steps")
                self.job_finished.set()

    def _checkpoint_on_leave(self) -> None:
        """A leaving node whose live state nobody took (every node of the job stopping at once, say): write it as
        a checkpoint of its step and report it, so the job restarted later resumes there instead of at its last
        checkpoint. The nodes of a job stopped together end at the same step, so together they write that step
        whole. State with a step whose update is pending (its norm exchange failed) is not a checkpoint."""
        from atoll.fsutil import atomic_write_bytes
        from atoll.node.state_transfer import checkpoint_file

        holder = self.peer.state if self.peer is not None else None
        live = holder.live if holder is not None else None
        root = self.config.checkpoint_dir
        if live is None or live.pending or root is None or self.job is None or live.step <= 0:
            return
        if live.outer is not None:  # a replica group's state mid-round: outer-mode checkpoints are taken at round
            return  # ends, with the outer state beside the layers
        path = checkpoint_file(root, live.step, live.layers)
        try:
            if not path.is_file():
                atomic_write_bytes(path, live.data)
            self.call("ReportCheckpoint", pb.CheckpointReport(
                job_id=self.job.id, node_id=self.node_id, plan_epoch=live.epoch, step=live.step,
                layer_start=live.layers[0], layer_end=live.layers[1], path=str(path), bytes=len(live.data),
                data_position=live.step * self.job.train.global_batch), timeout=timedelta(seconds=5))
        except (OSError, grpc.RpcError) as e:
            log.warning("leaving: the live state of layers [%d, %d) after step %d could not be kept as a checkpoint "
                        "(%s)", *live.layers, live.step, e.details() if isinstance(e, grpc.RpcError) else e)
            return
        log.info("leaving: kept the live state as the checkpoint of step %d (layers [%d, %d)): a restart resumes "
                 "there", live.step, *live.layers)

    def _prune_once_more(self) -> None:
        """Before leaving: ask for the checkpoint steps no node needs any more once more and delete them here. The
        reports just delivered (copies of the last checkpoint taken after this node's last heartbeat, at the
        job's end) may have moved that horizon, and no later heartbeat would bring it."""
        if self.on_prune is None:
            return
        req = self._heartbeat_request()
        try:
            reply = self.call("Heartbeat", req, timeout=timedelta(seconds=2))
        except grpc.RpcError:
            return
        self._heard_prune(reply, wait=True)

    def _heartbeat_request(self) -> pb.HeartbeatRequest:
        with self._cond:
            return pb.HeartbeatRequest(node_id=self.node_id, plan_epoch=self.epoch, step=self.step,
                                       session=self.session)

    def _heard_prune(self, reply: pb.HeartbeatReply, *, wait: bool) -> None:
        """Follow a heartbeat reply's prune horizon: when it rose, `on_prune` deletes the older step folders but the
        running plan's resume step (on a thread of its own, or at once with `wait`)."""
        if reply.prune_checkpoints_before <= self.prune_checkpoints_before:
            return
        self.prune_checkpoints_before = reply.prune_checkpoints_before
        if self.on_prune is None:
            return
        args = (reply.prune_checkpoints_before, reply.keep_checkpoint_step)
        if wait:
            self.on_prune(*args)
        else:
            threading.Thread(target=self.on_prune, args=args, daemon=True, name="atoll-prune").start()

    def _machine_probe(self, target: pb.ProbeTarget) -> None:
        """Probe `target` at its start (the coordinator's clock, corrected by this node's offset from it) as one of
        `target.flows` flows every node of this machine sends at once (`atoll.coordinator.machineprobe`)."""
        start = target.start_unix - self._clock_offset
        wait = start - time.time()
        if wait > MACHINE_PROBE_MAX_WAIT_S:
            log.warning("a machine probe of %s is to start in %.0f s; not waiting that long", target.node_id, wait)
            return
        # connected a second ahead, then one transfer while the machine's other flows run (the quickest of several,
        # as a lone probe takes, would pick a moment the others paused); the flows share the card: more time
        if self._stop.wait(max(0.0, wait - 1.0)):
            return
        try:
            result = probe_peer(target.address, nbytes=target.probe_bytes, token=self.config.token,
                                rpc=self.peer_rpc, timeout=max(1, target.flows) * self.config.probe_timeout,
                                sender=self.node_id, node=target.node_id, start_unix=start, curve=False)
            link = replace(result.measurement(src=self.node_id, dst=target.node_id), flows=target.flows)
            log.info("probed %s as one of %d flows from this machine at once: %.1f MB/s", target.node_id,
                     target.flows, link.bandwidth_bytes_per_s / 1e6)
        except ProbeError as e:
            log.warning("machine probe of %s failed: %s", target.node_id, e)
            link = LinkMeasurement(src=self.node_id, dst=target.node_id, bandwidth_bytes_per_s=0.0, rtt_seconds=0.0,
                                   measured_unix=time.time(), flows=target.flows)
        try:
            self.call("ReportProbes", pb.ProbeReport(node_id=self.node_id, links=[link_to_proto(link)]))
        except (grpc.RpcError, ValueError) as e:
            log.warning("could not report the machine probe of %s: %s", target.node_id, e)

    def _probe_loop(self) -> None:
        while not self._stop.is_set():
            try:
                target = self._probes.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                result = probe_peer(target.address, nbytes=target.probe_bytes, token=self.config.token,
                                    rpc=self.peer_rpc, timeout=self.config.probe_timeout,
                                    sender=self.node_id, node=target.node_id)
                link = result.measurement(src=self.node_id, dst=target.node_id)
                log.info("probed %s: %.1f MB/s, rtt %.2f ms", target.node_id, link.bandwidth_bytes_per_s / 1e6,
                         link.rtt_seconds * 1e3)
            except ProbeError as e:
                # an unreachable peer is a measurement too: no bandwidth, so no island spans the link
                log.warning("probe of %s failed: %s", target.node_id, e)
                link = LinkMeasurement(src=self.node_id, dst=target.node_id, bandwidth_bytes_per_s=0.0,
                                       rtt_seconds=0.0, measured_unix=time.time())
            try:
                self.call("ReportProbes", pb.ProbeReport(node_id=self.node_id, links=[link_to_proto(link)]))
            except grpc.RpcError as e:
                log.warning("could not report the probe of %s: %s: %s", target.node_id, e.code().name, e.details())
            finally:
                self._queued.discard(target.node_id)

    def report_step(self, metrics: StepMetrics) -> pb.StepAck:
        """Send step metrics; never raises. While the coordinator is away (or steps wait in the backlog) they
        join the backlog, which the outbox delivers in order once it is back, and the answer is "go on"."""
        req = step_metrics_to_proto(metrics)
        go_on = pb.StepAck(plan_epoch=metrics.plan_epoch, stop=False)
        with self._outbox_cond:
            if self._step_backlog:  # keep the order: behind what waits already
                self._backlog_step(_Outgoing("ReportStep", req, metrics.plan_epoch, f"step {metrics.step}"))
                self._outbox_cond.notify_all()
                return go_on
        try:
            return self.call("ReportStep", req)
        except ValueError:  # the channel was closed by stop()
            return go_on
        except grpc.RpcError as e:
            if e.code() in _REFUSED:
                self._refused_steps += 1
                if self._refused_steps == 1 or self._refused_steps % 100 == 0:
                    log.warning("the coordinator refused step %d's report (%s: %s; %d refused so far)", metrics.step,
                                e.code().name, e.details(), self._refused_steps)
                return go_on
            with self._outbox_cond:
                self._backlog_step(_Outgoing("ReportStep", req, metrics.plan_epoch, f"step {metrics.step}"))
                self._outbox_cond.notify_all()
            return go_on

    def _backlog_step(self, out: _Outgoing) -> None:
        """Queue a step report behind the others (`_outbox_cond` held); past `STEP_BACKLOG` the oldest goes, said."""
        if len(self._step_backlog) == self._step_backlog.maxlen:
            self._dropped_steps += 1
            if self._dropped_steps == 1 or self._dropped_steps % 1000 == 0:
                log.warning("the coordinator has been away for %d step reports: the oldest are dropped (%d so far; "
                            "the loss history will have a gap there)", STEP_BACKLOG, self._dropped_steps)
        self._step_backlog.append(out)

    def send_later(self, method: str, request, *, epoch: int, what: str,
                   on_delivered: Callable[[], None] | None = None) -> None:
        """Queue a unary report for the outbox thread; returns at once."""
        with self._outbox_cond:
            self._outbox.append(_Outgoing(method, request, epoch, what, on_delivered))
            self._outbox_cond.notify_all()

    def _outbox_loop(self) -> None:
        """Deliver queued reports in order, retrying with backoff (reset by a heartbeat that gets through)
        until delivered, superseded by a newer plan, or refused for good."""
        wait = self.config.backoff[0].total_seconds()
        failing_since: float | None = None
        while True:
            with self._outbox_cond:
                while not self._outbox and not self._step_backlog and not self._stop.is_set():
                    self._outbox_cond.wait()
                if not self._outbox and not self._step_backlog:
                    return
                item = self._outbox[0] if self._outbox else self._step_backlog[0]
            with self._cond:
                newest = self.plan.epoch if self.plan is not None else 0
            if item.epoch < newest and item.method != "ReportStep":  # old steps still tell the loss history
                log.info("dropping the unsent report of the %s: plan epoch %d is superseded by %d", item.what,
                         item.epoch, newest)
                self._outbox_done(item)
                continue
            try:
                reply = self.call(item.method, item.request)
            except ValueError:  # the channel was closed by stop()
                return
            except grpc.RpcError as e:
                # a copy is indexed as the node that took it: once that node left or was marked gone, the report
                # is never accepted (this node's own NOT_FOUND is a re-join, which the heartbeat does)
                lost_holder = e.code() == grpc.StatusCode.NOT_FOUND and getattr(item.request, "copy_of", "")
                if e.code() in _REFUSED or lost_holder:
                    (log.debug if item.method == "ReportStep" else log.warning if lost_holder else log.error)(
                        "the coordinator refused the report of the %s (%s: %s); dropping it", item.what,
                        e.code().name, e.details())
                    self._outbox_done(item)
                    continue
                if self._stop.is_set():
                    return
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning("report of the %s not delivered (%s); retrying with backoff", item.what,
                                e.code().name)
                with self._outbox_cond:
                    if self._outbox_cond.wait(wait):
                        wait = self.config.backoff[0].total_seconds()  # woken: the coordinator is back
                    else:
                        wait = min(2 * wait, self._backoff_cap())
                continue
            if failing_since is not None:
                log.info("report of the %s delivered after %.1fs", item.what, time.monotonic() - failing_since)
            failing_since, wait = None, self.config.backoff[0].total_seconds()
            log.debug("%s reported: %s", item.what, getattr(reply, "message", ""))
            self._outbox_done(item)
            if item.on_delivered is not None:
                try:
                    item.on_delivered()
                except Exception:  # noqa: BLE001 - e.g. pruning old checkpoints failed: say so, keep going
                    log.exception("after delivering the report of the %s", item.what)

    def _outbox_done(self, item: _Outgoing) -> None:
        with self._outbox_cond:
            for queue_ in (self._outbox, self._step_backlog):
                if queue_ and queue_[0] is item:
                    queue_.popleft()
            self._outbox_cond.notify_all()

    def undelivered(self) -> int:
        """Reports queued for the coordinator and not delivered yet."""
        with self._outbox_cond:
            return len(self._outbox) + len(self._step_backlog)

    def flush_outbox(self, timeout: timedelta) -> bool:
        """Wait until every queued report is delivered or dropped; False when `timeout` passed first."""
        deadline = time.monotonic() + timeout.total_seconds()
        with self._outbox_cond:
            while (self._outbox or self._step_backlog) and not self._stop.is_set():  # stopped: no one delivers
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._outbox_cond.wait(min(left, 0.5))
            return not (self._outbox or self._step_backlog)

    def _watch_loop(self) -> None:
        wait = self.config.backoff[0].total_seconds()
        while not self._stop.is_set():
            with self._cond:
                known = self.plan.epoch if self.plan is not None and not self._after_rejoin else 0
            # packed plans (a zstd frame each, ~14x smaller at thousands of nodes); a coordinator without them
            # answers UNIMPLEMENTED, and is watched with WatchPlan from then on
            method = self._stub.WatchPlanPacked if self._packed_plans else self._stub.WatchPlan
            # wait_for_ready: through an outage the call waits for the channel and opens the moment the
            # coordinator is back, rather than at the next retry of a backoff
            stream = method(pb.WatchPlanRequest(node_id=self.node_id, known_epoch=known, session=self.session),
                            timeout=self.config.watch_timeout.total_seconds(), wait_for_ready=True)
            self._stream = stream
            if self._stop.is_set():  # stop() may have looked at the previous stream
                stream.cancel()
            try:
                for message in stream:
                    wait = self.config.backoff[0].total_seconds()
                    if self._packed_plans:
                        try:
                            plan = plan_from_packed(message, self.config.rpc.max_message_bytes)
                        except ValueError as e:
                            log.warning("plan watch: %s; reconnecting", e)
                            stream.cancel()
                            break
                    else:
                        plan = plan_from_proto(message)
                    self._new_plan(plan)
                else:
                    continue
            except grpc.RpcError as e:
                code = e.code()
                if self._stop.is_set():
                    return
                if code == grpc.StatusCode.UNIMPLEMENTED and self._packed_plans:
                    log.info("the coordinator sends no packed plans; watching with WatchPlan")
                    self._packed_plans = False
                    continue
                if code == grpc.StatusCode.CANCELLED:
                    continue  # cancelled by a re-join: reopen at once
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue  # the stream's own deadline: reopen at once
                if code == grpc.StatusCode.NOT_FOUND:
                    self._rejoin(e.details() or "")
                elif code == grpc.StatusCode.UNAUTHENTICATED:
                    raise AgentError(f"plan watch refused: {e.details()}") from None
                elif code == grpc.StatusCode.FAILED_PRECONDITION:  # another process speaks for this node now
                    raise AgentError(f"stopping: {e.details()}") from None
                else:
                    log.debug("plan watch ended (%s), reconnecting in %.1fs", code.name, wait)
            if self._watch_wake.wait(wait):  # a heartbeat got through again (or stop): reopen now
                self._watch_wake.clear()
                wait = self.config.backoff[0].total_seconds()
            else:
                wait = min(2 * wait, self._backoff_cap())

    def _new_plan(self, plan: Plan) -> None:
        with self._cond:
            if self.plan is not None and (plan == self.plan or (plan.epoch <= self.plan.epoch
                                                                 and not self._after_rejoin)):
                return
            self._after_rejoin = False
            if self.peer is not None:  # before any run of it starts: its members may fetch outer state here
                self.peer.note_plan(plan)
            self.plan = plan
            self.plan_serial += 1
            self._cond.notify_all()
        log.info("%s", describe_plan(plan, self.node_id, self.config.coordinator.rsplit(":", 1)[0]))

    # --- the caller's thread ------------------------------------------------------------------------

    def wait_for_plan(self, after_serial: int, timeout: float | None = None) -> tuple[int, Plan] | None:
        """(serial, plan) of the latest plan once its serial exceeds `after_serial`; None on timeout or stop."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._stop.is_set():
                if self.plan is not None and self.plan_serial > after_serial:
                    return self.plan_serial, self.plan
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(0.5 if left is None else min(left, 0.5))
            return None

    def run(self, on_plan: OnPlan | None = None) -> None:
        """Start (if not started) and hand each new plan to `on_plan` until `stop()`.

        `on_plan` runs on this thread; when a newer plan arrives its `PlanRun.superseded` is set, and the
        next call gets the newest plan. Without a callback, plans are only logged (and the node runs
        nothing). Raises what stopped the agent from inside: AgentError when the coordinator refused it.
        """
        if self.peer is None:
            try:
                self.start()
            except AgentStopped:
                if self.peer is not None:  # started after stop() looked for it
                    self.peer.stop()
                return
        done = 0
        waiting = time.monotonic()
        while not self._stop.is_set():
            latest = self.wait_for_plan(done, WAITING_LINE_EVERY_S)
            if latest is None:
                if not (self._stop.is_set() or self._leaving.is_set() or self.job_finished.is_set()):
                    log.info("waiting for a plan (%.0fs so far): `atoll status --coordinator %s` says what the "
                             "coordinator waits for", time.monotonic() - waiting, self.config.coordinator)
                continue
            waiting = time.monotonic()
            done, plan = latest
            self.set_progress(plan.epoch, self.step)
            if on_plan is None:
                continue
            assert self.job is not None and self.peer is not None
            superseded = threading.Event()
            run = PlanRun(plan=plan, job=self.job, node_id=self.node_id, peer=self.peer, superseded=superseded,
                          agent=self)
            adopted = [done]
            watcher = threading.Thread(target=self._supersede_when_newer, args=(adopted, superseded, run),
                                       daemon=True, name="atoll-node-supersede")
            watcher.start()
            try:
                on_plan(run)
            finally:
                superseded.set()
                watcher.join(timeout=5)
                done = max(done, adopted[0])
                waiting = time.monotonic()
        if self.error is not None:
            raise self.error

    def _supersede_when_newer(self, adopted: list[int], superseded: threading.Event, run: PlanRun) -> None:
        """Set `superseded` once a newer plan arrives, unless the run can adopt it as it goes (outer mode:
        this node's replica group is kept as it runs); `adopted[0]` is the serial of the newest adopted."""
        from atoll.node.placement import group_continues

        while not superseded.is_set():
            if self._stop.is_set():
                superseded.set()
                return
            newer = self.wait_for_plan(adopted[0], timeout=0.5)
            if newer is None:
                continue
            serial, plan = newer
            if group_continues(run.current, plan, self.node_id):
                log.info("plan epoch %d keeps this node's replica group as it runs; training goes on", plan.epoch)
                run.latest = plan
                adopted[0] = serial
                self.set_progress(plan.epoch, self.step)
            else:
                superseded.set()

    def stop(self, leave: bool = True, flush: timedelta = timedelta(seconds=5)) -> None:
        """Stop the loops and the peer server; with `leave`, first deliver the queued reports (at most `flush`)
        and tell the coordinator (best effort)."""
        if self._stop.is_set():
            return
        if self._draining.is_set():  # a second stop (Ctrl-C again) while the first waits for the step in flight
            log.info("stopping now: the step in flight is cut short")
            self._stop.set()
            return
        # a node stopped while its coordinator is away (restarting) retries its Leave until it is back; one whose
        # coordinator went away as it stopped (the whole job stopping at once) tries once, as before
        leave_retry = LEAVE_RETRY if self._away_since is not None else timedelta(0)
        if leave and self.joins:
            self._leaving.set()
            if self.peer is not None and self.peer.state is not None:
                # the step in flight ends with its stage's other nodes (a ZeRO or tp stage's nodes must end at the
                # same step to gather its state for the next plan); one that does not finish in the time steps
                # take is cut short below
                self._draining.set()
                bound = min(step_wait_timeout(self.step_seconds(), self.config.handover), self.config.handover)
                if self.peer.state.stepping:
                    log.info("stopping: the step in flight finishes first (at most %.0fs; stop again to cut it "
                             "short), then this node leaves", bound.total_seconds())
                if not self.peer.state.wait_steps_over(bound):
                    log.info("the step in flight did not finish within %.0fs; ending it", bound.total_seconds())
        if leave and self.joins:
            if not self.flush_outbox(flush):
                log.warning("stopping with %d report(s) undelivered", len(self._outbox) + len(self._step_backlog))
            else:
                self._prune_once_more()
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        with self._outbox_cond:
            self._outbox_cond.notify_all()
        self._watch_wake.set()
        if self._stream is not None:
            self._stream.cancel()
        self._heartbeats.reset()
        left = False
        if leave and self.joins and self.peer is not None and self.peer.state is not None:
            # the run ends at its step boundary and sends its last step reports before the Leave makes them moot;
            # a ZeRO or tp stage's handover to the others of its stage waits for the Leave (`wait_left`)
            self.peer.state.wait_steps_over(self.config.handover)
        if leave and self.joins:
            left = self._left = self._send_leave(leave_retry)
        self._leave_answered.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        if left and self.peer is not None and self.peer.state is not None:
            # a graceful leave hands the live state over: the next plan's nodes may fetch it from here
            self.peer.state_access.hand_over()
            outcome = self.peer.state.wait_handed_over(most=self.config.handover, idle=timedelta(seconds=5))
            log.info("leaving: %s", outcome)
            if not outcome.taken:
                self._checkpoint_on_leave()
        if self.peer is not None:
            self.peer.stop()
        self._channel.close()
        for channel in self._old_channels:
            channel.close()
        self._state_lock.release()

    def _send_leave(self, most: timedelta) -> bool:
        """Tell the coordinator this node leaves; retried while the coordinator is away (a restart takes seconds)
        for at most `most`. Whether it took the Leave: only then do the next plan's nodes fetch this node's live
        state (or it keeps that state as a checkpoint); without, the coordinator notices the node gone when its
        lease lapses and the job resumes from its last checkpoint."""
        end = time.monotonic() + most.total_seconds()
        wait = 0.25
        while True:
            try:
                self.call("Leave", pb.LeaveRequest(node_id=self.node_id, reason="node stopped"),
                          timeout=timedelta(seconds=2))
                return True
            except grpc.RpcError as e:
                if e.code() not in _RETRYABLE or time.monotonic() + wait >= end:
                    if most.total_seconds() > 0:
                        log.warning("leaving: the coordinator did not take this node's Leave within %.0fs (%s: %s); "
                                    "it notices the node gone when its lease lapses, and its live state is not "
                                    "handed over", most.total_seconds(), e.code().name, e.details())
                    return False
            except ValueError:  # the channel is closed
                return False
            time.sleep(wait)
            wait = min(2 * wait, 2.0)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Wait until the agent stops (`stop()`, or a loop that failed); whether it has."""
        return self._stop.wait(timeout)

    @property
    def draining(self) -> bool:
        """A graceful stop is under way: the run trains no further step (`RunContext.draining`)."""
        return self._draining.is_set()

    def wait_left(self, timeout: timedelta) -> bool:
        """Whether this node is leaving gracefully and the coordinator took its Leave (waiting up to `timeout` for
        the answer): its stage's other nodes, superseded by the plan that follows, meet it for a handover. False at
        once where the node is not leaving."""
        if not self._leaving.is_set():
            return False
        self._leave_answered.wait(timeout.total_seconds())
        return self._left


def run_node_cli(args: argparse.Namespace) -> int:
    """`atoll node`: run until SIGINT/SIGTERM, then leave the job."""
    import signal

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    # setup mistakes: one line each, before anything starts; the checks that create nothing first, so a mistake
    # leaves no empty folders behind
    if not args.no_listen:
        check_listen(args.listen, "--listen")
    check_dial_address(args.coordinator, "--coordinator")
    if args.advertise:
        check_dial_address(args.advertise, "--advertise")
    from atoll.node.profiler import parse_device

    device = parse_device(args.device)  # a typo, or a GPU this machine lacks, is said now, not once the coordinator answers
    if device.type == "cuda" and device.index is not None:
        import torch

        # the process's current GPU: what a library allocates without naming a device (NCCL's set-up, a bare
        # synchronize) lands there, not in a context of its own on GPU 0
        torch.cuda.set_device(device)
    token = resolve_token(args.token, args.token_file)
    if token is None:
        raise ValueError(f"the node needs the job token: --token, --token-file or {TOKEN_ENV}")
    usable_state_dir(Path(args.state_dir))
    if args.checkpoint_dir:
        usable_state_dir(Path(args.checkpoint_dir), "--checkpoint-dir")
    if args.insecure:
        tls_ca = None
        log.warning("INSECURE: --insecure talks plaintext gRPC to the coordinator and to peers: anyone on the network "
                    "reads the job token and every tensor. Use it only in a closed lab, with a coordinator that runs "
                    "--insecure too")
    elif getattr(args, "ca_hash", None):
        from atoll.node.ca_hash import fetch_ca

        tls_ca = fetch_ca(args.coordinator, token=token, ca_hash=args.ca_hash)
        log.info("verifying the coordinator and peers with the job CA it presented, which matches --ca-hash %s",
                 fingerprint(cert_from_pem(tls_ca, "the fetched job CA")))
    else:
        ca_path = find_ca(args.tls_ca, args.token_file, ca_hash_flag=True)
        tls_ca = ca_path.read_bytes()
        log.info("verifying the coordinator and peers with the job CA %s (%s; compare with the coordinator's log)",
                 ca_path, fingerprint(cert_from_pem(tls_ca, str(ca_path))))
    checkpoint_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else Path(args.state_dir) / "checkpoints"
    config = AgentConfig(coordinator=args.coordinator, token=token, state_dir=Path(args.state_dir),
                         checkpoint_dir=checkpoint_dir,
                         device=args.device, listen=None if args.no_listen else args.listen,
                         advertise=args.advertise, tls_ca=tls_ca,
                         profile=ProfileOptions(budget=timedelta(seconds=args.profile_seconds)),
                         reprofile=args.reprofile, region=args.region or "", machine=args.machine or "",
                         wan_latency=timedelta(milliseconds=args.wan_latency_ms))
    agent = NodeAgent(config)
    stopping: list[threading.Thread] = []
    main_done = threading.Event()

    def on_signal(sig: signal.Signals) -> None:
        # on a thread of its own (`handle_on_thread`): heard at once, even while the main thread is inside a call
        # into the backend that runs no Python until it returns. The first stops gracefully, the second cuts the
        # step in flight short, the third exits without waiting for anything
        if len(stopping) >= 2:
            log.warning("%s a third time: exiting at once", sig.name)
            logging.shutdown()
            os._exit(128 + int(sig))
        if not stopping:
            log.info("%s: this node leaves the job", sig.name)
        stopping.append(threading.Thread(target=agent.stop, daemon=True, name="atoll-node-stop"))
        stopping[-1].start()

    def exit_if_stuck() -> None:
        # once the node has stopped (left, its state handed over or kept; or refused by the coordinator), the main
        # thread has nothing left to wait for: if it is still inside a blocking call after STUCK_AFTER_STOP, the
        # process exits without it rather than hang on until that call's own timeout
        agent.wait_stopped()
        for t in list(stopping):
            t.join()
        if main_done.wait(STUCK_AFTER_STOP.total_seconds()):
            return
        log.error("this node has stopped, but its main thread is still blocked %.0fs later in %s, a call that "
                  "answers no signal until its own timeout (a process group waiting for a peer that is not coming, "
                  "say); exiting without waiting for it", STUCK_AFTER_STOP.total_seconds(),
                  stuck_main_thread() or "a call")
        logging.shutdown()
        os._exit(1)

    handle_on_thread((signal.SIGINT, signal.SIGTERM), on_signal)
    threading.Thread(target=exit_if_stuck, daemon=True, name="atoll-node-stuck").start()
    pruning = threading.Lock()

    def prune(before: int, keep: int) -> None:  # what no node needs any more, its own checkpoints and copies alike
        from atoll.node.checkpoint import prune_older

        with pruning:
            removed = prune_older(checkpoint_dir, before, keep=keep)
        if removed:
            log.info("pruned the checkpoints of steps %s here: the job holds newer complete ones",
                     ", ".join(map(str, removed)))

    agent.on_prune = prune

    tensorboard: dict = {}  # the node's TensorBoard log, opened at the first plan (the job names it)
    if getattr(args, "tensorboard", None):
        from atoll.node.tensorboard import check_available

        check_available()  # a flag asking for event files fails now, with what to install

    def on_plan(run: PlanRun) -> None:
        import torch

        from atoll.node.runner import follow_plan
        from atoll.node.tensorboard import open_log

        if "log" not in tensorboard:
            tensorboard["log"] = open_log(getattr(args, "tensorboard", None) or run.job.train.tensorboard_dir,
                                          agent.node_id)

        from atoll.node.wan import wan_delay

        finished = follow_plan(run, checkpoint_dir=checkpoint_dir, device=torch.device(args.device),
                               coordinator_host=args.coordinator.rsplit(":", 1)[0], token=token,
                               rpc=agent.peer_rpc,
                               wan_latency=lambda plan, peer: wan_delay(plan, agent.node_id, peer, config.region,
                                                                        config.wan_latency),
                               tensorboard=tensorboard["log"])
        if finished and not args.stay:
            log.info("the job is done; this node leaves and exits (--stay keeps it)")
            waiting = agent.undelivered()
            if waiting:  # the coordinator is away: it learns of the job's end from these once it is back
                log.info("waiting up to %.0fs for the coordinator to take this node's last %d report(s)",
                         config.final_reports.total_seconds(), waiting)
            threading.Thread(target=agent.stop, kwargs={"flush": config.final_reports}, daemon=True).start()

    def exit_when_idle_and_done() -> None:
        # a node the plan leaves idle has no last step of its own: it exits once the coordinator says the job
        # finished. A node running a stage exits from on_plan after its last checkpoint; one whose run failed
        # at the very end waits for a plan that never comes, so it is stopped after a grace period
        while not agent.stopped:
            if agent.job_finished.wait(1.0):
                plan = agent.plan
                if plan is None or not any(agent.node_id in s.nodes for p in plan.pipelines for s in p.stages):
                    log.info("the job has finished and the plan leaves this node idle; leaving and exiting "
                             "(--stay keeps it)")
                elif not agent._stop.wait(FINISHED_GRACE.total_seconds()):
                    log.warning("the job finished %.0fs ago and this node's run has not ended; leaving and exiting "
                                "(--stay keeps it)", FINISHED_GRACE.total_seconds())
                else:
                    return
                agent.stop()
                return

    if not args.stay:
        threading.Thread(target=exit_when_idle_and_done, daemon=True, name="atoll-node-done").start()

    try:
        agent.run(on_plan=on_plan)
    except AgentError as e:
        raise PermissionError(str(e)) from None
    except JobFinished as e:
        log.info("%s; this node exits", e)
        return 0
    finally:
        agent.stop()
        for t in stopping:  # a graceful leave hands its state over before the process exits
            t.join(config.handover.total_seconds() + 30.0)
        if tensorboard.get("log") is not None:  # flushes what is queued
            tensorboard["log"].close()
        main_done.set()
    return 0
