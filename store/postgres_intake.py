"""PostgreSQL's webhook intake: a delivery's jobs in one statement, run on the event loop.

The statement (`_ENQUEUE`) inserts every new job in key order and sends the NOTIFY that wakes the
workers; it commits on its own (autocommit), so a delivery costs one round trip. A reference whose
job is already queued or running coalesces into it, read after (`_ACTIVE`).

What to run is decided by `enqueue_plan`, which does no I/O: it yields each statement and is sent
its rows. Two drivers run it:

- `PostgresStore.enqueue_many` on a pooled connection, for callers on a thread of their own;
- `LoopIntake.record`, for the webhook intake: a connection of the intake's own, read by the
  event loop that answers the deliveries. Between a delivery and its durable record there is no
  thread: no hand-over to wake one, no wake-up of the loop to come back, no interpreter lock to
  share with the threads that serve reads. Measured beside running scans on two cores, the
  registry waited 3.4-3.5 ms for an answer (p50) where it waited 4.1-4.8 ms with a commit thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Generator, Sequence
from typing import Any

import psycopg

from store.events import JOBS_QUEUED_CHANNEL
from store.models import EnqueueBatch, StoreUnavailable
from store.postgres_errors import describe_error, error_cause
from store.queries.jobs import dedupe_key

# The intake's one statement: every new job, in key order, and the NOTIFY that wakes the workers
# (sent also when every job coalesced into an active one). A row per job inserted, and one
# (NULL, NULL) row from the NOTIFY.
_ENQUEUE = (
    "WITH items AS ("
    "  SELECT * FROM unnest(%(ids)s::text[], %(references)s::text[], %(registries)s::text[],"
    "    %(waits)s::float8[], %(keys)s::text[], %(attempts)s::int[], %(sources)s::text[])"
    "    AS item(id, reference, registry, wait, dedupe_key, max_attempts, source)),"
    " inserted AS ("
    "  INSERT INTO jobs (id, reference, registry, dedupe_key, state, attempts, max_attempts, not_before, source,"
    "    created_at, updated_at)"
    "  SELECT id, reference, registry, dedupe_key, 'queued', 0, max_attempts, now() + make_interval(secs => wait),"
    "    source, clock_timestamp(), clock_timestamp() FROM items ORDER BY dedupe_key"
    "  ON CONFLICT (dedupe_key) WHERE state IN ('queued', 'running') DO NOTHING RETURNING id, dedupe_key)"
    " SELECT id, dedupe_key FROM inserted"
    " UNION ALL SELECT NULL, NULL FROM (SELECT pg_notify(%(channel)s, '')) AS told"
)
# The active job of each key that coalesced.
_ACTIVE = (
    "SELECT id, dedupe_key FROM jobs WHERE dedupe_key = ANY(%(keys)s) AND state IN ('queued', 'running')"
)
ROUNDS = 5  # a reference goes round again only when its active job settles between the two statements
INTAKE_NAME = "gpubadge-intake"  # the loop intake's application_name (pg_stat_activity)

Statement = tuple[str, dict[str, Any]]
Rows = list[tuple[Any, ...]]
EnqueuePlan = Generator[Statement, Rows, list[list[str]]]


def enqueue_plan(batches: Sequence[EnqueueBatch]) -> EnqueuePlan:
    """The statements that queue `batches`: yields each (SQL, parameters) and is sent its rows;
    returns the job ids, per batch, in the order of its references. No statement when there is
    nothing to queue. Every statement takes the keys in one order, so concurrent intakes that
    share references (replicas given the same push) wait for each other instead of deadlocking.
    Raises StoreUnavailable when a key's active job kept changing for `ROUNDS` rounds."""
    wanted: dict[str, tuple[str, str, float, EnqueueBatch]] = {}  # dedupe key -> its first item
    keys: list[list[str]] = []
    for batch in batches:
        keys.append([])
        for item in batch.references:
            key = dedupe_key(item[0], rescan=batch.rescan)
            keys[-1].append(key)
            wait = item[2] if len(item) == 3 else batch.delay
            wanted.setdefault(key, (item[0], item[1], float(wait), batch))
    found: dict[str, str] = {}
    for _ in range(ROUNDS):
        missing = sorted(key for key in wanted if key not in found)
        if not missing:
            break
        items = [wanted[key] for key in missing]
        inserted = yield (
            _ENQUEUE,
            {
                "ids": [uuid.uuid4().hex for _ in missing],
                "references": [item[0] for item in items],
                "registries": [item[1] for item in items],
                "waits": [item[2] for item in items],
                "keys": missing,
                "attempts": [item[3].max_attempts for item in items],
                "sources": [item[3].source for item in items],
                "channel": JOBS_QUEUED_CHANNEL,
            },
        )
        found.update({key: str(job_id) for job_id, key in inserted if key is not None})
        coalesced = [key for key in missing if key not in found]
        if coalesced:
            active = yield _ACTIVE, {"keys": coalesced}
            found.update({key: str(job_id) for job_id, key in active})
    lost = sorted(key for key in wanted if key not in found)
    if lost:
        message = f"could not queue {wanted[lost[0]][0]}: its active job kept changing"
        raise StoreUnavailable(message, message)
    return [[found[key] for key in batch_keys] for batch_keys in keys]


