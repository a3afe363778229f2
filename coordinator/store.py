"""The coordinator's state behind one interface: `MemoryStore` (tests) and `SqliteStore` (WAL, on disk).

What is kept: the job, members with their profiles, the latest measurement of each link, the islands,
the plan history, the checkpoint index, recent step metrics and the whole job's loss history
(`atoll.coordinator.history`: every step's loss, older steps merged into buckets). A coordinator restarted on the same
SQLite file resumes with the same job, members and plan epoch. Methods are thread-safe; returned
records are copies.
"""

from __future__ import annotations

import copy
import json
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

from atoll.coordinator.history import KEEP_FULL, MAX_BUCKETS, add_sample, compact, needs_compaction
from atoll.coordinator.history import Point as HistoryPoint
from atoll.coordinator.history import Sample as HistorySample
from atoll.plan import IslandInfo, Plan
from atoll.serde import step_metrics_from_proto, step_metrics_to_proto
from atoll.types import LayerTiming, LinkMeasurement, NodeProfile, StepMetrics
from atoll.v1 import atoll_pb2 as pb

MEMBER_STATES = ("alive", "gone", "left", "quarantined")
T = TypeVar("T")


class StoreError(RuntimeError):
    """The store refused an update (e.g. a plan epoch that does not increase)."""


@dataclass(kw_only=True)
class JobRecord:
    job_id: str
    name: str
    spec_toml: str
    created_unix: float = 0.0


@dataclass(kw_only=True)
class JobControlRecord:
    """What `atoll job stop/extend` changed of a job, and when it finished (`atoll.coordinator.job_control`)."""

    target_steps: int = 0
    """The step the job ends at; 0: the spec's `train.steps`."""
    stopped_unix: float = 0.0
    """When `atoll job stop` was given (0: never)."""
    finished_unix: float = 0.0
    """When the last step was reported (0: not yet)."""


@dataclass(kw_only=True)
class MemberRecord:
    """A node that joined the job."""

    node_id: str
    peer_address: str
    profile: NodeProfile
    state: str = "alive"
    """alive (holds a lease), gone (missed its lease), left (said goodbye), quarantined (out of every plan until
    an operator lets it back: `atoll.coordinator.quarantine`)."""
    joined_unix: float = 0.0
    last_heartbeat_unix: float = 0.0
    plan_epoch: int = 0
    """The epoch the node last said it runs."""
    step: int = 0
    reason: str = ""
    """Why the state last changed."""


def _shallow(x: T) -> T:
    c = object.__new__(type(x))
    c.__dict__.update(x.__dict__)
    return c


def copy_member(m: MemberRecord) -> MemberRecord:
    """A copy of `m` sharing nothing mutable with it, in a few microseconds (deepcopy takes a hundred)."""
    c = _shallow(m)
    c.profile = _shallow(m.profile)
    c.profile.layer_timings = [_shallow(t) for t in m.profile.layer_timings]
    return c


@dataclass(kw_only=True)
class CheckpointRecord:
    """One stage replica's report that it saved layers [layer_start, layer_end) at `step`."""

    step: int
    plan_epoch: int
    node_id: str
    layer_start: int
    layer_end: int
    path: str = ""
    bytes: int = 0
    data_position: int = 0
    reported_unix: float = 0.0


@dataclass(kw_only=True)
class OuterArrivalRecord:
    """A node's arrival at an outer round (`atoll.coordinator.outer`): its pseudo-gradients are ready to fetch."""

    round: int
    node_id: str
    group: int
    tokens: int
    epoch: int
    """The plan epoch when the round's first node arrived."""
    arrived_unix: float = 0.0


@dataclass(kw_only=True)
class StoredPlan:
    plan: Plan
    created_unix: float = 0.0
    reason: str = ""


@dataclass(kw_only=True)
class _Snapshot:
    job: JobRecord | None = None
    members: dict[str, MemberRecord] = field(default_factory=dict)
    links: dict[tuple[str, str], LinkMeasurement] = field(default_factory=dict)
    islands: list[IslandInfo] = field(default_factory=list)
    plans: list[StoredPlan] = field(default_factory=list)
    checkpoints: dict[tuple[int, int, str, int, int], CheckpointRecord] = field(default_factory=dict)
    steps: list[StepMetrics] = field(default_factory=list)
    history: dict[int, HistoryPoint] = field(default_factory=dict)
    history_bucketed: int = 0
    """The history's buckets cover the steps below this."""


