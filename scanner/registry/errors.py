"""What can go wrong talking to a registry, as `RegistryError`s whose text is safe to show.

Every message names the host and the object and never a secret or a URL (signed redirect URLs
carry credentials). `retryable` says whether trying the same request later may help.
"""

from __future__ import annotations

import errno
import json
import socket
from typing import Any
from urllib.parse import urlsplit

import aiohttp


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


class RedirectRefused(RegistryError):
    """A registry redirected to a host the operator did not allow; it was never contacted."""


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


class SlowTransfer(TransportError):
    """A transfer fell below GPUBADGE_MIN_TRANSFER_RATE and was cut off.

    Retryable, but by the job queue with its backoff, never at once inside the same scan: a
    registry that drips bytes would otherwise hold a worker through every retry.
    """


class ServerError(RegistryError):
    """The registry answered 5xx (or 408)."""

    default_retryable = True


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


def transport_error(
    exc: BaseException, timeout: float, *, url: str | None = None, host: str | None = None
) -> TransportError:
    """`describe_transport_error` as the error to raise."""
    message, retryable = describe_transport_error(exc, timeout, url=url, host=host)
    return TransportError(message, retryable=retryable, host=host or (urlsplit(url).netloc if url else None))


def error_codes(body: bytes) -> str:
    """` (MANIFEST_UNKNOWN, ...)` from a distribution error body, or "" when it has none."""
    try:
        data = json.loads(body)
        codes = [str(e.get("code")) for e in data.get("errors", []) if isinstance(e, dict)]
    except (ValueError, AttributeError, TypeError):
        return ""
    return f" ({', '.join(codes)})" if codes else ""
