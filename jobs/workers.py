"""Scan workers: claim leased jobs from the store, scan, record the outcome, and never die.

Jobs live in the database, and a claimed job carries a lease that its worker renews.
A worker that crashes, is killed, or can no longer write lets its leases lapse, and
any worker sharing the store claims those jobs again, so nothing stays `running` for
ever and a `kill -9` loses nothing. Scanning is idempotent per digest (the report is
keyed by digest), so a job run twice ends in the same single report.

The claim loop is supervised: an exception from the store or the scanner is logged,
counted, and followed by a backoff, then the loop goes on. A database that refuses
writes for a while delays the work; it does not end it.

Bursts coalesce twice: the store refuses a second active job for the same reference,
and digest-only child events wait briefly, so the index job covers them first.

A scan runs as its job (`ScanOptions.job`, and `force` for a rescan): the pending report it publishes
names the job, and is another scan's answer only while that job holds its lease, so a job run again
after pre-emption, a lapsed lease or a shutdown reads its layers again (`scanner.scan`).

A worker's slot is for a scan's config facts: once the scan has published them (the pending
report, the badge), the slot takes the next job while the layers are read, up to as many scans
again (`concurrency` before their facts, `2 * concurrency` in all), so the badges of a push burst
never wait for the layers of the images pushed before them.

Work is conserved and one team's slow registry is that team's problem alone. No worker idles
while any registry has a ready job: a registry alone in the queue gets every worker. Claims are
fair across registries (the store gives each free slot to the registry with the fewest scans in
flight, least recently claimed first), so a registry that holds every slot gives one up as soon
as any of its scans ends. Where none ends (a registry dripping its bytes holds its scans until
GPUBADGE_MIN_TRANSFER_RATE cuts them off, 30 s by default), pre-emption frees one: once a registry
has waited `preempt_after` seconds with ready jobs and no scan in flight anywhere, a saturated
worker puts its longest-running scan of the busiest registry back in the queue (no attempt spent;
`store.preempt_job`) and the next claim gives that slot to the waiting registry. A registry's
Retry-After puts the job back with `not_before` and closes that registry's gate
(`store.defer_job`) instead of a worker sleeping on it. `per_registry` (GPUBADGE_PER_REGISTRY_SCANS,
unset by default) still caps one registry's scans across every worker where an operator wants it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TypeVar

from scanner.models import ImageReport
from scanner.scan import Scanner, ScanOptions
from store import AsyncStore, Job, JobState, LeaseExpiry, queries
from store.events import wait_set
from store.models import Stored

log = logging.getLogger(__name__)

T = TypeVar("T")


SATURATED_RECHECK = 1.0  # seconds; only a lost wake-up would need it
EMPTY_TRUST = 1.0  # seconds a claim that found no queued job is believed, with no queue event since
MIN_DEFER = 1.0  # seconds a job waits at least after its registry's Retry-After (even "0")


@dataclass
class WorkerSettings:
    concurrency: int = 4  # scans before their config facts are published; as many again reading layers
    per_registry: int | None = None  # a hard cap on one registry's scans (None: work-conserving, no cap)
    preempt_after: float = (
        5.0  # seconds a registry waits with no scan in flight before one is pre-empted; 0: never
    )
    backoff_base: float = 1.0  # first retry of a failed scan
    backoff_max: float = 300.0
    idle_poll: float = 5.0  # re-check the queue this often with nothing to wake us
    lease_seconds: float = 30.0
    fault_backoff_max: float = 10.0  # longest pause after a store or worker fault


@dataclass
class JobOutcome:
    job: Job
    report: ImageReport
    seconds: float


@dataclass
class WorkerEvents:
    """Hooks for metrics: what the workers did that operators should see."""

    on_outcome: Callable[[JobOutcome], None] | None = None
    on_restart: Callable[[], None] | None = None
    on_lease_expiries: Callable[[list[LeaseExpiry]], None] | None = None
    on_preempt: Callable[[Job], None] | None = None  # a scan put back for a waiting registry


def worker_identity() -> str:
    """host/pid/nonce: unique per process start, and tells a local dead process from a live one."""
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


def _local_owner_is_dead(owner: str) -> bool:
    """True for a lease holder that ran on this host in a process that no longer exists."""
    host, _, rest = owner.partition("/")
    pid_text = rest.partition("/")[0]
    if host != socket.gethostname() or not pid_text.isdigit() or int(pid_text) == os.getpid():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, owned by someone else
        return False
    return False


@dataclass
class ScanWorkers:
    """A supervised pool of asyncio workers over the store's leased job queue."""

    store: AsyncStore
    scanner: Scanner
    settings: WorkerSettings = field(default_factory=WorkerSettings)
    events: WorkerEvents = field(default_factory=WorkerEvents)

    def __post_init__(self) -> None:
        self.owner = worker_identity()
        self._wake = asyncio.Event()
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self._running: dict[str, asyncio.Task[None]] = {}  # job id -> its scan
        self._before_facts: set[str] = set()  # jobs whose config facts are not published yet
        self._recording: set[str] = set()  # jobs whose outcome is being written (the write checks the lease)
        self._started: dict[str, tuple[Job, float]] = {}  # job id -> the job and when its scan began
        self._waiting_since: dict[str, float] = {}  # registry with ready jobs and none in flight -> since
        self._next_wait_check = 0.0
        self._next_expiry_check = 0.0
        # (the queue-event count, the time) of the last claim that found no job queued at all
        self._empty_seen: tuple[int, float] | None = None
        self._unsubscribe: Callable[[], None] | None = None

    def wake(self) -> None:
        """New jobs are committed: look now instead of at the next idle poll."""
        self._wake.set()

    async def start(self) -> None:
        # Jobs queued by any process (and slots freed by any worker) wake the claim loop at once.
        self._unsubscribe = self.store.events.on_queued(self.wake)
        # Only the queue's notices: a process that serves long polls (`serve`) started its own
        # listener, for every channel, before its workers; a worker process hears no report stored.
        await self.store.start_events(jobs_only=True)
        try:  # jobs of a process on this host that died (kill -9) resume now, not when leases lapse
            dead = [
                owner for owner in await self.store.run(queries.lease_owners) if _local_owner_is_dead(owner)
            ]
            if dead:
                resumed = await self.store.release_leases(dead, refund_attempt=False)
                log.info("resuming %d scan job(s) left running by %s", resumed, ", ".join(dead))
        except Exception as exc:
            log.warning("could not look for jobs of dead workers (%s); their leases lapse on their own", exc)
        self._tasks = [
            asyncio.create_task(
                self._supervised(self._claim_once, "claim loop", self._wake), name="scan-claims"
            ),
            asyncio.create_task(
                self._supervised(self._renew_once, "lease renewal", None), name="scan-leases"
            ),
        ]

    async def stop(self, drain_timeout: float = 30.0) -> None:
        """Stop claiming, let running scans finish (bounded), then hand back what is left."""
        self._stopping = True
        self._wake.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
        running = list(self._running.values())
        if running:
            _, pending = await asyncio.wait(running, timeout=drain_timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
                log.warning("%d scan(s) cancelled at shutdown; they go back to the queue", len(pending))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:  # what we still hold goes back at once rather than when its lease lapses
            await self.store.release_leases([self.owner], refund_attempt=True)
        except Exception as exc:
            log.warning("could not hand back leases at shutdown (%s); they lapse on their own", exc)

    # ----------------------------------------------------------------- waiting

    async def wait_for(self, job_id: str, timeout: float) -> Job | None:
        """Wait (bounded) until a job is done or failed; returns its latest state."""
        return await self.store.wait_for_job(job_id, timeout)

    async def wait_until(self, condition: Callable[[], Awaitable[bool]], timeout: float) -> bool:
        """Re-check `condition` whenever a job settles, in this process or (PostgreSQL) any other."""
        return await self.store.wait_until(condition, timeout)

    # ------------------------------------------------------------- supervision

    async def _supervised(
        self, step: Callable[[], Awaitable[float]], what: str, wake: asyncio.Event | None
    ) -> None:
        """Run `step` until stopped, pausing as long as it asks (or until `wake`).

        A fault is logged and counted, then retried after a growing backoff: the loop never dies.
        """
        faults = 0
        while not self._stopping:
            if wake is not None:
                wake.clear()  # before the step, so a wake that comes during it is not lost
            try:
                pause = await step()
                faults = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                faults += 1
                pause = min(self.settings.fault_backoff_max, 0.25 * 2 ** min(faults, 8))
                pause *= random.uniform(0.75, 1.0)
                log.error("scan workers: %s failed (%s); retrying in %.1f s", what, _describe(exc), pause)
                if self.events.on_restart:
                    self.events.on_restart()
            if self._stopping:
                return
            if wake is None:
                await asyncio.sleep(pause)
                continue
            await wait_set(wake, pause)

    async def _claim_once(self) -> float:
        """One pass: requeue lapsed leases (now and then), claim what fits; returns the idle pause."""
        if time.monotonic() >= self._next_expiry_check:
            expired = await self.store.expire_leases()
            self._next_expiry_check = time.monotonic() + self.settings.lease_seconds / 3
            if expired:
                for item in expired:
                    log.warning(
                        "lease of %s on job %s (%s) lapsed; job %s",
                        item.owner,
                        item.job_id,
                        item.reference,
                        "queued again" if item.state == "queued" else "failed for good",
                    )
                if self.events.on_lease_expiries:
                    self.events.on_lease_expiries(expired)
        free = self._free_slots()
        due: datetime | None = None  # read with the claim, when it leaves slots free (one hop for both)
        if free > 0 and not self._stopping:
            believed = self._queue_known_empty()
            if believed is not None:
                return believed
            queued_count, claiming_at = self.store.events.queued_count, time.monotonic()
            claim = await self.store.claim_jobs_or_next_due(
                free,
                owner=self.owner,
                lease_seconds=self.settings.lease_seconds,
                per_registry=self.settings.per_registry,
            )
            due = claim.due
            empty = len(claim.jobs) < free and due is None
            self._empty_seen = (queued_count, claiming_at) if empty else None
            for job in claim.jobs:
                task = asyncio.create_task(self._run(job, claim.stored.get(job.id)), name=f"scan-{job.id}")
                self._running[job.id] = task
                self._started[job.id] = (job, time.monotonic())
                self._before_facts.add(job.id)
                task.add_done_callback(functools.partial(self._forget, job.id))
        if self._free_slots() <= 0:
            if self.settings.preempt_after > 0:
                await self._preempt_for_a_waiting_registry()
            # Every slot busy: a scan that ends wakes this loop, so there is no due time to read. In a
            # push burst each webhook commit wakes it; that read would cost a store hop per delivery.
            return min(self.settings.idle_poll, SATURATED_RECHECK)
        # here the claim left slots free (a full claim leaves none), or the workers are stopping
        return self._idle_delay(due)

    def _queue_known_empty(self) -> float | None:
        """When the last claim found no job queued at all, less than EMPTY_TRUST ago, and no queue
        event came since: the seconds left of that trust (the pass claims nothing and waits them
        out, or the next queue event). Else None: claim.

        In a push burst most wakes are a scan's own slot freed (its config facts published, or its
        end): a claim then, with the queue seen empty and no job queued since, finds nothing, and
        was two of the three claim passes per scan, each a write transaction and a store hop. A job
        queued meanwhile always comes with a queue event (`AsyncStore` fires one for every commit
        that queues or requeues a job; with a listener, other processes' too), and the trust is
        short, so a lost event costs a second at most."""
        seen = self._empty_seen
        if seen is None or seen[0] != self.store.events.queued_count:
            return None
        left = EMPTY_TRUST - (time.monotonic() - seen[1])
        return left if left > 0 else None

    def _free_slots(self) -> int:
        """Slots for new claims: `concurrency` scans before their config facts are published, and
        as many again still reading layers after (so a burst's badges never wait for the layers
        of the images pushed before them), whichever is fuller."""
        return min(
            self.settings.concurrency - len(self._before_facts),
            2 * self.settings.concurrency - len(self._running),
        )

    def _facts_published(self, job_id: str) -> None:
        """A scan's badge is visible and it reads layers now: its config slot goes to the next claim."""
        self._before_facts.discard(job_id)
        self._wake.set()

    def _forget(self, job_id: str, _: asyncio.Task[None]) -> None:
        self._running.pop(job_id, None)
        self._started.pop(job_id, None)
        self._before_facts.discard(job_id)
        self._recording.discard(job_id)

    async def _preempt_for_a_waiting_registry(self) -> None:
        """Every slot here is busy: if a registry has waited `preempt_after` seconds with ready jobs
        and no scan in flight in any worker, put back one scan of the busiest registry we run.

        Looked at once per SATURATED_RECHECK at most (one read of the per-registry load). The
        scan put back is this worker's longest-running one of the registry with the most scans in
        flight everywhere, and only where that registry has two or more (taking a registry's only
        scan would just move the wait). Its job is queued again at once with its attempt refunded;
        the claim that follows gives the slot to the registry with the fewest in flight.
        """
        now = time.monotonic()
        if now < self._next_wait_check:
            return
        self._next_wait_check = now + SATURATED_RECHECK
        loads = await self.store.registry_load()
        waiting = {
            load.registry
            for load in loads
            if load.ready > 0 and load.running == 0 and load.cool_down_seconds <= 0
        }
        self._waiting_since = {registry: self._waiting_since.get(registry, now) for registry in waiting}
        starved = sorted(
            (since, registry)
            for registry, since in self._waiting_since.items()
            if now - since >= self.settings.preempt_after
        )
        if not starved:
            return
        running = {load.registry: load.running for load in loads}
        # the config slots are full: one of theirs; else every slot is: any scan
        holding = (
            self._before_facts if len(self._before_facts) >= self.settings.concurrency else self._running
        )
        candidates = [
            (-running.get(job.registry, 0), began, job)
            for job_id, (job, began) in self._started.items()
            if running.get(job.registry, 0) >= 2
            and job_id in self._running
            and job_id in holding
            and job_id not in self._recording  # its scan is over: putting it back would only redo it
        ]
        if not candidates:
            return
        _, began, job = min(candidates, key=lambda item: (item[0], item[1]))
        waited_since, registry = starved[0]
        task = self._running[job.id]
        task.cancel()
        await asyncio.wait({task}, timeout=self.settings.lease_seconds)
        preempted = await self._write(lambda: self.store.preempt_job(job.id, owner=self.owner), job)
        self._waiting_since[registry] = time.monotonic()  # its grace starts again: one scan per wait
        if preempted:
            if self.events.on_preempt:
                self.events.on_preempt(job)
            log.info(
                "scan %s of %s (%s, %.1f s in flight) put back in the queue: %s has waited %.1f s"
                " with ready jobs and no scan in flight",
                job.id,
                job.reference,
                job.registry,
                now - began,
                registry,
                now - waited_since,
            )

    def _idle_delay(self, due: datetime | None) -> float:
        """The pause before the next claim pass, with the earliest queued job due at `due`."""
        pause = self.settings.idle_poll
        if due is not None:
            pause = max(0.0, min(pause, (due - datetime.now(UTC)).total_seconds()))
            if pause == 0.0:
                # A job is ready but this pass did not take it: every slot is busy, its registry is at
                # its cap, or another worker holds it. Looking again at once would spin (a query per
                # turn); a settle or a new job wakes the loop anyway, so wait for that.
                pause = min(self.settings.idle_poll, SATURATED_RECHECK)
        return min(pause, self.settings.lease_seconds / 3)

    async def _renew_once(self) -> float:
        """Renew the leases of every running scan; stop scans whose lease was taken away."""
        interval = self.settings.lease_seconds / 3
        ids = list(self._running)
        if ids:
            held = set(await self.store.renew_leases(self.owner, ids, self.settings.lease_seconds))
            for job_id in ids:
                task = self._running.get(job_id)
                # A job whose outcome is being written is not renewed once that write commits (it is
                # done): its scan is not cancelled, and a lease truly lost shows in that write's answer.
                if job_id in self._recording:
                    continue
                if job_id not in held and task is not None and not task.done():
                    log.warning("lost the lease on job %s; another worker runs it now", job_id)
                    task.cancel()
        return interval

    # --------------------------------------------------------------- one job

    async def _run(self, job: Job, stored: Stored | None = None) -> None:
        """Scan one claimed job and record its outcome; `stored`: what the store held for the job's
        digest when the claim read it (the scan then does not read it again)."""
        started = time.monotonic()
        try:
            options = ScanOptions(
                force=job.rescan,
                job=job.id,
                on_facts=functools.partial(self._facts_published, job.id),
                stored=stored,
            )
            report = await self.scanner.scan(job.reference, options)
            # Counted before the outcome is written: whoever sees the job settled sees it counted.
            if self.events.on_outcome:
                self.events.on_outcome(JobOutcome(job, report, time.monotonic() - started))
            self._recording.add(job.id)
            await self._record(job, report)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must not kill the pool; the lease brings the job back
            log.exception("worker crashed on job %s", job.id)
            error = f"internal error: {_describe(exc)}"
            self._recording.add(job.id)

            async def fail() -> JobState | None:
                return await self.store.fail_job(
                    job.id, error, retry_in=self._backoff(job.attempts), owner=self.owner
                )

            await self._write(fail, job)
        finally:
            self._wake.set()

    async def _record(self, job: Job, report: ImageReport) -> None:
        failure = report.error or _platform_failure(report)
        if failure is not None and report.retry_after is not None and report.retryable:
            # The registry asked us to come back later: no attempt spent, no worker asleep on it,
            # and none of its other jobs claimed before then; other registries go on meanwhile.
            wait = max(MIN_DEFER, report.retry_after)

            async def defer() -> bool:
                return await self.store.defer_job(job.id, failure, retry_in=wait, owner=self.owner)

            await self._write(defer, job)
            log.warning(
                "scan %s of %s: %s asked to wait; back in the queue for %.0f s, with its registry's other jobs",
                job.id,
                job.reference,
                job.registry,
                wait,
            )
            return
        if report.error is None and (broken := _platform_failure(report)) is not None:
            # The report is stored (its config facts stand), but a platform's layers could not be
            # read: the job fails with that error, and is retried when another try may pass.
            retry_in = self._backoff(job.attempts) if report.retryable else None

            async def fail_platform() -> JobState | None:
                return await self.store.fail_job(job.id, broken, retry_in=retry_in, owner=self.owner)

            state = await self._write(fail_platform, job)
            log.warning("scan %s of %s (%s): %s", job.id, job.reference, state, broken)
            return
        if report.error is None or report.not_an_image:
            if report.error is not None:  # e.g. the attestation child of a multi-arch push
                log.info("scan %s: %s; nothing to badge", job.id, report.error)
            digest = report.digest if report.error is None else None
            held = await self._write(
                lambda: self.store.finish_job(job.id, digest=digest, owner=self.owner), job
            )
            if held is False:
                log.warning("job %s finished after its lease lapsed; the rerun records it", job.id)
            return
        # Failures are retried up to max_attempts: besides transient errors, a manifest "not found"
        # right after a push notification is often replication lag. A bound that the image exceeds
        # can never pass, so it fails for good at once.
        retry_in = self._backoff(job.attempts) if report.retryable else None
        error = report.error or "scan failed"

        async def fail() -> JobState | None:
            return await self.store.fail_job(job.id, error, retry_in=retry_in, owner=self.owner)

        state = await self._write(fail, job)
        log.warning("scan %s of %s failed (%s): %s", job.id, job.reference, state, report.error)

    async def _write(self, write: Callable[[], Awaitable[T]], job: Job) -> T | None:
        """Retry an outcome write through a database fault for as long as the lease would last.

        Past that, the job's lease lapses and another claim runs it again, so giving up loses nothing.
        """
        deadline = time.monotonic() + self.settings.lease_seconds
        delay = 0.2
        while True:
            try:
                return await write()
            except Exception as exc:
                if time.monotonic() + delay > deadline:
                    log.error(
                        "cannot record job %s (%s); its lease will bring it back", job.id, _describe(exc)
                    )
                    return None
                log.warning(
                    "cannot record job %s yet (%s); retrying in %.1f s", job.id, _describe(exc), delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _backoff(self, attempts: int) -> float:
        delay = min(self.settings.backoff_max, self.settings.backoff_base * 2 ** max(0, attempts - 1))
        return float(delay * random.uniform(0.5, 1.0))


def _platform_failure(report: ImageReport) -> str | None:
    """The first platform error of a stored report, as `platform: error`, or None."""
    for platform in report.platforms:
        if platform.error:
            return platform.error if len(report.platforms) == 1 else f"{platform.platform}: {platform.error}"
    return None


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return text or type(exc).__name__
