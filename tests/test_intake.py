"""Group commit: deliveries arriving together share a transaction, and each waits for it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from jobs.intake import JobIntake, QueueFull
from store import AsyncStore, EnqueueBatch, StoreUnavailable, queries
from store import SqliteStore as Store
from tests.conftest import OpenBackend


class CountingStore(Store):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.transactions = 0

    def record_intake(self, batches: Sequence[EnqueueBatch]) -> list[list[str]]:
        self.transactions += 1  # the intake's commits (to its journal)
        return super().record_intake(batches)


async def test_concurrent_deliveries_share_commits_and_all_persist(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "intake.db")
    intake = JobIntake(AsyncStore(store))
    results = await asyncio.gather(
        *(intake.enqueue([(f"r/app:{n}", "r")], source="test", max_attempts=3) for n in range(50))
    )
    ids = [job_ids[0] for job_ids in results]
    assert len(set(ids)) == 50
    assert 0 < store.transactions < 50  # batched, not one commit per delivery
    # durable before the answer: in the intake's journal, which a new process moves at its start
    reopened = Store(tmp_path / "intake.db")
    reopened.start_intake()
    assert all(reopened.job(job_id) is not None for job_id in ids)


async def test_a_failed_commit_reaches_every_waiting_delivery(tmp_path: Path) -> None:
    store = Store(tmp_path / "intake.db")
    intake = JobIntake(AsyncStore(store))
    store.close()  # the next commit fails
    outcomes = await asyncio.gather(
        *(intake.enqueue([(f"r/app:{n}", "r")], source="test", max_attempts=3) for n in range(3)),
        return_exceptions=True,
    )
    assert all(isinstance(outcome, StoreUnavailable) for outcome in outcomes)


async def test_the_queue_cap_refuses_what_would_pass_it_and_keeps_the_rest(open_backend: OpenBackend) -> None:
    """Issue 30 (11), on both engines: concurrent deliveries fill the queue to its cap exactly; the
    ones past it get QueueFull, nothing of theirs is committed, and every accepted job stays queued."""
    backend = open_backend()
    store = AsyncStore(backend)
    intake = JobIntake(store, max_queued=25)
    outcomes = await asyncio.gather(
        *(
            intake.enqueue([(f"r/app-{n}:{i}", "r") for i in range(3)], source="test", max_attempts=3)
            for n in range(12)
        ),
        return_exceptions=True,
    )
    accepted = [ids for ids in outcomes if isinstance(ids, list)]
    refused = [outcome for outcome in outcomes if isinstance(outcome, QueueFull)]
    assert len(accepted) == 8 and len(refused) == 4  # 8 x 3 = 24 fit under 25; a ninth would make 27
    assert "GPUBADGE_MAX_QUEUED_SCANS" in str(refused[0])
    assert await store.run(queries.queued_jobs, cap=100) == 24
    assert await intake.has_room(1) and not await intake.has_room(2)
    assert all(backend.job(job_id).state == "queued" for ids in accepted for job_id in ids)
