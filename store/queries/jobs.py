"""Reads of the job queue: written once, run on both engines.

Claims, leases, enqueueing and the other outcomes (what locks, and how) differ per engine and
stay in `store.sqlite` and `store.postgres`; what they share is here: a job's end (`finish_job`:
one conditional update, also written in the batch of its scan's results as a `JobEnd`), the job column list and its row
reader (`JOB_COLUMNS`, `job_of`), the job read their `retry_job` answers with, the lease owners,
whether a job runs under a live lease (`scan_in_flight`), the registries a claim chooses among
(`registry_turns`), the error a job whose lease lapsed is
left with (`LEASE_LAPSED_ERROR`, one SQL expression), the counts by state that read no finished job
(`queue_depth`), and retention's reads and deletes.

A rescan (`EnqueueBatch.rescan`) is queued under the dedupe key `RESCAN_KEY + reference`: rescans of
one reference coalesce with each other, never with a plain scan of it, and the job says it is one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from store.dialect import Db, reads, writes
from store.events import JOB_SETTLED_CHANNEL
from store.fairness import RegistryTurn
from store.models import JOB_STATES, Job

JOB_COLUMNS = (
    "id, reference, registry, state, attempts, max_attempts, error, result_digest, source, created_at,"
    " updated_at, lease_owner, lease_expires, dedupe_key"
)
RESCAN_KEY = "rescan "  # the dedupe key's prefix of a rescan (no reference has a space)


def dedupe_key(reference: str, *, rescan: bool) -> str:
    """The key a queued or running job of `reference` is unique by."""
    return f"{RESCAN_KEY}{reference}" if rescan else reference


# What a running job whose lease lapsed records as its error: one SQL expression over the job's row
# (as it was before the update clears the lease), the same on both engines.
LEASE_LAPSED_ERROR = (
    "'the worker ' || coalesce(lease_owner, '(unknown)') || ' stopped renewing its lease"
    " (crashed, cut off, or unable to write) on attempt ' || attempts || ' of ' || max_attempts"
)


@dataclass(frozen=True)
class JobEnd:
    """A scan job done, written in the batch of its scan's results (`reports.save_scan_results`), so
    that the job's end and its final report commit together."""

    job_id: str
    digest: str | None
    owner: str


@writes
def finish_job(db: Db, job_id: str, *, digest: str | None, owner: str) -> bool:
    """Mark a running job done; False (and nothing written) when `owner` no longer holds its lease.
    At commit every process hears the settle, keyed by the job and its reference."""
    row = db.one(
        "UPDATE jobs SET state = 'done', error = NULL, result_digest = :digest, lease_owner = NULL,"
        " lease_expires = NULL, updated_at = :now WHERE id = :id AND state = 'running' AND lease_owner = :owner"
        " RETURNING dedupe_key",
        {"digest": digest, "id": job_id, "owner": owner},
    )
    if row is None:
        return False
    db.notify(JOB_SETTLED_CHANNEL, f"{job_id} {row[0]}")
    return True


def job_of(db: Db, row: Sequence[Any]) -> Job:
    """A `jobs` row (`JOB_COLUMNS`) as a Job, its times in the one text form."""
    stamp = db.dialect.stamp
    return Job(
        row[0],
        row[1],
        row[2],
        row[3],
        row[4],
        row[5],
        row[6],
        row[7],
        row[8],
        stamp(row[9]) or "",
        stamp(row[10]) or "",
        row[11],
        stamp(row[12]),
        str(row[13]).startswith(RESCAN_KEY),
    )


@reads
def job(db: Db, job_id: str) -> Job | None:
    """One job by id, or None (an id a delivery was given names the job it was coalesced into)."""
    # an id a journaled delivery was given names the job it was coalesced into when it moved
    # (`store.queries.journal_moves`: `job_aliases`)
    row = db.one(
        f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = coalesce((SELECT job_id FROM job_aliases WHERE id = :id), :id)",
        {"id": job_id},
    )
    return job_of(db, row) if row else None


@reads
def scan_in_flight(db: Db, job_id: str) -> bool:
    """Whether job `job_id` runs now under a lease that has not lapsed (its worker renews it)."""
    row = db.one(
        "SELECT 1 FROM jobs WHERE id = :id AND state = 'running' AND lease_expires > :now", {"id": job_id}
    )
    return row is not None


@reads
def lease_owners(db: Db) -> list[str]:
    """The workers holding running jobs now."""
    rows = db.all("SELECT DISTINCT lease_owner FROM jobs WHERE state = 'running' AND lease_owner IS NOT NULL")
    return [row[0] for row in rows]


