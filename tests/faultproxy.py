"""A scriptable, fault-injecting aiohttp reverse proxy in front of the real registry, and a token server.

A test adds `Rule`s (first match wins, each fires `times` times) to make the proxy answer
500/429, reset the connection mid-body, flip a byte, hang until released, strip or add
headers, redirect to another host, or drip the body `rate` bytes a second (a throttled proxy). With `require_bearer`, the proxy plays a registry
that wants tokens from a `TokenServer`. Everything it sees is recorded for assertions.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import re
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
from aiohttp import web

from fixtures.hostile_registry import flood
from fixtures.loopback_http import serve_on_free_port

Action = Literal[
    "status",
    "reset",
    "tamper",
    "hang",
    "redirect",
    "strip_headers",
    "add_headers",
    "chunked",
    "drip",
    "flood",
]
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}


@dataclass
class Rule:
    action: Action
    method: str | None = None
    path: str | None = None  # regex searched in the path
    times: int | None = 1  # None: forever
    status: int = 500
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    location: str = ""  # redirect: base URL; the request's path is appended
    remove: tuple[str, ...] = ()
    rate: float = 1.0  # drip: body bytes per second
    size: int = 0  # flood: body bytes sent (streamed, no Content-Length unless `declare`)
    declare: bool = False

    def matches(self, request: web.Request) -> bool:
        if self.times is not None and self.times <= 0:
            return False
        if self.method and request.method != self.method:
            return False
        return not (self.path and not re.search(self.path, request.path))


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    status: int | None = None


class FaultProxy:
    """Reverse proxy to `upstream` (e.g. http://127.0.0.1:5000) on a free loopback port."""

    def __init__(self, upstream: str, bind: str = "127.0.0.1") -> None:
        self.upstream = upstream.rstrip("/")
        self.bind = bind
        self.rules: list[Rule] = []
        self.seen: list[Seen] = []
        self.release = asyncio.Event()
        self.closing = asyncio.Event()  # set at close: drips stop, so shutdown never waits on them
        self.in_flight = 0
        self.max_in_flight = 0
        self.arrivals = asyncio.Condition()
        self.bearer_realm: str | None = None
        self.bearer_service = "test-registry"
        self.valid_tokens: set[str] | None = None
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def host(self) -> str:
        return f"{self.bind}:{self.port}"

    def add(self, rule: Rule) -> Rule:
        self.rules.append(rule)
        return rule

    def require_bearer(self, realm: str, tokens: set[str]) -> None:
        self.bearer_realm, self.valid_tokens = realm, tokens

    async def start(self) -> FaultProxy:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner, self.port = await serve_on_free_port(app, self.bind)
        return self

    async def close(self) -> None:
        self.release.set()
        self.closing.set()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def wait_for_in_flight(self, count: int, timeout: float = 5.0) -> None:
        async with self.arrivals:
            await asyncio.wait_for(self.arrivals.wait_for(lambda: self.in_flight >= count), timeout)

    def count(self, method: str | None = None, path: str | None = None, status: int | None = None) -> int:
        return sum(
            1
            for s in self.seen
            if (method is None or s.method == method)
            and (path is None or re.search(path, s.path))
            and (status is None or s.status == status)
        )

    # --- handling -------------------------------------------------------------------------------

    def _challenge(self, request: web.Request) -> web.Response | None:
        if self.bearer_realm is None or self.valid_tokens is None:
            return None
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer ") and header.removeprefix("Bearer ") in self.valid_tokens:
            return None
        match = re.match(r"^/v2/(.+?)/(manifests|blobs|tags)/", request.path)
        scope = f',scope="repository:{match.group(1)}:pull"' if match else ""
        challenge = f'Bearer realm="{self.bearer_realm}",service="{self.bearer_service}"{scope}'
        return web.json_response(
            {"errors": [{"code": "UNAUTHORIZED"}]}, status=401, headers={"WWW-Authenticate": challenge}
        )

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        seen = Seen(request.method, request.path, dict(request.headers))
        self.seen.append(seen)
        async with self.arrivals:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.arrivals.notify_all()
        try:
            response = await self._respond(request)
            seen.status = response.status
            return response
        finally:
            self.in_flight -= 1

    async def _respond(self, request: web.Request) -> web.StreamResponse:
        denied = self._challenge(request)
        if denied is not None:
            return denied
        rule = next((r for r in self.rules if r.matches(request)), None)
        if rule is not None and rule.times is not None:
            rule.times -= 1
        if rule is None:
            return await self._forward(request)
        if rule.action == "status":
            return web.Response(status=rule.status, headers=rule.headers, body=rule.body)
        if rule.action == "chunked":
            return await self._forward(request, chunked=True)
        if rule.action == "drip":
            return await self._forward(request, drip=rule.rate)
        if rule.action == "flood":
            location = rule.location.rstrip("/") + request.path_qs if rule.location else None
            return await flood(request, rule.size, declare=rule.declare, location=location)
        if rule.action == "redirect":
            return web.Response(status=307, headers={"Location": rule.location.rstrip("/") + request.path_qs})
        if rule.action == "hang":
            await asyncio.wait_for(self.release.wait(), timeout=60)
            return await self._forward(request)
        if rule.action == "reset":
            return await self._forward(request, reset_midway=True)
        if rule.action == "tamper":
            return await self._forward(request, tamper=True)
        if rule.action == "strip_headers":
            return await self._forward(request, remove=rule.remove)
        return await self._forward(request, extra=rule.headers)

    async def _forward(
        self,
        request: web.Request,
        *,
        tamper: bool = False,
        reset_midway: bool = False,
        chunked: bool = False,
        remove: tuple[str, ...] = (),
        extra: dict[str, str] | None = None,
        drip: float | None = None,
    ) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        headers.pop("Authorization", None)
        async with self._session.request(
            request.method,
            self.upstream + request.path_qs,
            headers=headers,
            data=await request.read(),
            allow_redirects=False,
        ) as upstream:
            body = await upstream.read()
            out_headers = {
                k: v
                for k, v in upstream.headers.items()
                if k.lower() not in HOP_BY_HOP and k.lower() not in {r.lower() for r in remove}
            }
            out_headers.update(extra or {})
            if tamper and body:
                body = body[:-1] + bytes([body[-1] ^ 0x01])
            if reset_midway and body:
                response = web.StreamResponse(status=upstream.status, headers=out_headers)
                response.content_length = len(body)
                await response.prepare(request)
                await response.write(body[: len(body) // 2])
                assert request.transport is not None
                request.transport.abort()
                return response
            if chunked:  # no Content-Length: the client can only enforce caps while reading
                response = web.StreamResponse(status=upstream.status, headers=out_headers)
                response.enable_chunked_encoding()
                await response.prepare(request)
                for start in range(0, len(body), 1024):
                    await response.write(body[start : start + 1024])
                await response.write_eof()
                return response
            if drip is not None and request.method != "HEAD" and body:
                # Headers at once, then the body a byte at a time at `drip` bytes a second, until the
                # client gives up (or the proxy closes): no read timeout ever fires on the client.
                response = web.StreamResponse(status=upstream.status, headers=out_headers)
                response.content_length = len(body)
                await response.prepare(request)
                for index in range(len(body)):
                    try:
                        await response.write(body[index : index + 1])
                    except (ConnectionError, RuntimeError):
                        return response
                    try:
                        await asyncio.wait_for(self.closing.wait(), 1 / drip)
                    except TimeoutError:
                        continue
                    return response
                await response.write_eof()
                return response
            if request.method == "HEAD":
                response = web.Response(status=upstream.status, headers=out_headers)
                if upstream.content_length is not None:
                    response.headers["Content-Length"] = str(upstream.content_length)
                return response
            return web.Response(status=upstream.status, headers=out_headers, body=body)


class TokenServer:
    """A Bearer token endpoint: GET with optional Basic auth, or the OAuth2 refresh-token POST."""

    def __init__(
        self,
        users: dict[str, str] | None = None,
        refresh_tokens: set[str] | None = None,
        expires_in: int | None = 300,
        allow_anonymous: bool = True,
    ) -> None:
        self.users = users or {}
        self.refresh_tokens = refresh_tokens or set()
        self.expires_in = expires_in
        self.allow_anonymous = allow_anonymous
        self.issued: set[str] = set()
        self.calls: list[dict[str, str]] = []
        self.port = 0
        self._counter = itertools.count(1)
        self._runner: web.AppRunner | None = None

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    async def start(self) -> TokenServer:
        app = web.Application()
        app.router.add_route("*", "/token", self._token)
        self._runner, self.port = await serve_on_free_port(app)
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> TokenServer:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _user(self, request: web.Request) -> str | None:
        header = request.headers.get("Authorization", "")
        if not header.startswith("Basic "):
            return None
        user, _, password = base64.b64decode(header[6:]).decode().partition(":")
        return user if self.users.get(user) == password else ""

    async def _token(self, request: web.Request) -> web.Response:
        form = dict(await request.post()) if request.method == "POST" else {}
        call = {
            "method": request.method,
            "scope": " ".join(request.query.getall("scope", [])) or str(form.get("scope", "")),
            "service": request.query.get("service", "") or str(form.get("service", "")),
            "grant_type": str(form.get("grant_type", "")),
            "authorization": request.headers.get("Authorization", ""),
        }
        self.calls.append(call)
        if request.method == "POST":
            if (
                form.get("grant_type") != "refresh_token"
                or form.get("refresh_token") not in self.refresh_tokens
            ):
                return web.json_response({"error": "invalid_grant"}, status=401)
        else:
            user = self._user(request)
            if user == "" or (user is None and not self.allow_anonymous):
                return web.json_response({"details": "incorrect username or password"}, status=401)
        token = f"token-{next(self._counter)}"
        self.issued.add(token)
        payload: dict[str, object] = {"access_token" if request.method == "POST" else "token": token}
        if self.expires_in is not None:
            payload["expires_in"] = self.expires_in
        return web.json_response(payload)