class LoopIntake:
    """The webhook intake's own PostgreSQL connection, read by the event loop that answers the
    deliveries (psycopg's async connection, autocommit).

    One statement at a time (the intake's group commit never runs two). Opened at the first
    delivery. A connection that breaks (a failover, an idle-connection reaper, a restarted server)
    is dropped, and the delivery is tried once more on a new one: the statement coalesces, so a
    first try that committed unseen yields the same job ids. A server that cannot be reached, or
    a statement unanswered within `timeout` seconds, is StoreUnavailable (the route's 503)."""

    def __init__(self, url: str, *, timeout: float) -> None:
        self._url = url
        self._timeout = timeout
        self._connection: psycopg.AsyncConnection[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def record(self, batches: Sequence[EnqueueBatch]) -> list[list[str]]:
        """Queue `batches` (see `enqueue_plan`); returns once committed, with the job ids per batch."""
        for last_try in (False, True):
            fresh = self._connection is None or self._loop is not asyncio.get_running_loop()
            try:
                async with asyncio.timeout(self._timeout):
                    connection = await self._connected()
                    return await _run_on(connection, enqueue_plan(batches))
            except (psycopg.OperationalError, TimeoutError) as exc:
                self._drop()
                if fresh or last_try:
                    raise _unavailable(exc, self._timeout) from exc
            except asyncio.CancelledError:  # mid-statement: what the connection holds is unknown
                self._drop()
                raise
        raise AssertionError("unreachable")  # pragma: no cover - the second try returns or raises

    async def close(self) -> None:
        """Close the connection, if open."""
        connection, self._connection = self._connection, None
        if connection is not None and self._loop is asyncio.get_running_loop():
            with contextlib.suppress(psycopg.Error):
                await connection.close()
        elif connection is not None:
            connection.pgconn.finish()  # opened on a loop that is gone: nothing can await it there

    def _drop(self) -> None:
        """Forget the connection at once, without a round trip (it may be broken or mid-statement)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.pgconn.finish()

    async def _connected(self) -> psycopg.AsyncConnection[Any]:
        loop = asyncio.get_running_loop()
        if self._connection is not None and (self._loop is not loop or self._connection.closed):
            self._drop()
        if self._connection is None:
            self._connection = await psycopg.AsyncConnection.connect(
                self._url,
                autocommit=True,
                connect_timeout=max(1, int(self._timeout)),
                application_name=INTAKE_NAME,
            )
            self._loop = loop
        return self._connection


def _unavailable(exc: BaseException, timeout: float) -> StoreUnavailable:
    if isinstance(exc, TimeoutError):
        message = f"PostgreSQL did not take the delivery within {timeout:g} s"
        return StoreUnavailable(message, message)
    return StoreUnavailable(
        f"PostgreSQL is unreachable: {describe_error(exc)}", f"PostgreSQL is unreachable: {error_cause(exc)}"
    )


async def _run_on(connection: psycopg.AsyncConnection[Any], plan: EnqueuePlan) -> list[list[str]]:
    """Drive `plan` on `connection`, each statement committed on its own."""
    try:
        statement = next(plan)
        while True:
            cursor = await connection.execute(*statement)
            statement = plan.send(await cursor.fetchall())
    except StopIteration as done:
        ids: list[list[str]] = done.value
        return ids
