"""What every sender module shares: the scan request, the errors, the payload base and small helpers."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from scanner.registry.reference import DOCKER_HUB, ReferenceError, parse_reference
from web.bounded_json import JsonLimitExceeded, JsonLimits, loads_bounded

SOURCES: tuple[str, ...] = ("distribution", "dockerhub", "harbor", "ghcr", "quay", "gar", "ecr", "jfrog")

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
    """No normaliser for this source name (for a 404)."""

    def __init__(self, source: str) -> None:
        super().__init__(f"unknown webhook source {_short(source)}; known sources: {', '.join(SOURCES)}")


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
        # Frozen model: set the canonical spelling (docker.io/library/x, lowercase host) directly.
        object.__setattr__(self, "registry", parsed.registry)
        object.__setattr__(self, "repository", parsed.repository)
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

Normaliser = Callable[[dict[str, Any], Headers, str | None], Iterable[ScanRequest]]


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
    """host[:port] of an absolute URL, without credentials."""
    if not url:
        return None
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


def _lower_keys(headers: Mapping[str, str]) -> dict[str, str]:
    return {key.lower(): value for key, value in headers.items()}


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
