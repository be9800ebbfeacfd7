"""Registry webhooks: turn each sender's payload into scan requests, and check who sent it.

Eight senders announce pushes in eight shapes (see docs in shared/reference/webhooks.md).
The package is pure, with one module per sender: the aiohttp handler hands it the raw body, the headers and the
query, and gets back either a list of `ScanRequest` or an exception it maps to a status:
`UnknownSource` -> 404, `WebhookError` -> 400, `WebhookAuthError` -> 401.

Ignored events (pulls, blob uploads, scan results, other packages) give an empty list,
not an error: senders retry on non-2xx, and an event we do not care about must not be
retried forever.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import ValidationError

from web.bounded_json import JsonLimits
from web.hooks import distribution, dockerhub, ecr, gar, ghcr, harbor, jfrog, quay
from web.hooks.common import (
    MANIFEST_MEDIA_TYPES,
    SOURCES,
    Normaliser,
    ScanRequest,
    UnknownSource,
    WebhookAuthError,
    WebhookError,
    _describe,
    _lower_keys,
    _parse_json,
)
from web.hooks.signatures import authenticate

__all__ = [
    "MANIFEST_MEDIA_TYPES",
    "SOURCES",
    "ScanRequest",
    "UnknownSource",
    "WebhookAuthError",
    "WebhookError",
    "authenticate",
    "normalise",
]


_NORMALISERS: dict[str, Normaliser] = {
    "distribution": distribution.normalise,
    "dockerhub": dockerhub.normalise,
    "harbor": harbor.normalise,
    "ghcr": ghcr.normalise,
    "quay": quay.normalise,
    "gar": gar.normalise,
    "ecr": ecr.normalise,
    "jfrog": jfrog.normalise,
}

assert tuple(_NORMALISERS) == SOURCES


def normalise(
    source: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    default_registry: str | None = None,
    limits: JsonLimits | None = None,
) -> list[ScanRequest]:
    """Parse one webhook delivery into scan requests, in payload order, without duplicates.

    `default_registry` (host[:port]) is used where the payload names no host; JFrog needs it.
    `limits` bound the JSON's nesting, numbers and strings (GAR's wrapped message too).
    Raises UnknownSource, or WebhookError with the reason the payload was refused.
    """
    normaliser = _NORMALISERS.get(source)
    if normaliser is None:
        raise UnknownSource(source)
    limits = limits or JsonLimits()
    payload = _parse_json(source, body, limits)
    if source == "gar":
        payload = gar.unwrap_pubsub(payload, limits)
    try:
        requests = list(normaliser(payload, _lower_keys(headers), default_registry))
    except ValidationError as exc:
        raise WebhookError(f"{source} payload: {_describe(exc)}") from None
    return list(dict.fromkeys(requests))  # frozen models hash by value; keeps first-seen order
