"""The store's front door: one typed hop off the event loop, plus what adds behaviour.

`run(query, ...)` runs any of `store.queries` in a thread, as datasette's `execute_fn` does: a
locked or slow database then delays only the requests that need it; the loop keeps serving
everything else. The pool is bounded (`threads`). The health check and webhook intake each have a
thread of their own: a pool full of calls stuck behind a lock cannot hide that lock from /healthz,
and a webhook's 202 never waits for a pool thread.

Besides `run`, `AsyncStore` has a method for each engine-specific call a caller needs (claims,
leases, outcomes, registry load, queue health, GPU reservations): some only hop, others add
events fired after a commit, the health check's sharing and deadline, or the group commit of
scan results (`scan_cache`). Code on a thread of its own that may block (the webhook intake's
commit thread, an export being built) uses `blocking`, the same store without the hop. Callers
need not reach the backend (`backend` remains for callers not yet moved).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, overload

from scanner.models import ImageReport, PlatformReport
from scanner.registry.reference import ReferenceError, parse_reference
from store import queries
from store.backend import LoopCommits, StoreBackend
from store.dialect import Query
from store.events import (
    ALL_CHANNELS,
    FLEET_CHANNEL,
    FLEET_INVENTORY,
    FLEET_RESERVATIONS,
    FLEET_STAMPS,
    JOB_CHANNELS,
    JOB_SETTLED_CHANNEL,
    JOBS_QUEUED_CHANNEL,
    LOCAL_RECHECK,
    QUEUED,
    REFERENCE_CHANNEL,
    REPORTED_JOB,
    RESYNC,
    SETTLED,
    QueueEvents,
    wait_set,
)
from store.models import (
    ClaimPass,
    EnqueueBatch,
    Job,
    JobState,
    LeaseExpiry,
    QueueHealth,
    RegistryLoad,
    StoreUnavailable,
)
from store.queries.jobs import JobEnd
from store.queries.reports import ScanWrite
from store.queries.tags import LayerSeen, TagSeen
from store.report_lookups import Found, ReportLookups

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

LISTEN_READY_SECONDS = 10.0  # `start_events` waits this long at most for PostgreSQL's LISTEN to be in place
EVIDENCE_CACHE_BYTES = 8 << 20  # layers' cache entries kept in memory by a process that scans


LINGER_SECONDS = 0.05  # a write no caller waits for joins the next batch, or goes on its own this soon
# A scan job's config facts, when its layers read in moments (`scanner.scan.QUICK_READ_BYTES`), wait
# this long for the final report that supersedes them: under a burst a quick scan's layers take tens
# of milliseconds of wall time behind the other scans, and a 50 ms hold still stored half of them.
FACTS_HOLD_SECONDS = 0.5
LINGER_RETRY_SECONDS = 1.0  # a batch failed: its unawaited writes are tried again this soon, or with the next
LINGER_ATTEMPTS = 5  # batches an unawaited write may fail with before it is given up (and logged)


class StoreScanCache:
    """The scanner's `ScanCache` (scanner/cache.py) over an `AsyncStore`, with its writes (reports,
    tags, layers' cache entries, the ends of scan jobs) group-committed and layers' cache entries
    kept in memory too.

    Concurrent scans each await their own tag and report writes, and each write returns only
    after its commit (the same durability as one transaction per write). While one batch
    commits, the writes that arrive meanwhile gather, and the next batch takes them all in one
    transaction (`queries.save_scan_results`): one thread hop, one commit and one prepared
    statement per kind for the batch, however many scans wrote. A batch that fails fails every
    write in it, each caller with the store's own error.

    Some writes wait for no commit; they join the next batch:
    - a layer's cache entry (`save_layer_evidence`): this process answers from memory at once,
      and a crash before its commit costs a read of the layer, never an answer;
    - a scan job's reports (`save_report(..., with_next_write=True)`): its config facts, held back
      for `FACTS_HOLD_SECONDS` before they join a batch, so that the final report, which supersedes
      them, usually comes first (a small image's scan commits once, even while other scans' batches
      commit; a tag sighting held with them is stored all the same); and its final report, which
      the job's end follows at once (`finish_job`, `AsyncStore.finish_job`): the two commit in one
      transaction, so a job is never done without its report. Any other outcome of
      the job (`fail_job`, `defer_job`) first flushes what is queued. A queued report is the
      caller's no more: it must not be changed after the call.
    Nothing waits for them, so they are never lost to a batch that fails: they are tried again
    with the next batch, or on their own after `LINGER_RETRY_SECONDS`, up to `LINGER_ATTEMPTS`
    batches; one that no write follows commits after `LINGER_SECONDS`.
    """

    def __init__(self, store: AsyncStore, evidence_bytes: int = EVIDENCE_CACHE_BYTES) -> None:
        self._store = store
        self._pending: list[_Queued] = []
        self._draining: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        # A scan job's config facts held back by digest, and the timer that queues them (`_hold`).
        self._held: dict[str, tuple[tuple[ScanWrite, ...], asyncio.TimerHandle]] = {}
        # Layers' cache entries read or written here, by digest: a layer's content never changes, so
        # a base layer shared by a burst's images is read once, not once per scan. Another process's
        # richer entry may go unseen; the layer is then read again (more work, never a wrong answer).
        self._evidence: OrderedDict[str, str] = OrderedDict()
        self._evidence_bytes = 0
        self._evidence_limit = evidence_bytes

    @property
    def store(self) -> AsyncStore:
        return self._store

    async def report(self, digest: str) -> ImageReport | None:
        return await self._store.run(queries.report, digest)

    async def platform_report(self, digest: str) -> PlatformReport | None:
        return await self._store.run(queries.platform_report, digest)

    async def stored(self, digest: str) -> tuple[ImageReport | None, PlatformReport | None]:
        return await self._store.run(queries.stored, digest)

    async def scan_in_flight(self, job_id: str) -> bool:
        return await self._store.run(queries.scan_in_flight, job_id)

    async def layer_evidence(self, digest: str) -> str | None:
        known = self._evidence.get(digest)
        if known is not None:
            self._evidence.move_to_end(digest)
            return known
        found = await self._store.run(queries.layer_evidence, digest)
        if found is not None:
            self._keep_evidence(digest, found)
        return found

    async def layer_evidences(self, digests: Sequence[str]) -> dict[str, str]:
        """The cache entries of those of `digests` held here or in the store: one read at most."""
        found: dict[str, str] = {}
        for digest in digests:
            known = self._evidence.get(digest)
            if known is not None:
                self._evidence.move_to_end(digest)
                found[digest] = known
        missing = [digest for digest in digests if digest not in found]
        if missing:
            stored = await self._store.run(queries.layer_evidences, missing)
            for digest, entry in stored.items():
                self._keep_evidence(digest, entry)
            found.update(stored)
        return found

    async def save_layer_evidence(self, digest: str, evidence_json: str) -> None:
        """Store a layer's cache entry with the next batch of scan results; this process answers
        from memory meanwhile. An entry too big to keep in memory is awaited (another scan of
        this process then finds it stored)."""
        if self._keep_evidence(digest, evidence_json):
            self._linger(LayerSeen(digest, evidence_json))
        else:
            await self._write(LayerSeen(digest, evidence_json))

    def _keep_evidence(self, digest: str, evidence_json: str) -> bool:
        old = self._evidence.pop(digest, None)
        if old is not None:
            self._evidence_bytes -= len(old)
        if len(evidence_json) > self._evidence_limit:
            return False
        self._evidence[digest] = evidence_json
        self._evidence_bytes += len(evidence_json)
        while self._evidence_bytes > self._evidence_limit:
            _, dropped = self._evidence.popitem(last=False)
            self._evidence_bytes -= len(dropped)
        return True

    async def record_tag(self, registry: str, repository: str, tag: str, digest: str) -> None:
        await self._write(TagSeen(registry, repository, tag, digest))

    async def resolve_tag(self, registry: str, repository: str, tag: str) -> str | None:
        return await self._store.run(queries.resolve_tag, registry, repository, tag)

    async def save_report(self, report: ImageReport, *, with_next_write: bool = False) -> None:
        """Store a report (also a pending one) and the tag it was scanned by, in one transaction;
        at its commit the long polls on its reference wake (they find the tag pointing at it).
        `with_next_write`: return at once; the report commits with the next write (a scan job's
        end), see the class's docstring."""
        if report.error is not None or report.digest is None:
            raise ValueError("only successful reports are stored")  # before it can fail a batch
        writes: tuple[ScanWrite, ...] = (report,)
        if report.registry and report.repository and report.tag:
            writes = (TagSeen(report.registry, report.repository, report.tag, report.digest), report)
        if with_next_write and report.pending:
            self._hold(report.digest, writes)
        elif with_next_write:
            self._linger(*writes)
        else:
            await self._write(*writes)

    async def finish_job(self, job_id: str, *, digest: str | None, owner: str) -> bool:
        """Mark a running job done, in one transaction with the scan results queued before it (its
        final report); False (and nothing written) when `owner` no longer holds its lease."""
        [finished] = await self._write(JobEnd(job_id, digest, owner))
        return bool(finished)

    async def flush(self) -> None:
        """Commit what is queued or committing now, held facts included, in one try; a failure leaves
        the unawaited writes queued."""
        for digest in list(self._held):
            self._release(digest)
        if not self._pending and (self._draining is None or self._draining.done()):
            return
        with contextlib.suppress(Exception):
            await self._write()

    def _hold(self, digest: str, writes: tuple[ScanWrite, ...]) -> None:
        """Hold a scan job's config facts back for `FACTS_HOLD_SECONDS`, then queue them (`_release`),
        unless a report of the same digest comes first and supersedes them."""
        self._queue_unawaited(self._supersede_held(digest, writes))
        timer = asyncio.get_running_loop().call_later(FACTS_HOLD_SECONDS, self._release, digest)
        self._held[digest] = (writes, timer)

    def _release(self, digest: str) -> None:
        held = self._held.pop(digest, None)
        if held is not None:
            held[1].cancel()
            self._linger(*held[0])

    def _supersede_held(self, digest: str, writes: Sequence[ScanWrite]) -> list[ScanWrite]:
        """Drop the facts held for `digest`, which `writes` supersede; the tag sightings held with
        them that `writes` do not repeat are returned, to be stored all the same."""
        held = self._held.pop(digest, None)
        if held is None:
            return []
        held[1].cancel()
        return [write for write in held[0] if isinstance(write, TagSeen) and write not in writes]

    def _queue_unawaited(self, writes: Sequence[ScanWrite]) -> None:
        """Queue `writes` for the next batch, nobody waiting (a batch starts within `LINGER_SECONDS`)."""
        if writes:
            self._pending.extend(_Queued(write, None) for write in writes)
            self._wake_drain(LINGER_SECONDS)

    def _linger(self, *writes: ScanWrite) -> None:
        """Queue `writes` for the next batch, nobody waiting. A report supersedes a queued or held
        report of the same digest (a scan's config facts, when its final report comes before they
        commit), and a tag seen again the queued sighting."""
        digests = {write.digest for write in writes if isinstance(write, ImageReport)}
        for digest in digests:
            if digest is not None:
                self._queue_unawaited(self._supersede_held(digest, writes))
        if digests:
            self._pending = [
                item
                for item in self._pending
                if item.done is not None
                or not (
                    (isinstance(item.write, ImageReport) and item.write.digest in digests)
                    or (isinstance(item.write, TagSeen) and item.write in writes)
                )
            ]
        self._pending.extend(_Queued(write, None) for write in writes)
        self._wake_drain(LINGER_SECONDS)

    def _wake_drain(self, delay: float) -> None:
        """Start a drain in `delay` seconds, unless one runs (it takes what is queued) or is due."""
        if (self._draining is None or self._draining.done()) and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(delay, self._start_drain)

    def _start_drain(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pending and (self._draining is None or self._draining.done()):
            self._draining = asyncio.get_running_loop().create_task(self._drain())

    async def _write(self, *writes: ScanWrite) -> list[Any]:
        """Queue `writes` (they go in the same batch, with whatever is queued) and wait for their
        commit; each one's result (a `JobEnd`: whether its lease held)."""
        loop = asyncio.get_running_loop()
        done: list[asyncio.Future[Any]] = []
        for write in writes:
            if isinstance(write, ImageReport) and write.digest is not None:  # never land after it
                self._queue_unawaited(self._supersede_held(write.digest, writes))
            done.append(loop.create_future())
            self._pending.append(_Queued(write, done[-1]))
        if not writes:  # a flush: wait for the batch that takes what is queued now
            done.append(loop.create_future())
            self._pending.append(_Queued(None, done[-1]))
        self._start_drain()
        outcomes = await asyncio.gather(*done, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome  # the same error for each write of a failed batch
        return outcomes[: len(writes)]

    async def _drain(self) -> None:
        """Commit what has gathered, batch after batch, until nothing waits."""
        while self._pending:
            batch, self._pending = self._pending, []
            writes = [item.write for item in batch if item.write is not None]
            try:
                finished = await self._store.run(queries.save_scan_results, writes) if writes else frozenset()
            except Exception as exc:
                for item in batch:
                    if item.done is not None:
                        if not item.done.done():
                            item.done.set_exception(exc)
                    elif item.attempts + 1 < LINGER_ATTEMPTS:
                        self._pending.append(_Queued(item.write, None, item.attempts + 1))
                    else:
                        log.error(
                            "a queued scan result was not stored after %d tries (%s): %s",
                            LINGER_ATTEMPTS,
                            exc,
                            _describe_write(item.write),
                        )
                if all(item.done is None for item in self._pending):
                    break  # only unawaited writes are left: not again at once, the store just failed
            except BaseException:  # cancelled (the loop is closing): no writer waits forever
                for item in [*batch, *self._pending]:
                    if item.done is not None:
                        item.done.cancel()
                self._pending = []
                raise
            else:
                for item in batch:
                    if isinstance(item.write, ImageReport):  # long polls here wake on its commit
                        self._store._fire_local(SETTLED, f"{REPORTED_JOB} {item.write.reference}")
                    if item.done is not None and not item.done.done():
                        result = item.write.job_id in finished if isinstance(item.write, JobEnd) else None
                        item.done.set_result(result)
        if self._pending:
            self._draining = None
            self._wake_drain(LINGER_RETRY_SECONDS)


@dataclass(frozen=True)
class _Queued:
    """A write waiting for its batch: `done` settles with its outcome, None when nobody waits (it is
    then tried again when a batch fails, `attempts` counting); a `write` of None is a flush's marker."""

    write: ScanWrite | None
    done: asyncio.Future[Any] | None
    attempts: int = 0


def _describe_write(write: ScanWrite | None) -> str:
    if isinstance(write, ImageReport):
        return f"the report of {write.reference} (its job's lease brings the scan back)"
    if isinstance(write, LayerSeen):
        return f"the cache entry of layer {write.digest} (the layer is read again when needed)"
    return repr(write)


class StoreThreads:
    """The store's bounded pool of threads, with one hand-over each way and nothing more.

    A store call is small (a read of one row, one short transaction), and every scan and request
    makes several, so what the hop itself costs counts: `run_in_executor` checks that the callable
    is no coroutine function, makes a concurrent future, chains it to an asyncio future and copies
    its state across, about a fifth of a small call's CPU (yappi, bench/RESULTS.md). Here a call
    is one queue put, and its result one `call_soon_threadsafe` that settles the caller's future.
    Threads start as calls need them, up to `threads`."""

    def __init__(self, threads: int, name: str) -> None:
        self._limit = threads
        self._name = name
        self._calls: queue.SimpleQueue[
            tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Callable[[], Any]] | None
        ] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()

    def run(self, call: Callable[[], T]) -> asyncio.Future[T]:
        """`call()` in one of the threads; a future of this loop that its outcome settles."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._idle == 0 and len(self._threads) < self._limit:
                thread = threading.Thread(
                    target=self._serve, name=f"{self._name}_{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            else:
                self._idle = max(0, self._idle - 1)
        self._calls.put((loop, future, call))
        return future

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            loop, future, call = item
            try:
                outcome, failed = call(), False
            except BaseException as exc:  # the caller's to handle, on its loop
                outcome, failed = exc, True
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for it
                loop.call_soon_threadsafe(_settle, future, outcome, failed)
            del item, future, outcome  # nothing of the call outlives it here
            with self._lock:
                self._idle += 1

    def shutdown(self) -> None:
        """Let the calls handed over finish, then end the threads."""
        for _ in self._threads:
            self._calls.put(None)
        for thread in self._threads:
            thread.join()


def _digest_of(job: Job) -> str | None:
    """The digest a job's reference names, if it names one (a webhook's job does)."""
    try:
        return parse_reference(job.reference).digest
    except ReferenceError:
        return None


def _settle(future: asyncio.Future[Any], outcome: Any, failed: bool) -> None:
    """On the loop: a store call's outcome, unless its caller gave up (cancelled)."""
    if future.done():
        return
    if failed:
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class BlockingStore:
    """The store for code that runs on a thread of its own and may block, never on the event loop:
    the webhook intake's commit thread, an export being built. Shared queries and the intake's
    group commit, synchronously; nothing engine-specific."""

    __slots__ = ("_backend",)

    def __init__(self, backend: StoreBackend) -> None:
        self._backend = backend

    def run(self, query: Query[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run one of `store.queries` here, on the caller's thread: a read, or a write in one transaction."""
        return self._backend.run(query, *args, **kwargs)

    def enqueue_many(self, batches: Sequence[EnqueueBatch]) -> list[list[str]]:
        """The webhook intake's commit: every delivery's jobs in one commit, a job id per reference,
        per batch, never waiting for a scan's lock (`record_intake`; on SQLite, and on PostgreSQL
        with `intake_journal`, the intake's journal). The caller wakes the loop's workers and
        waiters afterwards (`AsyncStore.jobs_queued`)."""
        return self._backend.record_intake(batches)

    def tidy_intake(self) -> None:
        """Between answers, on the intake's thread: what its commits left to clean (the journal's
        rows already moved into the store)."""
        self._backend.tidy_intake()

    def queued_for_intake(self, cap: int) -> int:
        """Jobs waiting to run, up to `cap`, as the intake's queue cap counts them: never waiting for
        a writer (the store's queued jobs plus, with a journal, its rows not yet moved)."""
        return self._backend.queued_for_intake(cap)


class AsyncStore:
    """Async facade over one synchronous backend: the one way callers reach the store."""

    def __init__(
        self,
        backend: StoreBackend,
        *,
        threads: int = 8,
        report_cache_entries: int = 512,
        report_cache_seconds: float = 30.0,
    ) -> None:
        self._backend = backend
        self._pool = StoreThreads(threads, "store")
        self._health_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-health")
        self._intake_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-intake")
        self._health_check: tuple[float, Future[None]] | None = None
        self.events = QueueEvents()
        self._stop_listening: Callable[[], None] | None = None  # any thread
        self._detach_listener: Callable[[], None] | None = None  # on the loop, before it
        self._relay_task: asyncio.Task[None] | None = None  # PostgreSQL's notices, relayed on the loop
        self.scan_cache = StoreScanCache(self)
        self.blocking = BlockingStore(backend)
        self.report_lookups = ReportLookups(
            self._read_reference,
            entries=report_cache_entries,
            reuse_seconds=report_cache_seconds,
            cross_process=lambda: self.events.cross_process,
        )
        self.events.on_settled(self.report_lookups.forget)

    @property
    def backend(self) -> StoreBackend:
        """The engine behind the facade, for tests that inspect it; the service (web/) goes through
        the methods here, `run` and `blocking` (tests/test_web_layers.py holds it to that)."""
        return self._backend

    @overload
    async def run(self, function: Query[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T: ...

    @overload
    async def run(self, function: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T: ...

    async def run(self, function: object, /, *args: object, **kwargs: object) -> object:
        """Run a query of `store.queries` (through the backend's `run`: a read, or a write in one
        transaction), or any other blocking function, in the store's thread pool: the event loop
        only waits. The one way off the loop for a shared query."""
        if isinstance(function, Query):
            call = functools.partial(self._backend.run, function, *args, **kwargs)
        else:
            assert callable(function)
            call = functools.partial(function, *args, **kwargs)
        try:
            return await self._pool.run(call)
        finally:
            if isinstance(function, Query) and function in queries.REPORT_WRITES:
                self.report_lookups.forget()

    async def reference_report(self, registry: str, repository: str, tag: str, digest: str | None) -> Found:
        """`queries.reference_report`, answered from memory while nothing may have changed it
        (`store.report_lookups`): the lookup every placement request starts with."""
        return await self.report_lookups.reference_report(registry, repository, tag, digest)

    async def _read_reference(self, registry: str, repository: str, tag: str, digest: str | None) -> Found:
        return await self.run(queries.reference_report, registry, repository, tag, digest)

    async def close(self) -> None:
        """Commit the scan results still queued, wait for calls in flight, then close the backend's
        connections."""
        await self.scan_cache.flush()
        if self._detach_listener is not None:
            self._detach_listener()
        if self._relay_task is not None:
            self._relay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._relay_task
        await asyncio.get_running_loop().run_in_executor(None, self._shutdown)

    def _shutdown(self) -> None:
        if self._stop_listening is not None:
            self._stop_listening()
        self._intake_pool.shutdown(wait=True)
        self._pool.shutdown()
        self._health_pool.shutdown(wait=False, cancel_futures=True)
        self._backend.close()

    async def health(self, timeout: float) -> StoreUnavailable | None:
        """None when the database answers and takes a write within `timeout`; else why not, in words
        (the message for operators, `public` for anyone).

        Never waits longer than `timeout`. Overlapping callers share one check in flight; a check
        stuck past its own deadline is reported as stuck, never queued behind.
        """
        now = time.monotonic()
        if self._health_check is not None and not self._health_check[1].done():
            started, check = self._health_check
            if now - started > timeout:
                stuck = f"the database has not answered a write check for {now - started:.1f} s"
                return StoreUnavailable(stuck, stuck)
        else:
            started, check = now, self._health_pool.submit(self._backend.check_writable, timeout)
            self._health_check = (started, check)
        try:
            # shield: one caller giving up must not cancel the check the others share
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(check)), started + timeout + 0.25 - now)
        except TimeoutError:
            slow = f"the database did not take a write within {timeout:.1f} s"
            return StoreUnavailable(slow, slow)
        except StoreUnavailable as exc:
            return exc
        return None

    # ------------------------------------------------------------ engine-specific, one hop

    async def queue_health(self) -> QueueHealth:
        """What /healthz says of the scan queue: ready jobs, the oldest one's wait, the last progress."""
        return await self.run(self._backend.queue_health)

    async def registry_load(self) -> list[RegistryLoad]:
        """Every registry with running or queued jobs, or a closed gate, by name."""
        return await self.run(self._backend.registry_load)

    async def compact_job_tallies(self) -> None:
        """Fold the finished-job counts' change rows (PostgreSQL; nothing to do on SQLite)."""
        await self.run(self._backend.compact_job_tallies)

    async def claim_jobs(
        self, limit: int, *, owner: str, lease_seconds: float, per_registry: int | None = None
    ) -> list[Job]:
        """Lease up to `limit` ready jobs to `owner`, shared fairly across registries (at most
        `per_registry` running per registry, when given)."""
        return await self.run(
            self._backend.claim_jobs,
            limit,
            owner=owner,
            lease_seconds=lease_seconds,
            per_registry=per_registry,
        )

    async def claim_jobs_or_next_due(
        self, limit: int, *, owner: str, lease_seconds: float, per_registry: int | None = None
    ) -> ClaimPass:
        """`claim_jobs`; when it leaves slots free, when the earliest queued job is due
        (`queries.next_job_due`); and what the store holds for the claimed jobs' digests
        (`queries.stored_many`, which each scan would otherwise read first): all in one hop to the
        store's threads, as a worker's claim pass needs them and each hop wakes a thread and then
        the loop (a few hundred microseconds of CPU each on a VM).

        A queued job wakes every worker process, and one claim takes it. So a pass first reads
        whether any job is due (`queries.job_ready`, an index probe): the passes that come after the
        claim that took it write nothing and ask for no turn (the backends' `claim_jobs` probes again
        once it has the turn, for the passes that asked meanwhile)."""
        backend = self._backend

        def claim_then_look() -> ClaimPass:
            if not backend.run(queries.job_ready):  # none due (another process's claim took it): no write
                return ClaimPass([], backend.run(queries.next_job_due), {})
            claimed = backend.claim_jobs(
                limit, owner=owner, lease_seconds=lease_seconds, per_registry=per_registry
            )
            due = backend.run(queries.next_job_due) if len(claimed) < limit else None
            digests = {job.id: digest for job in claimed if not job.rescan and (digest := _digest_of(job))}
            found = backend.run(queries.stored_many, sorted(set(digests.values()))) if digests else {}
            return ClaimPass(claimed, due, {job_id: found[digest] for job_id, digest in digests.items()})

        return await self.run(claim_then_look)

    async def renew_leases(self, owner: str, job_ids: Sequence[str], lease_seconds: float) -> list[str]:
        """Extend `owner`'s leases on `job_ids`; the ids it still holds."""
        return await self.run(self._backend.renew_leases, owner, job_ids, lease_seconds)

    async def create_deployment(
        self, deployment_id: str, server: str, gpus: Sequence[str], record_json: str
    ) -> None:
        """Reserve `gpus` and record the deployment in one transaction, or raise GpuTaken."""
        await self.run(self._backend.create_deployment, deployment_id, server, gpus, record_json)

    # ------------------------------------------------------------ writes that wake others

    async def enqueue(
        self,
        references: Sequence[tuple[str, str] | tuple[str, str, float]],
        *,
        source: str | None = None,
        max_attempts: int = 5,
        delay: float = 0.0,
        rescan: bool = False,
    ) -> list[str]:
        """One delivery's jobs (see `enqueue_many`); `rescan`: scan again, reusing nothing stored."""
        batch = EnqueueBatch(references, source, max_attempts, delay, rescan)
        return (await self.enqueue_many([batch]))[0]

    async def enqueue_many(self, batches: Sequence[EnqueueBatch]) -> list[list[str]]:
        """Webhook intake: its own thread, so it never queues behind scan writes for a pool thread."""
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self._intake_pool, self._backend.enqueue_many, batches)
        self._fire_local(QUEUED)
        return ids

    async def expire_leases(self) -> list[LeaseExpiry]:
        expired = await self.run(self._backend.expire_leases)
        if any(item.state == "failed" for item in expired):
            self._fire_local(SETTLED)
        if any(item.state != "failed" for item in expired):  # queued again: claimable
            self._fire_local(QUEUED)
        return expired

    async def release_leases(self, owners: Sequence[str], *, refund_attempt: bool) -> int:
        released = await self.run(self._backend.release_leases, owners, refund_attempt=refund_attempt)
        if released:
            self._fire_local(QUEUED)
        return released

    async def preempt_job(self, job_id: str, *, owner: str) -> bool:
        """Put a running job back in the queue at once (its worker's slot goes to another registry)."""
        preempted = await self.run(self._backend.preempt_job, job_id, owner=owner)
        if preempted:
            self._fire_local(QUEUED)
        return preempted

    async def finish_job(self, job_id: str, *, digest: str | None, owner: str) -> bool:
        """Mark a job done, in one transaction with the scan results queued before it (its final
        report: `StoreScanCache`); False (and nothing written) when `owner` no longer holds its lease."""
        finished = await self.scan_cache.finish_job(job_id, digest=digest, owner=owner)
        self._fire_local(SETTLED)
        return finished

    async def fail_job(
        self, job_id: str, error: str, *, retry_in: float | None, owner: str
    ) -> JobState | None:
        await self.scan_cache.flush()  # the scan's report, queued, commits first
        state = await self.run(self._backend.fail_job, job_id, error, retry_in=retry_in, owner=owner)
        self._fire_local(QUEUED if state == "queued" else SETTLED)
        return state

    async def retry_job(self, job_id: str) -> Job | None:
        job = await self.run(self._backend.retry_job, job_id)
        if job is not None and job.state == "queued":
            self._fire_local(QUEUED)
        return job

    # ------------------------------------------------------------------ events

    def jobs_queued(self) -> None:
        """On the loop: jobs were committed from a caller's own thread (the webhook intake calls
        `blocking.enqueue_many` there); wake this process's workers and waiters as `enqueue_many` does."""
        self._fire_local(QUEUED)

    @property
    def local_reads(self) -> bool:
        """Whether a read is this host's own (SQLite: a file that never waits for a writer) rather
        than a round trip to a server (PostgreSQL)."""
        return self._backend.local_reads

    def intake_unmoved(self) -> int:
        """Jobs this process's intake journaled that are not in the store's queue yet (0 without a
        journal); read from memory, so safe on the loop."""
        return self._backend.intake_unmoved()

    def loop_intake(self) -> LoopCommits | None:
        """The webhook intake's commits on the event loop, on a connection of their own, where the
        engine has an async driver (PostgreSQL); None where it has not, or where the intake journals
        (SQLite, PostgreSQL with `intake_journal`: `blocking.enqueue_many` on the intake's thread). The caller closes it, and wakes the loop's workers and waiters after
        each commit (`jobs_queued`)."""
        return self._backend.loop_intake()

    def _fire_local(self, kind: str, payload: str = "") -> None:
        """This process's own write, for its own waiters and workers. With a PostgreSQL listener the
        NOTIFY of the same commit comes back to every process (this one too), keyed by job and
        reference, so firing here as well would only wake everyone a second time."""
        if not self.events.cross_process:
            self.events.fire(kind, payload)

    async def start_intake(self) -> None:
        """Ready the webhook intake's commit path now rather than at the first delivery (on SQLite,
        its journal and mover, and on PostgreSQL with `intake_journal`: what a previous run journaled
        and did not move is moved now)."""
        await asyncio.get_running_loop().run_in_executor(self._intake_pool, self._backend.start_intake)

    async def start_events(self, *, jobs_only: bool = False) -> None:
        """Deliver queue events on this loop; on PostgreSQL, and on a SQLite file whose processes
        share their events (`store.sqlite_notify`), also every other process's (LISTEN).

        `jobs_only`: hear only the queue's channels (`store.events.JOB_CHANNELS`: jobs queued, jobs
        settled), for a process that only runs scan workers; not the references whose report or
        tag changed, nor the fleet's. Idempotent: the first call decides (`serve` makes its own
        before its in-process workers start theirs). Without it, events fired by this process's
        own writes still reach waiters.
        """
        loop = asyncio.get_running_loop()
        if not getattr(self._backend, "shares_events", False):
            return
        if self._stop_listening is not None or self._relay_task is not None:
            return
        channels = JOB_CHANNELS if jobs_only else ALL_CHANNELS
        kinds = {JOBS_QUEUED_CHANNEL: QUEUED, JOB_SETTLED_CHANNEL: SETTLED}

        fire = self.events.fire

        def on_notify(notification: tuple[str, str]) -> None:  # on this loop
            channel, payload = notification
            if channel == REFERENCE_CHANNEL:
                fire(SETTLED, f"{REPORTED_JOB} {payload}")
            elif channel == FLEET_CHANNEL:
                if payload.startswith("stamps"):
                    fire(FLEET_STAMPS, payload.partition(" ")[2])
                elif payload == "reservations":
                    fire(FLEET_RESERVATIONS, "")
                else:  # "inventory [<origin>]"
                    fire(FLEET_INVENTORY, payload.partition(" ")[2])
            else:
                fire(kinds.get(channel, RESYNC), payload)

        bind_listener = getattr(self._backend, "bind_listener", None)
        try:
            if bind_listener is not None:
                # A SQLite file's socket, read on this loop: no thread wakes between a notice and
                # its waiters, and the notices that came together are taken in one turn.
                listener = await loop.run_in_executor(None, bind_listener, channels)
                listener.attach(loop, on_notify)
                self._detach_listener = listener.detach
                self._stop_listening = listener.close
            else:  # PostgreSQL's LISTEN connection, read on this loop (an async connection)
                relay = self._backend.relay_notifications  # type: ignore[attr-defined]
                listening = asyncio.Event()
                task = loop.create_task(relay(on_notify, listening, channels), name="store-listen")
                self._relay_task = task
                # bounded, as the first connection may take: one that cannot connect yet keeps trying
                await wait_set(listening, LISTEN_READY_SECONDS)
        except OSError as exc:  # a SQLite file's directory that takes no socket: polls instead
            log.warning(
                "cannot listen for the other processes' commits (%s): they are seen by re-checks"
                " (every %.0f s) and idle polls instead",
                exc,
                LOCAL_RECHECK,
            )
            return
        self.events.cross_process = True

    async def wait_until(
        self, condition: Callable[[], Awaitable[bool]], timeout: float, key: str | None = None
    ) -> bool:
        """Re-check `condition` whenever a job settles (on any replica, on PostgreSQL); bounded.
        With `key` (a job id or a reference), only when that job or reference settles."""
        return await self.events.wait_until(condition, timeout, key)

    async def wait_for_job(self, job_id: str, timeout: float) -> Job | None:
        """Wait (bounded) until a job is done or failed, whichever process runs it; its latest state."""

        async def settled() -> bool:
            job = await self.run(queries.job, job_id)
            return job is None or job.state in ("done", "failed")

        await self.wait_until(settled, timeout, key=job_id)
        return await self.run(queries.job, job_id)

    async def defer_job(self, job_id: str, error: str, *, retry_in: float, owner: str) -> bool:
        """Put a job back after its registry's Retry-After and close that registry's gate until then."""
        await self.scan_cache.flush()  # the scan's report, queued, commits first
        deferred = await self.run(self._backend.defer_job, job_id, error, retry_in=retry_in, owner=owner)
        self._fire_local(QUEUED)
        return deferred
