"""Ended deployments do not grow for ever: retention by age and by count, swept with the finished jobs by
the job runtime, on SQLite and PostgreSQL. A live deployment is never deleted, and a GPU reservation a
lost update left on an ended one goes with it."""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import UTC, datetime, timedelta
from typing import Any

from jobs.metrics import JobMetrics
from jobs.retention import RetentionPolicy, sweep_deployments
from jobs.runtime import ScanRuntime
from jobs.settings import JobSettings
from store import AsyncStore, queries
from store.sqlite import SqliteStore
from tests.conftest import OpenBackend
from tests.store_plans import recorded_statements, rows_read

NOW = datetime.now(UTC)
DAY = timedelta(days=1)


def deploy(backend: Any, name: str, *, state: str, updated: datetime, gpus: tuple[str, ...] = ()) -> None:
    """A deployment of node-a in `state`, last updated at `updated` (set as another process would). Its
    GPUs stay reserved: an end recorded without `release`, as a lost update would leave it."""
    backend.create_deployment(name, "node-a", list(gpus), f'{{"id": "{name}"}}')
    if state != "pending":
        backend.run(queries.update_deployment, name, f'{{"id": "{name}"}}', state=state)
    sql = "UPDATE deployments SET updated_at = {p} WHERE id = {p}"
    if isinstance(backend, SqliteStore):
        with sqlite3.connect(backend.path) as peer:
            peer.execute(sql.format(p="?"), [updated.isoformat(timespec="microseconds"), name])
        return
    import psycopg

    with psycopg.connect(backend._url) as peer:
        peer.execute(sql.format(p="%s"), [updated, name])


def kept(backend: Any, names: list[str]) -> list[str]:
    return [name for name in names if backend.run(queries.deployment, name) is not None]


async def test_a_sweep_deletes_ended_deployments_by_age_and_count_never_a_live_one(
    open_backend: OpenBackend,
) -> None:
    backend = open_backend()
    store = AsyncStore(backend)
    try:
        backend.run(queries.upsert_server, "node-a", '{"name": "node-a"}')
        old = [f"old-{n}" for n in range(5)]
        for n, name in enumerate(old):
            deploy(
                backend, name, state=("exited", "failed", "stopped")[n % 3], updated=NOW - 100 * DAY - n * DAY
            )
        # an old one that ended without its GPUs freed (a lost update): they go with it
        deploy(backend, "leaky", state="exited", updated=NOW - 120 * DAY, gpus=("GPU-leak",))
        recent = [f"recent-{n}" for n in range(4)]
        for n, name in enumerate(recent):
            deploy(backend, name, state="exited", updated=NOW - n * timedelta(hours=1))
        # live deployments older than any limit are never touched, nor their GPUs
        live = ["pending-old", "running-old"]
        deploy(backend, "pending-old", state="pending", updated=NOW - 400 * DAY, gpus=("GPU-live",))
        deploy(backend, "running-old", state="running", updated=NOW - 400 * DAY)
        assert set(backend.run(queries.reserved_gpus)) == {"GPU-leak", "GPU-live"}

        policy = RetentionPolicy(max_age_seconds=90 * 86400, max_count=0)
        assert await sweep_deployments(store, policy, batch=2, now=NOW) == 6
        assert kept(backend, [*old, "leaky", *recent, *live]) == [*recent, *live]
        assert backend.run(queries.reserved_gpus) == {"GPU-live": "pending-old"}
        # by count: the newest two ended ones stay; a second sweep finds nothing; keeping all deletes nothing
        assert await sweep_deployments(store, RetentionPolicy(0, 2), batch=100, now=NOW) == 2
        assert kept(backend, [*recent, *live]) == [*recent[:2], *live]
        assert await sweep_deployments(store, RetentionPolicy(0, 2), now=NOW) == 0
        assert await sweep_deployments(store, RetentionPolicy(0, 0), now=NOW) == 0
        assert backend.run(queries.ended_deployments, cap=100) == 2
    finally:
        await store.close()


HISTORY = 1200


def test_the_sweep_reads_ended_deployments_along_their_own_index(open_backend: OpenBackend) -> None:
    """Counting, finding the cut and deleting read the ended deployments (migration 0023), oldest first,
    never every deployment nor the live ones."""
    backend = open_backend()
    backend.run(queries.upsert_server, "node-a", '{"name": "node-a"}')
    for n in range(HISTORY):
        backend.create_deployment(f"d-{n}", "node-a", [], "{}")
        backend.run(queries.update_deployment, f"d-{n}", "{}", state="exited" if n % 4 else "running")
    with recorded_statements(lambda sql: "FROM deployments" in sql and "updated_at" in sql) as statements:
        beyond = backend.run(queries.ended_beyond, keep=800)
        assert beyond is not None
        assert backend.run(queries.delete_ended, through=beyond, limit=10) == 10
    assert backend.run(queries.ended_deployments, cap=10_000) == 900 - 10
    assert len(statements) == 2
    for sql, params in statements:
        if not isinstance(backend, SqliteStore) and sql.startswith("DELETE"):
            continue  # EXPLAIN ANALYZE would delete again
        read = rows_read(backend, sql, params, table="deployments", generic=True)
        if isinstance(read, str):
            steps = [step for step in read.split(" | ") if "deployments" in step]
            along = [step for step in steps if "(id=?)" not in step]  # the delete's rows, by their key
            assert along and all("deployments_ended" in step for step in along), read
            assert "TEMP B-TREE" not in read, read
        else:  # the cut: the newest 801 ended ones, not the 300 live ones beside them
            assert read <= 801, (sql, read)


async def test_the_runtime_sweeps_deployments_with_the_jobs(open_backend: OpenBackend, tmp_path: Any) -> None:
    backend = open_backend()
    store = AsyncStore(backend)
    backend.run(queries.upsert_server, "node-a", '{"name": "node-a"}')
    deploy(backend, "ancient", state="stopped", updated=NOW - 91 * DAY)
    deploy(backend, "fresh", state="stopped", updated=NOW - 89 * DAY)
    settings = JobSettings(db=tmp_path / "unused.db", registries=[])
    metrics = JobMetrics()
    try:
        runtime = await ScanRuntime.start(settings, store, metrics)
        try:
            assert runtime.retention is not None
            await asyncio.wait_for(runtime.retention.swept.wait(), 30)
        finally:
            await runtime.stop()
        assert kept(backend, ["ancient", "fresh"]) == ["fresh"]  # the default: 90 days
        assert "gpubadge_deployments_deleted_total 1.0" in metrics.render()
    finally:
        await store.close()
