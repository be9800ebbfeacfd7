"""Eligibility and constraints: which servers can run an image, and the same decision in another
scheduler's language. The decision is placement's pure `decide`, run in a worker thread on the
live fleet's index; these handlers gather its inputs (the image report, the request)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from placement.answer import ANSWER_FIELDS, AnswerOptions, EligibilityAnswer
from placement.exports import FORMATS, export_constraints, known_gpus
from placement.image_facts import ImageFacts
from placement.request import DeployRequest
from web.api_description import (
    ERROR,
    NOT_PLACEABLE,
    NOT_SCANNED_NO_TOKEN,
    ApiRoutes,
    ImageBody,
    json_reply,
    query,
)
from web.errors import json_http_error
from web.fleet.live_fleet import fleet_index
from web.lookups import bearer_may_write, image_report
from web.placement_requests import answer_options, eligibility_answer, request_body
from web.state import services_of

ROUTES = ApiRoutes()
ELIGIBILITY_BODY = ImageBody("EligibilityRequest", (DeployRequest, AnswerOptions))
ELIGIBILITY_ANSWER = {
    "allOf": [
        EligibilityAnswer,
        {
            "type": "object",
            "properties": {
                "image": {
                    "type": "object",
                    "properties": {"reference": {"type": "string"}, "digest": {"type": ["string", "null"]}},
                },
                "seconds": {"type": "number", "description": "time spent deciding"},
            },
        },
    ]
}
CONSTRAINTS_ANSWER = {
    "type": "object",
    "properties": {
        "format": {"enum": list(FORMATS)},
        "satisfiable": {"type": "boolean", "description": "false: no node can be eligible"},
        "notes": {"type": "array", "items": {"type": "string"}},
        "affinity": {"type": "object", "description": "core/v1 Affinity (kubernetes, dra)"},
        "resources": {"type": "object", "description": "container resources (kubernetes)"},
        "mig_strategy": {
            "type": "string",
            "description": "kubernetes, MIG devices asked for: the device plugin's strategy `affinity`"
            " and `resources` are written for (mixed: nvidia.com/mig-<profile>)",
        },
        "single_strategy": {
            "type": "object",
            "description": "kubernetes, MIG devices asked for: `affinity` and `resources` for nodes whose"
            " device plugin runs the single strategy (nvidia.com/gpu counts MIG devices)",
        },
        "resourceClaimTemplate": {"type": ["object", "null"], "description": "resource.k8s.io/v1 (dra)"},
        "hcl": {"type": "string", "description": "Nomad task fragment (nomad)"},
        "sdl": {"type": ["object", "null"], "description": "Akash SDL profiles (akash)"},
        "image": {"type": "object"},
    },
    "required": ["format", "satisfiable", "notes"],
}


@ROUTES.post(
    "/api/eligibility",
    "Which servers can run an image with this request, best fit first, and why not the others",
    description="Eligible servers come a page at a time (`limit`, default 50; pass `next_cursor` back as"
    " `cursor`); ineligible servers are counted by reason with a few examples. `explain: all` lists"
    " every server, with every reason. `limit`, `cursor` and `explain` may also be given in the query"
    " string.",
    body=ELIGIBILITY_BODY,
    parameters=[
        query("limit", "eligible servers per page (default 50)", "integer"),
        query("cursor", "`next_cursor` of the previous page"),
        query("explain", "summary (default) or all"),
    ],
    responses={
        "200": json_reply(ELIGIBILITY_ANSWER, "the decision"),
        **NOT_PLACEABLE,
        "404": json_reply(ERROR, NOT_SCANNED_NO_TOKEN),
    },
)
async def eligibility(request: web.Request) -> web.Response:
    services = services_of(request)
    image, deploy, _, fields = await request_body(request, other_fields=ANSWER_FIELDS)
    options = answer_options(request, fields)
    report = await image_report(services, image, may_scan=bearer_may_write(request))
    started = time.perf_counter()
    index = await fleet_index(request.app)
    index.view()  # built here, so a worker thread only reads the index
    # A thread when it must decide, not a process: a new question costs O(shapes + limit), a few
    # milliseconds of CPU at 10,000 servers, so shipping the index elsewhere would cost more.
    body: dict[str, Any] = dict(await eligibility_answer(report, deploy, index, options))
    body["image"] = {"reference": report.reference, "digest": report.digest}
    body["seconds"] = round(time.perf_counter() - started, 6)
    return web.json_response(body)


@ROUTES.post(
    "/api/constraints",
    "The eligibility of an image in a scheduler's language: kubernetes, dra, nomad or akash",
    description="The eligibility body plus `format`. `kubernetes`: `affinity` (GPU Feature Discovery"
    " labels, integer Gt/Lt terms) and `resources` (for MIG devices: the mixed strategy's, and"
    " `single_strategy`); `dra`: `resourceClaimTemplate` (resource.k8s.io/v1,"
    " CEL selectors) and an arch `affinity`; `nomad`: `hcl` (a task-level constraint and a device"
    " block); `akash`: `sdl` (a compute profile, null when no known model qualifies). `notes` says"
    " what the format cannot express or only approximates.",
    body={
        "allOf": [
            ELIGIBILITY_BODY,
            {"type": "object", "properties": {"format": {"enum": list(FORMATS)}}, "required": ["format"]},
        ]
    },
    responses={
        "200": json_reply(CONSTRAINTS_ANSWER, "the constraints"),
        **NOT_PLACEABLE,
        "404": json_reply(ERROR, NOT_SCANNED_NO_TOKEN),
    },
)
async def constraints(request: web.Request) -> web.Response:
    """The eligibility body plus `format`: the same decision in another scheduler's language."""
    services = services_of(request)
    image, deploy, _, fields = await request_body(request, other_fields=("format",))
    chosen = fields.get("format")
    if chosen not in FORMATS:
        raise json_http_error(web.HTTPBadRequest, f"invalid request: format: one of {', '.join(FORMATS)}")
    report = await image_report(services, image, may_scan=bearer_may_write(request))
    fleet = known_gpus(await fleet_index(request.app))
    facts = ImageFacts.from_report(report)
    body = await asyncio.to_thread(export_constraints, facts, deploy, fleet, chosen)
    body["image"] = {"reference": report.reference, "digest": report.digest}
    return web.json_response(body)


def setup_routes(app: web.Application) -> None:
    ROUTES.setup(app)
