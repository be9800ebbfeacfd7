"""Queue events as the event loop sees them: jobs queued, jobs settled.

Two sources feed them. Writes made through this process's `AsyncStore` fire them
directly (all one process needs when it owns the file's queue). On PostgreSQL, and on a
SQLite file whose processes share their events, the process also hears every process's
commits (`NOTIFY`, read on the event loop itself: no thread between a notice and its
waiters), so an idle worker wakes when any API process queues a job, and a long-poll
(`?wait=`) on any replica answers when any worker finishes the job. Nobody polls the
database to find out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

Kind = str  # "queued" | "settled" | "resync"
# The PostgreSQL backend's NOTIFY channels (named here, so that SQLite users never import psycopg).
JOBS_QUEUED_CHANNEL = "gpubadge_jobs_queued"
JOB_SETTLED_CHANNEL = "gpubadge_job_settled"  # payload: "<job id> <dedupe key>"
REFERENCE_CHANNEL = "gpubadge_reference_changed"  # payload: a reference whose report or tag changed
FLEET_CHANNEL = "gpubadge_fleet"  # payload: "reservations", "inventory [<origin>]" or "stamps <origin>"
# What a process hears. A process that serves HTTP hears every channel. One that only runs scan
# workers (`gpubadge worker`, `serve`'s worker processes) hears only the queue's: it holds no long
# poll, no reference lookups and no fleet, and every notice it heard would wake its loop for
# nothing, once per process, for each report and tag written.
ALL_CHANNELS = (JOBS_QUEUED_CHANNEL, JOB_SETTLED_CHANNEL, REFERENCE_CHANNEL, FLEET_CHANNEL)
JOB_CHANNELS = (JOBS_QUEUED_CHANNEL, JOB_SETTLED_CHANNEL)
FLEET_RESERVATIONS, FLEET_INVENTORY = "fleet-reservations", "fleet-inventory"
FLEET_STAMPS = "fleet-stamps"  # a replica wrote a batch of heartbeat stamps; payload: its origin
QUEUED, SETTLED, RESYNC = "queued", "settled", "resync"
REPORTED_JOB = "-"  # the job id of a settle that only says "a report of this reference was stored"


async def wait_set(event: asyncio.Event, timeout: float | None) -> bool:
    """Until `event` is set (True) or `timeout` passes (False; None: no timeout). Not `asyncio.wait_for`: on Python
    3.11 it returns the wake-up and drops a cancel that comes in the same turn of the loop, so a
    task looping on it (a replica follower, a worker) could outlive its shutdown."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()
            return True
    return False


class QueueEvents:
    """Fan-out of queue events to waiters and wake-up callbacks on one event loop."""

    def __init__(self) -> None:
        self._settled = asyncio.Event()  # any settle, for waiters without a key
        self._keyed: dict[str, list[asyncio.Event]] = {}  # job id or reference -> its waiters
        self._on_queued: list[Callable[[], None]] = []
        self._on_fleet: list[Callable[[str, str], None]] = []
        self._on_settled: list[Callable[[], None]] = []
        # True once another process's commits reach us too (PostgreSQL LISTEN); until then a waiter
        # re-checks every second, since another process sharing a SQLite file sends no events.
        self.cross_process = False
        self._ending = False  # shutdown: every wait answers with what holds now
        # Jobs may have been queued (a queue event or a resync, here or, with a listener, elsewhere)
        # this many times: a worker whose claim found no queued job at one count need not claim
        # again, when woken by a settle or its own freed slot, until the count moves.
        self.queued_count = 0

    def on_queued(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` (on the loop) whenever jobs may have become claimable; returns an unsubscribe."""
        self._on_queued.append(callback)
        return lambda: self._on_queued.remove(callback) if callback in self._on_queued else None

    def on_fleet(self, callback: Callable[[str, str], None]) -> None:
        """Call `callback(kind, payload)` (on the loop) when a process changed reservations or
        servers, or wrote heartbeat stamps (`FLEET_STAMPS`, the payload names the writer)."""
        self._on_fleet.append(callback)

    def on_settled(self, callback: Callable[[], None]) -> None:
        """Call `callback()` (on the loop) on every settle and resync: a job finished, or a report,
        tag or deleted manifest was written (here or, with a listener, in another process)."""
        self._on_settled.append(callback)

    def fire(self, kind: Kind, payload: str = "") -> None:
        """On the loop: something changed. A resync (a lost listener connection) counts as every kind.

        A settle's payload, "<job id> <reference>", wakes only the waiters on that job or that
        reference (besides the un-keyed ones); a settle without one wakes every waiter. A report
        stored mid-scan (its config facts, before its layers are read) comes as a settle of job
        `-`: it wakes the waiters on its reference, and frees no worker.
        """
        if kind in (FLEET_RESERVATIONS, FLEET_INVENTORY, FLEET_STAMPS, RESYNC):
            for fleet_callback in list(self._on_fleet):
                fleet_callback(FLEET_INVENTORY if kind == RESYNC else kind, payload)
            if kind != RESYNC:
                return
        if kind in (SETTLED, RESYNC):
            for settled_callback in list(self._on_settled):
                settled_callback()
            waiters, self._settled = self._settled, asyncio.Event()
            waiters.set()
            job_id, _, reference = payload.partition(" ")
            if kind == SETTLED and job_id:
                keys = {job_id, reference, reference.partition("@")[0]} - {""}
            else:
                keys = set(self._keyed)
            for key in keys:
                for event in self._keyed.pop(key, []):
                    event.set()
        if kind in (QUEUED, RESYNC):
            self.queued_count += 1  # before the callbacks: a worker woken by this reads the new count
        if kind in (QUEUED, SETTLED, RESYNC) and not payload.startswith(REPORTED_JOB + " "):
            # a settled job frees a worker slot and a registry slot
            for callback in list(self._on_queued):
                callback()

    def end_waits(self) -> None:
        """Shutdown: every `wait_until`, now and from now on, checks its condition once more and
        returns, so a held `?wait=` long poll answers at once instead of holding the exit back."""
        self._ending = True
        waiters, self._settled = self._settled, asyncio.Event()
        waiters.set()
        for events in self._keyed.values():
            for event in events:
                event.set()
        self._keyed.clear()

    async def wait_until(
        self, condition: Callable[[], Awaitable[bool]], timeout: float, key: str | None = None
    ) -> bool:
        """Re-check `condition` each time a job settles (here or, on PostgreSQL, on any replica).

        With `key` (a job id, or a reference), only settles of that job or reference wake it: with
        many waiters, each settle then costs one re-check, not one per waiter. Bounded by
        `timeout` and by shutdown (`end_waits`); also re-checks every `SAFETY_RECHECK` seconds
        with a listener (only a lost or differently-keyed notification would need it) and every
        `LOCAL_RECHECK` second without one.
        """
        deadline = time.monotonic() + timeout
        while True:
            # taken before the check, so a settle during the check is not missed
            if key is None:
                settled = self._settled
            else:
                settled = asyncio.Event()
                self._keyed.setdefault(key, []).append(settled)
            try:
                if await condition():
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._ending:
                    return False
                recheck = SAFETY_RECHECK if self.cross_process else LOCAL_RECHECK
                await wait_set(settled, min(remaining, recheck))
            finally:
                if key is not None and not settled.is_set():
                    waiting = self._keyed.get(key, [])
                    if settled in waiting:
                        waiting.remove(settled)
                    if not waiting:
                        self._keyed.pop(key, None)


SAFETY_RECHECK = 5.0  # with LISTEN: only a lost notification would need it
LOCAL_RECHECK = 1.0  # without: another process on the same SQLite file may finish the job