class Store(ABC):
    """Coordinator state. One job per store."""

    recent_steps_kept: int = 2000

    # job
    @abstractmethod
    def get_job(self) -> JobRecord | None: ...
    @abstractmethod
    def put_job(self, job: JobRecord) -> None:
        """Record the job; a store holds one job, and putting another id raises StoreError."""

    # members
    @abstractmethod
    def put_member(self, member: MemberRecord) -> None:
        """Insert or replace a member (profile, address, state and times)."""
    @abstractmethod
    def get_member(self, node_id: str) -> MemberRecord | None: ...
    def peek_member(self, node_id: str) -> MemberRecord | None:
        """The store's own record of a member (read it, do not change it): no copy, for the checks every
        heartbeat makes."""
        return self.get_member(node_id)
    @abstractmethod
    def list_members(self) -> list[MemberRecord]:
        """All members, ordered by node id."""
    def members_view(self) -> Mapping[str, MemberRecord]:
        """Every member by id as it is now, without copying the records: they are the store's own and must not
        be changed. For the coordinator's loop, which reads thousands each round."""
        return {m.node_id: m for m in self.list_members()}

    @abstractmethod
    def heartbeat(self, node_id: str, now: float, plan_epoch: int, step: int) -> bool:
        """Renew a member's lease; False when the node is unknown. In O(1), and kept in memory until `flush`:
        a lease outlives a coordinator restart by the restart grace, not by its last heartbeat on disk."""

    def flush(self) -> None:
        """Write what is held in memory (the latest heartbeats) to disk."""
    @abstractmethod
    def set_member_state(self, node_id: str, state: str, reason: str) -> None: ...

    # links
    @abstractmethod
    def put_links(self, links: list[LinkMeasurement]) -> None:
        """Keep the latest measurement of each (src, dst)."""
    @abstractmethod
    def list_links(self) -> list[LinkMeasurement]: ...
    def links_view(self) -> list[LinkMeasurement]:
        """The links in `list_links`' order, as the store's own records (read them, do not change them): no copy
        of each, which at 10,000 members and their 50,000 links costs more than the reader's work."""
        return self.list_links()

    # islands
    @abstractmethod
    def put_islands(self, islands: list[IslandInfo]) -> None: ...
    @abstractmethod
    def get_islands(self) -> list[IslandInfo]: ...

    # plans
    @abstractmethod
    def add_plan(self, plan: Plan, created_unix: float, reason: str = "") -> None:
        """Append a plan; its epoch must exceed every stored one."""
    @abstractmethod
    def plan_history(self) -> list[StoredPlan]:
        """Every plan, oldest first."""

    def latest_plan(self) -> Plan | None:
        history = self.plan_history()
        return history[-1].plan if history else None

    def latest_epoch(self) -> int:
        plan = self.latest_plan()
        return plan.epoch if plan is not None else 0

    # checkpoints
    @abstractmethod
    def add_checkpoint(self, record: CheckpointRecord) -> None:
        """Index a stage's checkpoint (a repeated report of the same stage, step and epoch replaces it)."""
    @abstractmethod
    def list_checkpoints(self) -> list[CheckpointRecord]:
        """Ordered by step, epoch, layers."""
    @abstractmethod
    def drop_checkpoints(self, step: int, node_id: str) -> int:
        """Forget `node_id`'s files of the checkpoint of `step` (the node found them missing or unreadable); the
        number of records dropped."""

    # step metrics
    @abstractmethod
    def add_step(self, metrics: StepMetrics) -> None:
        """Keep the latest `recent_steps_kept` reports."""
    @abstractmethod
    def recent_steps(self, limit: int = 100) -> list[StepMetrics]:
        """The latest reports, oldest first."""

    # the whole job's loss history (atoll.coordinator.history)
    history_keep_full: int = KEEP_FULL
    """Newest steps of the history kept one row per step; older ones are merged into buckets."""
    history_max_buckets: int = MAX_BUCKETS
    """Most buckets the older steps are merged into (their width doubles as the job grows)."""

    @abstractmethod
    def add_history(self, sample: HistorySample) -> None:
        """Merge a step's loss, tokens/s and validation loss into the history (bounded, never truncated)."""
    @abstractmethod
    def history(self, newest: int | None = None) -> list[HistoryPoint]:
        """The whole history (or its `newest` rows), oldest step first."""

    # job control: non-abstract, kept in memory here; SqliteStore keeps it in its file
    def get_control(self) -> JobControlRecord:
        return copy.copy(getattr(self, "_control", None) or JobControlRecord())

    def put_control(self, control: JobControlRecord) -> None:
        self._control = copy.copy(control)

    # the devices' measured speed (atoll.coordinator.calibration): non-abstract, kept in memory here
    def get_speed(self) -> dict[str, float]:
        """Per node, the factor its profile was scaled by for the newest plan."""
        return dict(getattr(self, "_speed", None) or {})

    def put_speed(self, speed: Mapping[str, float]) -> None:
        """Replace the factors (those of the plan just published)."""
        self._speed = dict(speed)

    # machine probes' figures (atoll.coordinator.machineprobe): non-abstract, kept in memory here
    def get_machine_flows(self) -> dict[str, tuple[float | None, float]]:
        """Per machine, the per-flow bytes/s its last round measured (None: no flow got through) and when."""
        return dict(getattr(self, "_machine_flows", None) or {})

    def put_machine_flow(self, machine: str, bytes_per_s: float | None, measured_unix: float) -> None:
        """Keep a machine's newest round figure (replacing its last)."""
        if not hasattr(self, "_machine_flows"):
            self._machine_flows: dict[str, tuple[float | None, float]] = {}
        self._machine_flows[machine] = (bytes_per_s, measured_unix)

    # outer rounds (atoll.coordinator.outer): non-abstract, kept in memory here; SqliteStore keeps them in its file
    def add_outer_arrival(self, arrival: OuterArrivalRecord) -> None:
        """Record a node's arrival at a round (a repeated one replaces it)."""
        if not hasattr(self, "_outer_arrivals"):
            self._outer_arrivals: dict[tuple[int, str], OuterArrivalRecord] = {}
        self._outer_arrivals[(arrival.round, arrival.node_id)] = copy.copy(arrival)

    def put_outer_decision(self, round_: int, decision_json: str) -> None:
        """Keep a round's decision as it stands now (its JSON, `atoll.coordinator.outer.decision_to_json`)."""
        if not hasattr(self, "_outer_decisions"):
            self._outer_decisions: dict[int, str] = {}
        self._outer_decisions[round_] = decision_json

    def outer_rounds(self) -> tuple[list[OuterArrivalRecord], dict[int, str]]:
        """Every arrival kept (by round, then node) and round -> its decision's JSON."""
        arrivals = getattr(self, "_outer_arrivals", {})
        return ([copy.copy(arrivals[k]) for k in sorted(arrivals)], dict(getattr(self, "_outer_decisions", {})))

    def put_outer_group(self, name: str, progress_json: str) -> None:
        """Keep a replica group's outer counters (`atoll.coordinator.outer.GroupProgress.to_json`), by its name."""
        if not hasattr(self, "_outer_groups"):
            self._outer_groups: dict[str, str] = {}
        self._outer_groups[name] = progress_json

    def outer_groups(self) -> dict[str, str]:
        """Group name -> its counters' JSON."""
        return dict(getattr(self, "_outer_groups", {}))

    def drop_outer_rounds(self, before: int) -> None:
        """Forget the arrivals and decisions of the rounds before `before`."""
        for k in [k for k in getattr(self, "_outer_arrivals", {}) if k[0] < before]:
            del self._outer_arrivals[k]
        for r in [r for r in getattr(self, "_outer_decisions", {}) if r < before]:
            del self._outer_decisions[r]

    def close(self) -> None:
        """Release files."""


