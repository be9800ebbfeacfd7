"""What every sender module shares: the sender record, the scan request, the errors, the payload base
and small helpers."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from scanner.registry.reference import DOCKER_HUB, ReferenceError, parse_reference
from web.bounded_json import JsonLimitExceeded, JsonLimits, loads_bounded

# Manifest media types worth scanning. Blobs (layers, configs) and schema1 are left out:
# registry:3 dropped schema1 and the scanner cannot read it.
MANIFEST_MEDIA_TYPES = frozenset(
    {
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
    }
)

_DOCKER_HUB_ALIASES = frozenset(
    {"docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"}
)

_MAX_ERRORS_SHOWN = 3

_HOST_LABEL = r"(?:[a-z0-9]|[a-z0-9][a-z0-9-]*[a-z0-9])"

_HOST_RE = re.compile(rf"^(?:{_HOST_LABEL}(?:\.{_HOST_LABEL})*|\[[a-f0-9:]+\])(?::[0-9]{{1,5}})?$")


class WebhookError(ValueError):
    """The payload cannot be understood; the message says why (for a 400)."""


class UnknownSource(WebhookError):
    """No sender of this name (for a 404); the message lists the known ones."""

    def __init__(self, source: str, known: Iterable[str]) -> None:
        super().__init__(f"unknown webhook source {_short(source)}; known sources: {', '.join(known)}")


class WebhookAuthError(Exception):
    """The sender did not prove it knows the secret (for a 401). Never carries the secret."""


class ScanRequest(BaseModel):
    """One manifest to (re)scan, or to mark gone.

    For `push`, scan `digest` if set, else resolve `tag` first (Docker Hub and Quay send
    no digest). For `delete`, a set `tag` means that tag is gone; a digest alone means
    the manifest itself is gone.
    """

    model_config = ConfigDict(frozen=True, strict=True)

    registry: str
    repository: str
    tag: str | None
    digest: str | None
    action: Literal["push", "delete"]
    source: str

    @model_validator(mode="after")
    def _canonical_and_parseable(self) -> ScanRequest:
        if self.tag is None and self.digest is None:
            raise ValueError(f"{self.registry}/{self.repository}: neither a tag nor a digest")
        host = self.registry.lower()
        if host in _DOCKER_HUB_ALIASES:
            host = DOCKER_HUB
        if not _HOST_RE.match(host):
            raise ValueError(f"invalid registry host {_short(self.registry)}")
        try:
            parsed = parse_reference(_reference_text(host, self.repository, self.tag, self.digest))
        except ReferenceError as exc:
            raise ValueError(str(exc)) from None
        if parsed.registry != host:
            raise ValueError(
                f"registry host {_short(host)} would read as a Docker Hub namespace in an image "
                "reference; use a dotted name, 'localhost' or host:port"
            )
        # Frozen model: set the canonical spelling (docker.io/library/x, lowercase host) directly, and
        # the parsed tag (an empty tag is no tag), so `reference` is exactly what the parser prints and
        # the intake queues it without parsing it a second time.
        object.__setattr__(self, "registry", parsed.registry)
        object.__setattr__(self, "repository", parsed.repository)
        object.__setattr__(self, "tag", parsed.tag)
        return self

    @property
    def reference(self) -> str:
        """`registry/repository[:tag][@digest]`, accepted by `scanner.registry.reference.parse_reference`."""
        return _reference_text(self.registry, self.repository, self.tag, self.digest)


def _reference_text(registry: str, repository: str, tag: str | None, digest: str | None) -> str:
    text = f"{registry}/{repository}"
    if tag:
        text += f":{tag}"
    if digest:
        text += f"@{digest}"
    return text


class _Payload(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True, populate_by_name=True)


Headers = Mapping[str, str]
"""A delivery's headers, keys lower-cased (`lower_keys`): what every sender's functions are given."""

Query = Mapping[str, str]

Normaliser = Callable[[dict[str, Any], Headers, str | None], Iterable[ScanRequest]]
"""A parsed JSON payload -> scan requests; may raise WebhookError or pydantic's ValidationError."""

Parser = Callable[[bytes, Headers, str | None, JsonLimits], list[ScanRequest]]
"""A raw body -> scan requests in payload order, without duplicates; raises WebhookError only."""

Authenticator = Callable[[bytes, Headers, Query, str | None], None]
"""Accept a delivery (body, headers, query) as proof of the configured secret, or raise WebhookAuthError."""

Unwrap = Callable[[dict[str, Any], JsonLimits], dict[str, Any]]
"""A payload that wraps the event (GAR's Pub/Sub push) -> the event, bounded by the same limits."""


