"""Group commit: deliveries arriving together share a transaction, and each waits for it."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence
from pathlib import Path

from store import AsyncStore, EnqueueBatch
from store import SqliteStore as Store
from web.intake import JobIntake


class CountingStore(Store):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.transactions = 0

    def enqueue_many(self, batches: Sequence[EnqueueBatch]) -> list[list[str]]:
        self.transactions += 1
        return super().enqueue_many(batches)


async def test_concurrent_deliveries_share_commits_and_all_persist(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "intake.db")
    intake = JobIntake(AsyncStore(store))
    results = await asyncio.gather(
        *(intake.enqueue([(f"r/app:{n}", "r")], source="test", max_attempts=3) for n in range(50))
    )
    ids = [job_ids[0] for job_ids in results]
    assert len(set(ids)) == 50
    assert store.transactions < 50  # batched, not one commit per delivery
    reopened = Store(tmp_path / "intake.db")
    assert all(reopened.job(job_id) is not None for job_id in ids)  # durable before the answer


async def test_a_failed_commit_reaches_every_waiting_delivery(tmp_path: Path) -> None:
    store = Store(tmp_path / "intake.db")
    intake = JobIntake(AsyncStore(store))
    store.close()  # the next commit fails
    outcomes = await asyncio.gather(
        *(intake.enqueue([(f"r/app:{n}", "r")], source="test", max_attempts=3) for n in range(3)),
        return_exceptions=True,
    )
    assert all(isinstance(outcome, sqlite3.ProgrammingError) for outcome in outcomes)
