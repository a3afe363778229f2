"""The one place that builds gRPC servers and channels.

Message-size limits, keepalive, TLS, the job token and default deadlines are set here and nowhere else.
Servers bind port 0 when asked and report the real address back.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
import urllib.parse
from collections.abc import Callable, Coroutine, Sequence
from concurrent import futures
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import grpc

from atoll.rpcguard import AioDecodeGuard, DecodeGuard

TOKEN_METADATA_KEY = "authorization"
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class RpcOptions:
    """Transport settings shared by servers and channels."""

    max_message_bytes: int = 8 * 1024 * 1024
    """Largest single message accepted or sent. Tensors travel in chunks well below this."""
    keepalive: timedelta = timedelta(seconds=20)
    """Interval of HTTP/2 keepalive pings on idle connections."""
    keepalive_timeout: timedelta = timedelta(seconds=10)
    """How long a keepalive ping may go unanswered before the connection is dropped."""
    default_deadline: timedelta = timedelta(seconds=30)
    """Deadline given to a client call that names none."""
    handshake_timeout: timedelta = timedelta(seconds=10)
    """Server: how long a new connection may take to finish its TLS and HTTP/2 handshake before it is dropped
    (gRPC's own default is 120 s, so a few hundred half-open connections held a server's sockets for minutes)."""
    max_connections: int | None = None
    """Server: connections open at once; one more is closed as it arrives (None: no bound). gRPC bounds them per
    server, not per peer."""
    max_connection_idle: timedelta | None = None
    """Server: a connection with no call for this long is closed (its client reconnects at its next call); None:
    never."""
    tls_cert: Path | None = None
    """Server: PEM certificate chain. Enables TLS on servers when set with tls_key."""
    tls_key: Path | None = None
    """Server: PEM private key."""
    tls_root_ca: Path | None = None
    """Client: PEM root certificate to verify servers with. Enables TLS on channels when set."""
    tls_server_name: str | None = None
    """Client: name to verify in the server certificate, when it differs from the dialled host."""
    mtls: MutualTls | None = None
    """Mutual TLS from keys and certificates held in memory (a job's CA, see `atoll.tls`); supersedes the
    path fields above."""

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be at least 1024, got {self.max_message_bytes}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        for name in ("keepalive", "keepalive_timeout", "default_deadline", "handshake_timeout"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1 (or None for no bound), got {self.max_connections}")
        if self.max_connection_idle is not None and self.max_connection_idle <= timedelta(0):
            raise ValueError("max_connection_idle must be positive (or None: never)")

    def channel_options(self) -> list[tuple[str, Any]]:
        opts: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive.total_seconds() * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout.total_seconds() * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # a lost server is redialled at most 2 s apart (gRPC's default backoff grows past 2 minutes), so
            # nodes find a restarted coordinator, or a peer, well within a lease (10 s by default)
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.min_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        name = self.mtls.server_name if self.mtls is not None and self.mtls.server_name else self.tls_server_name
        if name:
            opts.append(("grpc.ssl_target_name_override", name))
        return opts

    def server_options(self) -> list[tuple[str, Any]]:
        opts: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive.total_seconds() * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout.total_seconds() * 1000)),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.so_reuseport", 0),
            ("grpc.server_handshake_timeout_ms", max(1, int(self.handshake_timeout.total_seconds() * 1000))),
        ]
        if self.max_connections is not None:
            opts.append(("grpc.max_allowed_incoming_connections", self.max_connections))
        if self.max_connection_idle is not None:
            opts.append(("grpc.max_connection_idle_ms", int(self.max_connection_idle.total_seconds() * 1000)))
        return opts


def rendezvous_prefix(token: str | None, job_id: str, epoch: int) -> str:
    """Where a plan epoch's process groups meet in the coordinator's rendezvous store (torch's TCPStore, which
    authenticates nobody): under a name derived from the job token (HMAC-SHA256 of the job and epoch), so one
    who reaches the store without the token can guess no key the nodes read or write. Without a token (in-process
    tests) the job id and epoch name it."""
    if not token:
        return f"atoll/{job_id}/epoch-{epoch}"
    tag = hmac.new(token.encode(), f"atoll-rendezvous/{job_id}/{epoch}".encode(), "sha256").hexdigest()[:32]
    return f"atoll/{tag}"


@dataclass(frozen=True)
class TlsIdentity:
    """One end's PEM private key and certificate chain."""

    key_pem: bytes
    cert_pem: bytes


class MutualTls:
    """Mutual TLS material kept in memory.

    `roots_pem` verifies the other end's certificate; `identity` is this end's. Both may be replaced while a
    server runs (new handshakes use the new ones), as a node's peer server does once its join brings its
    certificate. A server given `client_roots_pem` requires client certificates and verifies them against
    those roots (None: it asks for none). A client expects
    `server_name` in the server's certificate instead of the host it dials, and sends the job token only with
    `send_token` (peer links do not: the certificate says who calls).
    """

    def __init__(self, *, roots_pem: bytes, identity: TlsIdentity | None = None,
                 client_roots_pem: bytes | None = None, server_name: str | None = None, send_token: bool = True):
        if not roots_pem:
            raise ValueError("mutual TLS needs the root certificate(s) that verify the other end")
        self.server_name = server_name
        self.send_token = send_token
        self._roots = roots_pem
        self._client_roots = client_roots_pem
        self._identity = identity
        self._lock = threading.Lock()

    @property
    def roots_pem(self) -> bytes:
        with self._lock:
            return self._roots

    @property
    def client_roots_pem(self) -> bytes | None:
        with self._lock:
            return self._client_roots

    @property
    def identity(self) -> TlsIdentity | None:
        with self._lock:
            return self._identity

    def update(self, identity: TlsIdentity, roots_pem: bytes | None = None) -> None:
        """Replace this end's identity and, when given, the roots (client roots of a server too)."""
        with self._lock:
            self._identity = identity
            if roots_pem is not None:
                self._roots = roots_pem
                if self._client_roots is not None:
                    self._client_roots = roots_pem

    def with_server_name(self, server_name: str | None) -> MutualTls:
        """A copy of this material as it is now, expecting `server_name` in the server's certificate."""
        with self._lock:
            return MutualTls(roots_pem=self._roots, identity=self._identity, client_roots_pem=self._client_roots,
                             server_name=server_name, send_token=self.send_token)

    def _snapshot(self) -> tuple[TlsIdentity | None, bytes | None]:
        with self._lock:
            return self._identity, self._client_roots

    def server_credentials(self) -> grpc.ServerCredentials:
        first = self._snapshot()
        if first[0] is None:
            raise ValueError("a TLS server needs a key and certificate")

        def config(snap: tuple[TlsIdentity | None, bytes | None]) -> grpc.ServerCertificateConfiguration:
            identity, client_roots = snap
            assert identity is not None
            return grpc.ssl_server_certificate_configuration([(identity.key_pem, identity.cert_pem)],
                                                             root_certificates=client_roots)

        served = [first]

        def fetch() -> grpc.ServerCertificateConfiguration | None:  # asked at each new handshake
            now = self._snapshot()
            if now[0] is None or (now[0] is served[0][0] and now[1] is served[0][1]):
                return None
            served[0] = now
            return config(now)

        return grpc.dynamic_ssl_server_credentials(config(first), fetch,
                                                   require_client_authentication=first[1] is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        identity, roots = self.identity, self.roots_pem
        if identity is None:
            return grpc.ssl_channel_credentials(root_certificates=roots)
        return grpc.ssl_channel_credentials(root_certificates=roots, private_key=identity.key_pem,
                                            certificate_chain=identity.cert_pem)


@dataclass
class ServerHandle:
    """A started server and the address it really listens on."""

    server: grpc.Server
    address: str
    port: int
    _stopped: bool = field(default=False, repr=False)

    def stop(self, grace: timedelta = timedelta(seconds=2)) -> None:
        if not self._stopped:
            self._stopped = True
            self.server.stop(grace.total_seconds()).wait(grace.total_seconds() + 5)


def make_server(
    listen: str,
    register: Sequence[Callable[[grpc.Server], None]],
    options: RpcOptions | None = None,
    *,
    max_workers: int = 16,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> ServerHandle:
    """Start a server on `listen` (HOST:PORT; port 0 picks a free one) with the given servicers.

    `register` holds callables such as `lambda s: add_PeerServicer_to_server(servicer, s)`.
    """
    options = options or RpcOptions()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="atoll-rpc"),
        options=options.server_options(),
        interceptors=[*interceptors, DecodeGuard()],  # innermost: it wraps the servicers' own handlers
        maximum_concurrent_rpcs=max_workers * 4,
    )
    for reg in register:
        reg(server)
    port = _bind(server, listen, options)
    server.start()
    host = listen.rsplit(":", 1)[0]
    return ServerHandle(server=server, address=f"{host}:{port}", port=port)


def _bind(server: grpc.Server | grpc.aio.Server, listen: str, options: RpcOptions) -> int:
    """Add the listening port (TLS when the options say so); the port really bound."""
    try:
        if options.mtls is not None:
            port = server.add_secure_port(listen, options.mtls.server_credentials())
        elif options.tls_cert is not None and options.tls_key is not None:
            creds = grpc.ssl_server_credentials(
                [(Path(options.tls_key).read_bytes(), Path(options.tls_cert).read_bytes())])
            port = server.add_secure_port(listen, creds)
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"could not listen on {listen}: the address is in use or invalid")
    return port


