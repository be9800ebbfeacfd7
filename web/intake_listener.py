"""The intake port: `POST /hooks/{source}` served by threads of its own, so a registry's answer
never waits for the event loop.

A registry sends its next delivery only once the last one is answered, and every answer must
follow a durable record of the job. On the main port that answer crosses from the event loop to
a commit thread and back, and each crossing waits for the loop to take a turn among everything
else `serve` does: under a push burst that wait doubled the answer's time against a receiver
that only records arrivals (bench/RESULTS.md, issue 44). Here one thread reads a delivery,
judges it (`web.webhook_judge`, exactly as the main port does), commits its jobs
(`JobIntake.enqueue_here`), and sends the answer itself; only then does it tell the loop (the
metrics, the workers' wake-up), off the answer's path.

How the threads share the port (leader and followers): one thread at a time, the leader, waits
on the selector for every open connection and the listening sockets, accepts, reads what has
arrived and feeds it to each connection's HTTP/1.1 parser (httptools: llhttp, Node's parser). A
connection with a whole request in is taken out of the selector, and the leader serves that
request itself. It keeps the lead while it does when nothing else is ready and the request is
quick (a body up to QUICK_BODY_BYTES, committed to an intake journal, or to PostgreSQL itself
while no other connection is open), then polls again: under one registry's deliveries one thread
does everything and the others sleep. Otherwise it hands the lead on first, so other requests are
read and served meanwhile (by as many threads), and a served connection goes back to the selector
through the leader. No thread ever waits on one client: requests are read without blocking, so a
slow client holds a buffer, never a thread.

Bounds, the main port's where they apply:

- `GPUBADGE_INTAKE_THREADS` deliveries judged and committed at once;
- `GPUBADGE_INTAKE_MAX_CONNECTIONS` open connections: past it a new one is answered 503 with
  Retry-After and closed;
- `GPUBADGE_REQUEST_HEAD_TIMEOUT`: a request head must be complete within that many seconds of
  the connection's opening, or of its first byte (keep-alive); a slower one gets 408 and is closed;
- `GPUBADGE_MIN_BODY_RATE`: while a body arrives, each such window must bring that many bytes a
  second, else 408;
- `GPUBADGE_MAX_BODY_BYTES`: a larger body is 413, on its Content-Length before it is read
  where it declares one; a request head over MAX_HEAD_BYTES (16 KiB) is 431;
- an idle keep-alive connection is closed after KEEPALIVE_SECONDS (aiohttp's own default);
- an answer the client does not read is abandoned after `GPUBADGE_REQUEST_HEAD_TIMEOUT`.

Only `POST /hooks/{source}` is served here; anything else is 404 or 405 with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import selectors
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import parse_qsl, unquote

import httptools

from jobs.intake import RETRY_AFTER_SECONDS, QueueFull
from store import StoreUnavailable, queries
from web import hooks
from web.settings import ServiceSettings
from web.state import Services
from web.webhook_judge import Refusal, accepted_body, judge_delivery, unknown_source

log = logging.getLogger(__name__)

KEEPALIVE_SECONDS = 75.0  # an idle keep-alive connection is closed after this (aiohttp's default)
MAX_HEAD_BYTES = 16 * 1024  # a request head larger than this is 431
READ_BYTES = 64 * 1024  # one recv() of a connection's bytes
SWEEP_SECONDS = 0.5  # how often the leader looks for connections past their deadlines
ACCEPT_PAUSE_SECONDS = 0.1  # accepting rests this long after accept() fails (out of descriptors)
PATH_PREFIX = "/hooks/"
# A request with a body up to this size is served by the thread that read it without handing the
# lead on first (when no other request is ready): waking another thread to wait on the selector
# cost a delivery's answer about 0.2 ms (bench/RESULTS.md), more than judging and committing it.
QUICK_BODY_BYTES = 64 * 1024
Answer = tuple[int, dict[str, object], dict[str, str]]  # status, JSON body, extra headers


@dataclass(frozen=True)
class _Request:
    """One whole request, as the parser read it (header names lower-cased)."""

    target: str
    headers: list[tuple[str, str]]
    body: bytes
    keep_alive: bool


class _Refused(Exception):
    """Raised in a parser callback: the request is answered `status` from what is read so far."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class _Connection:
    """One client connection: its socket, its parser (httptools calls the `on_*` methods back), and
    where its request stands. Touched by the leader only, except while a thread serves it."""

    def __init__(self, sock: socket.socket, peer: str, settings: ServiceSettings) -> None:
        self.sock, self.peer, self.settings = sock, peer, settings
        self.parser = httptools.HttpRequestParser(self)
        self.phase = "head"  # idle (between requests), head, body
        self.deadline = time.monotonic() + settings.request_head_timeout  # the current phase's end
        self.head_bytes = 0  # bytes read while a head was incomplete
        self.window_bytes = 0  # body bytes read since the current body window opened
        self.requests: deque[_Request] = deque()  # whole requests read, not yet served
        self.serving = False  # out of the selector: a thread serves its requests
        self.closed = False  # closed by the thread that served it: the leader only forgets it
        self.continue_wanted = False  # `Expect: 100-continue`, to answer once this read is parsed
        self.source: str | None = None  # the request's `{source}`, once its head is read (for the metrics)
        self._target = bytearray()
        self._headers: list[tuple[str, str]] = []
        self._body = bytearray()

    # The parser's callbacks.

    def on_message_begin(self) -> None:
        if self.phase == "idle":  # head_bytes already counts this head's first read
            self.phase = "head"
            self.deadline = time.monotonic() + self.settings.request_head_timeout
        self._target, self._headers, self._body, self.source = bytearray(), [], bytearray(), None

    def on_url(self, url: bytes) -> None:
        self._target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        settings = self.settings
        target = self._target.decode("latin-1")
        self.source = _source_of(target)
        problem = _request_problem(self.parser.get_method(), target, self._headers, settings)
        if problem is not None:
            raise _Refused(*problem)
        self.phase, self.head_bytes, self.window_bytes = "body", 0, 0
        self.deadline = time.monotonic() + settings.request_head_timeout
        self.continue_wanted = any(
            name == "expect" and value.lower() == "100-continue" for name, value in self._headers
        )

    def on_body(self, body: bytes) -> None:
        self._body += body
        if len(self._body) > self.settings.max_body_bytes:
            raise _Refused(413, f"body larger than {self.settings.max_body_bytes} bytes")

    def on_message_complete(self) -> None:
        target = self._target.decode("latin-1")
        request = _Request(target, self._headers, bytes(self._body), self.parser.should_keep_alive())
        self.requests.append(request)
        self.phase = "idle"
        self.continue_wanted = False


