"""A worker's lease renewal and pre-emption (jobs/workers.py) against a real store, on SQLite and
PostgreSQL, around a scan whose outcome is being written.

A renewal that lands after a scan's outcome committed finds the job no longer running: that is the
scan ending, not a lease lost. Under load (outcomes committed in groups, the renewal queued behind
them) it happened often enough to log "lost the lease ... another worker runs it now" for jobs
that had just finished, and to cancel their tasks. A lease another worker took is still lost: its
scan is cancelled and the warning names it. Pre-emption, which puts a scan back in the queue for
a registry that waited, passes over a scan whose outcome is being written: that would redo it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, cast

import pytest

from jobs.workers import ScanWorkers, WorkerSettings
from scanner.models import ImageReport
from scanner.scan import Scanner
from store import AsyncStore, queries
from tests.conftest import OpenBackend

DIGEST = "sha256:" + "ab" * 32


class OneReportScanner:
    """Stands in for the scanner (the renewal is what is tested): each scan answers one clean
    report, after `gate` opens when one is given."""

    def __init__(self, gate: asyncio.Event | None = None, ungated: str = "") -> None:
        self.gate = gate
        self.ungated = ungated  # a reference whose scan ends at once, gate or not

    async def scan(self, reference: str, options: Any = None) -> ImageReport:
        if self.gate is not None and reference != self.ungated:
            await self.gate.wait()
        return ImageReport(reference=reference, digest=DIGEST, registry="r.example")


async def test_a_renewal_after_the_outcome_committed_cancels_nothing_and_warns_nothing(
    open_backend: OpenBackend, caplog: pytest.LogCaptureFixture
) -> None:
    store = AsyncStore(open_backend(), threads=2)
    workers = ScanWorkers(store, scanner=cast(Scanner, OneReportScanner()))
    finish = store.finish_job
    renewed: list[list[str]] = []

    async def finish_then_renew(job_id: str, *, digest: str | None, owner: str) -> bool:
        """The outcome commits; the renewal's answer arrives before the scan's task resumes."""
        finished = await finish(job_id, digest=digest, owner=owner)
        renew = store.renew_leases

        async def recorded(owner: str, ids: Any, seconds: float) -> list[str]:
            held = await renew(owner, ids, seconds)
            renewed.append(held)
            return held

        store.renew_leases = recorded  # type: ignore[method-assign]
        await workers._renew_once()
        return finished

    store.finish_job = finish_then_renew  # type: ignore[method-assign]
    try:
        [job_id] = await store.enqueue([("r.example/app:1", "r.example")], source=None, max_attempts=3)
        with caplog.at_level(logging.WARNING, logger="jobs.workers"):
            await workers._claim_once()
            [task] = workers._running.values()
            await asyncio.wait_for(task, 30)
        assert renewed == [[]]  # the renewal did find the job no longer running
        assert not task.cancelled()
        assert "lost the lease" not in caplog.text, caplog.text
        job = await store.run(queries.job, job_id)
        assert job is not None and job.state == "done", job
    finally:
        await store.close()


async def test_a_lease_another_worker_took_still_cancels_the_scan(
    open_backend: OpenBackend, caplog: pytest.LogCaptureFixture
) -> None:
    backend = open_backend()
    store = AsyncStore(backend, threads=2)
    gate = asyncio.Event()  # the scan runs until the lease is gone
    workers = ScanWorkers(store, scanner=cast(Scanner, OneReportScanner(gate)))
    try:
        [job_id] = await store.enqueue([("r.example/app:2", "r.example")], source=None, max_attempts=3)
        await workers._claim_once()
        [task] = workers._running.values()
        await store.release_leases([workers.owner], refund_attempt=True)  # as a lapse would
        assert await store.claim_jobs(1, owner="other-worker", lease_seconds=30)
        with caplog.at_level(logging.WARNING, logger="jobs.workers"):
            await workers._renew_once()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
        assert f"lost the lease on job {job_id}" in caplog.text, caplog.text
        job = await store.run(queries.job, job_id)
        assert job is not None and job.state == "running" and job.lease_owner == "other-worker", job
    finally:
        gate.set()
        await store.close()


async def test_pre_emption_passes_over_a_scan_whose_outcome_is_being_written(
    open_backend: OpenBackend,
) -> None:
    store = AsyncStore(open_backend(), threads=2)
    scanning = asyncio.Event()  # the second scan of registry a runs until the end of the test
    workers = ScanWorkers(
        store,
        scanner=cast(Scanner, OneReportScanner(scanning, ungated="a.example/first:1")),
        settings=WorkerSettings(concurrency=2, preempt_after=1.0),
    )
    finish = store.finish_job
    writing, written = asyncio.Event(), asyncio.Event()

    async def slow_finish(job_id: str, *, digest: str | None, owner: str) -> bool:
        """The first scan's outcome write, held until the test lets it commit."""
        writing.set()
        await written.wait()
        return await finish(job_id, digest=digest, owner=owner)

    store.finish_job = slow_finish  # type: ignore[method-assign]
    try:
        [first] = await store.enqueue([("a.example/first:1", "a.example")], source=None, max_attempts=3)
        [second] = await store.enqueue([("a.example/second:1", "a.example")], source=None, max_attempts=3)
        await workers._claim_once()  # both slots: registry a's two scans, the first begun first
        assert set(workers._running) == {first, second}
        await asyncio.wait_for(writing.wait(), 30)  # the first scan ended; its outcome is being written
        await store.enqueue([("b.example/waiting:1", "b.example")], source=None, max_attempts=3)
        workers._waiting_since = {"b.example": time.monotonic() - 60}  # registry b has waited a minute
        workers._next_wait_check = 0.0  # the claim's own look (b had nothing queued then) was just now
        await workers._preempt_for_a_waiting_registry()
        stored = [await store.run(queries.job, job_id) for job_id in (first, second)]
        states = {job.id: job.state for job in stored if job is not None}
        assert states == {first: "running", second: "queued"}, states  # the scan still reading went back
        written.set()
        await asyncio.wait_for(workers._running[first], 30)
        done = await store.run(queries.job, first)
        assert done is not None and done.state == "done", done
    finally:
        written.set()
        scanning.set()
        await store.close()
