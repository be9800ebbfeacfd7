"""The OCI distribution client: the only code in gpubadge that talks to registries.

What it guarantees, so callers need not think about it:
- every manifest and blob is checked against its sha256 (streams at EOF);
- sizes are capped by Content-Length and again while reading;
- tokens come lazily from the 401 challenge (no `/v2/` ping) and are cached per scope;
- redirects are followed here, and Authorization never crosses to another host;
- 5xx, resets and timeouts are retried with backoff and jitter, 429 honours Retry-After;
- plain HTTP only to loopback or to registries configured `insecure`;
- every request is counted per logical scan (`with client.track() as stats`).
Errors are `RegistryError`s whose text names the host and object, never a secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import errno
import hashlib
import json
import logging
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urljoin, urlsplit

import aiohttp
from multidict import CIMultiDictProxy

from scanner.auth import (
    Challenge,
    RealmRefused,
    TokenCache,
    basic_authorization,
    build_token_request,
    check_realm,
    parse_challenges,
    parse_token_response,
    pull_scope,
)
from scanner.credentials import Credentials, CredentialStore
from scanner.models import Platform
from scanner.reference import DOCKER_HUB_API, Reference, ReferenceError, is_loopback, validate_digest
from scanner.settings import ScannerSettings

log = logging.getLogger(__name__)

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_SCHEMA1 = "application/vnd.docker.distribution.manifest.v1+json"
DOCKER_SCHEMA1_SIGNED = "application/vnd.docker.distribution.manifest.v1+prettyjws"
MANIFEST_MEDIA_TYPES = (OCI_INDEX, OCI_MANIFEST, DOCKER_MANIFEST_LIST, DOCKER_MANIFEST_V2)
INDEX_MEDIA_TYPES = frozenset({OCI_INDEX, DOCKER_MANIFEST_LIST})
SCHEMA1_MEDIA_TYPES = frozenset({DOCKER_SCHEMA1, DOCKER_SCHEMA1_SIGNED})
MANIFEST_ACCEPT = ", ".join(MANIFEST_MEDIA_TYPES)
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
ERROR_BODY_MAX = 4096
RETRYABLE_STATUSES = frozenset({408, 500, 502, 503, 504, 522})
DOCKER_HUB_CHALLENGE = Challenge(
    "bearer", {"realm": "https://auth.docker.io/token", "service": "registry.docker.io"}
)

T = TypeVar("T")
RequestHook = Callable[[str, int | None, str | None], None]


# --- errors ------------------------------------------------------------------------------------


class RegistryError(Exception):
    """Base error. `str()` is a clear message without secrets; `retryable` says if trying later may help."""

    default_retryable = False

    def __init__(
        self,
        message: str,
        *,
        retryable: bool | None = None,
        host: str | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.retryable = self.default_retryable if retryable is None else retryable
        self.host = host
        self.status = status


class NotFound(RegistryError):
    pass


class Unauthorized(RegistryError):
    pass


class DigestMismatch(RegistryError):
    pass


class TooLarge(RegistryError):
    pass


class UnsupportedManifest(RegistryError):
    pass


class RateLimited(RegistryError):
    default_retryable = True

    def __init__(self, message: str, *, retry_after: float | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class InsecureTransport(RegistryError):
    pass


class TokenRealmRefused(RegistryError):
    """The registry named a token realm we will not contact (SSRF or credential-leak guard)."""


class TransportError(RegistryError):
    """Connection reset, refused, or timed out."""

    default_retryable = True


class ServerError(RegistryError):
    """The registry answered 5xx (or 408)."""

    default_retryable = True


# --- data --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: Platform | None = None
    annotations: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any, where: str) -> Descriptor:
        if not isinstance(data, dict):
            raise RegistryError(f"{where}: a descriptor is not a JSON object")
        media_type, digest, size = data.get("mediaType"), data.get("digest"), data.get("size")
        if not isinstance(media_type, str) or not isinstance(digest, str):
            raise RegistryError(f"{where}: a descriptor lacks mediaType or digest")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise RegistryError(f"{where}: descriptor {digest} has an invalid size")
        try:
            validate_digest(digest)
        except ReferenceError as exc:
            raise RegistryError(f"{where}: {exc}") from None
        platform = None
        raw_platform = data.get("platform")
        if isinstance(raw_platform, dict):
            platform = Platform(
                os=str(raw_platform.get("os", "")),
                architecture=str(raw_platform.get("architecture", "")),
                variant=raw_platform.get("variant") or None,
            )
        raw_annotations = data.get("annotations")
        annotations = (
            {str(k): str(v) for k, v in raw_annotations.items()} if isinstance(raw_annotations, dict) else {}
        )
        return cls(media_type, digest, size, platform, annotations)


@dataclass(frozen=True)
class Manifest:
    """A verified manifest or index: its bytes, digest, and parsed JSON."""

    media_type: str
    digest: str
    raw: bytes
    data: dict[str, Any]

    @property
    def is_index(self) -> bool:
        return self.media_type in INDEX_MEDIA_TYPES or "manifests" in self.data

    @property
    def manifests(self) -> list[Descriptor]:
        entries = self.data.get("manifests")
        if not isinstance(entries, list):
            return []
        return [Descriptor.from_json(entry, f"index {self.digest}") for entry in entries]

    @property
    def config(self) -> Descriptor:
        if "config" not in self.data:
            raise RegistryError(f"manifest {self.digest} has no config")
        return Descriptor.from_json(self.data["config"], f"manifest {self.digest}")

    @property
    def layers(self) -> list[Descriptor]:
        entries = self.data.get("layers")
        if not isinstance(entries, list):
            return []
        return [Descriptor.from_json(entry, f"manifest {self.digest}") for entry in entries]

    def descriptor(self) -> Descriptor:
        return Descriptor(self.media_type, self.digest, len(self.raw))


@dataclass
class RequestStats:
    """Requests made inside one `track()` block. Token fetches are counted apart."""

    requests: int = 0
    bytes_received: int = 0
    token_requests: int = 0
    retries: int = 0


_active_stats: ContextVar[tuple[RequestStats, ...]] = ContextVar("gpubadge_request_stats", default=())


def _count(totals: RequestStats, **increments: int) -> None:
    """Add to the client's totals and to every `track()` block active in this context."""
    for stats in (totals, *_active_stats.get()):
        for name, amount in increments.items():
            setattr(stats, name, getattr(stats, name) + amount)


