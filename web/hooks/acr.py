"""Azure Container Registry webhooks: one JSON event per delivery, authenticated by a header only.

ACR signs nothing: it sends `Content-Type: application/json` plus whatever custom
headers the webhook was configured with. So the shared secret must arrive in a
header (`Authorization: Bearer <secret>`, or the bare secret in `Authorization` as
ACR sends a configured header verbatim); a `?token=` query is refused here, because
ACR shows the service URI in the portal and in activity logs. ACR deliveries are
refused outright when no secret is configured: an unsigned, unauthenticated hook
reachable from Azure would let anyone on the internet queue pulls (its record `needs_secret`).

Only `push` is acted on, keyed on `target.digest` (the tag is absent for pushes by
digest). `delete`, `quarantine`, `chart_push`, `chart_delete` and the portal's
`ping` are answered 2xx and ignored: ACR retries non-2xx deliveries. The route in
web/routes/webhooks.py checks `request.host` against the allowlist before anything is queued,
so no pull ever goes to a registry outside it.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from web.bounded_json import JsonLimits
from web.hooks.common import (
    MANIFEST_MEDIA_TYPES,
    Headers,
    Query,
    ScanRequest,
    Sender,
    WebhookAuthError,
    WebhookError,
    _describe,
    _parse_json,
    _request,
)

SOURCE = "acr"
IGNORED_ACTIONS = frozenset({"delete", "quarantine", "chart_push", "chart_delete", "ping"})


class _Payload(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True, populate_by_name=True)


class _AcrHeader(_Payload):
    action: str


class _AcrTarget(_Payload):
    media_type: str | None = Field(default=None, alias="mediaType")
    digest: str
    repository: str = Field(min_length=1)
    tag: str | None = None


class _AcrRequest(_Payload):
    host: str = Field(min_length=1)


class _AcrPush(_Payload):
    action: str
    target: _AcrTarget
    request: _AcrRequest


def authenticate(headers: Mapping[str, str], secret: str | None) -> None:
    """Accept only a delivery whose `Authorization` header carries `secret` (constant time)."""
    if not secret:
        raise WebhookAuthError(
            "acr webhook: refused because no secret is configured (ACR deliveries are unsigned); "
            "set GPUBADGE_WEBHOOK_SECRET or webhook_secrets.acr and add the header "
            "'Authorization: Bearer <secret>' to the ACR webhook"
        )
    authorization = next((value for key, value in headers.items() if key.lower() == "authorization"), None)
    if authorization is None:
        raise WebhookAuthError(
            "acr webhook: no credentials; configure the custom header 'Authorization: Bearer <secret>'"
        )
    scheme, _, credential = authorization.strip().partition(" ")
    given = credential.strip() if scheme.lower() == "bearer" and credential.strip() else authorization.strip()
    if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), secret.encode()):
        raise WebhookAuthError("acr webhook: the Authorization header does not match the configured secret")


def normalise(body: bytes, limits: JsonLimits | None = None) -> list[ScanRequest]:
    """One ACR event -> at most one push request; ignored actions -> []; bad bodies -> WebhookError.

    `limits` bound the JSON's nesting, numbers and strings, as for every other sender.
    """
    payload = _parse_json(SOURCE, body, limits or JsonLimits())
    try:
        action = _AcrHeader.model_validate(payload).action
        if action != "push":
            return []  # IGNORED_ACTIONS, and any action ACR adds later: acknowledged, never retried
        event = _AcrPush.model_validate(payload)
    except ValidationError as exc:
        raise WebhookError(f"acr payload: {_describe(exc)}") from None
    target = event.target
    if target.media_type is not None and target.media_type not in MANIFEST_MEDIA_TYPES:
        return []  # Helm charts and other artifacts pushed as OCI, schema1
    tag = target.tag or None
    if tag is not None and tag.startswith("sha256-"):
        return []  # a referrers tag-schema index (ours or anyone's), never an image
    return [_request(SOURCE, event.request.host, target.repository, tag, target.digest, "push")]


def _parse(
    body: bytes, headers: Headers, default_registry: str | None, limits: JsonLimits
) -> list[ScanRequest]:
    return normalise(body, limits)


def _authenticate(body: bytes, headers: Headers, query: Query, secret: str | None) -> None:
    authenticate(headers, secret)  # the header only: a ?token= would show in the portal and activity logs


SENDER = Sender(SOURCE, parse=_parse, authenticate=_authenticate, needs_secret=True)