def _renew(members: dict[str, MemberRecord], node_id: str, now: float, plan_epoch: int, step: int) -> bool:
    """Record a heartbeat in a member table; records are replaced, never changed, so views stay consistent."""
    m = members.get(node_id)
    if m is None:
        return False
    m = members[node_id] = _shallow(m)  # (not copy.copy: a tenth of its time, on every heartbeat)
    m.last_heartbeat_unix, m.plan_epoch, m.step = now, plan_epoch, step
    return True


def _covering(rows, step: int) -> HistoryPoint | None:
    """The history row holding `step`: its own row, else the bucket whose range covers it."""
    best = None
    for r in rows:
        if r.first <= step < r.first + r.width and (best is None or r.width < best.width):
            best = r
    return best


def _check_state(state: str) -> None:
    if state not in MEMBER_STATES:
        raise ValueError(f"member state must be one of {MEMBER_STATES}, got {state!r}")


class MemoryStore(Store):
    """State in memory, for tests and throwaway runs."""

    def __init__(self) -> None:
        self._s = _Snapshot()
        self._lock = threading.Lock()

    def get_job(self) -> JobRecord | None:
        with self._lock:
            return copy.deepcopy(self._s.job)

    def put_job(self, job: JobRecord) -> None:
        with self._lock:
            if self._s.job is not None and self._s.job.job_id != job.job_id:
                raise StoreError(f"this store holds job {self._s.job.job_id}, not {job.job_id}")
            self._s.job = copy.deepcopy(job)

    def put_member(self, member: MemberRecord) -> None:
        _check_state(member.state)
        with self._lock:
            self._s.members[member.node_id] = copy_member(member)

    def get_member(self, node_id: str) -> MemberRecord | None:
        with self._lock:
            m = self._s.members.get(node_id)
            return copy_member(m) if m is not None else None

    def peek_member(self, node_id: str) -> MemberRecord | None:
        with self._lock:
            return self._s.members.get(node_id)

    def list_members(self) -> list[MemberRecord]:
        with self._lock:
            return [copy_member(self._s.members[k]) for k in sorted(self._s.members)]

    def members_view(self) -> Mapping[str, MemberRecord]:
        with self._lock:
            return dict(self._s.members)

    def heartbeat(self, node_id: str, now: float, plan_epoch: int, step: int) -> bool:
        with self._lock:
            return _renew(self._s.members, node_id, now, plan_epoch, step)

    def set_member_state(self, node_id: str, state: str, reason: str) -> None:
        _check_state(state)
        with self._lock:
            m = self._s.members.get(node_id)
            if m is not None:
                m = self._s.members[node_id] = copy.copy(m)
                m.state, m.reason = state, reason

    def put_links(self, links: list[LinkMeasurement]) -> None:
        with self._lock:
            for x in links:
                self._s.links[(x.src, x.dst)] = _shallow(x)

    def list_links(self) -> list[LinkMeasurement]:
        return [_shallow(x) for x in self.links_view()]

    def links_view(self) -> list[LinkMeasurement]:
        with self._lock:  # records are replaced on update, never changed, so a view stays as it was read
            return [self._s.links[k] for k in sorted(self._s.links)]

    def put_islands(self, islands: list[IslandInfo]) -> None:
        with self._lock:
            self._s.islands = copy.deepcopy(islands)

    def get_islands(self) -> list[IslandInfo]:
        with self._lock:
            return copy.deepcopy(self._s.islands)

    def add_plan(self, plan: Plan, created_unix: float, reason: str = "") -> None:
        with self._lock:
            last = self._s.plans[-1].plan.epoch if self._s.plans else 0
            if plan.epoch <= last:
                raise StoreError(f"plan epoch {plan.epoch} does not exceed the stored epoch {last}")
            self._s.plans.append(StoredPlan(plan=copy.deepcopy(plan), created_unix=created_unix, reason=reason))

    def plan_history(self) -> list[StoredPlan]:
        with self._lock:
            return copy.deepcopy(self._s.plans)

    def add_checkpoint(self, record: CheckpointRecord) -> None:
        key = (record.step, record.plan_epoch, record.node_id, record.layer_start, record.layer_end)
        with self._lock:
            self._s.checkpoints[key] = copy.deepcopy(record)

    def list_checkpoints(self) -> list[CheckpointRecord]:
        with self._lock:
            return [copy.deepcopy(self._s.checkpoints[k]) for k in sorted(self._s.checkpoints)]

    def drop_checkpoints(self, step: int, node_id: str) -> int:
        with self._lock:
            gone = [k for k in self._s.checkpoints if k[0] == step and k[2] == node_id]
            for k in gone:
                del self._s.checkpoints[k]
            return len(gone)

    def add_step(self, metrics: StepMetrics) -> None:
        with self._lock:
            self._s.steps.append(copy.deepcopy(metrics))
            del self._s.steps[:-self.recent_steps_kept]

    def recent_steps(self, limit: int = 100) -> list[StepMetrics]:
        with self._lock:
            return copy.deepcopy(self._s.steps[-limit:]) if limit > 0 else []

    def add_history(self, sample: HistorySample) -> None:
        with self._lock:
            rows = self._s.history
            row = rows.get(sample.step)
            if row is None and sample.step < self._s.history_bucketed:  # rows never overlap: one can cover it
                row = _covering(rows.values(), sample.step)
            if row is not None:
                del rows[row.first]
            new = add_sample(row, sample)
            rows[new.first] = new
            if needs_compaction(sum(1 for r in rows.values() if r.width == 1), self.history_keep_full):
                kept = compact(list(rows.values()), keep_full=self.history_keep_full,
                               max_buckets=self.history_max_buckets)
                self._s.history = {r.first: r for r in kept}
                self._s.history_bucketed = max((r.first + r.width for r in kept if r.width > 1), default=0)

    def load_history(self, points: list[HistoryPoint]) -> None:
        """Take `points` (another store's `history()`) as this store's history."""
        with self._lock:
            self._s.history = {p.first: p for p in points}
            self._s.history_bucketed = max((p.first + p.width for p in points if p.width > 1), default=0)

    def history(self, newest: int | None = None) -> list[HistoryPoint]:
        with self._lock:
            keys = sorted(self._s.history)
            return [self._s.history[k] for k in (keys if newest is None else keys[-newest:] if newest > 0 else [])]


