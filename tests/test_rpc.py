"""The gRPC factory: real servers on port 0, token metadata, default deadlines, TLS."""

from __future__ import annotations

import shutil
import subprocess
import threading
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from atoll.rpc import RpcOptions, make_channel, make_server, token_from_metadata, token_matches, wait_ready


def _health_server(options: RpcOptions | None = None, interceptors=()):
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return make_server("127.0.0.1:0", [lambda s: health_pb2_grpc.add_HealthServicer_to_server(servicer, s)],
                       options, interceptors=interceptors)


def test_server_binds_port_zero_and_channel_calls_it() -> None:
    handle = _health_server()
    try:
        assert handle.port > 0 and handle.address.endswith(f":{handle.port}")
        channel = make_channel(handle.address)
        wait_ready(channel, timedelta(seconds=5))
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        channel.close()
    finally:
        handle.stop()


class _Capture(grpc.ServerInterceptor):
    def __init__(self):
        self.seen: list[tuple] = []

    def intercept_service(self, continuation, details):
        self.seen.append(tuple(details.invocation_metadata))
        return continuation(details)


def test_token_travels_in_metadata() -> None:
    cap = _Capture()
    handle = _health_server(interceptors=[cap])
    try:
        channel = make_channel(handle.address, token="s3cret")
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert ("authorization", "Bearer s3cret") in cap.seen[-1]
        channel.close()
    finally:
        handle.stop()


def test_token_matching_is_exact() -> None:
    assert token_matches("abc", "abc")
    assert not token_matches("abd", "abc")
    assert not token_matches(None, "abc")
    assert not token_matches("", "abc")

    class Ctx:
        def invocation_metadata(self):
            return (("authorization", "Bearer t1"),)

    assert token_from_metadata(Ctx()) == "t1"


def test_default_deadline_applies() -> None:
    """A call with no timeout of its own ends at the default deadline instead of hanging."""
    release = threading.Event()

    class Slow(health_pb2_grpc.HealthServicer):
        def Check(self, request, context):
            release.wait(5)
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    handle = make_server("127.0.0.1:0", [lambda s: health_pb2_grpc.add_HealthServicer_to_server(Slow(), s)])
    try:
        channel = make_channel(handle.address, RpcOptions(default_deadline=timedelta(milliseconds=300)))
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        channel.close()
    finally:
        release.set()
        handle.stop()


def test_message_size_limit_is_enforced() -> None:
    handle = _health_server(RpcOptions(max_message_bytes=4096))
    try:
        channel = make_channel(handle.address)
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="x" * 10_000))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        channel.close()
    finally:
        handle.stop()


def test_options_validate() -> None:
    with pytest.raises(ValueError, match="tls-cert and --tls-key"):
        RpcOptions(tls_cert=Path("c.pem"))
    with pytest.raises(ValueError, match="max_message_bytes"):
        RpcOptions(max_message_bytes=10)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is needed to make a test certificate")
def test_tls_round_trip(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )
    handle = _health_server(RpcOptions(tls_cert=cert, tls_key=key))
    try:
        channel = make_channel(handle.address, RpcOptions(tls_root_ca=cert))
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        channel.close()
        plain = make_channel(handle.address, RpcOptions(default_deadline=timedelta(seconds=2)))
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest())
        plain.close()
    finally:
        handle.stop()


@pytest.mark.parametrize("peer, host", [("ipv4:10.0.0.5:41234", "10.0.0.5"), ("ipv6:[::1]:5", "::1"),
                                        ("ipv6:%5B2001:db8::1%5D:443", "2001:db8::1"), ("unix:/tmp/s", ""), ("", "")])
def test_the_host_of_a_grpc_peer(peer: str, host: str) -> None:
    from atoll.rpc import peer_host
    assert peer_host(peer) == host


class _Refusal(grpc.RpcError):
    def __init__(self, metadata):
        self._metadata = metadata

    def trailing_metadata(self):
        return self._metadata


@pytest.mark.parametrize("metadata, seconds", [((("atoll-retry-after-s", "7.5"),), 7.5), ((), None), (None, None),
                                               ((("atoll-retry-after-s", "soon"),), None),
                                               ((("atoll-retry-after-s", "-1"),), None),
                                               ((("other", "3"),), None)])
def test_a_refusal_says_when_to_try_again(metadata, seconds) -> None:
    from atoll.rpc import retry_after
    assert retry_after(_Refusal(metadata)) == seconds
