"""HTML pages and SVG badges of images and scans: server-rendered, usable without JavaScript.

Handlers do the I/O (store reads, form posts) and hand view objects (web/image_views.py) to the
templates through web/templating.py's environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
from typing import Any
from urllib.parse import urlencode

from aiohttp import web
from markupsafe import Markup

from jobs.scan_requests import ScanRefused, request_scan
from placement.image_needs import image_needs
from scanner.models import ImageReport
from scanner.redaction import redact_secrets
from scanner.registry.reference import Reference, ReferenceError, parse_reference
from store import queries
from web.lookups import UNKNOWN_TIME, find_report, find_report_in_index, scan_jobs_of
from web.security import token_matches
from web.state import Services, services_of
from web.views.badge_svg import badge_for, render_badge
from web.views.image_views import (
    LEGEND,
    ImageFilters,
    explain_error,
    image_row_view,
    job_view,
    platform_view,
    progress_of,
    tag_history_view,
)
from web.views.nfd_view import nfd_views
from web.views.templating import STATIC_DIR, badge_url, environment, image_url, page, render

PAGE_SIZE = 50


RECENT_FAILURES = 5


# A scanned image's badge changes only when a push is scanned; five minutes of staleness is fine
# in a README, lets GitHub's image proxy and browsers cache it, and the ETag makes revalidation
# cheap. "Not scanned" is served no-cache so the badge turns green as soon as the scan lands.
BADGE_MAX_AGE = "max-age=300, public"


BADGE_NO_CACHE = "no-cache"


async def images_page(request: web.Request) -> web.Response:
    services = services_of(request)
    store = services.store
    filters = ImageFilters.from_query(request.query)
    rows, total = await store.run(
        queries.list_images,
        **filters.store_arguments(),
        limit=PAGE_SIZE,
        offset=(filters.page - 1) * PAGE_SIZE,
    )
    if filters.active or filters.page > 1:
        newest, _ = await store.run(queries.list_images, limit=1)
    else:
        newest = rows[:1]
    pages = max(1, math.ceil(total / PAGE_SIZE))
    return page(
        request,
        "images.html",
        title="Images · gpubadge",
        active="images",
        filters=filters,
        rows=[image_row_view(row) for row in rows],
        total=total,
        pages=pages,
        registries=await store.run(queries.registries),
        last_scan=newest[0].scanned_at if newest else None,
        failures=[
            job_view(job) for job in await store.run(queries.jobs, states=["failed"], limit=RECENT_FAILURES)
        ],
        legend=LEGEND,
        token_required=services.settings.api_token is not None,
    )


async def image_page(request: web.Request) -> web.Response:
    services = services_of(request)
    text = request.match_info["path"]
    try:
        reference = parse_reference(text)
    except ReferenceError as exc:
        return page(request, "error.html", status=400, title="Bad reference · gpubadge", message=str(exc))
    report, index = await find_report_in_index(services, reference)
    if report is None:
        pending, latest = await scan_jobs_of(services, reference)
        return page(
            request,
            "not_scanned.html",
            status=404,
            title=f"{reference} · not scanned",
            active="images",
            reference=str(reference),
            pending=job_view(pending) if pending else None,
            latest=job_view(latest) if latest else None,
            token_required=services.settings.api_token is not None,
        )
    return page(
        request,
        "image.html",
        title=f"{reference} · gpubadge",
        active="images",
        **await detail_context(services, reference, report, index),
    )


def eligibility_link(reference: Reference | str, gpu: bool) -> str:
    """The eligibility explorer for this image: with one GPU asked for where it needs or can use one."""
    fields = {"image": str(reference), **({"gpus": "1"} if gpu else {})}
    return "/eligibility?" + urlencode(fields)


# Tag events an image page shows: its repository's newest (a CI repository may hold one per commit).
TAG_HISTORY_ROWS = 100


async def detail_context(
    services: Services, reference: Reference, report: ImageReport, index: queries.IndexOf | None = None
) -> dict[str, Any]:
    store = services.store
    digests = {report.digest or ""} | {p.digest for p in report.platforms}
    tags = await store.run(queries.tags_for_digest, report.digest) if report.digest else []
    history = await store.run(
        queries.tag_history, reference.registry, reference.repository, limit=TAG_HISTORY_ROWS + 1
    )
    # the verdicts judge every file of GPU code per compute capability: a thread's work, not the loop's
    needs, platforms = await asyncio.to_thread(
        lambda: (image_needs(report), [platform_view(p) for p in report.platforms])
    )
    return {
        "reference": str(reference),
        "needs": needs,
        "eligibility_url": eligibility_link(reference, needs.gpu != "none"),
        "index": index,
        "index_url": image_url(index.reference) if index else None,
        "scan_time_known": report.scanned_at != UNKNOWN_TIME,
        "token_required": services.settings.api_token is not None,
        "interrupted": await interrupted_read(services, report),
        "outdated": any(platform.outdated for platform in report.platforms),
        "report": report.model_copy(update={"error": redact_secrets(report.error)})
        if report.error
        else report,
        "platforms": platforms,
        "tags": [(tag, image_url(f"{registry}/{repository}:{tag}")) for registry, repository, tag in tags],
        "history": tag_history_view(history[:TAG_HISTORY_ROWS], reference.name, digests),
        "history_cut": len(history) > TAG_HISTORY_ROWS,
        "badge_url": badge_url(reference),
        "error": explain_error(report.error) if report.error else None,
        "progress": progress_of(str(reference), services.layer_progress()) if report.pending else None,
        "referrers": [
            status
            for digest in dict.fromkeys([report.digest or "", *(p.digest for p in report.platforms)])
            if services.attacher is not None and (status := services.attacher.status(digest)) is not None
        ],
        "nfd_html": await nfd_section(services, report),
    }


async def interrupted_read(services: Services, report: ImageReport) -> bool:
    """A pending report whose layer read no longer runs: no live scan job holds its lease (the read
    was pre-empted, cut off or ended with its worker). The next scan of the image reads the layers
    again; the page offers it."""
    jobs = {p.pending_scan for p in report.platforms if p.libc.state == "pending"}
    if not report.pending or not jobs:
        return report.pending
    for job in jobs:
        if job is not None and await services.store.run(queries.scan_in_flight, job):
            return False
    return True


async def nfd_section(services: Services, report: ImageReport) -> Markup:
    """The image page's NFD section, rendered in a thread: an artifact is anyone's, so even its
    bounded rendering stays off the event loop."""
    views = await nfd_views(services.attacher, report)
    if not views:
        return Markup("")
    return Markup(await asyncio.to_thread(render, "_nfd.html", nfd=views))


async def scans_page(request: web.Request) -> web.Response:
    return await scans_response(request)


async def scans_response(
    request: web.Request, *, status: int = 200, error: str | None = None, ref: str = ""
) -> web.Response:
    services = services_of(request)
    store = services.store
    deep = services.layer_progress()
    recent = await store.run(queries.jobs, limit=50)
    names: dict[str, tuple[str, str]] = {}
    for job in recent:
        if job.state == "done" and job.result_digest:
            with contextlib.suppress(ReferenceError):
                reference = parse_reference(job.reference)
                names[job.result_digest] = (reference.registry, reference.repository)
    verdicts = await store.run(queries.scan_verdicts, names)
    return page(
        request,
        "scans.html",
        status=status,
        title="Scans · gpubadge",
        active="scans",
        pending=[
            job_view(job, deep)
            for job in await store.run(queries.jobs, states=["queued", "running"], limit=100)
        ],
        recent=[job_view(job, verdicts=verdicts) for job in recent],
        depth=await store.run(queries.queue_depth),
        token_required=services.settings.api_token is not None,
        form_error=error,
        ref=ref,
    )


async def submit_scan(request: web.Request) -> web.Response:
    """The scan form, and the image page's Rescan button (`rescan=1`): the same checks as POST
    /api/scans, then 303 to /scans (post/redirect/get), where the job shows."""
    services = services_of(request)
    form = await request.post()
    ref = str(form.get("ref", "")).strip()
    token = str(form.get("token", ""))
    rescan = form.get("rescan") == "1"  # the image page's Rescan button
    if not token_matches(services.settings.api_token, token):
        return await scans_response(request, status=401, error="That API token is not valid.", ref=ref)
    if not ref:
        return await scans_response(
            request, status=400, error="Enter an image reference, e.g. alpine:3.20.", ref=ref
        )
    try:
        await request_scan(
            services.intake, services.settings, ref, source="ui", wake=services.wake_workers, rescan=rescan
        )
    except ScanRefused as refused:
        return await scans_response(request, status=refused.status, error=refused.message, ref=ref)
    raise web.HTTPSeeOther("/scans")


def badge_reference(path: str) -> Reference:
    """`127.0.0.1:5000/team/app/1.0` (the badge URL without `.svg`) -> the tagged reference.

    The last segment is the tag; a `sha256:...` last segment pins a digest instead.
    """
    name, slash, last = path.rpartition("/")
    if not slash or not name or not last:
        raise ReferenceError(f"badge path {path!r} must be REGISTRY/REPOSITORY/TAG.svg")
    separator = "@" if ":" in last else ":"
    return parse_reference(f"{name}{separator}{last}")


async def badge(request: web.Request) -> web.Response:
    services = services_of(request)
    path = request.match_info["path"].removesuffix(".svg")
    try:
        reference = badge_reference(path)
    except ReferenceError as exc:
        return web.Response(status=400, text=str(exc), content_type="text/plain")
    report = await find_report(services, reference)
    failed, failure = False, None
    if report is None:
        latest = await services.store.run(queries.latest_job_for, str(reference))
        failed = latest is not None and latest.state == "failed"
        failure = redact_secrets(latest.error) if latest is not None and failed and latest.error else None
    svg = render_badge(badge_for(report, last_scan_failed=failed, failure=failure))
    etag = '"' + hashlib.sha256(svg.encode()).hexdigest()[:32] + '"'
    headers = {
        "Cache-Control": BADGE_MAX_AGE if report is not None else BADGE_NO_CACHE,
        "ETag": etag,
        "X-Content-Type-Options": "nosniff",
    }
    if etag in request.headers.get("If-None-Match", ""):
        return web.Response(status=304, headers=headers)
    return web.Response(text=svg, content_type="image/svg+xml", charset="utf-8", headers=headers)


async def favicon(request: web.Request) -> web.FileResponse:
    """/favicon.ico, which browsers and tools ask for on every page whatever the markup says."""
    return web.FileResponse(STATIC_DIR / "favicon.ico", headers={"Cache-Control": "public, max-age=86400"})


def setup_routes(app: web.Application) -> None:
    environment()  # load and check the templates at startup, not on the first request
    app.router.add_get("/", images_page)
    app.router.add_get("/images/{path:.+}", image_page)
    app.router.add_get("/scans", scans_page)
    app.router.add_post("/scans", submit_scan)
    app.router.add_get(r"/badge/{path:.+\.svg}", badge)
    app.router.add_static("/static", STATIC_DIR)
    app.router.add_get("/favicon.ico", favicon)
