"""Readable logs: one format for every component, time and component first."""

from __future__ import annotations

import logging
import os
import sys


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
