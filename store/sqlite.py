"""The SQLite backend: the embedded default store, one file.

The file holds scan reports (keyed by manifest digest), the tag -> digest history, the
per-layer evidence cache, the durable scan-job queue with leases, and the fleet (servers,
deployments, GPU reservations); the schema is `store/migrations/sqlite/`, applied by
`store.migrations.apply_pending` (`upgrade`). It is synchronous on purpose:
`store.facade.AsyncStore` runs every call in a thread pool, so no SQL ever runs on
an event loop, and a locked database delays only the requests that need it.

SQLite runs in WAL mode. Reads use one connection per thread and never wait for a
writer, in this process or another; writes share one connection and are short
`BEGIN IMMEDIATE` transactions, so two workers or two deploys never take the same
job or the same GPU.

The queries both engines share (reports, tags, the layer cache, job reads, the fleet) are
written once in `store.queries` and run here through `run`; this module keeps what SQLite does
its own way: the writer lock, claims, leases, enqueueing, outcomes, registry gates, health, the
upgrade's legacy `user_version`, and GPU reservations.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

from store.backend import SharedMethods
from store.dialect import SQLITE, Db, P, Query, T
from store.events import ALL_CHANNELS, FLEET_CHANNEL, JOB_CHANNELS, JOB_SETTLED_CHANNEL, JOBS_QUEUED_CHANNEL
from store.fairness import claim_order, plan_claims
from store.intake_journal import JournaledJob, journal_path
from store.intake_mover import IntakeMover
from store.migrations import apply_pending, latest_version
from store.models import (
    EnqueueBatch,
    GpuTaken,
    Job,
    JobState,
    LeaseExpiry,
    QueueHealth,
    RegistryLoad,
    StoreUnavailable,
)
from store.queries import JOB_READS
from store.queries.jobs import JOB_COLUMNS, LEASE_LAPSED_ERROR, job_of, job_ready, registry_turns
from store.queries.journal_moves import move_journaled, queued_beside_journal
from store.sqlite_access import WriterLock, create_private_file, immediate_transaction, unwritable_hint
from store.sqlite_notify import PAYLOAD_MAX, BoundListener, LocalNotifier, Notice

log = logging.getLogger(__name__)


def _now() -> datetime:
    return datetime.now(UTC)


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="microseconds")


def _seconds_since(stamp: str | None, moment: datetime) -> float | None:
    return None if stamp is None else max(0.0, (moment - datetime.fromisoformat(stamp)).total_seconds())


# Versioned schema: store/migrations/sqlite/NNNN_*.sql, applied in order and recorded in
# `schema_migrations`. Files versioned by `PRAGMA user_version` (before that table existed) count
# their first user_version migrations as applied; files made before any versioning hold migration
# 1's tables, which it creates only if missing.
SCHEMA_VERSION = latest_version("sqlite")


def _settled(job_id: str, reference: str) -> Notice:
    """The notice of a job that settled, as PostgreSQL's `_notify_settled` sends it."""
    return (JOB_SETTLED_CHANNEL, f"{job_id} {reference}"[:PAYLOAD_MAX])


class SqliteStore(SharedMethods):
    """One SQLite file, safe to call from many threads (and many processes)."""

    local_reads = True  # a read is a local file's, and never waits for a writer (WAL)

    def __init__(
        self,
        path: Path | str,
        *,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        busy_timeout: float = 30.0,
        upgrade: bool = True,
        shared_events: bool = False,
    ) -> None:
        self.path = Path(path)
        self.busy_timeout = busy_timeout
        # With shared_events, each commit's notices reach every process listening on this file, and
        # `bind_listener` hears theirs (store.sqlite_notify): the API and worker processes of one host
        # wake each other as PostgreSQL's replicas do. Without, one process owns the queue's events.
        self.shares_events = shared_events
        self._notifier = LocalNotifier(self.path) if shared_events else None
        self._synchronous = synchronous
        self._write_lock = WriterLock()
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        # The intake's journal (store.intake_journal) and its mover, opened by the first intake.
        self._intake = IntakeMover(
            journal_path(self.path),
            self._move_journaled,
            synchronous=synchronous,
            busy_timeout=busy_timeout,
            store=str(self.path),
        )
        try:
            create_private_file(self.path)
            self._writer = self._connect(busy_timeout)
            self._writer.execute("PRAGMA journal_mode=WAL")
            if upgrade:  # `gpubadge db status` looks without changing anything
                self.upgrade()
        except (OSError, sqlite3.Error) as exc:
            raise StoreUnavailable(
                f"cannot open the SQLite store {self.path}: {exc}{unwritable_hint(self.path)}",
                "cannot open the SQLite store",
            ) from exc

    def _connect(self, timeout: float) -> sqlite3.Connection:
        connection = sqlite3.connect(
            str(self.path), check_same_thread=False, isolation_level=None, timeout=timeout
        )
        connection.execute(f"PRAGMA synchronous={self._synchronous}")
        connection.execute("PRAGMA foreign_keys=ON")
        with self._connections_lock:
            self._connections.append(connection)
        return connection

    def upgrade(self) -> int:
        """Apply the migrations this file lacks; returns the schema version. Safe across processes."""
        with self._transaction() as conn:
            legacy = int(conn.execute("PRAGMA user_version").fetchone()[0])
            apply_pending(conn, "sqlite", legacy=legacy)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")  # older gpubadge builds read this
        return SCHEMA_VERSION

    def schema_version(self) -> int:
        with self._reading() as db:
            if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'schema_migrations'").fetchone() is None:
                return int(db.execute("PRAGMA user_version").fetchone()[0])  # before the table existed
            row = db.execute("SELECT max(version) FROM schema_migrations").fetchone()
        return int(row[0] or 0)

    def close(self) -> None:
        self._intake.close()
        with self._connections_lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            connection.close()
        if self._notifier is not None:
            self._notifier.close()

    # ---------------------------------------------------------------- events

    def bind_listener(self, channels: Sequence[str] = ALL_CHANNELS) -> BoundListener:
        """A listener's socket for an event loop to read (`BoundListener.attach`): every notice on
        `channels` a process sharing this file commits (this one's too), as PostgreSQL's LISTEN hears
        them, with no thread between the socket and the loop. `channels` is every channel, or the
        queue's alone (`JOB_CHANNELS`). Only a store opened with `shared_events`."""
        if self._notifier is None:
            raise RuntimeError("this SQLite store does not share its events (shared_events=False)")
        if set(channels) not in (set(ALL_CHANNELS), set(JOB_CHANNELS)):
            raise ValueError(f"a SQLite listener hears every channel or the queue's alone, not {channels}")
        return self._notifier.bind(jobs_only=set(channels) == set(JOB_CHANNELS))

    def _announce(self, *notices: Notice) -> None:
        """After a commit: tell the processes sharing this file (no-op unless it shares events)."""
        if self._notifier is not None and notices:
            self._notifier.send(notices)

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        """This thread's read connection: in WAL mode it never waits for a writer."""
        try:
            connection: sqlite3.Connection | None = getattr(self._local, "reader", None)
            if connection is None:
                connection = self._connect(self.busy_timeout)
                connection.execute("PRAGMA query_only=ON")
                self._local.reader = connection
            yield connection
        except sqlite3.OperationalError as exc:
            raise StoreUnavailable(
                f"the SQLite store {self.path} cannot be read: {exc}",
                f"the SQLite store cannot be read: {exc}",
            ) from exc

    @contextmanager
    def _transaction(self, *, urgent: bool = False) -> Iterator[sqlite3.Connection]:
        """One immediate transaction on the shared writer: writers serialise here, readers never block.

        A lock held too long elsewhere, a full disk or a read-only file becomes StoreUnavailable,
        with SQLite's own words for the cause.
        """
        lock = self._write_lock
        lock.acquire(urgent=urgent)  # not `hold`: one generator less on the webhook's commit path
        try:
            with immediate_transaction(self._writer) as conn:
                yield conn
        except sqlite3.OperationalError as exc:
            raise StoreUnavailable(
                f"the SQLite store {self.path} cannot be written: {exc}",
                f"the SQLite store cannot be written: {exc}",
            ) from exc
        finally:
            lock.release()

    # ---------------------------------------------------------------- health

    def check_writable(self, timeout: float) -> None:
        """Prove the database can be reached and written within `timeout`, or raise StoreUnavailable.

        Uses its own connection, so a writer stuck behind another process's lock cannot hold it up.
        """
        connection: sqlite3.Connection | None = getattr(self._local, "health", None)
        try:
            if connection is None:
                connection = self._connect(timeout)
                self._local.health = connection
            connection.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
            connection.execute("BEGIN IMMEDIATE")
            try:
                connection.execute(
                    "INSERT OR REPLACE INTO health (id, checked_at) VALUES (1, ?)", [_iso(_now())]
                )
            except BaseException:
                connection.execute("ROLLBACK")
                raise
            connection.execute("COMMIT")
        except sqlite3.Error as exc:
            raise StoreUnavailable(
                f"the SQLite store {self.path} cannot be written: {exc}",
                f"the SQLite store cannot be written: {exc}",
            ) from exc

    def queue_health(self) -> QueueHealth:
        self._settle_intake()
        moment = _now()
        now = _iso(moment)
        with self._reading() as db:
            ready, oldest = db.execute(
                "SELECT count(*), min(not_before) FROM jobs WHERE state = 'queued' AND not_before <= ?", [now]
            ).fetchone()
            (running,) = db.execute("SELECT count(*) FROM jobs WHERE state = 'running'").fetchone()
            progress = db.execute(
                "SELECT updated_at FROM jobs WHERE attempts > 0 ORDER BY updated_at DESC LIMIT 1"
            ).fetchone()
        return QueueHealth(
            ready=int(ready),
            oldest_ready_seconds=_seconds_since(oldest, moment),
            last_progress_seconds=_seconds_since(progress[0] if progress else None, moment),
            running=int(running),
        )

    # ---------------------------------------------------------------- queries

    def run(self, query: Query[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run one of `store.queries` (or any `Query`): a read on this thread's read connection, a
        write in one immediate transaction on the shared writer. A read of the job queue first
        waits for the jobs this process journaled (`_settle_intake`)."""
        if query in JOB_READS:
            return self._intake.read_queue(self._reading_query, query, *args, **kwargs)
        if query.write:
            with self._transaction() as conn:
                writing = Db(conn, SQLITE)
                result = query(writing, *args, **kwargs)
            self._announce(*writing.notices)
            return result
        return self._reading_query(query, *args, **kwargs)

    def _reading_query(self, query: Query[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        with self._reading() as connection:
            return query(Db(connection, SQLITE), *args, **kwargs)

    # ------------------------------------------------------------------ jobs

    def enqueue_many(self, batches: Sequence[EnqueueBatch]) -> list[list[str]]:
        """Several deliveries' jobs in one transaction (group commit); job ids per batch. They are
        in `jobs` when this returns, for every process (unless the store's writer is held elsewhere
        past `store.intake_mover.SETTLE_SECONDS`: then they wait, durable, in the journal, and move when it is free)."""
        ids = self.record_intake(batches)
        self._settle_intake()
        return ids

    def record_intake(self, batches: Sequence[EnqueueBatch]) -> list[list[str]]:
        """`enqueue_many` for the webhook intake, whose answer waits for it: it never touches the
        store's writer. The jobs are committed to the intake's journal (`store.intake_journal`),
        which no scan writes, and the mover carries them into `jobs` moments later; every read and
        claim of jobs in this process waits for that move first (`_settle_intake`), so here the
        journal is invisible (other processes see the jobs once moved, as the mover wakes them)."""
        if not any(batch.references for batch in batches):
            return [[] for _ in batches]
        with self._reading() as store:
            return self._intake.record(batches, store)

    def start_intake(self) -> None:
        """Open the intake's journal and start its mover (once); what an earlier process journaled
        and did not move is moved now. `serve` calls it at start, the first enqueue otherwise."""
        self._intake.start()

    def loop_intake(self) -> None:
        """None: the intake's commits are the journal's, on a thread of their own (`record_intake`);
        sqlite3 has no async driver to run them on the loop."""
        return None

    def tidy_intake(self) -> None:
        """The intake's thread, between answers: delete the journal rows already moved."""
        self._intake.trim()

    def intake_unmoved(self) -> int:
        """Jobs this process journaled that the mover has not carried into `jobs` yet (no I/O)."""
        return self._intake.unmoved()

    def queued_for_intake(self, cap: int) -> int:
        """Jobs waiting (up to `cap`), for the intake's queue cap, read without waiting for the mover
        or the writer: queued in the store, and journaled past the store's mark of this journal
        (`IntakeMover.waiting`: each job counted once while a move commits)."""

        def read(journal_id: str | None) -> tuple[int, int]:
            with self._reading() as db:
                return queued_beside_journal(Db(db, SQLITE), journal_id, cap=cap)

        return self._intake.waiting(read)

    def _settle_intake(self) -> None:
        """Wait until every job this process journaled is in `jobs` (`IntakeMover.settle`, bounded
        by the busy timeout too). Never call it holding the writer: the mover needs it."""
        self._intake.settle()

    def _move_journaled(
        self, journal_id: str, rows_after: Callable[[int], Sequence[JournaledJob]], through: int
    ) -> int:
        """The mover's pass (`store.queries.journal_moves`), on the writer ahead of waiting claims."""
        with self._transaction(urgent=True) as conn:
            writing = Db(conn, SQLITE)
            moved = move_journaled(writing, journal_id, rows_after, through)
        self._announce(*writing.notices)
        return moved

    def claim_jobs(
        self, limit: int, *, owner: str, lease_seconds: float, per_registry: int | None = None
    ) -> list[Job]:
        """Atomically move up to `limit` ready jobs to `running`, leased to `owner`, and return them.

        The lease must be renewed (`renew_leases`) before it expires, or the job is claimed
        again (`expire_leases`): that is how a crashed or cut-off worker loses nothing.

        Claims are fair across registries (`store.fairness`): each slot goes to the registry with
        ready jobs and the fewest running, the least recently claimed first among equals, so
        claims rotate and a slow registry cannot take every worker. With `per_registry`, no
        registry ends up with more than that many running jobs across every worker sharing the
        store; a registry cooling down after a Retry-After (`defer_job`) gets none until then, and
        its queued jobs are moved to the end of the cool-down.
        The whole choice is one `BEGIN IMMEDIATE` transaction, so it is exact across processes. A
        claim that finds no job due once it holds the lock (another process's claim took it) writes
        nothing and holds the lock for that one probe.
        """
        if limit <= 0:
            return []
        self._settle_intake()
        moment = _now()
        now, expires = _iso(moment), _iso(moment + timedelta(seconds=lease_seconds))
        with self._transaction() as conn:
            # Another process's claim may have taken every due job while this one waited its turn
            # (a queued job wakes every worker process): then there is nothing to choose or write.
            if not job_ready(Db(conn, SQLITE)):
                return []
            # Jobs of a registry cooling down (queued since its gate closed) wait for the gate: then
            # neither the idle loop, nor /healthz's stall check, nor /metrics counts them as ready.
            conn.execute(  # along the queued jobs' registry index: a probe per cooling registry
                "UPDATE jobs INDEXED BY jobs_ready_registry SET not_before = (SELECT g.cool_until FROM registry_gates g"
                "   WHERE g.registry = jobs.registry)"
                " WHERE state = 'queued' AND not_before <= :now"
                " AND registry IN (SELECT registry FROM registry_gates WHERE cool_until > :now)",
                {"now": now},
            )
            turns = registry_turns(Db(conn, SQLITE), limit)
            plan = plan_claims(turns, limit, per_registry)
            ids: list[str] = []
            for registry in dict.fromkeys(plan):
                rows = conn.execute(
                    "SELECT id FROM jobs WHERE state = 'queued' AND registry = ? AND not_before <= ?"
                    " ORDER BY not_before, created_at LIMIT ?",
                    [registry, now, plan.count(registry)],
                ).fetchall()
                ids.extend(row[0] for row in rows)
            if not ids:
                return []
            conn.executemany(
                "UPDATE jobs SET state = 'running', attempts = attempts + 1, lease_owner = ?,"
                " lease_expires = ?, updated_at = ? WHERE id = ?",
                [(owner, expires, now, job_id) for job_id in ids],
            )
            conn.executemany(
                "INSERT INTO registry_gates (registry, last_claimed) VALUES (?, ?)"
                " ON CONFLICT(registry) DO UPDATE SET last_claimed = excluded.last_claimed",
                [
                    (registry, _iso(moment + timedelta(microseconds=position)))
                    for position, registry in enumerate(claim_order(plan))
                ],
            )
            placeholders = ",".join("?" * len(ids))
            claimed = conn.execute(
                f"SELECT {JOB_COLUMNS} FROM jobs WHERE id IN ({placeholders}) ORDER BY created_at, id", ids
            ).fetchall()
        return [job_of(Db(conn, SQLITE), row) for row in claimed]

    def renew_leases(self, owner: str, job_ids: Sequence[str], lease_seconds: float) -> list[str]:
        """Extend `owner`'s leases; returns the ids it still holds (a lost lease is not renewed)."""
        if not job_ids:
            return []
        expires = _iso(_now() + timedelta(seconds=lease_seconds))
        marks = ",".join("?" * len(job_ids))
        with self._transaction() as conn:
            conn.execute(
                f"UPDATE jobs SET lease_expires = ? WHERE id IN ({marks}) AND state = 'running'"
                " AND lease_owner = ?",
                [expires, *job_ids, owner],
            )
            held = conn.execute(
                f"SELECT id FROM jobs WHERE id IN ({marks}) AND state = 'running' AND lease_owner = ?",
                [*job_ids, owner],
            ).fetchall()
        return [row[0] for row in held]

    def expire_leases(self) -> list[LeaseExpiry]:
        """Running jobs whose lease has passed go back to the queue, or fail once their attempts are spent."""
        now = _iso(_now())
        with self._transaction() as conn:
            rows = conn.execute(
                "SELECT id, reference, lease_owner, attempts, max_attempts FROM jobs"
                " WHERE state = 'running' AND (lease_expires IS NULL OR lease_expires < ?)",
                [now],
            ).fetchall()
            expired: list[LeaseExpiry] = []
            for job_id, reference, owner, attempts, max_attempts in rows:
                state: JobState = "failed" if attempts >= max_attempts else "queued"
                conn.execute(
                    f"UPDATE jobs SET state = ?, error = {LEASE_LAPSED_ERROR}, not_before = ?, lease_owner = NULL,"
                    " lease_expires = NULL, updated_at = ? WHERE id = ?",
                    [state, now, now, job_id],
                )
                expired.append(LeaseExpiry(job_id, reference, owner or "", state))
        notices = [_settled(item.job_id, item.reference) for item in expired if item.state == "failed"]
        if any(item.state == "queued" for item in expired):
            notices.append((JOBS_QUEUED_CHANNEL, ""))
        self._announce(*notices)
        return expired

    def release_leases(self, owners: Sequence[str], *, refund_attempt: bool) -> int:
        """Requeue at once every job held by `owners` (workers known to be gone, or shutting down).

        `refund_attempt` is for a clean shutdown, which is not the job's fault; a crashed worker's
        attempt counts, since the image itself may be what brought it down.
        """
        if not owners:
            return 0
        marks = ",".join("?" * len(owners))
        return self._requeue_running(f"lease_owner IN ({marks})", list(owners), refund_attempt=refund_attempt)

    def preempt_job(self, job_id: str, *, owner: str) -> bool:
        """Put `owner`'s running job back in the queue, ready now and with its attempt refunded.

        A worker does this to hand its slot to a registry that has waited with no scan in flight
        (`jobs.workers`' pre-emption): the job did nothing wrong. False (nothing written) when
        `owner` no longer holds its lease.
        """
        return self._requeue_running("id = ? AND lease_owner = ?", [job_id, owner], refund_attempt=True) > 0

    def _requeue_running(self, condition: str, params: list[str], *, refund_attempt: bool) -> int:
        """Requeue, ready now, the running jobs that also meet `condition`; how many."""
        now = _iso(_now())
        with self._transaction() as conn:
            cursor = conn.execute(
                "UPDATE jobs SET state = 'queued', not_before = ?, lease_owner = NULL, lease_expires = NULL,"
                " attempts = max(0, attempts - ?), updated_at = ?"
                f" WHERE state = 'running' AND {condition}",
                [now, int(refund_attempt), now, *params],
            )
        if cursor.rowcount:
            self._announce((JOBS_QUEUED_CHANNEL, ""))
        return cursor.rowcount

    def fail_job(self, job_id: str, error: str, *, retry_in: float | None, owner: str) -> JobState | None:
        """Record a failure: `queued` again after `retry_in` seconds, or `failed` for good.

        `retry_in=None` means the failure can never pass on retry. Returns None, writing nothing,
        when `owner` no longer holds the job's lease.
        """
        now = _now()
        with self._transaction() as conn:
            row = conn.execute(
                "SELECT attempts, max_attempts, dedupe_key FROM jobs"
                " WHERE id = ? AND state = 'running' AND lease_owner = ?",
                [job_id, owner],
            ).fetchone()
            if row is None:
                return None
            final = retry_in is None or row[0] >= row[1]
            state: JobState = "failed" if final else "queued"
            not_before = _iso(now + timedelta(seconds=retry_in or 0))
            conn.execute(
                "UPDATE jobs SET state = ?, error = ?, not_before = ?, lease_owner = NULL, lease_expires = NULL,"
                " updated_at = ? WHERE id = ?",
                [state, error, not_before, _iso(now), job_id],
            )
        self._announce(_settled(job_id, row[2]) if final else (JOBS_QUEUED_CHANNEL, ""))
        return state

    def compact_job_tallies(self) -> None:
        """Nothing to fold: SQLite's triggers keep one row per state, updated in place (one writer)."""

    def retry_job(self, job_id: str) -> Job | None:
        """Put a failed job back in the queue by hand (attempts start again)."""
        self._settle_intake()
        now = _iso(_now())
        with self._transaction() as conn:
            row = conn.execute("SELECT state, dedupe_key FROM jobs WHERE id = ?", [job_id]).fetchone()
            if row is None:
                return None
            requeued = False
            if row[0] == "failed":
                active = conn.execute(
                    "SELECT 1 FROM jobs WHERE dedupe_key = ? AND state IN ('queued', 'running')", [row[1]]
                ).fetchone()
                requeued = not active
                if requeued:
                    conn.execute(
                        "UPDATE jobs SET state = 'queued', attempts = 0, error = NULL, not_before = ?,"
                        " updated_at = ? WHERE id = ?",
                        [now, now, job_id],
                    )
        if requeued:
            self._announce((JOBS_QUEUED_CHANNEL, ""))
        return self.job(job_id)

    # ----------------------------------------------------------------- fleet
    # The reservation's primary key is what makes double-booking a GPU impossible; the rest of
    # the fleet's queries are written once in `store.queries.fleet`.

    def create_deployment(
        self, deployment_id: str, server: str, gpus: Sequence[str], record_json: str
    ) -> None:
        """Reserve `gpus` and record the deployment in one transaction, or raise GpuTaken."""
        now = _iso(_now())
        with self._transaction() as conn:
            if gpus:
                marks = ",".join("?" * len(gpus))
                taken = conn.execute(
                    f"SELECT gpu_uuid FROM reservations WHERE gpu_uuid IN ({marks})", list(gpus)
                ).fetchall()
                if taken:
                    raise GpuTaken(", ".join(row[0] for row in taken))
            conn.executemany(
                "INSERT INTO reservations (gpu_uuid, server, deployment_id) VALUES (?, ?, ?)",
                [(gpu, server, deployment_id) for gpu in gpus],
            )
            conn.execute(
                "INSERT INTO deployments (id, server, record, state, desired, created_at, updated_at)"
                " VALUES (?, ?, ?, 'pending', 'run', ?, ?)",
                [deployment_id, server, record_json, now, now],
            )
        self._announce((FLEET_CHANNEL, "reservations"))  # other processes: the index, the agent's poll

    # ------------------------------------------------------ registry gates

    def defer_job(self, job_id: str, error: str, *, retry_in: float, owner: str) -> bool:
        """The registry said come back later (429/503 with Retry-After): put the job back.

        In one transaction the job is queued again for `retry_in` seconds, without spending
        an attempt (the registry's state, not the image's), and its registry's gate closes
        until then, so no worker in any process claims another of its jobs before that while
        the other registries go on. False (nothing written) when `owner` lost the lease.
        """
        moment = _now()
        until = _iso(moment + timedelta(seconds=max(0.0, retry_in)))
        with self._transaction() as conn:
            row = conn.execute(
                "SELECT registry FROM jobs WHERE id = ? AND state = 'running' AND lease_owner = ?",
                [job_id, owner],
            ).fetchone()
            if row is None:
                return False
            conn.execute(
                "UPDATE jobs SET state = 'queued', error = ?, not_before = ?, attempts = max(0, attempts - 1),"
                " lease_owner = NULL, lease_expires = NULL, updated_at = ? WHERE id = ?",
                [error, until, _iso(moment), job_id],
            )
            conn.execute(  # its other queued jobs wait for the gate too
                "UPDATE jobs SET not_before = ? WHERE state = 'queued' AND registry = ? AND not_before < ?",
                [until, row[0], until],
            )
            conn.execute(
                "INSERT INTO registry_gates (registry, cool_until, cool_reason) VALUES (?, ?, ?)"
                " ON CONFLICT(registry) DO UPDATE SET cool_until = max(coalesce(cool_until, ''),"
                " excluded.cool_until), cool_reason = excluded.cool_reason",
                [row[0], until, error],
            )
        self._announce((JOBS_QUEUED_CHANNEL, ""))
        return True

    def registry_load(self) -> list[RegistryLoad]:
        """Every registry with running or queued jobs, or a closed gate, by name."""
        self._settle_intake()
        moment = _now()
        now = _iso(moment)
        with self._reading() as db:
            counts = db.execute(
                "SELECT registry, sum(state = 'running'), sum(state = 'queued' AND not_before <= ?)"
                " FROM jobs WHERE state IN ('queued', 'running') GROUP BY registry",
                [now],
            ).fetchall()
            gates = db.execute(
                "SELECT registry, cool_until FROM registry_gates WHERE cool_until > ?", [now]
            ).fetchall()
        cooling = {
            registry: (datetime.fromisoformat(until) - moment).total_seconds() for registry, until in gates
        }
        loads = {
            registry: RegistryLoad(registry, int(running), int(ready), cooling.get(registry, 0.0))
            for registry, running, ready in counts
        }
        for registry, seconds in cooling.items():
            loads.setdefault(registry, RegistryLoad(registry, 0, 0, seconds))
        return [loads[name] for name in sorted(loads)]
