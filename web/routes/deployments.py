"""Deployments: place an image on the best eligible server and reserve its GPUs, list, show, stop.

Reserving GPUs is one store transaction whose primary key on the GPU UUID makes double-booking
impossible; a deploy that loses that race decides again on the fresh inventory. A deployment
placed or stopped wakes its server's long poll.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from aiohttp import web

from placement.answer import ReasonCount
from placement.decide import decide
from placement.decision import Decision
from placement.image_facts import ImageFacts
from placement.protocol import (
    TERMINAL_STATES,
)
from placement.request import DeployRequest
from store import GpuTaken, queries
from web.api_description import (
    ERROR,
    NOT_PLACEABLE,
    PRIVATE,
    ApiRoutes,
    ImageBody,
    json_reply,
    path_parameter,
    query,
)
from web.api_models import Deployment, RunSpec
from web.errors import json_error
from web.fleet.live_fleet import FLEET_INDEX, fleet_index
from web.fleet.long_polls import LONG_POLLS
from web.lookups import image_report, requested_deployment, require_api_token
from web.placement_requests import request_body
from web.security import holds_api_token
from web.state import services_of

ROUTES = ApiRoutes()

RESERVE_ATTEMPTS = 5


@ROUTES.post(
    "/api/deployments",
    "Deploy an image: reserve GPUs on the best eligible server for its agent to run",
    token=True,
    body=ImageBody("DeploymentRequest", (DeployRequest, RunSpec)),
    responses={
        "201": json_reply(Deployment, "reserved; the server's agent will run it"),
        **NOT_PLACEABLE,
        "401": json_reply(ERROR, "token required"),
        "404": json_reply(
            ERROR, "no stored report for the image (or its scan is queued: the message names it)"
        ),
        "409": json_reply(
            {
                "allOf": [
                    ERROR,
                    {
                        "type": "object",
                        "properties": {
                            "ineligible_count": {"type": "integer"},
                            "ineligible_by_reason": {"type": "array", "items": ReasonCount},
                        },
                    },
                ]
            },
            "no server can run it; `ineligible_by_reason` says why",
        ),
    },
)
async def create_deployment(request: web.Request) -> web.Response:
    require_api_token(request)
    services = services_of(request)
    image, deploy, run, _ = await request_body(request, run_fields=True)
    report = await image_report(services, image)
    facts = ImageFacts.from_report(report)
    decision: Decision | None = None
    for _ in range(RESERVE_ATTEMPTS):
        decision = decide(facts, deploy, await fleet_index(request.app))
        choice = decision.best
        if choice is None:
            break
        platform = next(p for p in report.platforms if p.platform == choice["platform"])
        deployment = Deployment(
            id=uuid.uuid4().hex,
            image=report.reference,
            digest=platform.digest,
            platform=platform.platform,
            server=choice["server"],
            gpus=list(choice["gpus"]),
            gpu_required=bool(choice["gpus"]),
            driver_capabilities=platform.gpu.driver_capabilities,
            inferred_cuda=bool(choice["gpus"])
            and not platform.gpu.required
            and platform.gpu.inferred is not None,
            command=run.command,
            env=run.env,
        )
        try:
            await services.store.create_deployment(
                deployment.id,
                deployment.server,
                deployment.gpus,
                deployment.model_dump_json(),
            )
        except GpuTaken:
            # Another deploy (maybe another process) reserved one of these GPUs first: decide again.
            request.app[FLEET_INDEX].reservations_changed()
            continue
        request.app[FLEET_INDEX].reservations_changed()
        request.app[LONG_POLLS].wake([deployment.server])
        return web.json_response(
            deployment.shown(holds_api_token(request, services.settings.api_token)), status=201
        )
    assert decision is not None
    return json_error(
        409,
        "no server can run this image with this request",
        ineligible_count=decision.ineligible_count,
        ineligible_by_reason=decision.ineligible_summary(),
    )


@ROUTES.get(
    "/api/deployments/{id}",
    "A deployment's state, exit code and last log lines",
    parameters=[path_parameter("id")],
    responses={
        "200": json_reply(Deployment, "the deployment"),
        "404": json_reply(ERROR, "unknown"),
        **PRIVATE,
    },
)
async def get_deployment(request: web.Request) -> web.Response:
    services = services_of(request)
    deployment = await requested_deployment(request)
    return web.json_response(deployment.shown(holds_api_token(request, services.settings.api_token)))


@ROUTES.get(
    "/api/deployments",
    "Deployments, newest first",
    parameters=[query("server", "only this server's deployments")],
    responses={
        "200": json_reply(
            {"type": "object", "properties": {"deployments": {"type": "array", "items": Deployment}}},
            "deployments",
        ),
        **PRIVATE,
    },
)
async def list_deployments(request: web.Request) -> web.Response:
    services = services_of(request)
    reveal = holds_api_token(request, services.settings.api_token)
    rows = await services.store.run(queries.deployments, server=request.query.get("server") or None)
    return web.json_response(
        {"deployments": [Deployment.model_validate_json(row.record_json).shown(reveal) for row in rows]}
    )


@ROUTES.delete(
    "/api/deployments/{id}",
    "Stop a deployment (at once when its agent has not picked it up yet)",
    token=True,
    parameters=[path_parameter("id")],
    responses={
        "200": json_reply(Deployment, "already finished"),
        "202": json_reply(Deployment, "stopping"),
        "401": json_reply(ERROR, "token required"),
        "404": json_reply(ERROR, "unknown deployment"),
    },
)
async def delete_deployment(request: web.Request) -> web.Response:
    require_api_token(request)
    services = services_of(request)
    deployment = await requested_deployment(request)
    reveal = holds_api_token(request, services.settings.api_token)
    if deployment.state in TERMINAL_STATES:
        return web.json_response(deployment.shown(reveal))
    now = datetime.now(UTC)
    if deployment.state == "pending":  # the agent never saw it: stop here and free the GPUs
        deployment = deployment.model_copy(
            update={
                "state": "stopped",
                "desired": "stop",
                "reason": "stopped before it started",
                "updated_at": now,
            }
        )
        await services.store.run(
            queries.update_deployment,
            deployment.id,
            deployment.model_dump_json(),
            state="stopped",
            desired="stop",
            release=True,
        )
        request.app[FLEET_INDEX].reservations_changed()
    else:
        deployment = deployment.model_copy(update={"desired": "stop", "updated_at": now})
        await services.store.run(
            queries.update_deployment,
            deployment.id,
            deployment.model_dump_json(),
            state=deployment.state,
            desired="stop",
        )
    request.app[LONG_POLLS].wake([deployment.server])
    return web.json_response(deployment.shown(reveal), status=202)


def setup_routes(app: web.Application) -> None:
    ROUTES.setup(app)
