"""The coordinator's reachability check at join: dial the node's advertised Peer server address back.

A TCP connection with a short deadline: accepted means the node accepts connections from here; refused, no
route or no answer means it does not, and the reason goes into the node's join reply. It checks the network
path only (the Peer server's TLS and token are the peers' business), so it holds with and without TLS. Other
nodes may still reach an address the coordinator cannot (or the other way round); this is the best single
vantage point the coordinator has.
"""

from __future__ import annotations

import socket
from datetime import timedelta

DIAL_BACK_TIMEOUT = timedelta(seconds=3)
"""How long the coordinator waits for a joining node's address to accept a connection."""


def dial_back(address: str, timeout: timedelta = DIAL_BACK_TIMEOUT) -> str | None:
    """None when HOST:PORT accepts a TCP connection within `timeout`; otherwise why not."""
    if not address:
        return "no address advertised"
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout.total_seconds()):
            return None
    except socket.timeout:
        return f"no answer within {timeout.total_seconds():.0f}s"
    except (OSError, ValueError, OverflowError) as e:  # OverflowError: a port past 65535
        return f"{type(e).__name__}: {e}"