# --- pure helpers ------------------------------------------------------------------------------


def compute_digest(data: bytes, algorithm: str = "sha256") -> str:
    return f"{algorithm}:{hashlib.new(algorithm, data).hexdigest()}"


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    current = time.time() if now is None else now
    return max(0.0, when.timestamp() - current)


def parse_rate_limit(value: str | None) -> int | None:
    """`100;w=21600` -> 100."""
    if not value:
        return None
    head = value.split(";", 1)[0].strip()
    return int(head) if head.isdigit() else None


def bare_media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def manifest_media_type(data: dict[str, Any], content_type: str) -> str:
    """The manifest's own `mediaType` wins; else Content-Type; else infer from the shape."""
    declared = data.get("mediaType")
    if isinstance(declared, str) and declared:
        return declared
    if content_type in MANIFEST_MEDIA_TYPES or content_type in SCHEMA1_MEDIA_TYPES:
        return content_type
    if data.get("schemaVersion") == 1:
        return DOCKER_SCHEMA1
    if "manifests" in data:
        return OCI_INDEX
    return OCI_MANIFEST


_OS_ERROR_WORDS = {
    errno.ECONNREFUSED: "connection refused",
    errno.ECONNRESET: "connection reset",
    errno.ENETUNREACH: "network unreachable",
    errno.EHOSTUNREACH: "host unreachable",
    errno.ETIMEDOUT: "connection timed out",
    errno.EPIPE: "connection closed while sending",
}
# Failures that say "not from here, not now": retrying only makes a user wait for the same answer.
_PERMANENT_OS_ERRORS = frozenset({errno.ENETUNREACH})


