"""Servers, eligibility and deployments: the HTTP side of placement and of the node agents.

The decision itself is placement's pure `decide`; this module only gathers its
inputs (the image report, the request, the live inventory) and acts on its
answer. Reserving GPUs is one store transaction whose primary key on the GPU
UUID makes double-booking impossible; a deploy that loses that race decides
again on the fresh inventory.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from placement.answer import ANSWER_FIELDS, AnswerBody, AnswerOptions, answer, decode_cursor
from placement.decide import decide
from placement.decision import Decision
from placement.exports import FORMATS, export_constraints, known_gpus
from placement.image_facts import ImageFacts
from placement.index import FleetIndex
from placement.inventory import Gpu, Server, parse_inventory
from placement.protocol import (
    TERMINAL_STATES,
    AgentDeployment,
    DeploymentsResponse,
    DeploymentState,
    DeploymentStatus,
    Heartbeat,
    RegisterResponse,
)
from placement.request import DeployRequest
from scanner.models import ImageReport
from scanner.registry.reference import ReferenceError, parse_reference
from store import GpuTaken, ServerRecord, queries
from web.api import find_report, require_api_token, wait_param
from web.errors import json_error, json_http_error, read_json
from web.security import REDACTED, bearer_token, holds_api_token, mask_values, token_matches
from web.state import Services, services_of, services_of_app

log = logging.getLogger(__name__)

MAX_POLL = 60.0
RESERVE_ATTEMPTS = 5


class Deployment(BaseModel):
    """A deployment as the API shows it (`GET /api/deployments/{id}`)."""

    id: str
    image: str
    digest: str
    platform: str
    server: str
    gpus: list[str] = Field(default_factory=list)
    gpu_required: bool = False
    driver_capabilities: str | None = None
    inferred_cuda: bool = False
    command: list[str] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    state: DeploymentState = "pending"
    desired: str = "run"
    exit_code: int | None = None
    reason: str | None = None
    logs: str | None = None
    container_id: str | None = None
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    updated_at: datetime = Field(default_factory=lambda: datetime.now(UTC))

    def shown(self, token_holder: bool) -> dict[str, Any]:
        """The API's JSON. `env` values and the container's output only for API token holders:
        both may carry the workload's secrets (a program that prints its configuration)."""
        body = self.model_dump(mode="json")
        if not token_holder:
            body["env"] = mask_values(self.env)
            if self.logs:
                body["logs"] = REDACTED
        return body

    def for_agent(self) -> AgentDeployment:
        return AgentDeployment(
            id=self.id,
            image=self.image,
            digest=self.digest,
            gpu_required=self.gpu_required,
            gpus=self.gpus,
            driver_capabilities=self.driver_capabilities,
            inferred_cuda=self.inferred_cuda,
            command=self.command,
            env=self.env,
            desired="stop" if self.desired == "stop" else "run",
            state=self.state,
        )


class FleetEvents:
    """Wakes long-polling agents when a deployment for them appears or must stop.

    On shutdown it wakes them for good: aiohttp waits for running handlers before it
    exits, so open long polls would otherwise hold a graceful stop for up to MAX_POLL.
    """

    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self.closing = False

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def close(self) -> None:
        self.closing = True
        await self.notify()

    async def wait(self, timeout: float) -> None:
        async with self._changed:
            if self.closing:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)


FLEET_EVENTS = web.AppKey("fleet_events", FleetEvents)
STATIC_FLEET = web.AppKey("static_fleet", list[Server])


# ------------------------------------------------------------------ inventory


