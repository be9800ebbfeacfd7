"""The live fleet of this process: static servers plus agents heard from, indexed for placement.

`FleetIndexCache` keeps liveness (heartbeat stamps, written to the store in batches), GPU owners
and placement's `FleetIndex` in memory between requests; `install` puts it, the long polls and
the heartbeat writer on the application and follows other replicas' changes (PostgreSQL NOTIFY,
and a timed read of the heartbeats they wrote, in a task of its own: never in a request's way).
The routes of agents, eligibility, deployments, admission and the fleet pages read it from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

from aiohttp import web

from placement.index import FleetIndex
from placement.inventory import Gpu, Server, parse_inventory
from store import AsyncStore, ServerRecord, queries
from store.events import FLEET_INVENTORY, FLEET_STAMPS, wait_set
from web.fleet.long_polls import LONG_POLLS, LongPolls
from web.state import services_of_app

log = logging.getLogger(__name__)


STATIC_FLEET = web.AppKey("static_fleet", list[Server])


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
        in_use = sorted(
            {*server.gpus_in_use, *(device for device in server.device_uuids if device in reserved)}
        )
        result.append(server.model_copy(update={"gpus_in_use": in_use}))
    return result


_EPOCH = datetime.fromtimestamp(0, UTC)


class _StoredFleet(NamedTuple):
    """The server table as one read found it (built in a thread)."""

    servers: dict[str, Server]  # by name, as stored (source "agent")
    texts: dict[str, str]  # by name: the stored inventory JSON
    heard: dict[str, float]  # by name: last heartbeat, seconds since the epoch
    reserved: dict[str, str]  # GPU UUID -> deployment id


# Stamps another replica wrote are compared with this process's in chunks of this many, the
# event loop free between two: a read of a 10,000-agent fleet's stamps held it 3-5 ms in one piece.
FOLLOW_CHUNK = 1000
CATCH_UP_CHUNK = 500  # agents entered, or servers re-derived in the index, per turn of the loop


class FleetIndexCache:
    """The live fleet kept in memory between requests: liveness, GPU owners and placement's index.

    Liveness lives here, not in the store: a heartbeat that changes nothing stamps the agent
    in memory (`heard`) and costs no SQL; the stamps are written to the store in one batch per
    `flush_seconds` (`flush`), so a restart or another process sees them, and never touch the
    inventory. An inventory is written only when it changed (registration, a heartbeat with
    other GPUs). The server table is read in full once (at the first query), then only when
    another process registered servers (PostgreSQL NOTIFY, read by `follow`).

    Handlers that change the fleet say so and the change holds at once for GPU claims:
    `registered()` (a server registered or reported other GPUs) and `returned()` (heard from
    again after going stale); the index itself takes the changes, batched, at the next query.
    `reservations_changed()` (GPUs reserved or released) re-reads only the reservations and
    re-derives only the servers whose reserved GPUs changed. Agents silent for
    `stale_after_seconds` drop out on a timed check of the in-memory stamps, at most
    `check_seconds` after they are due; the check is in memory, and walks the live agents only
    once the earliest stamp among them is due. With other processes sharing the store
    (PostgreSQL), `follow`, in a task of its own (`install`), reads the stamps they wrote since
    its last read and any server they registered, when one of them says it wrote either (NOTIFY)
    and at least every two `heartbeat_flush_seconds`: that round trip never lands in a request,
    which finds its results in memory.
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
        self._owner: dict[str, str] = {}  # GPU or MIG device UUID -> live server name
        self._reserved_gpus: dict[str, str] = {}  # GPU UUID -> deployment id, as last read
        self._reserved: dict[str, frozenset[str]] = {}  # server name -> its reserved GPU UUIDs
        self._pending: set[str] = set()  # servers whose index entry must be (re)derived
        self._entering: list[str] = []  # agents back through another process, to enter (`_catch_up`)
        self._stamps_read_at: float | None = None  # wall time of the last read of others' stamps
        self._earliest_live = 0.0  # no live agent was last heard before this (wall time)
        self._maybe_back: set[str] = set()  # not live, heard from elsewhere since the last check
        self._reading = asyncio.Lock()  # one full read of the server table at a time
        self.origin = uuid.uuid4().hex[:16]  # names this process's stamp batches to the others
        self._follow_due = asyncio.Event()  # another process wrote stamps or servers since `follow`
        self.stamps_elsewhere = False  # another process sharing the store has written stamps

    # ---- liveness, on the loop and without I/O ------------------------------------------

    def prime(self, static: list[Server]) -> None:
        """Index the inventory file's servers at start-up, before the first query needs them.

        Built before the service freezes its start-up heap (web.app), the index of a large fleet
        stays out of the cyclic collector's full passes, which would otherwise land in queries.
        """
        self._static = {server.name: server for server in static}
        self._base = dict(self._static)
        for name, server in self._static.items():
            self._owner.update((device, name) for device in server.device_uuids)
        self._index = FleetIndex.build(static)
        self._full_read = True  # agents and reservations are read by the first query

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
        if server.name not in self._live:
            self._maybe_back.add(server.name)

    def forgot(self, name: str) -> None:
        """The registered agent `name` was removed from the store (an operator's `forget_server`)."""
        if name in self._live:
            self._leave(name)
        for known in (self._agents, self._texts, self._heard, self._unwritten):
            known.pop(name, None)
        self._maybe_back.discard(name)

    def _enter(self, name: str, server: Server) -> None:
        previous = self._base.get(name)
        if previous is not None:
            for device in previous.device_uuids:
                if self._owner.get(device) == name:
                    del self._owner[device]
        self._live.add(name)
        self._earliest_live = min(self._earliest_live, self._heard.get(name, 0.0))
        self._base[name] = server
        self._owner.update((device, name) for device in server.device_uuids)
        self._pending.add(name)

    def _leave(self, name: str) -> None:
        """`name` went stale: out of the live fleet (back to the file's entry if it has one)."""
        self._live.discard(name)
        previous = self._base.pop(name, None)
        if previous is not None:
            for device in previous.device_uuids:
                if self._owner.get(device) == name:
                    del self._owner[device]
        static = (self._static or {}).get(name)
        if static is not None:
            self._base[name] = static
            self._owner.update((device, name) for device in static.device_uuids)
        self._pending.add(name)

    def reservations_changed(self) -> None:
        self._reservations_dirty = True

    def inventory_changed_elsewhere(self) -> None:
        """Another process registered servers: `follow` reads the server table, now."""
        self._full_read = True
        self._follow_due.set()

    def stamps_written_elsewhere(self) -> None:
        """Another process wrote a batch of stamps (PostgreSQL NOTIFY): `follow` reads them, now."""
        self.stamps_elsewhere = True
        self._follow_due.set()

    async def follow_due(self, timeout: float) -> None:
        """Until another process wrote stamps or servers since the last `follow`, or `timeout`
        passed once another process has written stamps at all (a notification lost with the
        listener's connection is caught up that way). While this process is the only one that
        writes stamps (one `serve` on a SQLite file: its workers write none), only a notification
        ends the wait: a timed round would read back this process's own stamps, every agent's
        every round (10,000 rows a round, converted with the interpreter lock held)."""
        timed = timeout if self.stamps_elsewhere else None
        await wait_set(self._follow_due, timed)  # a cancel is never lost: shutdown ends this task
        self._follow_due.clear()

    # ---- reading the store ------------------------------------------------------------------

    async def refresh(self, app: web.Application) -> None:
        """Bring liveness, owners and reservations up to date: in memory, but for the first read of
        the server table and a re-read of the reservations after they changed."""
        now = self._clock()
        services = services_of_app(app)
        if self._index is None or self.inventory_reads == 0:
            await self._read_all(app, services.store)
        if now >= self._check_at:
            self._timed_check(services.settings.stale_after_seconds, now)
        await self._catch_up(services.settings.stale_after_seconds)
        store = services.store
        if self._reservations_dirty:
            self._reservations_dirty = False
            self._reserved_gpus = await store.run(queries.reserved_gpus)
            self._apply_reservations(())

    async def index(self, app: web.Application) -> FleetIndex:
        """The live fleet indexed for `decide`, with every change heard so far.

        Servers changed since the last call are re-derived CATCH_UP_CHUNK at a time, the loop free
        between two chunks: 10,000 agents back at once (a restart, a return from an outage) took
        ~170 ms in one step, and every request waited that long."""
        await self.refresh(app)
        while self._pending:
            pending = [self._pending.pop() for _ in range(min(CATCH_UP_CHUNK, len(self._pending)))]
            assert self._index is not None
            self._index.remove([name for name in pending if name not in self._base])
            self._apply_reservations([name for name in pending if name in self._base])
            if self._pending:
                await asyncio.sleep(0)  # requests ready meanwhile go first
        assert self._index is not None
        return self._index

    async def _catch_up(self, stale_after: float) -> None:
        """Enter the agents the timed check found back through another process (or a read of the
        store), CATCH_UP_CHUNK at a time, the loop free between two chunks: after a restart that
        is every agent (10,000 entered in one step held the loop ~145 ms)."""
        while self._entering:
            chunk = self._entering[:CATCH_UP_CHUNK]
            del self._entering[:CATCH_UP_CHUNK]
            cutoff = self._wall() - stale_after
            for name in chunk:
                server = self._agents.get(name)
                if server is not None and name not in self._live and self._heard.get(name, 0.0) >= cutoff:
                    self._enter(name, server)
            if self._entering:
                await asyncio.sleep(0)

    async def _read_all(self, app: web.Application, store: AsyncStore) -> None:
        async with self._reading:
            if self.inventory_reads > 0 and not self._full_read:
                return  # read meanwhile, by the caller this one waited for
            if self._static is None or self._index is None:
                self.prime(app[STATIC_FLEET])
            self._full_read = False
            try:
                await self._read_fleet(store)
            except BaseException:
                self._full_read = True  # read again next time
                raise
            self.inventory_reads += 1
            self._check_at = 0.0  # the next check runs on what was just read

    async def _read_fleet(self, store: AsyncStore) -> None:
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
            if name not in self._live:
                self._maybe_back.add(name)
        for name, text in known.items():  # removed through another process (not registered since)
            if name not in read.servers and self._texts.get(name) is text:
                self.forgot(name)
        self._reserved_gpus = read.reserved
        self._reservations_dirty = True  # applied once the index has every server
        for name in changed:
            self._enter(name, self._agents[name])

    async def follow(self, app: web.Application) -> None:
        """Read what other processes sharing the store wrote since the last call: the heartbeats
        they heard (written in batches, so read back over the time a batch may take) and the
        servers they registered. `install`'s task calls it on a shared store (PostgreSQL) when
        another process says it wrote stamps or servers (NOTIFY), at most every `check_seconds`;
        the round trip and the conversion run in the store's thread, the loop compares one number
        per stamp, `FOLLOW_CHUNK` stamps at a time. Nothing before the first query has read the fleet."""
        if self.inventory_reads == 0:
            return
        services = services_of_app(app)
        store, settings = services.store, services.settings
        if self._full_read:
            await self._read_all(app, store)
        wall = self._wall()
        margin = settings.heartbeat_flush_seconds + 2 * self.check_seconds + 1.0
        since = None if self._stamps_read_at is None else self._stamps_read_at - margin
        stamps = await store.run(
            queries.heartbeats,
            datetime.fromtimestamp(since, UTC) if since is not None else None,
            self.origin,  # this process's own stamps: it heard them
        )
        self._stamps_read_at = wall
        unknown = []
        for start in range(0, len(stamps), FOLLOW_CHUNK):
            if start:
                await asyncio.sleep(0)  # requests ready meanwhile go first
            for name, heard in stamps[start : start + FOLLOW_CHUNK]:
                if heard > self._heard.get(name, 0.0):
                    self._heard[name] = heard
                    if name not in self._live:
                        self._maybe_back.add(name)
                if name not in self._agents:
                    unknown.append(name)
        if unknown:
            records = await store.run(queries.server_records, unknown)
            parsed = await asyncio.to_thread(
                lambda: [agent_server(record.inventory_json) for record in records]
            )
            for server, record in zip(parsed, records, strict=True):
                self.learned(server, record.inventory_json, record.last_heartbeat)

    def _timed_check(self, stale_after: float, now: float) -> None:
        """Drop the agents silent for `stale_after` seconds; take back those heard from through
        another process. In memory; the live agents are walked only once the earliest stamp
        among them is due."""
        wall = self._wall()
        cutoff = wall - stale_after
        if cutoff > self._earliest_live:
            earliest = None
            for name in list(self._live):
                heard = self._heard.get(name, 0.0)
                if heard < cutoff:
                    self._leave(name)
                elif earliest is None or heard < earliest:
                    earliest = heard
            self._earliest_live = wall if earliest is None else earliest
        back, self._maybe_back = self._maybe_back, set()
        self._entering.extend(back)  # back through another process (it checked the GPUs): `_catch_up`
        due = self._earliest_live + stale_after - wall
        self._check_at = now + min(self.check_seconds, max(due, 0.0))

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
            # converted and written in the store's thread; the other replicas are told
            await store.run(queries.stamp_heartbeats, batch, self.origin)
        except BaseException:
            for name, heard in batch.items():  # kept for the next batch
                self._unwritten.setdefault(name, heard)
            raise
        self.stamp_writes += 1
        return len(batch)


