"""What one webhook delivery asks for, or why it is refused: the judgement both intake listeners share.

`judge_delivery` takes a delivery as it arrived (the source in its URL, the raw body, the
headers with lower-cased names, the query) and the service's settings, and returns either a
`Refusal` (a status and the reason, nothing queued) or an `Accepted` delivery: the scans it
asks for and the tags and digests it reports deleted. It does no I/O: the aiohttp route
(`web/routes/webhooks.py`, on the event loop) and the intake port's own listener
(`web/intake_listener.py`, on its threads) each record the outcome their own way and answer
with `accepted_body` or `Refusal.body`, so a registry gets the same answer from either port.

In order: an unknown source is 404; a source refused for want of a secret, or a bad secret or
signature, 401; a malformed body (or JSON beyond the GPUBADGE_JSON_* limits) 400; a registry
outside the allowlist 403 (the SSRF guard: nothing is queued and it is never contacted); more
scans than GPUBADGE_MAX_SCANS_PER_DELIVERY 413. Referrers tag-schema indexes and the report
artifacts this service pushed are never scanned. The body's size (GPUBADGE_MAX_BODY_BYTES) is
the transport's to bound, before the body is read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from scanner.redaction import redact_secrets
from web import hooks
from web.settings import ServiceSettings

log = logging.getLogger(__name__)

Push = tuple[str, str, float]  # (reference, registry, seconds to wait before it may run)


@dataclass(frozen=True)
class Refusal:
    """A delivery refused whole: nothing of it is queued or deleted."""

    status: int
    message: str
    refused: tuple[str, ...] = ()  # the registries off the allowlist (403)

    def body(self) -> dict[str, object]:
        """The answer's JSON, as every gpubadge error is shaped (secrets redacted)."""
        answer: dict[str, object] = {"error": redact_secrets(self.message)}
        if self.refused:
            answer["refused"] = list(self.refused)
        return answer


@dataclass(frozen=True)
class Accepted:
    """What an accepted delivery asks for: scans to queue, and deletions to record."""

    pushes: list[Push] = field(default_factory=list)
    deletes: list[hooks.ScanRequest] = field(default_factory=list)


def accepted_body(delivery: Accepted, job_ids: list[str]) -> dict[str, object]:
    """The 202's JSON once the delivery's jobs are committed."""
    return {"accepted": len(delivery.pushes), "deleted": len(delivery.deletes), "jobs": sorted(set(job_ids))}


def unknown_source(source: str) -> Refusal:
    """The 404 for a source no sender is named (checked before a listener reads the body)."""
    return Refusal(404, f"unknown webhook source {source!r}; expected one of {', '.join(hooks.SOURCES)}")


def judge_delivery(
    source: str,
    body: bytes,
    headers: Mapping[str, str],
    query: Mapping[str, str],
    settings: ServiceSettings,
    is_own: Callable[[str | None, str | None], bool] | None,
    remote: str | None,
) -> Accepted | Refusal:
    """Authenticate, parse and check one delivery (`headers` with lower-cased names); see the module.

    `is_own(digest, tag)`, where reports are attached, says whether a pushed artifact is one this
    service attached, which is never scanned (nor is a referrers tag-schema index, `sha256-…`). `remote` names the sender in the log lines of refused deliveries."""
    sender = hooks.SENDERS.get(source)
    if sender is None:
        return unknown_source(source)
    if settings.webhook_refused(source):
        log.warning("webhook from %s refused: no secret is configured for source %s", remote, source)
        hint = (
            "webhook_secrets lists the accepted sources"
            if settings.webhook_secrets
            else f"its deliveries are unsigned: set GPUBADGE_WEBHOOK_SECRET or webhook_secrets.{source}"
        )
        return Refusal(
            401, f"{source} webhooks are not accepted here: no secret is configured for {source} ({hint})"
        )
    try:
        sender.check(body, headers, query, settings.webhook_secret_for(source))
    except hooks.WebhookAuthError as exc:
        log.warning("webhook from %s refused: %s", remote, exc)
        return Refusal(401, str(exc))
    try:
        events = sender.parse(
            body, headers, settings.webhook_default_registry(sender), settings.json_limits()
        )
    except hooks.WebhookError as exc:
        return Refusal(400, f"malformed {source} webhook: {exc}")
    refused = sorted({event.registry for event in events if not settings.allows(event.registry)})
    if refused:
        return Refusal(
            403,
            f"registry not on the allowlist: {', '.join(refused)} (set GPUBADGE_REGISTRIES)",
            tuple(refused),
        )
    accepted = Accepted()
    for event in events:
        if event.action == "delete":
            accepted.deletes.append(event)
        elif not _own_artifact(event, is_own):
            # Digest-only events (the children of a multi-arch push) wait briefly for their index job.
            accepted.pushes.append(
                (event.reference, event.registry, 0.0 if event.tag else settings.coalesce_seconds)
            )
    if len(accepted.pushes) > settings.max_scans_per_delivery:  # nothing queued: the sender may split it
        return Refusal(
            413,
            f"this {source} delivery asks for {len(accepted.pushes)} scans; one delivery may queue at most "
            f"{settings.max_scans_per_delivery} (GPUBADGE_MAX_SCANS_PER_DELIVERY); nothing was queued",
        )
    return accepted


def _own_artifact(event: hooks.ScanRequest, is_own: Callable[[str | None, str | None], bool] | None) -> bool:
    if event.tag is not None and event.tag.startswith("sha256-"):
        return True
    return is_own is not None and is_own(event.digest, event.tag)
