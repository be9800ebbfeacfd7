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
import math
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

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
from store import AsyncStore, GpuTaken, ServerRecord, queries
from store.events import FLEET_INVENTORY
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


class LongPolls:
    """The agents' held long polls: at most `limit` at once, each woken only for its own server.

    A new poll of a server answers its older one at once (`hold`): the agent has moved on (a dropped
    connection, a restart), and a dead poll would otherwise keep its slot until its wait ran out.
    A deployment placed (or stopped) for a server wakes that server's poll alone, so one deploy
    costs one store read, not one per waiting agent. Which servers have work is kept as a set
    (`actionable`): a poll of a server outside it reads nothing from the store. Changes made by
    other API processes arrive without a server name (PostgreSQL NOTIFY); they mark the set
    unknown, and the next look re-reads it in one query and wakes the servers in it.

    On shutdown it wakes them for good: aiohttp waits for running handlers before it exits, so
    open long polls would otherwise hold a graceful stop for up to MAX_POLL.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.refused = 0  # polls answered 503 because `limit` were held
        self.closing = False
        self._generation: dict[str, int] = {}
        self._serials: dict[str, int] = {}  # server name -> its latest poll's serial
        self._holding: dict[str, int] = {}  # server name -> its polls holding a slot
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._actionable: set[str] = set()
        self._actionable_known = False
        self._refreshing: asyncio.Task[None] | None = None

    def admit(self, name: str) -> bool:
        """Take a slot for a held poll of `name` (give it back with `release`); False when all are
        held, unless `name` already holds one, which this poll supersedes (`hold`)."""
        if self.held >= self.limit and not self._holding.get(name):
            self.refused += 1
            return False
        self.held += 1
        self._holding[name] = self._holding.get(name, 0) + 1
        return True

    def release(self, name: str) -> None:
        self.held -= 1
        left = self._holding.get(name, 0) - 1
        if left > 0:
            self._holding[name] = left
        else:
            self._holding.pop(name, None)

    def hold(self, name: str) -> int:
        """A poll of `name` starts holding: any older poll of it answers now (its agent has moved on to
        this one: after a restart or a dropped connection, a dead poll would keep its slot until its
        wait ran out). Returns this poll's serial, for `superseded`."""
        serial = self._serials.get(name, 0) + 1
        self._serials[name] = serial
        for waiter in self._waiters.pop(name, ()):
            if not waiter.done():
                waiter.set_result(None)
        return serial

    def superseded(self, name: str, serial: int) -> bool:
        return self._serials.get(name, 0) != serial

    def generation(self, name: str) -> int:
        return self._generation.get(name, 0)

    def wake(self, names: Iterable[str]) -> None:
        """These servers have work (a deployment placed or to stop): their polls answer now."""
        for name in names:
            self._generation[name] = self._generation.get(name, 0) + 1
            self._actionable.add(name)
            for waiter in self._waiters.pop(name, ()):
                if not waiter.done():
                    waiter.set_result(None)

    def changed_elsewhere(self, store: AsyncStore) -> None:
        """Another process changed deployments of servers not named: re-read who has work, wake them."""
        self._actionable_known = False
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh(store))

    async def _refresh(self, store: AsyncStore) -> None:
        with contextlib.suppress(Exception):  # a store error leaves the set unknown: the next poll retries
            await self.has_work(store, "")
        self.wake(name for name in self._actionable if name in self._waiters)

    async def has_work(self, store: AsyncStore, name: str) -> bool:
        """Whether `name` may have deployments to act on (False: certainly none)."""
        if not self._actionable_known:
            self._actionable_known = True  # set before the read: a change during it marks it unknown again
            try:
                found = await store.run(queries.actionable_servers)
            except BaseException:
                self._actionable_known = False
                raise
            self._actionable |= found
        return name in self._actionable

    def settled(self, name: str, generation: int) -> None:
        """A read found no work for `name`: drop it from the set unless it was woken since."""
        if self._generation.get(name, 0) == generation:
            self._actionable.discard(name)

    async def wait(self, name: str, generation: int, timeout: float) -> None:
        """Until `name` is woken (at once if it was since `generation`), `timeout` passes, or shutdown."""
        if self.closing or self._generation.get(name, 0) != generation:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(name, []).append(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter, timeout)
        finally:
            waiters = self._waiters.get(name)
            if waiters is not None:
                with contextlib.suppress(ValueError):
                    waiters.remove(waiter)
                if not waiters:
                    del self._waiters[name]

    async def close(self) -> None:
        self.closing = True
        for waiters in list(self._waiters.values()):
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
        self._waiters.clear()


