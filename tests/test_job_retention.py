"""Finished jobs do not grow for ever (issue 44, point 6): retention by age and by count, enforced by
the job runtime in batches, on SQLite and PostgreSQL; and the counts /healthz, /metrics and the jobs
page show read no finished job, however many there are."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from jobs.metrics import JobMetrics
from jobs.retention import RetentionPolicy, sweep
from jobs.runtime import ScanRuntime
from jobs.settings import JobSettings
from store import AsyncStore, queries
from store.queries.jobs import QUEUE_DEPTH
from store.sqlite import SqliteStore
from tests.conftest import OpenBackend
from tests.store_plans import recorded_statements, rows_read

NOW = datetime.now(UTC)


def seed(backend: Any, rows: Iterable[tuple[str, datetime]]) -> list[str]:
    """Insert jobs (state, last update) as another process would, in one transaction; their ids."""
    records = []
    for state, moment in rows:
        job_id = uuid.uuid4().hex
        reference = f"registry.example/seed/{job_id}:1"
        records.append((job_id, reference, "registry.example", reference, state, moment, moment, moment))
    insert = (
        "INSERT INTO jobs (id, reference, registry, dedupe_key, state, attempts, max_attempts, not_before,"
        " created_at, updated_at) VALUES ({p}, {p}, {p}, {p}, {p}, 1, 5, {p}, {p}, {p})"
    )
    if isinstance(backend, SqliteStore):
        with sqlite3.connect(backend.path) as peer:
            peer.executemany(
                insert.format(p="?"),
                [
                    (*record[:5], *(moment.isoformat(timespec="microseconds") for moment in record[5:]))
                    for record in records
                ],
            )
    else:
        import psycopg

        with psycopg.connect(backend._url) as peer, peer.cursor() as cursor:
            cursor.executemany(insert.format(p="%s"), records)
    return [record[0] for record in records]


def counted(backend: Any) -> dict[str, int]:
    """Jobs by state, counted the slow way: every row read."""
    if isinstance(backend, SqliteStore):
        with sqlite3.connect(backend.path) as peer:
            rows = peer.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall()
    else:
        import psycopg

        with psycopg.connect(backend._url) as peer:
            rows = peer.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall()
    return {"queued": 0, "running": 0, "done": 0, "failed": 0, **{state: int(n) for state, n in rows}}


def remaining(backend: Any, ids: Iterable[str]) -> set[str]:
    wanted = list(ids)
    return {job_id for job_id in wanted if backend.job(job_id) is not None}


def test_the_newest_jobs_are_listed_without_reading_the_rest(open_backend: OpenBackend) -> None:
    """The scans page and GET /api/scans list the newest jobs along `jobs_created` (SQLite's migration 0018;
    PostgreSQL's since 0001): SQLite read and sorted every job retention keeps (100,000: 104 ms a page)."""
    backend = open_backend()
    ids = seed(backend, [("done", NOW - timedelta(seconds=n)) for n in range(3_000)])
    with recorded_statements(
        lambda sql: "FROM jobs" in sql and "ORDER BY created_at DESC LIMIT :limit" in sql
    ) as statements:
        newest = backend.run(queries.jobs, limit=20)
    assert [job.id for job in newest] == ids[:20]
    ((sql, params),) = statements
    read = rows_read(backend, sql, params)
    if isinstance(read, str):  # SQLite: down the index, newest first, no sort of every job
        assert "jobs_created" in read and "TEMP B-TREE" not in read, read
    else:  # PostgreSQL: the page's 20, not the 3,000
        assert read <= 25, read


def test_counts_by_state_read_no_finished_job(open_backend: OpenBackend) -> None:
    backend = open_backend()
    seed(backend, [("done", NOW - timedelta(minutes=n % 600)) for n in range(20_000)])
    seed(backend, [("failed", NOW - timedelta(minutes=n)) for n in range(3_000)])
    backend.enqueue([(f"registry.example/active:{n}", "registry.example") for n in range(5)])
    backend.claim_jobs(2, owner="worker", lease_seconds=30)
    expected = {"queued": 3, "running": 2, "done": 20_000, "failed": 3_000}
    assert counted(backend) == expected
    assert backend.run(queries.queue_depth) == expected
    cost = rows_read(backend, QUEUE_DEPTH)
    if isinstance(cost, str):  # SQLite: queued and running jobs are found by index, never every row
        assert "SCAN jobs" not in cost and cost.count("SEARCH jobs") == 2, cost
    else:  # PostgreSQL: the rows read of jobs are the active ones, not the 23,000 finished
        assert cost <= 5, cost


def test_the_tallies_follow_every_change_of_state(open_backend: OpenBackend) -> None:
    backend = open_backend()
    backend.enqueue([(f"registry.example/t:{n}", "registry.example") for n in range(6)], max_attempts=1)
    claimed = backend.claim_jobs(6, owner="worker", lease_seconds=30)
    backend.finish_job(claimed[0].id, digest=None, owner="worker")
    backend.finish_job(claimed[1].id, digest=None, owner="worker")
    assert backend.fail_job(claimed[2].id, "broken", retry_in=None, owner="worker") == "failed"
    assert backend.fail_job(claimed[3].id, "flaky", retry_in=5.0, owner="worker") in ("queued", "failed")
    assert backend.run(queries.queue_depth) == counted(backend)
    backend.retry_job(claimed[2].id)  # failed -> queued by hand
    assert backend.run(queries.queue_depth) == counted(backend)
    backend.release_leases(["worker"], refund_attempt=True)  # running -> queued
    assert backend.run(queries.queue_depth) == counted(backend)
    backend.compact_job_tallies()  # PostgreSQL folds its change rows; SQLite has none to fold
    assert backend.run(queries.queue_depth) == counted(backend)
    assert backend.run(queries.finished_jobs) == counted(backend)["done"] + counted(backend)["failed"]


async def test_a_sweep_deletes_by_age_and_by_count_oldest_first_in_batches(open_backend: OpenBackend) -> None:
    backend = open_backend()
    store = AsyncStore(backend)
    try:
        day = timedelta(days=1)
        ancient = seed(backend, [("done", NOW - 30 * day - n * timedelta(seconds=1)) for n in range(700)])
        old_failures = seed(
            backend, [("failed", NOW - 20 * day - n * timedelta(seconds=1)) for n in range(300)]
        )
        # within the age limit: 900 finished, one a minute; only the newest 600 are within the count
        recent = seed(
            backend, [("done" if n % 3 else "failed", NOW - n * timedelta(minutes=1)) for n in range(900)]
        )
        # queued and running jobs older than any limit are never touched
        active = seed(backend, [("queued", NOW - 90 * day), ("running", NOW - 90 * day)])

        deleted = await sweep(
            store, RetentionPolicy(max_age_seconds=7 * 86400, max_count=600), batch=100, now=NOW
        )

        assert deleted == 700 + 300 + 300
        assert remaining(backend, ancient + old_failures) == set()
        assert remaining(backend, recent) == set(recent[:600])  # the newest 600, by their last update
        assert remaining(backend, active) == set(active)
        assert backend.run(queries.queue_depth) == counted(backend)
        assert counted(backend)["done"] + counted(backend)["failed"] == 600
        # a second sweep finds nothing more to delete; a policy that keeps everything deletes nothing
        assert await sweep(store, RetentionPolicy(7 * 86400, 600), batch=100, now=NOW) == 0
        assert await sweep(store, RetentionPolicy(0, 0), now=NOW) == 0
    finally:
        await store.close()


async def test_retention_by_count_alone_keeps_the_newest(open_backend: OpenBackend) -> None:
    backend = open_backend()
    store = AsyncStore(backend)
    try:
        ids = seed(
            backend, [("done", NOW - n * timedelta(days=400)) for n in range(50)]
        )  # ages past any limit
        assert await sweep(store, RetentionPolicy(max_age_seconds=0, max_count=10), batch=7) == 40
        assert remaining(backend, ids) == set(ids[:10])
        assert backend.run(queries.queue_depth)["done"] == 10
    finally:
        await store.close()


@pytest.mark.parametrize("keep", [0, 5])
async def test_the_runtime_sweeps_where_it_runs_workers(
    open_backend: OpenBackend, tmp_path: Any, keep: int
) -> None:
    """`serve` (with workers) and `gpubadge worker` start retention with their workers; an API-only
    process (`serve --workers 0`) leaves it to them."""
    backend = open_backend()
    store = AsyncStore(backend)
    ids = seed(backend, [("done", NOW - timedelta(hours=n)) for n in range(20)])
    settings = JobSettings(
        db=tmp_path / "unused.db", registries=[], job_retention_seconds=3600 * 10.5, job_retention_count=keep
    )
    metrics = JobMetrics()
    try:
        api_only = await ScanRuntime.start(settings, store, metrics, run_workers=False)
        assert api_only.retention is None
        await api_only.stop()

        runtime = await ScanRuntime.start(settings, store, metrics)
        try:
            assert runtime.retention is not None
            await asyncio.wait_for(runtime.retention.swept.wait(), 30)
        finally:
            await runtime.stop()
        kept = set(ids[: keep or 11])  # the last 10.5 hours: 11 jobs, or the newest `keep` of them
        assert remaining(backend, ids) == kept
        assert "gpubadge_jobs_deleted_total " + f"{float(20 - len(kept))}" in metrics.render()
    finally:
        await store.close()


def test_on_sqlite_a_sweep_walks_the_finished_jobs_index_instead_of_sorting_them(tmp_path: Any) -> None:
    """SQLite keeps no statistics: left to itself it found finished jobs by the state index and sorted
    them all for each batch (2.4 s a batch at a million jobs). Each retention read walks jobs_finished."""
    from store.dialect import SQLITE, Db

    backend = SqliteStore(tmp_path / "store.db")
    backend.close()
    statements: list[str] = []
    with contextlib.closing(sqlite3.connect(tmp_path / "store.db")) as conn:
        conn.set_trace_callback(statements.append)
        db = Db(conn, SQLITE)
        queries.finished_beyond(db, keep=10)
        queries.delete_finished(db, through=NOW, limit=10)
        conn.set_trace_callback(None)
        plans = [
            " | ".join(str(row[3]) for row in conn.execute(f"EXPLAIN QUERY PLAN {statement}"))
            for statement in statements
            if statement.lstrip().upper().startswith(("SELECT", "DELETE"))
        ]
    assert len(plans) == 2
    for plan in plans:
        assert "jobs_finished" in plan and "TEMP B-TREE" not in plan, plan


async def test_a_sweep_that_deletes_nothing_still_folds_the_tallies(open_backend: OpenBackend) -> None:
    """PostgreSQL adds a tally row per finished job; every sweep folds them, even where the settings
    keep every job, so counting stays as cheap as the active jobs however long the service runs."""
    backend = open_backend()
    store = AsyncStore(backend)
    try:
        backend.enqueue([(f"registry.example/fold:{n}", "registry.example") for n in range(40)])
        for job in backend.claim_jobs(40, owner="worker", lease_seconds=30):
            backend.finish_job(job.id, digest=None, owner="worker")
        assert await sweep(store, RetentionPolicy(max_age_seconds=0, max_count=0)) == 0
        assert tally_rows(backend) <= 1  # one state, one row
        assert backend.run(queries.queue_depth) == {"queued": 0, "running": 0, "done": 40, "failed": 0}
    finally:
        await store.close()


def tally_rows(backend: Any) -> int:
    if isinstance(backend, SqliteStore):
        with contextlib.closing(sqlite3.connect(backend.path)) as peer:
            return int(peer.execute("SELECT count(*) FROM job_tallies").fetchone()[0])
    import psycopg

    with psycopg.connect(backend._url) as peer:
        row = peer.execute("SELECT count(*) FROM job_tallies").fetchone()
    return int(row[0]) if row else 0
