"""The agents' endpoints: register, heartbeat, long-poll for deployments, report a deployment's
status; the list of live servers; and the operator's: release a GPU, remove a server.

Agents authenticate with GPUBADGE_AGENT_TOKEN (the fleet-wide token) or their own per-server
token; with neither configured they are refused unless GPUBADGE_ALLOW_AGENTS_WITHOUT_TOKEN opts in
(then anyone acts as the fleet-wide token). A registration is at most GPUBADGE_MAX_SERVER_BYTES
(refused before it is parsed), and the fleet-wide token (or no token) registers at most
GPUBADGE_MAX_SERVERS_PER_AGENT_TOKEN servers.

A GPU UUID (a MIG device's too: reservations name it) belongs to the server that first reported it
(`store.queries.upsert_server`), live or stale: another server reporting it gets 409, whatever its token, until an operator releases it
(`POST /api/gpus/{uuid}/release`, `DELETE /api/servers/{name}`, both with the fleet-wide token) or
the fleet-wide token registers it on another server (which moves it, once its owner is stale). Two
live servers never report one GPU.
"""

from __future__ import annotations

import hmac
import logging
import math
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from aiohttp import web

from placement.inventory import Gpu, Server
from placement.protocol import (
    TERMINAL_STATES,
    DeploymentsResponse,
    DeploymentStatus,
    Heartbeat,
    RegisterResponse,
)
from store import queries
from web.api_description import (
    AGENT_ONLY,
    ERROR,
    FLEET_ONLY,
    GPU_CLAIMED,
    OBJECT,
    PRIVATE,
    TOO_LARGE,
    ApiRoutes,
    Model,
    json_reply,
    path_parameter,
    query,
)
from web.api_models import Deployment
from web.errors import json_error, json_http_error, read_model
from web.fleet.live_fleet import FLEET_INDEX, GPU_CLAIMS, agent_server, live_servers
from web.fleet.long_polls import LONG_POLLS, MAX_POLL, idle_poll_end
from web.lookups import requested_deployment, wait_param
from web.security import BEARER_CHALLENGE, bearer_token
from web.state import services_of, services_of_app

log = logging.getLogger(__name__)

ROUTES = ApiRoutes()


def require_agent_token(request: web.Request, server_name: str) -> bool:
    """Agents present GPUBADGE_AGENT_TOKEN (any server), or the per-agent token of `server_name`.
    True for the fleet-wide token (or no token, where the operator opted in): it may move GPUs.

    A per-agent token is bound to its server: presented for another server it gets 403, so one
    compromised node cannot register, heartbeat, poll or report as its neighbours.
    """
    settings = services_of(request).settings
    if agents_open(request):
        return True  # no agent token configured, and the operator opted in (logged at startup)
    given = (bearer_token(request) or "").encode()
    fleet_wide = settings.agent_token is not None and hmac.compare_digest(
        given, settings.agent_token.get_secret_value().encode()
    )
    owner = None
    for name, token in settings.agent_tokens.items():  # every comparison runs, whichever matches
        if hmac.compare_digest(given, token.get_secret_value().encode()):
            owner = name
    if fleet_wide:
        return True
    if owner == server_name:
        return False
    if owner is not None:
        log.warning("agent token of server %s used for server %s: refused", owner, server_name)
        raise json_http_error(
            web.HTTPForbidden, f"this agent token belongs to server {owner}; it cannot act for {server_name}"
        )
    raise _unauthorized(request)


def agents_open(request: web.Request) -> bool:
    """No agent token is configured and the operator opted in to agents without one."""
    settings = services_of(request).settings
    return settings.agent_token is None and not settings.agent_tokens and settings.allow_agents_without_token


def _unauthorized(request: web.Request) -> web.HTTPException:
    settings = services_of(request).settings
    if settings.agent_token is None and not settings.agent_tokens:
        message = (
            "no agent token is configured, so agents are refused: set GPUBADGE_AGENT_TOKEN (or agent_tokens),"
            " or GPUBADGE_ALLOW_AGENTS_WITHOUT_TOKEN=true where every client is trusted"
        )
    else:
        message = "a valid agent token is required (Authorization: Bearer <token>)"
    return json_http_error(web.HTTPUnauthorized, message, headers={"WWW-Authenticate": BEARER_CHALLENGE})


