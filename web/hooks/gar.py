"""Google Artifact Registry events, delivered as Pub/Sub push messages."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import ValidationError

from web.bounded_json import JsonLimitExceeded, JsonLimits, loads_bounded
from web.hooks.common import (
    Headers,
    ScanRequest,
    Sender,
    WebhookError,
    _blank,
    _describe,
    _Payload,
    _request,
    _short,
    json_parser,
)
from web.hooks.signatures import shared_secret


class _PubSubMessage(_Payload):
    data: str


class _PubSubEnvelope(_Payload):
    message: _PubSubMessage


class _GarEvent(_Payload):
    action: str
    digest: str | None = None
    tag: str | None = None


_GAR_ACTIONS: dict[str, Literal["push", "delete"]] = {"INSERT": "push", "DELETE": "delete"}


def normalise(
    payload: dict[str, Any], headers: Headers, default_registry: str | None
) -> Iterable[ScanRequest]:
    """Artifact Registry via a Pub/Sub push subscription (unwrapped by `unwrap_pubsub` first)."""
    event = _GarEvent.model_validate(payload)
    action = _GAR_ACTIONS.get(event.action)
    if action is None:
        return
    by_tag = _split_reference(event.tag, ":", "tag") if _blank(event.tag) else None
    by_digest = _split_reference(event.digest, "@", "digest") if _blank(event.digest) else None
    if by_tag and by_digest and by_tag[0] != by_digest[0]:
        raise WebhookError(
            f"gar payload: tag and digest name different images ({by_tag[0]} vs {by_digest[0]})"
        )
    name = (by_tag or by_digest or ("", ""))[0]
    if not name:
        raise WebhookError("gar payload: neither tag nor digest is set")
    host, _, repository = name.partition("/")
    yield _request(
        "gar",
        host,
        repository,
        by_tag[1] if by_tag else None,
        by_digest[1] if by_digest else None,
        action,
    )


def unwrap_pubsub(payload: dict[str, Any], limits: JsonLimits) -> dict[str, Any]:
    """A Pub/Sub push wraps the event as base64 JSON in `message.data`; unwrapped pushes are the event."""
    if "message" not in payload:
        return payload
    try:
        encoded = _PubSubEnvelope.model_validate(payload).message.data
    except ValidationError as exc:
        raise WebhookError(f"gar payload: {_describe(exc)}") from None
    try:
        message = loads_bounded(base64.b64decode(encoded, validate=True), limits)
    except JsonLimitExceeded as exc:
        raise WebhookError(f"gar payload refused: message.data: {exc}") from None
    except (binascii.Error, ValueError) as exc:
        raise WebhookError(f"gar payload: message.data is not base64-encoded JSON ({exc})") from None
    if not isinstance(message, dict):
        raise WebhookError(f"gar payload: message.data must hold a JSON object, got {type(message).__name__}")
    return message


def _split_reference(text: str | None, separator: str, field: str) -> tuple[str, str]:
    """`host/path<sep>value` -> (`host/path`, value); GAR sends full references, not parts."""
    name, sep, value = (text or "").rpartition(separator)
    if not sep or "/" not in name or not value or (separator == ":" and "/" in value):
        raise WebhookError(f"gar payload: {field} {_short(text)} is not a full image reference")
    return name, value


SENDER = Sender("gar", parse=json_parser("gar", normalise, unwrap_pubsub), authenticate=shared_secret("gar"))
