"""Shared test isolation."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _atoll_logger_restored() -> Iterator[None]:
    """A command run in-process (`atoll.launch.cli.main`) sets the "atoll" logger up as its process would: a handler
    of its own, its level, no propagation to the root logger. Each test gets the logger back as it found it, so a
    later test's `caplog` still sees atoll's records whichever test ran before it on the same worker."""
    logger = logging.getLogger("atoll")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate
