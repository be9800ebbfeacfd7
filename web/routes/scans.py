"""The scan API: request a scan, list scan jobs, show one (optionally waiting for it), retry one."""

from __future__ import annotations

from aiohttp import web
from pydantic import ValidationError

from jobs.intake import RETRY_AFTER_SECONDS
from jobs.scan_requests import ScanRefused, request_scan
from store import queries
from store.models import JOB_STATES
from web.api_description import (
    BAD_QUERY,
    ERROR,
    OBJECT,
    PRIVATE,
    QUEUE_FULL,
    TOO_LARGE,
    ApiRoutes,
    json_reply,
    path_parameter,
    query,
)
from web.api_models import JobView, ScanBody
from web.errors import json_error, json_http_error, read_json
from web.lookups import MAX_PAGE, int_param, public_wait, require_api_token, wait_param
from web.state import services_of

ROUTES = ApiRoutes()


@ROUTES.post(
    "/api/scans",
    "Request a scan",
    description="Queues a scan of `ref`, or answers the queued or running one. With `rescan: true` the"
    " image is read again whatever is stored (a report left pending by an interrupted scan is read"
    " again in any case).",
    token=True,
    body=ScanBody,
    responses={
        "202": json_reply(JobView, "queued"),
        "400": json_reply(ERROR, "invalid reference or body"),
        "401": json_reply(ERROR, "token required"),
        "403": json_reply(ERROR, "registry not allowed"),
        **TOO_LARGE,
        "503": json_reply(ERROR, QUEUE_FULL),
    },
)
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
        job = await request_scan(
            services.intake,
            services.settings,
            body.ref,
            source="api",
            wake=services.wake_workers,
            rescan=body.rescan,
        )
    except ScanRefused as refused:
        answer = json_error(refused.status, refused.message)
        if refused.status == 503:  # the queue is full: come back when workers have caught up
            answer.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
        return answer
    return web.json_response(JobView.of(job).model_dump(), status=202)


@ROUTES.get(
    "/api/scans/{job_id}",
    "A scan job's state and error",
    parameters=[
        path_parameter("job_id"),
        query("wait", "seconds to wait for the job to finish (max 60)", "number"),
    ],
    responses={
        "200": json_reply(JobView, "the job"),
        "404": json_reply(ERROR, "unknown job"),
        **BAD_QUERY,
        **PRIVATE,
    },
)
async def get_scan(request: web.Request) -> web.Response:
    services = services_of(request)
    job_id = request.match_info["job_id"]
    wait = wait_param(request)
    job = await services.store.run(queries.job, job_id)
    if job is not None and wait:  # the job may run in any worker process, here or elsewhere
        async with public_wait(request, wait):
            job = await services.store.wait_for_job(job_id, wait)
    if job is None:
        return json_error(404, f"no scan job {job_id}")
    return web.json_response(JobView.of(job).model_dump())


@ROUTES.post(
    "/api/scans/{job_id}/retry",
    "Retry a failed scan job",
    token=True,
    parameters=[path_parameter("job_id")],
    responses={
        "202": json_reply(JobView, "queued again"),
        "401": json_reply(ERROR, "token required"),
        "404": json_reply(ERROR, "unknown job"),
    },
)
async def retry_scan(request: web.Request) -> web.Response:
    require_api_token(request)
    services = services_of(request)
    job = await services.store.retry_job(request.match_info["job_id"])
    if job is None:
        return json_error(404, f"no scan job {request.match_info['job_id']}")
    services.wake_workers()
    return web.json_response(JobView.of(job).model_dump(), status=202)


@ROUTES.get(
    "/api/scans",
    "Recent scan jobs",
    parameters=[
        query("state", "comma-separated job states: queued, running, done, failed"),
        query("limit", "rows (max 200)", "integer"),
    ],
    responses={"200": json_reply(OBJECT, "jobs"), **BAD_QUERY, **PRIVATE},
)
async def list_scans(request: web.Request) -> web.Response:
    services = services_of(request)
    states = [s for s in request.query.get("state", "").split(",") if s]
    unknown = sorted(set(states) - set(JOB_STATES))
    if unknown:
        raise json_http_error(
            web.HTTPBadRequest, f"state: no job state {unknown[0][:40]!r} (states: {', '.join(JOB_STATES)})"
        )
    jobs = await services.store.run(
        queries.jobs, states=states, limit=int_param(request, "limit", 50, 1, MAX_PAGE)
    )
    return web.json_response({"jobs": [JobView.of(job).model_dump() for job in jobs]})


def setup_routes(app: web.Application) -> None:
    ROUTES.setup(app)
