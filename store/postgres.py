"""The PostgreSQL backend: the store shared by many API and worker processes.

Same methods, same records as `store.sqlite.SqliteStore`; what changes is how
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

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool, PoolTimeout

from scanner.facts.badges import libc_label
from scanner.models import ImageReport, PlatformReport
from store.events import FLEET_CHANNEL, JOB_SETTLED_CHANNEL, JOBS_QUEUED_CHANNEL, REPORTED_JOB
from store.fairness import RegistryTurn, claim_order, plan_claims
from store.migrations import latest_version, migrations
from store.models import (
    JOB_STATES,
    DeploymentRecord,
    EnqueueBatch,
    GpuTaken,
    ImageRow,
    Job,
    JobState,
    LeaseExpiry,
    QueueHealth,
    RegistryLoad,
    ServerRecord,
    StoreUnavailable,
    TagEvent,
)

log = logging.getLogger(__name__)

# NOTIFY channels. Payloads are job ids only: never a reference (it may carry a user's tag names
# into other tenants' listeners) and never more than PostgreSQL's 8000-byte payload limit.
JOBS_QUEUED = JOBS_QUEUED_CHANNEL
JOB_SETTLED = JOB_SETTLED_CHANNEL
CHANNELS = (JOBS_QUEUED, JOB_SETTLED, FLEET_CHANNEL)

# Arbitrary constants naming gpubadge's advisory locks (one 64-bit key space per database).
_MIGRATION_LOCK = 0x67707562_61646765  # "gpubadge"
_CLAIM_LOCK_CLASS = 0x6770_6263  # the claim lock: (class, 0), held while a claim picks its jobs

Notification = tuple[str, str]  # (channel, payload)


def _iso(moment: datetime | None) -> str | None:
    """The same text form the SQLite backend stores, so callers see one format."""
    return None if moment is None else moment.astimezone(UTC).isoformat(timespec="microseconds")


def _job(row: Sequence[Any]) -> Job:
    values = list(row)
    for index in (9, 10, 12):  # created_at, updated_at, lease_expires
        values[index] = _iso(values[index])
    return Job(*values)


# Exact totals up to this many matching images; beyond, the planner's estimate (see `_count`).
EXACT_COUNT_LIMIT = 10_000
# The text `q` searches: one expression, so one trigram index serves it (migration 0003).
_SEARCH_TEXT = (
    "(r.repository || chr(31) || r.reference || chr(31) || r.digest || chr(31) || coalesce(r.distro, ''))"
)

_JOB_COLUMNS = (
    "id, reference, registry, state, attempts, max_attempts, error, result_digest, source, created_at,"
    " updated_at, lease_owner, lease_expires"
)


class PostgresStore:
    """A connection pool over one PostgreSQL database; safe to call from many threads."""

    def __init__(
        self,
        url: str,
        *,
        pool_size: int = 10,
        connect_timeout: float = 10.0,
        upgrade: bool = True,
    ) -> None:
        self._url = url
        self._connect_timeout = connect_timeout
        self._pool: ConnectionPool[psycopg.Connection[TupleRow]] = ConnectionPool(
            url,
            min_size=1,
            max_size=max(1, pool_size),
            timeout=connect_timeout,
            kwargs={"connect_timeout": max(1, int(connect_timeout)), "application_name": "gpubadge"},
            open=False,
            name="gpubadge",
        )
        try:
            self._pool.open(wait=True, timeout=connect_timeout)
            if upgrade:
                self.upgrade()
        except (psycopg.Error, PoolTimeout) as exc:
            self._pool.close()
            raise StoreUnavailable(f"cannot open the PostgreSQL store: {_describe(exc)}") from exc
        self._listeners: list[_Listener] = []

    # ------------------------------------------------------------ plumbing

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[psycopg.Connection[TupleRow]]:
        """One pooled connection inside one transaction (committed on success, rolled back on error)."""
        try:
            with self._pool.connection() as conn, conn.transaction():
                yield conn
        except PoolTimeout as exc:
            raise StoreUnavailable(f"no PostgreSQL connection: {_describe(exc)}") from exc
        except psycopg.OperationalError as exc:
            raise StoreUnavailable(f"PostgreSQL is unreachable: {_describe(exc)}") from exc

    _reading = _transaction  # READ COMMITTED reads never wait for writers

    def upgrade(self) -> int:
        """Apply the pending migrations; safe when many replicas start at once (advisory lock)."""
        with self._transaction() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", [_MIGRATION_LOCK])
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY,"
                " name TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
            )
            applied = {row[0] for row in conn.execute("SELECT version FROM schema_migrations")}
            for migration in migrations("postgres"):
                if migration.version in applied:
                    continue
                for statement in migration.statements():
                    conn.execute(statement.encode())
                conn.execute(
                    "INSERT INTO schema_migrations (version, name) VALUES (%s, %s)",
                    [migration.version, migration.name],
                )
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
        for listener in self._listeners:
            listener.stop()
        self._listeners.clear()
        self._pool.close()

    def listen(self, callback: Callable[[Notification], None]) -> Callable[[], None]:
        """Call `callback((channel, payload))` from a background thread for every queue NOTIFY.

        One dedicated connection per listener; it reconnects after a lost connection
        (then reports ("", "") once, so the caller re-reads whatever it waits on).
        Returns a function that stops the listener.
        """
        listener = _Listener(self._url, callback, self._connect_timeout)
        self._listeners.append(listener)
        listener.start()
        return listener.stop

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
            raise StoreUnavailable(f"PostgreSQL cannot be written: {_describe(exc)}") from exc

    def queue_health(self) -> QueueHealth:
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

    # ---------------------------------------------------------------- reports

    def save_report(self, report: ImageReport) -> None:
        """Store a successful report under its manifest digest, and each platform under its own."""
        if report.error is not None or report.digest is None:
            raise ValueError("only successful reports are stored")
        platforms = report.platforms
        row = {
            "digest": report.digest,
            "registry": report.registry or "",
            "repository": report.repository or "",
            "reference": report.reference,
            "media_type": report.media_type,
            "gpu_required": any(p.gpu.required for p in platforms),
            "cuda_versions": sorted({p.gpu.cuda_version for p in platforms if p.gpu.cuda_version}),
            "libc_flavours": sorted({libc_label(p.libc) for p in platforms}),
            "platforms": [p.platform for p in platforms],
            "distro": next((p.libc.distro for p in platforms if p.libc.distro), None),
            "scanned_at": report.scanned_at,
            "report": report.model_dump_json(),
        }
        with self._transaction() as conn:
            conn.execute(
                "INSERT INTO reports (digest, registry, repository, reference, media_type, gpu_required,"
                " cuda_versions, libc_flavours, platforms, distro, scanned_at, report)"
                " VALUES (%(digest)s, %(registry)s, %(repository)s, %(reference)s, %(media_type)s,"
                " %(gpu_required)s, %(cuda_versions)s, %(libc_flavours)s, %(platforms)s, %(distro)s,"
                " %(scanned_at)s, %(report)s)"
                " ON CONFLICT (digest) DO UPDATE SET registry = excluded.registry,"
                " repository = excluded.repository, reference = excluded.reference,"
                " media_type = excluded.media_type, gpu_required = excluded.gpu_required,"
                " cuda_versions = excluded.cuda_versions, libc_flavours = excluded.libc_flavours,"
                " platforms = excluded.platforms, distro = excluded.distro, scanned_at = excluded.scanned_at,"
                " report = excluded.report",
                row,
            )
            with conn.cursor() as cursor:
                cursor.executemany(
                    "INSERT INTO platform_reports (digest, report) VALUES (%s, %s)"
                    " ON CONFLICT (digest) DO UPDATE SET report = excluded.report",
                    [(p.digest, p.model_dump_json()) for p in platforms],
                )
            children = [p.digest for p in platforms if p.digest != report.digest]
            if children:
                # Platform manifests scanned on their own before their index arrived are not
                # images of their own: the index report covers them.
                conn.execute(
                    "DELETE FROM reports WHERE digest = ANY(%s)"
                    " AND NOT EXISTS (SELECT 1 FROM tags WHERE tags.digest = reports.digest)",
                    [children],
                )
            self._notify_settled(conn, REPORTED_JOB, report.reference)  # long polls on any replica

    def report(self, digest: str) -> ImageReport | None:
        with self._reading() as conn:
            row = conn.execute("SELECT report FROM reports WHERE digest = %s", [digest]).fetchone()
        return ImageReport.model_validate_json(row[0]) if row else None

    def has_report(self, digest: str) -> bool:
        """Whether `digest` was scanned, as an image or as one platform of an index."""
        with self._reading() as conn:
            row = conn.execute(
                "SELECT EXISTS (SELECT 1 FROM reports WHERE digest = %(d)s)"
                " OR EXISTS (SELECT 1 FROM platform_reports WHERE digest = %(d)s)",
                {"d": digest},
            ).fetchone()
        return bool(row and row[0])

    def platform_report(self, digest: str) -> PlatformReport | None:
        with self._reading() as conn:
            row = conn.execute("SELECT report FROM platform_reports WHERE digest = %s", [digest]).fetchone()
        return PlatformReport.model_validate_json(row[0]) if row else None

    def list_images(
        self,
        *,
        gpu: bool | None = None,
        libc: str | None = None,
        cuda: str | None = None,
        registry: str | None = None,
        query: str | None = None,
        limit: int = 50,
        offset: int = 0,
        inferred: bool | None = None,
    ) -> tuple[list[ImageRow], int]:
        """Filtered, newest-first listing plus the total count for pagination."""
        where: list[str] = []
        params: dict[str, Any] = {}
        if inferred is not None:  # CUDA found in the layers (deep scan) of any platform
            where.append(
                ("" if inferred else "NOT ")
                + "EXISTS (SELECT 1 FROM jsonb_array_elements(r.report::jsonb -> 'platforms') p"
                " WHERE jsonb_typeof(p -> 'gpu' -> 'inferred') = 'object')"
            )
        if gpu is not None:
            where.append("r.gpu_required = %(gpu)s")
            params["gpu"] = gpu
        if libc:
            where.append("r.libc_flavours @> ARRAY[%(libc)s]::text[]")
            params["libc"] = libc
        if cuda:
            if "." in cuda:
                where.append("r.cuda_versions @> ARRAY[%(cuda)s]::text[]")
            else:
                where.append(
                    "EXISTS (SELECT 1 FROM unnest(r.cuda_versions) AS v WHERE v = %(cuda)s"
                    " OR v LIKE %(cuda_major)s)"
                )
                params["cuda_major"] = f"{cuda}.%"
            params["cuda"] = cuda
        if registry:
            where.append("r.registry = %(registry)s")
            params["registry"] = registry
        if query:
            # ILIKE (SQLite's LIKE is case-insensitive for ASCII) over the one expression that the
            # trigram index `reports_search` covers; chr(31) keeps a match from spanning two fields.
            where.append(f"{_SEARCH_TEXT} ILIKE %(q)s")
            escaped = query.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            params["q"] = f"%{escaped}%"
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        with self._reading() as conn:
            total = self._count(conn, clause, params, at_least=offset + limit)
            # The page is cut first, and only its rows look up their tags: PostgreSQL computes the
            # select list for the rows OFFSET skips too, so a deep page would pay for every skipped row.
            rows = conn.execute(
                "SELECT r.digest, r.registry, r.repository, r.reference, r.gpu_required, r.cuda_versions,"
                " r.libc_flavours, r.platforms, r.distro, r.scanned_at,"
                " (SELECT array_agg(t.tag ORDER BY t.tag) FROM tags t WHERE t.digest = r.digest"
                "   AND t.gone_at IS NULL AND t.registry = r.registry AND t.repository = r.repository"
                "   AND t.id = (SELECT max(id) FROM tags t2 WHERE t2.registry = t.registry"
                "   AND t2.repository = t.repository AND t2.tag = t.tag))"
                f" FROM (SELECT * FROM reports r {clause} ORDER BY r.scanned_at DESC, r.digest"
                " LIMIT %(limit)s OFFSET %(offset)s) AS r ORDER BY r.scanned_at DESC, r.digest",
                {**params, "limit": limit, "offset": offset},
            ).fetchall()
        images = [
            ImageRow(
                digest=row[0],
                registry=row[1],
                repository=row[2],
                reference=row[3],
                gpu_required=bool(row[4]),
                cuda_versions=list(row[5]),
                libc_flavours=list(row[6]),
                platforms=list(row[7]),
                distro=row[8],
                scanned_at=_iso(row[9]) or "",
                tags=sorted(row[10] or []),
            )
            for row in rows
        ]
        return images, total

    @staticmethod
    def _count(conn: psycopg.Connection[TupleRow], clause: str, params: dict[str, Any], at_least: int) -> int:
        """The exact number of matches up to EXACT_COUNT_LIMIT; beyond it, the planner's estimate.

        An exact count(*) reads every matching row, so its cost grows with the table (about 100 ms
        at 1M reports) while a page costs the same at any size. Past the limit nobody pages by
        the last digit: the estimate (never below the limit, or below what this page proves) keeps
        the listing's latency flat.
        """
        cap = max(EXACT_COUNT_LIMIT, at_least + 1)
        row = conn.execute(
            f"SELECT count(*) FROM (SELECT 1 FROM reports r {clause} LIMIT {cap}) AS m", params
        ).fetchone()
        exact = int(row[0]) if row else 0
        if exact < cap:
            return exact
        plan = conn.execute(f"EXPLAIN (FORMAT JSON) SELECT 1 FROM reports r {clause}", params).fetchone()
        estimate = int(plan[0][0]["Plan"]["Plan Rows"]) if plan else 0
        return max(estimate, cap)

    def registries(self) -> list[str]:
        """Distinct registries by skipping through the (registry, repository) index: one probe per
        registry, not a pass over every report."""
        with self._reading() as conn:
            rows = conn.execute(
                "WITH RECURSIVE found(registry) AS ("
                " (SELECT registry FROM reports ORDER BY registry LIMIT 1)"
                " UNION ALL"
                " SELECT (SELECT r.registry FROM reports r WHERE r.registry > found.registry"
                "   ORDER BY r.registry LIMIT 1) FROM found WHERE found.registry IS NOT NULL)"
                " SELECT registry FROM found WHERE registry IS NOT NULL"
            ).fetchall()
        return [row[0] for row in rows]

    # ------------------------------------------------------------------- tags

    def record_tag(self, registry: str, repository: str, tag: str, digest: str) -> None:
        """Remember that `tag` points at `digest` now; a change starts a new history row."""
        with self._transaction() as conn:
            # Serialise writers of one tag (two replicas seeing the same push) without a table lock.
            conn.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                [f"tag {registry} {repository} {tag}"],
            )
            current = conn.execute(
                "SELECT id, digest, gone_at FROM tags WHERE registry = %s AND repository = %s AND tag = %s"
                " ORDER BY id DESC LIMIT 1",
                [registry, repository, tag],
            ).fetchone()
            if current and current[1] == digest and current[2] is None:
                conn.execute("UPDATE tags SET last_seen = now() WHERE id = %s", [current[0]])
            else:
                conn.execute(
                    "INSERT INTO tags (registry, repository, tag, digest, first_seen, last_seen)"
                    " VALUES (%s, %s, %s, %s, now(), now())",
                    [registry, repository, tag, digest],
                )
            conn.execute(
                "DELETE FROM gone_digests WHERE registry = %s AND repository = %s AND digest = %s",
                [registry, repository, digest],
            )

    def resolve_tag(self, registry: str, repository: str, tag: str) -> str | None:
        """The digest a tag pointed at when last seen, or None if unknown or deleted."""
        with self._reading() as conn:
            row = conn.execute(
                "SELECT digest, gone_at FROM tags WHERE registry = %s AND repository = %s AND tag = %s"
                " ORDER BY id DESC LIMIT 1",
                [registry, repository, tag],
            ).fetchone()
        return row[0] if row and row[1] is None else None

    def tag_history(self, registry: str, repository: str) -> list[TagEvent]:
        with self._reading() as conn:
            rows = conn.execute(
                "SELECT tag, digest, first_seen, last_seen, gone_at FROM tags"
                " WHERE registry = %s AND repository = %s ORDER BY id DESC",
                [registry, repository],
            ).fetchall()
        return [
            TagEvent(row[0], row[1], _iso(row[2]) or "", _iso(row[3]) or "", _iso(row[4])) for row in rows
        ]

    def tags_for_digest(self, digest: str) -> list[tuple[str, str, str]]:
        """(registry, repository, tag) triples currently pointing at `digest`."""
        with self._reading() as conn:
            rows = conn.execute(
                "SELECT t.registry, t.repository, t.tag FROM tags t WHERE t.digest = %s AND t.gone_at IS NULL"
                " AND t.id = (SELECT max(id) FROM tags t2 WHERE t2.registry = t.registry"
                " AND t2.repository = t.repository AND t2.tag = t.tag) ORDER BY t.tag",
                [digest],
            ).fetchall()
        return [(row[0], row[1], row[2]) for row in rows]

    def mark_gone(self, registry: str, repository: str, *, tag: str | None, digest: str | None) -> None:
        """A registry deleted a tag or a manifest: keep the history, flag it gone."""
        with self._transaction() as conn:
            if tag:
                conn.execute(
                    "UPDATE tags SET gone_at = now() WHERE id = (SELECT max(id) FROM tags WHERE registry = %s"
                    " AND repository = %s AND tag = %s) AND gone_at IS NULL",
                    [registry, repository, tag],
                )
            if digest:
                conn.execute(
                    "UPDATE tags SET gone_at = now() WHERE registry = %s AND repository = %s AND digest = %s"
                    " AND gone_at IS NULL",
                    [registry, repository, digest],
                )
                conn.execute(
                    "INSERT INTO gone_digests (registry, repository, digest, gone_at) VALUES (%s, %s, %s, now())"
                    " ON CONFLICT (registry, repository, digest) DO UPDATE SET gone_at = excluded.gone_at",
                    [registry, repository, digest],
                )

    def is_gone(self, registry: str, repository: str, digest: str) -> bool:
        with self._reading() as conn:
            row = conn.execute(
                "SELECT 1 FROM gone_digests WHERE registry = %s AND repository = %s AND digest = %s",
                [registry, repository, digest],
            ).fetchone()
        return row is not None

    # ----------------------------------------------------------- layer cache

    def layer_evidence(self, digest: str) -> str | None:
        """The cached libc evidence JSON for a layer digest."""
        with self._reading() as conn:
            row = conn.execute("SELECT evidence FROM layers WHERE digest = %s", [digest]).fetchone()
        return row[0] if row else None

    def save_layer_evidence(self, digest: str, evidence_json: str) -> None:
        with self._transaction() as conn:
            conn.execute(
                "INSERT INTO layers (digest, evidence, stored_at) VALUES (%s, %s, now())"
                " ON CONFLICT (digest) DO UPDATE SET evidence = excluded.evidence, stored_at = now()",
                [digest, evidence_json],
            )

    # ------------------------------------------------------------------ jobs

    def enqueue(
        self,
        references: Sequence[tuple[str, str] | tuple[str, str, float]],
        *,
        source: str | None = None,
        max_attempts: int = 5,
        delay: float = 0.0,
    ) -> list[str]:
        """Queue (reference, registry[, delay]) jobs in one transaction; returns a job id per item.

        A reference that already has a queued or running job, from any replica, is
        coalesced into it (the partial unique index decides, not a prior read).
        """
        return self.enqueue_many([EnqueueBatch(references, source, max_attempts, delay)])[0]

    def enqueue_many(self, batches: Sequence[EnqueueBatch]) -> list[list[str]]:
        """Several deliveries' jobs in one transaction (group commit); job ids per batch."""
        if not any(batch.references for batch in batches):
            return [[] for _ in batches]
        items: list[tuple[int, int, str, str, float, EnqueueBatch]] = []
        for batch_index, batch in enumerate(batches):
            for item_index, item in enumerate(batch.references):
                wait = item[2] if len(item) == 3 else batch.delay
                items.append((batch_index, item_index, item[0], item[1], float(wait), batch))
        # One lock order for every transaction (by key), so concurrent group commits that share
        # references wait for each other instead of deadlocking.
        items.sort(key=lambda entry: entry[2])
        results: list[list[str]] = [[""] * len(batch.references) for batch in batches]
        with self._transaction() as conn:
            for batch_index, item_index, reference, registry, wait, batch in items:
                results[batch_index][item_index] = self._enqueue_one(
                    conn, reference, registry, wait, batch.source, batch.max_attempts
                )
            conn.execute(sql.SQL("NOTIFY {}").format(sql.Identifier(JOBS_QUEUED)))
        return results

    @staticmethod
    def _enqueue_one(
        conn: psycopg.Connection[TupleRow],
        reference: str,
        registry: str,
        wait: float,
        source: str | None,
        max_attempts: int,
    ) -> str:
        for _ in range(5):  # bounded: only a job settling between our two statements loops again
            inserted = conn.execute(
                "INSERT INTO jobs (id, reference, registry, dedupe_key, state, attempts, max_attempts,"
                " not_before, source, created_at, updated_at)"
                " VALUES (%s, %s, %s, %s, 'queued', 0, %s, now() + make_interval(secs => %s), %s,"
                " clock_timestamp(), clock_timestamp())"
                " ON CONFLICT (dedupe_key) WHERE state IN ('queued', 'running') DO NOTHING RETURNING id",
                [uuid.uuid4().hex, reference, registry, reference, max_attempts, wait, source],
            ).fetchone()
            if inserted:
                return str(inserted[0])
            existing = conn.execute(
                "SELECT id FROM jobs WHERE dedupe_key = %s AND state IN ('queued', 'running')", [reference]
            ).fetchone()
            if existing:
                return str(existing[0])
        raise StoreUnavailable(f"could not queue {reference}: its active job kept changing")

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
        exact across processes; rows are still locked with SKIP LOCKED against other writers.
        """
        if limit <= 0:
            return []
        with self._transaction() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s, 0)", [_CLAIM_LOCK_CLASS])
            # Jobs of a registry cooling down (queued since its gate closed) wait for the gate: then
            # neither the idle loop, nor /healthz's stall check, nor /metrics counts them as ready.
            conn.execute(
                "UPDATE jobs j SET not_before = g.cool_until FROM registry_gates g"
                " WHERE g.registry = j.registry AND g.cool_until > now()"
                " AND j.state = 'queued' AND j.not_before < g.cool_until"
            )
            turns = [
                RegistryTurn(registry, int(ready), int(running), _iso(last))
                for registry, ready, running, last in conn.execute(
                    "SELECT q.registry, q.ready,"
                    " (SELECT count(*) FROM jobs r WHERE r.state = 'running' AND r.registry = q.registry),"
                    " g.last_claimed"
                    " FROM (SELECT registry, count(*) AS ready FROM jobs"
                    "   WHERE state = 'queued' AND not_before <= now() GROUP BY registry) q"
                    " LEFT JOIN registry_gates g ON g.registry = q.registry"
                    " WHERE g.cool_until IS NULL OR g.cool_until <= now()"
                ).fetchall()
            ]
            plan = plan_claims(turns, limit, per_registry)
            claimed: list[Job] = []
            for registry in dict.fromkeys(plan):
                rows = conn.execute(
                    "UPDATE jobs SET state = 'running', attempts = attempts + 1, lease_owner = %s,"
                    " lease_expires = now() + make_interval(secs => %s), updated_at = clock_timestamp()"
                    " WHERE id IN (SELECT id FROM jobs WHERE state = 'queued' AND registry = %s"
                    "   AND not_before <= now() ORDER BY not_before, created_at LIMIT %s FOR UPDATE SKIP LOCKED)"
                    f" RETURNING {_JOB_COLUMNS}",
                    [owner, lease_seconds, registry, plan.count(registry)],
                ).fetchall()
                claimed.extend(_job(row) for row in rows)
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
                "   error = 'the worker ' || coalesce(lease_owner, '(unknown)') || ' stopped renewing its lease"
                " (crashed, cut off, or unable to write) on attempt ' || attempts || ' of ' || max_attempts,"
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
        with self._transaction() as conn:
            cursor = conn.execute(
                "UPDATE jobs SET state = 'queued', not_before = now(), lease_owner = NULL,"
                " lease_expires = NULL, attempts = greatest(0, attempts - %s), updated_at = clock_timestamp()"
                " WHERE state = 'running' AND lease_owner = ANY(%s)",
                [int(refund_attempt), list(owners)],
            )
            if cursor.rowcount:
                conn.execute(sql.SQL("NOTIFY {}").format(sql.Identifier(JOBS_QUEUED)))
            return cursor.rowcount

    def lease_owners(self) -> list[str]:
        """The workers holding running jobs now."""
        with self._reading() as conn:
            rows = conn.execute(
                "SELECT DISTINCT lease_owner FROM jobs WHERE state = 'running' AND lease_owner IS NOT NULL"
            ).fetchall()
        return [row[0] for row in rows]

    def finish_job(self, job_id: str, *, digest: str | None, owner: str) -> bool:
        """Mark a job done; False (and nothing written) when `owner` no longer holds its lease."""
        with self._transaction() as conn:
            row = conn.execute(
                "UPDATE jobs SET state = 'done', error = NULL, result_digest = %s, lease_owner = NULL,"
                " lease_expires = NULL, updated_at = clock_timestamp()"
                " WHERE id = %s AND state = 'running' AND lease_owner = %s RETURNING dedupe_key",
                [digest, job_id, owner],
            ).fetchone()
            if row is not None:
                self._notify_settled(conn, job_id, row[0])
            return row is not None

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
            job = conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = %s", [job_id]).fetchone()
        return _job(job) if job else None

    def job(self, job_id: str) -> Job | None:
        with self._reading() as conn:
            row = conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = %s", [job_id]).fetchone()
        return _job(row) if row else None

    def jobs(self, *, states: Sequence[str] = (), limit: int = 50) -> list[Job]:
        clause = "WHERE state = ANY(%(states)s)" if states else ""
        with self._reading() as conn:
            rows = conn.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs {clause} ORDER BY created_at DESC LIMIT %(limit)s",
                {"states": list(states), "limit": limit},
            ).fetchall()
        return [_job(row) for row in rows]

    def pending_job_for(self, reference: str) -> Job | None:
        """An active job for `reference`, or for `reference@<digest>` (as webhooks queue them)."""
        with self._reading() as conn:
            row = conn.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs WHERE state IN ('queued', 'running')"
                " AND (dedupe_key = %(ref)s OR left(dedupe_key, length(%(ref)s) + 1) = %(ref)s || '@')"
                " ORDER BY created_at DESC LIMIT 1",
                {"ref": reference},
            ).fetchone()
        return _job(row) if row else None

    def latest_job_for(self, reference: str) -> Job | None:
        with self._reading() as conn:
            row = conn.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs WHERE dedupe_key = %s ORDER BY created_at DESC LIMIT 1",
                [reference],
            ).fetchone()
        return _job(row) if row else None

    def queue_depth(self) -> dict[str, int]:
        with self._reading() as conn:
            rows = conn.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall()
        depth: dict[str, int] = dict.fromkeys(JOB_STATES, 0)
        depth.update({row[0]: int(row[1]) for row in rows})
        return depth

    def next_job_due(self) -> datetime | None:
        with self._reading() as conn:
            row = conn.execute("SELECT min(not_before) FROM jobs WHERE state = 'queued'").fetchone()
        return row[0] if row and row[0] else None

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

    def upsert_server(self, name: str, inventory_json: str) -> None:
        with self._transaction() as conn:
            conn.execute(
                "INSERT INTO servers (name, inventory, registered_at, last_heartbeat)"
                " VALUES (%s, %s, now(), now())"
                " ON CONFLICT (name) DO UPDATE SET inventory = excluded.inventory,"
                " last_heartbeat = excluded.last_heartbeat",
                [name, inventory_json],
            )
            conn.execute("SELECT pg_notify(%s, 'inventory')", [FLEET_CHANNEL])

    def heartbeat(self, name: str, inventory_json: str | None = None) -> bool:
        """Refresh a server's heartbeat (and inventory); False when the server is unknown."""
        with self._transaction() as conn:
            cursor = conn.execute(
                "UPDATE servers SET last_heartbeat = now(), inventory = coalesce(%s, inventory)"
                " WHERE name = %s",
                [inventory_json, name],
            )
            return cursor.rowcount > 0

    def servers(self) -> list[ServerRecord]:
        """(inventory JSON, registered_at, last_heartbeat) for every registered server."""
        with self._reading() as conn:
            rows = conn.execute(
                "SELECT inventory, registered_at, last_heartbeat FROM servers ORDER BY name"
            ).fetchall()
        return [ServerRecord(row[0], _iso(row[1]) or "", _iso(row[2]) or "") for row in rows]

    def server_inventory(self, name: str) -> str | None:
        with self._reading() as conn:
            row = conn.execute("SELECT inventory FROM servers WHERE name = %s", [name]).fetchone()
        return row[0] if row else None

    def reserved_gpus(self) -> dict[str, str]:
        """GPU UUID -> deployment id, for every GPU currently reserved."""
        with self._reading() as conn:
            rows = conn.execute("SELECT gpu_uuid, deployment_id FROM reservations").fetchall()
        return {row[0]: row[1] for row in rows}

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

    def deployment(self, deployment_id: str) -> DeploymentRecord | None:
        """(record JSON, state, desired)."""
        with self._reading() as conn:
            row = conn.execute(
                "SELECT record, state, desired FROM deployments WHERE id = %s", [deployment_id]
            ).fetchone()
        return DeploymentRecord(*row) if row else None

    def deployments(self, *, server: str | None = None, limit: int = 100) -> list[DeploymentRecord]:
        clause = "WHERE server = %(server)s" if server else ""
        with self._reading() as conn:
            rows = conn.execute(
                f"SELECT record, state, desired FROM deployments {clause} ORDER BY created_at DESC"
                " LIMIT %(limit)s",
                {"server": server, "limit": limit},
            ).fetchall()
        return [DeploymentRecord(*row) for row in rows]

    def update_deployment(
        self,
        deployment_id: str,
        record_json: str,
        *,
        state: str,
        desired: str | None = None,
        release: bool = False,
    ) -> None:
        """Store a new state (and record); `release` frees the deployment's GPUs in the same step."""
        with self._transaction() as conn:
            conn.execute(
                "UPDATE deployments SET record = %s, state = %s, desired = coalesce(%s, desired),"
                " updated_at = clock_timestamp() WHERE id = %s",
                [record_json, state, desired, deployment_id],
            )
            if release:
                conn.execute("DELETE FROM reservations WHERE deployment_id = %s", [deployment_id])
            conn.execute("SELECT pg_notify(%s, 'reservations')", [FLEET_CHANNEL])

    def actionable_deployments(self, server: str) -> list[DeploymentRecord]:
        """Deployments the server's agent must act on: new ones to run, live ones to stop."""
        with self._reading() as conn:
            rows = conn.execute(
                "SELECT record, state, desired FROM deployments WHERE server = %s AND ("
                " (desired = 'run' AND state = 'pending') OR"
                " (desired = 'stop' AND state NOT IN ('exited', 'failed', 'stopped')))"
                " ORDER BY created_at",
                [server],
            ).fetchall()
        return [DeploymentRecord(*row) for row in rows]

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