def _where(url: str | None, host: str | None) -> str:
    """`host:port` for messages; the port is the scheme's default when the URL names none."""
    if url:
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        name = parts.hostname or parts.netloc
        if ":" in name:
            name = f"[{name}]"
        return f"{name}:{port or (443 if parts.scheme == 'https' else 80)}"
    return host or "the registry"


def describe_transport_error(
    exc: BaseException, timeout: float, *, url: str | None = None, host: str | None = None
) -> tuple[str, bool]:
    """A transport failure in words, and whether trying again may help.

    Never a class name and never a URL (signed redirect URLs carry credentials): the message names
    `host:port` and the cause. Name resolution failures are final: a host that does not resolve now
    will not resolve in the next seconds either, and an offline machine should fail at once.
    """
    if isinstance(exc, aiohttp.ClientConnectorError):
        where = f"{exc.host}:{exc.port}" if ":" not in exc.host else f"[{exc.host}]:{exc.port}"
    else:
        where = _where(url, host)
    if isinstance(exc, TimeoutError):
        return f"{where} timed out after {timeout:g}s", True
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return f"cannot reach {where}: its TLS certificate is not trusted ({exc.certificate_error})", False
    if isinstance(exc, aiohttp.ClientConnectorSSLError | aiohttp.ClientSSLError):
        return f"cannot reach {where}: the TLS handshake failed", False
    if isinstance(exc, aiohttp.ClientConnectorDNSError) or isinstance(
        getattr(exc, "os_error", None), socket.gaierror
    ):
        return f"cannot reach {where}: name resolution failed", False
    if isinstance(exc, aiohttp.ClientConnectorError):
        code = exc.os_error.errno
        words = _OS_ERROR_WORDS.get(code or 0) or (exc.os_error.strerror or "connection failed").lower()
        return f"cannot reach {where}: {words}", code not in _PERMANENT_OS_ERRORS
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return f"{where} closed the connection before answering", True
    if isinstance(exc, aiohttp.ClientPayloadError):
        return f"the answer from {where} was cut off", True
    if isinstance(exc, aiohttp.ClientOSError):
        words = _OS_ERROR_WORDS.get(exc.errno or 0) or (exc.strerror or "connection failed").lower()
        return f"connection to {where} failed: {words}", True
    if isinstance(exc, aiohttp.InvalidURL):
        return f"invalid URL for {where}", False
    return f"request to {where} failed", True


def _transport_error(
    exc: BaseException, timeout: float, *, url: str | None = None, host: str | None = None
) -> TransportError:
    message, retryable = describe_transport_error(exc, timeout, url=url, host=host)
    return TransportError(message, retryable=retryable, host=host or (urlsplit(url).netloc if url else None))


def _error_codes(body: bytes) -> str:
    try:
        data = json.loads(body)
        codes = [str(e.get("code")) for e in data.get("errors", []) if isinstance(e, dict)]
    except (ValueError, AttributeError, TypeError):
        return ""
    return f" ({', '.join(codes)})" if codes else ""


# --- the client --------------------------------------------------------------------------------


class BlobStream:
    """Async iterator over a blob's bytes that verifies the digest when the last chunk is read."""

    def __init__(
        self,
        response: aiohttp.ClientResponse,
        digest: str,
        chunk_size: int,
        what: str,
        timeout: float,
        totals: RequestStats,
    ) -> None:
        self._response = response
        self._totals = totals
        self._iterator = response.content.iter_chunked(chunk_size)
        self._expected = digest
        self._hasher = hashlib.new(digest.split(":", 1)[0])
        self._what = what
        self._timeout = timeout
        self.content_length = response.content_length
        self.bytes_read = 0
        self.verified = False

    def __aiter__(self) -> BlobStream:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._iterator.__anext__()
        except StopAsyncIteration:
            actual = f"{self._expected.split(':', 1)[0]}:{self._hasher.hexdigest()}"
            if actual != self._expected:
                raise DigestMismatch(
                    f"{self._what}: content digest {actual} does not match {self._expected}"
                ) from None
            self.verified = True
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            message, retryable = describe_transport_error(exc, self._timeout, url=str(self._response.url))
            raise TransportError(f"{self._what}: {message}", retryable=retryable) from None
        self._hasher.update(chunk)
        self.bytes_read += len(chunk)
        _count(self._totals, bytes_received=len(chunk))
        return chunk