class _Lead:
    """The lead (who waits on the selector), taken at once and released at most once by its thread."""

    __slots__ = ("_lock", "held")

    def __init__(self, lock: threading.Lock) -> None:
        lock.acquire()
        self._lock, self.held = lock, True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._lock.release()


class IntakeListener:
    """`POST /hooks/{source}` on sockets of its own, served by `threads` threads (see the module).

    `bind` opens the listening sockets (so `serve` reports a taken port before it starts anything);
    `start`, on the event loop, starts the threads for the service's `Services`; `close` stops them
    and closes every connection."""

    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self.services: Services  # set by `start`
        self._listening: list[socket.socket] = []
        self._selector = selectors.DefaultSelector()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        self._lead = threading.Lock()  # held by the thread that waits on the selector
        self._ready: deque[_Connection] = deque()  # whole requests, for the next free thread (leader's)
        self._returned: deque[_Connection] = deque()  # served, back to the selector (leader's to register)
        self._open: set[_Connection] = set()  # the leader's and the serving threads'
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_sweep = 0.0
        self._paused: list[socket.socket] = []  # listening sockets not accepting until _accept_again_at
        self._accept_again_at = 0.0
        self._accept_logged_at = -60.0

    @property
    def ports(self) -> list[int]:
        """The ports listened on (one per address the host resolved to)."""
        return [sock.getsockname()[1] for sock in self._listening]

    def bind(self, host: str, port: int) -> None:
        """Listen on every address `host` resolves to, at `port` (0: any free port); OSError as bind's."""
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        try:
            for family, kind, proto, _, address in addresses:
                sock = socket.socket(family, kind, proto)
                self._listening.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                port = port or sock.getsockname()[1]  # every address on the same port
                sock.listen(1024)
                sock.setblocking(False)
        except OSError:
            self._close_listening()
            raise

    def start(self, services: Services) -> None:
        """On the event loop `serve` runs: start the threads (after `bind`), serving `services`."""
        self.services = services
        self._loop = asyncio.get_running_loop()
        for sock in self._listening:
            self._selector.register(sock, selectors.EVENT_READ, None)
        self._selector.register(self._wake_reader, selectors.EVENT_READ, None)
        for number in range(self.settings.intake_threads):
            thread = threading.Thread(target=self._serve, name=f"intake-{number}", daemon=True)
            thread.start()
            self._threads.append(thread)
        where = ", ".join(f"{sock.getsockname()[0]}:{sock.getsockname()[1]}" for sock in self._listening)
        log.info("intake port: POST /hooks/{source} on %s, %d threads", where, len(self._threads))

    def close(self, timeout: float = 5.0) -> None:
        """Stop the threads (a delivery being committed finishes first), close every connection."""
        self._stopping = True
        self._wake()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads.clear()
        for connection in list(self._open):
            self._drop(connection)
        self._close_listening()
        with contextlib.suppress(Exception):
            self._selector.close()
        self._wake_reader.close()
        self._wake_writer.close()

    def _close_listening(self) -> None:
        for sock in self._listening:
            sock.close()
        self._listening.clear()

    # The threads: the leader polls; whoever holds a whole request serves it.

    def _serve(self) -> None:
        """A thread's life: take the lead, poll until a request is whole, serve it; the thread that
        served a request without handing the lead on keeps it and polls again, so under one
        registry's deliveries one thread does everything and the others sleep."""
        lead: _Lead | None = None
        try:
            while not self._stopping:
                if lead is None or not lead.held:
                    lead = _Lead(self._lead)
                connection = self._ready.popleft() if self._ready else None
                while connection is None and not self._stopping:
                    try:
                        self._poll()
                    except Exception:  # a bug here must not take the port down with it
                        log.exception("intake port: polling failed; going on")
                        time.sleep(0.1)
                    connection = self._ready.popleft() if self._ready else None
                if connection is None:
                    continue
                if self._ready or len(connection.requests[0].body) > QUICK_BODY_BYTES:
                    lead.release()  # others wait, or this one takes long: the next thread polls now
                try:
                    self._serve_request(connection, lead)
                except Exception:
                    log.exception("intake port: serving a request from %s failed", connection.peer)
                    connection.closed = True
                    connection.sock.close()
                    self._give_back(connection, lead)
        finally:
            if lead is not None:
                lead.release()

    def _give_back(self, connection: _Connection, lead: _Lead) -> None:
        """A served connection back to the selector: at once by the leader, else through the leader."""
        if lead.held:
            self._resume(connection)
        else:
            self._returned.append(connection)
            self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: the leader is waking anyway
            self._wake_writer.send(b"\0")

    def _poll(self) -> None:
        """The leader: register returned connections, wait for bytes or connections, read them."""
        while self._returned:
            self._resume(self._returned.popleft())
        now = time.monotonic()
        if self._paused and now >= self._accept_again_at:
            for listening in self._paused:
                self._selector.register(listening, selectors.EVENT_READ, None)
            self._paused.clear()
        if now >= self._next_sweep:
            self._sweep(now)
            self._next_sweep = now + SWEEP_SECONDS
        if self._ready:
            return
        for key, _ in self._selector.select(SWEEP_SECONDS):
            if key.data is not None:
                self._read(key.data)
            elif key.fileobj is self._wake_reader:
                with contextlib.suppress(OSError):
                    while self._wake_reader.recv(4096):
                        pass
            else:
                self._accept(key.fileobj)  # type: ignore[arg-type]

    def _accept(self, listening: socket.socket) -> None:
        settings = self.settings
        while True:
            try:
                sock, address = listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, or the like: the backlog waits a moment
                self._pause_accepting(listening, exc)
                return
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)
            connection = _Connection(sock, peer, settings)
            self._open.add(connection)
            if len(self._open) > settings.intake_max_connections:
                self._refuse(
                    connection,
                    503,
                    f"the intake port holds {settings.intake_max_connections} connections"
                    " (GPUBADGE_INTAKE_MAX_CONNECTIONS); retry shortly",
                    {"Retry-After": "1"},  # as the main port's cap answers
                )
                continue
            self._selector.register(sock, selectors.EVENT_READ, connection)

    def _pause_accepting(self, listening: socket.socket, exc: OSError) -> None:
        """The leader: stop accepting on `listening` for ACCEPT_PAUSE_SECONDS (its backlog waits),
        rather than retry at once in a loop; said once a minute, not once per attempt."""
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(listening)
        self._paused.append(listening)
        self._accept_again_at = time.monotonic() + ACCEPT_PAUSE_SECONDS
        if time.monotonic() >= self._accept_logged_at + 60:
            self._accept_logged_at = time.monotonic()
            log.warning(
                "intake port: accept failed (%s); paused %.1f s, said again in a minute",
                exc,
                ACCEPT_PAUSE_SECONDS,
            )

    def _read(self, connection: _Connection) -> None:
        """The leader: what has arrived on `connection`, fed to its parser; a whole request is ready."""
        try:
            data = connection.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(connection)
            return
        if not data:  # the client closed (or half-closed: nothing more to read)
            self._drop(connection)
            return
        if connection.phase == "body":
            connection.window_bytes += len(data)
        else:
            connection.head_bytes += len(data)
        try:
            connection.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            refused = exc.__context__
            if isinstance(refused, _Refused):
                self._refuse(connection, refused.status, refused.message)
            else:
                log.error("intake port: a parser callback failed", exc_info=refused)
                self._refuse(connection, 500, "internal error; see the service log")
            return
        except httptools.HttpParserUpgrade:
            self._refuse(connection, 400, "protocol upgrades are not served here")
            return
        except httptools.HttpParserError as exc:
            self._refuse(connection, 400, f"malformed HTTP request: {exc}")
            return
        if connection.continue_wanted:
            connection.continue_wanted = False
            self._send_now(connection, b"HTTP/1.1 100 Continue\r\n\r\n")
        if connection.requests:
            self._selector.unregister(connection.sock)
            connection.serving = True
            self._ready.append(connection)
        elif connection.phase == "head" and connection.head_bytes > MAX_HEAD_BYTES:
            self._refuse(connection, 431, f"request head larger than {MAX_HEAD_BYTES} bytes")

    def _resume(self, connection: _Connection) -> None:
        """The leader: a served connection back; its next request may already be read."""
        if connection.closed:
            self._open.discard(connection)
            return
        if connection.requests:  # pipelined: served next, still out of the selector
            self._ready.append(connection)
            return
        connection.serving = False
        if connection.phase == "idle":
            connection.deadline = time.monotonic() + KEEPALIVE_SECONDS
        self._selector.register(connection.sock, selectors.EVENT_READ, connection)

    def _sweep(self, now: float) -> None:
        """The leader: close connections past their deadline (408 for a request still arriving)."""
        settings = self.settings
        for connection in [c for c in self._open if not c.serving and c.deadline <= now]:
            if connection.phase == "idle":
                self._drop(connection)
            elif connection.phase == "head":
                self._refuse(
                    connection,
                    408,
                    f"request head not complete within {settings.request_head_timeout:g} s"
                    " (GPUBADGE_REQUEST_HEAD_TIMEOUT)",
                )
            elif connection.window_bytes >= settings.min_body_rate * settings.request_head_timeout:
                connection.window_bytes = 0  # fast enough: judged again over the next window
                connection.deadline = now + settings.request_head_timeout
            else:
                self._refuse(
                    connection,
                    408,
                    f"request body slower than {settings.min_body_rate} bytes a second (GPUBADGE_MIN_BODY_RATE)",
                )

    # Answers.

    def _refuse(
        self, connection: _Connection, status: int, message: str, headers: dict[str, str] | None = None
    ) -> None:
        """The leader: answer an error at once, without reading further, and close the connection."""
        if connection.source is not None:  # a webhook refused before it was served: counted all the same
            self._tell(connection.source, status, None, queued=False)
        answer = {**(headers or {}), "Connection": "close"}
        self._send_now(connection, _response_bytes(status, {"error": message}, answer))
        self._drop(connection)

    def _send_now(self, connection: _Connection, data: bytes) -> None:
        """The leader: a short answer into the socket's buffer, without waiting; lost if it is full."""
        with contextlib.suppress(OSError):
            connection.sock.send(data)

    def _drop(self, connection: _Connection) -> None:
        self._open.discard(connection)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(connection.sock)
        connection.sock.close()

    def _serve_request(self, connection: _Connection, lead: _Lead) -> None:
        """On this thread: judge, commit and answer the connection's next request, then give the
        connection back (`_give_back`). `lead`, while held, is kept (this thread polls next), unless a
        commit may wait (see `_answer`)."""
        request = connection.requests.popleft()
        started = time.perf_counter()
        source, (status, payload, headers) = self._answer(request, connection.peer, lead)
        queued = status == 202 and bool(payload.get("jobs"))
        keep = request.keep_alive
        if not keep:
            headers["Connection"] = "close"
        data = _response_bytes(status, payload, headers)
        seconds = time.perf_counter() - started
        sock = connection.sock
        try:
            sock.settimeout(self.settings.request_head_timeout)  # a client that never reads is let go
            sock.sendall(data)
            sock.setblocking(False)
        except OSError:
            keep = False
        self._tell(source, status, seconds, queued)  # after the answer: the loop's turn is not awaited
        if queued:
            self.services.intake.tidy_here()
        if not keep:
            connection.closed = True
            sock.close()
        self._give_back(connection, lead)  # forgotten, or waited on again

    def _tell(self, source: str, status: int, seconds: float | None, queued: bool) -> None:
        """After an answer: `_told` on the loop (unless it has closed: nobody to tell)."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._told, source, status, seconds, queued)

    def _others_may_wait(self) -> bool:
        """Whether anyone could be served while this thread waits on a commit: a request already
        read, or another open connection (a listening socket's new one waits in its backlog)."""
        return bool(self._ready) or len(self._open) > 1

    def _told(self, source: str, status: int, seconds: float | None, queued: bool) -> None:
        """On the loop, after an answer: the webhook metrics, and this process's workers woken."""
        services = self.services
        services.metrics.count_webhook(source, status, seconds)
        if queued:
            services.store.jobs_queued()
            services.wake_workers()

    def _answer(self, request: _Request, peer: str, lead: _Lead) -> tuple[str, Answer]:
        """The delivery's source and its answer: judged, then its deletions and jobs committed. A
        deletion (it waits for the store's writer) first releases `lead`, and so does a commit that
        waits for a server (PostgreSQL's round trip) while another connection could be served
        meanwhile; with none open, waking a second thread only to wait on the selector would cost
        the answer more than it could save (a new connection waits in the backlog for that round
        trip, which the store bounds by its timeout: `PostgresStore.enqueue_many`)."""
        path, _, query_text = request.target.partition("?")
        source = _source_of(request.target) or ""
        services, settings = self.services, self.settings
        query = dict(parse_qsl(query_text, keep_blank_values=True))
        is_own = services.attacher.is_own if services.attacher is not None else None
        judged = judge_delivery(source, request.body, dict(request.headers), query, settings, is_own, peer)
        if isinstance(judged, Refusal):
            return source, (judged.status, judged.body(), {})
        if judged.deletes or (not services.intake.journaled and self._others_may_wait()):
            lead.release()
        try:
            for event in judged.deletes:
                services.store.blocking.run(
                    queries.mark_gone, event.registry, event.repository, tag=event.tag, digest=event.digest
                )
            job_ids = services.intake.enqueue_here(
                judged.pushes, source=source, max_attempts=settings.max_attempts
            )
        except QueueFull as full:
            return source, (503, {"error": str(full)}, {"Retry-After": str(RETRY_AFTER_SECONDS)})
        except StoreUnavailable as exc:
            log.warning("POST %s: %s", path, exc)
            return source, (
                503,
                {"error": f"the database is unavailable, retry later: {exc.public}"},
                {"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        except Exception:
            log.exception("unhandled error on POST %s", path)
            return source, (500, {"error": "internal error; see the service log"}, {})
        return source, (202, accepted_body(judged, job_ids), {})


def _source_of(target: str) -> str | None:
    """The `{source}` of a `/hooks/{source}` target; None for any other path."""
    path = target.partition("?")[0]
    rest = path.removeprefix(PATH_PREFIX)
    return unquote(rest) if path.startswith(PATH_PREFIX) and rest and "/" not in rest else None


def _request_problem(
    method: bytes, target: str, headers: list[tuple[str, str]], settings: ServiceSettings
) -> tuple[int, str] | None:
    """Why a request is answered from its head alone (status, reason), or None to read its body."""
    source = _source_of(target)
    path = target.partition("?")[0]
    if len(target) + sum(len(name) + len(value) + 4 for name, value in headers) > MAX_HEAD_BYTES:
        return 431, f"request head larger than {MAX_HEAD_BYTES} bytes"
    if source is None:
        return 404, f"the intake port serves POST {PATH_PREFIX}{{source}} only; the API is on GPUBADGE_PORT"
    if source not in hooks.SENDERS:
        return 404, unknown_source(source).message
    if method != b"POST":
        return 405, f"{method.decode('latin-1')} {path}: webhooks are delivered with POST"
    for name, value in headers:
        if name == "content-length" and value.strip().isdigit() and int(value) > settings.max_body_bytes:
            return 413, f"body larger than {settings.max_body_bytes} bytes"
    return None


def _response_bytes(status: int, payload: dict[str, object], headers: dict[str, str]) -> bytes:
    """One whole answer: `payload` as JSON, with `headers`."""
    content = json.dumps(payload).encode()
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(content)}\r\n{extra}\r\n"
    ).encode("latin-1") + content