def _describe(exc: BaseException) -> str:
    """An error in words, without the connection string (it may hold a password)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:300]


class _Listener:
    """A thread holding one connection in LISTEN; hands each NOTIFY to `callback`."""

    RECONNECT_DELAY = 1.0

    def __init__(self, url: str, callback: Callable[[Notification], None], connect_timeout: float) -> None:
        self._url = url
        self._callback = callback
        self._connect_timeout = connect_timeout
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpubadge-listen", daemon=True)

    def start(self) -> None:
        self._thread.start()
        # bounded: a listener that cannot connect yet keeps retrying in the background
        self._ready.wait(self._connect_timeout)

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        first = True
        while not self._stopping.is_set():
            try:
                with psycopg.connect(
                    self._url, autocommit=True, connect_timeout=max(1, int(self._connect_timeout))
                ) as conn:
                    for channel in CHANNELS:
                        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    self._ready.set()
                    if not first:
                        self._callback(("", ""))  # notifications may have been missed: re-check
                    first = False
                    while not self._stopping.is_set():
                        for notice in conn.notifies(timeout=0.5, stop_after=64):
                            self._callback((notice.channel, notice.payload))
            except psycopg.Error as exc:
                if self._stopping.is_set():
                    return
                log.warning("PostgreSQL listener lost its connection (%s); reconnecting", _describe(exc))
                self._stopping.wait(self.RECONNECT_DELAY)
            except Exception:  # the callback's bug must not silence every later notification
                log.exception("PostgreSQL listener callback failed")
