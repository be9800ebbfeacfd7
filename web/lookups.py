"""What several routes look up: the API token check, paging and `?wait=` parameters (and the public
long polls' slots), an image's stored report (scanning it when allowed), a stored deployment.

Route modules import this module and never each other.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from aiohttp import web

from jobs.scan_requests import ScanRefused, request_scan
from scanner.models import ImageReport
from scanner.registry.reference import Reference, ReferenceError, parse_reference
from store import Job, queries
from web.api_models import Deployment
from web.errors import json_http_error
from web.fleet.long_polls import PUBLIC_WAITS
from web.security import BEARER_CHALLENGE, bearer_token, holds_api_token, token_matches
from web.state import Services, services_of

MAX_PAGE = 200


MAX_WAIT = 60.0
PUBLIC_WAIT_RETRY_SECONDS = 5


def bearer_may_write(request: web.Request) -> bool:
    """Whether the request's bearer token passes for the API token (any does when none is
    configured; constant-time compare)."""
    return token_matches(services_of(request).settings.api_token, bearer_token(request) or "")


def require_api_token(request: web.Request) -> None:
    """Write endpoints need the API token when one is configured (constant-time compare)."""
    if not bearer_may_write(request):
        raise json_http_error(
            web.HTTPUnauthorized,
            "a valid API token is required (Authorization: Bearer <token>)",
            headers={"WWW-Authenticate": BEARER_CHALLENGE},
        )


def wait_param(request: web.Request, cap: float = MAX_WAIT) -> float:
    """`?wait=S`: long-poll for at most S seconds (capped), so clients sync on events, not sleeps."""
    raw = request.query.get("wait", "")
    try:
        return min(cap, max(0.0, float(raw))) if raw else 0.0
    except ValueError:
        raise json_http_error(web.HTTPBadRequest, "wait must be a number of seconds") from None


@contextlib.asynccontextmanager
async def public_wait(request: web.Request, wait: float) -> AsyncIterator[None]:
    """Hold a `?wait=` long poll of `wait` seconds for its caller: one of `PublicWaits`' slots unless
    the caller holds the API token (a pipeline of the operator's); 503 with Retry-After when none is
    free (GPUBADGE_PUBLIC_LONG_POLL_MAX, GPUBADGE_PUBLIC_LONG_POLLS_PER_PEER)."""
    settings = services_of(request).settings
    if wait <= 0 or holds_api_token(request, settings.api_token):
        yield
        return
    waits = request.app[PUBLIC_WAITS]
    peer = request.remote or "local"
    if not waits.admit(peer):
        refused = json_http_error(
            web.HTTPServiceUnavailable,
            f"this service holds its most public long polls ({waits.limit:,} in all, {waits.per_peer:,} per"
            " client: GPUBADGE_PUBLIC_LONG_POLL_MAX, GPUBADGE_PUBLIC_LONG_POLLS_PER_PEER); retry without"
            " wait, or with the API token",
            headers={"Retry-After": str(PUBLIC_WAIT_RETRY_SECONDS)},
        )
        refused.force_close()  # its connection goes too: a refused poll holds nothing
        raise refused
    try:
        yield
    finally:
        waits.release(peer)


def int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise json_http_error(web.HTTPBadRequest, f"{name} must be an integer") from None
    return max(low, min(high, value))


async def find_report(services: Services, reference: Reference) -> ImageReport | None:
    """The latest stored report for a tag or digest reference (one store read, or none while the
    store's lookup of it still holds: `store.report_lookups`)."""
    report, _ = await find_report_in_index(services, reference)
    return report


async def find_report_in_index(
    services: Services, reference: Reference
) -> tuple[ImageReport | None, queries.IndexOf | None]:
    """`find_report`, and for a platform manifest of an index reached by its digest, that index (its
    scan is the index's, and so is its time: the report carries the index's `scanned_at`)."""
    digest, report, platform = await services.store.reference_report(
        reference.registry, reference.repository, reference.tag or "", reference.digest
    )
    if digest is None:
        return None, None
    index = None
    if report is None:
        if platform is None:
            return None, None
        index = await index_of(services, reference, digest)
        report = ImageReport(
            reference=str(reference),
            digest=digest,
            platforms=[platform],
            registry=reference.registry,
            repository=reference.repository,
            scanned_at=datetime.fromisoformat(index.scanned_at) if index else UNKNOWN_TIME,
        )
    update = {"reference": str(reference), "tag": reference.tag, "cached": True}
    return report.model_copy(update=update), index


# The scan time of a platform manifest whose index report is gone: unknown, said as the epoch (the
# page says "unknown"), never the time of the request.
UNKNOWN_TIME = datetime.fromtimestamp(0, UTC)


async def index_of(services: Services, reference: Reference, digest: str) -> queries.IndexOf | None:
    """The stored index that lists `digest` as one of its platforms (None: not an index's child)."""
    return await services.store.run(queries.index_of, reference.registry, reference.repository, digest)


async def scan_jobs_of(services: Services, reference: Reference) -> tuple[Job | None, Job | None]:
    """The reference's queued or running scan job, and its latest job (that same one when it has one)."""
    pending = await services.store.run(queries.pending_job_for, str(reference))
    return pending, pending or await services.store.run(queries.latest_job_for, str(reference))


def _outdated(report: ImageReport) -> bool:
    return any(platform.outdated for platform in report.platforms)


async def read_again(services: Services, reference: Reference, stored: ImageReport) -> ImageReport:
    """The report of `reference` as this gpubadge's analysis reads it, for a stored one an older
    analysis wrote (the scan never reuses an outdated report).

    It is scanned here and now, as an image never scanned would be, but for at most
    `GPUBADGE_OUTDATED_SCAN_WAIT` seconds: past that (a registry down or slow, layers to read again),
    or where the scan failed for a reason that may pass, `stored` answers and a scan is queued
    (joined to one already waiting) for the workers to finish. A queue behind it does not hold the
    answer: after an upgrade `gpubadge db rescan-outdated` may have queued thousands.
    """
    wait = services.settings.outdated_scan_wait
    if services.scanner is not None and wait > 0:
        try:
            async with asyncio.timeout(wait):
                again = await services.scanner.scan(str(reference))
        except TimeoutError:
            pass
        else:
            if again.error is None:
                return again
            if not again.retryable:
                return stored
    with contextlib.suppress(ScanRefused):  # only a full queue: the reference parsed, its registry is allowed
        await request_scan(
            services.intake, services.settings, str(reference), source="outdated", wake=services.wake_workers
        )
    return stored


async def image_report(services: Services, text: str, *, may_scan: bool = True) -> ImageReport:
    """The stored report for `text`, scanning it now if it was never scanned and `may_scan`, for at most
    `GPUBADGE_UNSCANNED_SCAN_WAIT` seconds (past it the scan is queued, and a 404 names its job).

    A scan costs registry traffic and a worker's time, so a caller without the API token
    (`may_scan=False`) gets a 404 that says how to ask for the scan instead. A report an older
    analysis read (`PlatformReport.outdated`) is scanned again first when `may_scan`
    (`read_again`); where that cannot be done in time the stored report answers, and placement's
    answer says it is outdated.
    """
    try:
        reference = parse_reference(text)
    except ReferenceError as exc:
        raise json_http_error(web.HTTPBadRequest, str(exc)) from None
    report = await find_report(services, reference)
    if report is not None:
        if may_scan and _outdated(report) and services.settings.allows(reference.registry):
            return await read_again(services, reference, report)
        return report
    if not may_scan:
        if await services.store.run(queries.pending_job_for, str(reference)) is not None:
            raise json_http_error(
                web.HTTPNotFound,
                f"{reference} has not been scanned yet; its scan is queued, ask again when it is done",
            )
        raise json_http_error(
            web.HTTPNotFound,
            f"{reference} has not been scanned, and scanning it needs the API token: send"
            " Authorization: Bearer <token> with this request, or request the scan with"
            f' POST /api/scans {{"ref": "{reference}"}}',
        )
    if not services.settings.allows(reference.registry):
        raise json_http_error(web.HTTPForbidden, f"registry not on the allowlist: {reference.registry}")
    if services.scanner is None:
        raise json_http_error(web.HTTPServiceUnavailable, "scanner not ready")
    wait = services.settings.unscanned_scan_wait
    try:
        async with asyncio.timeout(wait):
            report = await services.scanner.scan(str(reference))
    except TimeoutError:
        raise await _queued_instead(services, reference, wait) from None
    if report.error:
        raise json_http_error(web.HTTPUnprocessableEntity, f"could not scan {reference}: {report.error}")
    return report


async def _queued_instead(services: Services, reference: Reference, wait: float) -> web.HTTPException:
    """The answer for an image never scanned whose scan here took longer than `wait` seconds: the scan is
    queued for the workers (joined to one already waiting), and the 404 names its job."""
    try:
        job = await request_scan(
            services.intake, services.settings, str(reference), source="api", wake=services.wake_workers
        )
    except ScanRefused as refused:  # only a full queue: the reference parsed, its registry is allowed
        return json_http_error(web.HTTPServiceUnavailable, refused.message, headers={"Retry-After": "30"})
    return json_http_error(
        web.HTTPNotFound,
        f"{reference} has not been scanned yet: scanning it took longer than {wait:g} s"
        f" (GPUBADGE_UNSCANNED_SCAN_WAIT), so it is queued as scan {job.id}; ask again when it is done"
        f" (GET /api/scans/{job.id}?wait=60 waits for it)",
        scan=job.id,
    )


async def requested_deployment(request: web.Request) -> Deployment:
    """The stored deployment `/{id}` names; 404 `no deployment ID` when there is none."""
    deployment_id = request.match_info["id"]
    row = await services_of(request).store.run(queries.deployment, deployment_id)
    if row is None:
        raise json_http_error(web.HTTPNotFound, f"no deployment {deployment_id}")
    return Deployment.model_validate_json(row.record_json)
