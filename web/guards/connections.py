"""Slow clients are closed, not served forever, and no client takes every connection: every listener
of the service runs through here.

aiohttp bounds a request head's size but not how long it may take to arrive, nor how slowly a
body may come: its only clock is the keep-alive timeout (75 s under `web.run_app`, 3630 s under
a bare `AppRunner`), armed once when a connection opens and never by the bytes that trickle in.
A client that sends one header line every few seconds therefore holds a connection, a file
descriptor and a parser for that long, and thousands of them run the process out of descriptors.

`GuardedRunner` is an `AppRunner` whose listeners hand each new connection to `ConnectionGuard`:

- **Open connections** (`max_connections`, by default sized from the open-file limit), counted
  over every guarded listener of the process from the moment they are accepted (a TLS connection
  from before its handshake): beyond it each new connection is answered `503` with `Retry-After`
  (a TLS one is closed) at once, so the accept queue never grows and the descriptors already open
  keep serving.
- **The reserve** (`connection_reserve`): the last connections under the cap are for health checks
  (`/healthz`), agents holding an agent token and admission reviews. Once the cap less the reserve
  are open, any other request is answered `503` with `Retry-After` as soon as its head is read
  (`reserve_middleware`), and every answer closes its connection, so the busy process sheds what
  can wait and keeps what must not. While the reserve is in use a peer address that already holds
  `connection_reserve_per_peer` connections gets no new one (`503` at once): one client cannot take
  the reserve, whoever else it locks out. Peers are told apart by address only.
- **TLS handshakes** (a listener given a `tls` context): done here, after the connection is
  counted, with `request_head_timeout` to finish (asyncio's own default is 60 s, and a connection
  in its handshake was counted nowhere); a failed or stalled handshake is counted
  (`failed_handshakes`) and logged at debug only.
- **Request heads** (`request_head_timeout`): a connection's first head must be complete within
  that many seconds of its opening (of its handshake's end, on TLS); each later head (keep-alive)
  within that many seconds of its first byte. Past it the client gets `408` and the connection is
  closed.
- **Request bodies** (`min_body_rate`): while a request's body is still arriving, every
  `request_head_timeout` seconds the connection must have delivered at least
  `min_body_rate` bytes a second over that window; a slower one gets `408` and is closed.
  A handler that has its whole body (or none: a GET long-poll) is never judged by it.

The listening socket's own failures (`accept()` out of descriptors) are logged once a minute, not
once per attempt (`quiet_accept_errors`).

The guard relies on three attributes of aiohttp's `RequestHandler` (`_request_count`,
`_messages`, `_current_request`; aiohttp 3.9 to 3.14); `tests/test_slow_clients.py` pins the
behaviour, so an aiohttp that changes them fails there first.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import resource
import ssl
import time
from asyncio import sslproto
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from aiohttp.web_protocol import RequestHandler

from web.fleet.long_polls import PublicWaits
from web.held_counts import HeldCounts
from web.security import bearer_token

if TYPE_CHECKING:
    from web.settings import ServiceSettings

log = logging.getLogger(__name__)

_REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 16\r\n\r\nrequest too slow"
)
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 1\r\n"
    b"Content-Type: text/plain\r\nContent-Length: 25\r\n\r\ntoo many open connections"
)
FD_RESERVE_MIN = 256  # descriptors kept back from the connection cap for the store, registries, files
RESERVE_RETRY_SECONDS = 1


def default_max_connections(soft_limit: int | None = None) -> int:
    """Connections one process may hold open: its open-file limit less a reserve (a tenth of the
    limit, at least FD_RESERVE_MIN) for everything else it opens; at least 64."""
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft_limit == resource.RLIM_INFINITY:
            soft_limit = 65536
    return max(64, soft_limit - max(FD_RESERVE_MIN, soft_limit // 10))


@dataclass(frozen=True)
class ConnectionLimits:
    """What a listener allows one connection, and how many it holds open at once."""

    request_head_timeout: float = 10.0
    min_body_rate: int = 1024
    max_connections: int = 0  # 0: `default_max_connections()`
    connection_reserve: int | None = None  # None: a tenth of the cap, at least 16
    connection_reserve_per_peer: int | None = None  # None: a quarter of the reserve, at least 4

    @property
    def connection_cap(self) -> int:
        return self.max_connections or default_max_connections()

    @property
    def reserve(self) -> int:
        """Connections under the cap kept for health checks, agents and admission (at most half)."""
        cap = self.connection_cap
        wanted = self.connection_reserve if self.connection_reserve is not None else max(16, cap // 10)
        return min(wanted, cap // 2)

    @property
    def reserve_per_peer(self) -> int:
        """While the reserve is in use, a peer holding this many connections gets no new one."""
        if self.connection_reserve_per_peer is not None:
            return self.connection_reserve_per_peer
        return max(4, self.reserve // 4)


def connection_limits(settings: ServiceSettings) -> ConnectionLimits:
    """The service's settings for every listener (API, admission webhook, worker health)."""
    return ConnectionLimits(
        request_head_timeout=settings.request_head_timeout,
        min_body_rate=settings.min_body_rate,
        max_connections=settings.max_connections or 0,
        connection_reserve=settings.connection_reserve,
        connection_reserve_per_peer=settings.connection_reserve_per_peer,
    )