@dataclass
class AioServerHandle:
    """A started `grpc.aio` server, the event loop thread it runs on, and the address it really listens on."""

    server: grpc.aio.Server
    loop: asyncio.AbstractEventLoop
    address: str
    port: int
    _thread: threading.Thread = field(repr=False)
    _stopped: bool = field(default=False, repr=False)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the server's loop from another thread and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace: timedelta = timedelta(seconds=2)) -> None:
        """Stop the server (calls still open after `grace` are cancelled), then its loop and thread."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.run(self.server.stop(grace.total_seconds()), timeout=grace.total_seconds() + 5)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
        # calls the server's stop left behind (one waiting on a pool thread, say) end as asyncio.run ends them
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()  # also shuts the default executor, the server's thread pool, down


def make_aio_server(
    listen: str,
    register: Sequence[Callable[[grpc.aio.Server], None]],
    options: RpcOptions | None = None,
    *,
    max_workers: int = 16,
    maximum_concurrent_rpcs: int | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_pending_calls: int | None = None,
) -> AioServerHandle:
    """Start a `grpc.aio` server on `listen` (HOST:PORT; port 0 picks a free one) on an event loop thread of its own.

    `async def` handlers run on the loop, so a call that mostly waits (a long server stream) holds no thread;
    plain `def` handlers run unchanged on a pool of `max_workers` threads, which is also the loop's default
    executor (`loop.run_in_executor(None, ...)`) for the blocking work of async handlers. Calls beyond
    `maximum_concurrent_rpcs` (None: no bound) are refused with RESOURCE_EXHAUSTED. `max_pending_calls` (None: gRPC's
    own, 1,000 then 3,000 at most): calls gRPC may hold before the server's loop takes them; beyond it gRPC drops
    them (the caller sees CANCELLED), so a server that thousands of clients call at once raises it.
    """
    options = options or RpcOptions()
    pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="atoll-rpc")
    loop = asyncio.new_event_loop()
    loop.set_default_executor(pool)
    thread = threading.Thread(target=_run_loop, args=(loop,), name="atoll-rpc-loop", daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, int]:
        # the server belongs to the loop it is made on, so it is made there
        pending = [] if max_pending_calls is None else [("grpc.server.max_pending_requests", max_pending_calls),
                                                        ("grpc.server.max_pending_requests_hard_limit", max_pending_calls)]
        server = grpc.aio.server(migration_thread_pool=pool, options=options.server_options() + pending,
                                 interceptors=[*interceptors, AioDecodeGuard()],
                                 maximum_concurrent_rpcs=maximum_concurrent_rpcs)
        for reg in register:
            reg(server)
        port = _bind(server, listen, options)
        await server.start()
        return server, port

    try:
        server, port = asyncio.run_coroutine_threadsafe(start(), loop).result()
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        raise
    host = listen.rsplit(":", 1)[0]
    return AioServerHandle(server=server, loop=loop, address=f"{host}:{port}", port=port, _thread=thread)


class _ClientDefaults(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                      grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the job token to every call, and a deadline to calls that name none."""

    def __init__(self, token: str | None, deadline: timedelta):
        self._metadata = ((TOKEN_METADATA_KEY, f"Bearer {token}"),) if token else ()
        self._deadline = deadline.total_seconds()

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = tuple(d.metadata or ()) + self._metadata
        timeout = d.timeout if d.timeout is not None else self._deadline
        return _CallDetails(d.method, timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


def make_channel(target: str, options: RpcOptions | None = None, *, token: str | None = None,
                 streaming_deadline: bool = True, server_name: str | None = None) -> grpc.Channel:
    """A channel to `target` (HOST:PORT) that sends the token and applies the default deadline.

    Long-lived server streams (WatchPlan) pass their own, longer timeout per call. With mutual TLS,
    `server_name` is the name the server's certificate must carry (a peer's `atoll.tls.node_dns_name`).
    """
    options = options or RpcOptions()
    if options.mtls is not None:
        mtls = options.mtls if server_name is None else options.mtls.with_server_name(server_name)
        channel = grpc.secure_channel(target, mtls.channel_credentials(),
                                      options=replace(options, mtls=mtls).channel_options())
    elif options.tls_root_ca is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(options.tls_root_ca).read_bytes())
        channel = grpc.secure_channel(target, creds, options=options.channel_options())
    else:
        channel = grpc.insecure_channel(target, options=options.channel_options())
    if options.mtls is not None and not options.mtls.send_token:
        token = None
    return grpc.intercept_channel(channel, _ClientDefaults(token, options.default_deadline))


