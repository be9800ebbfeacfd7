"""The PostgreSQL backend: the store shared by many API and worker processes.

Same contract, same records as `store.sqlite.SqliteStore`; the queries both share are
written once in `store.queries` and run here through `run`. What stays here is how
concurrency is made safe when the writers are separate processes on separate
machines:

- Claims lock candidate rows with `FOR UPDATE SKIP LOCKED`, so two workers never
  wait on each other's rows; the fair share across registries and the
  per-registry cap are exact across workers (claimers take turns on a short
  advisory lock while they choose).
- Enqueue dedup is the partial unique index `jobs_active_key` plus
  `ON CONFLICT DO NOTHING`: the same reference pushed to two API replicas at the
  same moment yields one job, and both callers get its id.
- A GPU reservation is an `INSERT` into a table keyed by the GPU's UUID, so the
  second of two concurrent deploys fails on the key, whichever replica took it.
- Every commit that changes the queue sends `NOTIFY`: workers wake on new jobs and
  API replicas learn that a job finished, without polling (`listen`).
- Times come from the database's clock, so replicas with skewed clocks still agree
  on leases and on which job is due.

It is synchronous on purpose, like the SQLite backend: `store.facade.AsyncStore`
runs every call in its thread pool, and psycopg's pool hands each thread its own
connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool, PoolTimeout

from store import queries
from store.backend import SharedMethods
from store.dialect import POSTGRES, Db, P, Query, T
from store.events import ALL_CHANNELS, FLEET_CHANNEL, JOB_SETTLED_CHANNEL, JOBS_QUEUED_CHANNEL
from store.fairness import claim_order, plan_claims
from store.intake_journal import JournaledJob
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
from store.postgres_connect import wait_for_server
from store.postgres_errors import describe_error as _describe
from store.postgres_errors import error_cause as _cause
from store.postgres_intake import INTAKE_NAME, LoopIntake, enqueue_plan
from store.queries import JOB_READS
from store.queries.jobs import JOB_COLUMNS, LEASE_LAPSED_ERROR, job_of, queued_jobs, registry_turns
from store.queries.journal_moves import move_journaled, queued_beside_journal

log = logging.getLogger(__name__)

# NOTIFY channels. Payloads are job ids only: never a reference (it may carry a user's tag names
# into other tenants' listeners) and never more than PostgreSQL's 8000-byte payload limit.
JOBS_QUEUED = JOBS_QUEUED_CHANNEL
JOB_SETTLED = JOB_SETTLED_CHANNEL

# Arbitrary constants naming gpubadge's advisory locks (one 64-bit key space per database).
_MIGRATION_LOCK = 0x67707562_61646765  # "gpubadge"
_CLAIM_LOCK_CLASS = 0x6770_6263  # the claim lock: (class, 0), held while a claim picks its jobs

Notification = tuple[str, str]  # (channel, payload)
LISTENER_NAME = "gpubadge-listen"  # the listening connection's application_name (pg_stat_activity)
RECONNECT_SECONDS = 1.0  # a lost listening connection is opened again this often


def _job(conn: psycopg.Connection[TupleRow], row: Sequence[Any]) -> Job:
    """A row of `JOB_COLUMNS` as a Job, its times in the text form the SQLite backend stores."""
    return job_of(Db(conn, POSTGRES), row)


Pool = ConnectionPool[psycopg.Connection[TupleRow]]


def _new_pool(
    url: str, size: int, timeout: float, name: str, *, statement_timeout: float | None = None
) -> Pool:
    """A pool (not yet open) of autocommit connections named `name` (their `application_name`).
    `statement_timeout` bounds each statement, set per connection as a session setting, not as a
    startup option, which poolers such as PgBouncer refuse."""
    configure = None
    if statement_timeout is not None:
        bound = sql.SQL("SET statement_timeout = {}").format(
            sql.Literal(max(1, round(statement_timeout * 1000)))
        )

        def configure(conn: psycopg.Connection[TupleRow]) -> None:
            conn.execute(bound)

    return ConnectionPool(
        url,
        min_size=1,
        max_size=size,
        timeout=timeout,
        kwargs={"connect_timeout": max(1, int(timeout)), "application_name": name, "autocommit": True},
        configure=configure,
        open=False,
        name=name,
    )


@contextlib.contextmanager
def _unavailable_on_failure() -> Iterator[None]:
    """A pool that gives no connection in time, or a server out of reach, as `StoreUnavailable`."""
    try:
        yield
    except PoolTimeout as exc:
        raise StoreUnavailable(
            f"no PostgreSQL connection: {_describe(exc)}", f"no PostgreSQL connection: {_cause(exc)}"
        ) from exc
    except psycopg.OperationalError as exc:
        raise StoreUnavailable(
            f"PostgreSQL is unreachable: {_describe(exc)}", f"PostgreSQL is unreachable: {_cause(exc)}"
        ) from exc


class PostgresStore(SharedMethods):
    """A connection pool over one PostgreSQL database; safe to call from many threads."""

    shares_events = True  # every replica hears every commit (LISTEN/NOTIFY)
    local_reads = False  # every read is a round trip to the server

    def __init__(
        self,
        url: str,
        *,
        pool_size: int = 10,
        connect_timeout: float = 10.0,
        upgrade: bool = True,
        intake_journal: Path | None = None,
    ) -> None:
        self._url = url
        self._connect_timeout = connect_timeout
        self._pool_size = max(1, pool_size)
        self._intake_pool: Pool | None = None  # `enqueue_many`'s
        self._intake_pool_lock = threading.Lock()
        # The webhook intake's local journal and its mover, where one is configured (store.intake_mover)
        self._intake = (
            IntakeMover(
                intake_journal,
                self._move_journaled,
                busy_timeout=connect_timeout,
                store="PostgreSQL",
                otherwise="unset GPUBADGE_INTAKE_JOURNAL to commit each delivery on PostgreSQL instead",
            )
            if intake_journal is not None
            else None
        )
        # autocommit: a read is its statements, one round trip each; a write says where its transaction
        # begins and ends (`_transaction`)
        self._pool = _new_pool(url, self._pool_size, connect_timeout, "gpubadge")
        try:
            # one connection first: a refused URL fails at once, in the server's words (not the pool's)
            wait_for_server(url, connect_timeout, "gpubadge")
            self._pool.open(wait=True, timeout=connect_timeout)
            if upgrade:
                self.upgrade()
        except (psycopg.Error, PoolTimeout) as exc:
            self._pool.close()
            raise StoreUnavailable(
                f"cannot open the PostgreSQL store: {_describe(exc)}",
                f"cannot open the PostgreSQL store: {_cause(exc)}",
            ) from exc

    # ------------------------------------------------------------ plumbing

    @contextlib.contextmanager
    def _connection(self, *, transaction: bool) -> Iterator[psycopg.Connection[TupleRow]]:
        """One pooled connection (autocommit), inside one transaction when asked; a pool that gives
        none in time, or a server out of reach, is `StoreUnavailable`."""
        with _unavailable_on_failure(), self._pool.connection() as conn:
            if transaction:
                with conn.transaction():
                    yield conn
            else:
                yield conn

    @contextlib.contextmanager
    def _intake_connection(self) -> Iterator[psycopg.Connection[TupleRow]]:
        """One connection of the intake's own pool (autocommit), opened at the first commit. Its
        statements are bounded by the connect timeout (`statement_timeout`, lock waits included), as
        the loop intake's are (`LoopIntake`): a commit that waits longer is `StoreUnavailable`, the
        sender's 503, never a thread held for as long as a lock is."""
        with _unavailable_on_failure():
            try:
                with (self._intake_pool or self._open_intake_pool()).connection() as conn:
                    yield conn
            except psycopg.errors.QueryCanceled as exc:
                message = f"PostgreSQL did not take the jobs within {self._connect_timeout:g} s"
                raise StoreUnavailable(message, message) from exc

    def _open_intake_pool(self) -> Pool:
        """The intake's pool, opened with its first connection ready (PoolTimeout when none comes);
        each connection's statements bounded by the connect timeout."""
        with self._intake_pool_lock:
            if self._intake_pool is None:
                timeout = self._connect_timeout
                pool = _new_pool(self._url, self._pool_size, timeout, INTAKE_NAME, statement_timeout=timeout)
                pool.open(wait=False)
                try:
                    pool.wait(timeout=timeout)
                except PoolTimeout:
                    pool.close()  # tried afresh at the next commit
                    raise
                self._intake_pool = pool
            return self._intake_pool

    def _transaction(self) -> contextlib.AbstractContextManager[psycopg.Connection[TupleRow]]:
        """One pooled connection inside one transaction (committed on success, rolled back on error)."""
        return self._connection(transaction=True)

    def _reading(self) -> contextlib.AbstractContextManager[psycopg.Connection[TupleRow]]:
        """One pooled connection for reads, with no transaction around them: each statement is one
        round trip, where BEGIN and COMMIT would add two. Under READ COMMITTED a transaction gives
        its statements no snapshot in common anyway (each sees what was committed when it began),
        and a read never waits for writers either way."""
        return self._connection(transaction=False)

    def upgrade(self) -> int:
        """Apply the pending migrations; safe when many replicas start at once (advisory lock)."""
        with self._transaction() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", [_MIGRATION_LOCK])
            for migration in apply_pending(conn, "postgres"):
                log.info("PostgreSQL schema migrated to %d (%s)", migration.version, migration.name)
        return latest_version("postgres")

    def schema_version(self) -> int:
        with self._reading() as conn:
            exists = conn.execute("SELECT to_regclass('schema_migrations') IS NOT NULL").fetchone()
            if not exists or not exists[0]:
                return 0
            row = conn.execute("SELECT coalesce(max(version), 0) FROM schema_migrations").fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        if self._intake is not None:
            self._intake.close()  # its last pass needs the pool
        self._pool.close()
        if self._intake_pool is not None:
            self._intake_pool.close()

    async def relay_notifications(
        self,
        callback: Callable[[Notification], None],
        listening: asyncio.Event | None = None,
        channels: Sequence[str] = ALL_CHANNELS,
    ) -> None:
        """On the running loop until cancelled: LISTEN on a connection of its own and call
        `callback((channel, payload))` there for every NOTIFY on `channels`, in order.

        psycopg's async connection: the loop itself waits on the connection's socket, with no thread
        between a notice and its waiters. `listening` is set once the LISTENs are in place. A lost
        connection is opened again every RECONNECT_SECONDS; once it is back, `("", "")` is reported
        once, so the caller re-reads whatever it waits on (notices may have been missed)."""
        lost = False
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self._url,
                    autocommit=True,
                    connect_timeout=max(1, int(self._connect_timeout)),
                    application_name=LISTENER_NAME,
                ) as conn:
                    for channel in channels:
                        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    if listening is not None:
                        listening.set()
                    if lost:
                        _relay(callback, ("", ""))
                    async for notice in conn.notifies():
                        _relay(callback, (notice.channel, notice.payload))
            except psycopg.Error as exc:
                log.warning("PostgreSQL listener lost its connection (%s); reconnecting", _describe(exc))
            except Exception:  # whatever it was, notices must go on arriving
                log.exception("PostgreSQL listener failed; reconnecting")
            lost = True
            await asyncio.sleep(RECONNECT_SECONDS)

    # ---------------------------------------------------------------- health

    def check_writable(self, timeout: float) -> None:
        """Prove the database takes a write within `timeout`, or raise StoreUnavailable."""
        millis = max(1, int(timeout * 1000))
        try:
            with self._pool.connection(timeout=timeout) as conn, conn.transaction():
                conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(millis)))
                conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(millis)))
                conn.execute(
                    "INSERT INTO health (id, checked_at) VALUES (1, now())"
                    " ON CONFLICT (id) DO UPDATE SET checked_at = excluded.checked_at"
                )
        except (psycopg.Error, PoolTimeout) as exc:
            raise StoreUnavailable(
                f"PostgreSQL cannot be written: {_describe(exc)}",
                f"PostgreSQL cannot be written: {_cause(exc)}",
            ) from exc

    def queue_health(self) -> QueueHealth:
        self._settle_intake()
        with self._reading() as conn:
            row = conn.execute(
                "SELECT (SELECT count(*) FROM jobs WHERE state = 'queued' AND not_before <= now()),"
                " extract(epoch FROM now() - (SELECT min(not_before) FROM jobs"
                "   WHERE state = 'queued' AND not_before <= now())),"
                " extract(epoch FROM now() - (SELECT max(updated_at) FROM jobs WHERE attempts > 0)),"
                " (SELECT count(*) FROM jobs WHERE state = 'running')"
            ).fetchone()
        assert row is not None
        return QueueHealth(
            ready=int(row[0]),
            oldest_ready_seconds=None if row[1] is None else max(0.0, float(row[1])),
            last_progress_seconds=None if row[2] is None else max(0.0, float(row[2])),
            running=int(row[3]),
        )

    # ---------------------------------------------------------------- queries

    def run(self, query: Query[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run one of `store.queries` (or any `Query`) on one pooled connection: a write in one
        transaction, a read statement by statement (`_reading`). With an intake journal, a read of
        the job queue first waits for the jobs this process journaled (`_settle_intake`), and a job
        still in the journal is shown queued."""
        if self._intake is not None and query in JOB_READS:
            return self._intake.read_queue(self._run, query, *args, **kwargs)
        return self._run(query, *args, **kwargs)

    def _run(self, query: Query[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        with self._transaction() if query.write else self._reading() as conn:
            return query(Db(conn, POSTGRES), *args, **kwargs)

    # ------------------------------------------------------------------ jobs

    def start_intake(self) -> None:
        """With a journal, open it and start its mover (what an earlier run journaled and did not
        move is moved now); without, nothing to ready: the intake inserts into `jobs`."""
        if self._intake is not None:
            self._intake.start()

    def record_intake(self, batches: Sequence[EnqueueBatch]) -> list[list[str]]:
        """The webhook intake's commit. With a journal (`intake_journal`), a local commit and no
        round trip: the mover carries the jobs into `jobs` moments later (`store.intake_mover`);
        the journal reads nothing of the server, so a reference with an active job there gets an
        id of its own, which becomes an alias of that job when it moves. Without, `enqueue_many`."""
        if self._intake is None:
            return self.enqueue_many(batches)
        if not any(batch.references for batch in batches):
            return [[] for _ in batches]
        return self._intake.record(batches, None)

    def tidy_intake(self) -> None:
        """With a journal, delete its rows already moved; without, nothing to tidy."""
        if self._intake is not None:
            self._intake.trim()

    def intake_unmoved(self) -> int:
        """With a journal, jobs this process journaled that are not in PostgreSQL yet (no I/O); else 0."""
        return self._intake.unmoved() if self._intake is not None else 0

    def queued_for_intake(self, cap: int) -> int:
        """Queued jobs up to `cap`, for the intake's queue cap; with a journal, plus its rows past
        this server's mark of it (`IntakeMover.waiting`: each job counted once while a move commits)."""
        if self._intake is None:
            return self._run(queued_jobs, cap=cap)
        return self._intake.waiting(lambda journal_id: self._run(queued_beside_journal, journal_id, cap=cap))

    def _settle_intake(self) -> None:
        """With a journal, wait until what this process journaled is in `jobs` (bounded)."""
        if self._intake is not None:
            self._intake.settle()

    def _move_journaled(
        self, journal_id: str, rows_after: Callable[[int], Sequence[JournaledJob]], through: int
    ) -> int:
        """The journal mover's pass (`store.queries.journal_moves`), in one transaction."""
        return self.run(move_journaled, journal_id, rows_after, through)

    def enqueue_many(self, batches: Sequence[EnqueueBatch]) -> list[list[str]]:
        """Several deliveries' jobs in one statement (group commit); job ids per batch
        (`store.postgres_intake.enqueue_plan`, on a connection of the intake's pool, each statement
        bounded by the connect timeout: past it, `StoreUnavailable`)."""
        plan = enqueue_plan(batches)
        try:
            statement = next(plan)
        except StopIteration as nothing:  # nothing to queue: no connection taken
            ids: list[list[str]] = nothing.value
            return ids
        with self._intake_connection() as conn:  # each statement commits on its own
            while True:
                rows = conn.execute(*statement).fetchall()
                try:
                    statement = plan.send(rows)
                except StopIteration as done:
                    queued: list[list[str]] = done.value
                    return queued

    def loop_intake(self) -> LoopIntake | None:
        """The webhook intake's commits on the event loop, on a connection of their own
        (`store.postgres_intake.LoopIntake`), bounded by the connect timeout; None with a journal
        (its local commits run on the intake's thread, as SQLite's)."""
        if self._intake is not None:
            return None
        return LoopIntake(self._url, timeout=self._connect_timeout)

    def claim_jobs(
        self, limit: int, *, owner: str, lease_seconds: float, per_registry: int | None = None
    ) -> list[Job]:
        """Atomically move up to `limit` ready jobs to `running`, leased to `owner`, and return them.

        Claims are fair across registries (`store.fairness`): each slot goes to the registry with
        ready jobs and the fewest running across every worker, the least recently claimed first
        among equals (`registry_gates.last_claimed`, shared by every process), so claims rotate
        and a slow registry cannot take every worker. A registry cooling down after a Retry-After
        gets none (its queued jobs move to the end of the cool-down); with `per_registry`, none
        gets more than that many running. Claimers take
        turns on one advisory lock for the few milliseconds of the choice, so counts and turns are
        exact across processes; rows are still locked with SKIP LOCKED against other writers. A claim
        that finds no job due once it has its turn (another's claim took it) ends its turn at once.
        """
        if limit <= 0:
            return []
        self._settle_intake()
        with self._transaction() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s, 0)", [_CLAIM_LOCK_CLASS])
            # Another replica's claim may have taken every due job while this one waited its turn
            # (a queued job wakes every worker process): then there is nothing to choose or write.
            if not queries.job_ready(Db(conn, POSTGRES)):
                return []
            # Jobs of a registry cooling down (queued since its gate closed) wait for the gate: then
            # neither the idle loop, nor /healthz's stall check, nor /metrics counts them as ready.
            conn.execute(
                "UPDATE jobs j SET not_before = g.cool_until FROM registry_gates g"
                " WHERE g.registry = j.registry AND g.cool_until > now()"
                " AND j.state = 'queued' AND j.not_before < g.cool_until"
            )
            turns = registry_turns(Db(conn, POSTGRES), limit)
            plan = plan_claims(turns, limit, per_registry)
            claimed: list[Job] = []
            for registry in dict.fromkeys(plan):
                rows = conn.execute(
                    "UPDATE jobs SET state = 'running', attempts = attempts + 1, lease_owner = %s,"
                    " lease_expires = now() + make_interval(secs => %s), updated_at = clock_timestamp()"
                    " WHERE id IN (SELECT id FROM jobs WHERE state = 'queued' AND registry = %s"
                    "   AND not_before <= now() ORDER BY not_before, created_at LIMIT %s FOR UPDATE SKIP LOCKED)"
                    f" RETURNING {JOB_COLUMNS}",
                    [owner, lease_seconds, registry, plan.count(registry)],
                ).fetchall()
                claimed.extend(_job(conn, row) for row in rows)
            if claimed:
                conn.cursor().executemany(
                    "INSERT INTO registry_gates (registry, last_claimed)"
                    " VALUES (%s, now() + make_interval(secs => %s))"
                    " ON CONFLICT (registry) DO UPDATE SET last_claimed = excluded.last_claimed",
                    [(registry, position * 1e-6) for position, registry in enumerate(claim_order(plan))],
                )
        return sorted(claimed, key=lambda job: (job.created_at, job.id))

    def renew_leases(self, owner: str, job_ids: Sequence[str], lease_seconds: float) -> list[str]:
        """Extend `owner`'s leases; returns the ids it still holds (a lost lease is not renewed)."""
        if not job_ids:
            return []
        with self._transaction() as conn:
            rows = conn.execute(
                "UPDATE jobs SET lease_expires = now() + make_interval(secs => %s)"
                " WHERE id = ANY(%s) AND state = 'running' AND lease_owner = %s RETURNING id",
                [lease_seconds, list(job_ids), owner],
            ).fetchall()
        return [row[0] for row in rows]

    def expire_leases(self) -> list[LeaseExpiry]:
        """Running jobs whose lease has passed go back to the queue, or fail once their attempts are spent."""
        with self._transaction() as conn:
            rows = conn.execute(
                "WITH lapsed AS (SELECT id, lease_owner AS owner FROM jobs WHERE state = 'running'"
                "   AND (lease_expires IS NULL OR lease_expires < now()) FOR UPDATE SKIP LOCKED)"
                " UPDATE jobs SET"
                "   state = CASE WHEN attempts >= max_attempts THEN 'failed' ELSE 'queued' END,"
                f"   error = {LEASE_LAPSED_ERROR},"
                "   not_before = now(), lease_owner = NULL, lease_expires = NULL, updated_at = clock_timestamp()"
                " FROM lapsed WHERE jobs.id = lapsed.id"
                " RETURNING jobs.id, jobs.reference, lapsed.owner, jobs.state",
            ).fetchall()
            expired = [LeaseExpiry(row[0], row[1], row[2] or "", row[3]) for row in rows]
            self._notify_changes(conn, expired)
        return expired

    def release_leases(self, owners: Sequence[str], *, refund_attempt: bool) -> int:
        """Requeue at once every job held by `owners` (workers known to be gone, or shutting down)."""
        if not owners:
            return 0
        return self._requeue_running("lease_owner = ANY(%s)", [list(owners)], refund_attempt=refund_attempt)

    def preempt_job(self, job_id: str, *, owner: str) -> bool:
        """Put `owner`'s running job back in the queue, ready now and with its attempt refunded.

        A worker does this to hand its slot to a registry that has waited with no scan in flight
        (`jobs.workers`' pre-emption): the job did nothing wrong. False (nothing written) when
        `owner` no longer holds its lease.
        """
        return self._requeue_running("id = %s AND lease_owner = %s", [job_id, owner], refund_attempt=True) > 0

    def _requeue_running(self, condition: str, params: list[Any], *, refund_attempt: bool) -> int:
        """Requeue, ready now, the running jobs that also meet `condition` (and wake the workers);
        how many."""
        with self._transaction() as conn:
            cursor = conn.execute(
                "UPDATE jobs SET state = 'queued', not_before = now(), lease_owner = NULL,"
                " lease_expires = NULL, attempts = greatest(0, attempts - %s), updated_at = clock_timestamp()"
                f" WHERE state = 'running' AND {condition}",
                [int(refund_attempt), *params],
            )
            if cursor.rowcount:
                conn.execute(sql.SQL("NOTIFY {}").format(sql.Identifier(JOBS_QUEUED)))
            return cursor.rowcount

    def fail_job(self, job_id: str, error: str, *, retry_in: float | None, owner: str) -> JobState | None:
        """Record a failure: `queued` again after `retry_in` seconds, or `failed` for good.

        Returns None, writing nothing, when `owner` no longer holds the job's lease.
        """
        with self._transaction() as conn:
            row = conn.execute(
                "UPDATE jobs SET"
                "   state = CASE WHEN %(final)s OR attempts >= max_attempts THEN 'failed' ELSE 'queued' END,"
                "   error = %(error)s, not_before = now() + make_interval(secs => %(retry)s),"
                "   lease_owner = NULL, lease_expires = NULL, updated_at = clock_timestamp()"
                " WHERE id = %(id)s AND state = 'running' AND lease_owner = %(owner)s"
                " RETURNING state, dedupe_key",
                {
                    "final": retry_in is None,
                    "error": error,
                    "retry": retry_in or 0.0,
                    "id": job_id,
                    "owner": owner,
                },
            ).fetchone()
            if row is None:
                return None
            state: JobState = row[0]
            if state == "failed":
                self._notify_settled(conn, job_id, row[1])
            else:
                conn.execute(sql.SQL("NOTIFY {}").format(sql.Identifier(JOBS_QUEUED)))
        return state

    def compact_job_tallies(self) -> None:
        """Fold `job_tallies`' change rows into one row per state. One statement: the rows it deletes
        are the ones it sums, and a change committed meanwhile stays for the next fold."""
        with self._transaction() as conn:
            conn.execute(
                "WITH folded AS (DELETE FROM job_tallies RETURNING state, delta)"
                " INSERT INTO job_tallies (state, delta)"
                " SELECT state, sum(delta) FROM folded GROUP BY state HAVING sum(delta) <> 0"
            )

    def retry_job(self, job_id: str) -> Job | None:
        """Put a failed job back in the queue by hand (attempts start again)."""
        with self._transaction() as conn:
            row = conn.execute("SELECT state FROM jobs WHERE id = %s FOR UPDATE", [job_id]).fetchone()
            if row is None:
                return None
            if row[0] == "failed":
                # The unique index refuses a second active job for the key; then the failed one stays.
                with contextlib.suppress(psycopg.errors.UniqueViolation), conn.transaction():
                    conn.execute(
                        "UPDATE jobs SET state = 'queued', attempts = 0, error = NULL, not_before = now(),"
                        " updated_at = clock_timestamp() WHERE id = %s",
                        [job_id],
                    )
                    conn.execute(sql.SQL("NOTIFY {}").format(sql.Identifier(JOBS_QUEUED)))
            return queries.job(Db(conn, POSTGRES), job_id)

    @staticmethod
    def _notify_settled(conn: psycopg.Connection[TupleRow], job_id: str, reference: str) -> None:
        """Sent at commit: every replica's waiters on this job or reference (and the slot it frees)
        learn of it. Payload "<job id> <reference>"; references are bounded far below NOTIFY's 8000 bytes."""
        conn.execute("SELECT pg_notify(%s, %s)", [JOB_SETTLED, f"{job_id} {reference}"[:7900]])

    def _notify_changes(self, conn: psycopg.Connection[TupleRow], expired: Sequence[LeaseExpiry]) -> None:
        for entry in expired:
            if entry.state == "failed":
                self._notify_settled(conn, entry.job_id, entry.reference)
        if any(entry.state == "queued" for entry in expired):
            conn.execute(sql.SQL("NOTIFY {}").format(sql.Identifier(JOBS_QUEUED)))

    # ----------------------------------------------------------------- fleet

    def create_deployment(
        self, deployment_id: str, server: str, gpus: Sequence[str], record_json: str
    ) -> None:
        """Reserve `gpus` and record the deployment in one transaction, or raise GpuTaken.

        The reservation's primary key decides between concurrent deploys on any replica:
        `ON CONFLICT DO NOTHING` waits for a rival's uncommitted row, then reports who won.
        """
        wanted = sorted(set(gpus))  # one lock order for every deploy: rivals queue, never deadlock
        with self._transaction() as conn:
            if wanted:
                reserved = conn.execute(
                    "INSERT INTO reservations (gpu_uuid, server, deployment_id)"
                    " SELECT gpu, %s, %s FROM unnest(%s::text[]) AS gpu ORDER BY gpu"
                    " ON CONFLICT (gpu_uuid) DO NOTHING RETURNING gpu_uuid",
                    [server, deployment_id, wanted],
                ).fetchall()
                taken = sorted(set(wanted) - {row[0] for row in reserved})
                if taken:
                    raise GpuTaken(", ".join(taken))  # rolls the partial reservation back
            conn.execute(
                "INSERT INTO deployments (id, server, record, state, desired, created_at, updated_at)"
                " VALUES (%s, %s, %s, 'pending', 'run', clock_timestamp(), clock_timestamp())",
                [deployment_id, server, record_json],
            )
            # other replicas: refresh the placement index, wake the agent's long-poll
            conn.execute("SELECT pg_notify(%s, 'reservations')", [FLEET_CHANNEL])

    # ------------------------------------------------------ registry gates

    def defer_job(self, job_id: str, error: str, *, retry_in: float, owner: str) -> bool:
        """The registry said come back later (429/503 with Retry-After): put the job back.

        In one transaction the job is queued again for `retry_in` seconds, without spending
        an attempt (the registry's state, not the image's), and its registry's gate closes
        until then, so no worker in any process claims another of its jobs before that while
        the other registries go on. False (nothing written) when `owner` lost the lease.
        """
        with self._transaction() as conn:
            row = conn.execute(
                "UPDATE jobs SET state = 'queued', error = %(error)s,"
                "   not_before = now() + make_interval(secs => %(retry)s), attempts = greatest(0, attempts - 1),"
                "   lease_owner = NULL, lease_expires = NULL, updated_at = clock_timestamp()"
                " WHERE id = %(id)s AND state = 'running' AND lease_owner = %(owner)s"
                " RETURNING registry, not_before",
                {"error": error, "retry": max(0.0, retry_in), "id": job_id, "owner": owner},
            ).fetchone()
            if row is None:
                return False
            conn.execute(  # its other queued jobs wait for the gate too
                "UPDATE jobs SET not_before = %s WHERE state = 'queued' AND registry = %s AND not_before < %s",
                [row[1], row[0], row[1]],
            )
            conn.execute(
                "INSERT INTO registry_gates (registry, cool_until, cool_reason) VALUES (%s, %s, %s)"
                " ON CONFLICT (registry) DO UPDATE SET cool_until = greatest(registry_gates.cool_until,"
                " excluded.cool_until), cool_reason = excluded.cool_reason",
                [row[0], row[1], error],
            )
            conn.execute(sql.SQL("NOTIFY {}").format(sql.Identifier(JOBS_QUEUED)))
        return True

    def registry_load(self) -> list[RegistryLoad]:
        """Every registry with running or queued jobs, or a closed gate, by name."""
        with self._reading() as conn:
            rows = conn.execute(
                "SELECT coalesce(j.registry, g.registry), coalesce(j.running, 0), coalesce(j.ready, 0),"
                " coalesce(extract(epoch FROM g.cool_until - now()), 0)"
                " FROM (SELECT registry, count(*) FILTER (WHERE state = 'running') AS running,"
                "   count(*) FILTER (WHERE state = 'queued' AND not_before <= now()) AS ready"
                "   FROM jobs WHERE state IN ('queued', 'running') GROUP BY registry) j"
                " FULL JOIN (SELECT registry, cool_until FROM registry_gates WHERE cool_until > now()) g"
                " ON g.registry = j.registry ORDER BY 1"
            ).fetchall()
        return [
            RegistryLoad(name, int(running), int(ready), float(cool)) for name, running, ready, cool in rows
        ]


def _relay(callback: Callable[[Notification], None], notice: Notification) -> None:
    try:
        callback(notice)
    except Exception:  # the callback's bug must not silence every later notification
        log.exception("PostgreSQL listener callback failed on %s", notice[0])
