"""Retention: finished scan jobs do not grow for ever.

A job's row is its history (what was asked, when, by whom, how it ended); the image's report is
kept apart and stays. Each process that runs scan workers sweeps: at start and every
`SWEEP_SECONDS`, it deletes finished jobs (done or failed) last updated more than
`GPUBADGE_JOB_RETENTION_SECONDS` ago (default 7 days) and those beyond the newest
`GPUBADGE_JOB_RETENTION_COUNT` (default 100,000), oldest first, `BATCH` jobs per transaction.
Each batch is one store call off the event loop, and after each the sweeper waits as long as the
batch took, so it holds SQLite's one writer at most half the time and the webhook intake's commits
never queue behind more than one small batch; on PostgreSQL (where deletes block no insert) one
sweeper deletes at a time, however many worker processes sweep. The count needs no scan: finished
jobs are tallied as they change state (`store.queries.finished_jobs`), and only when there are more
than the cap does one read find where the newest `count` end. Queued and running jobs are never
touched. Every sweep also folds PostgreSQL's tally rows, so it runs even where the settings keep
every job.

Deployments that ended (exited, failed or stopped) go the same way, by their own policy
(`GPUBADGE_DEPLOYMENT_RETENTION_SECONDS`, default 90 days, and `GPUBADGE_DEPLOYMENT_RETENTION_COUNT`,
default 100,000), with any GPU reservation a lost update left them: every deployment ever made
stayed in the table. A live deployment (pending, pulling, running) is never touched.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial

from store import AsyncStore, queries
from store.dialect import Query

log = logging.getLogger(__name__)

SWEEP_SECONDS = 60.0  # how often a process sweeps; a cap may be passed by one interval's jobs
BATCH = 100  # jobs deleted per transaction: about 20 ms of SQLite's writer (a million-job table, 2 cores)


@dataclass(frozen=True)
class RetentionPolicy:
    """What is kept of finished jobs: `max_age_seconds` (0: any age) and `max_count` (0: any number)."""

    max_age_seconds: float
    max_count: int


async def sweep(
    store: AsyncStore, policy: RetentionPolicy, *, batch: int = BATCH, now: datetime | None = None
) -> int:
    """Delete the finished jobs `policy` no longer keeps, oldest first, `batch` per transaction;
    returns how many went. Then fold the tallies' change rows (PostgreSQL)."""
    cutoffs = await _cutoffs(
        policy,
        now,
        lambda: store.run(queries.finished_jobs),
        lambda: store.run(queries.finished_beyond, keep=policy.max_count),
    )
    deleted = await _delete_through(store, cutoffs, queries.delete_finished, batch)
    await store.compact_job_tallies()
    return deleted


async def sweep_deployments(
    store: AsyncStore, policy: RetentionPolicy, *, batch: int = BATCH, now: datetime | None = None
) -> int:
    """Delete the ended deployments `policy` no longer keeps, oldest first, `batch` per transaction;
    returns how many went."""
    cutoffs = await _cutoffs(
        policy,
        now,
        lambda: store.run(queries.ended_deployments, cap=policy.max_count + 1),
        lambda: store.run(queries.ended_beyond, keep=policy.max_count),
    )
    return await _delete_through(store, cutoffs, queries.delete_ended, batch)


async def _cutoffs(
    policy: RetentionPolicy,
    now: datetime | None,
    count: Callable[[], Awaitable[int]],
    beyond: Callable[[], Awaitable[datetime | None]],
) -> list[datetime]:
    """What `policy` deletes through: its age limit, and where the newest `max_count` end (`beyond`),
    asked only when `count` says there are more than that."""
    cutoffs: list[datetime] = []
    if policy.max_age_seconds > 0:
        cutoffs.append((now or datetime.now(UTC)) - timedelta(seconds=policy.max_age_seconds))
    if policy.max_count > 0 and await count() > policy.max_count:
        cut = await beyond()
        if cut is not None:
            cutoffs.append(cut)
    return cutoffs


async def _delete_through(
    store: AsyncStore, cutoffs: list[datetime], delete: Query[..., int], batch: int
) -> int:
    """Run `delete(through=, limit=batch)` through the latest of `cutoffs` until a batch comes back short,
    waiting after each batch as long as it took; how many went."""
    if not cutoffs:
        return 0
    through, deleted = max(cutoffs), 0
    while True:
        started = time.monotonic()
        gone = await store.run(delete, through=through, limit=batch)
        deleted += gone
        if gone < batch:
            return deleted
        await asyncio.sleep(time.monotonic() - started)  # the writer is the intake's as long again


class JobRetention:
    """Sweeps at start and every `every` seconds until stopped: finished jobs by `policy`, then ended
    deployments by `deployments` (when given); a failed sweep is logged and the next one tries again.
    `on_swept(deleted)` hears of each sweep that deleted jobs, `on_deployments_swept` of deployments."""

    def __init__(
        self,
        store: AsyncStore,
        policy: RetentionPolicy,
        *,
        deployments: RetentionPolicy | None = None,
        every: float = SWEEP_SECONDS,
        on_swept: Callable[[int], None] | None = None,
        on_deployments_swept: Callable[[int], None] | None = None,
    ) -> None:
        self.store = store
        self.policy = policy
        self.deployments = deployments
        self.on_deployments_swept = on_deployments_swept
        self.every = every
        self.on_swept = on_swept
        self.sweeps = 0  # sweeps finished, failed ones included
        self.swept = asyncio.Event()  # set after each sweep, for whoever waits on the next one
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="job-retention")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await self._logged(
                "job retention", "finished job(s)", partial(sweep, self.store, self.policy), self.on_swept
            )
            if self.deployments is not None:
                await self._logged(
                    "deployment retention",
                    "ended deployment(s)",
                    partial(sweep_deployments, self.store, self.deployments),
                    self.on_deployments_swept,
                )
            self.sweeps += 1
            self.swept.set()
            await asyncio.sleep(self.every)

    async def _logged(
        self,
        what: str,
        rows: str,
        run: Callable[[], Awaitable[int]],
        on_swept: Callable[[int], None] | None,
    ) -> None:
        """One sweep, `run`: a failure is logged (the next one tries again), a deletion logged and told."""
        try:
            deleted = await run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("%s: the sweep failed (%s); it runs again in %.0f s", what, exc, self.every)
        else:
            if deleted:
                log.info("%s: deleted %d %s", what, deleted, rows)
                if on_swept is not None:
                    on_swept(deleted)
