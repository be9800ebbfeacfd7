"""A worker's claim passes (jobs/workers.py): a pass makes one store hop, and a pass woken by a
settle or by its own freed slot, with the queue just seen empty and no job queued since, makes
none (issue 44, point 3: in a push burst two of every three claim passes found nothing, each a
write transaction and a hop). A queued job always wakes a claim, and the trust in an empty queue
lasts `EMPTY_TRUST` at most. With several worker processes, a queued job wakes them all: the
passes after the one that took it write nothing, and none queues behind another's claim."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from jobs.workers import CONTENDED_RETRY, EMPTY_TRUST, ScanWorkers
from scanner.scan import Scanner
from store import AsyncStore, SqliteStore
from store.events import QUEUED, SETTLED
from store.facade import CLAIM_TRIES
from tests.conftest import OpenBackend


async def test_a_claim_pass_after_the_queue_was_seen_empty_waits_for_a_queued_job(
    open_backend: OpenBackend,
) -> None:
    store = AsyncStore(open_backend(), threads=1)
    workers = ScanWorkers(store, scanner=cast(Scanner, None))  # no job is claimed: nothing is scanned
    claims = 0
    claim = store.claim_jobs_or_next_due

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal claims
        claims += 1
        return await claim(*args, **kwargs)

    store.claim_jobs_or_next_due = counted  # type: ignore[method-assign]
    try:
        await workers._claim_once()
        assert claims == 1  # the queue is empty
        pause = await workers._claim_once()  # a slot freed here: nothing was queued since
        assert claims == 1 and 0 < pause <= EMPTY_TRUST
        store.events.fire(SETTLED, "job-1 r.example/app:1")  # a job ended: it queued nothing
        await workers._claim_once()
        assert claims == 1
        store.events.fire(QUEUED)  # a job was queued, here or in another process
        await workers._claim_once()
        assert claims == 2
        # the trust lasts EMPTY_TRUST: past it a pass claims anyway (a lost event costs that much)
        workers._empty_seen = (store.events.queued_count, time.monotonic() - EMPTY_TRUST)
        await workers._claim_once()
        assert claims == 3
    finally:
        await store.close()


async def test_a_job_queued_while_the_queue_is_believed_empty_is_claimed_at_once(
    open_backend: OpenBackend,
) -> None:
    """Queued through the store's own path (as the intake and `POST /api/scans` do): its event
    moves the count, and the next pass claims it."""
    store = AsyncStore(open_backend(), threads=1)
    workers = ScanWorkers(store, scanner=cast(Scanner, None))
    started: list[str] = []

    async def run(
        job: Any, stored: Any = None
    ) -> None:  # stands in for the scan: the claim is what is tested
        started.append(job.reference)

    workers._run = run  # type: ignore[method-assign]
    try:
        await workers._claim_once()
        assert workers._queue_known_empty() is not None
        await store.enqueue([("r.example/app:1", "r.example")], source=None, max_attempts=3)
        assert workers._queue_known_empty() is None
        await workers._claim_once()
        for task in list(workers._running.values()):
            await task
        assert started == ["r.example/app:1"]
    finally:
        await store.close()


@contextlib.contextmanager
def claimers_turn_held(backend: Any) -> Iterator[None]:
    """Another process holds the claimers' turn: on SQLite the file's write lock (a claim is one
    immediate transaction), on PostgreSQL the claim lock (an advisory lock only claims take)."""
    if isinstance(backend, SqliteStore):
        holder = sqlite3.connect(backend.path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        return
    import psycopg

    from store.postgres import _CLAIM_LOCK_CLASS

    with psycopg.connect(backend._url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s, 0)", [_CLAIM_LOCK_CLASS])
        try:
            yield
        finally:
            holder.execute("SELECT pg_advisory_unlock(%s, 0)", [_CLAIM_LOCK_CLASS])


def test_a_claim_gives_way_to_another_processs_claim_and_writes_nothing(open_backend: OpenBackend) -> None:
    """A queued job wakes every worker process at once; one claim takes it. The others neither queue
    for the turn (on SQLite its busy timeout is seconds) nor choose again once they get it."""
    backend = open_backend()
    [job_id] = backend.enqueue([("r.example/app:1", "r.example")])
    with claimers_turn_held(backend):
        started = time.monotonic()
        assert backend.claim_jobs_if_free(4, owner="w", lease_seconds=30) is None
        assert time.monotonic() - started < 1
    assert backend.job(job_id).state == "queued"  # nothing written
    [job] = backend.claim_jobs_if_free(4, owner="w", lease_seconds=30)
    assert job.id == job_id


async def test_a_pass_that_gave_way_looks_again_shortly_then_waits_its_turn(
    open_backend: OpenBackend,
) -> None:
    backend = open_backend()
    store = AsyncStore(backend, threads=1)
    workers = ScanWorkers(store, scanner=cast(Scanner, None))
    started: list[str] = []

    async def run(job: Any, stored: Any = None) -> None:  # stands in for the scan
        started.append(job.reference)

    workers._run = run  # type: ignore[method-assign]
    waited: list[bool] = []
    claim_jobs = backend.claim_jobs

    def waiting_claim(*args: Any, **kwargs: Any) -> Any:
        waited.append(True)
        return claim_jobs(*args, **kwargs)

    backend.claim_jobs = waiting_claim
    workers._next_expiry_check = time.monotonic() + 3600  # no lease sweep (a write) in these passes
    try:
        await store.enqueue([("r.example/app:1", "r.example")], source=None, max_attempts=3)
        with claimers_turn_held(backend):
            async with asyncio.timeout(10):  # bounded: a pass that queued for the turn would wait for it
                pause = await workers._claim_once()
            assert 0 < pause <= CONTENDED_RETRY and workers._contended == 1
            assert workers._queue_known_empty() is None  # a pass that gave way saw nothing empty
        await workers._claim_once()
        for task in list(workers._running.values()):
            await task
        assert started == ["r.example/app:1"] and workers._contended == 0 and not waited
        # after CLAIM_TRIES passes in a row gave way, the next waits for its turn: a busy store
        # cannot starve a worker
        await store.enqueue([("r.example/app:2", "r.example")], source=None, max_attempts=3)
        workers._contended = CLAIM_TRIES
        await workers._claim_once()
        assert waited == [True]
    finally:
        await store.close()


async def test_a_pass_with_no_job_due_asks_for_no_turn(open_backend: OpenBackend) -> None:
    """The processes that come after the claim that took the job read that none is due, and write
    nothing: they do not ask for the turn at all."""
    backend = open_backend()
    store = AsyncStore(backend, threads=1)
    try:
        await store.enqueue([("r.example/later:1", "r.example", 3600.0)], source=None, max_attempts=3)
        with claimers_turn_held(backend):
            async with asyncio.timeout(10):  # bounded: a pass that asked for the turn would wait for it
                claim = await store.claim_jobs_or_next_due(4, owner="w", lease_seconds=30)
        assert claim.jobs == [] and not claim.contended
        assert claim.due is not None and claim.due > datetime.now(UTC) + timedelta(minutes=50)
    finally:
        await store.close()
