"""CNCF Distribution (registry:2, registry:3, Debian docker-registry) notification envelopes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import Field

from web.hooks.common import (
    MANIFEST_MEDIA_TYPES,
    Headers,
    ScanRequest,
    Sender,
    WebhookError,
    _blank,
    _Payload,
    _request,
    _require_default,
    _url_host,
    json_parser,
)
from web.hooks.signatures import shared_secret

DISTRIBUTION_MEDIA_TYPES = (
    "application/vnd.docker.distribution.events.v1+json",  # registry:2 (and GitLab's fork)
    "application/vnd.docker.distribution.events.v2+json",  # registry:3
)


class _DistributionTarget(_Payload):
    media_type: str | None = Field(default=None, alias="mediaType")
    digest: str | None = None
    repository: str | None = None
    url: str | None = None
    tag: str | None = None


class _DistributionRequest(_Payload):
    host: str | None = None


class _DistributionEvent(_Payload):
    action: str
    target: _DistributionTarget
    request: _DistributionRequest | None = None


class _DistributionEnvelope(_Payload):
    events: list[_DistributionEvent]


def normalise(
    payload: dict[str, Any], headers: Headers, default_registry: str | None
) -> Iterable[ScanRequest]:
    """CNCF Distribution (registry:2 v1 envelope, registry:3 v2 envelope; same JSON either way)."""
    envelope = _DistributionEnvelope.model_validate(payload)
    for event in envelope.events:
        target = event.target
        if event.action == "push":
            if target.media_type not in MANIFEST_MEDIA_TYPES:
                continue  # layers, configs (application/octet-stream), schema1
            action: Literal["push", "delete"] = "push"
        elif event.action == "delete":
            # Manifest and blob deletes look alike (digest only); a stray blob digest marks nothing.
            if target.media_type is not None and target.media_type not in MANIFEST_MEDIA_TYPES:
                continue
            action = "delete"
        else:
            continue  # pull, mount, and whatever future actions appear
        tag, digest = _blank(target.tag), _blank(target.digest)
        if tag is None and digest is None:
            continue  # a repository delete: nothing scannable is named
        if not target.repository:
            raise WebhookError(f"distribution event {event.action}: target.repository is missing")
        host = _url_host(target.url) or _blank(event.request.host if event.request else None)
        yield _request(
            "distribution",
            host or _require_default(default_registry, "distribution event carries no request.host"),
            target.repository,
            tag,
            digest,
            action,
        )


SENDER = Sender(
    "distribution", parse=json_parser("distribution", normalise), authenticate=shared_secret("distribution")
)
