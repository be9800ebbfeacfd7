"""The only code that speaks SQL. It returns models, and callers reach it through `AsyncStore`.

`open_store` picks the backend: SQLite (the embedded default, one file) unless a
PostgreSQL URL is configured for scale-out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from store.facade import AsyncStore
from store.models import (
    DeploymentRecord,
    EnqueueBatch,
    GpuTaken,
    ImageRow,
    Job,
    JobState,
    LeaseExpiry,
    QueueHealth,
    ServerRecord,
    StoreUnavailable,
    TagEvent,
)
from store.sqlite import SqliteStore

__all__ = [
    "AsyncStore",
    "DeploymentRecord",
    "EnqueueBatch",
    "GpuTaken",
    "ImageRow",
    "Job",
    "JobState",
    "LeaseExpiry",
    "QueueHealth",
    "ServerRecord",
    "SqliteStore",
    "StoreUnavailable",
    "TagEvent",
    "open_store",
]


def open_store(
    path: Path | str,
    *,
    synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
    busy_timeout: float = 30.0,
    threads: int = 8,
) -> AsyncStore:
    """The async store over the SQLite file at `path` (migrated to the current schema)."""
    return AsyncStore(SqliteStore(path, synchronous=synchronous, busy_timeout=busy_timeout), threads=threads)
