"""Eligibility and constraints: which servers can run an image, and the same decision in another
scheduler's language. The decision is placement's pure `decide`, run in a worker thread on the
live fleet's index; these handlers gather its inputs (the image report, the request)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from placement.answer import ANSWER_FIELDS
from placement.decide import ImageFacts
from placement.exports import FORMATS, export_constraints, known_gpus
from web.errors import json_http_error
from web.live_fleet import fleet_index
from web.lookups import image_report
from web.placement_requests import answer_options, eligibility_answer, request_body
from web.security import bearer_token, token_matches
from web.state import services_of


async def eligibility(request: web.Request) -> web.Response:
    services = services_of(request)
    image, deploy, _, fields = await request_body(request, other_fields=ANSWER_FIELDS)
    options = answer_options(request, fields)
    may_scan = token_matches(services.settings.api_token, bearer_token(request) or "")
    report = await image_report(services, image, may_scan=may_scan)
    started = time.perf_counter()
    index = await fleet_index(request.app)
    index.view()  # built here, so the worker thread only reads the index
    # A thread, not a process: a query costs O(shapes + limit), about a millisecond of CPU at
    # 10,000 servers, so shipping the index to another process would cost more than the work.
    body: dict[str, Any] = dict(await asyncio.to_thread(eligibility_answer, report, deploy, index, options))
    body["image"] = {"reference": report.reference, "digest": report.digest}
    body["seconds"] = round(time.perf_counter() - started, 6)
    return web.json_response(body)


async def constraints(request: web.Request) -> web.Response:
    """The eligibility body plus `format`: the same decision in another scheduler's language."""
    services = services_of(request)
    image, deploy, _, fields = await request_body(request, other_fields=("format",))
    chosen = fields.get("format")
    if chosen not in FORMATS:
        raise json_http_error(web.HTTPBadRequest, f"invalid request: format: one of {', '.join(FORMATS)}")
    may_scan = token_matches(services.settings.api_token, bearer_token(request) or "")
    report = await image_report(services, image, may_scan=may_scan)
    fleet = known_gpus(await fleet_index(request.app))
    facts = ImageFacts.from_report(report)
    body = await asyncio.to_thread(export_constraints, facts, deploy, fleet, chosen)
    body["image"] = {"reference": report.reference, "digest": report.digest}
    return web.json_response(body)


def setup_routes(app: web.Application) -> None:
    app.router.add_post("/api/eligibility", eligibility)
    app.router.add_post("/api/constraints", constraints)