LONG_POLLS = web.AppKey("long_polls", LongPolls)
STATIC_FLEET = web.AppKey("static_fleet", list[Server])


# ------------------------------------------------------------------ inventory


async def live_servers(app: web.Application) -> list[Server]:
    """Static servers from the inventory file plus agents heard from recently, with GPUs in use.

    An agent's last heartbeat is the later of the stored one and the one this process heard
    and has not written yet (heartbeats are written in batches, `FleetIndexCache`)."""
    services = services_of_app(app)
    cache = app[FLEET_INDEX]
    stale_before = cache.wall_now() - timedelta(seconds=services.settings.stale_after_seconds)
    reserved = await services.store.run(queries.reserved_gpus)
    servers: dict[str, Server] = {server.name: server for server in app[STATIC_FLEET]}
    for inventory, _, last_heartbeat in await services.store.run(queries.servers):
        server = Server.model_validate_json(inventory)
        seen = max(datetime.fromisoformat(last_heartbeat), cache.last_heard(server.name) or _EPOCH)
        if seen < stale_before:
            continue
        servers[server.name] = server.model_copy(update={"last_heartbeat": seen, "source": "agent"})
    result = []
    for server in servers.values():
        in_use = sorted({*server.gpus_in_use, *(gpu.uuid for gpu in server.gpus if gpu.uuid in reserved)})
        result.append(server.model_copy(update={"gpus_in_use": in_use}))
    return result


_EPOCH = datetime.fromtimestamp(0, UTC)


class _StoredFleet(NamedTuple):
    """The server table as one read found it (built in a thread)."""

    servers: dict[str, Server]  # by name, as stored (source "agent")
    texts: dict[str, str]  # by name: the stored inventory JSON
    heard: dict[str, float]  # by name: last heartbeat, seconds since the epoch
    reserved: dict[str, str]  # GPU UUID -> deployment id