def require_some_agent_token(request: web.Request) -> None:
    """Before a registration's body is read: 401 unless the request holds some agent token (or
    agents are open), so a stranger's body is never parsed."""
    if agents_open(request):
        return
    settings = services_of(request).settings
    given = (bearer_token(request) or "").encode()
    known = [token for token in (settings.agent_token, *settings.agent_tokens.values()) if token is not None]
    matched = False
    for token in known:  # every comparison runs
        matched |= hmac.compare_digest(given, token.get_secret_value().encode())
    if not matched:
        raise _unauthorized(request)


def require_fleet_token(request: web.Request, action: str) -> None:
    """Operators' fleet actions (release a GPU, remove a server) need the fleet-wide agent token."""
    settings = services_of(request).settings
    if agents_open(request):
        return
    if settings.agent_token is None:
        raise json_http_error(
            web.HTTPForbidden,
            f"{action} needs the fleet-wide agent token, and GPUBADGE_AGENT_TOKEN is not set",
        )
    given = (bearer_token(request) or "").encode()
    if not hmac.compare_digest(given, settings.agent_token.get_secret_value().encode()):
        log.warning("%s refused: the request does not hold the fleet-wide agent token", action)
        raise json_http_error(
            web.HTTPUnauthorized,
            f"{action} needs the fleet-wide agent token (Authorization: Bearer $GPUBADGE_AGENT_TOKEN);"
            " a per-agent token acts for its own server only",
            headers={"WWW-Authenticate": BEARER_CHALLENGE},
        )


async def claimed_elsewhere(app: web.Application, name: str, gpus: Sequence[Gpu]) -> web.Response | None:
    """A 409 when a live server other than `name` reports one of these GPU UUIDs, else None.

    The same UUID on two servers is a cloned inventory or an impostor; either way placement must
    not hand that GPU out twice. The claim lapses once its server goes stale.
    """
    cache = app[FLEET_INDEX]
    await cache.refresh(app)
    owners = cache.owners([device for gpu in gpus for device in gpu.device_uuids])
    taken = {uuid: owner for uuid, owner in owners.items() if owner != name}
    if not taken:
        return None
    holders = sorted(set(taken.values()))
    log.warning(
        "server %s reports GPU(s) %s already reported by live server(s) %s: refused until %s goes stale",
        name,
        ", ".join(sorted(taken)),
        ", ".join(holders),
        " / ".join(holders),
    )
    return json_error(
        409,
        f"GPU {', '.join(sorted(taken))} is already reported by live server {', '.join(holders)}",
        claimed=taken,
    )


def owned_elsewhere(name: str, owners: dict[str, str]) -> web.Response:
    """409: GPUs another server reported first (live or not); only an operator moves them."""
    holders = sorted(set(owners.values()))
    gpus = ", ".join(sorted(owners))
    log.warning(
        "server %s reports GPU(s) %s, which belong to server(s) %s: refused", name, gpus, ", ".join(holders)
    )
    return json_error(
        409,
        f"GPU {gpus} belongs to server {', '.join(holders)}, which reported it first; an operator releases it"
        f" (gpubadge fleet release {' '.join(sorted(owners))}, or POST /api/gpus/<uuid>/release with the"
        " fleet-wide agent token), or registers this server with the fleet-wide token to move it",
        claimed=owners,
    )


def _log_moved(name: str, moved: dict[str, str]) -> None:
    if moved:
        log.warning(
            "GPU(s) %s moved to server %s from server(s) %s by the fleet-wide agent token",
            ", ".join(sorted(moved)),
            name,
            ", ".join(sorted(set(moved.values()))),
        )


async def agent_heard(app: web.Application, name: str) -> web.Response | None:
    """An agent's heartbeat or poll: stamp it live. None when done, else the answer to give.

    A live agent costs a stamp in memory (no SQL, no lock). An agent this process does not hold
    live is looked up (once; another process may have registered it): unknown gets 404
    ("register again"); back after going stale, it is live again at once unless another live
    server claimed its GPUs meanwhile (409).
    """
    cache = app[FLEET_INDEX]
    if cache.is_live_agent(name):
        cache.heard(name)
        return None
    async with app[GPU_CLAIMS]:
        await cache.refresh(app)
        if cache.is_live_agent(name):
            cache.heard(name)
            return None
        if cache.stored(name) is None:
            found = await services_of_app(app).store.run(queries.server_records, [name])
            if not found:
                return json_error(404, f"unknown server {name}; register again")
            record = found[0]
            cache.learned(agent_server(record.inventory_json), record.inventory_json, record.last_heartbeat)
        stored = cache.stored(name)
        assert stored is not None
        conflict = await claimed_elsewhere(app, name, stored.gpus)
        if conflict is not None:
            return conflict
        uuids = [device for gpu in stored.gpus for device in gpu.device_uuids]
        store = services_of_app(app).store
        owners = await store.run(queries.gpu_owners, uuids) if uuids else {}
        taken = {gpu_uuid: owner for gpu_uuid, owner in owners.items() if owner != name}
        if not taken and len(owners) < len(uuids):  # some were released meanwhile: its own again
            taken = (await store.run(queries.claim_gpus, name, uuids)).refused
        if taken:
            return owned_elsewhere(name, taken)
        cache.returned(name)
    return None


