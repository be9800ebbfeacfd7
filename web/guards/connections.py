"""Slow clients are closed, not served forever: every listener of the service runs through here.

aiohttp bounds a request head's size but not how long it may take to arrive, nor how slowly a
body may come: its only clock is the keep-alive timeout (75 s under `web.run_app`, 3630 s under
a bare `AppRunner`), armed once when a connection opens and never by the bytes that trickle in.
A client that sends one header line every few seconds therefore holds a connection, a file
descriptor and a parser for that long, and thousands of them run the process out of descriptors.

`GuardedRunner` is an `AppRunner` whose listeners hand each new connection to `ConnectionGuard`:

- **Request heads** (`request_head_timeout`): a connection's first head must be complete within
  that many seconds of its opening; each later head (keep-alive) within that many seconds of its
  first byte. Past it the client gets `408` and the connection is closed.
- **Request bodies** (`min_body_rate`): while a request's body is still arriving, every
  `request_head_timeout` seconds the connection must have delivered at least
  `min_body_rate` bytes a second over that window; a slower one gets `408` and is closed.
  A handler that has its whole body (or none: a GET long-poll) is never judged by it.
- **Open connections** (`max_connections`, by default sized from the open-file limit), counted
  over every guarded listener of the process: beyond it each new connection is answered `503`
  with `Retry-After` and closed at once, so the accept queue never grows and the descriptors
  already open keep serving.

The guard relies on three attributes of aiohttp's `RequestHandler` (`_request_count`,
`_messages`, `_current_request`; aiohttp 3.9 to 3.14); `tests/test_slow_clients.py` pins the
behaviour, so an aiohttp that changes them fails there first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

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

    @property
    def connection_cap(self) -> int:
        return self.max_connections or default_max_connections()


def connection_limits(settings: ServiceSettings) -> ConnectionLimits:
    """The service's settings for every listener (API, admission webhook, worker health)."""
    return ConnectionLimits(
        request_head_timeout=settings.request_head_timeout,
        min_body_rate=settings.min_body_rate,
        max_connections=settings.max_connections or 0,
    )


class GuardedHandler(RequestHandler):
    """aiohttp's request handler with a clock on request heads and on body rate."""

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._heads = 0  # request heads parsed so far
        self._window_bytes = 0  # bytes received since the body check last looked

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._guard.opened()
        self._arm_head_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._guard.closed()
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


class _Busy(asyncio.Protocol):
    """A connection beyond the cap: answered 503 and closed, before any byte of it is read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(_BUSY)
        transport.close()


class _ProcessConnections:
    """Connections open in this process, over every guarded listener (the cap is per process)."""

    open = 0


class ConnectionGuard:
    """The protocol factory a listener calls per connection: a guarded handler, or `_Busy`."""

    def __init__(self, server: web.Server, limits: ConnectionLimits) -> None:
        self.server = server
        self.limits = limits
        self.cap = limits.connection_cap
        self.refused = 0
        self.closed_slow_heads = 0
        self.closed_slow_bodies = 0
        self._warned = False

    @property
    def open(self) -> int:
        return _ProcessConnections.open

    def opened(self) -> None:
        _ProcessConnections.open += 1

    def closed(self) -> None:
        _ProcessConnections.open -= 1

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.cap:
            self.refused += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "%d connections open, GPUBADGE_MAX_CONNECTIONS reached: new ones are answered 503",
                    self.open,
                )
            return _Busy()
        self._warned = False
        # the same arguments aiohttp's own Server.__call__ hands its RequestHandler
        return GuardedHandler(self.server, guard=self, loop=self.server._loop, **self.server._kwargs)


class GuardedRunner(web.AppRunner):
    """An `AppRunner` whose sites accept connections through a `ConnectionGuard`."""

    def __init__(self, app: web.Application, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._limits = limits
        self.guard: ConnectionGuard | None = None

    @property
    def server(self) -> web.Server | None:
        server = super().server
        if server is None:
            return None
        if self.guard is None or self.guard.server is not server:
            self.guard = ConnectionGuard(server, self._limits)
        # TCPSite only calls what it gets: a protocol factory with the Server's interface
        return self.guard  # type: ignore[return-value]


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
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
            if print is not None:
                print(
                    f"======== Running on {site.name} ========"
                    f" (at most {limits.connection_cap} connections; request heads within"
                    f" {limits.request_head_timeout:g} s, bodies at {limits.min_body_rate} B/s or more)"
                )
            while True:
                await asyncio.sleep(3600)
        finally:
            await runner.cleanup()

    asyncio.set_event_loop(loop)
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