@reads
def waiting_references(db: Db, references: Sequence[str]) -> set[str]:
    """Those of `references` with a scan or a rescan of exactly that reference waiting or running: one
    statement for a page of them, through the active jobs' unique index on `dedupe_key`."""
    keys = [*references, *(dedupe_key(reference, rescan=True) for reference in references)]
    rows = db.all(
        "SELECT dedupe_key FROM jobs WHERE state IN ('queued', 'running') AND "
        + db.dialect.in_list("dedupe_key", "keys"),
        {"keys": db.dialect.array(keys)},
    )
    return {row[0].removeprefix(RESCAN_KEY) for row in rows}


@reads
def jobs(db: Db, *, states: Sequence[str] = (), limit: int = 50) -> list[Job]:
    """The newest `limit` jobs, of `states` when given. Each state's newest are read in order along
    `jobs_state_created` and stop at `limit`, then merged: the cost is the page, not the jobs in those
    states (a queue at its cap holds 100,000). The states are written into the statement (they are
    `JOB_STATES`, checked here), so PostgreSQL's generic plan knows how rare each one is: with a parameter
    it walked every job newest first to find a few running ones."""
    if not states:
        rows = db.all(
            f"SELECT {JOB_COLUMNS} FROM jobs ORDER BY created_at DESC LIMIT :limit", {"limit": limit}
        )
        return [job_of(db, row) for row in rows]
    wanted = list(dict.fromkeys(states))
    if not set(wanted) <= set(JOB_STATES):
        raise ValueError(f"not job states: {sorted(set(wanted) - set(JOB_STATES))}")
    arms = " UNION ALL ".join(
        f"SELECT * FROM (SELECT {JOB_COLUMNS} FROM jobs WHERE state = '{state}'"
        f" ORDER BY created_at DESC LIMIT :limit) AS newest_{state}"
        for state in wanted
    )
    rows = db.all(
        f"SELECT {JOB_COLUMNS} FROM ({arms}) AS picked ORDER BY created_at DESC LIMIT :limit",
        {"limit": limit},
    )
    return [job_of(db, row) for row in rows]


@reads
def pending_job_for(db: Db, reference: str) -> Job | None:
    """An active job for `reference` (a scan or a rescan), or for `reference@<digest>` (as webhooks
    queue them).

    Each arm is an index lookup, so its cost does not grow with the queue: the `reference@` prefix is
    the byte range [`reference@`, `referenceA`) ('A' follows '@'), compared bytewise
    (`Dialect.bytewise`). SQLite reads the three arms through `jobs_reference` (every job of a key,
    as many as retention keeps); left to choose, it read every active job through the state index.
    PostgreSQL reads them through `jobs_reference` and `jobs_active_key_bytewise`. The matches are
    found apart from the newest-first order (a materialised CTE): a prepared statement's generic plan
    otherwise walked every job newest first (`jobs_created`) until one matched, 1.8 ms at 10,000 queued.
    """
    key = db.dialect.bytewise("dedupe_key")
    row = db.one(
        f"WITH active AS MATERIALIZED (SELECT {JOB_COLUMNS}"
        f" FROM {db.dialect.read_through('jobs', 'jobs_reference')} WHERE state IN ('queued', 'running')"
        " AND (dedupe_key = :ref OR dedupe_key = :rescan"
        f" OR ({key} >= :digests_from AND {key} < :digests_to)))"
        f" SELECT {JOB_COLUMNS} FROM active ORDER BY created_at DESC LIMIT 1",
        {
            "ref": reference,
            "rescan": dedupe_key(reference, rescan=True),
            "digests_from": f"{reference}@",
            "digests_to": f"{reference}A",
        },
    )
    return job_of(db, row) if row else None


@reads
def latest_job_for(db: Db, reference: str) -> Job | None:
    row = db.one(
        f"SELECT {JOB_COLUMNS} FROM jobs WHERE dedupe_key = :ref ORDER BY created_at DESC LIMIT 1",
        {"ref": reference},
    )
    return job_of(db, row) if row else None


# Jobs by state without reading the finished ones: queued and running jobs are counted from their
# indexes (as many as are active: at most the queue's cap and the workers' slots), done and failed
# ones are the sums of `job_tallies`, kept by triggers as jobs change state (migration 0010).
QUEUE_DEPTH = (
    "SELECT 'queued', count(*) FROM jobs WHERE state = 'queued'"
    " UNION ALL SELECT 'running', count(*) FROM jobs WHERE state = 'running'"
    " UNION ALL SELECT state, sum(delta) FROM job_tallies GROUP BY state"
)


@reads
def queue_depth(db: Db) -> dict[str, int]:
    """How many jobs are in each state; its cost grows with the active jobs, not with history."""
    depth: dict[str, int] = dict.fromkeys(JOB_STATES, 0)
    depth.update({row[0]: int(row[1]) for row in db.all(QUEUE_DEPTH)})
    return depth