class ProcessConnections:
    """Connections open in this process, over every guarded listener (the cap is per process), by
    peer address; and the cap and reserve the last guard started applies (`reserve_middleware`)."""

    held = HeldCounts()  # by peer address; one process-wide tally, on the loop
    cap = 0  # 0: no guarded listener in this process
    reserve = 0

    @classmethod
    def in_reserve(cls) -> bool:
        """More than the cap less the reserve are open: only reserved requests are served."""
        return cls.cap > 0 and cls.held.total > cls.cap - cls.reserve


def _peer(transport: asyncio.BaseTransport) -> str:
    name = transport.get_extra_info("peername")
    if isinstance(name, tuple) and name:
        return str(name[0])
    return "local"  # a UNIX socket's peer


class GuardedHandler(RequestHandler):
    """aiohttp's request handler with a clock on request heads and on body rate. Its connection was
    counted (`ConnectionGuard.admit`) before it was made; it gives it back when lost."""

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, peer: str, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._peer = peer
        self.made = False  # its connection was made (over TLS: once the handshake was done)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._heads = 0  # request heads parsed so far
        self._window_bytes = 0  # bytes received since the body check last looked

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made = True
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._guard.release(self._peer)
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        between_requests = not self._messages and self._current_request is None
        super().data_received(data)
        self._window_bytes += len(data)
        if self._request_count > self._heads:  # one or more heads completed
            self._heads = self._request_count
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            if self._body_timer is None:
                self._window_bytes = 0
                self._body_timer = self._loop.call_later(
                    self._guard.limits.request_head_timeout, self._check_body_rate
                )
        elif between_requests and self._head_timer is None:
            self._arm_head_timer()  # the first bytes of a keep-alive connection's next head

    def _arm_head_timer(self) -> None:
        self._head_timer = self._loop.call_later(self._guard.limits.request_head_timeout, self._head_too_slow)

    def _head_too_slow(self) -> None:
        self._head_timer = None
        self._guard.closed_slow_heads += 1
        self._refuse()

    def _check_body_rate(self) -> None:
        self._body_timer = None
        request = self._current_request
        window = self._guard.limits.request_head_timeout
        received, self._window_bytes = self._window_bytes, 0
        if request is None or request.content.is_eof():
            return  # the body is in (or the handler has not started): nothing to judge now
        if received < self._guard.limits.min_body_rate * window:
            self._guard.closed_slow_bodies += 1
            self._refuse()
            return
        self._body_timer = self._loop.call_later(window, self._check_body_rate)

    def _refuse(self) -> None:
        """408 and close. Nothing of a response has been sent yet: the head was incomplete, or the
        handler is still reading the body (no route of ours answers before it has its body)."""
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(_REQUEST_TIMEOUT)
        self.force_close()