class FleetIndexCache:
    """The live fleet kept in memory between requests: liveness, GPU owners and placement's index.

    Liveness lives here, not in the store: a heartbeat that changes nothing stamps the agent
    in memory (`heard`) and costs no SQL; the stamps are written to the store in one batch per
    `flush_seconds` (`flush`), so a restart or another process sees them, and never touch the
    inventory. An inventory is written only when it changed (registration, a heartbeat with
    other GPUs). The server table is read in full once (at the first query), then only when
    another process registered servers (PostgreSQL NOTIFY, at most once per timed check).

    Handlers that change the fleet say so and the change holds at once for GPU claims:
    `registered()` (a server registered or reported other GPUs) and `returned()` (heard from
    again after going stale); the index itself takes the changes, batched, at the next query.
    `reservations_changed()` (GPUs reserved or released) re-reads only the reservations and
    re-derives only the servers whose reserved GPUs changed. Agents silent for
    `stale_after_seconds` drop out on a timed check of the in-memory stamps, every
    `check_seconds` and when the first agent is due to go stale; with other processes sharing
    the store (PostgreSQL) the same check reads the stamps they wrote since the last check.
    """

    def __init__(
        self,
        check_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.check_seconds = check_seconds
        self._clock = clock
        self._wall = wall
        self.inventory_reads = 0  # full reads of the server table (tests, diagnostics)
        self.stamp_writes = 0  # batches of heartbeats written to the store
        self._index: FleetIndex | None = None
        self._full_read = True  # the next query reads the whole server table
        self._reservations_dirty = True
        self._check_at = 0.0  # clock() time of the next timed check
        self._static: dict[str, Server] | None = None  # the inventory file's servers, read once
        self._agents: dict[str, Server] = {}  # every registered agent as stored, live or not
        self._texts: dict[str, str] = {}  # agent name -> its stored inventory JSON
        self._heard: dict[str, float] = {}  # agent name -> last heard, seconds since the epoch
        self._unwritten: dict[str, float] = {}  # heartbeats heard here, not yet written
        self._live: set[str] = set()  # agents in the live fleet
        self._base: dict[str, Server] = {}  # the live fleet by name, before reservations
        self._owner: dict[str, str] = {}  # GPU UUID -> live server name
        self._reserved_gpus: dict[str, str] = {}  # GPU UUID -> deployment id, as last read
        self._reserved: dict[str, frozenset[str]] = {}  # server name -> its reserved GPU UUIDs
        self._pending: set[str] = set()  # servers whose index entry must be (re)derived
        self._stamps_read_at: float | None = None  # wall time of the last read of others' stamps

    # ---- liveness, on the loop and without I/O ------------------------------------------

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
        self._full_read = True  # agents and reservations are read by the first query

    def is_live(self, name: str) -> bool:
        """Whether `name` is in the live fleet now (a live agent or a static server)."""
        return name in self._base

    def is_live_agent(self, name: str) -> bool:
        return name in self._live

    def heard(self, name: str) -> None:
        """A live agent's heartbeat (or poll): a stamp in memory, written with the next batch."""
        now = self._wall()
        self._heard[name] = now
        self._unwritten[name] = now

    def wall_now(self) -> datetime:
        return datetime.fromtimestamp(self._wall(), UTC)

    def last_heard(self, name: str) -> datetime | None:
        seen = self._heard.get(name)
        return datetime.fromtimestamp(seen, UTC) if seen is not None else None

    def stored(self, name: str) -> Server | None:
        """The registered agent `name` as last stored (live or not), if this process knows it."""
        return self._agents.get(name)

    def same_gpus(self, name: str, gpus: Sequence[Gpu]) -> bool:
        stored = self._agents.get(name)
        return stored is not None and stored.gpus == list(gpus)

    def owners(self, uuids: Sequence[str]) -> dict[str, str]:
        """GPU UUID -> the live server that reports it (static, or an agent not yet stale).
        Current as of the last `refresh` plus every claim made since."""
        return {gpu_uuid: self._owner[gpu_uuid] for gpu_uuid in uuids if gpu_uuid in self._owner}

    def registered(self, server: Server, text: str) -> None:
        """`server` registered (or reported other GPUs) and was stored as `text`: live at once."""
        self._agents[server.name] = server
        self._texts[server.name] = text
        self._heard[server.name] = self._wall()
        self._enter(server.name, server)

    def returned(self, name: str) -> None:
        """A stored agent heard from again after going stale (its GPUs were checked): live at once."""
        self.heard(name)
        self._enter(name, self._agents[name])

    def learned(self, server: Server, text: str, last_heartbeat: str) -> None:
        """A server another process registered, read from the store on its first request here."""
        self._agents[server.name] = server
        self._texts[server.name] = text
        heard = datetime.fromisoformat(last_heartbeat).timestamp()
        self._heard[server.name] = max(self._heard.get(server.name, 0.0), heard)

    def _enter(self, name: str, server: Server) -> None:
        previous = self._base.get(name)
        if previous is not None:
            for gpu in previous.gpus:
                if self._owner.get(gpu.uuid) == name:
                    del self._owner[gpu.uuid]
        self._live.add(name)
        self._base[name] = server
        self._owner.update((gpu.uuid, name) for gpu in server.gpus)
        self._pending.add(name)

    def _leave(self, name: str) -> None:
        """`name` went stale: out of the live fleet (back to the file's entry if it has one)."""
        self._live.discard(name)
        previous = self._base.pop(name, None)
        if previous is not None:
            for gpu in previous.gpus:
                if self._owner.get(gpu.uuid) == name:
                    del self._owner[gpu.uuid]
        static = (self._static or {}).get(name)
        if static is not None:
            self._base[name] = static
            self._owner.update((gpu.uuid, name) for gpu in static.gpus)
        self._pending.add(name)

    def reservations_changed(self) -> None:
        self._reservations_dirty = True

    def inventory_changed_elsewhere(self) -> None:
        """Another process registered servers: the next timed check reads the server table."""
        self._full_read = True

    # ---- reading the store ------------------------------------------------------------------

    async def refresh(self, app: web.Application) -> None:
        """Bring liveness, owners and reservations up to date (cheap when nothing is due)."""
        now = self._clock()
        store = services_of_app(app).store
        if self._index is None or (self._full_read and (self.inventory_reads == 0 or now >= self._check_at)):
            await self._read_all(app, store)
            self._check_at = 0.0  # the stale check below runs on what was just read
        if now >= self._check_at:
            await self._timed_check(app, store, now)
        if self._reservations_dirty:
            self._reservations_dirty = False
            self._reserved_gpus = await store.run(queries.reserved_gpus)
            self._apply_reservations(())

    async def index(self, app: web.Application) -> FleetIndex:
        """The live fleet indexed for `decide`, with every change heard so far."""
        await self.refresh(app)
        if self._pending:
            pending, self._pending = self._pending, set()
            assert self._index is not None
            self._index.remove([name for name in pending if name not in self._base])
            self._apply_reservations([name for name in pending if name in self._base])
        assert self._index is not None
        return self._index

    async def _read_all(self, app: web.Application, store: AsyncStore) -> None:
        if self._static is None or self._index is None:
            self.prime(app[STATIC_FLEET])
        self.inventory_reads += 1
        self._full_read = False
        self._reservations_dirty = False
        known = dict(self._texts)
        rows, reserved = await store.run(queries.servers), await store.run(queries.reserved_gpus)
        # Parsing 10,000 inventories and their stamps is the costly part: a thread does it, and
        # only for inventories that changed; the fleet itself changes here, on the loop, in one step.
        read = await asyncio.to_thread(_read_fleet, rows, reserved, known, dict(self._agents))
        changed = []
        for name, server in read.servers.items():
            if self._agents.get(name) is not server and name in self._live:
                changed.append(name)  # its inventory changed, through another process
            self._agents[name] = server
            self._texts[name] = read.texts[name]
            self._heard[name] = max(self._heard.get(name, 0.0), read.heard[name])
        self._reserved_gpus = read.reserved
        self._reservations_dirty = True  # applied once the index has every server
        for name in changed:
            self._enter(name, self._agents[name])

    async def _timed_check(self, app: web.Application, store: AsyncStore, now: float) -> None:
        settings = services_of_app(app).settings
        wall = self._wall()
        if store.events.cross_process:
            # Other processes' agents: the stamps they wrote since the last check (with the time
            # a batch may take to be written), and any server they registered meanwhile.
            margin = settings.heartbeat_flush_seconds + 2 * self.check_seconds + 1.0
            since = None if self._stamps_read_at is None else self._stamps_read_at - margin
            self._stamps_read_at = wall
            stamps = await store.run(
                queries.heartbeats, datetime.fromtimestamp(since, UTC) if since is not None else None
            )
            unknown = []
            for name, stamp in stamps:
                heard = datetime.fromisoformat(stamp).timestamp()
                if heard > self._heard.get(name, 0.0):
                    self._heard[name] = heard
                if name not in self._agents:
                    unknown.append(name)
            if unknown:
                for record in await store.run(queries.server_records, unknown):
                    server = await asyncio.to_thread(_agent_server, record.inventory_json)
                    self.learned(server, record.inventory_json, record.last_heartbeat)
        cutoff = wall - settings.stale_after_seconds
        first_due = None
        for name in list(self._live):
            heard = self._heard.get(name, 0.0)
            if heard < cutoff:
                self._leave(name)
            elif first_due is None or heard < first_due:
                first_due = heard
        for name, server in self._agents.items():  # back through another process (it checked the GPUs)
            if name not in self._live and self._heard.get(name, 0.0) >= cutoff:
                self._enter(name, server)
        self._check_at = now + self.check_seconds
        if first_due is not None:
            due = first_due + settings.stale_after_seconds - wall
            self._check_at = min(self._check_at, now + max(due, 0.0))

    def _apply_reservations(self, changed: Sequence[str]) -> None:
        """Apply the reserved GPUs; re-derive the servers in `changed` and those whose reservations moved."""
        reserved: dict[str, set[str]] = {}
        for gpu_uuid in self._reserved_gpus:
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
            server = self._base.get(name)
            if server is None:
                continue
            taken = now_reserved.get(name)
            if taken:
                server = server.model_copy(update={"gpus_in_use": sorted({*server.gpus_in_use, *taken})})
            placed.append(server)
        assert self._index is not None
        self._index.update(placed)

    async def flush(self, store: AsyncStore) -> int:
        """Write the heartbeats heard since the last flush in one batch; how many were written."""
        if not self._unwritten:
            return 0
        batch, self._unwritten = self._unwritten, {}
        try:
            await store.run(queries.stamp_heartbeats, batch)  # converted and written in the store's thread
        except BaseException:
            for name, heard in batch.items():  # kept for the next batch
                self._unwritten.setdefault(name, heard)
            raise
        self.stamp_writes += 1
        return len(batch)


def _agent_server(text: str) -> Server:
    return Server.model_validate_json(text).model_copy(update={"source": "agent"})


def _read_fleet(
    rows: Sequence[ServerRecord],
    reserved: dict[str, str],
    known: Mapping[str, str],
    agents: Mapping[str, Server],
) -> _StoredFleet:
    """The server table's rows parsed (run in a thread): unchanged inventories keep their objects."""
    servers: dict[str, Server] = {}
    texts: dict[str, str] = {}
    heard: dict[str, float] = {}
    by_text = {text: agents[name] for name, text in known.items() if name in agents}
    for inventory, _, last_heartbeat in rows:
        server = by_text.get(inventory) or _agent_server(inventory)
        servers[server.name] = server
        texts[server.name] = inventory
        heard[server.name] = datetime.fromisoformat(last_heartbeat).timestamp()
    return _StoredFleet(servers, texts, heard, reserved)


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
    cache = app[FLEET_INDEX]
    await cache.refresh(app)
    owners = cache.owners([gpu.uuid for gpu in gpus])
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
            cache.learned(_agent_server(record.inventory_json), record.inventory_json, record.last_heartbeat)
        stored = cache.stored(name)
        assert stored is not None
        conflict = await claimed_elsewhere(app, name, stored.gpus)
        if conflict is not None:
            return conflict
        cache.returned(name)
    return None


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
    text = stored.model_dump_json()
    async with request.app[GPU_CLAIMS]:  # the check and the write are one step for other registrations
        conflict = await claimed_elsewhere(request.app, server.name, server.gpus)
        if conflict is not None:
            return conflict
        await services.store.run(queries.upsert_server, server.name, text)
        request.app[FLEET_INDEX].registered(stored, text)
    log.info("server %s registered with %d GPU(s)", server.name, len(server.gpus))
    body = RegisterResponse(name=server.name, heartbeat_seconds=services.settings.heartbeat_seconds)
    return web.json_response(body.model_dump())


_OK = b'{"ok": true}'


async def server_heartbeat(request: web.Request) -> web.Response:
    """A heartbeat: a stamp in memory when nothing changed; the inventory is written only when the
    GPUs reported differ from the stored ones."""
    name = request.match_info["name"]
    require_agent_token(request, name)
    services = services_of(request)
    data = await read_json(request, services.settings.json_limits(), empty={})
    try:
        beat = Heartbeat.model_validate(data)
    except ValidationError as exc:
        return json_error(400, f"invalid heartbeat: {_first_error(exc)}")
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
            current = _agent_server(text) if text is not None else None
        if current is None:
            return json_error(404, f"unknown server {name}; register again")
        updated = current.model_copy(update={"gpus": beat.gpus})
        text = updated.model_dump_json()
        if not await services.store.run(queries.heartbeat, name, text):
            return json_error(404, f"unknown server {name}; register again")
        cache.registered(updated, text)
    return web.Response(body=_OK, content_type="application/json")


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
    request.app[LONG_POLLS].wake([deployment.server])
    return web.json_response(deployment.shown(reveal), status=202)


async def agent_poll(request: web.Request) -> web.Response:
    """The agent's long poll: answers at once when there is work, else after `wait` seconds.

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
        deadline = time.monotonic() + wait
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
        request.app[LONG_POLLS].wake([deployment.server])
    return web.json_response(updated.shown(token_holder=False))


HEARTBEAT_WRITER = web.AppKey("heartbeat_writer", asyncio.Task[None])


async def _write_heartbeats(app: web.Application) -> None:
    """Every `heartbeat_flush_seconds`: the heartbeats heard since, in one store write."""
    services = services_of_app(app)
    while True:
        await asyncio.sleep(services.settings.heartbeat_flush_seconds)
        try:
            await app[FLEET_INDEX].flush(services.store)
        except Exception as exc:  # the store is down: the stamps wait for the next batch
            log.warning("could not write agents' heartbeats (kept for the next batch): %s", exc)


async def _start_heartbeat_writer(app: web.Application) -> None:
    app[HEARTBEAT_WRITER] = asyncio.get_running_loop().create_task(_write_heartbeats(app))


async def _end_long_polls(app: web.Application) -> None:
    """Shutdown: open long polls answer now, and the last heartbeats heard are written."""
    await app[LONG_POLLS].close()
    writer = app.get(HEARTBEAT_WRITER)
    if writer is not None:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
    try:
        await app[FLEET_INDEX].flush(services_of_app(app).store)
    except Exception as exc:
        log.warning("could not write the last heartbeats on shutdown: %s", exc)


def _follow_other_replicas(app: web.Application) -> None:
    """On PostgreSQL, what other API replicas change reaches this one: deploys and stops make its
    placement index re-read the reservations and wake the long polls of the servers with work;
    registrations make the next timed check read the server table."""

    def changed(kind: str) -> None:
        index = app[FLEET_INDEX]
        if kind == FLEET_INVENTORY:
            index.inventory_changed_elsewhere()
            index.reservations_changed()  # a resync arrives as an inventory change: re-read both
        else:
            index.reservations_changed()
        app[LONG_POLLS].changed_elsewhere(services_of_app(app).store)

    services_of_app(app).store.events.on_fleet(changed)


def setup_routes(app: web.Application) -> None:
    settings = services_of_app(app).settings
    app[LONG_POLLS] = LongPolls(settings.long_poll_max)
    app[FLEET_INDEX] = FleetIndexCache()
    app[GPU_CLAIMS] = asyncio.Lock()
    app.on_startup.append(_start_heartbeat_writer)
    app.on_shutdown.append(_end_long_polls)
    _follow_other_replicas(app)
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