@dataclass(frozen=True, slots=True)
class Sender:
    """Everything the service knows about one webhook sender, in one record.

    `web/hooks/__init__.py` holds the table of them (`SENDERS`); the route, the settings and the
    start-up log read it, and no other code names a sender. `authenticate` is called only when a
    secret is configured, unless `needs_secret`: such a sender (ACR, which signs nothing) is refused
    outright without one, never left open. `default_registry_setting` names the `ServiceSettings`
    field that holds the registry host the sender's payloads leave out (JFrog's), or None.
    """

    name: str
    parse: Parser
    authenticate: Authenticator
    needs_secret: bool = False
    default_registry_setting: str | None = None

    def check(self, body: bytes, headers: Headers, query: Query, secret: str | None) -> None:
        """Authenticate one delivery against the configured `secret` (None: none configured)."""
        if secret or self.needs_secret:
            self.authenticate(body, headers, query, secret)


def json_parser(source: str, normaliser: Normaliser, unwrap: Unwrap | None = None) -> Parser:
    """The parser of a sender whose body is one JSON object: bounded parse, optional unwrap (GAR's
    Pub/Sub envelope), the normaliser, pydantic's errors as WebhookError, duplicates dropped."""

    def parse(
        body: bytes, headers: Headers, default_registry: str | None, limits: JsonLimits
    ) -> list[ScanRequest]:
        payload = _parse_json(source, body, limits)
        if unwrap is not None:
            payload = unwrap(payload, limits)
        try:
            requests = list(normaliser(payload, headers, default_registry))
        except ValidationError as exc:
            raise WebhookError(f"{source} payload: {_describe(exc)}") from None
        return list(dict.fromkeys(requests))  # frozen models hash by value; keeps first-seen order

    return parse


def _parse_json(source: str, body: bytes, limits: JsonLimits) -> dict[str, Any]:
    try:
        payload = loads_bounded(body, limits)
    except JsonLimitExceeded as exc:
        raise WebhookError(f"{source} payload refused: {exc}") from None
    except UnicodeDecodeError:
        raise WebhookError(f"{source} payload is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise WebhookError(f"{source} payload is not JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(payload, dict):
        raise WebhookError(f"{source} payload must be a JSON object, got {type(payload).__name__}")
    return payload


def _request(
    source: str,
    registry: str,
    repository: str,
    tag: str | None,
    digest: str | None,
    action: Literal["push", "delete"],
) -> ScanRequest:
    try:
        return ScanRequest(
            registry=registry, repository=repository, tag=tag, digest=digest, action=action, source=source
        )
    except ValidationError as exc:
        raise WebhookError(f"{source} payload names an invalid image: {_describe(exc)}") from None


def _describe(exc: ValidationError) -> str:
    """Pydantic's errors as `field.path: reason`, without echoing the offending values."""
    errors = exc.errors(include_url=False, include_input=False)
    parts = []
    for error in errors[:_MAX_ERRORS_SHOWN]:
        location = ".".join(str(part) for part in error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        parts.append(f"{location}: {message}" if location else message)
    if len(errors) > _MAX_ERRORS_SHOWN:
        parts.append(f"and {len(errors) - _MAX_ERRORS_SHOWN} more")
    return "; ".join(parts)


def _blank(value: str | None) -> str | None:
    return value if value else None


def _url_host(url: str | None) -> str | None:
    """host[:port] of an absolute URL, without credentials.

    Plain `http(s)://host/...` (what registries send) is cut with string operations; anything
    else (brackets, whitespace or control characters, other schemes) goes through `urlsplit`.
    """
    if not url:
        return None
    if url.startswith(("http://", "https://")) and url.isascii() and url.isprintable() and " " not in url:
        netloc = url.partition("//")[2].partition("/")[0].partition("?")[0].partition("#")[0]
        if "[" not in netloc and "]" not in netloc:
            return netloc.rpartition("@")[2] or None
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    return parts.netloc.rpartition("@")[2] or None


def _require_default(default_registry: str | None, why: str) -> str:
    if not default_registry:
        raise WebhookError(f"{why}, and no default registry is configured")
    return default_registry


def _media_type(headers: Headers) -> str:
    return headers.get("content-type", "").split(";", 1)[0].strip().lower()


def lower_keys(headers: Mapping[str, str]) -> dict[str, str]:
    """Header names lower-cased once per delivery, so each sender looks them up with plain `get`."""
    return {key.lower(): value for key, value in headers.items()}


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
