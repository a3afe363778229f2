"""Stop signals handled at once, whatever the main thread is doing.

Python runs a signal handler on the main thread, between two bytecodes: while that thread is inside a long call
into C++ (a process group's constructor waiting for a peer that is not coming, a collective, a blocking read), a
SIGTERM is not seen until the call returns, which may be minutes. `handle_on_thread` has the C-level handler write
each signal's number to a socket (`signal.set_wakeup_fd`) that a thread of its own reads, so the handler runs at
once on that thread. `stuck_main_thread` says where the main thread is, for a process that gives up waiting for it.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Iterable


def handle_on_thread(signals: Iterable[signal.Signals], handler: Callable[[signal.Signals], None]) -> None:
    """Call `handler(sig)` on a daemon thread as soon as one of `signals` arrives. Call from the main thread (as
    `signal.signal`); it replaces the process's wakeup fd, which nothing else here uses."""
    wanted = {int(s) for s in signals}
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    for sig in wanted:
        # a Python-level handler must be installed for the C-level one to write the wakeup byte; it does nothing
        # itself (it runs late, on the main thread): the thread below acts
        signal.signal(sig, _ignore)

    def deliver() -> None:
        _keep = writer  # noqa: F841 - the wakeup fd must stay open as long as this thread reads its pair
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for number in data:
                if number in wanted:
                    handler(signal.Signals(number))

    threading.Thread(target=deliver, name="atoll-signals", daemon=True).start()


def _ignore(_signum: int, _frame: object) -> None:
    return None


def stuck_main_thread() -> str:
    """Where the main thread is now, as "function (file:line)"; "" when it has ended or cannot be seen."""
    main = threading.main_thread()
    frame = sys._current_frames().get(main.ident or -1)
    if frame is None or not main.is_alive():
        return ""
    top = traceback.extract_stack(frame, limit=1)[-1]
    return f"{top.name} ({top.filename}:{top.lineno})"
