"""Fault injection for long runs of the tiny job: the driver of `bench.chaos` and `bench.churn`.

A `FaultDriver` runs one job on a `LocalCluster` (a coordinator and nodes as real `atoll` processes on this
machine) and injects events while it trains:

- `node-kill`: SIGKILL a random running node (its whole process group); restarted on its state dir (same node
  id) `restart_after` seconds after its kill or its detection (see the pace below), so the cluster keeps its
  size;
- `coordinator-kill`: SIGKILL the coordinator, restart it on the same state dir and address after `outage` s;
- `join`: start a new node;
- `leave`: SIGTERM a random node (a graceful leave); it is not restarted.

Events follow the cluster, not the clock: the first comes once the job has trained `first_at` steps, each
next one once the cluster is past the one before (`DriverConfig.pace`):

- "recovery": every node it should have is alive (a killed node restarted `restart_after` s after its kill),
  the newest plan accounts for all of them, and `gap_steps` whole steps are trained in it since;
- "detection": the event was detected (the killed node marked gone, or planned out) and the job trained
  `gap_steps` whole steps again since (in a newer plan when the node ran a stage); a killed node is restarted
  `restart_after` s after its death was detected, while the next events go on, and only nodes that joined
  since their start are picked. A coordinator kill still waits for a whole cluster, so that no join of a
  restarted node falls in its window.

The job's spec gives its learning-rate schedule (`train.steps`); while events remain, the driver keeps
`room_seconds` of training ahead of the newest step at the measured step rate (`atoll job extend`: steps past
the spec's train at its final rate), and once the last event is past it ends the job a few steps later
(`atoll job stop`). The undisturbed run of the same spec, run afterwards, is extended to the same end at its
start, so both train the same steps on the same batches at the same rates.

A monitor thread reads the coordinator's SQLite store (it stays readable while the coordinator is down)
every `poll` seconds: step reports, members and plans. From them, per event:

- detection: from the event until the coordinator marks the node gone/left, or publishes a plan without it
  (node kills and leaves); from the join until a plan names the new node (joins); coordinator kills: from the
  kill until every member has heartbeated the restarted coordinator;
- time to the next step: from the event (a join: its join) until the first whole step (one with a loss) is
  trained after it; for a node that ran a stage, in a newer plan than the one it ran;
- steps rolled back: how far the trained step went back in the event's window (`rolled_back`);
- bytes of state moved: what the nodes' logs say they fetched or received of other nodes' state in the
  window (`state_bytes`), or None where they say nothing.
"""

from __future__ import annotations

import argparse
import math
import random
import re
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

from atoll.coordinator.store import SqliteStore
from atoll.job import JobSpec
from atoll.launch.localcluster import LocalCluster, _signal_group, clear_run
from atoll.plan import Plan

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "tiny.toml"

KINDS = ("node-kill", "coordinator-kill", "join", "leave")
PACES = ("recovery", "detection")


