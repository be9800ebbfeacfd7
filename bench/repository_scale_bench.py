"""A busy repository's pages against its history: what the store reads for one image of a CI repository.

    python3 -m bench.repository_scale_bench [--quick]

A CI repository tags every commit and keeps a report per digest. Setup (unmeasured), on SQLite and
on PostgreSQL (`initdb` in a temp dir): `events` tag events and as many reports in
`reg.example/ci/app`, one multi-arch index newer than them, as many newer reports and tag events
spread over 50 other repositories, and twice `events` finished jobs; then, on PostgreSQL, `VACUUM
ANALYZE`, as autovacuum would have (without the visibility map it sets, the image list's count took
a sequential scan: 9.0 ms against 3.5). Measured, each through the store's own `run`, 50 calls after 10
warm-up calls (so PostgreSQL runs a prepared statement's generic plan):

- `index_of`: the index a platform manifest belongs to (a lookup by a child's digest, each such job
  on the scans page); and the same for a child no stored index lists (named through a repository
  whose index was deleted), which searched every report;
- `tag_history(limit=101)`: what an image page shows of its repository's tags;
- `mark_gone` of a digest: a registry's manifest delete (the digest of a different event each call);
- `jobs(limit=50)`: the scans page, beside twice `events` finished jobs;
- `list_images(registry=…)`: the image list filtered by registry (every report is of that registry).

The peer is the same store as it was before migrations 0015 to 0019 and the delete's index hint
(`reports_repo` on (registry, repository), no `tags_history` nor `reports_registry_order`, and on
SQLite no `reports_gpu_order` nor `jobs_created`; `index_of` searching the reports' text, not
`index_children`; the whole history read, the update planned freely;
the image list's own-tags hint stays, so its "before" is an understatement), in the same run on the same rows: the indexes are swapped and the statistics
gathered again. Targets: p99 under 5 ms a call at 50,000 events, 25 ms for the image list. (The delete was fine before: SQLite
took `tags_digest` until `tags_history` came; its row guards the hint that keeps it so.)
"""

from __future__ import annotations

import sqlite3
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from bench.common import Figure, Results, percentile, run_section, temporary_sqlite_store
from scanner.models import ImageReport, LibcVerdict, PlatformReport
from store import queries
from store.dialect import Db, reads, writes
from store.queries.tags import TagEvent, TagSeen, announce_reference

SECTION = "repository"
REGISTRY, REPOSITORY = "reg.example", "ci/app"
CALLS, WARM_UP = 50, 10
# p99 targets: 5 ms a call, and the image list (a count, a page, each row's tags) as the UI pages' is
TARGETS_MS = {"the image list filtered by registry": 25.0}
BATCH = 1_000
START = datetime(2026, 1, 1, tzinfo=UTC)
CHILD = "sha256:" + "c" * 64
UNLISTED = "sha256:" + "f" * 64  # a platform manifest whose index report is gone
# The indexes before migrations 0015 to 0018 (the statements that read without them are below).
BEFORE = (
    "DROP INDEX reports_repo_newest",
    "DROP INDEX tags_history",
    "DROP INDEX reports_registry_order",
    "CREATE INDEX reports_repo ON reports (registry, repository)",
)
# what SQLite lacked besides (PostgreSQL has had these since 0001)
BEFORE_SQLITE = (*BEFORE, "DROP INDEX reports_gpu_order", "DROP INDEX jobs_created")


@reads
def history_before(db: Db, registry: str, repository: str) -> list[TagEvent]:
    """The page's tag history before: every event of the repository, sorted."""
    rows = db.all(
        "SELECT tag, digest, first_seen, last_seen, gone_at FROM tags"
        " WHERE registry = :registry AND repository = :repository ORDER BY id DESC",
        {"registry": registry, "repository": repository},
    )
    return [TagEvent(row[0], row[1], str(row[2]), str(row[3]), row[4]) for row in rows]


@reads
def index_of_before(db: Db, registry: str, repository: str, digest: str) -> str | None:
    """`index_of` before migration 0019 (the digest of the index found): the repository's reports'
    text searched for the child newest first, then, where none lists it, every report's."""
    sql = (
        "SELECT digest FROM reports WHERE {where} AND digest <> :digest AND report LIKE :pattern"
        " ORDER BY scanned_at DESC LIMIT 1"
    )
    params = {"registry": registry, "repository": repository, "digest": digest}
    params["pattern"] = f'%"digest":"{digest}"%'
    row = db.one(sql.format(where="registry = :registry AND repository = :repository"), params)
    if row is None:
        row = db.one(sql.format(where="1 = 1"), params)
    return str(row[0]) if row else None


