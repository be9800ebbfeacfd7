"""Webhook intake: `POST /hooks/{source}`, one delivery of any sender in `web.hooks.SENDERS`.

A delivery is answered 202 only after its scan jobs are committed to the store, so an
acknowledged push is never lost. Bad input gets a 4xx with a reason and changes nothing. The
SSRF guard runs before anything is queued: a registry outside the allowlist is refused here and
never contacted.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from jobs.intake import RETRY_AFTER_SECONDS, QueueFull
from store import queries
from web import hooks
from web.api_description import (
    ERROR,
    OBJECT,
    QUEUE_FULL,
    ApiRoutes,
    json_reply,
    path_parameter,
    query,
)
from web.errors import json_error
from web.state import Services, services_of

log = logging.getLogger(__name__)

ROUTES = ApiRoutes()


# Deliveries larger than this are parsed off the event loop (a 1 MiB delivery takes 100+ ms to parse).
INLINE_PARSE_BYTES = 64 * 1024


@ROUTES.post(
    "/hooks/{source}",
    "Registry webhook (distribution, dockerhub, harbor, ghcr, quay, gar, ecr, jfrog, acr)",
    parameters=[
        path_parameter("source"),
        query("token", "shared secret, for senders that cannot set headers"),
    ],
    responses={
        "202": json_reply(OBJECT, "jobs committed"),
        "400": json_reply(ERROR, "malformed payload, or JSON beyond the GPUBADGE_JSON_* limits"),
        "401": json_reply(ERROR, "bad or missing secret or signature, or no secret for this source"),
        "403": json_reply(ERROR, "registry not on the allowlist"),
        "404": json_reply(ERROR, "unknown source"),
        "413": json_reply(ERROR, "body too large, or more scans than GPUBADGE_MAX_SCANS_PER_DELIVERY"),
        "503": json_reply(ERROR, QUEUE_FULL),
    },
)
async def receive_webhook(request: web.Request) -> web.Response:
    services = services_of(request)
    source = request.match_info["source"]
    started = time.perf_counter()
    status = 500
    try:
        response = await _receive_webhook(request, services, source)
        status = response.status
        return response
    finally:
        label = source if source in hooks.SENDERS else "unknown"
        services.metrics.webhooks.inc(label, str(status))
        services.metrics.webhook_seconds.observe(time.perf_counter() - started, label)


async def _receive_webhook(request: web.Request, services: Services, source: str) -> web.Response:
    """Receive, authenticate, parse, check the allowlist, enqueue, commit, answer: one delivery.

    Everything the route knows of the sender comes from its record in `hooks.SENDERS`. The
    registry waits for this answer before it sends its next delivery, so the path is kept lean:
    headers are lower-cased once, the body is parsed once, each image reference is parsed once
    (by `ScanRequest`), and the 202 is sent only once the intake has committed the jobs.
    """
    settings = services.settings
    sender = hooks.SENDERS.get(source)
    if sender is None:
        return json_error(
            404, f"unknown webhook source {source!r}; expected one of {', '.join(hooks.SOURCES)}"
        )
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return json_error(413, f"body larger than {settings.max_body_bytes} bytes")
    if settings.webhook_refused(source):
        log.warning("webhook from %s refused: no secret is configured for source %s", request.remote, source)
        hint = (
            "webhook_secrets lists the accepted sources"
            if settings.webhook_secrets
            else f"its deliveries are unsigned: set GPUBADGE_WEBHOOK_SECRET or webhook_secrets.{source}"
        )
        return json_error(
            401, f"{source} webhooks are not accepted here: no secret is configured for {source} ({hint})"
        )
    headers = hooks.lower_keys(request.headers)
    try:
        sender.check(body, headers, request.query, settings.webhook_secret_for(source))
    except hooks.WebhookAuthError as exc:
        log.warning("webhook from %s refused: %s", request.remote, exc)
        return json_error(401, str(exc))
    try:
        default_registry, limits = settings.webhook_default_registry(sender), settings.json_limits()
        if len(body) <= INLINE_PARSE_BYTES:  # a registry's usual delivery: parsed at once, on the loop
            events = sender.parse(body, headers, default_registry, limits)
        else:  # up to max_body_bytes of events: parsed in a thread, so /healthz and others go on
            events = await asyncio.to_thread(sender.parse, body, headers, default_registry, limits)
    except hooks.WebhookError as exc:
        return json_error(400, f"malformed {source} webhook: {exc}")
    refused = sorted({event.registry for event in events if not settings.allows(event.registry)})
    if refused:
        return json_error(
            403,
            f"registry not on the allowlist: {', '.join(refused)} (set GPUBADGE_REGISTRIES)",
            refused=refused,
        )
    # Referrers tag-schema indexes and the report artifacts we pushed are never scanned.
    pushes: list[tuple[str, str, float]] = []
    deleted = 0
    for event in events:
        if event.action == "delete":
            deleted += 1
            await services.store.run(
                queries.mark_gone, event.registry, event.repository, tag=event.tag, digest=event.digest
            )
        elif not _own_artifact(services, event):
            # Digest-only events (the children of a multi-arch push) wait briefly for their index job.
            pushes.append((event.reference, event.registry, 0.0 if event.tag else settings.coalesce_seconds))
    if len(pushes) > settings.max_scans_per_delivery:  # nothing queued: the sender may split it
        return json_error(
            413,
            f"this {source} delivery asks for {len(pushes)} scans; one delivery may queue at most "
            f"{settings.max_scans_per_delivery} (GPUBADGE_MAX_SCANS_PER_DELIVERY); nothing was queued",
        )
    try:
        job_ids = await services.intake.enqueue(pushes, source=source, max_attempts=settings.max_attempts)
    except QueueFull as full:
        refused_full = json_error(503, str(full))
        refused_full.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
        return refused_full
    services.wake_workers()
    return web.json_response(
        {"accepted": len(pushes), "deleted": deleted, "jobs": sorted(set(job_ids))}, status=202
    )


def _own_artifact(services: Services, event: hooks.ScanRequest) -> bool:
    if event.action != "push":
        return False
    if event.tag is not None and event.tag.startswith("sha256-"):
        return True
    return services.attacher is not None and services.attacher.is_own(event.digest, event.tag)


def setup_routes(app: web.Application) -> None:
    ROUTES.setup(app)
