"""The coordinator process: gRPC server (Coordinator + standard health service), Prometheus endpoint, and
the background loop that expires leases, forms islands and publishes plans.

The gRPC server is a `grpc.aio` one on an event loop thread of its own: plan watches wait there as coroutines,
holding no thread, and the unary calls run on its bounded thread pool.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import signal
import socket
import sqlite3
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from atoll.coordinator import backups, statedir
from atoll.coordinator.heap import settle_heap
from atoll.coordinator.drift import DriftOptions
from atoll.coordinator.netfit import CalibrationOptions
from atoll.coordinator.islands import IslandOptions
from atoll.coordinator.membership import MembershipOptions
from atoll.coordinator.metrics import CoordinatorMetrics
from atoll.coordinator.state import CoordinatorOptions, CoordinatorState, Planner, load_pinned_plan, pinned_planner
from atoll.coordinator.spill import SpillingStore
from atoll.coordinator.store import MemoryStore, SqliteStore, Store, StoreError
from atoll.fsutil import atomic_write_text
from atoll.inputs import input_path
from atoll.preflight import SetupError, check_listen, check_output_file, check_tls_pair, usable_state_dir
from atoll.job import JobSpec, resolve_token
from atoll.coordinator.watches import PlanWatches, add_coordinator_to_server
from atoll.coordinator.heartbeats import HeartbeatStreams
from atoll.coordinator.looplag import LoopLag
from atoll.coordinator.ca import JobAuthority
from atoll.coordinator.dashboard.access import ViewerToken
from atoll.tls import CertificateError
from atoll.rpc import AioServerHandle, RpcOptions, TlsIdentity, make_aio_server

if TYPE_CHECKING:
    from atoll.coordinator.dashboard.server import Dashboard

log = logging.getLogger("atoll.coordinator")

SERVICE_NAME = "atoll.v1.Coordinator"
DB_NAME = "coordinator.db"
TOKEN_NAME = "token"
METRICS_PERIOD_S = 1.0
IDLE_CONNECTION = timedelta(minutes=10)
"""A connection without a call this long is closed: a node's holds its heartbeat stream and plan watch, so only
idle clients (a finished `atoll status`, a plaintext peer that never calls) lose theirs."""


@dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """Where and how the coordinator process serves."""

    listen: str = "127.0.0.1:0"
    """HOST:PORT of the gRPC server; port 0 picks a free one."""
    state_dir: Path | None = None
    """Folder of the SQLite state; None keeps state in memory (lost on exit)."""
    metrics_port: int | None = None
    """Port of the Prometheus endpoint (0 picks one); None serves none."""
    metrics_host: str = "127.0.0.1"
    """Address the Prometheus endpoint binds."""
    rpc: RpcOptions = field(default_factory=RpcOptions)
    """Message limits, keepalive and TLS of the server."""
    tick: timedelta = timedelta(milliseconds=250)
    """Period of the background loop (leases, islands, planning, metrics)."""
    max_workers: int = 64
    """Server threads, which run the unary calls (join, heartbeat, reports, status). Plan watches hold none: they
    wait on the server's event loop."""
    max_watches: int = 20_000
    """Plan watches open at once (each node holds one, two while it reconnects); more are refused with
    RESOURCE_EXHAUSTED."""
    max_watch_life: timedelta = timedelta(minutes=10)
    """Longest life of one plan watch; it then ends and the node opens the next. Nodes' own deadline is shorter."""
    max_heartbeat_streams: int = 20_000
    """Heartbeat streams open at once (each node holds one, two while it reconnects); more are refused with
    RESOURCE_EXHAUSTED (a node then heartbeats with unary calls)."""
    rendezvous_host: str | None = None
    """Address the rendezvous store (torch's TCPStore, which cannot authenticate) binds and plans name: one only
    the nodes' private network reaches. None: the listen host (every interface for a wildcard listen)."""
    backup_every: timedelta | None = timedelta(minutes=5)
    """Interval of the store's online backups into state_dir/backups (None: none; no state_dir: none)."""
    backups_kept: int = 3
    """Backups kept (the newest); older ones are deleted as new ones are written."""
    dashboard_port: int | None = None
    """Port of the web dashboard (`atoll.coordinator.dashboard`; 0 picks one); None serves none."""
    dashboard_host: str = "127.0.0.1"
    """Address the dashboard binds: loopback by default. Any other is served over HTTPS with the coordinator's
    certificate when the coordinator serves TLS."""
    mutual_tls: bool = False
    """Serve mutual TLS under the job CA (`atoll.coordinator.ca`, kept in state_dir; in memory without one): nodes
    join with the token and a signing request, and every later call is checked against the node's certificate.
    False: plaintext, where any token holder can speak as any node (in-process tests, `--insecure`)."""

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics port must be in 0-65535, got {self.metrics_port}")
        if self.dashboard_port is not None and not 0 <= self.dashboard_port < 65536:
            raise ValueError(f"dashboard port must be in 0-65535, got {self.dashboard_port}")
        if self.tick <= timedelta(0):
            raise ValueError(f"tick must be positive, got {self.tick}")
        if self.max_workers < 4:
            raise ValueError(f"max_workers must be at least 4, got {self.max_workers}")
        if self.max_watches < 1:
            raise ValueError(f"max_watches must be at least 1, got {self.max_watches}")
        if self.max_watch_life <= timedelta(0):
            raise ValueError(f"max_watch_life must be positive, got {self.max_watch_life}")
        if self.max_heartbeat_streams < 1:
            raise ValueError(f"max_heartbeat_streams must be at least 1, got {self.max_heartbeat_streams}")
        if self.backup_every is not None and self.backup_every <= timedelta(0):
            raise ValueError(f"backup_every must be positive (or None for no backups), got {self.backup_every}")
        if self.backups_kept < 1:
            raise ValueError(f"backups_kept must be at least 1, got {self.backups_kept}")


WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def _rendezvous_store(listen: str, previous: str = ""):
    """The torch.distributed store the nodes of each plan epoch meet at, and its address for the plan.

    A listen address on all interfaces gives an empty host: nodes then use the host they dial the
    coordinator at. The store lives as long as this process. A coordinator restarted on its state dir binds
    the address its last plan names (`previous`) again, so that plan stays current: its process groups are
    formed already and need no store, and training goes on without a new epoch. When that port is taken, the
    store gets a new one, and the plan naming the old one is replaced by a new epoch.
    """
    import torch.distributed as dist

    host = listen.rsplit(":", 1)[0]
    bind = ("::" if host in ("::", "[::]") else "0.0.0.0") if host in WILDCARD_HOSTS else host.strip("[]")
    advertised = "" if host in WILDCARD_HOSTS else host
    port = 0
    if previous and previous.rsplit(":", 1)[0] == advertised:
        port = int(previous.rsplit(":", 1)[1])
    try:
        listener = _listen_socket(bind, port)
    except OSError as e:  # the port is taken: a new one, and a new epoch once nodes are back
        if not port:
            raise
        log.warning("the rendezvous port %d of the last plan is taken (%s); using a new one, so the next plan "
                    "starts from the last checkpoint", port, e)
        listener = _listen_socket(bind, 0)
    # torch's store would bind every interface whatever host it is given: it serves on the socket bound here, and
    # owns it from now on
    port = listener.getsockname()[1]
    store = dist.TCPStore(bind, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60),
                          master_listen_fd=listener.fileno())
    listener.detach()
    return store, f"{advertised}:{store.port}"


