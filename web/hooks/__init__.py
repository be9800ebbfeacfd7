"""Registry webhooks: turn each sender's payload into scan requests, and check who sent it.

Nine senders announce pushes in nine shapes (see docs in shared/reference/webhooks.md).
The package is pure, with one module per sender, and each module's `SENDER` record says all
the service knows of it: its name, how it authenticates, how it parses a body, whether it is
refused without a secret, and which setting names the registry its payloads leave out.
`SENDERS` below is the table of them; the route (web/routes/webhooks.py), the settings' secret lookup
and the start-up log read it, and nothing else names a sender. A delivery is handed over as
the raw body, the headers and the query, and comes back as a list of `ScanRequest` or an
exception the route maps to a status:
`UnknownSource` -> 404, `WebhookError` -> 400, `WebhookAuthError` -> 401.

Ignored events (pulls, blob uploads, scan results, other packages) give an empty list,
not an error: senders retry on non-2xx, and an event we do not care about must not be
retried forever.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from web.bounded_json import JsonLimits
from web.hooks import acr, distribution, dockerhub, ecr, gar, ghcr, harbor, jfrog, quay
from web.hooks.common import (
    MANIFEST_MEDIA_TYPES,
    ScanRequest,
    Sender,
    UnknownSource,
    WebhookAuthError,
    WebhookError,
    lower_keys,
)

__all__ = [
    "MANIFEST_MEDIA_TYPES",
    "SENDERS",
    "SOURCES",
    "ScanRequest",
    "Sender",
    "UnknownSource",
    "WebhookAuthError",
    "WebhookError",
    "authenticate",
    "lower_keys",
    "normalise",
    "refused",
    "sender",
]

SENDERS: Mapping[str, Sender] = {
    record.name: record
    for record in (
        distribution.SENDER,
        dockerhub.SENDER,
        harbor.SENDER,
        ghcr.SENDER,
        quay.SENDER,
        gar.SENDER,
        ecr.SENDER,
        jfrog.SENDER,
        acr.SENDER,
    )
}
"""Every sender, by the name in its URL (`POST /hooks/<name>`)."""

SOURCES: tuple[str, ...] = tuple(SENDERS)


def sender(source: str) -> Sender:
    """The record of `source`; UnknownSource (listing the known ones) when there is none."""
    record = SENDERS.get(source)
    if record is None:
        raise UnknownSource(source, SOURCES)
    return record


def refused(record: Sender, *, shared_secret: bool, own_secrets: Collection[str]) -> bool:
    """Whether deliveries from `record` are refused before they are read, for want of a secret.

    With a shared secret every sender can prove it. With per-sender secrets only, a sender without
    its own is refused, never left open. With none at all, a sender whose record `needs_secret`
    (ACR) is refused, and the others are open.
    """
    if shared_secret or record.name in own_secrets:
        return False
    return bool(own_secrets) or record.needs_secret


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
    return sender(source).parse(body, lower_keys(headers), default_registry, limits or JsonLimits())


def authenticate(
    source: str,
    body: bytes,
    headers: Mapping[str, str],
    query: Mapping[str, str],
    secret: str | None,
) -> None:
    """Accept the delivery if it proves knowledge of `secret`; raise WebhookAuthError if not.

    Proofs: `Authorization: Bearer <secret>` (or the bare secret, as Harbor and GitLab send
    their configured header verbatim), `?token=<secret>` (not for ACR), GitHub's
    `X-Hub-Signature-256`, and JFrog's `X-JFrog-Event-Auth`. A signature header that is present
    must verify; it is not silently skipped in favour of a token. No secret configured: accept,
    unless the sender `needs_secret`.
    """
    sender(source).check(body, lower_keys(headers), query, secret)
