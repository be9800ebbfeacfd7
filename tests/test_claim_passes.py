"""A worker's claim passes (jobs/workers.py): a pass makes one store hop, and a pass woken by a
settle or by its own freed slot, with the queue just seen empty and no job queued since, makes
none (issue 44, point 3: in a push burst two of every three claim passes found nothing, each a
write transaction and a hop). A queued job always wakes a claim, and the trust in an empty queue
lasts `EMPTY_TRUST` at most. With several worker processes, a queued job wakes them all: the
passes after the one that took it write nothing."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from jobs.workers import EMPTY_TRUST, ScanWorkers
from scanner.scan import Scanner
from store import AsyncStore, SqliteStore
from store.events import QUEUED, SETTLED
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


async def test_a_pass_with_no_job_due_asks_for_no_turn(open_backend: OpenBackend) -> None:
    """A queued job wakes every worker process and one claim takes it: the passes that come after
    read that none is due, and neither wait for the claimers' turn nor write."""
    backend = open_backend()
    store = AsyncStore(backend, threads=1)
    try:
        await store.enqueue([("r.example/later:1", "r.example", 3600.0)], source=None, max_attempts=3)
        with claimers_turn_held(backend):
            async with asyncio.timeout(10):  # bounded: a pass that asked for the turn would wait for it
                claim = await store.claim_jobs_or_next_due(4, owner="w", lease_seconds=30)
        assert claim.jobs == []
        assert claim.due is not None and claim.due > datetime.now(UTC) + timedelta(minutes=50)
    finally:
        await store.close()


def test_a_claim_that_gets_its_turn_after_the_job_was_taken_writes_nothing(
    open_backend: OpenBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The passes that asked for the turn while another claim held it: once they have it, one probe
    says no job is due, and the turn ends without the claim's choice and writes."""
    backend = open_backend()
    backend.enqueue([("r.example/later:1", "r.example", 3600.0)])
    statements: list[str] = []
    if isinstance(backend, SqliteStore):
        backend._writer.set_trace_callback(statements.append)
    else:
        import psycopg

        execute = psycopg.Connection.execute

        def traced(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            statements.append(str(query))
            return execute(self, query, *args, **kwargs)

        monkeypatch.setattr(psycopg.Connection, "execute", traced)
    assert backend.claim_jobs(4, owner="w", lease_seconds=30) == []
    assert statements and not [text for text in statements if "UPDATE" in text or "INSERT" in text]
