"""Readable logs: one format for every component, time and component first."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable


def setup_logging(verbosity: int = 0) -> None:
    """verbosity -1: warnings; 0: info; 1: info with more detail; 2+: debug. ATOLL_LOG_LEVEL overrides."""
    level = {-1: logging.WARNING, 0: logging.INFO, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    override = os.environ.get("ATOLL_LOG_LEVEL")
    if override:
        level = logging.getLevelName(override.upper())
        if not isinstance(level, int):
            raise ValueError(f"ATOLL_LOG_LEVEL={override!r} is not a log level (use DEBUG, INFO, WARNING, ERROR)")
    handler = _Stderr()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s", "%H:%M:%S"))
    handler.addFilter(RateLimit())
    root = logging.getLogger("atoll")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


class _Stderr(logging.StreamHandler):
    """A handler writing to whatever `sys.stderr` is when a record is emitted, not the stream it was when the
    handler was made (as `logging.lastResort` does): a process that replaces its stderr later (a daemon, a
    wrapper that captures output) keeps its logs, and none go to a stream that has since been closed."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)  # StreamHandler's would set the stream this class reads from sys.stderr

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr


class RateLimit(logging.Filter):
    """Errors (and any record with a traceback) pass once per cause per `interval`; the rest of that interval's are
    counted, and the next one to pass says how many were left out. A cause is the logger, the message's format
    and, for an exception, its type and where it was raised: a flood of one failure (junk from a peer, a full
    disk) is a line a minute, while a different failure still shows at once."""

    def __init__(self, interval: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.interval = interval
        self.clock = clock
        self._lock = threading.Lock()
        self._causes: dict[tuple, tuple[float, int]] = {}
        """cause -> (when its last record passed, records left out since)"""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR and not record.exc_info:
            return True
        key = _cause(record)
        now = self.clock()
        with self._lock:
            passed, left_out = self._causes.get(key, (None, 0))
            if passed is not None and now - passed < self.interval:
                self._causes[key] = (passed, left_out + 1)
                return False
            self._causes[key] = (now, 0)
            if len(self._causes) > 4096:  # causes a flood of distinct ones leaves behind
                for k in [k for k, (t, _) in self._causes.items() if now - t >= self.interval]:
                    del self._causes[k]
        if left_out:
            record.msg = f"{record.msg} ({left_out} more like it in the last {self.interval:g} s not logged)"
        return True


def _cause(record: logging.LogRecord) -> tuple:
    exc = record.exc_info
    if not exc or exc[0] is None:
        return record.name, str(record.msg), record.levelno
    where = traceback.extract_tb(exc[2])[-1:] if exc[2] is not None else []
    return record.name, str(record.msg), exc[0].__name__, *((where[0].filename, where[0].lineno) if where else ())
