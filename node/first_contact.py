"""What a node says when it cannot reach its coordinator: which step of the path failed and what to check.

`diagnose` (`atoll.netcheck`) looks at the path below gRPC (the name resolves, the port accepts a TCP connection)
so the message can tell a typo from a stopped coordinator, a firewall or a TLS mismatch. `FirstContactWatch`
says it once, a few seconds into the first contact, while the agent keeps retrying.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from datetime import timedelta

from atoll.netcheck import TOKEN_REFUSED, diagnose

log = logging.getLogger("atoll.node")

FIRST_CONTACT_WARNING = timedelta(seconds=5)
"""How long after the node's process started the first contact may go unanswered before the node says why it
waits (well within 10 s; a process that took longer to start says so at once)."""


def process_age() -> float:
    """Seconds since this process started (Linux: /proc), 0.0 where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: start time in ticks
    except (OSError, ValueError, IndexError):
        return 0.0


class FirstContactWatch:
    """Logs `diagnose`'s line once if the first contact has not succeeded `after` the process started (at
    least `least` from now); `done()` stops it."""

    def __init__(self, address: str, *, tls: bool, after: timedelta = FIRST_CONTACT_WARNING,
                 least: timedelta = timedelta(milliseconds=500), say: Callable[[str], None] | None = None,
                 mtls=None):
        self.address, self.tls, self.mtls = address, tls, mtls
        self._say = say or (lambda line: log.error("%s", line))
        self.delay = max(least.total_seconds(), after.total_seconds() - process_age())
        """Seconds from now until it speaks."""
        self._timer = threading.Timer(self.delay, self._fire)
        self._timer.daemon = True
        self.fired = threading.Event()
        self.said = ""
        """The diagnosis, once it fired."""
        self._timer.start()

    def _fire(self) -> None:
        self.said = diagnose(self.address, tls=self.tls, mtls=self.mtls)
        if TOKEN_REFUSED not in self.said:  # the caller gives up on a wrong token, saying so itself
            self._say(f"cannot reach the coordinator at {self.address} yet (still retrying): {self.said}")
        self.fired.set()

    @property
    def wrong_token(self) -> bool:
        """The diagnosis found the job token refused: retrying cannot mend it."""
        return self.fired.is_set() and TOKEN_REFUSED in self.said

    def done(self) -> None:
        self._timer.cancel()