class RegistryClient:
    """Async client for OCI registries. Use as `async with RegistryClient(settings) as client:`."""

    def __init__(
        self,
        settings: ScannerSettings | None = None,
        *,
        on_request: RequestHook | None = None,
        credentials: CredentialStore | None = None,
    ) -> None:
        self.settings = settings or ScannerSettings()
        self.on_request = on_request
        self.rate_limits: dict[str, int] = {}
        self.rate_limit_limits: dict[str, int] = {}
        self.totals = RequestStats()
        self._credentials = credentials or CredentialStore(self.settings)
        self._session: aiohttp.ClientSession | None = None
        self._semaphores: dict[str, asyncio.Semaphore] = {}
        # Docker Hub's challenge is well known: asking for its token first saves a 401 per cold start.
        self._challenges: dict[str, Challenge] = {DOCKER_HUB_API: DOCKER_HUB_CHALLENGE}
        self._tokens = TokenCache()
        self._token_locks: dict[tuple[str, str, str], asyncio.Lock] = {}

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

    @contextlib.contextmanager
    def track(self) -> Iterator[RequestStats]:
        """Count requests made in this context (and tasks started from it); nests and is task-safe."""
        stats = RequestStats()
        token = _active_stats.set((*_active_stats.get(), stats))
        try:
            yield stats
        finally:
            _active_stats.reset(token)

    # --- public operations ---------------------------------------------------------------------

    async def resolve(self, ref: Reference) -> Descriptor:
        """HEAD the manifest: digest, media type and size without a counted pull; GET if no digest."""

        async def head(host: str) -> Descriptor | None:
            path = f"/v2/{ref.repository}/manifests/{ref.identifier}"
            async with self._slot(host):
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
            async with self._slot(host):
                response = await self._open(
                    host, ref.repository, "GET", path, {"Accept": MANIFEST_ACCEPT}, self._timeout()
                )
                try:
                    body = await self._read_capped(response, limit, f"manifest {ref.name}@{identifier}")
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
            async with self._slot(host):
                response = await self._open(
                    host, ref.repository, "GET", path, {"Accept": OCI_INDEX}, self._timeout()
                )
                try:
                    body = await self._read_capped(response, limit, f"referrers of {ref.name}@{digest}")
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
            async with self._slot(host):
                response = await self._open(
                    host, ref.repository, "GET", path, {"Accept-Encoding": "identity"}, self._timeout()
                )
                try:
                    return await self._read_capped(response, max_bytes, what)
                finally:
                    response.release()

        body = await self._on_endpoints(ref, get)
        actual = compute_digest(body, digest.split(":", 1)[0])
        if actual != digest:
            raise DigestMismatch(f"{what}: content digest is {actual}")
        return body

    @contextlib.asynccontextmanager
    async def stream_blob(
        self, ref: Reference, digest: str, chunk_size: int = 65536
    ) -> AsyncIterator[BlobStream]:
        """Stream a blob's (compressed) bytes; the digest is checked if the consumer reads to the end.

        Leaving the block early closes the connection, so an early verdict costs only what was read.
        """
        validate_digest(digest)
        path = f"/v2/{ref.repository}/blobs/{digest}"
        what = f"blob {ref.name}@{digest}"
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.settings.request_timeout, sock_read=self.settings.request_timeout
        )

        async def open_holding_slot(host: str) -> tuple[aiohttp.ClientResponse, asyncio.Semaphore]:
            # The slot stays taken while the caller reads, so it is acquired here rather than with
            # `_slot`; any way out before the response is handed over (errors, cancellation) gives it back.
            slot = self._semaphore(host)
            await slot.acquire()
            try:
                response = await self._open(
                    host, ref.repository, "GET", path, {"Accept-Encoding": "identity"}, timeout
                )
            except BaseException:
                slot.release()
                raise
            return response, slot

        response, slot = await self._on_endpoints(ref, open_holding_slot)
        stream = BlobStream(response, digest, chunk_size, what, self.settings.request_timeout, self.totals)
        try:
            yield stream
        finally:
            if stream.verified:
                response.release()  # fully read: the connection can be reused
            else:
                response.close()  # stopped early: drop the connection rather than drain the blob
            slot.release()

    # --- endpoints, slots, retries -------------------------------------------------------------

    def _endpoints(self, ref: Reference) -> list[str]:
        mirror = self.settings.mirror_for(ref.registry)
        hosts = [ref.api_host]
        if mirror:
            mirror_host = mirror.split("://", 1)[-1].rstrip("/")
            hosts.insert(0, mirror_host)
        return hosts

    @staticmethod
    def _fall_back(exc: RegistryError) -> bool:
        return isinstance(exc, NotFound | Unauthorized | TransportError | ServerError | RateLimited)

    async def _on_endpoints(self, ref: Reference, operation: Callable[[str], Awaitable[T]]) -> T:
        """Run `operation` against the mirror first (if any), then the registry itself."""
        hosts = self._endpoints(ref)
        for index, host in enumerate(hosts):
            try:
                return await self._retrying(lambda host=host: operation(host), host=host)  # type: ignore[misc]
            except RegistryError as exc:
                if index == len(hosts) - 1 or not self._fall_back(exc):
                    raise
                log.warning("mirror %s failed (%s); trying %s", host, exc, hosts[index + 1])
        raise AssertionError("unreachable: no endpoints")

    def _semaphore(self, host: str) -> asyncio.Semaphore:
        if host not in self._semaphores:
            self._semaphores[host] = asyncio.Semaphore(self.settings.concurrency_per_registry)
        return self._semaphores[host]

    @contextlib.asynccontextmanager
    async def _slot(self, host: str) -> AsyncIterator[None]:
        async with self._semaphore(host):
            yield

    def _timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.settings.request_timeout)

    def _backoff(self, attempt: int) -> float:
        delay = min(self.settings.backoff_max, self.settings.backoff_base * (2.0**attempt))
        return delay * random.uniform(0.5, 1.0)

    async def _retrying(self, operation: Callable[[], Awaitable[T]], host: str | None = None) -> T:
        """Run `operation`, retrying what may pass (5xx, resets, timeouts, 429) with backoff."""
        attempts = max(1, self.settings.retries)
        for attempt in range(attempts):
            try:
                return await operation()
            except (aiohttp.ClientError, TimeoutError) as exc:
                error = _transport_error(exc, self.settings.request_timeout, host=host)
                if not error.retryable or attempt == attempts - 1:
                    raise error from None
                delay = self._backoff(attempt)
            except RegistryError as exc:
                if not exc.retryable or attempt == attempts - 1:
                    raise
                delay = self._backoff(attempt)
                if isinstance(exc, RateLimited) and exc.retry_after is not None:
                    if exc.retry_after > self.settings.retry_after_max:
                        raise
                    delay = exc.retry_after
            _count(self.totals, retries=1)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable: retry loop ended")

    # --- HTTP ----------------------------------------------------------------------------------

    def _scheme(self, host: str) -> str:
        return "http" if is_loopback(host) or self.settings.is_insecure(host) else "https"

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers={"User-Agent": "gpubadge/0.1"},
                connector=aiohttp.TCPConnector(limit=100),
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
        host = urlsplit(url).netloc
        _count(self.totals, requests=1)
        try:
            response = await self._http().request(
                method, url, headers=dict(headers), allow_redirects=False, timeout=timeout
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            error = _transport_error(exc, timeout.total or self.settings.request_timeout, url=url)
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

    async def _follow(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        authorization: str | None,
        timeout: aiohttp.ClientTimeout,
    ) -> aiohttp.ClientResponse:
        """Send, following redirects ourselves; Authorization only goes to the original host."""
        origin = urlsplit(url)
        for _ in range(self.settings.max_redirects + 1):
            target = urlsplit(url)
            if target.scheme == "http" and not (
                is_loopback(target.netloc) or self.settings.is_insecure(target.netloc)
            ):
                raise InsecureTransport(
                    f"refusing plain HTTP to {target.netloc}: only loopback or registries configured "
                    "'insecure' may use http",
                    host=target.netloc,
                )
            if target.scheme not in ("http", "https"):
                raise RegistryError(f"redirect to unsupported scheme {target.scheme!r}")
            send_headers = dict(headers)
            if authorization and (target.scheme, target.netloc) == (origin.scheme, origin.netloc):
                send_headers["Authorization"] = authorization
            response = await self._send(method, url, send_headers, timeout)
            location = response.headers.get("Location")
            if response.status not in REDIRECT_STATUSES or not location:
                return response
            response.release()
            url = urljoin(url, location)
            if response.status == 303 and method != "HEAD":
                method = "GET"
        raise RegistryError(f"too many redirects from {origin.netloc}{origin.path}", host=origin.netloc)

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
        answered_challenge = False
        while True:
            authorization = await self._authorization(host, repository)
            response = await self._follow(method, url, headers, authorization, timeout)
            if response.status == 401 and not answered_challenge:
                challenges = parse_challenges(response.headers.getall("WWW-Authenticate", []))
                response.release()
                if await self._answer_challenge(host, repository, challenges, authorization):
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
        codes = _error_codes(body)
        if status == 404:
            raise NotFound(f"{what}: not found{codes}", host=host, status=status)
        if status in (401, 403):
            credentials = await self._credentials.get(host)
            hint = f" with credentials from {credentials.source}" if credentials else " anonymously"
            raise Unauthorized(f"{what}: access denied ({status}){hint}{codes}", host=host, status=status)
        if status == 429:
            retry_after = parse_retry_after(response.headers.get("Retry-After"))
            raise RateLimited(
                f"{what}: rate limited (429){codes}", retry_after=retry_after, host=host, status=status
            )
        if status in RETRYABLE_STATUSES or status >= 500:
            raise ServerError(f"{what}: server error {status}{codes}", host=host, status=status)
        raise RegistryError(f"{what}: unexpected status {status}{codes}", host=host, status=status)

    async def _read_capped(self, response: aiohttp.ClientResponse, limit: int, what: str) -> bytes:
        """The body, refusing more than `limit` bytes by Content-Length and while reading."""
        declared = response.content_length
        if declared is not None and declared > limit:
            raise TooLarge(f"{what} is {declared} bytes, over the {limit}-byte limit")
        buffer = bytearray()
        async for chunk in response.content.iter_chunked(65536):
            buffer += chunk
            _count(self.totals, bytes_received=len(chunk))
            if len(buffer) > limit:
                raise TooLarge(f"{what} exceeds the {limit}-byte limit")
        return bytes(buffer)

    # --- auth ----------------------------------------------------------------------------------

    def _refuse_schema1(self, media_type: str, ref: Reference) -> None:
        if media_type in SCHEMA1_MEDIA_TYPES:
            raise UnsupportedManifest(
                f"{ref}: Docker schema 1 manifests ({media_type}) are not supported; "
                "re-push the image with a current Docker or skopeo"
            )

    async def _authorization(self, host: str, repository: str) -> str | None:
        """The Authorization header to send up front, if we already know what this host wants."""
        credentials = await self._credentials.get(host)
        if credentials is not None and credentials.registry_token is not None:
            return "Bearer " + credentials.registry_token.get_secret_value()
        challenge = self._challenges.get(host)
        if challenge is None:
            return None
        if challenge.scheme == "basic":
            return basic_authorization(credentials) if credentials else None
        token = await self._token(host, challenge, repository, credentials, rejected=None)
        return f"Bearer {token}"

    async def _answer_challenge(
        self, host: str, repository: str, challenges: list[Challenge], sent: str | None
    ) -> bool:
        """Remember the host's challenge and get what it asks for; False if we have nothing to offer."""
        if not challenges and host in self._challenges:
            challenges = [self._challenges[host]]
        credentials = await self._credentials.get(host)
        bearer = next((c for c in challenges if c.scheme == "bearer" and c.realm), None)
        if bearer is not None:
            remembered = Challenge("bearer", {k: v for k, v in bearer.params.items() if k != "scope"})
            self._challenges[host] = remembered
            rejected = sent.removeprefix("Bearer ") if sent and sent.startswith("Bearer ") else None
            scope = bearer.params.get("scope")
            await self._token(host, remembered, repository, credentials, rejected=rejected, scope=scope)
            return True
        basic = next((c for c in challenges if c.scheme == "basic"), None)
        if basic is not None:
            self._challenges[host] = basic
            offer = basic_authorization(credentials) if credentials else None
            return offer is not None and offer != sent
        return False

    async def _token(
        self,
        host: str,
        challenge: Challenge,
        repository: str,
        credentials: Credentials | None,
        *,
        rejected: str | None,
        scope: str | None = None,
    ) -> str:
        """A cached or fresh token for pulling `repository`; single-flight per (host, service, scope)."""
        key = (host, challenge.service or "", pull_scope(repository))
        lock = self._token_locks.setdefault(key, asyncio.Lock())
        async with lock:
            cached = self._tokens.get(key)
            if cached is not None and cached != rejected:
                return cached
            scopes = [pull_scope(repository)]
            if scope and scope not in scopes:
                scopes.insert(0, scope)
            token, lifetime = await self._retrying(
                lambda: self._fetch_token(host, challenge, scopes, credentials), host=host
            )
            self._tokens.put(key, token, lifetime)
            return token

    def _realm_allowlist(self) -> set[str]:
        """Configured registries and their mirrors: hosts a token realm may name."""
        hosts = {entry.host for entry in self.settings.registries}
        hosts |= {
            entry.mirror.split("://", 1)[-1].rstrip("/") for entry in self.settings.registries if entry.mirror
        }
        return hosts

    async def _fetch_token(
        self, host: str, challenge: Challenge, scopes: list[str], credentials: Credentials | None
    ) -> tuple[str, float]:
        try:
            request = build_token_request(challenge, scopes, credentials)
        except ValueError as exc:
            raise Unauthorized(f"{host}: {exc}", host=host) from None
        try:
            check_realm(
                host,
                request.url,
                allowlist=self._realm_allowlist(),
                sends_credentials=request.sends_credentials,
                insecure_hosts=[entry.host for entry in self.settings.registries if entry.insecure],
            )
        except RealmRefused as exc:
            raise TokenRealmRefused(str(exc), host=host) from None
        realm = urlsplit(request.url)
        _count(self.totals, token_requests=1)
        what = f"token from {realm.netloc}{realm.path} for {host}"
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
                if response.status == 429 or response.status >= 500:
                    raise ServerError(f"{what}: status {response.status}", host=host)
                if response.status != 200:
                    raise RegistryError(f"{what}: unexpected status {response.status}", host=host)
                body = await response.content.read(65 * 1024)
        except (aiohttp.ClientError, TimeoutError) as exc:
            error = _transport_error(exc, self.settings.request_timeout, url=request.url)
            self._observe(realm.netloc, None, str(error))
            raise TransportError(
                f"{error} (fetching a token for {host})", retryable=error.retryable, host=host
            ) from None
        try:
            return parse_token_response(body)
        except ValueError as exc:
            raise Unauthorized(f"{what}: {exc}", host=host) from None