@writes
def mark_gone_before(db: Db, registry: str, repository: str, digest: str) -> None:
    """`mark_gone` of a digest before: the same statements, the update planned freely."""
    key = {"registry": registry, "repository": repository, "digest": digest}
    announce_reference(db, f"{registry}/{repository}@{digest}")
    db.execute(
        "UPDATE tags SET gone_at = :now WHERE registry = :registry AND repository = :repository"
        " AND digest = :digest AND gone_at IS NULL",
        key,
    )
    db.execute(
        "INSERT INTO gone_digests (registry, repository, digest, gone_at) VALUES (:registry, :repository, :digest, :now)"
        " ON CONFLICT (registry, repository, digest) DO UPDATE SET gone_at = excluded.gone_at",
        key,
    )


def _report(number: int, platforms: list[str], at: datetime, repository: str = REPOSITORY) -> ImageReport:
    return ImageReport(
        reference=f"{REGISTRY}/{repository}@sha256:{number:064x}",
        digest=f"sha256:{number:064x}",
        registry=REGISTRY,
        repository=repository,
        scanned_at=at,
        platforms=[
            PlatformReport(platform=f"linux/{arch}", digest=digest, libc=LibcVerdict(flavour="glibc"))
            for arch, digest in zip(("amd64", "arm64"), platforms, strict=False)
        ],
    )


def _fill(store: Any, events: int) -> None:
    for first in range(0, events, BATCH):
        numbers = range(first, min(events, first + BATCH))
        store.run(
            queries.save_reports,
            [_report(n, [f"sha256:{n + 10**8:064x}"], START + timedelta(seconds=n)) for n in numbers],
        )
        store.run(
            queries.record_tags,
            [TagSeen(REGISTRY, REPOSITORY, f"commit-{n:06d}", f"sha256:{n:064x}") for n in numbers],
        )
    store.run(
        queries.save_reports, [_report(10**9, [CHILD, "sha256:" + "d" * 64], START + timedelta(days=1))]
    )
    later = START + timedelta(days=2)
    for first in range(0, events, BATCH):
        numbers = range(2 * 10**9 + first, 2 * 10**9 + min(events, first + BATCH))
        repositories = [f"team{n % 50}/svc" for n in numbers]
        store.run(
            queries.save_reports,
            [
                _report(n, [f"sha256:{n + 10**8:064x}"], later + timedelta(seconds=n - 2 * 10**9), r)
                for n, r in zip(numbers, repositories, strict=True)
            ],
        )
        store.run(
            queries.record_tags,
            [
                TagSeen(REGISTRY, r, f"v{n}", f"sha256:{n:064x}")
                for n, r in zip(numbers, repositories, strict=True)
            ],
        )


def _seed_jobs(store: Any, count: int) -> None:
    """`count` finished scan jobs, as retention keeps them (100,000 by default), written directly."""
    rows = []
    for n in range(count):
        at = START + timedelta(seconds=n)
        reference = f"{REGISTRY}/{REPOSITORY}@sha256:{n:064x}"
        rows.append((f"{n:032x}", reference, REGISTRY, reference, "done", at, at, at))
    insert = (
        "INSERT INTO jobs (id, reference, registry, dedupe_key, state, attempts, max_attempts, not_before,"
        " created_at, updated_at) VALUES ({p}, {p}, {p}, {p}, {p}, 1, 5, {p}, {p}, {p})"
    )
    url = getattr(store, "_url", None)
    if url is None:
        with sqlite3.connect(store.path) as conn:
            conn.executemany(
                insert.format(p="?"), [(*row[:5], *(m.isoformat() for m in row[5:])) for row in rows]
            )
        conn.close()
        return
    import psycopg

    with psycopg.connect(url) as conn, conn.cursor() as cursor:
        cursor.executemany(insert.format(p="%s"), rows)


