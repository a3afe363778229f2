"""The coordinator's loop-lateness probe: what lease expiry allows for the coordinator's own stalls."""

from __future__ import annotations

import asyncio
import threading
import time

from atoll.coordinator.looplag import LoopLag


def test_recent_is_the_largest_lateness_within_the_window() -> None:
    lag = LoopLag(keep=60)
    lag.record(100.0, 0.01)
    lag.record(110.0, 2.5)
    lag.record(120.0, 0.02)
    assert lag.recent(15, now=121.0) == 2.5
    assert lag.recent(5, now=121.0) == 0.02
    assert lag.recent(5, now=200.0) == 0.0  # nothing measured lately
    lag.record(200.0, 0.0)
    assert lag.recent(200, now=200.0) == 0.0  # older samples were dropped past `keep`


def test_a_blocked_loop_is_measured_late() -> None:
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    lag = LoopLag(period=0.02)
    try:
        lag.start(loop)
        time.sleep(0.2)
        assert lag.recent(1.0) < 0.1
        loop.call_soon_threadsafe(time.sleep, 0.5)  # the loop is busy for half a second
        time.sleep(0.8)
        assert 0.35 < lag.recent(1.0) < 2.0
    finally:
        lag.stop()
        loop.call_soon_threadsafe(loop.stop)
        t.join(timeout=5)