@reads
def finished_jobs(db: Db) -> int:
    """How many jobs are done or failed (from `job_tallies`: no job is read)."""
    row = db.one("SELECT coalesce(sum(delta), 0) FROM job_tallies")
    return int(row[0]) if row else 0


@reads
def finished_beyond(db: Db, *, keep: int) -> datetime | None:
    """When the newest finished job past the `keep` newest finished (so the first one retention by
    count deletes), or None when no more than `keep` are finished. Reads `keep` index entries."""
    row = db.one(
        f"SELECT updated_at FROM {db.dialect.read_through('jobs', 'jobs_finished')}"
        " WHERE state IN ('done', 'failed') ORDER BY updated_at DESC LIMIT 1 OFFSET :keep",
        {"keep": keep},
    )
    stamp = db.dialect.stamp(row[0]) if row else None
    return datetime.fromisoformat(stamp) if stamp else None


RETENTION_LOCK = "job-retention"


@writes
def delete_finished(db: Db, *, through: datetime, limit: int) -> int:
    """Delete up to `limit` finished jobs last updated at or before `through`, oldest first; returns
    how many. One sweeper at a time deletes (an advisory lock on PostgreSQL; SQLite's one writer)."""
    db.dialect.lock(db, RETENTION_LOCK)
    cursor = db.execute(
        "DELETE FROM jobs WHERE id IN"
        f" (SELECT id FROM {db.dialect.read_through('jobs', 'jobs_finished')}"
        " WHERE state IN ('done', 'failed') AND updated_at <= :through ORDER BY updated_at LIMIT :limit)",
        {"through": db.dialect.stamp_param(through), "limit": limit},
    )
    return int(cursor.rowcount)


@reads
def job_ready(db: Db) -> bool:
    """Whether a queued job is due now, by the store's clock (an index probe): a claim pass asks
    first, so the worker processes that come after the claim that took a job write nothing."""
    return db.one("SELECT 1 FROM jobs WHERE state = 'queued' AND not_before <= :now LIMIT 1") is not None


@reads
def next_job_due(db: Db) -> datetime | None:
    row = db.one("SELECT min(not_before) FROM jobs WHERE state = 'queued'")
    due = db.dialect.stamp(row[0]) if row else None
    return datetime.fromisoformat(due) if due else None


def registry_turns(db: Db, limit: int) -> list[RegistryTurn]:
    """Each registry with a queued job and no cool-down, as a claim of up to `limit` jobs sees it
    (`store.fairness.plan_claims`): its ready jobs counted up to `limit` (the most a claim takes
    from one registry), its running jobs, and its last claim. Called inside the claim's write
    transaction.

    Its cost grows with the registries that have queued jobs, not with the queue: the registries
    are found by a skip scan of the queued jobs' registry index (one probe per registry), and each
    count stops at `limit`. Counting every ready job, as it once did, read the whole queue on every
    claim: 69 ms a claim at the queue's cap (100,000) on SQLite, inside the write lock."""
    queued = db.dialect.read_through("jobs", "jobs_ready_registry")
    rows = db.all(
        "WITH RECURSIVE queued(registry) AS ("
        f" SELECT (SELECT min(registry) FROM {queued} WHERE state = 'queued')"
        " UNION ALL"
        f" SELECT (SELECT min(registry) FROM {queued} WHERE state = 'queued' AND registry > q.registry)"
        " FROM queued q WHERE q.registry IS NOT NULL)"
        " SELECT q.registry,"
        " (SELECT count(*) FROM (SELECT 1 FROM jobs WHERE state = 'queued' AND registry = q.registry"
        "   AND not_before <= :now LIMIT :limit) AS due),"
        " (SELECT count(*) FROM jobs r WHERE r.state = 'running' AND r.registry = q.registry),"
        " g.last_claimed"
        " FROM queued q LEFT JOIN registry_gates g ON g.registry = q.registry"
        " WHERE q.registry IS NOT NULL AND (g.cool_until IS NULL OR g.cool_until <= :now)",
        {"limit": limit},
    )
    return [
        RegistryTurn(registry, int(ready), int(running), db.dialect.stamp(last))
        for registry, ready, running, last in rows
    ]


@reads
def queued_jobs(db: Db, *, cap: int) -> int:
    """Jobs waiting to run (state `queued`), counted up to `cap` (an index range, never the table)."""
    row = db.one(
        "SELECT count(*) FROM (SELECT 1 FROM jobs WHERE state = 'queued' LIMIT :cap) AS waiting", {"cap": cap}
    )
    return int(row[0]) if row else 0