def agent_server(text: str) -> Server:
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
        server = by_text.get(inventory) or agent_server(inventory)
        servers[server.name] = server
        texts[server.name] = inventory
        heard[server.name] = datetime.fromisoformat(last_heartbeat).timestamp()
    return _StoredFleet(servers, texts, heard, reserved)


FLEET_INDEX = web.AppKey("fleet_index", FleetIndexCache)


GPU_CLAIMS = web.AppKey("gpu_claims", asyncio.Lock)


async def fleet_index(app: web.Application) -> FleetIndex:
    """The live fleet, indexed for `decide`: what `live_servers` lists, kept between requests."""
    return await app[FLEET_INDEX].index(app)


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
    loop = asyncio.get_running_loop()
    app[HEARTBEAT_WRITER] = loop.create_task(_write_heartbeats(app))
    app[REPLICA_FOLLOWER] = loop.create_task(_read_other_replicas(app))


REPLICA_FOLLOWER = web.AppKey("replica_follower", asyncio.Task[None])


async def _read_other_replicas(app: web.Application) -> None:
    """On a store shared with other processes (PostgreSQL), what they wrote
    (`FleetIndexCache.follow`), read here so that no request waits for it: when another process
    says it wrote a batch of stamps or registered servers, at most every `check_seconds`, and at
    least every two `heartbeat_flush_seconds` (a lost notification) once another process has
    written stamps. Idle while no other process does (one `serve` on a SQLite file)."""
    services = services_of_app(app)
    store = services.store
    while True:
        cache = app[FLEET_INDEX]
        await cache.follow_due(max(cache.check_seconds, 2 * services.settings.heartbeat_flush_seconds))
        if store.events.cross_process:
            try:
                await cache.follow(app)
            except Exception as exc:  # the store is down: the next round reads from where this one began
                log.warning("could not read the other replicas' heartbeats: %s", exc)
        await asyncio.sleep(cache.check_seconds)