def _listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host` (an address or a name) and `port` only (0: a free one)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the port of a coordinator just killed
        sock.bind(addr)
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


class CoordinatorService:
    """A running coordinator. `start()` binds and starts the loop; `stop()` shuts everything down."""

    def __init__(self, *, job: JobSpec, token: str, config: ServiceConfig | None = None,
                 options: CoordinatorOptions | None = None, store: Store | None = None,
                 planner: Planner | None = None):
        self.config = config or ServiceConfig()
        self._state_dir: Path | None = None
        """The state dir whose `state.json` this service keeps (the one its own store is in)."""
        if store is None and self.config.state_dir is not None:
            # a dir it cannot read whole is refused before SQLite or the CA loader would start anew over it
            statedir.check(self.config.state_dir, mutual_tls=self.config.mutual_tls)
            # a full disk is served from memory, its writes queued until space returns (`atoll.coordinator.spill`)
            store = SpillingStore(SqliteStore(self.config.state_dir / DB_NAME))
            self._state_dir = self.config.state_dir
        self.store = store if store is not None else MemoryStore()
        store = self.store
        self.authority: JobAuthority | None = None
        if self.config.mutual_tls:
            self.authority = (JobAuthority.load_or_create(self.config.state_dir) if self.config.state_dir
                              else JobAuthority.in_memory())
        last = store.latest_plan()
        listen_host = self.config.listen.rsplit(":", 1)[0]
        if self.config.rendezvous_host is not None:
            listen_host = self.config.rendezvous_host
        elif listen_host in WILDCARD_HOSTS and self.config.mutual_tls:
            log.warning("the rendezvous store (torch TCPStore: no authentication) listens on every interface; keep "
                        "its port inside the nodes' network (firewall), or bind it there with --rendezvous-host")
        self.rendezvous_store, rendezvous = _rendezvous_store(f"{listen_host}:0",
                                                              last.rendezvous if last is not None else "")
        self.state = CoordinatorState(store=store, job=job, token=token, options=options, rendezvous=rendezvous,
                                      **({"planner": planner} if planner is not None else {}))
        if self._state_dir is not None:
            statedir.mark_open(self._state_dir, job_id=self.state.job.id,
                               ca_fingerprint=self.authority.fingerprint if self.authority is not None else "")
        self.newest_backup: backups.Backup | None = (backups.newest(backups.backup_folder(self._state_dir))
                                                     if self._state_dir is not None else None)
        """The newest backup of the store (shown by `atoll status`), None before the first."""
        self.state.newest_backup = lambda: ((str(self.newest_backup.path), self.newest_backup.taken_unix)
                                            if self.newest_backup is not None else None)
        self.viewer = ViewerToken(self._state_dir)
        """The dashboard's read-only token (`atoll job viewer-token`), kept in the state dir."""
        self.state.viewer_token = self.viewer.get_or_create
        self.dashboard: Dashboard | None = None
        self._backups = threading.Thread(target=self._run_backups, name="atoll-coordinator-backup", daemon=True)
        self.metrics = CoordinatorMetrics()
        self.health = health_aio.HealthServicer()
        self.watches = PlanWatches(self.state, max_watches=self.config.max_watches,
                                   max_life=self.config.max_watch_life)
        self.heartbeats = HeartbeatStreams(self.state, max_streams=self.config.max_heartbeat_streams,
                                           max_life=self.config.max_watch_life)
        self.loop_lag = LoopLag()
        """How late the server's event loop runs (heartbeats are answered there): lease expiry allows for it."""
        self._server: AioServerHandle | None = None
        self._metrics_server = None
        self.metrics_address: str | None = None
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._run_loop, name="atoll-coordinator-loop", daemon=True)

    @property
    def address(self) -> str:
        if self._server is None:
            raise RuntimeError("the coordinator is not started")
        return self._server.address

    def start(self) -> CoordinatorService:
        from atoll.coordinator.servicer import CoordinatorServicer

        servicer = CoordinatorServicer(self.state, self.watches, self.authority, self.heartbeats)
        rpc = self.config.rpc
        if self.authority is not None:  # the operator's own server certificate (--tls-cert), else the CA's
            own = (TlsIdentity(Path(rpc.tls_key).read_bytes(), Path(rpc.tls_cert).read_bytes())
                   if rpc.tls_cert is not None and rpc.tls_key is not None else None)
            rpc = replace(rpc, mtls=self.authority.server_tls(self.state.token, own))
        # past the watches and heartbeat streams, room for a queue of unary calls a few times the threads deep
        streams = self.config.max_watches + self.config.max_heartbeat_streams
        self._server = make_aio_server(
            self.config.listen,
            [lambda s: add_coordinator_to_server(servicer, s),  # plans serialized once for every watch
             lambda s: health_pb2_grpc.add_HealthServicer_to_server(self.health, s)],
            rpc, max_workers=self.config.max_workers,
            maximum_concurrent_rpcs=streams + 4 * self.config.max_workers,
            # a heartbeat from every node may arrive while the loop is busy (a plan sent to every watch): gRPC holds
            # them for the loop instead of dropping those past its default 1,000 (which the nodes saw as CANCELLED)
            max_pending_calls=streams + 4 * self.config.max_workers)
        for name in ("", SERVICE_NAME):
            self._server.run(self.health.set(name, health_pb2.HealthCheckResponse.SERVING))
        self.loop_lag.start(self._server.loop)
        self.state.stalled = self.loop_lag.recent
        if self.config.metrics_port is not None:
            from prometheus_client import start_http_server

            self._metrics_server, _ = start_http_server(self.config.metrics_port, self.config.metrics_host,
                                                        registry=self.metrics.registry)
            port = self._metrics_server.server_address[1]
            self.metrics_address = f"{self.config.metrics_host}:{port}"
        if self.config.dashboard_port is not None:
            self.dashboard = self._start_dashboard(rpc)
        self.metrics.update(self.state)
        self._loop.start()
        if self._state_dir is not None and self.config.backup_every is not None:
            self._backups.start()
        log.info("coordinator of job %s (%s) listening on %s%s; plan epoch %d, %d members known",
                 self.state.job.id, self.state.job.name, self.address,
                 (f", metrics on http://{self.metrics_address}/metrics" if self.metrics_address else "")
                 + (f", dashboard on {self.dashboard.url}" if self.dashboard is not None else ""),
                 self.state.epoch, len(self.store.list_members()))
        return self

    def _start_dashboard(self, rpc: RpcOptions) -> Dashboard:
        from atoll.coordinator.dashboard.server import Dashboard, tls_context

        host = self.config.dashboard_host
        tls = None
        if host not in LOOPBACK_HOSTS and self.authority is not None:  # exposed: HTTPS with the coordinator's cert
            own = rpc.mtls.identity if rpc.mtls is not None else self.authority.server
            tls = tls_context(own.key_pem, own.cert_pem)
        elif host not in LOOPBACK_HOSTS:
            log.warning("INSECURE: the dashboard on %s is plain HTTP (the coordinator runs --insecure): the token "
                        "that opens it crosses the network in the clear", host)
        return Dashboard(self.state, host=host, port=self.config.dashboard_port, viewer=self.viewer, tls=tls).start()

    def _run_loop(self) -> None:
        last_metrics = 0.0
        while not self._stop.wait(self.config.tick.total_seconds()):
            try:
                events = self.state.tick()
                if self.dashboard is not None:
                    self.dashboard.note_tick(events)
                now = time.monotonic()
                # scrapes are rarer than ticks; without an endpoint nobody reads the gauges (thousands of members
                # make an update cost a good part of a core)
                if self._metrics_server is not None and (events or now - last_metrics >= METRICS_PERIOD_S):
                    self.metrics.update(self.state)
                    self.metrics.loop_lag.set(self.loop_lag.recent(60.0))
                    last_metrics = now
            except Exception:  # noqa: BLE001 - the loop must outlive one bad round; the log says what failed
                log.exception("coordinator loop round failed")

    def backup(self) -> backups.Backup:
        """Take a backup of the store now (the backup thread's work, at its interval)."""
        assert self._state_dir is not None, "backups are of a store in a state dir"
        taken = backups.take(self._state_dir / DB_NAME, backups.backup_folder(self._state_dir),
                             keep=self.config.backups_kept)
        self.newest_backup = taken
        return taken

    def _run_backups(self) -> None:
        assert self.config.backup_every is not None
        while not self._stop.wait(self.config.backup_every.total_seconds()):
            try:
                taken = self.backup()
                log.debug("backed the store up to %s", taken.path)
            except (OSError, sqlite3.Error) as e:  # a full disk, say: the store itself goes on
                log.warning("the store's backup failed (%s); the next is tried in %s", e, self.config.backup_every)

    def stop(self) -> None:
        self._stop.set()
        self.loop_lag.stop()
        if self._server is not None:
            self._server.run(self.health.enter_graceful_shutdown())
        self.state.close()  # ends plan watches, so the server's grace period is not spent waiting on them
        if self._server is not None:  # and heartbeat streams, which wait for their nodes' next heartbeat
            self._server.loop.call_soon_threadsafe(self.heartbeats.close_all)
        if self._server is not None:
            self._server.stop()
        self.watches.close()
        if self._loop.is_alive():
            self._loop.join(timeout=5)
        if self._backups.is_alive():
            self._backups.join(timeout=30)
        if self.dashboard is not None:
            self.dashboard.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self.store.close()
        if self.authority is not None:
            self.authority.close()
        if self._state_dir is not None:
            statedir.mark_closed(self._state_dir)  # the store closed whole: its log is folded in and gone

    def __enter__(self) -> CoordinatorService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def load_or_create_token(state_dir: Path | None, given: str | None) -> tuple[str, str]:
    """(token, where it came from). Without a given token, reuse the one kept in the state dir or make one."""
    if given:
        return given, "given"
    if state_dir is not None:
        path = state_dir / TOKEN_NAME
        if path.is_file():
            kept = path.read_text(encoding="utf-8").strip()
            if not kept:
                raise SetupError(f"{path} is empty: delete it to have a new token made, or write the job's token on "
                                 f"its first line")
            return kept, str(path)
        token = secrets.token_urlsafe(24)
        state_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, token + "\n", mode=0o600)
        return token, f"{path} (new)"
    return secrets.token_urlsafe(24), "generated for this run"


def run_coordinator_cli(args: argparse.Namespace) -> int:
    """`atoll coordinator`: serve until SIGINT/SIGTERM."""
    job = JobSpec.load(input_path(args.job))
    if job.checkpoint.interval == 0:
        log.warning("the job writes no checkpoints (checkpoint.interval = 0): a fault that takes every holder of a "
                    "layer restarts it from step 0, and `atoll export` has nothing to export; set [checkpoint] "
                    "interval in the job spec to keep them")
    given_token = resolve_token(None, args.token_file)  # (a missing --token-file is said before any folder is made)
    state_dir = usable_state_dir(Path(args.state_dir))  # setup mistakes: one line each, before anything starts
    check_listen(args.listen, "--listen")
    if args.rendezvous_host:
        host = args.rendezvous_host
        check_listen(f"[{host}]:0" if ":" in host and not host.startswith("[") else f"{host}:0", "--rendezvous-host")
    if args.metrics_port is not None:
        check_listen(f"{args.metrics_host}:{args.metrics_port}", "--metrics-host/--metrics-port")
    if getattr(args, "dashboard_port", None) is not None:
        check_listen(f"{args.dashboard_host}:{args.dashboard_port}", "--dashboard-host/--dashboard-port")
    if args.address_file:
        check_output_file(Path(args.address_file), "--address-file")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SetupError("--tls-cert and --tls-key go together: give both, or neither (the job CA then signs the "
                         "coordinator's certificate)")
    if args.tls_cert:
        check_tls_pair(Path(args.tls_cert), Path(args.tls_key))
    if args.start_fresh and args.restore:
        raise SetupError("--start-fresh and --restore exclude each other: --start-fresh begins a new job, --restore "
                         "brings a backup of this one back")
    if args.start_fresh:
        aside = statedir.start_fresh(state_dir)
        log.warning("--start-fresh: %s; a new job starts in %s", f"the old state is in {aside}" if aside else
                    "there was no state to set aside", state_dir)
    if args.restore:
        try:
            aside = backups.restore(Path(args.restore), state_dir)
        except backups.RestoreError as e:
            log.error("%s", e)
            return 2
        log.warning("--restore: the store of %s is back in %s%s", args.restore, state_dir,
                    f" (the one it replaced is in {aside})" if aside else "")
    token, origin = load_or_create_token(state_dir, given_token)
    if origin == "given":
        origin = f"--token-file {args.token_file}" if args.token_file else "$ATOLL_TOKEN"
    if not args.heartbeat_budget >= 0:
        log.error("--heartbeat-budget must be a number of heartbeats a second, or 0 for a fixed cadence; got %s",
                  args.heartbeat_budget)
        return 2
    try:
        drift = DriftOptions(enabled=args.drift_every > 0, threshold=args.drift[0], min_gain=args.drift[1],
                             interval=timedelta(seconds=args.drift_every if args.drift_every > 0 else 60.0))
    except ValueError as e:
        log.error("--drift FACTOR GAIN: %s (e.g. --drift 1.25 0.10)", e)
        return 2
    rpc = RpcOptions(tls_cert=Path(args.tls_cert) if args.tls_cert else None,
                     tls_key=Path(args.tls_key) if args.tls_key else None,
                     handshake_timeout=timedelta(seconds=args.handshake_timeout), max_connections=args.max_connections,
                     max_connection_idle=IDLE_CONNECTION)
    options = CoordinatorOptions(membership=MembershipOptions(
                                     lease=timedelta(seconds=args.lease),
                                     join_settle=timedelta(seconds=min(args.join_settle, 60.0))),
                                 islands=IslandOptions(relative_threshold=args.island_threshold),
                                 heartbeat_budget=args.heartbeat_budget or None, drift=drift,
                                 calibration=CalibrationOptions(enabled=getattr(args, "network_fit", True)))
    config = ServiceConfig(listen=args.listen, state_dir=state_dir, metrics_port=args.metrics_port,
                           metrics_host=args.metrics_host, rpc=rpc, mutual_tls=not args.insecure,
                           dashboard_port=getattr(args, "dashboard_port", None),
                           dashboard_host=getattr(args, "dashboard_host", "127.0.0.1"),
                           rendezvous_host=args.rendezvous_host,
                           backup_every=timedelta(seconds=args.backup_every) if args.backup_every > 0 else None,
                           backups_kept=args.backups_kept)
    if args.insecure:
        log.warning("INSECURE: --insecure serves plaintext gRPC without node certificates: anyone on the network "
                    "reads the job token and every tensor, and any token holder can speak as any node. Use it only "
                    "in a closed lab")
    planner = None
    if args.plan:
        try:
            planner = pinned_planner(load_pinned_plan(Path(args.plan), job))
        except ValueError as e:
            log.error("--plan: %s", e)
            return 2
        log.info("publishing the pinned plan of %s while every node it names is alive", args.plan)
    try:
        service = CoordinatorService(job=job, token=token, config=config, options=options, planner=planner).start()
    except statedir.UnreadableState as e:  # a store, log, CA or identities file missing or cut short
        log.error("%s", e)
        return 2
    except StoreError as e:  # a state dir of another job or version: one line saying what to do
        log.error("%s: %s", state_dir, e)
        return 2
    except CertificateError as e:  # a damaged CA in the state dir
        log.error("%s", e)
        return 2
    settle_heap()  # the process is the coordinator's alone: start-up's objects leave the collector's scans
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # `kill -USR1 <pid>`: measure every link again (after a network change, say)
    signal.signal(signal.SIGUSR1, lambda *_: service.state.request_reprobe(service.state.clock()))
    try:
        if args.address_file:
            atomic_write_text(Path(args.address_file), service.address + "\n")
        host, port = service.address.rsplit(":", 1)
        dial = socket.gethostname() if host in ("0.0.0.0", "[::]") else host
        if service.authority is not None:
            log.info("job CA %s (%s); nodes verify the coordinator and each other with it. Start nodes with: "
                     "atoll node --coordinator %s:%s --token-file <copy of the token> --ca-hash %s (or --tls-ca "
                     "<copy of %s>; token from %s)", service.authority.ca_path, service.authority.fingerprint, dial,
                     port, service.authority.fingerprint, service.authority.ca_path, origin)
        else:
            log.info("job token from %s; start nodes with: atoll node --coordinator %s:%s --token-file <file holding "
                     "the token> --insecure", origin, dial, port)
        while not stop.wait(1.0):
            pass
        log.info("stopping")
    finally:
        service.stop()
    return 0