# --- SQLite ---------------------------------------------------------------------------------------------

_SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS job (
    one INTEGER PRIMARY KEY CHECK (one = 1), job_id TEXT NOT NULL, name TEXT NOT NULL,
    spec_toml TEXT NOT NULL, created_unix REAL NOT NULL);
CREATE TABLE IF NOT EXISTS members (
    node_id TEXT PRIMARY KEY, peer_address TEXT NOT NULL, profile_json TEXT NOT NULL, state TEXT NOT NULL,
    joined_unix REAL NOT NULL, last_heartbeat_unix REAL NOT NULL, plan_epoch INTEGER NOT NULL,
    step INTEGER NOT NULL, reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS links (
    src TEXT NOT NULL, dst TEXT NOT NULL, bandwidth REAL NOT NULL, rtt REAL NOT NULL, probe_bytes INTEGER NOT NULL,
    measured_unix REAL NOT NULL, PRIMARY KEY (src, dst));
CREATE TABLE IF NOT EXISTS islands (one INTEGER PRIMARY KEY CHECK (one = 1), islands_json TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS plans (
    epoch INTEGER PRIMARY KEY, created_unix REAL NOT NULL, reason TEXT NOT NULL, plan_json TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints (
    step INTEGER NOT NULL, plan_epoch INTEGER NOT NULL, node_id TEXT NOT NULL, layer_start INTEGER NOT NULL,
    layer_end INTEGER NOT NULL, path TEXT NOT NULL, bytes INTEGER NOT NULL, data_position INTEGER NOT NULL,
    reported_unix REAL NOT NULL, PRIMARY KEY (step, plan_epoch, node_id, layer_start, layer_end));
CREATE TABLE IF NOT EXISTS steps (id INTEGER PRIMARY KEY AUTOINCREMENT, metrics BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS history (
    first INTEGER PRIMARY KEY, width INTEGER NOT NULL, epoch INTEGER NOT NULL, last INTEGER NOT NULL,
    count INTEGER NOT NULL, loss_min REAL NOT NULL, loss_sum REAL NOT NULL, loss_max REAL NOT NULL,
    tps_sum REAL NOT NULL, tps_count INTEGER NOT NULL, val_count INTEGER NOT NULL, val_min REAL NOT NULL,
    val_sum REAL NOT NULL, val_max REAL NOT NULL);
CREATE TABLE IF NOT EXISTS control (
    one INTEGER PRIMARY KEY CHECK (one = 1), target_steps INTEGER NOT NULL, stopped_unix REAL NOT NULL,
    finished_unix REAL NOT NULL);
CREATE TABLE IF NOT EXISTS speed (node_id TEXT PRIMARY KEY, factor REAL NOT NULL);
CREATE TABLE IF NOT EXISTS machine_flows (machine TEXT PRIMARY KEY, bytes_per_s REAL, measured_unix REAL NOT NULL);
CREATE TABLE IF NOT EXISTS outer_arrivals (
    round INTEGER NOT NULL, node_id TEXT NOT NULL, grp INTEGER NOT NULL, tokens INTEGER NOT NULL,
    epoch INTEGER NOT NULL, arrived_unix REAL NOT NULL, PRIMARY KEY (round, node_id));
CREATE TABLE IF NOT EXISTS outer_decisions (round INTEGER PRIMARY KEY, decision_json TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS outer_groups (name TEXT PRIMARY KEY, progress_json TEXT NOT NULL);
"""


def _profile_json(p: NodeProfile) -> str:
    return json.dumps(asdict(p), sort_keys=True)


def _profile_from_json(text: str) -> NodeProfile:
    d = json.loads(text)
    d["layer_timings"] = [LayerTiming(**t) for t in d.get("layer_timings", [])]
    return NodeProfile(**d)


class SqliteStore(Store):
    """State in one SQLite file in WAL mode; every update is its own transaction.

    synchronous=NORMAL under WAL loses nothing when the process is killed (only an OS crash may lose the
    last transactions), which is the failure a restarted coordinator must survive.
    """

    def __init__(self, path: str | Path, *, read_only: bool = False):
        """`read_only`: for a reader beside (or after) the coordinator: a test, the demo, a bench. It never writes,
        and, unlike a read-write connection that closes last, it leaves the write-ahead log in place: folding the
        log into the file and deleting it behind a killed coordinator would look, at its restart, like a log
        deleted after a crash (`atoll.coordinator.statedir`)."""
        from atoll.coordinator import integrity

        self.path = Path(path)
        self.read_only = read_only
        if not read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # a damaged file is refused, naming the way out, rather than read in part or recreated empty
        integrity.check_file(self.path)
        target = f"file:{self.path}?mode=ro" if read_only else self.path
        self._db = sqlite3.connect(target, check_same_thread=False, isolation_level=None, timeout=10.0,
                                   uri=read_only)
        try:
            self._open(integrity)
        except BaseException:
            self._db.close()
            raise

    def _open(self, integrity) -> None:
        try:
            self._db.execute("PRAGMA busy_timeout=10000")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, _SCHEMA_VERSION):
                raise StoreError(f"{self.path} has schema version {version}; this atoll reads {_SCHEMA_VERSION}. "
                                 f"Run the atoll version that wrote it, or use a new --state-dir")
            fresh = integrity.check_schema(self._db, self.path)
            if not fresh:
                integrity.check_rows(self._db, self.path, member=self._member, plan=Plan.from_json,
                                     islands=lambda text: [IslandInfo(**d) for d in json.loads(text)],
                                     states=MEMBER_STATES)
            if not self.read_only:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
                with self._lock:
                    self._db.executescript(_SCHEMA)
                    self._db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
        except sqlite3.DatabaseError as e:
            raise integrity.damaged(self.path, f"SQLite cannot read it ({e})") from None
        # members live in memory too: a heartbeat is a dict update, written to disk by `flush` (joins, leaves
        # and state changes are written at once, so no acknowledged one is lost to a crash)
        self._members = {r[0]: self._member(r) for r in self._read("SELECT * FROM members")}
        self._links = {(s, d): LinkMeasurement(src=s, dst=d, bandwidth_bytes_per_s=bw, rtt_seconds=rtt, probe_bytes=n,
                                               measured_unix=t)
                       for s, d, bw, rtt, n, t in self._read("SELECT * FROM links")}
        """The links too (written through): the islands and the metrics read all of them."""
        self._pending: dict[str, tuple[float, int, int]] = {}
        self._mem = threading.Lock()
        """Guards the in-memory tables only, never held across SQLite: a heartbeat never waits on the disk."""

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _write(self, sql: str, params: tuple = ()) -> sqlite3.Cursor:
        with self._tx() as db:
            return db.execute(sql, params)

    def _read(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def get_job(self) -> JobRecord | None:
        rows = self._read("SELECT job_id, name, spec_toml, created_unix FROM job")
        if not rows:
            return None
        job_id, name, spec, created = rows[0]
        return JobRecord(job_id=job_id, name=name, spec_toml=spec, created_unix=created)

    def put_job(self, job: JobRecord) -> None:
        current = self.get_job()
        if current is not None and current.job_id != job.job_id:
            raise StoreError(f"{self.path} holds job {current.job_id}, not {job.job_id}")
        self._write("INSERT OR REPLACE INTO job VALUES (1, ?, ?, ?, ?)",
                    (job.job_id, job.name, job.spec_toml, job.created_unix))

    def put_member(self, member: MemberRecord) -> None:
        _check_state(member.state)
        m = copy_member(member)
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO members VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (m.node_id, m.peer_address, _profile_json(m.profile), m.state, m.joined_unix,
                        m.last_heartbeat_unix, m.plan_epoch, m.step, m.reason))
            with self._mem:
                self._members[m.node_id] = m
                self._pending.pop(m.node_id, None)

    @staticmethod
    def _member(row: tuple) -> MemberRecord:
        node_id, addr, profile, state, joined, hb, epoch, step, reason = row
        return MemberRecord(node_id=node_id, peer_address=addr, profile=_profile_from_json(profile), state=state,
                            joined_unix=joined, last_heartbeat_unix=hb, plan_epoch=epoch, step=step, reason=reason)

    def get_member(self, node_id: str) -> MemberRecord | None:
        with self._mem:
            m = self._members.get(node_id)
        return copy_member(m) if m is not None else None

    def peek_member(self, node_id: str) -> MemberRecord | None:
        with self._mem:  # records are replaced on update, never changed under a reader
            return self._members.get(node_id)

    def list_members(self) -> list[MemberRecord]:
        with self._mem:
            members = [self._members[k] for k in sorted(self._members)]
        return [copy_member(m) for m in members]

    def members_view(self) -> Mapping[str, MemberRecord]:
        with self._mem:
            return dict(self._members)

    def heartbeat(self, node_id: str, now: float, plan_epoch: int, step: int) -> bool:
        with self._mem:
            if not _renew(self._members, node_id, now, plan_epoch, step):
                return False
            self._pending[node_id] = (now, plan_epoch, step)
            return True

    def flush(self) -> None:
        with self._mem:
            pending, self._pending = self._pending, {}
        if pending:
            with self._tx() as db:
                db.executemany("UPDATE members SET last_heartbeat_unix = ?, plan_epoch = ?, step = ? WHERE node_id = ?",
                               [(t, e, s, n) for n, (t, e, s) in pending.items()])

    def set_member_state(self, node_id: str, state: str, reason: str) -> None:
        _check_state(state)
        with self._tx() as db:
            db.execute("UPDATE members SET state = ?, reason = ? WHERE node_id = ?", (state, reason, node_id))
            with self._mem:
                m = self._members.get(node_id)
                if m is not None:
                    m = self._members[node_id] = copy.copy(m)
                    m.state, m.reason = state, reason

    def put_links(self, links: list[LinkMeasurement]) -> None:
        with self._tx() as db:
            db.executemany("INSERT OR REPLACE INTO links VALUES (?, ?, ?, ?, ?, ?)",
                           [(x.src, x.dst, x.bandwidth_bytes_per_s, x.rtt_seconds, x.probe_bytes, x.measured_unix)
                            for x in links])
            with self._mem:
                for x in links:
                    self._links[(x.src, x.dst)] = _shallow(x)

    def list_links(self) -> list[LinkMeasurement]:
        return [_shallow(x) for x in self.links_view()]

    def links_view(self) -> list[LinkMeasurement]:
        with self._mem:  # records are replaced on update, never changed, so a view stays as it was read
            return [self._links[k] for k in sorted(self._links)]

    def put_islands(self, islands: list[IslandInfo]) -> None:
        self._write("INSERT OR REPLACE INTO islands VALUES (1, ?)", (json.dumps([asdict(i) for i in islands]),))

    def get_islands(self) -> list[IslandInfo]:
        rows = self._read("SELECT islands_json FROM islands")
        return [IslandInfo(**d) for d in json.loads(rows[0][0])] if rows else []

    def add_plan(self, plan: Plan, created_unix: float, reason: str = "") -> None:
        with self._tx() as db:
            last = db.execute("SELECT COALESCE(MAX(epoch), 0) FROM plans").fetchone()[0]
            if plan.epoch <= last:
                raise StoreError(f"plan epoch {plan.epoch} does not exceed the stored epoch {last}")
            db.execute("INSERT INTO plans VALUES (?, ?, ?, ?)",
                       (plan.epoch, created_unix, reason, plan.to_json(indent=None)))

    def plan_history(self) -> list[StoredPlan]:
        return [StoredPlan(plan=Plan.from_json(js), created_unix=t, reason=r)
                for _, t, r, js in self._read("SELECT * FROM plans ORDER BY epoch")]

    def latest_plan(self) -> Plan | None:
        rows = self._read("SELECT plan_json FROM plans ORDER BY epoch DESC LIMIT 1")
        return Plan.from_json(rows[0][0]) if rows else None

    def add_checkpoint(self, record: CheckpointRecord) -> None:
        r = record
        self._write("INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (r.step, r.plan_epoch, r.node_id, r.layer_start, r.layer_end, r.path, r.bytes, r.data_position,
                     r.reported_unix))

    def list_checkpoints(self) -> list[CheckpointRecord]:
        rows = self._read("SELECT * FROM checkpoints ORDER BY step, plan_epoch, node_id, layer_start, layer_end")
        return [CheckpointRecord(step=s, plan_epoch=e, node_id=n, layer_start=a, layer_end=b, path=p, bytes=nb,
                                 data_position=dp, reported_unix=t) for s, e, n, a, b, p, nb, dp, t in rows]

    def drop_checkpoints(self, step: int, node_id: str) -> int:
        with self._tx() as db:
            return db.execute("DELETE FROM checkpoints WHERE step = ? AND node_id = ?", (step, node_id)).rowcount

    def add_step(self, metrics: StepMetrics) -> None:
        with self._tx() as db:
            cur = db.execute("INSERT INTO steps (metrics) VALUES (?)",
                             (step_metrics_to_proto(metrics).SerializeToString(),))
            db.execute("DELETE FROM steps WHERE id <= ?", (cur.lastrowid - self.recent_steps_kept,))

    def recent_steps(self, limit: int = 100) -> list[StepMetrics]:
        if limit <= 0:
            return []
        rows = self._read("SELECT metrics FROM steps ORDER BY id DESC LIMIT ?", (limit,))
        return [step_metrics_from_proto(pb.StepMetrics.FromString(blob)) for (blob,) in reversed(rows)]

    _HISTORY_COLUMNS = ("first", "width", "epoch", "last", "count", "loss_min", "loss_sum", "loss_max", "tps_sum",
                        "tps_count", "val_count", "val_min", "val_sum", "val_max")

    def add_history(self, sample: HistorySample) -> None:
        cols = ", ".join(self._HISTORY_COLUMNS)
        insert = f"INSERT INTO history ({cols}) VALUES ({', '.join('?' * len(self._HISTORY_COLUMNS))})"
        with self._tx() as db:
            # the row holding the step: its own, or the bucket whose range covers it
            found = db.execute(f"SELECT {cols} FROM history WHERE first <= ? ORDER BY first DESC LIMIT 1",
                               (sample.step,)).fetchone()
            row = self._history_point(found) if found else None
            if row is not None and not row.first <= sample.step < row.first + row.width:
                row = None
            if row is not None:
                db.execute("DELETE FROM history WHERE first = ?", (row.first,))
            db.execute(insert, self._history_values(add_sample(row, sample)))
            full = db.execute("SELECT COUNT(*) FROM history WHERE width = 1").fetchone()[0]
            if needs_compaction(full, self.history_keep_full):
                rows = [self._history_point(r) for r in db.execute(f"SELECT {cols} FROM history ORDER BY first")]
                kept = compact(rows, keep_full=self.history_keep_full, max_buckets=self.history_max_buckets)
                db.execute("DELETE FROM history")
                db.executemany(insert, [self._history_values(r) for r in kept])

    def history(self, newest: int | None = None) -> list[HistoryPoint]:
        cols = ", ".join(self._HISTORY_COLUMNS)
        if newest is None:
            return [self._history_point(r) for r in self._read(f"SELECT {cols} FROM history ORDER BY first")]
        rows = self._read(f"SELECT {cols} FROM history ORDER BY first DESC LIMIT ?", (max(0, newest),))
        return [self._history_point(r) for r in reversed(rows)]

    @classmethod
    def _history_point(cls, row: tuple) -> HistoryPoint:
        # SQLite stores an infinite REAL as such (the min/max of a row without that kind of report)
        return HistoryPoint(**dict(zip(cls._HISTORY_COLUMNS, row)))

    @classmethod
    def _history_values(cls, p: HistoryPoint) -> tuple:
        return tuple(getattr(p, c) for c in cls._HISTORY_COLUMNS)

    def get_control(self) -> JobControlRecord:
        rows = self._read("SELECT target_steps, stopped_unix, finished_unix FROM control")
        if not rows:
            return JobControlRecord()
        target, stopped, finished = rows[0]
        return JobControlRecord(target_steps=target, stopped_unix=stopped, finished_unix=finished)

    def put_control(self, control: JobControlRecord) -> None:
        self._write("INSERT OR REPLACE INTO control VALUES (1, ?, ?, ?)",
                    (control.target_steps, control.stopped_unix, control.finished_unix))

    def get_speed(self) -> dict[str, float]:
        return {n: float(f) for n, f in self._read("SELECT node_id, factor FROM speed")}

    def put_speed(self, speed: Mapping[str, float]) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM speed")
            db.executemany("INSERT INTO speed VALUES (?, ?)", sorted(speed.items()))

    def get_machine_flows(self) -> dict[str, tuple[float | None, float]]:
        return {m: (None if bw is None else float(bw), float(t))
                for m, bw, t in self._read("SELECT machine, bytes_per_s, measured_unix FROM machine_flows")}

    def put_machine_flow(self, machine: str, bytes_per_s: float | None, measured_unix: float) -> None:
        self._write("INSERT OR REPLACE INTO machine_flows VALUES (?, ?, ?)", (machine, bytes_per_s, measured_unix))

    def add_outer_arrival(self, arrival: OuterArrivalRecord) -> None:
        a = arrival
        self._write("INSERT OR REPLACE INTO outer_arrivals VALUES (?, ?, ?, ?, ?, ?)",
                    (a.round, a.node_id, a.group, a.tokens, a.epoch, a.arrived_unix))

    def put_outer_decision(self, round_: int, decision_json: str) -> None:
        self._write("INSERT OR REPLACE INTO outer_decisions VALUES (?, ?)", (round_, decision_json))

    def outer_rounds(self) -> tuple[list[OuterArrivalRecord], dict[int, str]]:
        arrivals = [OuterArrivalRecord(round=r, node_id=n, group=g, tokens=t, epoch=e, arrived_unix=u)
                    for r, n, g, t, e, u in self._read("SELECT round, node_id, grp, tokens, epoch, arrived_unix "
                                                       "FROM outer_arrivals ORDER BY round, node_id")]
        return arrivals, {r: text for r, text in self._read("SELECT round, decision_json FROM outer_decisions")}

    def put_outer_group(self, name: str, progress_json: str) -> None:
        self._write("INSERT OR REPLACE INTO outer_groups VALUES (?, ?)", (name, progress_json))

    def outer_groups(self) -> dict[str, str]:
        return {n: text for n, text in self._read("SELECT name, progress_json FROM outer_groups")}

    def drop_outer_rounds(self, before: int) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM outer_arrivals WHERE round < ?", (before,))
            db.execute("DELETE FROM outer_decisions WHERE round < ?", (before,))

    def close(self) -> None:
        try:
            self.flush()
        except sqlite3.Error:
            pass  # a closed or broken file: the heartbeats it held only renew leases, which restart grace covers
        with self._lock:
            self._db.close()