@dataclass(frozen=True, kw_only=True)
class FaultSchedule:
    """How many events of each kind a run gets, in a random order drawn from `seed`."""

    node_kills: int = 0
    coordinator_kills: int = 0
    joins: int = 0
    leaves: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("node_kills", "coordinator_kills", "joins", "leaves"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def events(self) -> list[str]:
        kinds = (["node-kill"] * self.node_kills + ["coordinator-kill"] * self.coordinator_kills
                 + ["join"] * self.joins + ["leave"] * self.leaves)
        random.Random(self.seed).shuffle(kinds)
        return kinds


@dataclass(frozen=True, kw_only=True)
class DriverConfig:
    """The cluster, the job's length and the timing of the events."""

    nodes: int = 4
    """Nodes at the start."""
    gap_steps: int = 10
    """Whole steps trained in the newest plan after a recovery before the next event."""
    first_at: int = 20
    """The step after which the first event comes (the first plan's steps measured)."""
    min_steps: int = 150
    """Shortest job."""
    restart_after: float = 10.0
    """Seconds a killed node stays down before it is started again: after its kill (pace "recovery"; longer than
    the lease, so its death is detected as a death, not as a restart at a new address), or after its death was
    detected (pace "detection")."""
    outage: float = 5.0
    """Seconds the coordinator stays down (shorter than the lease: nodes keep their membership)."""
    lease: float = 8.0
    """The coordinator's lease (`atoll coordinator --lease`)."""
    recover_timeout: float = 300.0
    """Longest wait for the cluster to recover from an event before the run is given up."""
    pace: str = "recovery"
    """When the next event comes: "recovery" (the cluster whole again) or "detection" (the event detected and
    training going again); see the module's docstring."""
    room_seconds: float = 60.0
    """Seconds of training kept ahead of the newest step while events remain (`atoll job extend`), and the job
    stopped a few steps after the last event is past (`atoll job stop`). 0: the job's length is the spec's."""
    poll: float = 0.25
    """Seconds between two readings of the coordinator's store."""
    threads_per_node: int = 1
    profile_seconds: float = 1.0
    job: Path = TINY

    def __post_init__(self) -> None:
        if self.nodes < 2:
            raise ValueError(f"nodes must be >= 2 (a kill needs a survivor), got {self.nodes}")
        if self.gap_steps < 1 or self.first_at < 1 or self.min_steps < 10:
            raise ValueError("gap_steps and first_at must be >= 1 and min_steps >= 10")
        if not 0 < self.outage < self.lease:
            raise ValueError(f"outage ({self.outage}s) must be positive and shorter than the lease ({self.lease}s)")
        for name in ("recover_timeout", "poll", "profile_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.pace not in PACES:
            raise ValueError(f"pace must be one of {PACES}, got {self.pace!r}")
        if self.restart_after < 0 or self.room_seconds < 0:
            raise ValueError("restart_after and room_seconds must be >= 0")
        if 0 < self.room_seconds <= self.outage:
            raise ValueError(f"room_seconds ({self.room_seconds}) must be longer than the outage ({self.outage}s): "
                             f"the job is not extended while the coordinator is away")

    def event_seconds(self, kind: str) -> float:
        """A generous guess of the wall time an event of `kind` takes until the cluster is past it (a node's
        start: imports, profile, join; a plan; its set-up), for the run's time bound."""
        start = 15.0 + self.profile_seconds
        detect = self.lease + 10.0
        kill = detect if self.pace == "detection" else self.restart_after + start + 10.0
        return {"node-kill": kill, "coordinator-kill": self.outage + 10.0 + (start if self.pace == "detection" else 0),
                "join": start + 10.0, "leave": 20.0}[kind]


def write_job(cfg: DriverConfig, steps: int, path: Path) -> Path:
    """The tiny job, `steps` long, planned for `cfg.nodes` nodes, with a fixed codec (identity) so the losses of
    two runs differ only by what the faults did."""
    job = JobSpec.load(cfg.job)
    job = replace(job, train=replace(job.train, steps=steps),
                  compression=replace(job.compression, mode="identity"),
                  cluster=replace(job.cluster, expected_nodes=cfg.nodes, min_nodes=1),
                  outer=replace(job.outer, mode="sync"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(job.to_toml())
    return path


@dataclass
class Event:
    """One injected event and what it cost."""

    index: int
    kind: str
    at: float
    """Unix time of the event (a join: when its process was started)."""
    target: str = ""
    """Process name (node3) or "coordinator"."""
    node_id: str = ""
    role: str = ""
    """What the node ran in the plan of the moment: "stage 1 of 2, 1 other replica live", "idle", ..."""
    live_replica: bool = False
    """A node kill or leave whose stage had another replica alive."""
    epoch: int = 0
    """Plan epoch at the event."""
    step: int = -1
    """Highest whole step trained before the event."""
    until: float = 0.0
    """End of the event's window (the next event, or the end of the run)."""
    back_at: float = 0.0
    """Killed node restarted / coordinator restarted / joined node's join (unix time; 0: n/a)."""
    detection_s: float | None = None
    next_step_s: float | None = None
    rolled_back: int | None = None
    state_bytes: int | None = None
    trained_while_down: int | None = None
    """Coordinator kills: whole steps trained while it was down."""
    detected_at: float = 0.0
    """Unix time the driver saw the event detected (0: not yet); the figures are measured after the run."""
    note: str = ""


@dataclass
class RunRecord:
    """What the monitor read from the coordinator's store during a run."""

    steps: dict[tuple[str, int, int], tuple[float, int, float | None, int]] = field(default_factory=dict)
    """(node id, epoch, step) -> (unix time, step, loss, epoch) of every report."""
    plans: list[tuple[float, Plan, str]] = field(default_factory=list)
    """(created, plan, reason) of every plan."""
    left_alive: dict[str, float] = field(default_factory=dict)
    """node id -> the first time the store showed it not alive (reset when it is alive again)."""
    member_states: dict[str, str] = field(default_factory=dict)
    heard: dict[str, float] = field(default_factory=dict)
    """node id -> latest heartbeat time."""
    joined: dict[str, list[float]] = field(default_factory=dict)
    """node id -> every join time the store has shown for it (a restarted node joins again)."""
    gone_times: dict[str, list[float]] = field(default_factory=dict)
    """node id -> every time the store was first seen marking it not alive."""
    heard_log: dict[str, list[float]] = field(default_factory=dict)
    """node id -> every heartbeat time the store was seen holding (one per reading at most)."""
    target: int = 0
    """The step the job ends at, as the coordinator keeps it (the spec's, or as extended or stopped)."""
    finished: float = 0.0
    """When the coordinator recorded the job finished (0: not yet)."""
    _whole: tuple[int, list[tuple[float, int, int, float]]] | None = field(default=None, repr=False, compare=False)

    def reported(self) -> set[int]:
        """Steps some node reported trained (with a loss or without: a step whose loss all-reduce failed when a
        replica died has its optimizer step done but no loss)."""
        return {s for (_, s, _, _) in self.steps.values()}

    def whole_steps(self) -> list[tuple[float, int, int, float]]:
        """(unix time, step, epoch, loss) of every step with a loss, in time order, once per plan epoch (every
        replica of a last stage reports the step's loss: the first report stands for the step; a step trained again
        after a rollback is another epoch's) (computed once per record: a long run has tens of thousands, and the
        driver asks several times a poll)."""
        if self._whole is None or self._whole[0] != len(self.steps):
            first: dict[tuple[int, int], tuple[float, int, int, float]] = {}
            for (t, s, loss, e) in self.steps.values():
                if loss is not None and ((e, s) not in first or t < first[(e, s)][0]):
                    first[(e, s)] = (t, s, e, loss)
            self._whole = (len(self.steps), sorted(first.values()))
        return self._whole[1]

    def losses(self) -> dict[int, float]:
        """Each step's loss as last trained."""
        return {s: loss for _, s, _, loss in self.whole_steps()}


class Monitor:
    """Reads the coordinator's store every `poll` seconds into a `RunRecord` (a thread of its own)."""

    def __init__(self, db: Path, poll: float):
        self.db, self.poll = db, poll
        self.record = RunRecord()
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-monitor", daemon=True)

    def start(self) -> "Monitor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.read()  # the last reports

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.read()
            except Exception:  # noqa: BLE001 - the store is being created or written: read again next time
                continue

    def read(self) -> None:
        if not self.db.is_file():
            return
        store = SqliteStore(self.db, read_only=True)
        try:
            limit = 256
            while True:  # read back until the oldest report read was read before (row order, not report times:
                # the reports a node kept through a coordinator outage arrive late, stamped with their own times)
                batch = store.recent_steps(limit=limit)
                if (len(batch) < limit or limit >= store.recent_steps_kept
                        or (batch[0].node_id, batch[0].plan_epoch, batch[0].step) in self.record.steps):
                    break
                limit *= 4
            members = store.list_members()
            control = store.get_control()
            latest = store.latest_plan()  # the whole history is parsed again only when a plan was added
            known = self.record.plans[-1][1].epoch if self.record.plans else 0
            plans = store.plan_history() if latest is not None and latest.epoch != known else None
        finally:
            store.close()
        now = time.time()
        with self.lock:
            r = self.record
            for m in batch:
                r.steps[(m.node_id, m.plan_epoch, m.step)] = (m.unix_time, m.step, m.loss, m.plan_epoch)
            r.target = control.target_steps or r.target
            r.finished = control.finished_unix
            for m in members:
                r.heard[m.node_id] = m.last_heartbeat_unix
                log_ = r.heard_log.setdefault(m.node_id, [])
                if m.last_heartbeat_unix and (not log_ or log_[-1] != m.last_heartbeat_unix):
                    log_.append(m.last_heartbeat_unix)
                times = r.joined.setdefault(m.node_id, [])
                if m.joined_unix and m.joined_unix not in times:
                    times.append(m.joined_unix)
                if m.state != "alive":
                    if m.node_id not in r.left_alive:
                        r.left_alive[m.node_id] = now
                        r.gone_times.setdefault(m.node_id, []).append(now)
                else:
                    r.left_alive.pop(m.node_id, None)
                r.member_states[m.node_id] = m.state
            if plans is not None:
                r.plans = [(p.created_unix, p.plan, p.reason) for p in plans]

    def snapshot(self) -> RunRecord:
        with self.lock:
            r = self.record
            return RunRecord(steps=dict(r.steps), plans=list(r.plans), left_alive=dict(r.left_alive),
                             member_states=dict(r.member_states), heard=dict(r.heard),
                             joined={k: list(v) for k, v in r.joined.items()},
                             gone_times={k: list(v) for k, v in r.gone_times.items()},
                             heard_log={k: list(v) for k, v in r.heard_log.items()}, target=r.target,
                             finished=r.finished)


def plan_nodes(plan: Plan) -> set[str]:
    return {n for p in plan.pipelines for st in p.stages for n in st.nodes}


def role_of(plan: Plan | None, node_id: str, alive: set[str]) -> tuple[str, bool]:
    """(what `node_id` runs in `plan`, whether another replica of its stage is alive)."""
    if plan is None:
        return "no plan yet", False
    for p_index, p in enumerate(plan.pipelines):
        for s_index, st in enumerate(p.stages):
            if node_id in st.nodes:
                others = [n for n in st.nodes if n != node_id and n in alive]
                # another pipeline holding the same layers is a live copy too
                for q_index, q in enumerate(plan.pipelines):
                    if q_index != p_index:
                        others += [n for s in q.stages for n in s.nodes
                                   if n in alive and s.layers[0] <= st.layers[0] and st.layers[1] <= s.layers[1]]
                return (f"pipeline {p_index} stage {s_index} of {len(p.stages)} (layers {st.layers[0]}-{st.layers[1]}), "
                        f"{len(others)} live cop{'y' if len(others) == 1 else 'ies'} elsewhere"), bool(others)
    return "idle in the plan", False


def rolled_back(steps: list[tuple[float, int, int, float]], start: float, end: float) -> int:
    """How far the trained step went back within [start, end): the largest drop below the highest step trained
    so far (steps trained before `start` count as trained)."""
    high = max((s for t, s, _, _ in steps if t < start), default=-1)
    worst = 0
    for t, s, _, _ in steps:
        if start <= t < end:
            worst = max(worst, high + 1 - s)
            high = max(high, s)
    return worst


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(B|bytes|KB|kB|KiB|MB|MiB|GB|GiB)\b")
_STATE_LINE = re.compile(r"(?i)state transfer|\b(fetched|received|transferred|sent|streamed|copied|handed over)\b.*"
                         r"\b(state|weights|checkpoint|optimizer)\b")
_UNITS = {"b": 1, "bytes": 1, "kb": 1e3, "kib": 1024, "mb": 1e6, "mib": 2**20, "gb": 1e9, "gib": 2**30}
_LOG_TIME = re.compile(r"^(\d\d):(\d\d):(\d\d)\b")
"""Atoll's log lines start with the local time of day (`atoll.log`)."""


def _log_time(line: str, near: float) -> float | None:
    """Unix time of a log line stamped HH:MM:SS, on the day that puts it nearest to `near`."""
    m = _LOG_TIME.match(line)
    if m is None:
        return None
    h, mi, sec = (int(x) for x in m.groups())
    base = time.localtime(near)
    day = time.mktime((base.tm_year, base.tm_mon, base.tm_mday, h, mi, sec, 0, 0, -1))
    return min((day - 86400, day, day + 86400), key=lambda t: abs(t - near))


def log_lines(logs: list[Path]):
    """(log, line) of every line of the nodes' logs that exist (a node that never started has none)."""
    for log in logs:
        try:
            lines = log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            yield log, line


def state_bytes_in_logs(logs: list[Path], start: float, end: float) -> int | None:
    """Bytes of state the nodes' logs say they fetched, received or handed over within [start, end) (a line
    such as "state transfer: 123456 bytes from ..."), or None when no line in the window says so."""
    total, seen = 0, False
    for _, line in log_lines(logs):
        if not _STATE_LINE.search(line):
            continue
        size = _SIZE.search(line)
        t = _log_time(line, start)
        if size is None or t is None:
            continue
        # stamps have whole seconds: a line of the event's first second counts
        if int(start) <= t < end:
            seen = True
            total += int(float(size.group(1)) * _UNITS[size.group(2).lower()])
    return total if seen else None


class RunFailed(RuntimeError):
    """The disturbed run could not go on: the cluster did not recover from an event in time."""


class FaultDriver:
    """One run of the job under `out` with the events of `schedule` (none: the undisturbed run). `target`: the
    step the job ends at, when it is to end later than its spec says (extended at the start)."""

    def __init__(self, cfg: DriverConfig, job_path: Path, out: Path, *, seed: int = 0, target: int | None = None,
                 say=print):
        self.cfg, self.job_path, self.out = cfg, job_path, Path(out)
        self.job = JobSpec.load(job_path)
        self.target = self.job.train.steps
        """The step the job ends at (the spec's, or as this driver extended or stopped it)."""
        self._fixed_target = target
        self.rng = random.Random(seed)
        self.say = say
        clear_run(self.out)
        self.cluster = LocalCluster(job_path=job_path, out=self.out, threads_per_node=cfg.threads_per_node,
                                    profile_seconds=cfg.profile_seconds)
        self.coordinator_args = ["--lease", str(cfg.lease), "--island-threshold", "0.001"]
        self.monitor = Monitor(self.cluster.state_db, cfg.poll)
        self.running: list[str] = []
        """Names of the node processes that should be up."""
        self.started_at: dict[str, float] = {}
        """name -> when its process was (last) started."""
        self.down: dict[str, float] = {}
        """Killed nodes waiting for their restart: name -> when to start it (inf: once its death is detected)."""
        self._next_name = 1
        self.events: list[Event] = []
        self.started = 0.0
        self.finished: float | None = None
        self.not_injected = 0
        self._managed = False
        """Whether this driver moves the job's end (`room_seconds`): it then stops the job after the last event."""
        self._last_extend = 0.0

    # --- processes -----------------------------------------------------------------------------------

    def _start_node(self, name: str | None = None) -> str:
        if name is None:
            name = f"node{self._next_name}"
            self._next_name += 1
        self.cluster.start_node(name)
        self.started_at[name] = time.time()
        if name not in self.running:
            self.running.append(name)
        return name

    def node_id(self, name: str, wait: float = 60.0) -> str:
        path = self.out / name / "node_id"
        end = time.monotonic() + wait
        while time.monotonic() < end:
            if path.is_file() and path.read_text().strip():
                return path.read_text().strip()
            time.sleep(0.1)
        raise RunFailed(f"{name} wrote no node id within {wait:.0f}s; see {self.out}/{name}.log")

    def _check_processes(self) -> None:
        for name, proc in list(self.cluster.procs.items()):
            # a node exits 0 once the job is done (and leaves); any other exit is a failure
            if proc.poll() is not None and (name == "coordinator" or (name in self.running and proc.returncode != 0)):
                raise RunFailed(f"{name} exited with code {proc.returncode}; see {self.out}/{name}.log")

    def _restart_due(self, rec: RunRecord) -> None:
        now = time.time()
        for name, when in list(self.down.items()):
            e = next((e for e in reversed(self.events) if e.target == name and e.kind == "node-kill"), None)
            if math.isinf(when) and e is not None:  # pace "detection": restarted once its death was detected
                seen = detected_at(e, rec)
                if seen is None:
                    continue
                when = self.down[name] = seen + self.cfg.restart_after
            if now >= when:
                del self.down[name]
                self._start_node(name)
                if e is not None:
                    e.back_at = time.time()

    # --- the job's end ---------------------------------------------------------------------------------

    def _control(self, action: str, steps: int = 0):
        from atoll.launch.job import control_job
        from atoll.tls import bootstrap_rpc

        token = self.cluster.token
        rpc = None if self.cluster.insecure else bootstrap_rpc(token, self.cluster.ca_file.read_bytes())
        reply = control_job(self.cluster.address, action, steps=steps, token=token, rpc=rpc,
                            timeout=timedelta(seconds=10))
        self.target = reply.target_steps
        return reply

    def _keep_room(self, rec: RunRecord) -> None:
        """While events remain: extend the job when fewer than `room_seconds` of training are left at the rate
        of the last seconds."""
        if not self._managed or time.monotonic() - self._last_extend < 2.0:
            return
        steps = rec.whole_steps()
        high = self.high_step(rec)
        recent = [(t, s) for t, s, _, _ in steps if t >= time.time() - 10.0]
        rate = (len({s for _, s in recent}) / max(1.0, recent[-1][0] - recent[0][0])) if len(recent) > 1 else 5.0
        room = max(4 * self.cfg.gap_steps, int(rate * self.cfg.room_seconds))
        if self.target - (high + 1) >= room:
            return
        self._last_extend = time.monotonic()
        try:
            self._control("extend", room)
        except (ValueError, ConnectionError) as e:  # near the end already, or the coordinator is away
            self.say(f"  could not extend the job (at step {high} of {self.target}): {e}")

    # --- progress --------------------------------------------------------------------------------------

    def high_step(self, rec: RunRecord) -> int:
        return max((s for _, s, _, _ in rec.whole_steps()), default=-1)

    def complete(self, rec: RunRecord) -> bool:
        """The coordinator recorded the job finished (its last step reported)."""
        return rec.finished > 0

    def recovered(self, rec: RunRecord, since: float) -> bool:
        """Every node that should run is alive and heard from since `since`, the newest plan accounts for all of
        them and runs no other, and `gap_steps` whole steps of it were trained after `since`."""
        if self.down or not rec.plans:
            return False
        ids = {self.node_id(n) for n in self.running}
        if any(rec.member_states.get(i) != "alive" or rec.heard.get(i, 0.0) < since for i in ids):
            return False
        created, plan, _ = rec.plans[-1]
        # the plan accounts for every node (runs it, or leaves it idle on purpose) and runs only live ones
        planned = {n for i in plan.islands for n in i.nodes}
        if not plan_nodes(plan) <= ids or not ids <= planned:
            return False
        after = [s for t, s, e, _ in rec.whole_steps() if t > max(since, created) and e == plan.epoch]
        return len(after) >= self.cfg.gap_steps

    def joined_since_start(self, rec: RunRecord) -> list[str]:
        """Running nodes that are alive members and joined since their (re)start: the ones a kill may pick."""
        out = []
        for name in self.running:
            i = self.node_id(name)
            if rec.member_states.get(i) == "alive" and any(t >= self.started_at[name] - 1.0
                                                           for t in rec.joined.get(i, [])):
                out.append(name)
        return out

    def past(self, e: Event, rec: RunRecord) -> bool:
        """Pace "detection": `e` was detected and the job trained `gap_steps` whole steps again since (in a plan
        newer than the one the killed node ran); a coordinator kill: every member heard the new process."""
        steps = rec.whole_steps()
        if e.kind == "coordinator-kill":
            ids = {self.node_id(n) for n in self.running}
            if any(rec.heard.get(i, 0.0) < e.back_at for i in ids):
                return False
            e.detected_at = e.detected_at or time.time()
            after = [s for t, s, _, _ in steps if t > e.back_at]
        elif e.kind in ("node-kill", "leave"):
            seen = detected_at(e, rec)
            if seen is None:
                return False
            e.detected_at = seen
            named = e.role.startswith("pipeline")
            after = [s for t, s, ep, _ in steps if t > seen and (ep > e.epoch or not named)]
        else:  # a join: a plan accounts for the node (runs it, or leaves it idle on purpose, as `recovered`)
            naming = [t for t, p, _ in rec.plans if t >= e.at and e.node_id in {n for i in p.islands for n in i.nodes}]
            if not naming:
                return False
            after = [s for t, s, _, _ in steps if t > naming[0]]
        return len(after) >= self.cfg.gap_steps

    def ready_for(self, kind: str, rec: RunRecord, last_action: float) -> bool:
        """Whether the next event, of `kind`, may come now."""
        if self.high_step(rec) < self.cfg.first_at:
            return False
        if self.cfg.pace == "recovery" or not self.events or kind == "coordinator-kill":
            # a coordinator kill waits for a whole cluster: no join of a restarted node in its window
            return self.recovered(rec, last_action) and (not self.events or self.past(self.events[-1], rec)
                                                         or self.cfg.pace == "recovery")
        if not self.past(self.events[-1], rec):
            return False
        return kind not in ("node-kill", "leave") or len(self.joined_since_start(rec)) >= 2

    def _wait(self, what: str, until, timeout: float) -> RunRecord:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self._check_processes()
            rec = self.monitor.snapshot()
            self._restart_due(rec)
            if until(rec):
                return rec
            self._keep_room(rec)
            time.sleep(self.cfg.poll)
        raise RunFailed(f"timed out after {timeout:.0f}s waiting for {what}; logs in {self.out}")

    # --- events ----------------------------------------------------------------------------------------

    def _pick(self, rec: RunRecord) -> str:
        names = self.joined_since_start(rec) if self.cfg.pace == "detection" else self.running
        return self.rng.choice(sorted(names))

    def _event(self, kind: str, rec: RunRecord) -> Event:
        plan = rec.plans[-1][1] if rec.plans else None
        alive = {n for n, s in rec.member_states.items() if s == "alive"}
        e = Event(index=len(self.events) + 1, kind=kind, at=0.0, epoch=plan.epoch if plan else 0,
                  step=self.high_step(rec))
        if kind in ("node-kill", "leave"):
            name = self._pick(rec)
            e.target, e.node_id = name, self.node_id(name)
            e.role, e.live_replica = role_of(plan, e.node_id, alive)
            proc = self.cluster.procs[name]
            self.running.remove(name)
            e.at = time.time()
            if kind == "node-kill":
                _signal_group(proc, signal.SIGKILL)
                proc.wait(10)
                self.down[name] = (math.inf if self.cfg.pace == "detection"
                                   else time.time() + self.cfg.restart_after)
            else:
                _signal_group(proc, signal.SIGTERM)
                try:
                    proc.wait(60)
                except Exception:  # noqa: BLE001 - a leave that hangs is killed, and the note says so
                    _signal_group(proc, signal.SIGKILL)
                    proc.wait(10)
                    e.note = "did not exit within 60 s of SIGTERM; killed"
                del self.cluster.procs[name]
        elif kind == "coordinator-kill":
            e.target = "coordinator"
            e.at = time.time()
            self.cluster.kill_coordinator()
            time.sleep(self.cfg.outage)
            self.cluster.restart_coordinator(extra=self.coordinator_args)
            e.back_at = time.time()
        elif kind == "join":
            e.at = time.time()
            name = self._start_node()
            e.target, e.node_id = name, self.node_id(name)
        else:
            raise ValueError(f"unknown event kind {kind!r}; one of {KINDS}")
        return e

    def run(self, schedule: FaultSchedule, timeout: float) -> list[Event]:
        """Start the cluster, inject the events at their steps, wait for the job to finish; return the events."""
        kinds = schedule.events()
        cfg = self.cfg
        self.started = time.time()
        deadline = time.monotonic() + timeout
        try:
            self.cluster.start_coordinator(extra=self.coordinator_args)
            if self._fixed_target is not None and self._fixed_target > self.target:
                try:  # before any node hears the spec's end
                    self._control("extend", self._fixed_target - self.target)
                except (ValueError, ConnectionError, PermissionError) as e:
                    raise RunFailed(f"could not extend the job to step {self._fixed_target}: {e}") from None
            self._managed = bool(kinds) and cfg.room_seconds > 0
            self.monitor.start()
            for _ in range(cfg.nodes):
                self._start_node()
            last_action = time.time()
            for k, kind in enumerate(kinds):
                left = deadline - time.monotonic()
                what = (f"the cluster to recover and train {cfg.gap_steps} steps" if cfg.pace == "recovery" or
                        kind == "coordinator-kill" else f"the event before to be detected and {cfg.gap_steps} "
                        f"steps trained since")
                rec = self._wait(f"{what} (before event {k + 1}, {kind})",
                                 lambda r: self.complete(r) or self.ready_for(kind, r, last_action),
                                 min(left, cfg.recover_timeout))
                if self.complete(rec):
                    self.not_injected = len(kinds) - k
                    self.say(f"the job finished before event {k + 1}; {self.not_injected} event(s) not injected "
                             f"(a longer job: --steps, or more room: room_seconds)")
                    break
                e = self._event(kind, rec)
                self.events.append(e)
                self.say(f"  event {e.index}/{len(kinds)}: {e.kind} {e.target} at step {e.step} ({e.role or 'n/a'})")
                last_action = e.back_at or e.at
                if kind == "node-kill" and cfg.pace == "recovery":
                    # recovered means restarted too: wait for the restart before counting from it
                    self._wait("the killed node's restart", lambda r: e.target not in self.down,
                               cfg.restart_after + 30)
                    last_action = e.back_at
            if self._managed and self.events and not self.not_injected:
                last = self.events[-1]
                self._wait(f"the last event ({last.kind}) to be past", lambda r: self.complete(r)
                           or self.past(last, r), min(deadline - time.monotonic(), cfg.recover_timeout))
                self._managed = False
                if not self.complete(self.monitor.snapshot()):
                    try:
                        reply = self._control("stop")
                        self.say(f"  every event injected: the job ends at step {reply.target_steps}")
                    except (ValueError, ConnectionError) as e:  # ending already: it ends at its target
                        self.say(f"  every event injected; the job was not stopped ({e}): it ends at step "
                                 f"{self.target}")
            self._wait("the job to finish", self.complete, max(30.0, deadline - time.monotonic()))
            self.finished = time.time()
            self.target = self.monitor.snapshot().target or self.target
            # nodes leave on their own once the job is done, after their last reports reach the coordinator
            # (a replica's may come later than the step's first): stopping them at once would cut those off
            leave_by = time.monotonic() + 30.0
            while time.monotonic() < leave_by and any(
                    p.poll() is None for name, p in self.cluster.procs.items() if name != "coordinator"):
                time.sleep(0.2)
        finally:
            self.monitor.stop()
            self.cluster.stop()
        self.measure()
        return self.events

    # --- figures -----------------------------------------------------------------------------------------

    def measure(self) -> None:
        """Fill in each event's figures from what the monitor read."""
        rec = self.monitor.snapshot()
        steps = rec.whole_steps()
        end = self.finished or time.time()
        logs = sorted(self.out.glob("node*.log"))
        for i, e in enumerate(self.events):
            e.until = self.events[i + 1].at if i + 1 < len(self.events) else end
            e.rolled_back = rolled_back(steps, e.at, e.until)
            e.state_bytes = state_bytes_in_logs(logs, e.at, e.until)
            later = [(t, p) for t, p, _ in rec.plans if t >= e.at]
            if e.kind in ("node-kill", "leave"):
                seen = detected_at(e, rec, e.until)
                e.detection_s = seen - e.at if seen is not None else None
                named = e.role.startswith("pipeline")
                newer = [(t, s) for t, s, ep, _ in steps if t > e.at and (ep > e.epoch or not named)]
                e.next_step_s = newer[0][0] - e.at if newer else None
            elif e.kind == "join":
                joined = min((t for t in rec.joined.get(e.node_id, []) if e.at <= t < e.until), default=0.0)
                e.back_at = joined
                naming = [(t, p) for t, p in later if e.node_id in plan_nodes(p)]
                e.detection_s = naming[0][0] - joined if naming and joined else None
                if naming:
                    first = naming[0][1].epoch
                    newer = [t for t, s, ep, _ in steps if ep >= first and t > naming[0][0]]
                    e.next_step_s = newer[0] - joined if newer and joined else None
                    e.rolled_back = rolled_back(steps, naming[0][0], e.until)
                else:
                    e.note = (e.note + "; " if e.note else "") + "no plan named the node (idle or still joining)"
                    e.rolled_back = 0
            else:  # coordinator kill: from the kill until every member heartbeated the restarted process
                back = e.back_at
                # the members alive at the kill: heard within a lease before it
                members = [i for i, ts in rec.heard_log.items() if any(e.at - self.cfg.lease <= t < e.at for t in ts)]
                firsts = [next((t for t in rec.heard_log[i] if t >= back), None) for i in members]
                e.detection_s = (max(firsts) - e.at) if members and None not in firsts else None
                e.next_step_s = next((t - e.at for t, _, _, _ in steps if t > e.at), None)
                during = [s for t, s, _, _ in steps if e.at <= t < back]
                e.trained_while_down = len(during)
                replans = [p.epoch for t, p in later if t < e.until]
                e.note = (f"down {back - e.at:.1f}s, {len(during)} step(s) trained meanwhile"
                          + (f", new epoch(s) {replans}" if replans else ", no new epoch"))

    def summary_losses(self) -> dict[int, float]:
        return self.monitor.snapshot().losses()


def detected_at(e: Event, rec: RunRecord, until: float = math.inf) -> float | None:
    """When the coordinator was seen to know of node kill or leave `e`: it marked the node not alive, or (a node
    the plan ran) published a plan without it; None: not (yet) within [e.at, until)."""
    gone = [t for t in rec.gone_times.get(e.node_id, []) if e.at <= t < until]
    named = e.role.startswith("pipeline")
    without = [t for t, p, _ in rec.plans if e.at <= t < until and e.node_id not in plan_nodes(p)] if named else []
    seen = gone + without  # a plan that never named the node: its absence is no detection
    return min(seen) if seen else None


def final_loss(losses: dict[int, float], last: int = 10) -> float:
    """Mean loss of the job's last `last` steps (the same batches in every run)."""
    tail = sorted(losses)[-last:]
    return statistics.fmean(losses[s] for s in tail)


def fmt(x: float | int | None, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def event_table(events: list[Event]) -> list[str]:
    rows = [["#", "event", "target", "at step", "detect s", "next step s", "rolled back", "state bytes", "role / note"]]
    for e in events:
        rows.append([str(e.index), e.kind, e.target, str(e.step), fmt(e.detection_s), fmt(e.next_step_s),
                     fmt(e.rolled_back, "d"), fmt(e.state_bytes, ","), "; ".join(x for x in (e.role, e.note) if x)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def undisturbed(cfg: DriverConfig, job_path: Path, out: Path, timeout: float, *, target: int | None = None,
                say=print) -> dict[int, float]:
    """The same job on the same cluster without events, ending at `target` (default: the spec's end): its losses
    by step."""
    driver = FaultDriver(cfg, job_path, out, target=target, say=say)
    driver.run(FaultSchedule(), timeout)
    return driver.summary_losses()


@dataclass
class Outcome:
    """A disturbed run and an undisturbed run of the same job to the same end."""

    steps: int
    """The step the disturbed job ended at (the undisturbed one ends there too)."""
    base: dict[int, float]
    """The undisturbed run's loss by step ({} when it failed: `base_error`)."""
    driver: FaultDriver
    error: str
    """Why the disturbed run stopped short ("" when it finished)."""
    wall_s: float
    """Seconds the disturbed run took."""
    base_error: str = ""
    base_wall_s: float = 0.0

    @property
    def losses(self) -> dict[int, float]:
        """The disturbed run's loss by step, up to its end (a plan that failed may have trained past the step
        a stop then ended the job at, and been rolled back)."""
        return {s: loss for s, loss in self.driver.summary_losses().items() if s < self.steps}

    @property
    def missing(self) -> list[int]:
        """Steps of the job no node reported trained."""
        reported = self.driver.monitor.snapshot().reported()
        return [s for s in range(self.steps) if s not in reported]

    @property
    def completed(self) -> bool:
        """The coordinator recorded the job finished, through every event, and every step was reported."""
        return (not self.error and not self.driver.not_injected and self.driver.monitor.snapshot().finished > 0
                and not self.missing)


def run_pair(cfg: DriverConfig, schedule: FaultSchedule, out: Path, *, steps: int | None = None,
             timeout: float | None = None, say=print) -> Outcome:
    """Run the job (`steps`: its spec's steps, default `cfg.min_steps`) with the events of `schedule`, then
    undisturbed to the same end (skipped when the disturbed run failed)."""
    kinds = schedule.events()
    timeout = timeout or 600.0 + sum(cfg.event_seconds(k) for k in kinds) * 3
    job = write_job(cfg, steps or cfg.min_steps, out / "job.toml")
    driver = FaultDriver(cfg, job, out / "disturbed", seed=schedule.seed, say=say)
    t0 = time.monotonic()
    error = ""
    try:
        driver.run(schedule, timeout)
    except RunFailed as e:
        error = str(e)
        driver.measure()
    res = Outcome(steps=driver.target, base={}, driver=driver, error=error, wall_s=time.monotonic() - t0)
    say(f"disturbed run: {len(driver.events)} of {len(kinds)} event(s) in {res.wall_s:.0f}s, "
        f"{len(res.losses)} steps with a loss of {res.steps}" + (f"; FAILED: {error}" if error else ""))
    if error:
        res.base_error = "not run: the disturbed run failed"
        return res
    t0 = time.monotonic()
    try:
        res.base = undisturbed(cfg, job, out / "undisturbed", res.wall_s + 600.0, target=res.steps, say=say)
    except RunFailed as e:
        res.base_error = str(e)
    res.base_wall_s = time.monotonic() - t0
    say(f"undisturbed run to step {res.steps}: " + (f"FAILED: {res.base_error}" if res.base_error else
                                                   f"{len(res.base)} steps in {res.base_wall_s:.0f}s, final loss "
                                                   f"{final_loss(res.base):.4f}"))
    return res


# --- the command line both benchmarks share -------------------------------------------------------------

def bench_parser(doc: str, *, node_kills: int, restart_after: float, lease: float, out: str,
                 quick_help: str) -> argparse.ArgumentParser:
    """The arguments of a fault benchmark (`bench.chaos`, `bench.churn`); each adds its own events' counts."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--node-kills", "--kills", type=int, default=node_kills)
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="the job spec's steps (its learning-rate schedule; "
                                                            "default 150): the job is extended while events remain "
                                                            "and ends a few steps after the last")
    ap.add_argument("--gap-steps", type=int, default=10, help="steps trained after an event before the next")
    ap.add_argument("--restart-after", type=float, default=restart_after, help="seconds a killed node stays down")
    ap.add_argument("--lease", type=float, default=lease, help="the coordinator's lease (seconds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=None, help="bound of each run in seconds (default: from the "
                                                                "number of events)")
    ap.add_argument("--out", type=Path, default=Path("runs") / out)
    return ap


def run_bench(cfg: DriverConfig, schedule: FaultSchedule, args: argparse.Namespace, header: str,
              targets: int, before_table: Callable[[Outcome], None] | None = None) -> Outcome | None:
    """Run a fault benchmark's pair of runs and print its event table (`before_table` may refine the events'
    figures first); None (with `targets met: 0/N` printed) when the disturbed run failed before any event."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the cluster's processes are stopped too
    say = lambda s: print(s, flush=True)  # noqa: E731
    say(f"{header}; logs under {args.out}")
    res = run_pair(cfg, schedule, args.out, steps=args.steps, timeout=args.timeout, say=say)
    if res.error and not res.driver.events:
        print(f"targets met: 0/{targets} (missed: the disturbed run failed before its first event)")
        return None
    if before_table is not None:
        before_table(res)
    for line in event_table(res.driver.events):
        print(line)
    if res.missing:
        print(f"steps no node reported trained: {res.missing[:20]}{' ...' if len(res.missing) > 20 else ''}")
    return res


QUARANTINE_LINE = re.compile(r"node (\S+) is quarantined: (.+?); it is left out of the next plan")
"""What the coordinator logs when it quarantines a node (`atoll.coordinator.quarantine`)."""


def quarantines(logs: list[Path]) -> list[tuple[str, str]]:
    """(node, reason) of every quarantine these coordinator logs name (each log over all its lifetimes: a restarted
    coordinator appends to it); a log that does not exist names none."""
    found = []
    for log in logs:
        if log.exists():
            found += [(m.group(1), m.group(2)) for m in QUARANTINE_LINE.finditer(log.read_text(errors="replace"))]
    return found


def false_quarantines(res: Outcome) -> tuple[str, bool]:
    """Print the quarantines of both runs, all of them false (no node misbehaves in a fault benchmark: it is
    killed, restarted, joined or leaves), and return the target's (name, met)."""
    out = res.driver.out
    found = quarantines([out / "coordinator.log", out.parent / "undisturbed" / "coordinator.log"])
    print(f"quarantines: {len(found)} (no node misbehaves here: each would be false)"
          + "".join(f"\n  {node}: {why}" for node, why in found[:10]))
    return "0 false quarantines", not found


def print_targets(targets: dict[str, bool], res: Outcome) -> int:
    """Print the notes and `targets met: N/M`; the exit status (0: the run went through, whatever it met)."""
    if res.driver.not_injected:
        print(f"note: {res.driver.not_injected} event(s) were not injected: the job ended first")
    missed = [name for name, ok in targets.items() if not ok]
    print(f"targets met: {len(targets) - len(missed)}/{len(targets)}"
          + (f" (missed: {'; '.join(missed)})" if missed else ""))
    return 0