async def _end_long_polls(app: web.Application) -> None:
    """Shutdown: open long polls answer now, and the last heartbeats heard are written."""
    await app[LONG_POLLS].close()
    for key in (REPLICA_FOLLOWER, HEARTBEAT_WRITER):
        task = app.get(key)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    try:
        await app[FLEET_INDEX].flush(services_of_app(app).store)
    except Exception as exc:
        log.warning("could not write the last heartbeats on shutdown: %s", exc)


def _follow_other_replicas(app: web.Application) -> None:
    """On PostgreSQL, what other API replicas change reaches this one: deploys and stops make its
    placement index re-read the reservations and wake the long polls of the servers with work;
    registrations make the next `follow` read the server table, and the stamps another replica
    wrote make it read those."""

    def changed(kind: str, payload: str) -> None:
        index = app[FLEET_INDEX]
        if kind == FLEET_STAMPS:
            if payload != index.origin:  # this process's own batch, echoed back, is known here
                index.stamps_written_elsewhere()
            return
        if kind == FLEET_INVENTORY:
            if payload and payload == index.origin:  # this process's own registration, echoed back
                return
            index.inventory_changed_elsewhere()
            index.reservations_changed()  # a resync arrives as an inventory change: re-read both
        else:
            index.reservations_changed()
        app[LONG_POLLS].changed_elsewhere(services_of_app(app).store)

    services_of_app(app).store.events.on_fleet(changed)


def install(app: web.Application) -> None:
    """Put the live fleet on `app`: the index cache, GPU claims lock, long polls, the static
    inventory (GPUBADGE_INVENTORY_FILE), the heartbeat writer and the shutdown that ends polls."""
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
