"""Webhook intake: `POST /hooks/{source}`, one delivery of any sender in `web.hooks.SENDERS`.

A delivery is answered 202 only after its scan jobs are committed to the store, so an
acknowledged push is never lost. Bad input gets a 4xx with a reason and changes nothing. The
SSRF guard runs before anything is queued: a registry outside the allowlist is refused here and
never contacted.
"""

from __future__ import annotations

import asyncio
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
from web.webhook_judge import Refusal, accepted_body, judge_delivery, unknown_source

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
        services.metrics.count_webhook(source, status, time.perf_counter() - started)


async def _receive_webhook(request: web.Request, services: Services, source: str) -> web.Response:
    """Receive, judge (`judge_delivery`), record, commit, answer: one delivery.

    The registry waits for this answer before it sends its next delivery, so the path is kept lean:
    the body is parsed once, on the loop when it is a registry's usual size, and the 202 is sent
    only once the intake has committed the jobs."""
    settings = services.settings
    if source not in hooks.SENDERS:  # before the body is read
        return _refused(unknown_source(source))
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return json_error(413, f"body larger than {settings.max_body_bytes} bytes")
    is_own = services.attacher.is_own if services.attacher is not None else None
    judge = (source, body, hooks.lower_keys(request.headers), request.query, settings, is_own, request.remote)
    if len(body) <= INLINE_PARSE_BYTES:  # a registry's usual delivery: judged at once, on the loop
        judged = judge_delivery(*judge)
    else:  # up to max_body_bytes of events: judged in a thread, so /healthz and others go on
        judged = await asyncio.to_thread(judge_delivery, *judge)
    if isinstance(judged, Refusal):
        return _refused(judged)
    for event in judged.deletes:
        await services.store.run(
            queries.mark_gone, event.registry, event.repository, tag=event.tag, digest=event.digest
        )
    try:
        job_ids = await services.intake.enqueue(
            judged.pushes, source=source, max_attempts=settings.max_attempts
        )
    except QueueFull as full:
        refused_full = json_error(503, str(full))
        refused_full.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
        return refused_full
    services.wake_workers()
    return web.json_response(accepted_body(judged, job_ids), status=202)


def _refused(refusal: Refusal) -> web.Response:
    return web.json_response(refusal.body(), status=refusal.status)


def setup_routes(app: web.Application) -> None:
    ROUTES.setup(app)
