"""A worker's claim passes (jobs/workers.py): a pass makes one store hop, and a pass woken by a
settle or by its own freed slot, with the queue just seen empty and no job queued since, makes
none (issue 44, point 3: in a push burst two of every three claim passes found nothing, each a
write transaction and a hop). A queued job always wakes a claim, and the trust in an empty queue
lasts `EMPTY_TRUST` at most."""

from __future__ import annotations

import time
from typing import Any, cast

from jobs.workers import EMPTY_TRUST, ScanWorkers
from scanner.scan import Scanner
from store import AsyncStore
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
