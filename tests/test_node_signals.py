"""Stop signals reach a node at once even while its main thread is inside a blocking call into the backend."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

CHILD = textwrap.dedent("""
    import signal, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from atoll.node.signals import handle_on_thread, stuck_main_thread

    def on_signal(sig):
        print(f"handled {sig.name} at {time.monotonic():.3f} in {stuck_main_thread()}", flush=True)

    handle_on_thread((signal.SIGTERM,), on_signal)

    def wait_for_a_peer_not_coming():
        # gloo's constructor waits for rank 1 until its timeout, running no Python signal handler meanwhile
        dist.ProcessGroupGloo(dist.HashStore(), 0, 2, timedelta(seconds=20))

    print(f"blocking at {time.monotonic():.3f}", flush=True)
    try:
        wait_for_a_peer_not_coming()
    except Exception as e:
        print(f"constructor ended at {time.monotonic():.3f}", flush=True)
""")


@pytest.mark.timeout(60)
def test_a_signal_is_handled_while_the_main_thread_blocks_in_gloo() -> None:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("blocking"), line
        time.sleep(1.0)  # inside the constructor by now
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        line = proc.stdout.readline()
        heard = time.monotonic()
        assert line.startswith("handled SIGTERM"), line
        assert heard - sent < 5.0, f"the handler ran {heard - sent:.1f}s after the signal"
        assert "wait_for_a_peer_not_coming" in line  # where the main thread is stuck
    finally:
        proc.kill()
        proc.wait(10)