async def live_servers(app: web.Application) -> list[Server]:
    """Static servers from the inventory file plus agents heard from recently, with GPUs in use."""
    services = services_of_app(app)
    stale_before = datetime.now(UTC) - timedelta(seconds=services.settings.stale_after_seconds)
    reserved = await services.store.run(queries.reserved_gpus)
    servers: dict[str, Server] = {server.name: server for server in app[STATIC_FLEET]}
    for inventory, _, last_heartbeat in await services.store.run(queries.servers):
        server = Server.model_validate_json(inventory)
        seen = datetime.fromisoformat(last_heartbeat)
        if seen < stale_before:
            continue
        servers[server.name] = server.model_copy(update={"last_heartbeat": seen, "source": "agent"})
    result = []
    for server in servers.values():
        in_use = sorted({*server.gpus_in_use, *(gpu.uuid for gpu in server.gpus if gpu.uuid in reserved)})
        result.append(server.model_copy(update={"gpus_in_use": in_use}))
    return result


class FleetIndexCache:
    """The placement index kept between requests, so a query costs `decide`, not a fleet rebuild.

    Building the live server list and its index per request costs ~0.5 s at 10,000 servers;
    the query itself a few ms. Handlers that change the fleet say so: `claimed()` (a server
    registered, reported new GPUs, or came back after going silent) makes the next query re-read
    the servers (parsing only inventories whose JSON changed), and its GPU claims hold at once for
    the next registration's check (`owners`), which never forces a re-read itself;
    `reservations_changed()` (GPUs reserved or released) re-reads only the reservations and
    re-derives only the servers whose reserved GPUs changed. Agents that go silent drop out on a
    timed check, every `check_seconds` and when the first agent is due to go stale; the same
    check picks up changes made by another process sharing the store.
    """

    def __init__(self, check_seconds: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.check_seconds = check_seconds
        self._clock = clock
        self.inventory_reads = 0  # full re-reads of the server table (tests, diagnostics)
        self._index: FleetIndex | None = None
        self._inventory_dirty = True
        self._reservations_dirty = True
        self._check_at = 0.0  # clock() time of the next timed check
        self._parsed: dict[str, Server] = {}  # stored inventory JSON -> parsed agent server
        self._base: dict[str, Server] = {}  # live servers by name, before reservations
        self._owner: dict[str, str] = {}  # GPU UUID -> server name
        self._reserved: dict[str, frozenset[str]] = {}  # server name -> its reserved GPU UUIDs
        self._static: dict[str, Server] | None = None  # the inventory file's servers, read once
        self._agents: set[str] = set()  # live agents' names at the last read
        # Claims made since the last read of the server table (registrations, GPU reports, servers
        # back from silence): they hold at once, without a re-read per registration.
        self._recent_owner: dict[str, str] = {}  # GPU UUID -> server name
        self._recent_live: set[str] = set()  # server names

    def prime(self, static: list[Server]) -> None:
        """Index the inventory file's servers at start-up, before the first query needs them.

        Built before the service freezes its start-up heap (web.app), the index of a large fleet
        stays out of the cyclic collector's full passes, which would otherwise land in queries.
        """
        self._static = {server.name: server for server in static}
        self._base = dict(self._static)
        for name, server in self._static.items():
            self._owner.update((gpu.uuid, name) for gpu in server.gpus)
        self._index = FleetIndex.build(static)
        self._inventory_dirty = True  # agents and reservations are read by the first query

    def reservations_changed(self) -> None:
        self._reservations_dirty = True

    def claimed(self, name: str, gpus: Sequence[Gpu]) -> None:
        """`name` is live and reports `gpus` (it registered, reported GPUs or came back): holds at once."""
        self._inventory_dirty = True
        self._recent_live.add(name)
        self._recent_owner.update((gpu.uuid, name) for gpu in gpus)

    async def owners(self, app: web.Application, uuids: Sequence[str]) -> dict[str, str]:
        """GPU UUID -> the live server that reports it (static, or an agent not yet stale)."""
        await self._current(app)
        found = {}
        for gpu_uuid in uuids:
            owner = self._recent_owner.get(gpu_uuid) or self._owner.get(gpu_uuid)
            if owner is not None:
                found[gpu_uuid] = owner
        return found

    async def is_live(self, app: web.Application, name: str) -> bool:
        """Whether `name` is in the live fleet now (an agent not yet stale, or a static server)."""
        await self._current(app)
        return name in self._base or name in self._recent_live

    async def _current(self, app: web.Application) -> None:
        """Re-read the servers when agents may have gone stale, but not for registrations alone:
        those are in the recent claims, and a burst of N must not cost N reads of the whole table."""
        if self._index is None or self._clock() >= self._check_at:
            await self.index(app)

    def heard_from(self, name: str) -> None:
        """An agent heartbeat: only news when the index does not hold it (new, or back from silence)."""
        if name not in self._base:
            self._inventory_dirty = True
            self._recent_live.add(name)

    async def index(self, app: web.Application) -> FleetIndex:
        now = self._clock()
        store = services_of_app(app).store
        if self._index is None or self._inventory_dirty or now >= self._check_at:
            self._inventory_dirty = False
            # Claims made before this read are committed, so the read has them; later ones stay.
            self._recent_owner.clear()
            self._recent_live.clear()
            servers, reserved = await store.run(queries.servers), await store.run(queries.reserved_gpus)
            # Parsing inventories is the costly part (10,000 agents at start-up): a thread does it;
            # the index itself changes here, on the loop, in one step.
            unseen = [row.inventory_json for row in servers if row.inventory_json not in self._parsed]
            fresh = await asyncio.to_thread(_parse_inventories, unseen) if unseen else {}
            self._read_inventory(app, now, servers, reserved, fresh)
        elif self._reservations_dirty:
            self._reservations_dirty = False
            self._apply_reservations(await store.run(queries.reserved_gpus), ())
        assert self._index is not None
        return self._index

    def _read_inventory(
        self,
        app: web.Application,
        now: float,
        rows: Sequence[ServerRecord],
        reserved: Mapping[str, str],
        fresh: Mapping[str, Server],
    ) -> None:
        services = services_of_app(app)
        self.inventory_reads += 1
        stale_after = timedelta(seconds=services.settings.stale_after_seconds)
        wall = datetime.now(UTC)
        if self._static is None:
            self._static = {server.name: server for server in app[STATIC_FLEET]}
        base = dict(self._static)  # the file's servers are parsed once; agents win over them
        agents: set[str] = set()
        parsed: dict[str, Server] = {}
        first_seen: datetime | None = None
        for inventory, _, last_heartbeat in rows:
            seen = datetime.fromisoformat(last_heartbeat)
            if seen < wall - stale_after:
                continue
            server = self._parsed.get(inventory)
            if server is None:  # heartbeat times are not kept current here: placement ignores them
                parsed_now = fresh.get(inventory) or Server.model_validate_json(inventory)
                server = parsed_now.model_copy(update={"last_heartbeat": seen, "source": "agent"})
            parsed[inventory] = base[server.name] = server
            agents.add(server.name)
            first_seen = seen if first_seen is None else min(first_seen, seen)
        self._parsed = parsed
        self._check_at = now + self.check_seconds
        if first_seen is not None:
            due = (first_seen + stale_after - wall).total_seconds()
            self._check_at = min(self._check_at, now + max(due, 0.0))
        previous, self._base = self._base, base
        # Only agents come and go or change: the file's servers are the same objects every time.
        previous_agents, self._agents = self._agents, agents
        candidates = base.keys() if not previous else agents | previous_agents
        changed = [name for name in candidates if name in base and previous.get(name) is not base[name]]
        gone = [name for name in previous_agents if name not in base]
        for name in (*changed, *gone):
            if name in previous:
                for gpu in previous[name].gpus:
                    if self._owner.get(gpu.uuid) == name:
                        del self._owner[gpu.uuid]
        for name in changed:
            self._owner.update((gpu.uuid, name) for gpu in base[name].gpus)
        for name in gone:
            self._reserved.pop(name, None)
        if self._index is None:
            self._index = FleetIndex()
        self._index.remove(gone)
        self._apply_reservations(reserved, changed)

    def _apply_reservations(self, reserved_gpus: Mapping[str, str], changed: Sequence[str]) -> None:
        """Apply reserved GPUs; re-derive the servers in `changed` and those whose reservations moved."""
        reserved: dict[str, set[str]] = {}
        for gpu_uuid in reserved_gpus:
            owner = self._owner.get(gpu_uuid)
            if owner is not None:
                reserved.setdefault(owner, set()).add(gpu_uuid)
        now_reserved = {name: frozenset(uuids) for name, uuids in reserved.items()}
        moved = {
            name
            for name in now_reserved.keys() | self._reserved.keys()
            if now_reserved.get(name) != self._reserved.get(name)
        }
        self._reserved = now_reserved
        placed = []
        for name in moved.union(changed):
            server = self._base[name]
            taken = now_reserved.get(name)
            if taken:
                server = server.model_copy(update={"gpus_in_use": sorted({*server.gpus_in_use, *taken})})
            placed.append(server)
        assert self._index is not None
        self._index.update(placed)


def _parse_inventories(documents: Sequence[str]) -> dict[str, Server]:
    """Stored inventory documents parsed, keyed by their text (run in a thread)."""
    return {document: Server.model_validate_json(document) for document in documents}


FLEET_INDEX = web.AppKey("fleet_index", FleetIndexCache)
GPU_CLAIMS = web.AppKey("gpu_claims", asyncio.Lock)


async def fleet_index(app: web.Application) -> FleetIndex:
    """The live fleet, indexed for `decide`: what `live_servers` lists, kept between requests."""
    return await app[FLEET_INDEX].index(app)


def require_agent_token(request: web.Request, server_name: str) -> None:
    """Agents present GPUBADGE_AGENT_TOKEN (any server), or the per-agent token of `server_name`.

    A per-agent token is bound to its server: presented for another server it gets 403, so one
    compromised node cannot register, heartbeat, poll or report as its neighbours.
    """
    settings = services_of(request).settings
    if settings.agent_token is None and not settings.agent_tokens:
        return  # no agent token configured: open (logged at startup)
    given = (bearer_token(request) or "").encode()
    fleet_wide = settings.agent_token is not None and hmac.compare_digest(
        given, settings.agent_token.get_secret_value().encode()
    )
    owner = None
    for name, token in settings.agent_tokens.items():  # every comparison runs, whichever matches
        if hmac.compare_digest(given, token.get_secret_value().encode()):
            owner = name
    if fleet_wide or owner == server_name:
        return
    if owner is not None:
        log.warning("agent token of server %s used for server %s: refused", owner, server_name)
        raise json_http_error(
            web.HTTPForbidden, f"this agent token belongs to server {owner}; it cannot act for {server_name}"
        )
    raise json_http_error(
        web.HTTPUnauthorized,
        "a valid agent token is required (Authorization: Bearer <token>)",
        headers={"WWW-Authenticate": 'Bearer realm="gpubadge"'},
    )


async def claimed_elsewhere(app: web.Application, name: str, gpus: Sequence[Gpu]) -> web.Response | None:
    """A 409 when a live server other than `name` reports one of these GPU UUIDs, else None.

    The same UUID on two servers is a cloned inventory or an impostor; either way placement must
    not hand that GPU out twice. The claim lapses once its server goes stale.
    """
    owners = await app[FLEET_INDEX].owners(app, [gpu.uuid for gpu in gpus])
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
    stale_after = services_of_app(app).settings.stale_after_seconds
    return json_error(
        409,
        f"GPU {', '.join(sorted(taken))} is already reported by live server {', '.join(holders)};"
        f" it is released {stale_after:g} s after that server's last heartbeat",
        claimed=taken,
    )


async def returning_conflict(app: web.Application, name: str) -> web.Response | None:
    """For a server heard from again after going stale: a 409 if its GPUs were claimed meanwhile."""
    if await app[FLEET_INDEX].is_live(app, name):
        return None
    stored = await services_of_app(app).store.run(queries.server_inventory, name)
    if stored is None:
        return None
    gpus = Server.model_validate_json(stored).gpus
    conflict = await claimed_elsewhere(app, name, gpus)
    if conflict is None:
        app[FLEET_INDEX].claimed(name, gpus)
    return conflict


async def list_servers(request: web.Request) -> web.Response:
    servers = await live_servers(request.app)
    return web.json_response({"servers": [server.model_dump(mode="json") for server in servers]})


async def register_server(request: web.Request) -> web.Response:
    services = services_of(request)
    data = await read_json(request, services.settings.json_limits())
    try:
        server = Server.model_validate(data)
    except ValidationError as exc:
        return json_error(400, f"invalid server: {_first_error(exc)}")
    require_agent_token(request, server.name)
    stored = server.model_copy(update={"source": "agent", "gpus_in_use": [], "last_heartbeat": None})
    async with request.app[GPU_CLAIMS]:  # the check and the write are one step for other registrations
        conflict = await claimed_elsewhere(request.app, server.name, server.gpus)
        if conflict is not None:
            return conflict
        await services.store.run(queries.upsert_server, server.name, stored.model_dump_json())
        request.app[FLEET_INDEX].claimed(server.name, server.gpus)
    log.info("server %s registered with %d GPU(s)", server.name, len(server.gpus))
    body = RegisterResponse(name=server.name, heartbeat_seconds=services.settings.heartbeat_seconds)
    return web.json_response(body.model_dump())


async def server_heartbeat(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    require_agent_token(request, name)
    services = services_of(request)
    data = await read_json(request, services.settings.json_limits(), empty={})
    try:
        beat = Heartbeat.model_validate(data)
    except ValidationError as exc:
        return json_error(400, f"invalid heartbeat: {_first_error(exc)}")
    async with request.app[GPU_CLAIMS]:
        inventory = None
        if beat.gpus is None:
            conflict = await returning_conflict(request.app, name)
            if conflict is not None:
                return conflict
        else:
            conflict = await claimed_elsewhere(request.app, name, beat.gpus)
            if conflict is not None:
                return conflict
            current = await services.store.run(queries.server_inventory, name)
            if current is not None:
                inventory = (
                    Server.model_validate_json(current)
                    .model_copy(update={"gpus": beat.gpus})
                    .model_dump_json()
                )
        if not await services.store.run(queries.heartbeat, name, inventory):
            return json_error(404, f"unknown server {name}; register again")
        if inventory is not None and beat.gpus is not None:
            request.app[FLEET_INDEX].claimed(name, beat.gpus)
        else:
            request.app[FLEET_INDEX].heard_from(name)
    return web.json_response({"ok": True})


# ---------------------------------------------------------------- eligibility


class RunSpec(BaseModel):
    """What to run in the container, beside the image's own defaults (deployments only)."""

    model_config = ConfigDict(extra="forbid")

    command: list[str] | None = Field(default=None, description="replaces the image's CMD")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables")

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not _ENV_NAME.match(name):
                raise ValueError(f"invalid environment variable name {name!r}")
            if name == "NVIDIA_VISIBLE_DEVICES":
                raise ValueError(
                    "NVIDIA_VISIBLE_DEVICES is set to the reserved GPUs and cannot be overridden"
                )
        return env


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RUN_FIELDS = ("command", "env")


async def _request_body(
    request: web.Request, *, run_fields: bool = False, other_fields: Sequence[str] = ()
) -> tuple[str, DeployRequest, RunSpec, dict[str, Any]]:
    """Split `{"image", ...request}` (plus `command`/`env` for deployments) into checked parts.

    `other_fields` (e.g. `limit`, `format`) are taken out of the body unchecked, for the caller.
    """
    data: Any = await read_json(request, services_of(request).settings.json_limits())
    if not isinstance(data, dict) or not isinstance(data.get("image"), str):
        raise json_http_error(web.HTTPBadRequest, 'expected {"image": REF, ...request}')
    image = data.pop("image")
    run_data = {key: data.pop(key) for key in RUN_FIELDS if run_fields and key in data}
    others = {key: data.pop(key) for key in other_fields if key in data}
    try:
        return image, DeployRequest.parse_any(data), RunSpec.model_validate(run_data), others
    except (ValidationError, ValueError) as exc:
        detail = _first_error(exc) if isinstance(exc, ValidationError) else str(exc)
        raise json_http_error(web.HTTPBadRequest, f"invalid request: {detail}") from None


def _first_error(exc: ValidationError) -> str:
    error = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in error.get("loc", ()))
    return f"{where}: {error['msg']}" if where else str(error["msg"])


async def image_report(services: Services, text: str, *, may_scan: bool = True) -> ImageReport:
    """The stored report for `text`, scanning it now if it was never scanned and `may_scan`.

    A scan costs registry traffic and a worker's time, so a caller without the API token
    (`may_scan=False`) gets a 404 that says how to ask for the scan instead.
    """
    try:
        reference = parse_reference(text)
    except ReferenceError as exc:
        raise json_http_error(web.HTTPBadRequest, str(exc)) from None
    report = await find_report(services, reference)
    if report is not None:
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
    report = await services.scanner.scan(str(reference))
    if report.error:
        raise json_http_error(web.HTTPUnprocessableEntity, f"could not scan {reference}: {report.error}")
    return report


def answer_options(request: web.Request, fields: dict[str, Any]) -> AnswerOptions:
    """`limit`, `cursor`, `explain` from the body, else the query string; 400 when out of bounds."""
    data: dict[str, Any] = {key: request.query[key] for key in ANSWER_FIELDS if key in request.query}
    data.update(fields)
    try:
        options = AnswerOptions.model_validate(data)
        if options.cursor is not None:
            decode_cursor(options.cursor)
    except ValidationError as exc:
        raise json_http_error(web.HTTPBadRequest, f"invalid request: {_first_error(exc)}") from None
    except ValueError as exc:
        raise json_http_error(web.HTTPBadRequest, f"invalid request: cursor: {exc}") from None
    most = services_of(request).settings.eligibility_max_limit
    if options.limit > most:
        raise json_http_error(web.HTTPBadRequest, f"invalid request: limit: at most {most}")
    return options


def eligibility_answer(
    report: ImageReport, deploy: DeployRequest, index: FleetIndex, options: AnswerOptions
) -> AnswerBody:
    """decide + answer: pure and CPU-only, run in a worker thread by the handlers."""
    return answer(decide(ImageFacts.from_report(report), deploy, index), options)


async def eligibility(request: web.Request) -> web.Response:
    services = services_of(request)
    image, deploy, _, fields = await _request_body(request, other_fields=ANSWER_FIELDS)
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
    image, deploy, _, fields = await _request_body(request, other_fields=("format",))
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


# ---------------------------------------------------------------- deployments


async def _load(services: Services, deployment_id: str) -> Deployment | None:
    row = await services.store.run(queries.deployment, deployment_id)
    return Deployment.model_validate_json(row.record_json) if row else None


async def create_deployment(request: web.Request) -> web.Response:
    require_api_token(request)
    services = services_of(request)
    image, deploy, run, _ = await _request_body(request, run_fields=True)
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
            await services.store.run(
                services.store.backend.create_deployment,
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
        await request.app[FLEET_EVENTS].notify()
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


async def get_deployment(request: web.Request) -> web.Response:
    services = services_of(request)
    deployment = await _load(services, request.match_info["id"])
    if deployment is None:
        return json_error(404, f"no deployment {request.match_info['id']}")
    return web.json_response(deployment.shown(holds_api_token(request, services.settings.api_token)))


async def list_deployments(request: web.Request) -> web.Response:
    services = services_of(request)
    reveal = holds_api_token(request, services.settings.api_token)
    rows = await services.store.run(queries.deployments, server=request.query.get("server") or None)
    return web.json_response(
        {"deployments": [Deployment.model_validate_json(row.record_json).shown(reveal) for row in rows]}
    )


async def delete_deployment(request: web.Request) -> web.Response:
    require_api_token(request)
    services = services_of(request)
    deployment = await _load(services, request.match_info["id"])
    if deployment is None:
        return json_error(404, f"no deployment {request.match_info['id']}")
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
    await request.app[FLEET_EVENTS].notify()
    return web.json_response(deployment.shown(reveal), status=202)


async def agent_poll(request: web.Request) -> web.Response:
    """The agent's long poll: answers at once when there is work, else after `wait` seconds."""
    name = request.match_info["name"]
    require_agent_token(request, name)
    services = services_of(request)
    wait = wait_param(request, MAX_POLL)
    async with request.app[GPU_CLAIMS]:
        conflict = await returning_conflict(request.app, name)
        if conflict is not None:
            return conflict
        if await services.store.run(queries.heartbeat, name):
            request.app[FLEET_INDEX].heard_from(name)
    deadline = time.monotonic() + wait
    while True:
        rows = await services.store.run(queries.actionable_deployments, name)
        remaining = deadline - time.monotonic()
        if rows or remaining <= 0 or request.app[FLEET_EVENTS].closing:
            break
        await request.app[FLEET_EVENTS].wait(remaining)
    body = DeploymentsResponse(
        deployments=[Deployment.model_validate_json(row.record_json).for_agent() for row in rows]
    )
    return web.json_response(body.model_dump(mode="json"))


async def deployment_status(request: web.Request) -> web.Response:
    services = services_of(request)
    deployment = await _load(services, request.match_info["id"])
    if deployment is None:
        return json_error(404, f"no deployment {request.match_info['id']}")
    require_agent_token(request, deployment.server)
    data = await read_json(request, services.settings.json_limits())
    try:
        status = DeploymentStatus.model_validate(data)
    except ValidationError as exc:
        return json_error(400, f"invalid status: {_first_error(exc)}")
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
        await request.app[FLEET_EVENTS].notify()
    return web.json_response(updated.shown(token_holder=False))


async def _end_long_polls(app: web.Application) -> None:
    await app[FLEET_EVENTS].close()


def _follow_other_replicas(app: web.Application) -> None:
    """On PostgreSQL, deploys and stops made through other API replicas reach this one: its
    placement index re-reads the reservations, and its long-polling agents wake."""
    index, events = app[FLEET_INDEX], app[FLEET_EVENTS]
    waking: set[asyncio.Task[None]] = set()

    def changed(kind: str) -> None:
        # Another replica's registrations reach the index on its timed check (every few seconds,
        # as the index is built to); its reservations are re-read now, and waiting agents wake.
        del kind
        index.reservations_changed()
        task = asyncio.get_running_loop().create_task(events.notify())
        waking.add(task)
        task.add_done_callback(waking.discard)

    services_of_app(app).store.events.on_fleet(changed)


def setup_routes(app: web.Application) -> None:
    app[FLEET_EVENTS] = FleetEvents()
    app[FLEET_INDEX] = FleetIndexCache()
    app[GPU_CLAIMS] = asyncio.Lock()
    app.on_shutdown.append(_end_long_polls)
    _follow_other_replicas(app)
    settings = services_of_app(app).settings
    inventory_file = settings.inventory_file
    app[STATIC_FLEET] = parse_inventory(inventory_file.read_text()).servers if inventory_file else []
    app[FLEET_INDEX].prime(app[STATIC_FLEET])
    app.router.add_get("/api/servers", list_servers)
    app.router.add_post("/api/servers", register_server)
    app.router.add_post("/api/servers/{name}/heartbeat", server_heartbeat)
    app.router.add_post("/api/eligibility", eligibility)
    app.router.add_post("/api/constraints", constraints)
    app.router.add_get("/api/deployments", list_deployments)
    app.router.add_post("/api/deployments", create_deployment)
    app.router.add_get("/api/deployments/{id}", get_deployment)
    app.router.add_delete("/api/deployments/{id}", delete_deployment)
    app.router.add_post("/api/deployments/{id}/status", deployment_status)
    app.router.add_get("/api/agents/{name}/deployments", agent_poll)
