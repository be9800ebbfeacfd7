"""The image API: `GET /api/images` (a filtered page of scanned images) and
`GET /api/images/by-ref` (one image's report, optionally waiting for its scan)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from placement.image_needs import image_needs
from scanner.models import ImageReport
from scanner.redaction import redact_secrets
from scanner.registry.reference import ReferenceError, parse_reference
from store import ImageRow, queries
from web.api_description import (
    BAD_QUERY,
    ERROR,
    OBJECT,
    PRIVATE,
    ApiRoutes,
    json_reply,
    query,
)
from web.api_models import JobView
from web.errors import json_error, json_http_error
from web.lookups import MAX_PAGE, find_report, int_param, public_wait, scan_jobs_of, wait_param
from web.state import services_of
from web.views.image_views import row_carried_cuda, row_gpu

ROUTES = ApiRoutes()


def _report_json(report: ImageReport) -> dict[str, Any]:
    """The report (`gpubadge scan --json`'s shape), with `needs`: placement's answer to "does it
    need a GPU?" in the one vocabulary (placement.image_needs)."""
    body = report.model_dump(mode="json")
    if body.get("error"):
        body["error"] = redact_secrets(body["error"])
    else:
        body["needs"] = image_needs(report).model_dump(mode="json")
    return body


def _row_json(row: ImageRow) -> dict[str, Any]:
    """A listing row with the vocabulary's answer: `gpu` (required, optional or none) and the CUDA
    its layers carry beside the declared `cuda_versions`."""
    return {**row.__dict__, "gpu": row_gpu(row), "carried_cuda": row_carried_cuda(row)}


def _gpu_params(request: web.Request) -> tuple[bool | None, bool | None]:
    """(declares a GPU, carries CUDA) filters from `gpu` (true/false, or the vocabulary's required,
    optional, none) and `inferred`."""
    gpu = request.query.get("gpu", "")
    inferred = _bool_param(request.query.get("inferred"), "inferred")
    if gpu in ("required", "optional", "none"):
        declared = gpu == "required"
        if gpu != "required":
            inferred = gpu == "optional"
        return declared, inferred
    return _bool_param(gpu, "gpu"), inferred


def _bool_param(value: str | None, name: str) -> bool | None:
    if value is None or value == "":
        return None
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "gpu"):
        return True
    if lowered in ("0", "false", "no", "cpu"):
        return False
    raise json_http_error(web.HTTPBadRequest, f"{name} must be true or false")


def _ready(report: ImageReport | None, until: str) -> bool:
    """`?until=facts`: a report exists; `done` (the default): its layer verdicts are in too."""
    return report is not None and (until == "facts" or not report.pending)


@ROUTES.get(
    "/api/images",
    "List scanned images",
    parameters=[
        query(
            "gpu",
            "required: declares an NVIDIA GPU; optional: declares none but carries CUDA (runs on a CPU too);"
            " none: neither (CPU only). true and false: declares a GPU or not",
        ),
        query("libc", "glibc, musl, none or unknown"),
        query("cuda", "CUDA version an image declares or carries, e.g. 12 or 12.2"),
        query("inferred", "true: CUDA found in the layers (declared or not); false: none found", "boolean"),
        query("registry", "registry host"),
        query("q", "free text over repository, reference, digest, distro and tags (at most 200 characters)"),
        query("page", "page number, from 1", "integer"),
        query("limit", "rows per page (max 200)", "integer"),
    ],
    responses={"200": json_reply(OBJECT, "a page of images"), **BAD_QUERY, **PRIVATE},
)
async def list_images(request: web.Request) -> web.Response:
    services = services_of(request)
    query = request.query
    limit = int_param(request, "limit", 50, 1, MAX_PAGE)
    page = int_param(request, "page", 1, 1, 1_000_000)
    libc = query.get("libc") or None
    if libc == "no-libc":
        libc = "none"
    declared, carried = _gpu_params(request)
    search = query.get("q") or None
    if search is not None and len(search) > queries.SEARCH_MAX_CHARS:
        raise json_http_error(web.HTTPBadRequest, f"q: at most {queries.SEARCH_MAX_CHARS} characters")
    rows, total = await services.store.run(
        queries.list_images,
        gpu=declared,
        libc=libc,
        cuda=query.get("cuda") or None,
        registry=query.get("registry") or None,
        query=search,
        limit=limit,
        offset=(page - 1) * limit,
        inferred=carried,
    )
    return web.json_response(
        {
            "total": total,
            "page": page,
            "limit": limit,
            "images": [_row_json(row) for row in rows],
        }
    )


@ROUTES.get(
    "/api/images/by-ref",
    "Latest report for a tag or digest reference (the `gpubadge scan --json` shape)",
    parameters=[
        {**query("ref", "image reference"), "required": True},
        query("wait", "seconds to wait for the report (max 60)", "number"),
        {
            "name": "until",
            "in": "query",
            "description": "what `wait` waits for: done (the full report, the default) or facts"
            " (the config facts, published before the layers are read; `pending` is true then)",
            "schema": {"type": "string", "enum": ["done", "facts"]},
        },
    ],
    responses={
        "200": json_reply(ImageReport, "the report; `pending` true while its layers are still being read"),
        "400": json_reply(ERROR, "invalid reference, wait or until"),
        "404": json_reply(ERROR, "not scanned; `pending` says whether a scan is queued"),
        **PRIVATE,
    },
)
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
    report: ImageReport | None = None

    async def ready() -> bool:
        nonlocal report
        report = await find_report(services, reference)
        return _ready(report, until)

    if wait:  # the scan may run in any worker process, here or elsewhere; the last check's read is kept
        async with public_wait(request, wait):
            await services.store.wait_until(ready, wait, key=str(reference))
    else:
        await ready()
    if report is None:
        pending, latest = await scan_jobs_of(services, reference)
        return json_error(
            404,
            f"{reference} has not been scanned",
            pending=pending is not None,
            job=JobView.of(latest).model_dump() if latest else None,
        )
    found: ImageReport = report
    if any(p.gpu.archs is not None and p.gpu.archs.files for p in found.platforms):
        # its GPU code is judged per compute capability (placement.gpu_code): a thread's work
        return web.json_response(await asyncio.to_thread(_report_json, found))
    return web.json_response(_report_json(found))


def setup_routes(app: web.Application) -> None:
    ROUTES.setup(app)
