"""The log set-up every command shares (atoll.log)."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from atoll.log import setup_logging


def test_logs_go_to_the_stderr_of_the_moment_not_one_since_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler writes to `sys.stderr` as it is when a record comes, so a stream replaced and closed later (a
    test's captured output, a wrapper's) loses nothing and raises no logging error."""
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    setup_logging(0)
    first.close()
    now = io.StringIO()
    monkeypatch.setattr(sys, "stderr", now)
    logging.getLogger("atoll.test").info("after the swap")
    logging.getLogger("atoll.test").debug("not at info")
    assert "I atoll.test: after the swap" in now.getvalue() and "not at info" not in now.getvalue()


def test_the_level_comes_from_the_verbosity_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    setup_logging(-1)
    assert logging.getLogger("atoll").level == logging.WARNING
    setup_logging(2)
    assert logging.getLogger("atoll").level == logging.DEBUG
    monkeypatch.setenv("ATOLL_LOG_LEVEL", "error")
    setup_logging(0)
    assert logging.getLogger("atoll").level == logging.ERROR
    monkeypatch.setenv("ATOLL_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="ATOLL_LOG_LEVEL"):
        setup_logging(0)
