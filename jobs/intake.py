"""Group commit for incoming scan jobs: on the event loop where the engine allows it, else on a
commit thread of the intake's own.

Each delivery must be durable before its 202, but one commit per request caps the intake rate
and lengthens the queue behind it. Deliveries are instead committed in groups: the first
delivery starts a commit at once, and everything that arrives while that commit (and its fsync)
is in flight joins the next one. The event loop keeps accepting requests the whole time, and
each caller still answers only after its own commit.

Where the commit runs:

- **On PostgreSQL, on the loop** (`AsyncStore.loop_intake`): one statement on a connection of
  the intake's own, read by the loop, so no thread stands between a delivery and its record.
- **On the caller's own thread** (`enqueue_here`): the intake port's listener
  (`web/intake_listener.py`) reads, commits and answers each delivery on one thread of its own, on
  either engine, so its answer never waits for the event loop to take a turn. One commit per
  delivery there: the registries wait for each answer, so few are ever in flight at once.
- **On SQLite, on the intake's thread** (the journal, `store.intake_journal`): sqlite3 has no
  async driver. The registry waits for each answer before it sends its next delivery, so the hop
  is the cheapest there is: one queue put to wake the thread, one `call_soon_threadsafe` to come
  back, and the callers' futures settled directly on the loop, with no executor future, no
  chained callbacks and no task per group.

The queue has a cap (GPUBADGE_MAX_QUEUED_SCANS). The intake knows how many jobs wait: it counts
them (an index range, stopped at the cap) at most once a second, adds what each group queues,
and counts again whenever a group would bring that figure within a tenth of the cap, so near the
cap the figure is exact for this process (replicas sharing PostgreSQL may overshoot by what they
queue within one count; the figure is shared by the loop's commits and `enqueue_here`'s threads,
under a lock held for arithmetic only). Where the intake journals to PostgreSQL, the
once-a-second count runs on a thread of its own while the queue is not near its cap, so a
journaled delivery's answer waits for no read of the server (a round trip, or the store's
timeout while the server is away); the first count and those near the cap stay in front of the
commit. A delivery that would pass the cap is not committed: its caller gets
`QueueFull` (the route answers 503 with Retry-After), the others in its group are committed as
usual, and nothing already queued is touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence

from store import AsyncStore, EnqueueBatch, LoopCommits, StoreUnavailable, queries

log = logging.getLogger(__name__)

Pending = list[tuple[EnqueueBatch, asyncio.Future[list[str]]]]
Outcome = list[list[str]] | BaseException
RECOUNT_SECONDS = 1.0
QUEUE_SETTING = "GPUBADGE_MAX_QUEUED_SCANS"
RETRY_AFTER_SECONDS = 30


class QueueFull(Exception):
    """The scan queue holds `cap` jobs (GPUBADGE_MAX_QUEUED_SCANS): this delivery was not queued."""

    def __init__(self, cap: int) -> None:
        super().__init__(
            f"the scan queue is full ({cap} scans waiting, {QUEUE_SETTING}); nothing of this request was "
            f"queued, and nothing already queued was dropped: retry in {RETRY_AFTER_SECONDS} s"
        )
        self.cap = cap


class JobIntake:
    def __init__(self, store: AsyncStore, *, max_queued: int | None = None) -> None:
        self.store = store
        self.max_queued = max_queued
        self._waiting: int | None = None  # jobs queued, as the commit thread last knew it
        self._counted_at = 0.0
        self._pending: Pending = []
        self._committing = False
        self._groups: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, Pending] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # starts the thread once, whichever loop asks first
        # `_waiting` and `_counted_at`, shared by the loop's commits and `enqueue_here`'s threads
        self._count_lock = threading.Lock()
        self._counting = False  # a recount beside the answers is running (`_count_before`)
        self._admitted = 0  # jobs admitted so far: what a recount beside the answers adds to its count
        self._on_loop: LoopCommits | None = store.loop_intake()
        # where the intake journals and the store's count is a round trip away (PostgreSQL with a
        # journal), the once-a-second count runs beside the answers (`_count_before`)
        self._count_aside = self._on_loop is None and not store.local_reads
        self._commits: set[asyncio.Task[None]] = set()  # the loop's commit in flight, if any

    async def enqueue(
        self,
        references: Sequence[tuple[str, str] | tuple[str, str, float]],
        *,
        source: str | None,
        max_attempts: int,
    ) -> list[str]:
        """Queue one delivery's jobs; returns once they are committed, with their ids.

        Raises `QueueFull` (nothing of this delivery queued) when they would pass the queue's cap."""
        if not references:
            return []
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[str]] = loop.create_future()
        self._pending.append((EnqueueBatch(references, source, max_attempts), future))
        if not self._committing:
            self._committing = True
            self._dispatch(loop)
        return await future

    @property
    def journaled(self) -> bool:
        """Whether `enqueue_here` commits to an intake journal, which only intakes write (so it never
        waits for a scan's write or a round trip): on SQLite, and on PostgreSQL with `intake_journal`;
        False on PostgreSQL without one (a pooled connection's round trip)."""
        return self._on_loop is None

    def enqueue_here(
        self,
        references: Sequence[tuple[str, str] | tuple[str, str, float]],
        *,
        source: str | None,
        max_attempts: int,
    ) -> list[str]:
        """Queue one delivery's jobs from a thread that may block, never the event loop: commit them
        on this thread and return their ids once committed. Raises `QueueFull` (nothing queued) when
        they would pass the queue's cap. The caller wakes the loop's workers and waiters afterwards
        (`AsyncStore.jobs_queued`, on the loop), and tidies between answers (`tidy_here`)."""
        if not references:
            return []
        self._count_before(len(references))
        if not self._admit_sizes([len(references)])[0]:
            raise QueueFull(self.max_queued or 0)
        return self.store.blocking.enqueue_many([EnqueueBatch(references, source, max_attempts)])[0]

    def tidy_here(self) -> None:
        """After an answer of `enqueue_here`, on the same thread: what its commits left to clean."""
        try:
            self.store.blocking.tidy_intake()
        except Exception:
            log.exception("intake: tidying after the commits failed; tried again after the next")

    async def close(self) -> None:
        """Let the commits started finish, then close the loop's connection or stop the commit thread
        (before the store closes)."""
        while self._commits:
            await asyncio.gather(*self._commits, return_exceptions=True)
        if self._on_loop is not None:
            await self._on_loop.close()
        thread = self._thread
        if thread is not None:
            self._groups.put(None)
            await asyncio.get_running_loop().run_in_executor(None, thread.join)
            self._thread = None

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop: commit every pending delivery as one group, there or on the commit thread."""
        group, self._pending = self._pending, []
        if self._on_loop is not None:
            task = loop.create_task(self._commit_on_loop(self._on_loop, loop, group))
            self._commits.add(task)
            task.add_done_callback(self._commits.discard)
            return
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._commit_groups, name="intake", daemon=True)
                    self._thread.start()
        self._groups.put((loop, group))

    async def _commit_on_loop(
        self, commits: LoopCommits, loop: asyncio.AbstractEventLoop, group: Pending
    ) -> None:
        """On the loop: the group's one commit, then its answers (`_settle`)."""
        if self._must_count(_size(group)):
            await self.store.run(self._recount)
        admitted, full = self._admit(group)
        outcome: Outcome
        try:
            outcome = await commits.record([batch for batch, _ in admitted]) if admitted else []
        except Exception as exc:  # every delivery of the group learns its commit failed
            outcome = exc
        self._settle(loop, admitted, outcome, full)

    def _commit_groups(self) -> None:
        """The commit thread: one transaction per group, then back to the loop with the outcome."""
        while (item := self._groups.get()) is not None:
            loop, group = item
            self._count_before(_size(group))
            admitted, full = self._admit(group)
            outcome: Outcome
            try:
                outcome = (
                    self.store.blocking.enqueue_many([batch for batch, _ in admitted]) if admitted else []
                )
            except Exception as exc:  # every delivery of the group learns its commit failed
                outcome = exc
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for these answers
                loop.call_soon_threadsafe(self._settle, loop, admitted, outcome, full)
            if self._groups.empty():  # the answers are on their way and nothing waits: tidy up
                try:
                    self.store.blocking.tidy_intake()
                except Exception:
                    log.exception("intake: tidying after the commits failed; tried again after the next")

    # The queue's cap: where the commit runs (the loop or the thread), it counts the waiting jobs
    # when `_must_count` says so (`_recount`, on a thread), then `_admit`s the group.

    def _must_count(self, incoming: int) -> bool:
        """Whether the jobs waiting must be counted before `incoming` more are judged against the
        cap: never counted yet, counted over a second ago, or they would bring the figure near it."""
        if self.max_queued is None:
            return False
        return (
            self._waiting is None
            or time.monotonic() - self._counted_at >= RECOUNT_SECONDS
            or self._near_cap(incoming)
        )

    def _near_cap(self, incoming: int) -> bool:
        """Whether `incoming` more would bring the last count within a tenth of the cap."""
        cap = self.max_queued
        return cap is not None and self._waiting is not None and self._waiting + incoming > cap - cap // 10

    def _count_before(self, incoming: int) -> None:
        """On a thread that commits: count the waiting jobs when `_must_count` says so. Where the
        intake journals to a store whose reads are a round trip away (PostgreSQL with a journal) and
        the queue is not near its cap, the count runs on a thread of its own, beside the answers: a
        journaled delivery's answer then waits for no read of the server (nor, while it is away,
        for the store's timeout). On SQLite the count is a local read that waits for no writer, and
        runs in line, as it always did."""
        if not self._must_count(incoming):
            return
        if self._count_aside and self._waiting is not None and not self._near_cap(incoming):
            with self._count_lock:
                if self._counting:
                    return
                self._counting = True
                admitted = self._admitted
            threading.Thread(
                target=self._recount, args=(admitted,), name="intake-recount", daemon=True
            ).start()
            return
        self._recount()

    def _recount(self, admitted: int | None = None) -> None:
        """On a thread (the commit thread, a recount's own, or the store's for a commit on the loop):
        count the jobs waiting, up to the cap. A recount beside the answers (`admitted`: the jobs
        admitted when it began) adds those admitted since, which its read may have missed (an
        over-estimate until the next count, never an under-count). A count that fails leaves the
        last one, and the next is tried a second later, not at every delivery."""
        try:
            waiting = self.store.blocking.queued_for_intake((self.max_queued or 0) + 1)
        except Exception as exc:
            if isinstance(exc, StoreUnavailable):  # the store's own words; no traceback each second
                log.warning(
                    "intake: counting the queued jobs failed (%s); the cap is checked with the last count",
                    exc,
                )
            else:
                log.exception(
                    "intake: counting the queued jobs failed; the cap is checked with the last count"
                )
            with self._count_lock:
                self._counted_at, self._counting = time.monotonic(), False
            return
        with self._count_lock:
            if admitted is not None:
                waiting += self._admitted - admitted
            self._waiting, self._counted_at, self._counting = waiting, time.monotonic(), False

    def _admit(self, group: Pending) -> tuple[Pending, list[asyncio.Future[list[str]]]]:
        """`group` split into the deliveries to commit and the futures of those that would take the
        queue past its cap (none refused while never counted)."""
        admitted: Pending = []
        refused: list[asyncio.Future[list[str]]] = []
        for delivery, fits in zip(
            group, self._admit_sizes([len(batch.references) for batch, _ in group]), strict=True
        ):
            if fits:
                admitted.append(delivery)
            else:
                refused.append(delivery[1])
        return admitted, refused

    def _admit_sizes(self, sizes: list[int]) -> list[bool]:
        """Whether each delivery of `sizes` jobs fits under the cap, counting in those that fit before
        it (all fit while never counted)."""
        cap = self.max_queued
        fits: list[bool] = []
        with self._count_lock:
            for size in sizes:
                if cap is None or self._waiting is None:
                    fits.append(True)
                elif self._waiting + size > cap:
                    fits.append(False)
                else:
                    self._waiting += size  # coalesced ones too: an over-estimate until recounted
                    self._admitted += size
                    fits.append(True)
        return fits

    def _settle(
        self,
        loop: asyncio.AbstractEventLoop,
        group: Pending,
        outcome: Outcome,
        full: list[asyncio.Future[list[str]]] | None = None,
    ) -> None:
        """On the loop: answer each delivery of the group, then start the next group, if any."""
        for future in full or ():
            if not future.done():
                future.set_exception(QueueFull(self.max_queued or 0))
        if isinstance(outcome, BaseException):
            for _, future in group:
                if not future.done():
                    future.set_exception(outcome)
        else:
            for (_, future), ids in zip(group, outcome, strict=True):
                if not future.done():
                    future.set_result(ids)
            if group:
                self.store.jobs_queued()
        if self._pending:
            self._dispatch(loop)
        else:
            self._committing = False

    async def has_room(self, count: int = 1) -> bool:
        """Whether `count` more jobs fit under the cap now (an exact count, off the loop)."""
        if self.max_queued is None:
            return True
        waiting = await self.store.run(queries.queued_jobs, cap=self.max_queued + 1)
        return waiting + count <= self.max_queued


def _size(group: Pending) -> int:
    return sum(len(batch.references) for batch, _ in group)
