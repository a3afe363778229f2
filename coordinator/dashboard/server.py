"""The dashboard's web server: aiohttp on an event loop thread of its own, beside the coordinator's gRPC server.

One builder thread takes a snapshot of the job (`atoll.coordinator.dashboard.snapshot`) every PERIOD while
anyone watches (every IDLE_PERIOD otherwise, so the event log misses nothing) and serializes it once; every
browser's server-sent event stream is handed the same bytes. Ten browsers cost ten socket writes a second, not ten
reads of the state.

Every page and API call needs the job token or the viewer token (`access`): as `Authorization: Bearer TOKEN`,
as the cookie the login form sets, or once in the address (`/?token=TOKEN`, which sets the cookie and
redirects to an address without it). The static files (the page's code, no data) are served to anyone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import ssl
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web

from atoll.coordinator.dashboard.access import ViewerToken, may_view
from atoll.coordinator.dashboard.events import EventLog
from atoll.coordinator.dashboard.snapshot import Snapshots, history_doc

log = logging.getLogger("atoll.coordinator.dashboard")

COOKIE = "atoll_dashboard"
PERIOD_S = (0.5, 1.0)
"""Seconds between snapshots while anyone watches: the shorter while one costs little, up to the longer as the
job grows (a snapshot then costs at most about 2% of a core)."""
IDLE_PERIOD_S = 5.0
"""Seconds between snapshots while nobody watches (events are still noticed)."""
PING_S = 15.0
"""A comment line on idle event streams this often, so proxies keep them open."""
STATIC = ("index.html", "login.html", "app.js", "app.css")


def _clean(x: Any) -> Any:
    """`x` with every non-finite float as None (JSON has no infinity)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def to_json(doc: Any) -> bytes:
    try:
        text = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = json.dumps(_clean(doc), separators=(",", ":"), allow_nan=False)
    return text.encode("utf-8")


def _asset(name: str) -> bytes:
    return resources.files("atoll.coordinator.dashboard").joinpath("static", name).read_bytes()


def tls_context(key_pem: bytes, cert_pem: bytes) -> ssl.SSLContext:
    """A server TLS context of a PEM key and certificate chain held in memory."""
    import os
    import tempfile

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory(prefix="atoll-dashboard-") as d:  # ssl loads keys from files only
        key, cert = Path(d) / "key.pem", Path(d) / "cert.pem"
        key.touch(mode=0o600)
        key.write_bytes(key_pem)
        cert.write_bytes(cert_pem)
        ctx.load_cert_chain(str(cert), str(key))
        os.unlink(key)
    return ctx


