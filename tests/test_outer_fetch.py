"""A fetch of an outer contribution gives up on a holder it cannot connect to within `OUTER_CONNECT_S`, so a relay
is tried next instead of after the whole transfer's timeout (a cut link answers nothing)."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest

from atoll.node.outer import OuterSyncError, fetch_outer
from atoll.rpc import RpcOptions
from atoll.v1 import atoll_pb2 as pb


def test_a_holder_that_never_answers_is_given_up_after_the_connect_bound() -> None:
    # a socket that accepts TCP (the kernel's backlog) but never speaks HTTP/2: as good as a black hole for gRPC
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(OuterSyncError, match="no connection .* within 0.5s"):
            fetch_outer(address, pb.OuterFetchRequest(job_id="j", plan_epoch=1, round=0, kind="delta", names=["x"]),
                        token=None, rpc=RpcOptions(), timeout=timedelta(seconds=60),
                        connect_timeout=timedelta(seconds=0.5))
        assert time.monotonic() - t0 < 20  # not the transfer's 60 s (3x margin over the 0.5 s bound and start-up)
    finally:
        silent.close()