@ROUTES.get(
    "/api/servers",
    "Live servers: the inventory file plus agents heard from recently, with GPUs in use",
    responses={
        "200": json_reply(
            {
                "type": "object",
                "properties": {"servers": {"type": "array", "items": Model(Server, "validation")}},
            },
            "the fleet",
        ),
        **PRIVATE,
    },
)
async def list_servers(request: web.Request) -> web.Response:
    servers = await live_servers(request.app)
    return web.json_response({"servers": [server.model_dump(mode="json") for server in servers]})


@ROUTES.post(
    "/api/servers",
    "Register a server (node agents); registering again replaces its inventory",
    token=True,
    body=Model(Server, "validation"),
    responses={
        "200": json_reply(RegisterResponse, "registered; heartbeat this often"),
        "400": json_reply(ERROR, "invalid server"),
        **AGENT_ONLY,
        **GPU_CLAIMED,
        **TOO_LARGE,
    },
)
async def register_server(request: web.Request) -> web.Response:
    services = services_of(request)
    settings = services.settings
    require_some_agent_token(request)  # before the body is read
    server = await read_model(
        request,
        settings.json_limits(),
        Server,
        "server",
        most=(settings.max_server_bytes, "GPUBADGE_MAX_SERVER_BYTES"),
    )
    fleet_wide = require_agent_token(request, server.name)
    stored = server.model_copy(update={"source": "agent", "gpus_in_use": [], "last_heartbeat": None})
    text = stored.model_dump_json()
    counted = fleet_wide and server.name not in settings.agent_tokens
    async with request.app[GPU_CLAIMS]:  # the check and the write are one step for other registrations
        conflict = await claimed_elsewhere(request.app, server.name, server.gpus)
        if conflict is not None:
            return conflict
        claims = await services.store.run(
            queries.upsert_server,
            server.name,
            text,
            server.device_uuids,
            reassign=fleet_wide,
            most_servers=settings.max_servers_per_agent_token if counted else None,
            uncounted=list(settings.agent_tokens),
            origin=request.app[FLEET_INDEX].origin,
        )
        if claims.full:
            most = settings.max_servers_per_agent_token
            log.warning(
                "registration of server %s refused: %d servers registered by one token", server.name, most
            )
            return json_error(
                403,
                f"this token has registered its most servers ({most:,}, GPUBADGE_MAX_SERVERS_PER_AGENT_TOKEN);"
                " remove servers that are gone (gpubadge fleet forget NAME) or raise the setting",
            )
        if claims.refused:
            return owned_elsewhere(server.name, claims.refused)
        request.app[FLEET_INDEX].registered(stored, text)
    _log_moved(server.name, claims.reassigned)
    log.info("server %s registered with %d GPU(s)", server.name, len(server.gpus))
    body = RegisterResponse(name=server.name, heartbeat_seconds=settings.heartbeat_seconds)
    return web.json_response(body.model_dump())


_OK = b'{"ok": true}'