class Dashboard:
    """The dashboard of one coordinator: `start()` binds `host:port` (0: a free port) and serves until `stop()`."""

    def __init__(self, state, *, host: str = "127.0.0.1", port: int = 0, viewer: ViewerToken | None = None,
                 tls: ssl.SSLContext | None = None, events: EventLog | None = None) -> None:
        self.state = state
        self.host, self.port = host, port
        self.viewer = viewer
        self.tls = tls
        self.events = events if events is not None else EventLog()
        self.snapshots = Snapshots(state, self.events)
        self._doc = b"{}"
        self._version = 0
        self._history: tuple[str, bytes] = ("", b"")
        self._watchers = 0
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Condition | None = None
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._serve, name="atoll-dashboard", daemon=True)
        self._builder = threading.Thread(target=self._build, name="atoll-dashboard-snapshot", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.build_seconds = 0.0
        """How long the newest snapshot took to build and serialize."""

    # --- life -------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls is not None else 'http'}://{host}:{self.port}/"

    def start(self) -> Dashboard:
        self._take()  # the first snapshot before the first page asks
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error
        self._builder.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._loop is not None and self._runner is not None:
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            try:
                fut.result(timeout=10)
            except Exception:  # noqa: BLE001 - stopping: a late stream's error is of no use now
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._builder.join(timeout=10)

    async def _shutdown(self) -> None:
        async with self._changed:
            self._changed.notify_all()  # streams see the stop and end
        await self._runner.cleanup()

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._bind())
        except BaseException as e:  # noqa: BLE001 - said by start() in the caller's thread
            self._error = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        loop.run_forever()
        loop.close()

    async def _bind(self) -> None:
        self._changed = asyncio.Condition()
        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/", self._index)
        app.router.add_post("/login", self._login)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/snapshot", self._snapshot)
        app.router.add_get("/api/stream", self._stream)
        app.router.add_get("/api/history", self._history_json)
        app.router.add_get("/api/island/{island}", self._island)
        app.router.add_get("/api/node/{node}", self._node)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.tls, backlog=128)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # port 0: the one the system picked

    # --- snapshots ------------------------------------------------------------------------------------------------

    def _take(self) -> None:
        started = time.monotonic()
        doc = self.snapshots.take()
        doc["snapshot_seconds"] = self.build_seconds  # what the one before cost (read and serialized), for benches
        doc["snapshot_period_seconds"] = self.period
        data = to_json(doc)
        self.build_seconds = time.monotonic() - started
        self._doc = data
        self._version += 1
        if self._loop is not None and self._changed is not None:
            asyncio.run_coroutine_threadsafe(self._notify(), self._loop)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _build(self) -> None:
        last = time.monotonic()
        while True:
            if self._stop.wait(self.period):
                return
            now = time.monotonic()
            if self._watchers == 0 and now - last < IDLE_PERIOD_S:
                continue
            last = now
            try:
                self._take()
            except Exception:  # noqa: BLE001 - the dashboard must outlive one bad read; the log says what failed
                log.exception("dashboard snapshot failed")

    @property
    def period(self) -> float:
        """Seconds between snapshots while anyone watches: 50 times what the last one cost, within PERIOD_S."""
        return min(PERIOD_S[1], max(PERIOD_S[0], 50 * self.build_seconds))

    def note_tick(self, lines: list[str]) -> None:
        """What a round of the coordinator's loop decided (its events)."""
        if lines:
            self.events.note_tick(lines)

    # --- access ---------------------------------------------------------------------------------------------------

    def _token_of(self, request: web.Request) -> str | None:
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return auth[7:].strip()
        return request.cookies.get(COOKIE) or request.query.get("token")

    def _allowed(self, token: str | None) -> bool:
        return may_view(token, self.state.token, self.viewer)

    @web.middleware
    async def _guard(self, request: web.Request, handler):
        if request.path.startswith("/static/") or request.path == "/login":
            return await handler(request)
        if not self._allowed(self._token_of(request)):
            if request.path.startswith("/api/"):
                return web.json_response({"error": "missing or wrong token: give the job token or the viewer "
                                          "token (atoll job viewer-token)"}, status=401)
            return self._login_page(status=401)
        return await handler(request)

    def _login_page(self, status: int = 401, message: str = "") -> web.Response:
        page = _asset("login.html").decode("utf-8").replace("{{message}}", message)
        return web.Response(text=page, content_type="text/html", status=status,
                            headers={"Cache-Control": "no-store"})

    def _with_cookie(self, response: web.StreamResponse, token: str) -> web.StreamResponse:
        response.set_cookie(COOKIE, token, httponly=True, samesite="Strict", secure=self.tls is not None, path="/")
        return response

    async def _login(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        token = str(form.get("token", "")).strip()
        if not self._allowed(token):
            return self._login_page(401, "That token opens no dashboard of this job.")
        return self._with_cookie(web.HTTPSeeOther("/"), token)

    # --- pages and data -------------------------------------------------------------------------------------------

    async def _index(self, request: web.Request) -> web.StreamResponse:
        token = request.query.get("token")
        if token:  # the token once in the address: kept as a cookie, and taken out of the address bar
            return self._with_cookie(web.HTTPSeeOther("/"), token)
        return web.Response(body=_asset("index.html"), content_type="text/html",
                            headers={"Cache-Control": "no-store"})

    async def _static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound()
        kind = {"js": "application/javascript", "css": "text/css", "html": "text/html"}[name.rsplit(".", 1)[1]]
        return web.Response(body=_asset(name), content_type=kind, headers={"Cache-Control": "no-cache"})

    async def _snapshot(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self._doc, content_type="application/json")

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        self._watchers += 1
        try:
            sent = 0
            while not self._stop.is_set():
                if self._version != sent:
                    sent = self._version
                    await response.write(b"event: snapshot\ndata: " + self._doc + b"\n\n")
                    continue
                quiet = False
                async with self._changed:  # the version is checked again under the lock the notice needs
                    if self._version != sent:
                        continue
                    try:
                        await asyncio.wait_for(self._changed.wait(), PING_S)
                    except asyncio.TimeoutError:
                        quiet = True
                if quiet:  # (written outside the lock: a slow browser holds up no other)
                    await response.write(b": ping\n\n")
        except ConnectionResetError:  # the browser went away
            pass
        finally:
            self._watchers -= 1
        return response

    async def _history_json(self, request: web.Request) -> web.StreamResponse:
        key = self.snapshots.doc.get("history_key", "")
        if key != self._history[0] or not self._history[1]:
            points = await asyncio.get_running_loop().run_in_executor(None, self.state.store.history)
            self._history = (key, to_json(history_doc(points)))
        return web.Response(body=self._history[1], content_type="application/json")

    async def _island(self, request: web.Request) -> web.StreamResponse:
        rows = self.snapshots.island_nodes(request.match_info["island"])
        if rows is None:
            return web.json_response({"error": "no such island (islands change as nodes join and leave)"},
                                     status=404)
        return web.Response(body=to_json(rows), content_type="application/json")

    async def _node(self, request: web.Request) -> web.StreamResponse:
        page = self.snapshots.node_page(request.match_info["node"])
        if page is None:
            return web.json_response({"error": "no such node in this job"}, status=404)
        return web.Response(body=to_json(page), content_type="application/json")
