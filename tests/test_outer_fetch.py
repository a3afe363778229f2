"""A fetch of an outer contribution gives up on a holder it cannot connect to within `OUTER_CONNECT_S`, so a relay
is tried next instead of after the whole transfer's timeout (a cut link answers nothing)."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import grpc
import pytest
import torch

from atoll.node.outer import OuterSyncError, fetch_outer
from atoll.rpc import RpcOptions, ready_within
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

    sync._channels, sync._holder_pool = None, ThreadPoolExecutor(2)  # (what __init__ makes)
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


def test_fetches_reuse_a_warm_channel_and_drop_one_a_fetch_failed_on(monkeypatch) -> None:
    """A node fetches every round from the same holders: with `FetchChannels` the channel (its TCP and TLS session)
    is made once and kept; a fetch that fails drops it, and the next one connects afresh; closing closes all."""
    import grpc

    from atoll.node import outer as outer_mod

    made: list = []

    class Channel:
        closed = False

        def close(self) -> None:
            self.closed = True

    def make_channel(address, rpc, **kw):
        made.append(Channel())
        return made[-1]

    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

    answers: list = [None, Refused(), None]

    class Stub:
        def __init__(self, channel) -> None:
            pass

        def FetchOuter(self, request, timeout):  # noqa: N802 - the gRPC method's name
            answer = answers.pop(0)
            if answer is not None:
                raise answer
            return iter(())

    monkeypatch.setattr(outer_mod, "make_channel", make_channel)
    monkeypatch.setattr(outer_mod.pb_grpc, "PeerStub", Stub)
    channels = outer_mod.FetchChannels()

    def fetch():
        return fetch_outer("b0:1", pb.OuterFetchRequest(round=3), token="t", rpc=RpcOptions(),
                           timeout=timedelta(seconds=5), node="b0", channels=channels)

    fetch()
    with pytest.raises(grpc.RpcError):
        fetch()
    assert len(made) == 1 and made[0].closed  # reused, then dropped when the fetch failed on it
    fetch()
    assert len(made) == 2 and not made[1].closed
    channels.close()
    assert made[1].closed
    # two fetches over one channel (two holders at one address): the one that fails drops it for later fetches but
    # closes it only once the other is done with it
    channels = outer_mod.FetchChannels()
    first = channels.acquire(("b0:1", "b0", "t"), lambda: make_channel("b0:1", None))
    assert channels.acquire(("b0:1", "b0", "t"), lambda: make_channel("b0:1", None)) is first
    channels.release(("b0:1", "b0", "t"), first, failed=True)
    assert not first.closed
    fresh = channels.acquire(("b0:1", "b0", "t"), lambda: make_channel("b0:1", None))
    assert fresh is not first
    channels.release(("b0:1", "b0", "t"), first)
    assert first.closed and not fresh.closed
    channels.release(("b0:1", "b0", "t"), fresh)
    assert not fresh.closed  # kept warm for the next round
    channels.close()
    assert fresh.closed
    # without a cache: a channel for the fetch, closed after it
    answers.append(None)
    fetch_outer("b0:1", pb.OuterFetchRequest(round=3), token="t", rpc=RpcOptions(), timeout=timedelta(seconds=5))
    assert len(made) == 5 and made[4].closed


def test_the_holders_of_one_contribution_are_fetched_from_at_once(monkeypatch) -> None:
    """Each holder of a contribution serves its part; the parts are fetched at once (on a wide-area link each is a
    round trip at least), not one after the other."""
    import threading

    from atoll.node import outer as outer_mod

    sync = outer_mod.OuterSync.__new__(outer_mod.OuterSync)
    sync._channels, sync._holder_pool = None, ThreadPoolExecutor(4)  # (what __init__ makes)
    sync.plan_source = None
    sync.mine = ["layers.0.w", "layers.1.w", "layers.2.w"]
    sync.cfg = outer_mod.OuterConfig(job_id="j", node_id="a0", group=0, inner_steps=2,
                                     codec=outer_mod.CodecSpec("identity"), deadline=timedelta(seconds=30))
    sync.stop = threading.Event()
    sync._unreachable = {}
    part = outer_mod.Participant(group=1, tokens=8, since_epoch=1, nodes=("b0", "b1", "b2"))
    holders = {"b0": ["layers.0.w"], "b1": ["layers.1.w"], "b2": ["layers.2.w"]}
    monkeypatch.setattr(sync, "_sources", lambda p, names=None: [
        ("group 1", holders, {n: f"{n}:1" for n in holders}, 1, "")], raising=False)
    inside, most = [0], [0]
    lock = threading.Lock()

    def fetch(address, request, *, node, **kw):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.3)
        with lock:
            inside[0] -= 1
        return {n: torch.ones(2) for n in request.names}, 3, 8

    monkeypatch.setattr(outer_mod, "fetch_outer", fetch)
    t0 = time.monotonic()
    tensors, nbytes = sync._fetch_contribution(part, 3)
    assert sorted(tensors) == sorted(sync.mine) and nbytes == 24
    assert most[0] == 3 and time.monotonic() - t0 < 3 * 0.3  # all three at once, not one after the other


def test_a_connect_wait_that_times_out_leaves_no_thread_behind_to_fail_on_close(monkeypatch) -> None:
    """`ready_within` on a peer that does not answer (a cut link) returns False, and closing the channel after it
    raises nothing in grpc's connectivity-polling thread (uncancelled, that thread raised `Channel closed!` into the
    nodes' logs on bench.regions' link cut)."""
    failures: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    assert ready_within(channel, 0.3) is False
    channel.close()
    time.sleep(1.0)  # the polling thread wakes every 0.2 s
    assert failures == []