class _Gate(asyncio.Protocol):
    """Every accepted connection's first protocol: counted and handed to a `GuardedHandler` (over TLS,
    through asyncio's `SSLProtocol` with the head timeout as its handshake's deadline), or refused at
    once. Admitted, it is out of the connection's way: the transport speaks to its new protocol from
    the first byte (so a ClientHello sent with the connection is never lost)."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self._guard = guard

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes
        guard = self._guard
        peer = _peer(transport)
        if not guard.admit(peer):
            if guard.tls is None:
                transport.write(_BUSY)
                transport.close()
            else:  # no HTTP to answer with before a handshake: the client sees the close
                transport.abort()
            return
        handler = guard.handler(peer)
        if guard.tls is None:
            transport.set_protocol(handler)
            handler.connection_made(transport)
            return
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()
        secure = sslproto.SSLProtocol(
            loop,
            handler,
            guard.tls,
            finished,
            server_side=True,
            ssl_handshake_timeout=guard.limits.request_head_timeout,  # type: ignore[arg-type]  # typeshed: int; seconds
        )
        transport.set_protocol(secure)
        secure.connection_made(transport)
        guard.handshaking.add(transport)
        finished.add_done_callback(lambda done: guard.handshake_ended(done, transport, handler, peer))


class ConnectionGuard:
    """The protocol factory a listener calls per connection (a `_Gate`): the cap, the reserve and its
    per-peer share, TLS handshakes with a deadline."""

    def __init__(
        self, server: web.Server, limits: ConnectionLimits, tls: ssl.SSLContext | None = None
    ) -> None:
        self.server = server
        self.limits = limits
        self.tls = tls
        self.cap = limits.connection_cap
        self.reserve = limits.reserve
        self.reserve_per_peer = limits.reserve_per_peer
        self.refused = 0  # connections refused at the cap
        self.refused_in_reserve = 0  # refused for their peer's share while the reserve is in use
        self.closed_slow_heads = 0
        self.closed_slow_bodies = 0
        self.failed_handshakes = 0  # TLS handshakes that failed or did not finish in time
        self.handshaking: set[asyncio.Transport] = set()  # TLS connections before their handshake's end
        self._warned = 0.0
        ProcessConnections.cap, ProcessConnections.reserve = self.cap, self.reserve

    @property
    def open(self) -> int:
        return ProcessConnections.held.total

    def admit(self, peer: str) -> bool:
        """Count a new connection from `peer`, or refuse it: at the cap, or, while the reserve is in
        use, when `peer` already holds its share of connections."""
        opened = ProcessConnections.held.total
        held = ProcessConnections.held.of(peer)
        if opened >= self.cap:
            self.refused += 1
            self._warn(
                f"{opened} connections open, GPUBADGE_MAX_CONNECTIONS reached: new ones are answered 503"
            )
            return False
        if opened >= self.cap - self.reserve and held >= self.reserve_per_peer:
            self.refused_in_reserve += 1
            self._warn(
                f"{opened} connections open, in GPUBADGE_CONNECTION_RESERVE: peers holding"
                f" {self.reserve_per_peer} or more get no new one (GPUBADGE_CONNECTION_RESERVE_PER_PEER)"
            )
            return False
        ProcessConnections.held.take(peer)
        return True

    def release(self, peer: str) -> None:
        ProcessConnections.held.give_back(peer)

    def _warn(self, message: str) -> None:
        """Once a minute at most: a flood of refusals is one line, not one per connection."""
        now = time.monotonic()
        if now - self._warned >= 60.0:
            self._warned = now
            log.warning("%s", message)

    def handler(self, peer: str) -> GuardedHandler:
        # the same arguments aiohttp's own Server.__call__ hands its RequestHandler
        return GuardedHandler(
            self.server, guard=self, peer=peer, loop=self.server._loop, **self.server._kwargs
        )

    def __call__(self) -> asyncio.Protocol:
        return _Gate(self)

    def handshake_ended(
        self, done: asyncio.Future[None], transport: asyncio.Transport, handler: GuardedHandler, peer: str
    ) -> None:
        """A TLS handshake ended: the handler has its connection (SSLProtocol made it before saying
        so), or it failed (timed out, refused by TLS, or the client left) and is given back here.
        Failures are counted and logged at debug only: a flood of them is no flood of the log."""
        self.handshaking.discard(transport)
        failure = None if done.cancelled() else done.exception()
        if handler.made:
            return
        self.failed_handshakes += 1
        self.release(peer)
        log.debug("TLS handshake from %s failed: %s", peer, failure or "closed")

    def stop_handshakes(self) -> None:
        """Shutdown: connections still in their handshake are closed (aiohttp knows only the others)."""
        for transport in list(self.handshaking):
            transport.abort()


class GuardedRunner(web.AppRunner):
    """An `AppRunner` whose sites accept connections through a `ConnectionGuard`; with `tls`, the
    guard does the TLS handshake itself (give its sites no `ssl_context`)."""

    def __init__(
        self,
        app: web.Application,
        limits: ConnectionLimits,
        *,
        tls: ssl.SSLContext | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **kwargs)
        self._limits = limits
        self._tls = tls
        self.guard: ConnectionGuard | None = None

    @property
    def server(self) -> web.Server | None:
        server = super().server
        if server is None:
            return None
        if self.guard is None or self.guard.server is not server:
            self.guard = ConnectionGuard(server, self._limits, self._tls)
        # TCPSite only calls what it gets: a protocol factory with the Server's interface
        return self.guard  # type: ignore[return-value]

    async def shutdown(self) -> None:
        if self.guard is not None:
            self.guard.stop_handshakes()
        await super().shutdown()


# ------------------------------------------------------------------ the reserve, per request

AGENT_PATHS = re.compile(
    r"^/api/(servers(/[^/]+/heartbeat)?|agents/[^/]+/deployments|deployments/[^/]+/status)$"
)


def service_reserved(settings: ServiceSettings) -> Callable[[web.BaseRequest], bool]:
    """Which requests the API listener serves from the reserve: health checks, admission reviews,
    and agents' requests that hold an agent token (any agent's, where none is configured and
    `allow_agents_without_token` opts in)."""
    tokens = [
        token.get_secret_value().encode()
        for token in (settings.agent_token, *settings.agent_tokens.values())
        if token
    ]
    open_agents = not tokens and settings.allow_agents_without_token

    def reserved(request: web.BaseRequest) -> bool:
        path = request.path
        if path == "/healthz" or path.startswith("/k8s/admit"):
            return True
        if not AGENT_PATHS.match(path):
            return False
        if open_agents:
            return True
        given = (bearer_token(request) or "").encode()
        matched = False
        for token in tokens:  # every comparison runs
            matched |= hmac.compare_digest(given, token)
        return matched

    return reserved


def reserve_middleware(reserved: Callable[[web.BaseRequest], bool]) -> Middleware:
    """While the reserve is in use (`ProcessConnections.in_reserve`), a request `reserved` does not
    name gets 503 and Retry-After as soon as its head is read, and every answer closes its
    connection (keep-alive idles would hold what the reserve is for)."""

    @web.middleware
    async def reserve(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not ProcessConnections.in_reserve():
            return await handler(request)
        if not reserved(request):
            refused = web.json_response(
                {
                    "error": "the service is at its connection cap less the reserve kept for health checks,"
                    " agents and admission (GPUBADGE_MAX_CONNECTIONS, GPUBADGE_CONNECTION_RESERVE); retry shortly"
                },
                status=503,
                headers={"Retry-After": str(RESERVE_RETRY_SECONDS)},
            )
            refused.force_close()
            return refused
        response = await handler(request)
        response.force_close()
        return response

    return reserve


def public_waits(settings: ServiceSettings) -> PublicWaits:
    """The public long polls' caps: the settings', else a quarter of the connection cap, and a
    quarter of that (at least 16) per peer."""
    limit = settings.public_long_poll_max or max(1, connection_limits(settings).connection_cap // 4)
    per_peer = settings.public_long_polls_per_peer or max(16, limit // 4)
    return PublicWaits(limit, min(per_peer, limit))


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Log the listening socket's `accept()` failures (out of descriptors: asyncio retries every
    second, with a traceback each time) once a minute, and everything else as the loop would."""
    last = [0.0]

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if "accept" in message or "listen" in message:  # asyncio's and uvloop's words for it
            now = time.monotonic()
            if now - last[0] < 60.0:
                return
            last[0] = now
            log.error("%s: %s (logged once a minute)", context.get("message"), context.get("exception"))
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handle)


