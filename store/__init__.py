"""The only code that speaks SQL. It returns models, and callers reach it through `AsyncStore`
(`store.run(queries.x, ...)` for a shared query, a method for each engine-specific call) or, on a
thread of their own, through `AsyncStore.blocking`.

`open_store` picks the backend: SQLite (the embedded default, one file) unless a
PostgreSQL URL is configured for scale-out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from store.backend import LoopCommits, QueryRunner, StoreBackend
from store.facade import AsyncStore, BlockingStore
from store.models import (
    ClaimPass,
    DeploymentRecord,
    EnqueueBatch,
    GpuClaims,
    GpuTaken,
    ImageRow,
    Job,
    JobState,
    LeaseExpiry,
    QueueHealth,
    RegistryLoad,
    ServerRecord,
    StoreUnavailable,
    TagEvent,
)
from store.sqlite import SqliteStore

__all__ = [
    "AsyncStore",
    "BlockingStore",
    "ClaimPass",
    "DeploymentRecord",
    "EnqueueBatch",
    "GpuClaims",
    "GpuTaken",
    "ImageRow",
    "Job",
    "JobState",
    "LeaseExpiry",
    "LoopCommits",
    "QueryRunner",
    "QueueHealth",
    "RegistryLoad",
    "ServerRecord",
    "SqliteStore",
    "StoreBackend",
    "StoreUnavailable",
    "TagEvent",
    "open_backend",
    "open_store",
]


def open_store(
    path: Path | str,
    *,
    synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
    busy_timeout: float = 30.0,
    threads: int = 8,
    database_url: str | None = None,
    shared_events: bool = False,
    report_cache_entries: int = 512,
    report_cache_seconds: float = 30.0,
    intake_journal: Path | None = None,
) -> AsyncStore:
    """The async store, migrated to the current schema: PostgreSQL when `database_url` is given
    (then no SQLite file is touched), else the SQLite file at `path`. `shared_events`: on SQLite,
    tell the other processes sharing the file of each commit and hear theirs (`store.sqlite_notify`),
    as every PostgreSQL store does. `report_cache_entries` and `report_cache_seconds` bound the
    reference lookups kept in memory (`store.report_lookups`). `intake_journal`: on PostgreSQL, the
    local file the webhook intake commits to (`store.intake_mover`); SQLite's is beside its file."""
    return AsyncStore(
        open_backend(
            path,
            synchronous=synchronous,
            busy_timeout=busy_timeout,
            threads=threads,
            database_url=database_url,
            shared_events=shared_events,
            intake_journal=intake_journal,
        ),
        threads=threads,
        report_cache_entries=report_cache_entries,
        report_cache_seconds=report_cache_seconds,
    )


def open_backend(
    path: Path | str,
    *,
    synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
    busy_timeout: float = 30.0,
    threads: int = 8,
    database_url: str | None = None,
    upgrade: bool = True,
    shared_events: bool = False,
    intake_journal: Path | None = None,
) -> StoreBackend:
    """The synchronous backend (for `gpubadge db` and tools that need no event loop)."""
    if database_url:
        from store.postgres import PostgresStore  # deferred: SQLite users never load psycopg

        # one connection per store thread, plus the health check's own
        return PostgresStore(
            database_url,
            pool_size=threads + 1,
            connect_timeout=busy_timeout,
            upgrade=upgrade,
            intake_journal=intake_journal,
        )
    return SqliteStore(
        path, synchronous=synchronous, busy_timeout=busy_timeout, upgrade=upgrade, shared_events=shared_events
    )
