"""JSON API, webhook intake, health and metrics.

A webhook is answered 202 only after its scan jobs are committed to SQLite, so
an acknowledged push is never lost. Bad input gets a 4xx with a reason and
changes nothing. The SSRF guard runs before anything is queued: a registry
outside the allowlist is refused here and never contacted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web
from pydantic import BaseModel, Field, ValidationError

from scanner.models import ImageReport
from scanner.registry.reference import Reference, ReferenceError, parse_reference
from store import Job, queries
from web import hooks
from web.errors import json_error, json_http_error, read_json
from web.intake import RETRY_AFTER_SECONDS, QueueFull
from web.scan_requests import ScanRefused, request_scan
from web.security import bearer_token, redact_secrets, token_matches
from web.state import Services, services_of

log = logging.getLogger(__name__)

MAX_PAGE = 200
MAX_WAIT = 60.0
# Deliveries larger than this are parsed off the event loop (a 1 MiB delivery takes 100+ ms to parse).
INLINE_PARSE_BYTES = 64 * 1024


class ScanBody(BaseModel):
    ref: str = Field(description="image reference: a tag or a digest")


class JobView(BaseModel):
    id: str
    reference: str
    state: str
    attempts: int
    error: str | None
    digest: str | None
    source: str | None
    created_at: str
    updated_at: str

    @classmethod
    def of(cls, job: Job) -> JobView:
        return cls(
            id=job.id,
            reference=job.reference,
            state=job.state,
            attempts=job.attempts,
            error=redact_secrets(job.error) if job.error else job.error,
            digest=job.result_digest,
            source=job.source,
            created_at=job.created_at,
            updated_at=job.updated_at,
        )


def require_api_token(request: web.Request) -> None:
    """Write endpoints need the API token when one is configured (constant-time compare)."""
    if not token_matches(services_of(request).settings.api_token, bearer_token(request) or ""):
        raise json_http_error(
            web.HTTPUnauthorized,
            "a valid API token is required (Authorization: Bearer <token>)",
            headers={"WWW-Authenticate": 'Bearer realm="gpubadge"'},
        )


# ------------------------------------------------------------------ webhooks


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


# ----------------------------------------------------------------------- API


def _report_json(report: ImageReport) -> dict[str, Any]:
    body = report.model_dump(mode="json")
    if body.get("error"):
        body["error"] = redact_secrets(body["error"])
    return body


def _bool_param(value: str | None, name: str) -> bool | None:
    if value is None or value == "":
        return None
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "gpu"):
        return True
    if lowered in ("0", "false", "no", "cpu"):
        return False
    raise json_http_error(web.HTTPBadRequest, f"{name} must be true or false")


def wait_param(request: web.Request, cap: float = MAX_WAIT) -> float:
    """`?wait=S`: long-poll for at most S seconds (capped), so clients sync on events, not sleeps."""
    raw = request.query.get("wait", "")
    try:
        return min(cap, max(0.0, float(raw))) if raw else 0.0
    except ValueError:
        raise json_http_error(web.HTTPBadRequest, "wait must be a number of seconds") from None


def _int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise json_http_error(web.HTTPBadRequest, f"{name} must be an integer") from None
    return max(low, min(high, value))


async def list_images(request: web.Request) -> web.Response:
    services = services_of(request)
    query = request.query
    limit = _int_param(request, "limit", 50, 1, MAX_PAGE)
    page = _int_param(request, "page", 1, 1, 1_000_000)
    libc = query.get("libc") or None
    if libc == "no-libc":
        libc = "none"
    rows, total = await services.store.run(
        queries.list_images,
        gpu=_bool_param(query.get("gpu"), "gpu"),
        libc=libc,
        cuda=query.get("cuda") or None,
        registry=query.get("registry") or None,
        query=query.get("q") or None,
        limit=limit,
        offset=(page - 1) * limit,
        inferred=_bool_param(query.get("inferred"), "inferred"),
    )
    return web.json_response(
        {
            "total": total,
            "page": page,
            "limit": limit,
            "images": [row.__dict__ for row in rows],
        }
    )


async def _stored_digest(services: Services, reference: Reference) -> str | None:
    """The digest a tag or digest reference stands for, if the store knows it."""
    if reference.digest:
        return reference.digest
    return await services.store.run(
        queries.resolve_tag, reference.registry, reference.repository, reference.tag or ""
    )


def _ready(report: ImageReport | None, until: str) -> bool:
    """`?until=facts`: a report exists; `done` (the default): its layer verdicts are in too."""
    return report is not None and (until == "facts" or not report.pending)


async def find_report(services: Services, reference: Reference) -> ImageReport | None:
    """The latest stored report for a tag or digest reference."""
    store = services.store
    digest = await _stored_digest(services, reference)
    if digest is None:
        return None
    report = await store.run(queries.report, digest)
    if report is None:
        platform = await store.run(queries.platform_report, digest)
        if platform is None:
            return None
        report = ImageReport(
            reference=str(reference),
            digest=digest,
            platforms=[platform],
            registry=reference.registry,
            repository=reference.repository,
        )
    return report.model_copy(update={"reference": str(reference), "tag": reference.tag, "cached": True})


async def image_by_ref(request: web.Request) -> web.Response:
    services = services_of(request)
    text = request.query.get("ref", "")
    if not text:
        return json_error(400, "missing query parameter ref")
    try:
        reference = parse_reference(text)
    except ReferenceError as exc:
        return json_error(400, str(exc))
    wait = wait_param(request)
    until = request.query.get("until", "done")
    if until not in ("done", "facts"):
        return json_error(400, "until must be done (the full report) or facts (the config facts)")
    report = await find_report(services, reference)
    if wait and not _ready(report, until):  # the scan may run in any worker process, here or elsewhere

        async def ready() -> bool:
            return _ready(await find_report(services, reference), until)

        await services.store.wait_until(ready, wait, key=str(reference))
        report = await find_report(services, reference)
    if report is None:
        pending = await services.store.run(queries.pending_job_for, str(reference))
        latest = pending or await services.store.run(queries.latest_job_for, str(reference))
        return json_error(
            404,
            f"{reference} has not been scanned",
            pending=pending is not None,
            job=JobView.of(latest).model_dump() if latest else None,
        )
    return web.json_response(_report_json(report))


async def create_scan(request: web.Request) -> web.Response:
    require_api_token(request)
    services = services_of(request)
    data = await read_json(request, services.settings.json_limits())
    try:
        body = ScanBody.model_validate(data)
    except ValidationError as exc:
        return json_error(
            400, f"invalid body: {exc.errors(include_url=False)[0]['msg']}", expected={"ref": "REF"}
        )
    try:
        job = await request_scan(services, body.ref, source="api")
    except ScanRefused as refused:
        answer = json_error(refused.status, refused.message)
        if refused.status == 503:  # the queue is full: come back when workers have caught up
            answer.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
        return answer
    return web.json_response(JobView.of(job).model_dump(), status=202)


async def get_scan(request: web.Request) -> web.Response:
    services = services_of(request)
    job_id = request.match_info["job_id"]
    wait = wait_param(request)
    job = await services.store.run(services.store.backend.job, job_id)
    if job is not None and wait:  # the job may run in any worker process, here or elsewhere
        job = await services.store.wait_for_job(job_id, wait)
    if job is None:
        return json_error(404, f"no scan job {job_id}")
    return web.json_response(JobView.of(job).model_dump())


async def retry_scan(request: web.Request) -> web.Response:
    require_api_token(request)
    services = services_of(request)
    job = await services.store.retry_job(request.match_info["job_id"])
    if job is None:
        return json_error(404, f"no scan job {request.match_info['job_id']}")
    services.wake_workers()
    return web.json_response(JobView.of(job).model_dump(), status=202)


async def list_scans(request: web.Request) -> web.Response:
    services = services_of(request)
    states = [s for s in request.query.get("state", "").split(",") if s]
    jobs = await services.store.run(
        queries.jobs, states=states, limit=_int_param(request, "limit", 50, 1, MAX_PAGE)
    )
    return web.json_response({"jobs": [JobView.of(job).model_dump() for job in jobs]})


def setup_routes(app: web.Application) -> None:
    app.router.add_post("/hooks/{source}", receive_webhook)
    app.router.add_get("/api/images", list_images)
    app.router.add_get("/api/images/by-ref", image_by_ref)
    app.router.add_post("/api/scans", create_scan)
    app.router.add_get("/api/scans", list_scans)
    app.router.add_get("/api/scans/{job_id}", get_scan)
    app.router.add_post("/api/scans/{job_id}/retry", retry_scan)
