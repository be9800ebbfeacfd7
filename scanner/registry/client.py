"""The OCI distribution client that reads registries (manifests, blobs, referrers) with the
scanner's pull credentials. Writes go through `scanner.registry.push` (oras-py, with each
registry's push account); scanner/registry/ is the only code in gpubadge that talks to registries.

What it guarantees, so callers need not think about it:
- every manifest and blob is checked against its sha256 (streams at EOF);
- sizes are capped by Content-Length and again while reading;
- tokens come lazily from the 401 challenge (no `/v2/` ping) and are cached per scope
  (`scanner.registry.auth.RegistryAuth`; this client only sends its token requests);
- redirects are followed here, and Authorization never crosses to another host;
- 5xx, resets and timeouts are retried with backoff and jitter, 429 honours Retry-After;
- a read slower than `min_transfer_rate` over `min_transfer_window` is cut off (`transfer`),
  and with `defer_retry_after` a Retry-After is raised at once and remembered per host;
- plain HTTP only to loopback or to registries configured `insecure`;
- every request is counted per logical scan (`with client.track() as stats`).
Errors are `RegistryError`s whose text names the host and object, never a secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDictProxy

from scanner.registry import mirrors, redirects
from scanner.registry.auth import (
    TOKEN_RESPONSE_MAX,
    RegistryAuth,
    TokenRequest,
    describe_token_request,
    parse_challenges,
)
from scanner.registry.blobs import BlobStream
from scanner.registry.credentials import Credentials, CredentialStore
from scanner.registry.descriptors import (
    DOCKER_SCHEMA1,
    MANIFEST_ACCEPT,
    OCI_INDEX,
    OCI_MANIFEST,
    SCHEMA1_MEDIA_TYPES,
    Descriptor,
    Manifest,
    bare_media_type,
    compute_digest,
    manifest_media_type,
)
from scanner.registry.errors import (
    DigestMismatch,
    NotFound,
    RateLimited,
    RegistryError,
    ServerError,
    TooLarge,
    TransportError,
    Unauthorized,
    UnsupportedManifest,
    error_codes,
    transport_error,
)
from scanner.registry.reference import Reference, ReferenceError, validate_digest
from scanner.registry.retry import RETRYABLE_STATUSES, RetryPolicy, parse_rate_limit, parse_retry_after
from scanner.registry.stats import RequestStats, count, track
from scanner.registry.transfer import TransferGuard
from scanner.settings import ScannerSettings

log = logging.getLogger(__name__)

ERROR_BODY_MAX = 4096

T = TypeVar("T")
RequestHook = Callable[[str, int | None, str | None], None]


class RegistryClient:
    """Async client for OCI registries. Use as `async with RegistryClient(settings) as client:`.

    `defer_retry_after` (the service's workers): a Retry-After is never slept on; it is raised
    at once, and the host stays cooling down in this client until then (`cool_down_left`), so
    the job goes back to the queue and the worker takes another registry's job.
    """

    def __init__(
        self,
        settings: ScannerSettings | None = None,
        *,
        on_request: RequestHook | None = None,
        credentials: CredentialStore | None = None,
        defer_retry_after: bool = False,
    ) -> None:
        self.settings = settings or ScannerSettings()
        self.on_request = on_request
        self.rate_limits: dict[str, int] = {}
        self.rate_limit_limits: dict[str, int] = {}
        self.totals = RequestStats()
        self.received_by_registry: dict[str, int] = {}  # bytes received, by registry, since start
        self.cutoffs_by_registry: dict[str, int] = {}  # transfers cut off as too slow, by host
        self.defer_retry_after = defer_retry_after
        self._cool_until: dict[str, float] = {}  # host -> time.monotonic() its Retry-After ends
        self._retry = RetryPolicy(
            self.settings, self.totals, defer_retry_after=defer_retry_after, on_retry_after=self._cool_down
        )
        self._credentials = credentials or CredentialStore(self.settings)
        self._session: aiohttp.ClientSession | None = None
        self._semaphores: dict[str, asyncio.Semaphore] = {}
        self._auth = RegistryAuth(self.settings, self._credentials, self._retry, self._token_exchange)
        # one request's bound, the same for every small read: made once (it is immutable)
        self._request_timeout = aiohttp.ClientTimeout(total=self.settings.request_timeout)

    def __repr__(self) -> str:
        return f"RegistryClient(hosts={sorted(self._semaphores)})"

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _received(self, registry: str, amount: int) -> None:
        count(self.totals, bytes_received=amount)
        self.received_by_registry[registry] = self.received_by_registry.get(registry, 0) + amount

    def _cool_down(self, host: str, seconds: float) -> None:
        """`host` answered with a Retry-After: remember when it ends (the later end wins)."""
        until = time.monotonic() + seconds
        self._cool_until[host] = max(until, self._cool_until.get(host, 0.0))

    def cool_down_left(self, host: str) -> float:
        """Seconds until `host`'s last Retry-After ends; 0 when it asked for none or it passed."""
        return max(0.0, self._cool_until.get(host, 0.0) - time.monotonic())

    def _guard(self, host: str, what: str) -> TransferGuard:
        """The rate floor for one transfer from `host` (GPUBADGE_MIN_TRANSFER_RATE)."""

        def cut_off() -> None:
            self.cutoffs_by_registry[host] = self.cutoffs_by_registry.get(host, 0) + 1

        return TransferGuard(
            self.settings.min_transfer_rate,
            self.settings.min_transfer_window,
            what=what,
            host=host,
            on_cutoff=cut_off,
        )

    def track(self) -> contextlib.AbstractContextManager[RequestStats]:
        """Count requests made in this context (and tasks started from it); nests and is task-safe."""
        return track()

    # --- public operations ---------------------------------------------------------------------

    async def resolve(self, ref: Reference) -> Descriptor:
        """HEAD the manifest: digest, media type and size without a counted pull; GET if no digest."""

        async def head(host: str) -> Descriptor | None:
            path = f"/v2/{ref.repository}/manifests/{ref.identifier}"
            async with self._semaphore(host):
                response = await self._open(
                    host, ref.repository, "HEAD", path, {"Accept": MANIFEST_ACCEPT}, self._timeout()
                )
                response.release()
            media_type = bare_media_type(response.headers.get("Content-Type"))
            self._refuse_schema1(media_type, ref)
            digest = response.headers.get("Docker-Content-Digest")
            try:
                digest = validate_digest(digest) if digest else None
            except ReferenceError:
                digest = None
            if digest is None:
                return None
            if ref.digest and digest != ref.digest:
                raise DigestMismatch(f"{ref}: registry {host} reports digest {digest}", host=host)
            return Descriptor(media_type or OCI_MANIFEST, digest, response.content_length or 0)

        found = await self._on_endpoints(ref, head)
        if found is not None:
            return found
        log.info("%s: no Docker-Content-Digest on HEAD; falling back to GET", ref)
        return (await self.manifest(ref)).descriptor()

    async def manifest(self, ref: Reference, digest: str | None = None) -> Manifest:
        """GET a manifest or index by digest (or the reference's tag/digest), verified."""
        identifier = validate_digest(digest) if digest else ref.identifier
        pinned = identifier if ":" in identifier else None
        path = f"/v2/{ref.repository}/manifests/{identifier}"
        limit = self.settings.max_manifest_bytes

        async def get(host: str) -> tuple[bytes, CIMultiDictProxy[str]]:
            async with self._semaphore(host):
                response = await self._open(
                    host, ref.repository, "GET", path, {"Accept": MANIFEST_ACCEPT}, self._timeout()
                )
                try:
                    body = await self._read_capped(host, response, limit, f"manifest {ref.name}@{identifier}")
                finally:
                    response.release()
            return body, response.headers

        body, headers = await self._on_endpoints(ref, get)
        algorithm = pinned.split(":", 1)[0] if pinned else "sha256"
        actual = compute_digest(body, algorithm)
        claimed = headers.get("Docker-Content-Digest")
        if pinned and actual != pinned:
            raise DigestMismatch(f"manifest {ref.name}@{pinned}: content digest is {actual}")
        if not pinned and claimed and claimed.startswith(f"{algorithm}:") and claimed != actual:
            raise DigestMismatch(
                f"manifest {ref}: registry claims digest {claimed} but content digest is {actual}"
            )
        try:
            data = json.loads(body)
        except ValueError:
            raise RegistryError(f"manifest {ref.name}@{identifier} is not valid JSON") from None
        if not isinstance(data, dict):
            raise RegistryError(f"manifest {ref.name}@{identifier} is not a JSON object")
        media_type = manifest_media_type(data, bare_media_type(headers.get("Content-Type")))
        if data.get("schemaVersion") == 1:
            media_type = DOCKER_SCHEMA1
        self._refuse_schema1(media_type, ref)
        return Manifest(media_type, actual, body, data)

    async def referrers(self, ref: Reference, digest: str) -> Manifest | None:
        """The referrers API's index for `digest`; None where the registry has no such API (a 404)."""
        path = f"/v2/{ref.repository}/referrers/{validate_digest(digest)}"
        limit = self.settings.max_manifest_bytes

        async def get(host: str) -> tuple[bytes, str]:
            async with self._semaphore(host):
                response = await self._open(
                    host, ref.repository, "GET", path, {"Accept": OCI_INDEX}, self._timeout()
                )
                try:
                    body = await self._read_capped(host, response, limit, f"referrers of {ref.name}@{digest}")
                finally:
                    response.release()
            return body, bare_media_type(response.headers.get("Content-Type"))

        try:
            body, media_type = await self._on_endpoints(ref, get)
        except NotFound:
            return None
        try:
            data = json.loads(body)
        except ValueError:
            return None
        if (
            media_type != OCI_INDEX
            or not isinstance(data, dict)
            or not isinstance(data.get("manifests"), list)
        ):
            return None  # a registry answering something else there has no referrers API
        return Manifest(OCI_INDEX, compute_digest(body), body, data)

    async def blob(self, ref: Reference, digest: str, max_bytes: int) -> bytes:
        """A small blob (an image config), read whole, capped and verified."""
        validate_digest(digest)
        path = f"/v2/{ref.repository}/blobs/{digest}"
        what = f"blob {ref.name}@{digest}"

        async def get(host: str) -> bytes:
            async with self._semaphore(host):
                response = await self._open(
                    host, ref.repository, "GET", path, {"Accept-Encoding": "identity"}, self._timeout()
                )
                try:
                    return await self._read_capped(host, response, max_bytes, what)
                finally:
                    response.release()

        body = await self._on_endpoints(ref, get)
        actual = compute_digest(body, digest.split(":", 1)[0])
        if actual != digest:
            raise DigestMismatch(f"{what}: content digest is {actual}")
        return body

    @contextlib.asynccontextmanager
    async def stream_blob(
        self,
        ref: Reference,
        digest: str,
        chunk_size: int = 65536,
        *,
        size: int | None = None,
        ranged: bool = False,
    ) -> AsyncIterator[BlobStream]:
        """Stream a blob's (compressed) bytes; the digest is checked if the consumer reads to the end.

        `ranged` (with the blob's `size`): read it in growing ranges (`scanner.registry.blobs`), for
        a consumer that may stop early. Leaving the block early closes the connection, so an early
        verdict costs only what was read, and the stream's `bytes_received` says what was sent.
        """
        validate_digest(digest)
        path = f"/v2/{ref.repository}/blobs/{digest}"
        what = f"blob {ref.name}@{digest}"
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.settings.request_timeout, sock_read=self.settings.request_timeout
        )
        held: list[asyncio.Semaphore] = []  # the host's slot stays taken while the caller reads
        chosen: list[str] = []  # the host that answered the first range (a mirror, or the registry)

        async def open_range(start: int, end: int | None) -> aiohttp.ClientResponse:
            headers = {"Accept-Encoding": "identity"}
            if start or end is not None:
                headers["Range"] = f"bytes={start}-{'' if end is None else end}"
            if chosen:
                host = chosen[0]
                return await self._retry.run(
                    lambda: self._open(host, ref.repository, "GET", path, headers, timeout), host=host
                )

            async def first(host: str) -> aiohttp.ClientResponse:
                slot = self._semaphore(host)
                await slot.acquire()
                try:
                    response = await self._open(host, ref.repository, "GET", path, headers, timeout)
                except BaseException:
                    slot.release()
                    raise
                held.append(slot)
                chosen.append(host)
                return response

            return await self._on_endpoints(ref, first)

        stream = BlobStream(
            open_range,
            digest,
            size=size,
            ranged=ranged,
            chunk_size=chunk_size,
            what=what,
            timeout=self.settings.request_timeout,
            received=lambda amount: self._received(chosen[0] if chosen else ref.api_host, amount),
            guard=lambda: self._guard(chosen[0] if chosen else ref.api_host, what),
        )
        try:
            await stream.start()
            yield stream
        finally:
            stream.close()
            for slot in held:
                slot.release()

    # --- endpoints, slots, retries -------------------------------------------------------------

    async def _on_endpoints(self, ref: Reference, operation: Callable[[str], Awaitable[T]]) -> T:
        """`operation` on the mirror first (if any), then the registry itself, each with retries."""

        def retried(host: str) -> Awaitable[T]:
            return self._retry.run(lambda: operation(host), host=host)

        return await mirrors.on_endpoints(mirrors.endpoints(ref, self.settings), retried)

    def _semaphore(self, host: str) -> asyncio.Semaphore:
        if host not in self._semaphores:
            self._semaphores[host] = asyncio.Semaphore(self.settings.concurrency_per_registry)
        return self._semaphores[host]

    def _timeout(self) -> aiohttp.ClientTimeout:
        return self._request_timeout

    # --- HTTP ----------------------------------------------------------------------------------

    def _plain_http_allowed(self, host: str) -> bool:
        return redirects.plain_http_allowed(self.settings, host)

    def _hop_allowed(self, origin: str, target: str) -> bool:
        return redirects.hop_allowed(self.settings, origin, target)

    def _scheme(self, host: str) -> str:
        return "http" if self._plain_http_allowed(host) else "https"

    def _http(self) -> aiohttp.ClientSession:
        """The one HTTP session. It keeps no cookies, as containerd's resolver and skopeo keep
        none: the registry API authenticates by header (tokens, basic), and a jar would only cost
        a cookie filter per request and an update per response (about 7% of a request's CPU)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers={"User-Agent": "gpubadge/0.1"},
                connector=aiohttp.TCPConnector(limit=100),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    def _observe(self, host: str, status: int | None, error: str | None) -> None:
        if self.on_request is not None:
            try:
                self.on_request(host, status, error)
            except Exception:
                log.exception("on_request hook failed")

    async def _send(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        timeout: aiohttp.ClientTimeout,
    ) -> aiohttp.ClientResponse:
        """One HTTP exchange, counted and observed (status, rate-limit headers)."""
        host = url.split("/", 3)[2]  # the URL's authority: `follow` built it, scheme://host/...
        count(self.totals, requests=1)
        try:
            response = await self._http().request(
                method, url, headers=dict(headers), allow_redirects=False, timeout=timeout
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            error = transport_error(exc, timeout.total or self.settings.request_timeout, url=url)
            self._observe(host, None, str(error))
            raise error from None
        self._observe(host, response.status, None)
        remaining = parse_rate_limit(response.headers.get("ratelimit-remaining"))
        if remaining is not None:
            self.rate_limits[host] = remaining
        limit = parse_rate_limit(response.headers.get("ratelimit-limit"))
        if limit is not None:
            self.rate_limit_limits[host] = limit
        return response

    async def _open(
        self,
        host: str,
        repository: str,
        method: str,
        path: str,
        headers: Mapping[str, str],
        timeout: aiohttp.ClientTimeout,
    ) -> aiohttp.ClientResponse:
        """A successful (2xx) response, after at most one challenge round; errors are mapped."""
        url = f"{self._scheme(host)}://{host}{path}"
        left = self.cool_down_left(host) if self.defer_retry_after else 0.0
        if left > 0:  # asking again before its Retry-After ends would only earn another 429
            raise RateLimited(
                f"{method} {host}{path}: {host} asked to wait (Retry-After), {left:.0f} s left",
                retry_after=left,
                host=host,
            )
        answered_challenge = False
        while True:
            authorization = await self._auth.authorization(host, repository)
            response = await redirects.follow(
                self._send,
                method,
                url,
                headers,
                authorization,
                timeout,
                max_redirects=self.settings.max_redirects,
                plain_http_allowed=self._plain_http_allowed,
                hop_allowed=self._hop_allowed,
            )
            if response.status == 401 and not answered_challenge:
                challenges = parse_challenges(response.headers.getall("WWW-Authenticate", []))
                response.release()
                if await self._auth.answer_challenge(host, repository, challenges, authorization):
                    answered_challenge = True
                    continue
            if 200 <= response.status < 300:
                return response
            await self._raise_for_status(response, host, f"{method} {host}{path}")

    async def _raise_for_status(self, response: aiohttp.ClientResponse, host: str, what: str) -> None:
        status = response.status
        try:
            body = b"" if response.method == "HEAD" else await response.content.read(ERROR_BODY_MAX)
        except (aiohttp.ClientError, TimeoutError):
            body = b""
        finally:
            response.release()
        codes = error_codes(body)
        if status == 404:
            raise NotFound(f"{what}: not found{codes}", host=host, status=status)
        if status in (401, 403):
            credentials = await self._credentials.get(host)
            hint = f" with credentials from {credentials.source}" if credentials else " anonymously"
            raise Unauthorized(f"{what}: access denied ({status}){hint}{codes}", host=host, status=status)
        retry_after = parse_retry_after(response.headers.get("Retry-After"))
        if status == 429 or (status == 503 and retry_after is not None):
            # A 503 with Retry-After says the same as a 429: come back then, not sooner.
            words = "rate limited" if status == 429 else "unavailable"
            after = "" if retry_after is None else f", retry after {retry_after:.0f} s"
            raise RateLimited(
                f"{what}: {words} ({status}{after}){codes}", retry_after=retry_after, host=host, status=status
            )
        if status in RETRYABLE_STATUSES or status >= 500:
            raise ServerError(f"{what}: server error {status}{codes}", host=host, status=status)
        raise RegistryError(f"{what}: unexpected status {status}{codes}", host=host, status=status)

    async def _read_capped(self, host: str, response: aiohttp.ClientResponse, limit: int, what: str) -> bytes:
        """The body, refusing more than `limit` bytes by Content-Length and while reading."""
        declared = response.content_length
        if declared is not None and declared > limit:
            raise TooLarge(f"{what} is {declared} bytes, over the {limit}-byte limit")
        buffer = bytearray()
        guard = self._guard(host, what)
        try:
            while True:
                since = guard.clock()
                chunk = await response.content.read(65536)
                if not chunk:
                    return bytes(buffer)
                buffer += chunk
                self._received(host, len(chunk))
                guard.received(since, len(chunk))
                if len(buffer) > limit:
                    raise TooLarge(f"{what} exceeds the {limit}-byte limit")
        except TimeoutError:
            slow = guard.timed_out()  # the request's own timeout, on a body that came too slowly
            if slow is None:
                raise
            raise slow from None

    def _refuse_schema1(self, media_type: str, ref: Reference) -> None:
        if media_type in SCHEMA1_MEDIA_TYPES:
            raise UnsupportedManifest(
                f"{ref}: Docker schema 1 manifests ({media_type}) are not supported; "
                "re-push the image with a current Docker or skopeo"
            )

    async def _token_exchange(
        self, host: str, request: TokenRequest, credentials: Credentials | None
    ) -> bytes:
        """The seam `RegistryAuth` fetches tokens through: one request to the token server, counted
        and observed; the body of a 200, else the status mapped to a `RegistryError`."""
        realm = urlsplit(request.url)
        count(self.totals, token_requests=1)
        what = describe_token_request(host, request)
        headers = {"Authorization": request.authorization} if request.authorization else {}
        try:
            async with self._http().request(
                request.method,
                request.url,
                params=request.params,
                data=request.form,
                headers=headers,
                allow_redirects=False,
                timeout=self._timeout(),
            ) as response:
                self._observe(realm.netloc, response.status, None)
                if response.status in (401, 403):
                    source = credentials.source if credentials else "none (anonymous)"
                    raise Unauthorized(
                        f"{what}: refused ({response.status}); credentials from {source}", host=host
                    )
                retry_after = parse_retry_after(response.headers.get("Retry-After"))
                if response.status in (429, 503) and retry_after is not None:
                    raise RateLimited(
                        f"{what}: status {response.status}, retry after {retry_after:.0f} s",
                        retry_after=retry_after,
                        host=host,
                    )
                if response.status == 429 or response.status >= 500:
                    raise ServerError(f"{what}: status {response.status}", host=host)
                if response.status != 200:
                    raise RegistryError(f"{what}: unexpected status {response.status}", host=host)
                body = b""  # to its end (a body may arrive in several reads); more is refused as too large
                while len(body) <= TOKEN_RESPONSE_MAX:
                    chunk = await response.content.read(TOKEN_RESPONSE_MAX + 1 - len(body))
                    if not chunk:
                        break
                    body += chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            error = transport_error(exc, self.settings.request_timeout, url=request.url)
            self._observe(realm.netloc, None, str(error))
            raise TransportError(
                f"{error} (fetching a token for {host})", retryable=error.retryable, host=host
            ) from None
        return body