def _timed(call: Callable[[int], object]) -> list[float]:
    for number in range(WARM_UP):
        call(number)
    samples = []
    for number in range(WARM_UP, WARM_UP + CALLS):
        started = time.perf_counter()
        call(number)
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def _calls(store: Any, events: int, before: bool) -> dict[str, Callable[[int], object]]:
    def index_of(_: int) -> object:
        if before:
            assert store.run(index_of_before, REGISTRY, REPOSITORY, CHILD) == f"sha256:{10**9:064x}"
            return None
        found = store.run(queries.index_of, REGISTRY, REPOSITORY, CHILD)
        assert found is not None and found.digest == f"sha256:{10**9:064x}"
        return found

    def unlisted(_: int) -> object:
        if before:
            assert store.run(index_of_before, REGISTRY, REPOSITORY, UNLISTED) is None
        else:
            assert store.run(queries.index_of, REGISTRY, REPOSITORY, UNLISTED) is None
        return None

    def history(_: int) -> object:
        if before:
            found = store.run(history_before, REGISTRY, REPOSITORY)
        else:
            found = store.run(queries.tag_history, REGISTRY, REPOSITORY, limit=101)
        assert found and found[0].tag == f"commit-{events - 1:06d}"
        return found

    def delete(number: int) -> object:
        digest = f"sha256:{number * 97 + (1 if before else 0):064x}"
        if before:
            return store.run(mark_gone_before, REGISTRY, REPOSITORY, digest)
        return store.run(queries.mark_gone, REGISTRY, REPOSITORY, tag=None, digest=digest)

    def scans_page(_: int) -> object:
        jobs = store.run(queries.jobs, limit=50)
        assert len(jobs) == 50
        return jobs

    def listing(_: int) -> object:
        rows, total = store.run(queries.list_images, registry=REGISTRY, limit=50)
        assert len(rows) == 50 and total > 50
        return rows

    return {
        "index_of": index_of,
        "index_of, a child no stored index lists": unlisted,
        "tag history (an image page)": history,
        "a manifest delete": delete,
        "the scans page (newest 50 jobs)": scans_page,
        "the image list filtered by registry": listing,
    }


def _measure(
    results: Results,
    engine: str,
    store: Any,
    events: int,
    analyze: Callable[[], None],
    swap: Callable[[], None],
) -> None:
    _fill(store, events)
    _seed_jobs(store, 2 * events)
    analyze()
    now = {name: _timed(call) for name, call in _calls(store, events, before=False).items()}
    swap()
    before = {name: _timed(call) for name, call in _calls(store, events, before=True).items()}
    for name, samples in now.items():
        p50, p99 = statistics.median(samples), percentile(samples, 0.99)
        peer = before[name]
        results.add(
            Figure(
                SECTION,
                f"{name}, {engine}, a repository of {events:,} tag events and reports",
                f"p50 {p50:.2f} ms, p99 {p99:.2f} ms",
                f"before: p50 {statistics.median(peer):.2f} ms, p99 {percentile(peer, 0.99):.2f} ms",
                ratio=statistics.median(peer) / p50,
                target=f"p99 < {TARGETS_MS.get(name, 5.0):g} ms",
                met=p99 < TARGETS_MS.get(name, 5.0),
            )
        )


def _postgres_sql(url: str, statements: list[str]) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement.encode())


def run_all(results: Results, quick: bool) -> None:
    from fixtures.postgres import postgres_unavailable_reason, run_postgres
    from store.postgres import PostgresStore

    events = 10_000 if quick else 50_000
    print(f"repository scale: {events:,} tag events and reports in one repository", flush=True)
    with temporary_sqlite_store("gpubadge-repository-") as store:

        def swap_sqlite() -> None:
            with sqlite3.connect(store.path) as conn:
                for statement in BEFORE_SQLITE:
                    conn.execute(statement)
            conn.close()

        _measure(results, "SQLite", store, events, lambda: None, swap_sqlite)  # SQLite keeps no statistics
    reason = postgres_unavailable_reason()
    if reason is not None:
        results.add(Figure(SECTION, "PostgreSQL", f"not run: {reason}"))
        return
    with run_postgres() as server:
        store = PostgresStore(server.url, pool_size=2)
        try:
            _measure(
                results,
                "PostgreSQL",
                store,
                events,
                lambda: _postgres_sql(server.url, ["VACUUM ANALYZE"]),
                lambda: _postgres_sql(server.url, [*BEFORE, "VACUUM ANALYZE"]),
            )
        finally:
            store.close()


if __name__ == "__main__":
    run_section(run_all, __doc__)