@ROUTES.post(
    "/api/servers/{name}/heartbeat",
    "Agent heartbeat; a `gpus` list replaces the server's GPUs",
    token=True,
    parameters=[path_parameter("name")],
    body=Model(Heartbeat, "validation"),
    body_required=False,
    responses={
        "200": json_reply(OBJECT, "ok"),
        "400": json_reply(ERROR, "invalid heartbeat"),
        **AGENT_ONLY,
        "404": json_reply(ERROR, "unknown server: register again"),
        **GPU_CLAIMED,
        **TOO_LARGE,
    },
)
async def server_heartbeat(request: web.Request) -> web.Response:
    """A heartbeat: a stamp in memory when nothing changed; the inventory is written only when the
    GPUs reported differ from the stored ones."""
    name = request.match_info["name"]
    fleet_wide = require_agent_token(request, name)
    services = services_of(request)
    settings = services.settings
    beat = await read_model(
        request,
        settings.json_limits(),
        Heartbeat,
        "heartbeat",
        empty={},
        most=(settings.max_server_bytes, "GPUBADGE_MAX_SERVER_BYTES"),
    )
    cache = request.app[FLEET_INDEX]
    if beat.gpus is None or (cache.is_live_agent(name) and cache.same_gpus(name, beat.gpus)):
        answer = await agent_heard(request.app, name)
        return answer or web.Response(body=_OK, content_type="application/json")
    async with request.app[GPU_CLAIMS]:
        conflict = await claimed_elsewhere(request.app, name, beat.gpus)
        if conflict is not None:
            return conflict
        current = cache.stored(name)
        if current is None:
            text = await services.store.run(queries.server_inventory, name)
            current = agent_server(text) if text is not None else None
        if current is None:
            return json_error(404, f"unknown server {name}; register again")
        updated = current.model_copy(update={"gpus": beat.gpus})
        text = updated.model_dump_json()
        if len(text) > settings.max_server_bytes:
            return json_error(
                413,
                f"the server's inventory would be larger than {settings.max_server_bytes:,} bytes"
                " (GPUBADGE_MAX_SERVER_BYTES)",
            )
        uuids = [device for gpu in beat.gpus for device in gpu.device_uuids]
        claims = await services.store.run(queries.replace_gpus, name, text, uuids, reassign=fleet_wide)
        if claims is None:
            return json_error(404, f"unknown server {name}; register again")
        if claims.refused:
            return owned_elsewhere(name, claims.refused)
        cache.registered(updated, text)
    _log_moved(name, claims.reassigned)
    return web.Response(body=_OK, content_type="application/json")


@ROUTES.get(
    "/api/agents/{name}/deployments",
    "Agent long poll: answers at once when a deployment needs action, else within `wait` seconds (at the server's own point of a `wait`-long cycle)",
    token=True,
    parameters=[path_parameter("name"), query("wait", "seconds to wait for work (max 60)", "number")],
    responses={
        "200": json_reply(DeploymentsResponse, "deployments to run or stop (maybe none)"),
        "400": json_reply(ERROR, "wait is not a number"),
        **AGENT_ONLY,
        "404": json_reply(ERROR, "unknown server: register again"),
        "409": json_reply(ERROR, "back from silence, but its GPUs are now reported by another server"),
    },
)
async def agent_poll(request: web.Request) -> web.Response:
    """The agent's long poll: answers at once when there is work, else at the server's own point of
    a `wait`-long cycle (`idle_poll_end`): at most `wait` seconds, exactly `wait` for a poll renewed
    at once, and polls opened together (agents back after a restart) spread over the cycle.

    At most `GPUBADGE_LONG_POLL_MAX` are held at once (each holds a connection, so a file
    descriptor); past that the answer is 503 with `Retry-After`, which the agent honours with
    jitter, so the service never runs out of descriptors for everything else.
    """
    name = request.match_info["name"]
    require_agent_token(request, name)
    services = services_of(request)
    wait = wait_param(request, MAX_POLL)
    answer = await agent_heard(request.app, name)
    if answer is not None:
        return answer
    polls = request.app[LONG_POLLS]
    if wait > 0 and not polls.admit(name):
        retry = services.settings.long_poll_retry_seconds
        refused = json_error(
            503,
            f"this service holds its most long polls ({polls.limit}, GPUBADGE_LONG_POLL_MAX);"
            f" retry in about {retry:g} s",
        )
        refused.headers["Retry-After"] = f"{math.ceil(retry)}"
        return refused
    held = wait > 0
    serial = polls.hold(name) if held else 0
    try:
        wall = time.time()
        deadline = time.monotonic() + (idle_poll_end(name, wait, wall) - wall if held else 0.0)
        while True:
            generation = polls.generation(name)
            rows = []
            if await polls.has_work(services.store, name):
                rows = await services.store.run(queries.actionable_deployments, name)
                if not rows:
                    polls.settled(name, generation)
            remaining = deadline - time.monotonic()
            if rows or remaining <= 0 or polls.closing or (held and polls.superseded(name, serial)):
                break
            await polls.wait(name, generation, remaining)
    finally:
        if held:
            polls.release(name)
    body = DeploymentsResponse(
        deployments=[Deployment.model_validate_json(row.record_json).for_agent() for row in rows]
    )
    return web.json_response(body.model_dump(mode="json"))


