"""The intake's journal: a SQLite file of its own, which no scan ever writes (beside a SQLite store's
file; on PostgreSQL, where `GPUBADGE_INTAKE_JOURNAL` says).

A registry waits for each webhook answer, and a 202 must follow a durable record of the job. In
one SQLite file that record shares the single writer lock with every scan's writes (claims,
outcomes, reports, in several processes) and with the WAL's checkpoints: a delivery waits for
whatever holds the lock, and on a busy host for the holder to get a core again. So the intake
commits its jobs to this journal (`<db>-intake`), whose only writers are intakes, and a mover
thread (`store.intake_mover.IntakeMover`) carries them into the store's `jobs` table in journal
order, moments later, off the answer's path: one transaction per pass, recording how far it got
in that same transaction (`intake_moved`), so a crash anywhere moves each job exactly once.

The journal keeps its own WAL and never checkpoints on the intake's commit (the mover runs a
passive checkpoint now and then). Moved rows are deleted by the intake's thread between answers. A journal names itself with a random id (`journal_meta`), so a journal file replaced
by a new one starts its count again rather than being taken as moved.

Which jobs coalesce: a reference with an active job (queued or running, read from the store,
which never waits for its writer) gets that job's id, as before; one already journaled and not
yet moving gets that row's id. Should an active job appear between that read and the move (a
manual retry of the same reference), the moved row becomes an alias of it (`job_aliases`), so the
id the sender was given still names the scan that covers it.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Literal

from store.models import EnqueueBatch, Job
from store.queries.jobs import RESCAN_KEY, dedupe_key
from store.sqlite_access import create_private_file, immediate_transaction

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS journal_meta (id INTEGER PRIMARY KEY CHECK (id = 1), journal TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS intake ("
    " seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL, reference TEXT NOT NULL, registry TEXT NOT NULL,"
    " max_attempts INTEGER NOT NULL, not_before TEXT NOT NULL, source TEXT, created_at TEXT NOT NULL,"
    " dedupe_key TEXT NOT NULL)",
)
INSERT_ROWS = 1000  # rows per INSERT statement (8 parameters each, under SQLite's 32,766)
Row = tuple[str, str, str, int, str, str | None, str, str]  # a journal row as _RECORD inserts it
_RECORD = (
    "INSERT INTO intake (id, reference, registry, max_attempts, not_before, source, created_at, dedupe_key)"
)


def journal_path(store_path: Path) -> Path:
    """Where the journal of the store at `store_path` lives."""
    return store_path.with_name(store_path.name + "-intake")


@dataclass(frozen=True)
class JournaledJob:
    """A job as the intake recorded it: what the mover inserts into `jobs`."""

    seq: int
    id: str
    reference: str
    registry: str
    max_attempts: int
    not_before: str
    source: str | None
    created_at: str
    dedupe_key: str  # what it coalesces by (`store.queries.jobs.dedupe_key`: a rescan only with rescans)


def _iso(moment: datetime) -> str:
    return moment.isoformat(timespec="microseconds")


class IntakeJournal:
    """The journal file: recorded by intakes (any thread, any process), read and trimmed for the mover.

    Thread-safe: the intake's writes hold `_write_lock` (one writer connection), reads use a
    connection of their own. `moving_through` and `moved_through` are the in-process marks the
    mover sets (before and after a pass), which the intake reads to coalesce and to trim."""

    def __init__(
        self,
        path: Path,
        *,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        busy_timeout: float = 30.0,
    ) -> None:
        self.path = path
        self._write_lock = threading.Lock()
        create_private_file(path)  # the service user's alone, as the store's file
        self._writer = self._connect(synchronous, busy_timeout)
        self._writer.execute("PRAGMA journal_mode=WAL")
        self._writer.execute("PRAGMA wal_autocheckpoint=0")  # the mover checkpoints, off the answer's path
        with self._transaction() as conn:
            for statement in SCHEMA:
                conn.execute(statement)
            conn.execute(
                "INSERT INTO journal_meta (id, journal) VALUES (1, ?) ON CONFLICT (id) DO NOTHING",
                [os.urandom(8).hex()],
            )
            self.journal_id: str = conn.execute("SELECT journal FROM journal_meta").fetchone()[0]
        self._reader = self._connect(synchronous, busy_timeout)  # the mover's: reads and checkpoints
        self._reader_lock = threading.Lock()
        self.moving_through = 0  # rows up to here may be moving: never coalesced into
        self.moved_through = 0  # rows up to here are in the store: trimmed after the next answer
        self.recorded_through = 0  # the last row this process recorded
        self._trimmed_through = 0
        self._unmoved: dict[
            str, tuple[int, str]
        ] = {}  # dedupe key -> (seq, id) of rows this process recorded

    def _connect(self, synchronous: str, busy_timeout: float) -> sqlite3.Connection:
        connection = sqlite3.connect(
            str(self.path), check_same_thread=False, isolation_level=None, timeout=busy_timeout
        )
        connection.execute(f"PRAGMA synchronous={synchronous}")
        return connection

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._write_lock, self._transaction_held() as conn:
            yield conn

    @contextlib.contextmanager
    def _transaction_held(self) -> Iterator[sqlite3.Connection]:
        """One transaction on the writer; the caller holds `_write_lock`."""
        with immediate_transaction(self._writer) as conn:
            yield conn

    def record(
        self, batches: Sequence[EnqueueBatch], store: sqlite3.Connection | None, now: datetime
    ) -> list[list[str]]:
        """Several deliveries' jobs in one journal commit; a job id per reference, per batch.

        The answer waits for this, so it runs as few statements as there are (each hands the
        interpreter lock over and takes it back): one read of the store's active jobs for the
        references (`store`, a read connection to a SQLite store that never waits for its writer;
        None for a store whose read is a round trip away), and one INSERT of every new row, which
        commits on its own. A reference with an active job gets that job's id; one this process
        journaled that is not yet moving gets its row's id (kept in memory: another process's
        duplicate row, or one whose active job the store was not asked about, is coalesced when it
        moves, and its id becomes an alias); any other, a new job. Moved rows are trimmed apart
        (`trim`), after the answer.
        """
        active: dict[str, str] = {}
        if store is not None:
            keys = list(
                dict.fromkeys(
                    dedupe_key(item[0], rescan=batch.rescan) for batch in batches for item in batch.references
                )
            )
            marks = ",".join("?" * len(keys))
            active = dict(
                store.execute(
                    f"SELECT dedupe_key, id FROM jobs WHERE dedupe_key IN ({marks})"
                    " AND state IN ('queued', 'running')",
                    keys,
                ).fetchall()
            )
        created = _iso(now)
        not_before = {0.0: created}  # delay -> timestamp: most items share one (no delay at all)
        results: list[list[str]] = []
        rows: list[Row] = []
        with self._write_lock:
            unmoved = self._unmoved
            moving = self.moving_through  # rows up to here are (being) moved: coalesce into none of them
            for batch in batches:
                ids: list[str] = []
                for item in batch.references:
                    reference = item[0]
                    key = dedupe_key(reference, rescan=batch.rescan)
                    known = active.get(key)
                    if (
                        known is None
                        and (journaled := unmoved.get(key)) is not None
                        and journaled[0] > moving
                    ):
                        known = journaled[1]
                    if known is not None:
                        ids.append(known)
                        continue
                    wait = item[2] if len(item) == 3 else batch.delay
                    ready = not_before.get(wait)
                    if ready is None:
                        ready = not_before[wait] = _iso(now + timedelta(seconds=wait))
                    job_id = os.urandom(16).hex()  # as random as uuid4().hex, without the UUID object
                    rows.append(
                        (job_id, reference, item[1], batch.max_attempts, ready, batch.source, created, key)
                    )
                    active[key] = job_id  # a second mention in this commit joins the first
                    ids.append(job_id)
                results.append(ids)
            if len(rows) > INSERT_ROWS:  # several statements: one transaction still
                with self._transaction_held():
                    self._insert(rows)
            elif rows:
                self._insert(rows)  # one statement, its own commit
        return results

    def _insert(self, rows: list[Row]) -> None:
        """INSERT `rows` (INSERT_ROWS to a statement); they take consecutive seqs (one writer)."""
        for start in range(0, len(rows), INSERT_ROWS):
            chunk = rows[start : start + INSERT_ROWS]
            values = ",".join(["(?, ?, ?, ?, ?, ?, ?, ?)"] * len(chunk))
            cursor = self._writer.execute(
                f"{_RECORD} VALUES {values}", [value for row in chunk for value in row]
            )
            last = int(cursor.lastrowid or 0)
            for offset, row in enumerate(chunk):
                self._unmoved[row[7]] = (last - len(chunk) + 1 + offset, row[0])
            self.recorded_through = last

    def trim(self) -> None:
        """Delete the rows the mover has moved, and forget them (the intake's thread, between answers)."""
        moved = self.moved_through
        if moved <= self._trimmed_through:
            return
        with self._write_lock:
            self._writer.execute("DELETE FROM intake WHERE seq <= ?", [moved])
            self._trimmed_through = moved
            self._unmoved = {
                reference: entry for reference, entry in self._unmoved.items() if entry[0] > moved
            }

    def high_seq(self) -> int:
        """The last seq this journal ever gave (rows trimmed or not; trimming deletes only the lowest):
        seqs are consecutive, so the rows recorded after a mark number this minus the mark."""
        with self._reader_lock:
            row = self._reader.execute("SELECT seq FROM sqlite_sequence WHERE name = 'intake'").fetchone()
        return int(row[0]) if row else 0

    def rows(self, after: int, through: int) -> list[JournaledJob]:
        """The journaled jobs after `after` up to `through`, in journal order."""
        with self._reader_lock:
            rows = self._reader.execute(
                "SELECT seq, id, reference, registry, max_attempts, not_before, source, created_at, dedupe_key"
                " FROM intake"
                " WHERE seq > ? AND seq <= ? ORDER BY seq",
                [after, through],
            ).fetchall()
        return [JournaledJob(*row) for row in rows]

    def job(self, job_id: str) -> Job | None:
        """A job still in the journal (not moved yet), as the store will show it: queued."""
        with self._reader_lock:
            row = self._reader.execute(
                "SELECT id, reference, registry, max_attempts, source, created_at, dedupe_key FROM intake WHERE id = ?"
                " ORDER BY seq DESC LIMIT 1",
                [job_id],
            ).fetchone()
        if row is None:
            return None
        stamp = _iso(datetime.fromisoformat(row[5]))
        rescan = str(row[6]).startswith(RESCAN_KEY)
        return Job(
            row[0], row[1], row[2], "queued", 0, row[3], None, None, row[4], stamp, stamp, rescan=rescan
        )

    def checkpoint(self) -> None:
        """Fold the journal's WAL into its file without waiting for (or blocking) the intake."""
        with self._reader_lock, contextlib.suppress(sqlite3.Error):
            self._reader.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def close(self) -> None:
        for connection in (self._reader, self._writer):
            with contextlib.suppress(sqlite3.Error):
                connection.close()