RETRY_AFTER_KEY = "atoll-retry-after-s"
"""Trailing metadata of a refusal that may pass when tried again later: the seconds to wait first."""


def retry_after(error: grpc.RpcError) -> float | None:
    """The seconds a refusal says to wait before trying once more (`RETRY_AFTER_KEY`); None: it does not say."""
    try:
        metadata = error.trailing_metadata() or ()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - an error without metadata (a local failure)
        return None
    for key, value in metadata:
        if key == RETRY_AFTER_KEY:
            try:
                seconds = float(value)
            except (TypeError, ValueError):
                return None
            return seconds if 0 <= seconds <= 3600 else None
    return None


def peer_host(peer: str) -> str:
    """The host of a gRPC `context.peer()` string ("ipv4:10.0.0.5:41234" -> "10.0.0.5", "ipv6:[::1]:5" -> "::1";
    "" for one without a host, such as a unix socket). gRPC may percent-encode it ("ipv6:%5B::1%5D:5")."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6") or not rest:
        return ""
    host = rest.rsplit(":", 1)[0] if kind == "ipv4" or rest.startswith("[") else rest
    return host.strip("[]")


def peer_certificate(context: grpc.ServicerContext) -> bytes | None:
    """The PEM certificate the caller presented over mutual TLS (already verified by TLS), or None."""
    certs = (context.auth_context() or {}).get("x509_pem_cert") or ()
    return certs[0] if certs else None


def token_from_metadata(context: grpc.ServicerContext) -> str | None:
    """The bearer token a call carries, or None."""
    for key, value in context.invocation_metadata() or ():
        if key == TOKEN_METADATA_KEY and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return None


def token_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison of a presented token with the job's."""
    return given is not None and hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def ready_within(channel: grpc.Channel, seconds: float) -> bool:
    """Whether the channel connects within `seconds`. A wait that times out is cancelled: left subscribed, grpc's
    connectivity-polling thread outlives it and raises `ValueError: Cannot invoke RPC: Channel closed!` (an
    uncaught traceback in the log) once the channel is closed."""
    future = grpc.channel_ready_future(channel)
    try:
        future.result(timeout=seconds)
        return True
    except grpc.FutureTimeoutError:
        future.cancel()
        return False


def wait_ready(channel: grpc.Channel, timeout: timedelta) -> None:
    """Block until the channel connects; raise `TimeoutError` with the target's state otherwise."""
    if not ready_within(channel, timeout.total_seconds()):
        raise TimeoutError(f"no gRPC server answered within {timeout.total_seconds():.0f}s")
