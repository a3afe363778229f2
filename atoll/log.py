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
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("atoll")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
