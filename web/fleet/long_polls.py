"""The long polls held by this process: the agents' (a cap, one wake-up per server, a clean stop)
and the public `?wait=` ones (a cap, and a share per peer)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
from collections.abc import Iterable

from aiohttp import web

from store import AsyncStore, queries
from web.held_counts import HeldCounts

MAX_POLL = 60.0


def idle_poll_end(name: str, wait: float, now: float) -> float:
    """The wall-clock time at which an idle poll of server `name`, asking `wait` seconds and opened
    at wall time `now`, answers: the next instant after `now` on the server's own phase of a
    `wait`-long cycle. So the poll is held at most `wait` seconds, and a poll opened right after
    the last one ended is held exactly `wait`.

    The phase is a hash of the name, the same in every process sharing the store. Agents that
    reconnected together (a restart, a network blip) therefore renew their polls spread evenly over
    the cycle from their first round on, N / `wait` renewals a second, instead of every `wait`
    seconds in a burst of thousands of requests in front of every other request. A random end
    within the last part of the wait only blurs such a burst a little more each round: after a
    restart of a 10,000-agent fleet, renewals still came in waves of 110 to 770 a second minutes
    later (bench/fleet_bench.py)."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    phase = int.from_bytes(digest, "big") / 2**64 * wait
    return phase + (math.floor((now - phase) / wait) + 1) * wait


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
        self.refused = 0  # polls answered 503 because `limit` were held
        self.closing = False
        self._generation: dict[str, int] = {}
        self._serials: dict[str, int] = {}  # server name -> its latest poll's serial
        self._holding = HeldCounts()  # server name -> its polls holding a slot
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._actionable: set[str] = set()
        self._actionable_known = False
        self._refreshing: asyncio.Task[None] | None = None

    def admit(self, name: str) -> bool:
        """Take a slot for a held poll of `name` (give it back with `release`); False when all are
        held, unless `name` already holds one, which this poll supersedes (`hold`)."""
        if self._holding.total >= self.limit and not self._holding.of(name):
            self.refused += 1
            return False
        self._holding.take(name)
        return True

    def release(self, name: str) -> None:
        self._holding.give_back(name)

    @property
    def held(self) -> int:
        """Polls holding a slot now."""
        return self._holding.total

    def hold(self, name: str) -> int:
        """A poll of `name` starts holding: any older poll of it answers now (its agent has moved on to
        this one: after a restart or a dropped connection, a dead poll would keep its slot until its
        wait ran out). Returns this poll's serial, for `superseded`."""
        serial = self._serials.get(name, 0) + 1
        self._serials[name] = serial
        _answer(self._waiters.pop(name, ()))
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
            _answer(self._waiters.pop(name, ()))

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
            with contextlib.suppress(TimeoutError):  # not wait_for: on 3.11 it may drop a cancel
                async with asyncio.timeout(timeout):
                    await waiter
        finally:
            waiters = self._waiters.get(name)
            if waiters is not None:
                with contextlib.suppress(ValueError):
                    waiters.remove(waiter)
                if not waiters:
                    del self._waiters[name]

    async def close(self) -> None:
        self.closing = True
        for waiters in self._waiters.values():
            _answer(waiters)
        self._waiters.clear()


def _answer(waiters: Iterable[asyncio.Future[None]]) -> None:
    """Wake these held polls (those not already answered)."""
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)


LONG_POLLS = web.AppKey("long_polls", LongPolls)


class PublicWaits:
    """`?wait=` long polls of callers without the API token (`GET /api/images/by-ref`, `GET
    /api/scans/{id}`): at most `limit` held at once, and at most `per_peer` by one peer address, so
    polls anyone may open and renew cannot hold the connections everyone else needs. Past either,
    the poll is refused (`admit` is False) and the route answers 503 with Retry-After."""

    def __init__(self, limit: int, per_peer: int) -> None:
        self.limit = limit
        self.per_peer = per_peer
        self.refused = 0
        self._held = HeldCounts()

    def admit(self, peer: str) -> bool:
        if self._held.total >= self.limit or self._held.of(peer) >= self.per_peer:
            self.refused += 1
            return False
        self._held.take(peer)
        return True

    def release(self, peer: str) -> None:
        self._held.give_back(peer)

    @property
    def held(self) -> int:
        """Public polls held now."""
        return self._held.total


PUBLIC_WAITS = web.AppKey("public_waits", PublicWaits)
