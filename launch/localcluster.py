"""A coordinator and nodes as local processes: what `atoll demo`, the end-to-end tests and the benchmark run.

Each process is the real command (`python -m atoll coordinator|node ...`) a person would start on its
own machine; here they share this one, talk gRPC over loopback and write their logs into one folder.
Given a `Host` (a `bench/geo.py` testbed host), a process runs there instead: in the host's network
namespace and CPU quota, listening on its address, in its region.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Protocol

from atoll.fsutil import atomic_write_text


class Host(Protocol):
    """Somewhere other than this machine's loopback to run a process: a testbed host (`bench.geo.GeoHost`)."""

    region: str
    """Region of the nodes started here (`--region`)."""
    ip: str
    """Address processes here listen on and advertise."""
    wan_latency_ms: float
    """One-way latency to other regions that nodes started here emulate (`--wan-latency-ms`)."""

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` on the host."""
        ...

    def reach(self, address: str) -> str:
        """An address this process can dial for `address` as seen from the host."""
        ...


class ProcessExited(RuntimeError):
    """A process of the cluster exited while it was still needed; the message names it and its log."""


def _tail(log: Path, lines: int, width: int | None = 220) -> list[str]:
    """The last `lines` non-blank lines a process logged, each cut to `width` characters (None: whole)."""
    try:
        text = [line.rstrip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except FileNotFoundError:
        return []
    return [line if width is None or len(line) <= width else line[:width] + " ..." for line in text[-lines:]]


def _last_line(log: Path) -> str:
    """The last line a process logged (its error, when it failed), for a one-line report."""
    return "".join(_tail(log, 1, width=None)).strip()


@dataclass
class LocalCluster:
    """Processes of one job under `out`: coordinator state, node state dirs, shared checkpoints, logs."""

    job_path: Path
    out: Path
    threads_per_node: int = 1
    """torch threads per node: nodes sharing a machine must split its cores."""
    profile_seconds: float = 3.0
    """Time budget of each node's start-up profile (more repeats, steadier medians)."""
    insecure: bool = False
    """Plaintext gRPC everywhere (`--insecure`); by default mutual TLS under the coordinator's job CA."""
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    address: str = ""
    status_address: str = ""
    """Where this process asks the coordinator for its status: `address`, or a relay into its host."""
    _losses: dict[int, float] = field(default_factory=dict, repr=False)
    _loss_times: dict[int, float] = field(default_factory=dict, repr=False)
    _merged: set[tuple[str, int, int]] = field(default_factory=set, repr=False)
    """(node id, plan epoch, step) of every report `losses` has merged."""
    _previous_sigterm: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.token_file = self.out / "token"
        if not self.token_file.is_file() or not self.token_file.read_text().strip():
            # atomic, and 0600 from the first byte: a later run reuses the file
            atomic_write_text(self.token_file, secrets.token_hex(16), mode=0o600)
        self.checkpoints = self.out / "checkpoints"

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    @property
    def ca_file(self) -> Path:
        """The job CA the coordinator keeps in its state dir; nodes and status verify it with this file."""
        return self.out / "coordinator" / "ca.pem"

    def _tls_args(self) -> list[str]:
        return ["--insecure"] if self.insecure else ["--tls-ca", str(self.ca_file)]

    @property
    def state_db(self) -> Path:
        return self.out / "coordinator" / "coordinator.db"

    def _spawn(self, name: str, args: list[str], host: Host | None = None,
               env_extra: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.out / f"{name}.log", "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(self.threads_per_node), **(env_extra or {})}
        popen = host.popen if host is not None else subprocess.Popen
        proc = popen([sys.executable, "-m", "atoll", *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                     start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def start_coordinator(self, listen: str | None = None, timeout: float = 60.0,
                          extra: list[str] | None = None, *, host: Host | None = None) -> str:
        """Start the coordinator (on `host` when given) and return the address nodes dial."""
        addr_file = self.out / "coordinator.address"
        addr_file.unlink(missing_ok=True)
        listen = listen or (f"{host.ip}:0" if host is not None else "127.0.0.1:0")
        proc = self._spawn("coordinator", ["coordinator", "--job", str(self.job_path), "--listen", listen,
                                           "--state-dir", str(self.out / "coordinator"), "--token-file",
                                           str(self.token_file), "--address-file", str(addr_file),
                                           *(["--insecure"] if self.insecure else []), *(extra or [])], host)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if addr_file.is_file() and addr_file.read_text().strip():
                self.address = addr_file.read_text().strip()
                self.status_address = host.reach(self.address) if host is not None else self.address
                return self.address
            if proc.poll() is not None:
                raise ProcessExited(f"the coordinator exited with code {proc.returncode} "
                                    f"({_last_line(self.out / 'coordinator.log')}); see {self.out}/coordinator.log")
            time.sleep(0.1)
        raise TimeoutError(f"the coordinator did not start listening within {timeout:.0f}s")

    def start_node(self, name: str, *, region: str | None = None, extra: list[str] | None = None,
                   host: Host | None = None, node_id: str | None = None, env: dict[str, str] | None = None) -> None:
        """Start a node; on `host` it listens on the host's address, in its region (unless `region` says
        otherwise), emulating the host's latency to other regions. `node_id` gives it that id (kept in its state
        dir, so a plan written before it starts can name it); without, it keeps the one it has or makes one. `env`:
        variables added to the node's environment (the test-only `ATOLL_FAULT`, `atoll.node.faults`)."""
        if not self.address:
            raise RuntimeError("start the coordinator first")
        if node_id is not None:
            from atoll.node.identity import save_node_id

            (self.out / name).mkdir(parents=True, exist_ok=True)
            save_node_id(self.out / name, node_id)
        listen = f"{host.ip}:0" if host is not None else "127.0.0.1:0"
        args = ["node", "--coordinator", self.address, "--token-file", str(self.token_file), "--listen",
                listen, "--state-dir", str(self.out / name), "--checkpoint-dir", str(self.checkpoints),
                "--threads", str(self.threads_per_node), "--profile-seconds", str(self.profile_seconds),
                *self._tls_args()]
        region = region or (host.region if host is not None else None)
        if region:
            args += ["--region", region]
        if host is not None and host.wan_latency_ms > 0:
            args += ["--wan-latency-ms", str(host.wan_latency_ms)]
        self._spawn(name, args + list(extra or []), host, env)

    def status(self, timeout: float = 5.0):
        from atoll.coordinator.status import fetch_status

        from atoll.tls import bootstrap_rpc

        rpc = None if self.insecure else bootstrap_rpc(self.token, self.ca_file.read_bytes())
        return fetch_status(self.status_address or self.address, token=self.token, timeout=timedelta(seconds=timeout),
                            rpc=rpc)

    def check_alive(self, *, finished_ok: bool = False) -> None:
        """Raise ProcessExited for a process that is gone; with `finished_ok`, a node that left cleanly (code 0:
        nodes leave once the job is done) does not count."""
        for name, p in self.procs.items():
            if p.poll() is not None and not (finished_ok and name != "coordinator" and p.returncode == 0):
                raise ProcessExited(f"{name} exited with code {p.returncode} ({_last_line(self.out / f'{name}.log')}); "
                                    f"see {self.out}/{name}.log")

    def log_tails(self, lines: int = 8) -> str:
        """The last lines of every process's log, for a failure message that shows what each was doing (the
        logs themselves may be gone with the run's temporary folder)."""
        parts = []
        for name, p in self.procs.items():
            state = "running" if p.poll() is None else f"exited {p.returncode}"
            parts.append(f"--- {name} ({state}):")
            parts.extend(f"  {line}" for line in _tail(self.out / f"{name}.log", lines))
        return "\n".join(parts)

    def wait_status(self, until, timeout: float, what: str, *, poll: float = 0.3,
                    dead: frozenset[str] | None = None):
        """Poll the coordinator's status until `until(status)` holds and return that status; AssertionError after
        `timeout` seconds. Every process must stay up (`check_alive`), except nodes leaving cleanly (a node exits
        with code 0 once the job is done, which can come before the status shows the last step); with `dead`, the
        named ones may be gone and the others may exit cleanly, only an error exit fails the wait."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if dead is None:
                self.check_alive(finished_ok=True)
            else:
                for name, p in self.procs.items():
                    if name not in dead and p.poll() is not None and p.returncode != 0:
                        raise AssertionError(f"{name} exited with code {p.returncode}: see {self.out}/{name}.log\n"
                                             + self.log_tails())
            try:
                status = self.status()
            except Exception:  # noqa: BLE001 - busy or restarting: ask again
                time.sleep(poll)
                continue
            if until(status):
                return status
            time.sleep(poll)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; logs in {self.out}\n"
                             + self.log_tails())

    def wait_losses(self, steps: int, timeout: float, *, poll: float = 0.5) -> dict[int, float]:
        """Poll the coordinator's store until `steps` steps have reported a loss and return every loss so far;
        TimeoutError after `timeout` seconds. Every process must stay up, except nodes leaving cleanly."""
        end = time.monotonic() + timeout
        while len(losses := self.losses()) < steps:
            self.check_alive(finished_ok=True)
            if time.monotonic() > end:
                raise TimeoutError(f"{len(losses)} of {steps} steps reported within {timeout:.0f}s; logs in {self.out}\n"
                                   + self.log_tails())
            time.sleep(poll)
        return losses

    @contextmanager
    def read_store(self) -> Iterator:
        """The coordinator's store (`SqliteStore` of `state_db`), open for the block and closed after it."""
        from atoll.coordinator.store import SqliteStore

        store = SqliteStore(self.state_db, read_only=True)  # leaves the log as a killed coordinator left it
        try:
            yield store
        finally:
            store.close()

    def step_reports(self) -> list:
        """Every step report the coordinator's store holds (`StepMetrics`, oldest first); [] before it has a store."""
        if not self.state_db.is_file():
            return []
        with self.read_store() as store:
            return store.recent_steps(limit=1_000_000)

    def losses(self) -> dict[int, float]:
        """Every step's loss reported so far (the latest report of a step wins), from the coordinator's store.

        The store keeps only its latest `Store.recent_steps_kept` reports; each call adds the reports that
        arrived since the one before, so a caller asking at least once per that many reports (the demo asks
        every second) has every step of a job of any length.
        """
        if not self.state_db.is_file():
            return dict(self._losses)
        with self.read_store() as store:
            # read back until the oldest report read was merged before (row order, not report times: the reports
            # a node kept through a coordinator outage arrive late, stamped with their own times)
            limit = 256
            while True:
                batch = store.recent_steps(limit=limit)
                if (len(batch) < limit or limit >= store.recent_steps_kept
                        or (batch[0].node_id, batch[0].plan_epoch, batch[0].step) in self._merged):
                    break
                limit *= 4
        for s in batch:
            key = (s.node_id, s.plan_epoch, s.step)
            if key in self._merged:
                continue
            self._merged.add(key)
            if s.loss is not None and s.unix_time >= self._loss_times.get(s.step, float("-inf")):
                self._losses[s.step], self._loss_times[s.step] = s.loss, s.unix_time
        return dict(self._losses)

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator only (its machine crashed); `restart_coordinator` brings it back."""
        proc = self.procs.pop("coordinator", None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def restart_coordinator(self, timeout: float = 60.0, extra: list[str] | None = None) -> str:
        """Start the coordinator again on the same state dir and address, so running nodes find it again."""
        if not self.address:
            raise RuntimeError("the coordinator never started")
        return self.start_coordinator(listen=self.address, timeout=timeout, extra=extra)

    def node_name(self, node_id: str) -> str:
        """The process name (node1, ...) of the node with the stable id `node_id`."""
        for name in self.procs:
            id_file = self.out / name / "node_id"
            if name != "coordinator" and id_file.is_file() and id_file.read_text().strip() == node_id:
                return name
        raise KeyError(f"no running node has id {node_id}")

    def pause(self, name: str) -> None:
        """SIGSTOP a process: alive, holding its sockets, but answering nothing (a machine that hangs)."""
        self.procs[name].send_signal(signal.SIGSTOP)

    def resume(self, name: str) -> None:
        """SIGCONT a paused process."""
        self.procs[name].send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL every process and what it started (a crash of all machines at once)."""
        for p in self.procs.values():
            _signal_group(p, signal.SIGKILL)
        for p in self.procs.values():
            p.wait(10)
        self.procs.clear()

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM nodes first, then the coordinator; SIGKILL what is still running after `grace`.

        Each process leads a session of its own (so a Ctrl-C at the terminal reaches only the launcher, which
        stops them in order), and the signals go to its whole process group: nothing it started outlives it.
        """
        order = [n for n in self.procs if n != "coordinator"] + (["coordinator"] if "coordinator" in self.procs else [])
        for name in order:
            _signal_group(self.procs[name], signal.SIGTERM)
        end = time.monotonic() + grace
        for name in order:
            try:
                self.procs[name].wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # the leader may be gone while a process it started lingers
            _signal_group(self.procs[name], signal.SIGKILL)
            self.procs[name].wait(5)
        self.procs.clear()

    def __enter__(self) -> "LocalCluster":
        # the processes run in sessions of their own, so they would outlive a script (a benchmark) killed with
        # SIGTERM: it leaves this block instead, which stops them. A handler already installed (the demo's) stays.
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)  # type: ignore[arg-type]
                self._previous_sigterm = None


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """Send `sig` to the process group `proc` leads (it was started in a session of its own), else to `proc`."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):  # no such group: the leader is reaped and the group empty
        if proc.poll() is None:
            proc.send_signal(sig)


def stored_run(out: Path) -> tuple[str, int] | None:
    """(job id, steps reported) of the run a LocalCluster left under `out`, or None when there is none."""
    from atoll.coordinator.store import SqliteStore, StoreError

    db = Path(out) / "coordinator" / "coordinator.db"
    if not db.is_file():
        return None
    try:
        store = SqliteStore(db)
    except StoreError:  # written by another version of atoll
        return ("(unreadable)", 0)
    try:
        job = store.get_job()
        steps = store.recent_steps(limit=store.recent_steps_kept)
    finally:
        store.close()
    if job is None:
        return None
    return job.job_id, max((s.step + 1 for s in steps if s.loss is not None), default=0)


RUN_ENTRIES = re.compile(r"(coordinator|checkpoints|token|coordinator\.address|loss\.png|plan\.png|node\d+|"
                         r"(coordinator|node\d+)\.log)")
"""What a LocalCluster (and the demo) writes under its folder."""


def clear_run(out: Path) -> None:
    """Delete what a LocalCluster wrote under `out` (state, checkpoints, logs, token, pictures); nothing else."""
    out = Path(out)
    if not out.is_dir():
        return
    for entry in out.iterdir():
        if RUN_ENTRIES.fullmatch(entry.name):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