def run_guarded_app(
    app: web.Application,
    *,
    host: str,
    port: int,
    limits: ConnectionLimits,
    loop: asyncio.AbstractEventLoop,
    print: Any = None,
    **runner_kwargs: Any,
) -> None:
    """`web.run_app` for one TCP host and port, its listener guarded by `limits`.

    As `run_app`: SIGINT and SIGTERM end it gracefully (the app's cleanup runs, open requests get
    `shutdown_timeout`), idle keep-alive connections close after 75 s, and the loop is closed after.
    """
    runner_kwargs.setdefault("keepalive_timeout", 75.0)

    async def serve() -> None:
        runner = GuardedRunner(app, limits, handle_signals=True, **runner_kwargs)
        try:
            await runner.setup()
        except BaseException:  # a start-up step failed: what the steps before it started stops
            await runner.cleanup()
            raise
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
            if print is not None:
                print(
                    f"======== Running on {site.name} ========"
                    f" (at most {limits.connection_cap} connections, the last {limits.reserve} kept for health"
                    f" checks, agents and admission; request heads within {limits.request_head_timeout:g} s,"
                    f" bodies at {limits.min_body_rate} B/s or more)"
                )
            while True:
                await asyncio.sleep(3600)
        finally:
            await runner.cleanup()

    asyncio.set_event_loop(loop)
    quiet_accept_errors(loop)
    main_task = loop.create_task(serve())
    try:
        loop.run_until_complete(main_task)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            if not main_task.done():
                main_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    loop.run_until_complete(main_task)
        finally:
            pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
