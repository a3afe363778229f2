"""The coordinator process's garbage collection, set once its start-up is done.

A full collection scans every object the collector tracks: with torch imported (for the rendezvous store) and
thousands of members that is hundreds of thousands of objects, and with Python's default thresholds it ran often
enough to stall heartbeats by ~10 ms and to double the time of a replan at 2,000 members. So the objects of
start-up (modules, the loaded state) are frozen out of collection, and collections run less often; reference
counting still frees almost everything at once, and the collector still finds cycles.
"""

from __future__ import annotations

import gc
import sys

THRESHOLDS = (50_000, 20, 100)
"""Allocations before a young collection, and young (then middle) collections before an older one."""


SWITCH_INTERVAL = 0.001
"""Seconds a thread holds the GIL before another that waits for it gets a turn (Python's default: 0.005)."""


def settle_heap() -> None:
    """Freeze what start-up allocated and space collections out (process-wide: for the coordinator's own process)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    # the background loop (leases, islands, plans) is pure Python over every member: with the default 5 ms
    # switch interval each of its turns held heartbeats on the server loop for that long, many times a round
    sys.setswitchinterval(SWITCH_INTERVAL)
