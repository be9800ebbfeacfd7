"""Durable scan workers: claim jobs from the store, scan, record the outcome.

Jobs live in SQLite, so a crash or `kill -9` loses nothing: on start, jobs left
`running` go back to the queue, and scanning is idempotent per digest (the
report is keyed by digest), so a job run twice ends in the same result.

Bursts coalesce twice: the store refuses a second active job for the same
reference, and tag jobs run before digest-only jobs of the same repository, so
the N child-manifest events of a multi-arch push find their platforms already
scanned by the index job and cost no further layer reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from scanner.models import ImageReport
from scanner.scan import Scanner, ScanOptions
from scanner.store import Job, Store

log = logging.getLogger(__name__)


@dataclass
class WorkerSettings:
    concurrency: int = 4
    per_registry: int = 4
    backoff_base: float = 1.0
    backoff_max: float = 300.0
    idle_poll: float = 5.0


@dataclass
class JobOutcome:
    job: Job
    report: ImageReport
    seconds: float


def _settled(job: Job | None) -> bool:
    return job is None or job.state in ("done", "failed")


@dataclass
class ScanWorkers:
    """A pool of asyncio workers over the store's job queue."""

    store: Store
    scanner: Scanner
    settings: WorkerSettings = field(default_factory=WorkerSettings)
    on_outcome: Callable[[JobOutcome], None] | None = None

    def __post_init__(self) -> None:
        self._wake = asyncio.Event()
        self._stopping = False
        self._loop_task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._per_registry: Counter[str] = Counter()
        self._finished = asyncio.Condition()

    def wake(self) -> None:
        """New jobs are committed: look now instead of at the next idle poll."""
        self._wake.set()

    async def start(self) -> None:
        resumed = self.store.requeue_running()
        if resumed:
            log.info("resuming %d scan job(s) left running by the last process", resumed)
        self._loop_task = asyncio.create_task(self._loop(), name="scan-workers")

    async def stop(self, drain_timeout: float = 30.0) -> None:
        """Stop claiming, let running scans finish (bounded), then cancel what is left."""
        self._stopping = True
        self._wake.set()
        if self._loop_task:
            await self._loop_task
        if self._running:
            _, pending = await asyncio.wait(self._running, timeout=drain_timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
                log.warning("%d scan(s) cancelled at shutdown; they resume on next start", len(pending))
                self.store.requeue_running()

    async def wait_for(self, job_id: str, timeout: float) -> Job | None:
        """Wait (bounded) until a job is done or failed; returns its latest state."""
        await self.wait_until(lambda: _settled(self.store.job(job_id)), timeout)
        return self.store.job(job_id)

    async def wait_until(self, condition: Callable[[], bool], timeout: float) -> bool:
        """Re-check `condition` each time a job finishes, for at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        async with self._finished:
            while not condition():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._finished.wait(), remaining)
        return True

    async def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            free = self.settings.concurrency - len(self._running)
            if free > 0:
                claimed = self.store.claim_jobs(
                    free, per_registry=self.settings.per_registry, running=self._per_registry
                )
                for job in claimed:
                    self._per_registry[job.registry] += 1
                    task = asyncio.create_task(self._run(job), name=f"scan-{job.id}")
                    self._running.add(task)
                    task.add_done_callback(self._running.discard)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._idle_delay())

    def _idle_delay(self) -> float:
        due = self.store.next_job_due()
        if due is None:
            return self.settings.idle_poll
        return max(0.0, min(self.settings.idle_poll, (due - datetime.now(UTC)).total_seconds()))

    async def _run(self, job: Job) -> None:
        started = time.monotonic()
        try:
            report = await self.scanner.scan(job.reference, ScanOptions())
            if report.error is None:
                self.store.finish_job(job.id, digest=report.digest)
            elif report.not_an_image:  # e.g. the attestation child of a multi-arch push
                log.info("scan %s: %s; nothing to badge", job.id, report.error)
                self.store.finish_job(job.id, digest=None)
            else:
                # Every failure is retried up to max_attempts: besides transient errors, a manifest
                # "not found" right after a push notification is often replication lag.
                retry_in = self._backoff(job.attempts)
                state = self.store.fail_job(job.id, report.error, retry_in=retry_in)
                log.warning("scan %s of %s failed (%s): %s", job.id, job.reference, state, report.error)
            if self.on_outcome:
                self.on_outcome(JobOutcome(job, report, time.monotonic() - started))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must not kill the worker pool
            log.exception("worker crashed on job %s", job.id)
            self.store.fail_job(job.id, f"internal error: {exc}", retry_in=self._backoff(job.attempts))
        finally:
            self._per_registry[job.registry] -= 1
            self._wake.set()
            async with self._finished:
                self._finished.notify_all()

    def _backoff(self, attempts: int) -> float:
        delay = min(self.settings.backoff_max, self.settings.backoff_base * 2 ** max(0, attempts - 1))
        return float(delay * random.uniform(0.5, 1.0))
