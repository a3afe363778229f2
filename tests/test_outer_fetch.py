"""A fetch of an outer contribution gives up on a holder it cannot connect to within `OUTER_CONNECT_S`, so a relay
is tried next instead of after the whole transfer's timeout (a cut link answers nothing)."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
import torch

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


def test_a_holder_that_could_not_be_connected_to_is_not_tried_again_while_a_relay_may_serve(monkeypatch) -> None:
    """The link to a contribution's own group is cut: its holder fails to connect once, and while the relay (another
    group, which has not fetched the contribution yet) is asked again, the cut holder is not (each try of it would
    cost the connect bound again)."""
    import threading
    from types import SimpleNamespace

    import grpc

    from atoll.compression import CodecSpec
    from atoll.node import outer as outer_mod

    sync = outer_mod.OuterSync.__new__(outer_mod.OuterSync)
    sync.plan, sync.plan_source, sync.stop = SimpleNamespace(), None, threading.Event()
    sync.timeout, sync.mine, sync._unreachable = timedelta(seconds=120), ["layers.0.w"], {}
    sync.cfg = outer_mod.OuterConfig(job_id="j", node_id="a0", group=0, inner_steps=2, codec=CodecSpec("identity"),
                                     deadline=timedelta(seconds=30))
    part = outer_mod.Participant(group=1, tokens=8, since_epoch=1, nodes=("b1",))
    monkeypatch.setattr(sync, "_sources", lambda p, names=None: [
        ("group 1", {"b1": ["layers.0.w"]}, {"b1": "b1:1"}, 1, ""),
        ("group 2 (a relay)", {"c1": ["layers.0.w"]}, {"c1": "c1:1"}, 1, "origin")], raising=False)

    class NotYet(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.NOT_FOUND

        def details(self):
            return "not fetched yet"

    asked = []

    def fetch(address, request, **kw):
        asked.append(address)
        if address == "b1:1":
            raise outer_mod.Unconnected(address, "no connection to b1:1 within 3s")
        if asked.count(address) < 4:
            raise NotYet()
        return {"layers.0.w": torch.zeros(1)}, 3, 4

    monkeypatch.setattr(outer_mod, "fetch_outer", fetch)
    monkeypatch.setattr(outer_mod.time, "sleep", lambda s: None)
    got, nbytes = sync._fetch_contribution(part, 3)
    assert set(got) == {"layers.0.w"} and nbytes == 4
    assert asked == ["b1:1", "c1:1", "c1:1", "c1:1", "c1:1"]