@ROUTES.post(
    "/api/deployments/{id}/status",
    "Agent report of a deployment's state; a terminal state frees its GPUs",
    token=True,
    parameters=[path_parameter("id")],
    body=Model(DeploymentStatus, "validation"),
    responses={
        "200": json_reply(Deployment, "recorded"),
        "400": json_reply(ERROR, "invalid status"),
        **AGENT_ONLY,
        "404": json_reply(ERROR, "unknown deployment"),
        **TOO_LARGE,
    },
)
async def deployment_status(request: web.Request) -> web.Response:
    services = services_of(request)
    deployment = await requested_deployment(request)
    require_agent_token(request, deployment.server)
    status = await read_model(request, services.settings.json_limits(), DeploymentStatus, "status")
    # Stopped while still pending, but the agent had already picked it up: record what runs
    # so the next poll tells the agent to stop it (its GPUs were freed by the stop).
    late_start = deployment.state in TERMINAL_STATES and status.state not in TERMINAL_STATES
    updated = deployment.model_copy(
        update={
            "state": status.state,
            "exit_code": status.exit_code,
            "reason": status.reason,
            "logs": status.logs if status.logs is not None else deployment.logs,
            "container_id": status.container_id or deployment.container_id,
            "updated_at": datetime.now(UTC),
        }
    )
    await services.store.run(
        queries.update_deployment,
        deployment.id,
        updated.model_dump_json(),
        state=status.state,
        release=status.state in TERMINAL_STATES,
    )
    if status.state in TERMINAL_STATES:
        request.app[FLEET_INDEX].reservations_changed()
    if late_start:
        log.info("deployment %s was stopped before the agent started it; asking it to stop", deployment.id)
        request.app[LONG_POLLS].wake([deployment.server])
    return web.json_response(updated.shown(token_holder=False))


@ROUTES.post(
    "/api/gpus/{uuid}/release",
    "Release a GPU from the server that reported it first (fleet-wide agent token): the next server to report it owns it",
    token=True,
    parameters=[path_parameter("uuid")],
    responses={
        "200": json_reply(OBJECT, "released; `server` names its owner until now"),
        **FLEET_ONLY,
        "404": json_reply(ERROR, "no server owns this GPU"),
        "409": json_reply(ERROR, "a live server reports this GPU"),
    },
)
async def release_gpu(request: web.Request) -> web.Response:
    require_fleet_token(request, "releasing a GPU")
    gpu_uuid = request.match_info["uuid"]
    app = request.app
    async with app[GPU_CLAIMS]:
        cache = app[FLEET_INDEX]
        await cache.refresh(app)
        live = cache.owners([gpu_uuid]).get(gpu_uuid)
        if live is not None:
            return json_error(
                409,
                f"GPU {gpu_uuid} is reported by live server {live}; it can be released once that server is"
                " silent (or removed from the inventory file)",
                claimed={gpu_uuid: live},
            )
        previous = await services_of(request).store.run(queries.release_gpu, gpu_uuid)
    if previous is None:
        return json_error(404, f"no server owns GPU {gpu_uuid}")
    log.warning("GPU %s released from server %s by an operator", gpu_uuid, previous)
    return web.json_response({"released": gpu_uuid, "server": previous})


@ROUTES.delete(
    "/api/servers/{name}",
    "Remove a registered server that is no longer live (fleet-wide agent token): its inventory and its GPUs' claims",
    token=True,
    parameters=[path_parameter("name")],
    responses={
        "200": json_reply(OBJECT, "removed; `released` lists its GPUs"),
        **FLEET_ONLY,
        "404": json_reply(ERROR, "no such registered server"),
        "409": json_reply(ERROR, "the server is live"),
    },
)
async def remove_server(request: web.Request) -> web.Response:
    require_fleet_token(request, "removing a server")
    name = request.match_info["name"]
    app = request.app
    services = services_of(request)
    async with app[GPU_CLAIMS]:
        cache = app[FLEET_INDEX]
        await cache.refresh(app)
        if cache.is_live_agent(name):
            return json_error(
                409,
                f"server {name} is live; stop its agent, and remove it once it is silent"
                f" ({services.settings.stale_after_seconds:g} s)",
            )
        if not await services.store.run(queries.server_records, [name]):
            return json_error(404, f"no registered server {name}")
        released = await services.store.run(queries.forget_server, name)
        cache.forgot(name)
    log.warning("server %s removed by an operator; GPU(s) released: %s", name, ", ".join(released) or "none")
    return web.json_response({"removed": name, "released": released})


def setup_routes(app: web.Application) -> None:
    ROUTES.setup(app)
