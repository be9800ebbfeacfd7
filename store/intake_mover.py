"""The intake's journal and its mover, for either engine: what a webhook's 202 waits for, and what
carries its jobs into the store's `jobs` table afterwards.

The intake commits a delivery's jobs to a local journal (`store.intake_journal.IntakeJournal`, a
SQLite file that no scan ever writes), so its answer waits for no lock, writer or round trip of
the store's. A mover thread carries the journaled jobs into `jobs`, in journal order, moments
later: one transaction of the store's per pass (`store.queries.journal_moves.move_journaled`),
which records how far it got in that same transaction, so a crash anywhere moves each job exactly
once. The store runs that transaction its own way (`Commit`): SQLite on its writer, PostgreSQL on a
pooled connection.

- **SQLite** always journals, to `<db>-intake` beside its file: every process sharing the file
  shares the journal.
- **PostgreSQL** journals when given a journal file (`GPUBADGE_INTAKE_JOURNAL`); otherwise its
  intake commits to the server directly, one round trip per delivery. A journal is local to the
  host that holds it: its jobs reach other replicas once moved (a few milliseconds while the server
  answers, or when it comes back), and a journal lost with its disk before its mover ran loses
  what it held.

In this process every read of the job queue waits for what it journaled to move (`settle`, at
most SETTLE_SECONDS), so here the journal is invisible.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal, cast

from store.dialect import P, Query, T
from store.intake_journal import IntakeJournal, JournaledJob
from store.models import EnqueueBatch, Job, StoreUnavailable
from store.queries.jobs import job
from store.sqlite_access import POSTGRES_INSTEAD, unwritable_hint

log = logging.getLogger(__name__)

MOVE_RECHECK = 1.0  # seconds between the mover's passes when no intake wakes it (another process's rows)
MOVE_GATHER = 0.002  # seconds the mover waits after a wake-up before its pass
SETTLE_SECONDS = 2.0  # longest a read of the job queue waits for this process's journaled jobs
CHECKPOINT_SECONDS = 1.0  # the journal's WAL is folded back at most this often

# The store's transaction for one pass: the journal's id, the rows after a given seq (up to the
# pass's end), and that end; returns how many rows it moved.
Commit = Callable[[str, Callable[[int], Sequence[JournaledJob]], int], int]


class IntakeMover:
    """One journal file and the thread that moves it; thread-safe. Opened at the first `record`
    (or `start`); `close` moves what is left and stops."""

    def __init__(
        self,
        path: Path,
        commit: Commit,
        *,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        busy_timeout: float = 30.0,
        store: str = "the store",
        otherwise: str = POSTGRES_INSTEAD,
    ) -> None:
        self.path = path
        self._commit = commit
        self._synchronous: Literal["NORMAL", "FULL"] = synchronous
        self._busy_timeout = busy_timeout
        self._store = store  # how the mover's log names where it moves to (never a URL)
        self._otherwise = otherwise  # the remedy besides a writable directory, where it cannot open
        self._journal: IntakeJournal | None = None
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self._moved = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False

    def start(self) -> IntakeJournal:
        """Open the journal and start the mover (once); what an earlier process journaled and did
        not move is moved now, or by the mover as soon as the store takes it."""
        with self._lock:
            if self._closing:  # as every other call on a closed store fails
                raise StoreUnavailable("the store is closed")
            if self._journal is None:
                try:
                    self._journal = IntakeJournal(
                        self.path, synchronous=self._synchronous, busy_timeout=self._busy_timeout
                    )
                except (OSError, sqlite3.Error) as exc:
                    hint = unwritable_hint(self.path, self._otherwise)
                    raise StoreUnavailable(
                        f"the intake journal {self.path} cannot be opened: {exc}{hint}"
                    ) from exc
                log.info(
                    "intake journal %s: each webhook delivery committed here before its answer, moved into %s",
                    self.path,
                    self._store,
                )
                try:  # what an earlier run journaled, before anyone reads the queue
                    if left := self._move():
                        log.info(
                            "moved %d jobs an earlier run left in the intake journal into %s",
                            left,
                            self._store,
                        )
                except (StoreUnavailable, sqlite3.Error) as exc:
                    log.warning("journaled jobs not moved yet (%s); the mover keeps trying", exc)
                self._thread = threading.Thread(target=self._move_forever, name="intake-mover", daemon=True)
                self._thread.start()
            return self._journal

    def record(self, batches: Sequence[EnqueueBatch], active: sqlite3.Connection | None) -> list[list[str]]:
        """Commit the batches' jobs to the journal (`IntakeJournal.record`; `active`, a read
        connection to a SQLite store's `jobs`, or None where reading the store would cost a round
        trip) and wake the mover; a job id per reference, per batch."""
        ids = self.start().record(batches, active, datetime.now(UTC))
        self._wanted.set()
        return ids

    @property
    def journal(self) -> IntakeJournal | None:
        return self._journal

    def trim(self) -> None:
        """The intake's thread, between answers: delete the journal rows already moved."""
        if self._journal is not None:
            self._journal.trim()

    def waiting(self, read: Callable[[str | None], tuple[int, int]]) -> int:
        """Jobs waiting, for the queue's cap: `read(journal_id)` gives how far the store has moved
        this journal (0 for None, before it opens) and its queued jobs, in one snapshot
        (`queries.journal_moves.queued_beside_journal`); the journal's rows past that mark are
        added, read after it. So a job moving meanwhile is counted once, as queued or as journaled,
        never twice and never not at all (only a row that will coalesce into another job is counted
        too). Never waits for the mover or the store's writer."""
        journal = self._journal
        moved, queued = read(journal.journal_id if journal is not None else None)
        return queued + (max(0, journal.high_seq() - moved) if journal is not None else 0)

    def unmoved(self) -> int:
        """Jobs this process journaled that are not in the store yet (in memory: no I/O)."""
        journal = self._journal
        return max(0, journal.recorded_through - journal.moved_through) if journal is not None else 0

    def job(self, job_id: str) -> Job | None:
        """A job still in the journal, as the store will show it (queued); None if not there."""
        return self._journal.job(job_id) if self._journal is not None else None

    def settle(self) -> None:
        """Wait until every job this process journaled is moved, at most SETTLE_SECONDS (and at
        most the store's timeout): a store that does not take them leaves them in the journal, and
        the caller goes on without them. Never call it holding what the mover's transaction needs."""
        journal = self._journal
        if journal is None or journal.moved_through >= journal.recorded_through:
            return
        target = journal.recorded_through
        self._wanted.set()
        with self._moved:
            self._moved.wait_for(
                lambda: journal.moved_through >= target, timeout=min(SETTLE_SECONDS, self._busy_timeout)
            )

    def read_queue(
        self, run: Callable[..., T], query: Query[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """A read of the job queue (`queries.JOB_READS`), `run(query, ...)`, once what this process
        journaled has moved (`settle`); `queries.job` of an id still in the journal (the store out of
        reach, or its writer held elsewhere) reads it there, queued."""
        self.settle()
        found: T = run(query, *args, **kwargs)
        if query is job and found is None:
            return cast(T, self.job(str(args[0] if args else kwargs["job_id"])))
        return found

    def close(self) -> None:
        """Stop the mover after a last pass (a clean stop leaves the journal empty), close the journal."""
        with self._lock:
            self._closing = True
        thread, journal = self._thread, self._journal
        if thread is not None:
            self._wanted.set()
            thread.join(timeout=self._busy_timeout)
        if journal is not None:
            with contextlib.suppress(Exception):
                self._move()
            journal.close()
        self._thread = self._journal = None

    def _move_forever(self) -> None:
        """The mover thread: a pass whenever the intake journals, and every MOVE_RECHECK seconds."""
        failures = 0
        checkpoint_due = 0.0
        while not self._closing:
            if self._wanted.wait(MOVE_RECHECK):
                # Let the answer that woke us go out first (the loop and the intake's thread need the
                # interpreter lock for it), and gather what arrives meanwhile into the same pass.
                time.sleep(MOVE_GATHER)
            self._wanted.clear()
            try:
                if self._move() and time.monotonic() >= checkpoint_due:
                    assert self._journal is not None
                    self._journal.checkpoint()
                    checkpoint_due = time.monotonic() + CHECKPOINT_SECONDS
                failures = 0
            except Exception as exc:
                failures += 1
                if isinstance(exc, StoreUnavailable):  # the store's own words: no URL, no traceback
                    log.warning("moving journaled jobs into %s failed (%s); retrying", self._store, exc)
                else:
                    log.exception("moving journaled jobs into %s failed; retrying", self._store)
                time.sleep(min(5.0, 0.05 * 2**failures))

    def _move(self) -> int:
        """One pass: the journaled jobs not yet moved, into the store in journal order, and how far
        that got, in one transaction of the store's; returns how many rows it moved."""
        journal = self._journal
        if journal is None:
            return 0
        through = journal.high_seq()
        if through > journal.moved_through:
            journal.moving_through = through  # from here, the intake coalesces into none of these rows
            moved = self._commit(journal.journal_id, lambda after: journal.rows(after, through), through)
        else:
            moved = 0
        with self._moved:
            journal.moved_through = max(journal.moved_through, through)
            self._moved.notify_all()
        return moved
