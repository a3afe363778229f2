"""Checks of a coordinator state file before the coordinator runs on it.

A state file that is truncated, not SQLite at all, fails SQLite's own integrity check, lacks a table or a
column, or holds rows the coordinator cannot read is refused with `DamagedState`, whose message names the file,
what is wrong and the way out: move it aside and start afresh on a new state dir, or restore a backup. The
coordinator never starts on such a file, as it would lose the job silently (a missing checkpoints table, for
one, would be recreated empty and send the job back to step 0 while the nodes' checkpoint files exist).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

from atoll.coordinator.store import StoreError

SQLITE_HEADER = b"SQLite format 3\x00"

CORE_COLUMNS: dict[str, tuple[str, ...]] = {
    "job": ("one", "job_id", "name", "spec_toml", "created_unix"),
    "members": ("node_id", "peer_address", "profile_json", "state", "joined_unix", "last_heartbeat_unix",
                "plan_epoch", "step", "reason"),
    "links": ("src", "dst", "bandwidth", "rtt", "probe_bytes", "measured_unix"),
    "islands": ("one", "islands_json"),
    "plans": ("epoch", "created_unix", "reason", "plan_json"),
    "checkpoints": ("step", "plan_epoch", "node_id", "layer_start", "layer_end", "path", "bytes", "data_position",
                    "reported_unix"),
}
"""The tables every state file has had since schema version 1, with the columns read from them. Tables added
since are created when missing (a file from before them is not damaged)."""

NUMERIC_COLUMNS: dict[str, tuple[str, ...]] = {
    "members": ("joined_unix", "last_heartbeat_unix", "plan_epoch", "step"),
    "links": ("bandwidth", "rtt", "probe_bytes", "measured_unix"),
    "plans": ("epoch", "created_unix"),
    "checkpoints": ("step", "plan_epoch", "layer_start", "layer_end", "bytes", "data_position", "reported_unix"),
}


class DamagedState(StoreError):
    """The state file cannot be trusted; the message says what is wrong and how to recover."""


def damaged(path: Path, what: str) -> DamagedState:
    return DamagedState(
        f"{path} is damaged: {what}. The coordinator will not start on it, as it would lose the job's state "
        f"(members, plans, the checkpoint index) without a word. Move it aside (mv {path} {path}.damaged) and "
        f"restart with --state-dir NEW to start the job afresh (--start-fresh moves the old state aside for you), or "
        f"restore a backup of it (--restore BACKUP)")


def check_file(path: Path) -> bool:
    """Before SQLite opens `path`: True when it is to be created, False when it exists and looks like SQLite."""
    if path.is_dir():
        raise damaged(path, "it is a folder, not a SQLite file")
    if not path.exists():
        return True
    size = path.stat().st_size
    if size == 0:
        raise damaged(path, "it is empty (0 bytes); the file was cut short")
    with open(path, "rb") as f:
        head = f.read(len(SQLITE_HEADER))
    if head != SQLITE_HEADER:
        raise damaged(path, "it is not a SQLite database (it does not start with SQLite's header)")
    if size < 512:
        raise damaged(path, f"it is {size} bytes long, shorter than one SQLite page; the file was cut short")
    return False


def check_schema(db: sqlite3.Connection, path: Path) -> bool:
    """True for a fresh file (no tables yet); raises DamagedState for a file SQLite or the schema rejects."""
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not tables:
        return True
    result = [r[0] for r in db.execute("PRAGMA integrity_check(3)")]
    if result != ["ok"]:
        found = " ".join(" ".join(str(r).split()) for r in result)  # one line, however SQLite words it
        raise damaged(path, f"SQLite's integrity check fails ({found[:300]})")
    missing = sorted(set(CORE_COLUMNS) - tables)
    if missing:
        what = (f"it has none of the coordinator's tables (found {', '.join(sorted(tables))[:200]}): another "
                       f"program's database?") if len(missing) == len(CORE_COLUMNS) else (
            f"the {', '.join(missing)} table{'s are' if len(missing) > 1 else ' is'} missing")
        raise damaged(path, what)
    for table, columns in CORE_COLUMNS.items():
        have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
        lacking = [c for c in columns if c not in have]
        if lacking:
            raise damaged(path, f"the {table} table lacks the column{'s' if len(lacking) > 1 else ''} "
                                f"{', '.join(lacking)}")
    return False


def check_rows(db: sqlite3.Connection, path: Path, *, member: Callable[[tuple], object],
               plan: Callable[[str], object], islands: Callable[[str], object], states: tuple[str, ...]) -> None:
    """Every row the coordinator reads at start parses: members (with `member`), the newest plan (with `plan`),
    the islands, numbers where numbers belong, and a job record wherever anything else is recorded."""
    for table, columns in NUMERIC_COLUMNS.items():
        bad = " OR ".join(f"typeof({c}) NOT IN ('integer', 'real')" for c in columns)
        row = db.execute(f"SELECT rowid FROM {table} WHERE {bad} LIMIT 1").fetchone()
        if row is not None:
            raise damaged(path, f"row {row[0]} of the {table} table holds text where a number belongs")
    jobs = db.execute("SELECT COUNT(*) FROM job").fetchone()[0]
    if jobs == 0:
        counts = {t: db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("members", "plans", "checkpoints")}
        recorded = [f"{n} {t}" for t, n in counts.items() if n]
        if recorded:
            raise damaged(path, f"the job record is missing while {', '.join(recorded)} are recorded")
    for row in db.execute("SELECT * FROM members"):
        if row[3] not in states:
            raise damaged(path, f"member {str(row[0])[:64]!r} has the unknown state {str(row[3])[:32]!r}")
        try:
            member(row)
        except (ValueError, TypeError, KeyError) as e:
            raise damaged(path, f"the record of member {str(row[0])[:64]!r} does not parse ({type(e).__name__}: "
                                f"{str(e)[:120]})") from None
    newest = db.execute("SELECT epoch, plan_json FROM plans ORDER BY epoch DESC LIMIT 1").fetchone()
    if newest is not None:
        try:
            plan(newest[1])
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise damaged(path, f"the newest plan (epoch {newest[0]}) does not parse ({type(e).__name__}: "
                                f"{str(e)[:120]})") from None
    for (text,) in db.execute("SELECT islands_json FROM islands"):
        try:
            islands(text)
        except (ValueError, TypeError, KeyError) as e:
            raise damaged(path, f"the islands record does not parse ({type(e).__name__}: {str(e)[:120]})") from None
