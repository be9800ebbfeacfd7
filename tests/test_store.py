"""The store: reports by digest, tag history, layer cache, and the durable job queue.

The conformance tests take `open_backend`, so each runs on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from scanner.models import GpuFacts, ImageReport, LibcVerdict, PlatformReport
from store import SqliteStore as Store
from store import queries
from tests.conftest import OpenBackend
from tests.store_plans import recorded_statements, rows_read


def _report(digest: str, *, gpu: bool = False, cuda: str | None = None, libc: str = "glibc") -> ImageReport:
    platform = PlatformReport(
        platform="linux/amd64",
        digest="sha256:" + digest[-1].translate(str.maketrans("ac", "bd")) * 64,
        gpu=GpuFacts(required=gpu, cuda_version=cuda),
        libc=LibcVerdict(flavour=libc),
    )
    return ImageReport(
        reference=f"127.0.0.1:5000/app:{digest[-4:]}",
        digest=digest,
        registry="127.0.0.1:5000",
        repository="app",
        platforms=[platform],
    )


def test_reports_round_trip_and_filter(open_backend: OpenBackend) -> None:
    store = open_backend()
    store.run(queries.save_report, _report("sha256:" + "a" * 64, gpu=True, cuda="12.2", libc="glibc"))
    store.run(queries.save_report, _report("sha256:" + "c" * 64, libc="musl"))
    assert store.run(queries.report, "sha256:" + "a" * 64) is not None
    assert store.run(queries.platform_report, "sha256:" + "b" * 64) is not None
    gpu_rows, total = store.run(queries.list_images, gpu=True)
    assert total == 1 and gpu_rows[0].cuda_versions == ["12.2"]
    assert store.run(queries.list_images, libc="musl")[1] == 1
    assert store.run(queries.list_images, cuda="12")[1] == 1
    assert store.run(queries.list_images, cuda="11.8")[1] == 0
    assert store.run(queries.list_images, query="100%")[1] == 0  # LIKE wildcards are escaped


def test_tag_history_and_gone(open_backend: OpenBackend) -> None:
    store = open_backend()
    first, second = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    store.run(queries.record_tag, "r", "app", "v1", first)
    store.run(queries.record_tag, "r", "app", "v1", first)
    store.run(queries.record_tag, "r", "app", "v1", second)
    assert store.run(queries.resolve_tag, "r", "app", "v1") == second
    assert [event.digest for event in store.run(queries.tag_history, "r", "app")] == [second, first]
    store.run(queries.mark_gone, "r", "app", tag="v1", digest=None)
    assert store.run(queries.resolve_tag, "r", "app", "v1") is None
    store.run(queries.mark_gone, "r", "app", tag=None, digest=first)
    assert store.run(queries.is_gone, "r", "app", first)


def test_the_newest_tag_events_are_read_without_the_rest_of_the_repository(open_backend: OpenBackend) -> None:
    """An image page's tag history is its repository's newest events, read along `tags_history`
    (migration 0016) and no further; it read and sorted every event (122 ms for 50,000 on SQLite)."""
    from store.queries.tags import TagSeen

    store = open_backend()
    events = [TagSeen("r", "ci/app", f"commit-{n:05d}", f"sha256:{n:064x}") for n in range(2000)]
    for first in range(0, len(events), 500):
        store.run(queries.record_tags, events[first : first + 500])
    # newer events of other repositories, which a walk of every event newest first would read
    store.run(
        queries.record_tags,
        [TagSeen("r", f"team{n % 50}/svc", f"v{n}", f"sha256:{n + 10**6:064x}") for n in range(500)],
    )
    with recorded_statements(lambda sql: "FROM tags" in sql and "ORDER BY -id" in sql) as statements:
        newest = store.run(queries.tag_history, "r", "ci/app", limit=3)
    assert [event.tag for event in newest] == ["commit-01999", "commit-01998", "commit-01997"]
    assert len(store.run(queries.tag_history, "r", "ci/app")) == 2000  # no limit: every event
    ((sql, params),) = statements
    read = rows_read(store, sql, params, table="tags", generic=True)
    if isinstance(read, str):  # SQLite: down the repository's events in order, no sort of them
        assert "tags_history" in read and "TEMP B-TREE" not in read, read
    else:  # PostgreSQL: the three events asked for, not the repository's 2,000 nor the newer 500,
        # whether planned for any values or for these (by id alone, it took the primary key backwards)
        assert read <= 5, read
        assert rows_read(store, sql, params, table="tags") <= 5


def test_a_deleted_manifest_marks_its_tags_gone_through_its_own_rows(open_backend: OpenBackend) -> None:
    """A registry's manifest delete flags the digest's tag events gone in the store's write transaction,
    found by the digest; SQLite, with no statistics, walked every event of the repository instead."""
    from store.queries.tags import TagSeen

    store = open_backend()
    events = [TagSeen("r", "ci/app", f"commit-{n:05d}", f"sha256:{n:064x}") for n in range(2000)]
    for first in range(0, len(events), 500):
        store.run(queries.record_tags, events[first : first + 500])
    with recorded_statements(
        lambda sql: sql.startswith("UPDATE tags") and "digest = :digest" in sql
    ) as statements:
        store.run(queries.mark_gone, "r", "ci/app", tag=None, digest=f"sha256:{1234:064x}")
    gone = [event.tag for event in store.run(queries.tag_history, "r", "ci/app") if event.gone_at]
    assert gone == ["commit-01234"] and store.run(queries.resolve_tag, "r", "ci/app", "commit-01234") is None
    ((sql, params),) = statements
    read = rows_read(store, sql, params, table="tags", generic=True)
    if isinstance(read, str):
        assert "tags_digest" in read and "SCAN" not in read, read
    else:
        assert read <= 3, read


def test_queue_coalesces_claims_once_and_survives_reopen(open_backend: OpenBackend) -> None:
    store = open_backend()
    ids = store.enqueue([("r/app:1", "r"), ("r/app:1", "r"), ("r/app:2", "r")])
    assert ids[0] == ids[1] and ids[0] != ids[2]
    claimed: list[str] = []
    lock = threading.Lock()

    def claim() -> None:
        other = open_backend()
        jobs = other.claim_jobs(10, owner="w", lease_seconds=30)
        with lock:
            claimed.extend(job.id for job in jobs)

    threads = [threading.Thread(target=claim) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert sorted(claimed) == sorted({ids[0], ids[2]})  # every job claimed exactly once
    store.close()
    reopened = open_backend()
    assert reopened.run(queries.queue_depth)["running"] == 2  # a reopen alone steals no leased job
    assert reopened.release_leases(["w"], refund_attempt=False) == 2
    assert reopened.run(queries.queue_depth)["queued"] == 2


def test_failed_job_retries_then_fails_and_can_be_retried_by_hand(open_backend: OpenBackend) -> None:
    store = open_backend()
    (job_id,) = store.enqueue([("r/app:1", "r")], max_attempts=2)
    store.claim_jobs(1, owner="w", lease_seconds=30)
    assert store.fail_job(job_id, "boom", retry_in=0, owner="w") == "queued"
    store.claim_jobs(1, owner="w", lease_seconds=30)
    assert store.fail_job(job_id, "boom again", retry_in=0, owner="w") == "failed"
    job = store.job(job_id)
    assert job is not None and job.state == "failed" and job.error == "boom again"
    retried = store.retry_job(job_id)
    assert retried is not None and retried.state == "queued" and retried.attempts == 0


def test_claims_respect_the_per_registry_limit(open_backend: OpenBackend) -> None:
    store = open_backend()
    store.enqueue([(f"busy/app:{n}", "busy") for n in range(5)] + [("calm/app:1", "calm")])
    first = store.claim_jobs(1, owner="a", lease_seconds=30, per_registry=2)
    assert [job.registry for job in first] == ["busy"]
    second = store.claim_jobs(10, owner="b", lease_seconds=30, per_registry=2)
    # one more busy job fits (the limit counts every worker's running jobs), then calm
    assert sorted(job.registry for job in second) == ["busy", "calm"]
    assert store.claim_jobs(10, owner="c", lease_seconds=30, per_registry=2) == []
    assert store.finish_job(first[0].id, digest=None, owner="a")
    assert len(store.claim_jobs(10, owner="c", lease_seconds=30, per_registry=2)) == 1


async def test_the_service_opens_the_store_in_the_configured_sync_mode(tmp_path: Path) -> None:
    from web.app import create_app
    from web.settings import ServiceSettings
    from web.state import SERVICES

    for mode, pragma in (("NORMAL", 1), ("FULL", 2)):
        settings = ServiceSettings(db=tmp_path / f"{mode}.db", sqlite_synchronous=mode, docker_config=None)
        store = create_app(settings, start_workers=False)[SERVICES].store
        assert isinstance(store.backend, Store)
        with store.backend._reading() as db:
            assert db.execute("PRAGMA synchronous").fetchone()[0] == pragma
        await store.close()


def test_leases_renew_expire_and_guard_outcomes(open_backend: OpenBackend) -> None:
    store = open_backend()
    ids = store.enqueue([("r/app:1", "r"), ("r/app:2", "r")])
    jobs = store.claim_jobs(10, owner="alive", lease_seconds=60)
    assert sorted(job.id for job in jobs) == sorted(ids)
    assert all(job.lease_owner == "alive" and job.lease_expires for job in jobs)
    assert sorted(store.renew_leases("alive", ids, 60)) == sorted(ids)
    assert store.renew_leases("thief", ids, 60) == []  # only the holder renews
    assert store.lease_owners() == ["alive"]
    assert store.expire_leases() == []  # nothing lapsed yet
    # a lease of (almost) zero lapses at once: the job is queued again, and the late outcome refused
    assert store.renew_leases("alive", [ids[0]], 0.000001) == [ids[0]]
    deadline_passed = threading.Event()
    deadline_passed.wait(0.01)  # the lease is 1 µs; 10 ms later it has certainly passed
    (expired,) = store.expire_leases()
    assert (expired.job_id, expired.owner, expired.state) == (ids[0], "alive", "queued")
    assert store.finish_job(ids[0], digest=None, owner="alive") is False
    assert store.fail_job(ids[0], "late", retry_in=1, owner="alive") is None
    assert store.finish_job(ids[1], digest="sha256:" + "9" * 64, owner="alive") is True
    done = store.job(ids[1])
    assert done is not None and done.state == "done" and done.result_digest == "sha256:" + "9" * 64
    assert done.lease_owner is None
    assert store.run(queries.latest_job_for, "r/app:2") == done
    assert store.run(queries.pending_job_for, "r/app:1") is not None
    assert store.run(queries.pending_job_for, "r/app") is None
    assert store.run(queries.queue_depth) == {"queued": 1, "running": 0, "done": 1, "failed": 0}
    health = store.queue_health()
    assert health.ready == 1 and health.running == 0 and health.last_progress_seconds is not None
    assert [job.id for job in store.run(queries.jobs, states=["done"])] == [ids[1]]
    assert store.run(queries.next_job_due) is not None
    store.check_writable(5.0)


# Queued images beside the one asked for: enough that PostgreSQL's generic plan for the old query walked
# them all newest first (its estimate for a range of parameters thought a match near).
NEIGHBOURS = 3000


def test_a_waiting_scan_is_found_by_its_reference_without_reading_the_queue(
    open_backend: OpenBackend,
) -> None:
    """`pending_job_for` finds a scan of the reference, its rescan, or one queued by digest
    (`reference@sha256:…`), never a neighbour's or a finished one; each arm an index lookup, so the image
    page's question does not read the queue (it read every active job: 27 ms at 100,000 on SQLite)."""
    from store import EnqueueBatch

    store = open_backend()
    (finished,) = store.enqueue([("r/app@sha256:" + "3" * 64, "r")])
    assert [job.id for job in store.claim_jobs(1, owner="w", lease_seconds=60)] == [finished]
    assert store.finish_job(finished, digest="sha256:" + "3" * 64, owner="w")
    # neighbours on both sides of the `r/app@` range, and a crowd of other queued images
    store.enqueue([(f"r/app{n}@sha256:{n:064x}", "r") for n in range(NEIGHBOURS)])
    store.enqueue([("r/app?@sha256:" + "1" * 64, "r"), ("r/appA@sha256:" + "2" * 64, "r"), ("r/ap", "r")])
    assert store.run(queries.pending_job_for, "r/app") is None  # a finished scan is not waiting

    (by_digest,) = store.enqueue([("r/app@sha256:" + "4" * 64, "r")])
    found = store.run(queries.pending_job_for, "r/app")
    assert found is not None and found.id == by_digest
    ((rescan,),) = store.enqueue_many([EnqueueBatch([("r/app", "r")], rescan=True)])
    assert store.run(queries.pending_job_for, "r/app").id in {rescan, by_digest}
    assert store.run(queries.pending_job_for, "r/app@sha256:" + "4" * 64).id == by_digest
    assert store.run(queries.pending_job_for, "r/app:1") is None
    (tagged,) = store.enqueue([("r/app:1", "r")])
    assert store.run(queries.pending_job_for, "r/app:1").id == tagged

    with recorded_statements(lambda sql: "dedupe_key = :rescan" in sql) as statements:
        assert store.run(queries.pending_job_for, "r/app200") is not None
    ((sql, params),) = statements
    read = rows_read(store, sql, params, generic=True)
    if isinstance(read, str):  # SQLite: every search of jobs is by key, none by state or time
        searches = [step for step in read.split(" | ") if "jobs" in step and "SEARCH" in step]
        assert searches and all("dedupe_key" in step for step in searches), read
        assert "SCAN jobs" not in read, read
    else:
        assert read <= 3, read  # the one job of `r/app200@…`, not the queue


def test_the_newest_jobs_in_some_states_are_read_without_the_rest_of_them(open_backend: OpenBackend) -> None:
    """The scans page's pending list and the image list's recent failures (`jobs(states=…)`) read each
    state's newest rows in order (migration 0022) and stop at the page: they read and sorted every job in
    those states (37 ms for the scans page at 100,000 queued jobs on SQLite)."""
    store = open_backend()
    store.enqueue([(f"r/app{n}@sha256:{n:064x}", "r") for n in range(NEIGHBOURS)])
    running = {job.id for job in store.claim_jobs(3, owner="w", lease_seconds=60)}
    newest = set(store.enqueue([("r/late:1", "r")])) | set(store.enqueue([("r/late:2", "r")]))

    with recorded_statements(lambda sql: "UNION ALL" in sql and "FROM jobs" in sql) as statements:
        pending = store.run(queries.jobs, states=["queued", "running", "queued"], limit=5)
    assert {job.id for job in pending[:2]} == newest and {job.state for job in pending} == {"queued"}
    assert len(pending) == 5
    assert {job.id for job in store.run(queries.jobs, states=["running"], limit=10)} == running
    with pytest.raises(ValueError, match="not job states"):
        store.run(queries.jobs, states=["paused"])

    ((sql, params),) = statements
    read = rows_read(store, sql, params, generic=True)
    if isinstance(read, str):  # SQLite: each state a range of its newest, no sort of the state's jobs
        searches = [step for step in read.split(" | ") if "jobs" in step]
        assert searches and all("jobs_state_created (state=?)" in step for step in searches), read
    else:
        assert read <= 10, read  # five of each state at most, not the queue


# Reports of one repository older than the index asked for: a CI repository keeps one per commit.
REPOSITORY_CROWD = 2000


def test_the_index_of_a_platform_manifest_is_found_without_reading_its_whole_repository(
    open_backend: OpenBackend,
) -> None:
    """`index_of` answers with the newest report of the repository that lists the platform manifest,
    walking the repository's reports newest first until one does (migration 0015); it read and sorted
    every report of the repository (38 ms at 20,000 on SQLite), for each such lookup and scans-page row."""
    from datetime import timedelta

    store = open_backend()
    start, child = datetime(2026, 1, 1, tzinfo=UTC), "sha256:" + "c" * 64

    def image(number: int, platforms: list[str], at: datetime, repository: str = "ci/app") -> ImageReport:
        return ImageReport(
            reference=f"reg.example/{repository}:{number}",
            digest=f"sha256:{number:064x}",
            registry="reg.example",
            repository=repository,
            scanned_at=at,
            platforms=[
                PlatformReport(platform=f"linux/{arch}", digest=digest, libc=LibcVerdict(flavour="glibc"))
                for arch, digest in zip(("amd64", "arm64"), platforms, strict=False)
            ],
        )

    store.run(queries.save_reports, [image(1, [child, "sha256:" + "a" * 64], start)])  # an older index
    for first in range(10, 10 + REPOSITORY_CROWD, 500):
        crowd = [
            image(n, [f"sha256:{n + 10**6:064x}"], start + timedelta(seconds=n))
            for n in range(first, first + 500)
        ]
        store.run(queries.save_reports, crowd)
    store.run(queries.save_reports, [image(2, [child, "sha256:" + "b" * 64], start + timedelta(days=1))])
    store.run(
        queries.save_reports, [image(3, ["sha256:" + "d" * 64, "sha256:" + "e" * 64], start, "other/app")]
    )
    # and newer reports of other repositories, which a walk of every report newest first would read
    later = start + timedelta(days=2)
    newer = range(10**5, 10**5 + 500)
    store.run(
        queries.save_reports,
        [image(n, [f"sha256:{n + 10**7:064x}"], later + timedelta(seconds=n), "other/app") for n in newer],
    )

    with recorded_statements(lambda sql: "FROM reports" in sql or "index_children" in sql) as statements:
        found = store.run(queries.index_of, "reg.example", "ci/app", child)
        # named through another repository: found; listed by no stored image (its index deleted): none
        elsewhere = store.run(queries.index_of, "reg.example", "ci/app", "sha256:" + "e" * 64)
        orphan = store.run(queries.index_of, "reg.example", "ci/app", "sha256:" + "f" * 64)
    assert found is not None and (found.digest, found.platform) == (f"sha256:{2:064x}", "linux/amd64")
    assert elsewhere is not None and (elsewhere.digest, elsewhere.platform) == (
        f"sha256:{3:064x}",
        "linux/arm64",
    )
    assert orphan is None
    # the child's own repository first, however new another repository's index is
    store.run(
        queries.save_reports,
        [image(4, [child, "sha256:" + "9" * 64], later + timedelta(days=1), "mirror/app")],
    )
    assert store.run(queries.index_of, "reg.example", "ci/app", child).digest == f"sha256:{2:064x}"
    assert store.run(queries.index_of, "reg.example", "mirror/app", child).digest == f"sha256:{4:064x}"

    assert len(statements) == 3
    for sql, params in statements:  # each lookup reads the indexes that list its child, nothing else
        read = rows_read(store, sql, params, table="reports", generic=True)
        if isinstance(read, str):  # SQLite: searches by key only, no scan and no sort of the reports
            assert all(step.startswith(("SEARCH", "USE TEMP B-TREE")) for step in read.split(" | ")), read
        else:  # PostgreSQL: the indexes that list the child (three by now), not the repository's crowd
            assert read <= 3, read


def test_upgrading_links_the_stored_indexes_to_their_platform_manifests(open_backend: OpenBackend) -> None:
    """Migration 0019 fills `index_children` from the index reports already stored, so `index_of` finds
    an index saved before it; a single-platform image links nothing."""
    store = open_backend()
    child = "sha256:" + "c" * 64
    index = ImageReport(
        reference="reg.example/app:1",
        digest="sha256:" + "1" * 64,
        registry="reg.example",
        repository="app",
        media_type="application/vnd.oci.image.index.v1+json",
        platforms=[
            PlatformReport(platform="linux/amd64", digest=child, libc=LibcVerdict(flavour="glibc")),
            PlatformReport(
                platform="linux/arm64", digest="sha256:" + "a" * 64, libc=LibcVerdict(flavour="glibc")
            ),
        ],
    )
    single = ImageReport(
        reference="reg.example/app:2",
        digest="sha256:" + "2" * 64,
        registry="reg.example",
        repository="app",
        media_type="application/vnd.oci.image.manifest.v1+json",
        platforms=[PlatformReport(platform="linux/amd64", digest="sha256:" + "2" * 64)],
    )
    store.run(queries.save_reports, [index, single])
    _back_to_version_18(store)
    again = open_backend()  # opening applies the pending migration
    found = again.run(queries.index_of, "reg.example", "app", child)
    assert found is not None and (found.digest, found.platform) == (index.digest, "linux/amd64")
    assert _links(again) == [("sha256:" + "a" * 64, index.digest), (child, index.digest)]


def _back_to_version_18(store: Any) -> None:
    """The database as version 18 left it: no `index_children`, migration 19 not recorded."""
    undo = ["DROP TABLE index_children", "DELETE FROM schema_migrations WHERE version = 19"]
    if isinstance(store, Store):
        with sqlite3.connect(store.path) as peer:
            for statement in undo:
                peer.execute(statement)
        return
    import psycopg

    with psycopg.connect(store._url, autocommit=True) as peer:
        for statement in undo:
            peer.execute(statement)


def _links(store: Any) -> list[tuple[str, str]]:
    sql = "SELECT child, parent FROM index_children ORDER BY child, parent"
    if isinstance(store, Store):
        with sqlite3.connect(store.path) as peer:
            return [tuple(row) for row in peer.execute(sql)]
    import psycopg

    with psycopg.connect(store._url) as peer:
        return [tuple(row) for row in peer.execute(sql)]


def test_a_filtered_image_list_reads_its_page_in_list_order(open_backend: OpenBackend) -> None:
    """The image list filtered by registry or by GPU walks an index in list order and stops at its page
    (migration 0017): SQLite sorted every report of the registry for each page (179 ms at 100,000) and
    read every report to count the GPU images; PostgreSQL sorted the registry's rows. And each row's tags
    are found by its digest: SQLite walked its repository's tag events (a page of a CI repository with
    50,000 events: 865 ms)."""
    from datetime import timedelta

    store = open_backend()
    start = datetime(2026, 1, 1, tzinfo=UTC)

    def image(number: int, registry: str) -> ImageReport:
        return ImageReport(
            reference=f"{registry}/team/app@sha256:{number:064x}",
            digest=f"sha256:{number:064x}",
            registry=registry,
            repository="team/app",
            scanned_at=start + timedelta(seconds=number),
            platforms=[
                PlatformReport(
                    platform="linux/amd64",
                    digest=f"sha256:{number + 10**6:064x}",
                    gpu=GpuFacts(required=number % 2 == 0),
                    libc=LibcVerdict(flavour="glibc"),
                )
            ],
        )

    # a registry of 300 older images, then 2,000 newer ones elsewhere
    store.run(queries.save_reports, [image(n, "rare.example") for n in range(300)])
    for first in range(300, 2300, 500):
        store.run(queries.save_reports, [image(n, "main.example") for n in range(first, first + 500)])
    with recorded_statements(lambda sql: "ORDER BY r.scanned_at DESC" in sql) as statements:
        rare, rare_total = store.run(queries.list_images, registry="rare.example", limit=20)
        gpu, gpu_total = store.run(queries.list_images, gpu=True, limit=20)
    assert rare_total == 300 and [row.digest for row in rare] == [
        f"sha256:{n:064x}" for n in range(299, 279, -1)
    ]
    assert gpu_total == 1150 and [row.digest for row in gpu] == [
        f"sha256:{n:064x}" for n in range(2298, 2258, -2)
    ]
    for (sql, params), index in zip(statements, ("reports_registry_order", "reports_gpu_order"), strict=True):
        read = rows_read(store, sql, params, table="reports")
        if isinstance(read, str):
            # SQLite: the page along the filter's index, in list order, not sorted (only its 20 rows are,
            # again, outside); each row's tags by its digest, not by walking its repository's tag events
            page = read[read.index("CO-ROUTINE r") : read.index("| SCAN r")]
            assert f"SEARCH r USING INDEX {index}" in page and "TEMP B-TREE" not in page, read
            assert (
                "SEARCH t USING INDEX tags_digest" in read and "SEARCH t USING INDEX tags_history" not in read
            )
            assert "SEARCH t USING INDEX tags_lookup" not in read, read
        else:  # PostgreSQL: the page's 20 rows, not the registry's 300 nor the 2,000 newer
            assert read <= 25, read


def test_sqlite_lists_deployments_and_releases_gpus_through_their_indexes(tmp_path: Path) -> None:
    """The indexes PostgreSQL has had since 0001 that SQLite lacked (migration 0018): the newest deployments
    are read along `deployments_created`, a deployment's GPUs released through `reservations_deployment`,
    not by reading every deployment or every reservation of the fleet."""
    store = Store(tmp_path / "store.db")
    with recorded_statements(
        lambda sql: (
            ("FROM deployments" in sql and "ORDER BY created_at" in sql) or "DELETE FROM reservations" in sql
        )
    ) as statements:
        store.run(queries.deployments, limit=10)
        store.run(queries.update_deployment, "d-1", "{}", state="stopped", release=True)
    plans = [rows_read(store, sql, params) for sql, params in statements]
    assert len(plans) == 2 and "deployments_created" in plans[0] and "TEMP B-TREE" not in plans[0], plans
    assert "reservations_deployment" in plans[1], plans
    store.close()


HISTORY = 1500  # deployments that ended: every one ever made stays in the table


def test_the_deployments_to_act_on_are_read_without_the_fleets_history(open_backend: OpenBackend) -> None:
    """An agent's poll (`actionable_deployments`) and the set of servers with work (`actionable_servers`,
    read again whenever another process changed a deployment) read the deployments to act on alone
    (migration 0020), and a server's page of deployments its newest rows (0021), not every deployment the
    fleet or the server ever had."""
    store = open_backend()
    for server in ("node-a", "node-b"):
        store.run(queries.upsert_server, server, f'{{"name": "{server}"}}')
    for n in range(HISTORY):
        store.create_deployment(f"old-{n}", ("node-a", "node-b")[n % 2], [], f'{{"id": "old-{n}"}}')
        store.run(queries.update_deployment, f"old-{n}", f'{{"id": "old-{n}"}}', state="exited", release=True)
    store.create_deployment("new", "node-a", ["GPU-1"], '{"id": "new"}')
    store.create_deployment("stopping", "node-b", [], '{"id": "stopping"}')
    store.run(queries.update_deployment, "stopping", '{"id": "stopping"}', state="running", desired="stop")

    with recorded_statements(lambda sql: "FROM deployments" in sql and "desired" in sql) as statements:
        assert store.run(queries.actionable_servers) == {"node-a", "node-b"}
        assert [r.record_json for r in store.run(queries.actionable_deployments, "node-a")] == [
            '{"id": "new"}'
        ]
        assert [r.state for r in store.run(queries.actionable_deployments, "node-b")] == ["running"]
        # and a server's newest deployments (its page), in order along its own rows
        page = store.run(queries.deployments, server="node-b", limit=10)
        assert [r.record_json for r in page][:2] == ['{"id": "stopping"}', f'{{"id": "old-{HISTORY - 1}"}}']
    assert len(statements) == 4
    for sql, params in statements:
        read = rows_read(store, sql, params, table="deployments", generic=True)
        if "LIMIT" in sql:  # the page: ten rows of the server's, no sort of its history
            # (PostgreSQL, knowing node-b has half the rows, may walk the newest of the whole fleet instead)
            assert (
                "deployments_server_newest" in read and "TEMP B-TREE" not in read
                if isinstance(read, str)
                else read <= 20
            ), (sql, read)
            continue
        if isinstance(read, str):  # SQLite: through the partial index, never a walk of the history
            steps = [step for step in read.split(" | ") if "deployments" in step]
            assert steps and all(
                step.endswith("deployments_actionable") or "deployments_actionable (" in step
                for step in steps
            ), read
        else:
            assert read <= 2, (sql, read)


def test_fleet_reservations_and_deployments(open_backend: OpenBackend) -> None:
    from store import GpuTaken

    store = open_backend()
    store.run(queries.upsert_server, "node-a", '{"name": "node-a"}')
    assert store.run(queries.heartbeat, "node-a") and not store.run(queries.heartbeat, "node-b")
    assert store.run(queries.server_inventory, "node-a") == '{"name": "node-a"}'
    assert [record.inventory_json for record in store.run(queries.servers)] == ['{"name": "node-a"}']
    store.create_deployment("d1", "node-a", ["GPU-1", "GPU-2"], '{"id": "d1"}')
    try:
        store.create_deployment("d2", "node-a", ["GPU-2", "GPU-3"], '{"id": "d2"}')
    except GpuTaken as exc:
        assert "GPU-2" in str(exc)
    else:
        raise AssertionError("GPU-2 was reserved twice")
    assert store.run(queries.reserved_gpus) == {
        "GPU-1": "d1",
        "GPU-2": "d1",
    }  # d2 left no partial reservation
    assert store.run(queries.deployment, "d2") is None
    assert [record.record_json for record in store.run(queries.actionable_deployments, "node-a")] == [
        '{"id": "d1"}'
    ]
    store.run(queries.update_deployment, "d1", '{"id": "d1", "v": 2}', state="exited", release=True)
    assert store.run(queries.reserved_gpus) == {}
    assert store.run(queries.deployment, "d1") == ('{"id": "d1", "v": 2}', "exited", "run")
    assert len(store.run(queries.deployments, server="node-a")) == 1


def test_heartbeat_stamps_are_written_in_a_batch_and_read_back_as_seconds(open_backend: OpenBackend) -> None:
    """What an API replica reads of the others' agents (`queries.heartbeats`): numbers, to the
    millisecond, and only the servers heard from since the time asked."""
    import time
    from datetime import UTC, datetime

    store = open_backend()
    for name in ("node-a", "node-b"):
        store.run(queries.upsert_server, name, f'{{"name": "{name}"}}')
    now = time.time()
    store.run(queries.stamp_heartbeats, {"node-a": now + 60.25, "node-b": now + 30.5})
    store.run(queries.stamp_heartbeats, {"node-a": now + 10.0})  # a stamp never moves back
    stamps = dict(store.run(queries.heartbeats))
    assert abs(stamps["node-a"] - (now + 60.25)) < 0.002 and abs(stamps["node-b"] - (now + 30.5)) < 0.002
    since = datetime.fromtimestamp(now + 45, UTC)
    assert [name for name, _ in store.run(queries.heartbeats, since)] == ["node-a"]
    # a batch as a busy replica writes one (one statement): each stamp forward, none back
    names = [f"node-{n:03d}" for n in range(300)]
    for name in names:
        store.run(queries.upsert_server, name, f'{{"name": "{name}"}}')
    store.run(queries.stamp_heartbeats, {name: now + n for n, name in enumerate(names)})
    store.run(queries.stamp_heartbeats, {name: now + 150 - n % 2 for n, name in enumerate(names)})
    stamps = dict(store.run(queries.heartbeats))
    for n, name in enumerate(names):
        assert abs(stamps[name] - max(now + n, now + 150 - n % 2)) < 0.002, (name, stamps[name] - now)


def test_a_replica_reads_only_the_stamps_other_processes_wrote(open_backend: OpenBackend) -> None:
    """Each row names the process whose stamp it holds; a replica following the others skips its own
    (with two APIs that was half of every read), and reads a row again once another stamps it later."""
    import time

    store = open_backend()
    for name in ("node-a", "node-b", "node-c"):
        store.run(queries.upsert_server, name, f'{{"name": "{name}"}}')
    now = time.time()
    store.run(queries.stamp_heartbeats, {"node-a": now + 1, "node-b": now + 1}, "api-1")
    store.run(queries.stamp_heartbeats, {"node-c": now + 2}, "api-2")
    assert sorted(name for name, _ in store.run(queries.heartbeats, None, "api-1")) == ["node-c"]
    assert sorted(name for name, _ in store.run(queries.heartbeats, None, "api-2")) == ["node-a", "node-b"]
    assert len(store.run(queries.heartbeats)) == 3  # no one to skip: every row
    store.run(queries.stamp_heartbeats, {"node-a": now + 3}, "api-2")  # node-a's agent moved to api-2
    store.run(queries.stamp_heartbeats, {"node-b": now}, "api-2")  # older than api-1's: not written
    assert sorted(name for name, _ in store.run(queries.heartbeats, None, "api-1")) == ["node-a", "node-c"]
    assert sorted(name for name, _ in store.run(queries.heartbeats, None, "api-2")) == ["node-b"]


def test_a_batch_of_stamps_costs_in_proportion_to_its_size(open_backend: OpenBackend) -> None:
    """A replica writes a flush's stamps in one statement; its relation of (name, stamp) pairs is
    walked once, never matched pair by pair (that was quadratic: 140 ms for 1,650 stamps on
    SQLite, about 1.3 s for these 5,000)."""
    import time

    from store.dialect import Db, writes

    @writes
    def register(db: Db, names: list[str]) -> None:
        for name in names:
            queries.upsert_server(db, name, f'{{"name": "{name}"}}')

    store = open_backend()
    names = [f"node-{n:05d}" for n in range(5_000)]
    store.run(register, names)
    now = time.time() + 60
    started = time.perf_counter()
    store.run(queries.stamp_heartbeats, {name: now for name in names})
    assert time.perf_counter() - started < 0.5
    assert all(abs(seen - now) < 0.002 for _, seen in store.run(queries.heartbeats))


def test_layer_cache_registries_and_tags_for_digest(open_backend: OpenBackend) -> None:
    store = open_backend()
    store.run(queries.save_layer_evidence, "sha256:" + "e" * 64, '{"flavour": "musl"}')
    store.run(queries.save_layer_evidence, "sha256:" + "e" * 64, '{"flavour": "glibc"}')
    assert store.run(queries.layer_evidence, "sha256:" + "e" * 64) == '{"flavour": "glibc"}'
    digest = "sha256:" + "a" * 64
    store.run(queries.save_report, _report(digest))
    store.run(queries.record_tag, "127.0.0.1:5000", "app", "v1", digest)
    store.run(queries.record_tag, "127.0.0.1:5000", "app", "v2", digest)
    assert store.run(queries.registries) == ["127.0.0.1:5000"]
    assert store.run(queries.tags_for_digest, digest) == [
        ("127.0.0.1:5000", "app", "v1"),
        ("127.0.0.1:5000", "app", "v2"),
    ]
    (row,), total = store.run(queries.list_images)
    assert total == 1 and row.tags == ["v1", "v2"] and row.digest == digest
    assert store.run(queries.has_report, digest) and store.run(queries.has_report, "sha256:" + "b" * 64)
    assert store.schema_version() == store.upgrade()  # upgrading a current database changes nothing


def test_a_gpu_belongs_to_the_server_that_reported_it_first(open_backend: OpenBackend) -> None:
    """Issue 43, point 8, in the store: the first reporter owns a GPU; another server's registration
    or report of it writes nothing (`refused`), unless it may `reassign` (the fleet-wide token); an
    operator's release or removal frees it. On both engines."""
    store = open_backend()

    def inventory(name: str, *uuids: str) -> str:
        return json.dumps({"name": name, "gpus": [{"uuid": u} for u in uuids]})

    assert store.run(queries.upsert_server, "a", inventory("a", "G1", "G2"), ["G1", "G2"]).written
    refused = store.run(queries.upsert_server, "b", inventory("b", "G2", "G3"), ["G2", "G3"])
    assert refused.refused == {"G2": "a"} and not refused.written
    assert store.run(queries.server_records, ["b"]) == []  # nothing of it was written
    assert store.run(queries.gpu_owners, ["G1", "G2", "G3"]) == {"G1": "a", "G2": "a"}
    assert store.run(queries.upsert_server, "b", inventory("b", "G3"), ["G3"]).written
    assert store.run(queries.replace_gpus, "b", inventory("b", "G1"), ["G1"]).refused == {"G1": "a"}
    assert store.run(queries.replace_gpus, "nobody", inventory("nobody"), []) is None
    moved = store.run(queries.replace_gpus, "b", inventory("b", "G1", "G3"), ["G1", "G3"], reassign=True)
    assert moved.written and moved.reassigned == {"G1": "a"}
    assert store.run(queries.claim_gpus, "a", ["G1", "G2"]).refused == {"G1": "b"}
    assert store.run(queries.release_gpu, "G1") == "b" and store.run(queries.release_gpu, "G1") is None
    assert store.run(queries.claim_gpus, "a", ["G1", "G2"]).written
    assert store.run(queries.gpu_owners, ["G1", "G2", "G3"]) == {"G1": "a", "G2": "a", "G3": "b"}
    assert store.run(queries.forget_server, "a") == ["G1", "G2"]
    assert store.run(queries.gpu_owners, ["G1", "G2", "G3"]) == {"G3": "b"}
    assert [json.loads(r.inventory_json)["name"] for r in store.run(queries.servers)] == ["b"]
    # A token's share of servers: a new one past it is refused; one registered already is not new.
    for name in ("c", "d"):
        assert store.run(queries.upsert_server, name, inventory(name), [], most_servers=3).written
    full = store.run(queries.upsert_server, "e", inventory("e"), [], most_servers=3)
    assert full.full and not full.written
    assert store.run(queries.upsert_server, "e", inventory("e"), [], most_servers=3, uncounted=["b"]).written
    assert store.run(queries.upsert_server, "d", inventory("d", "G9"), ["G9"], most_servers=3).written
    assert store.run(queries.server_count) == 4


def test_a_version_7_file_gives_each_registered_gpu_to_the_server_heard_from_last(tmp_path: Path) -> None:
    """Migration 8 on SQLite: the servers registered before it keep the GPUs (and MIG devices) they
    report; of two reporting one, the one heard from last."""
    path = tmp_path / "v7.db"
    with _sqlite_file_at(path, 7) as old:
        for name, uuids, heard in (("old", ["G1", "G2"], "2026-11-01"), ("new", ["G2", "G3"], "2026-11-27")):
            old.execute(
                "INSERT INTO servers (name, inventory, registered_at) VALUES (?, ?, '2026-10-01T00:00:00+00:00')",
                [
                    name,
                    json.dumps({"name": name, "gpus": [{"uuid": u, "mig_devices": _mig(u)} for u in uuids]}),
                ],
            )
            old.execute(
                "INSERT INTO server_heartbeats (name, last_heartbeat) VALUES (?, ?)",
                [name, f"{heard}T00:00:00+00:00"],
            )
        old.execute(
            'INSERT INTO servers (name, inventory, registered_at) VALUES (\'cpu\', \'{"name": "cpu", "gpus": []}\','
            " '2026-10-01T00:00:00+00:00')"
        )
        old.execute(
            "INSERT INTO server_heartbeats (name, last_heartbeat) VALUES ('cpu', '2026-11-27T00:00:00+00:00')"
        )
    store = Store(path)
    try:
        owners = store.run(queries.gpu_owners, ["G1", "G2", "G3", "MIG-G1", "MIG-G2"])
        assert owners == {"G1": "old", "G2": "new", "G3": "new", "MIG-G1": "old", "MIG-G2": "new"}
    finally:
        store.close()


def _mig(gpu_uuid: str) -> list[dict[str, str]]:
    """A MIG device of the GPUs G1 and G2 (the others are whole)."""
    return [{"uuid": f"MIG-{gpu_uuid}", "profile": "1g.10gb"}] if gpu_uuid in ("G1", "G2") else []


def test_postgres_migration_8_gives_each_registered_gpu_to_the_server_heard_from_last(
    postgres_url: str,
) -> None:
    import psycopg

    from store.migrations import migrations
    from store.postgres import PostgresStore

    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL,"
            " applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        )
        for migration in migrations("postgres")[:7]:
            for statement in migration.statements():
                conn.execute(statement)
            conn.execute(
                "INSERT INTO schema_migrations (version, name) VALUES (%s, %s)",
                [migration.version, migration.name],
            )
        for name, uuids, heard in (("old", ["G1", "G2"], "2026-11-01"), ("new", ["G2", "G3"], "2026-11-27")):
            conn.execute(
                "INSERT INTO servers (name, inventory, registered_at) VALUES (%s, %s, now())",
                [
                    name,
                    json.dumps({"name": name, "gpus": [{"uuid": u, "mig_devices": _mig(u)} for u in uuids]}),
                ],
            )
            conn.execute(
                "INSERT INTO server_heartbeats (name, last_heartbeat) VALUES (%s, %s)", [name, heard]
            )
        conn.execute(
            "INSERT INTO servers (name, inventory, registered_at) VALUES ('cpu', '{\"name\": \"cpu\"}', now())"
        )
        conn.execute("INSERT INTO server_heartbeats (name, last_heartbeat) VALUES ('cpu', now())")
    store = PostgresStore(postgres_url, pool_size=1)
    try:
        owners = store.run(queries.gpu_owners, ["G1", "G2", "G3", "MIG-G1", "MIG-G2"])
        assert owners == {"G1": "old", "G2": "new", "G3": "new", "MIG-G1": "old", "MIG-G2": "new"}
    finally:
        store.close()


def test_sqlite_files_versioned_by_user_version_migrate_without_rerunning(tmp_path: Path) -> None:
    """Files written before `schema_migrations` existed record their steps instead of re-applying
    them (re-running 0002's ALTER TABLE would fail on the existing column)."""

    from store.migrations import latest_version, migrations

    path = tmp_path / "legacy.db"
    with sqlite3.connect(path) as legacy:
        for migration in migrations("sqlite"):
            for statement in migration.statements():
                legacy.execute(statement)
        legacy.execute(f"PRAGMA user_version = {latest_version('sqlite')}")
    store = Store(path)
    try:
        assert store.schema_version() == latest_version("sqlite")
        with store._reading() as db:
            recorded = [row[0] for row in db.execute("SELECT version FROM schema_migrations ORDER BY 1")]
        assert recorded == [migration.version for migration in migrations("sqlite")]
    finally:
        store.close()


@contextlib.contextmanager
def _sqlite_file_at(path: Path, version: int) -> Iterator[sqlite3.Connection]:
    """A SQLite file as schema `version` left it (its migrations applied, none after), open for a
    test to add rows of that schema; committed and closed on leaving."""
    from store.migrations import migrations

    old = sqlite3.connect(path)
    try:
        for migration in migrations("sqlite")[:version]:
            for statement in migration.statements():
                old.execute(statement)
        old.execute(f"PRAGMA user_version = {version}")
        yield old
        old.commit()
    finally:
        old.close()


def test_a_version_5_file_keeps_its_servers_heartbeats_in_their_own_table(tmp_path: Path) -> None:
    """Migration 6: the last heartbeats move out of `servers` (a stamp rewrote the whole row,
    inventory included) into `server_heartbeats`, each server's kept."""
    path = tmp_path / "v5.db"
    with _sqlite_file_at(path, 5) as old:
        old.execute(
            "INSERT INTO servers (name, inventory, registered_at, last_heartbeat)"
            " VALUES ('gpu-1', '{}', '2026-11-01T00:00:00+00:00', '2026-11-27T10:00:00+00:00')"
        )
    store = Store(path)
    try:
        assert store.schema_version() >= 6
        [record] = store.run(queries.servers)
        assert record.last_heartbeat.startswith("2026-11-27T10:00:00")
        assert store.run(queries.heartbeat, "gpu-1")  # a stamp lands in the new table
        assert not store.run(queries.heartbeat, "unknown")
        [(name, seen)] = store.run(queries.heartbeats)
        assert name == "gpu-1" and seen > datetime(2026, 11, 27, 10, tzinfo=UTC).timestamp()
        with store._reading() as db:
            columns = [row[1] for row in db.execute("PRAGMA table_info(servers)")]
        assert "last_heartbeat" not in columns
    finally:
        store.close()


def test_sqlite_version_4_file_gets_the_job_indexes_postgres_has(tmp_path: Path) -> None:
    """Migration 5: the latest job of a reference is found by index, not by scanning every job
    (the image page asks it for each image without a report), and a queued job's insert no longer
    writes a page of the lease index, which holds running jobs only."""
    path = tmp_path / "v4.db"
    with _sqlite_file_at(path, 4):
        pass  # the schema alone
    store = Store(path)
    try:
        assert store.schema_version() >= 5
        (latest,) = _plans_of(store, lambda: store.run(queries.latest_job_for, "127.0.0.1:5000/app:v1"))
        assert "USING INDEX jobs_reference" in latest and "TEMP B-TREE" not in latest, latest
        with store._reading() as db:
            lease_index = db.execute("SELECT sql FROM sqlite_master WHERE name = 'jobs_lease'").fetchone()[0]
        assert "(lease_expires) WHERE state = 'running'" in lease_index  # a queued job's insert skips it
    finally:
        store.close()


def _plans_of(store: Any, call: Any) -> list[str]:
    """SQLite's plan for each SELECT on `jobs` that `call` reads, as the store words it (traced on
    this thread's read connection with its values), so the test follows the query it names."""
    statements: list[str] = []
    with store._reading() as reader:
        reader.set_trace_callback(statements.append)
        try:
            call()
        finally:
            reader.set_trace_callback(None)
        return [
            " ".join(str(row[3]) for row in reader.execute(f"EXPLAIN QUERY PLAN {statement}"))
            for statement in statements
            if statement.lstrip().upper().startswith("SELECT") and " FROM jobs" in statement
        ]


def _age_leases(store: Any, seconds: float) -> None:
    """Move every lease's expiry into the past, as time passing would (another connection, as a peer)."""
    from datetime import UTC, datetime, timedelta

    past = datetime.now(UTC) - timedelta(seconds=seconds)
    if isinstance(store, Store):
        with sqlite3.connect(store.path) as other:
            other.execute("UPDATE jobs SET lease_expires = ? WHERE state = 'running'", [past.isoformat()])
        return
    import psycopg

    with psycopg.connect(store._url) as other:
        other.execute("UPDATE jobs SET lease_expires = %s WHERE state = 'running'", [past])


def test_a_lapsed_lease_is_claimed_again_and_the_old_owner_cannot_record(open_backend: OpenBackend) -> None:
    store = open_backend()
    (job_id,) = store.enqueue([("r/app:1", "r")], max_attempts=3)
    (first,) = store.claim_jobs(1, owner="crashed", lease_seconds=30)
    assert first.lease_owner == "crashed" and first.lease_expires is not None
    assert store.expire_leases() == []  # not lapsed yet
    assert store.renew_leases("crashed", [job_id], 30) == [job_id]
    _age_leases(store, 1)
    (expiry,) = store.expire_leases()
    assert (expiry.job_id, expiry.owner, expiry.state) == (job_id, "crashed", "queued")
    (again,) = store.claim_jobs(1, owner="rescuer", lease_seconds=30)
    assert again.id == job_id and again.attempts == 2
    # The first worker comes back: its lease is gone, so it can neither renew nor record.
    assert store.renew_leases("crashed", [job_id], 30) == []
    assert store.finish_job(job_id, digest="sha256:" + "0" * 64, owner="crashed") is False
    assert store.fail_job(job_id, "late", retry_in=0, owner="crashed") is None
    assert store.finish_job(job_id, digest="sha256:" + "1" * 64, owner="rescuer") is True
    job = store.job(job_id)
    assert job is not None and job.state == "done" and job.result_digest == "sha256:" + "1" * 64


def test_a_job_that_keeps_killing_its_worker_fails_for_good(open_backend: OpenBackend) -> None:
    store = open_backend()
    (job_id,) = store.enqueue([("r/bomb:1", "r")], max_attempts=2)
    for attempt in (1, 2):
        (job,) = store.claim_jobs(1, owner=f"w{attempt}", lease_seconds=30)
        assert job.attempts == attempt
        _age_leases(store, 1)
        (expiry,) = store.expire_leases()
    assert expiry.state == "failed"
    job_after = store.job(job_id)
    assert job_after is not None and job_after.state == "failed"
    assert job_after.error is not None and "stopped renewing its lease" in job_after.error


def test_shutdown_hands_leases_back_without_spending_an_attempt(open_backend: OpenBackend) -> None:
    store = open_backend()
    (job_id,) = store.enqueue([("r/app:1", "r")])
    store.claim_jobs(1, owner="leaving", lease_seconds=30)
    assert store.lease_owners() == ["leaving"]
    assert store.release_leases(["leaving"], refund_attempt=True) == 1
    job = store.job(job_id)
    assert job is not None and job.state == "queued" and job.attempts == 0 and job.lease_owner is None


def test_queue_health_tells_a_stall_from_a_backlog(open_backend: OpenBackend) -> None:
    from web.health import stall_reason

    store = open_backend()
    fresh = store.queue_health()
    assert (fresh.ready, fresh.oldest_ready_seconds, fresh.last_progress_seconds) == (0, None, None)
    store.enqueue([("r/app:1", "r"), ("r/app:2", "r")])
    waiting = store.queue_health()
    assert waiting.ready == 2 and waiting.oldest_ready_seconds is not None
    assert stall_reason(waiting, stall_seconds=3600) is None
    stalled = stall_reason(waiting, stall_seconds=0)
    assert stalled is not None and "2 ready job(s)" in stalled and "GPUBADGE_STALL_SECONDS" in stalled
    store.claim_jobs(1, owner="w", lease_seconds=30)
    busy = store.queue_health()
    assert busy.running == 1 and busy.last_progress_seconds is not None
    assert stall_reason(busy, stall_seconds=0.0 + 3600) is None


def test_schema_migrates_a_file_from_before_versioning(tmp_path: Path) -> None:

    from store.migrations import migrations
    from store.sqlite import SCHEMA_VERSION

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as old:  # the schema as it was shipped before migrations
        for statement in migrations("sqlite")[0].statements():
            old.execute(statement)
        old.execute(
            "INSERT INTO jobs (id, reference, registry, dedupe_key, state, not_before, created_at, updated_at)"
            " VALUES ('old', 'r/app:1', 'r', 'r/app:1', 'queued', '2026-01-01', '2026-01-01', '2026-01-01')"
        )
    store = Store(path)
    assert store.schema_version() == SCHEMA_VERSION
    job = store.job("old")
    assert job is not None and job.lease_owner is None  # old rows keep their data, gain the columns
    assert Store(path).upgrade() == SCHEMA_VERSION  # a second start changes nothing


def test_a_held_write_lock_becomes_store_unavailable_not_a_hang(tmp_path: Path) -> None:

    from store import StoreUnavailable

    path = tmp_path / "q.db"
    store = Store(path, busy_timeout=0.2)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # a backup tool or a migration holding the write lock
    try:
        # the intake commits to its own journal (store.intake_journal): it never waits for this lock
        (job_id,) = store.enqueue([("r/app:1", "r")])
        with pytest.raises(StoreUnavailable, match="database is locked"):
            store.claim_jobs(1, owner="w", lease_seconds=30)
        with pytest.raises(StoreUnavailable, match="cannot be written"):
            store.check_writable(0.2)
        assert store.run(queries.queue_depth)["queued"] == 0  # reads go on beside the lock (WAL)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    job = store.job(job_id)  # the journal's job reached the store once the lock was gone
    assert job is not None and job.state == "queued"
    # coalesced into it: the same id or, where the first row was still moving (the mover retries a failed
    # move after a backoff), an alias that names the same job once moved
    (again,) = store.enqueue([("r/app:1", "r")])
    deadline = time.monotonic() + 10
    while (named := store.job(again)) is None or named.id != job_id:
        assert time.monotonic() < deadline, (again, job_id, named)
        time.sleep(0.05)
    store.check_writable(0.2)


def test_intake_commits_go_before_queued_scan_writes() -> None:
    from store.sqlite_access import WriterLock

    lock = WriterLock()
    order: list[str] = []
    release = threading.Event()
    holding = threading.Event()

    def holder() -> None:
        with lock.hold(urgent=False):
            holding.set()
            release.wait(timeout=10)

    def writer(name: str, urgent: bool) -> None:
        with lock.hold(urgent=urgent):
            order.append(name)

    first = threading.Thread(target=holder)
    first.start()
    assert holding.wait(timeout=10)
    scan_write = threading.Thread(target=writer, args=("scan write", False))
    scan_write.start()
    intake = threading.Thread(target=writer, args=("intake", True))
    intake.start()
    # Both wait on the held lock; once it is free the intake commit goes first.
    while lock._urgent_waiting == 0:
        intake.join(timeout=0.01)
    release.set()
    for thread in (first, scan_write, intake):
        thread.join(timeout=10)
    assert order == ["intake", "scan write"]


async def test_overlapping_health_checks_share_one_write(tmp_path: Path) -> None:
    from store import AsyncStore

    class SlowCheck(Store):
        checks = 0

        def check_writable(self, timeout: float) -> None:
            SlowCheck.checks += 1
            threading.Event().wait(0.2)  # a check still in flight when the next caller arrives
            super().check_writable(timeout)

    store = AsyncStore(SlowCheck(tmp_path / "h.db"))
    try:
        answers = await asyncio.gather(*(store.health(2.0) for _ in range(5)))
    finally:
        await store.close()
    assert answers == [None] * 5  # none reported the shared check as stuck
    assert SlowCheck.checks == 1


def test_a_batch_of_scan_results_is_stored_in_one_transaction(open_backend: OpenBackend) -> None:
    from store.queries import TagSeen

    store = open_backend()
    index, other, child = ("sha256:" + letter * 64 for letter in "acb")
    store.run(queries.save_report, _report(child))  # a platform scanned alone before its index
    assert store.run(queries.list_images)[1] == 1
    index_report = _report(index)  # its platform is `child`: the index report covers it now
    store.run(
        queries.save_scan_results,
        [
            TagSeen("127.0.0.1:5000", "app", "v1", index),
            index_report,
            _report(other, libc="musl"),
            TagSeen("127.0.0.1:5000", "app", "v2", other),
        ],
    )
    assert store.run(queries.report, index) == index_report  # the JSON, assembled once, reads back whole
    rows, total = store.run(queries.list_images)
    assert total == 2 and {row.digest for row in rows} == {index, other}
    assert store.run(queries.has_report, child)  # still known, as one platform of the index
    as_image, as_platform = store.run(queries.stored, child)
    assert as_image is None and as_platform is not None and as_platform.digest == child
    assert store.run(queries.resolve_tag, "127.0.0.1:5000", "app", "v1") == index
    assert store.run(queries.resolve_tag, "127.0.0.1:5000", "app", "v2") == other
    assert store.run(queries.list_images, libc="musl")[1] == 1


def _lone(digest: str, tag: str | None = None) -> ImageReport:
    """A platform manifest scanned on its own (a digest-only job): its one platform is itself."""
    platform = PlatformReport(platform="linux/amd64", digest=digest, libc=LibcVerdict(flavour="glibc"))
    reference = f"127.0.0.1:5000/app:{tag}" if tag else f"127.0.0.1:5000/app@{digest}"
    return ImageReport(
        reference=reference,
        digest=digest,
        registry="127.0.0.1:5000",
        repository="app",
        tag=tag,
        platforms=[platform],
    )


@pytest.mark.parametrize("child_saved", ["before", "with", "after"])
def test_a_multi_arch_child_is_never_an_image_of_its_own(open_backend: OpenBackend, child_saved: str) -> None:
    """Whichever of the two saves comes first (the child's own digest-only scan, its index's scan),
    only the index is an image; the child stays known as the index's platform."""
    store = open_backend()
    index, child = "sha256:" + "a" * 64, "sha256:" + "b" * 64  # _report(index)'s platform is `child`
    if child_saved == "before":
        store.run(queries.save_report, _lone(child))
        store.run(queries.save_report, _report(index))
    elif child_saved == "with":
        store.run(queries.save_scan_results, [_lone(child), _report(index)])
    else:
        store.run(queries.save_report, _report(index))
        store.run(queries.save_report, _lone(child))
    rows, total = store.run(queries.list_images)
    assert total == 1 and [row.digest for row in rows] == [index]
    as_image, as_platform = store.run(queries.stored, child)
    assert as_image is None and as_platform is not None


def test_a_tagged_platform_manifest_stays_an_image_after_its_index(open_backend: OpenBackend) -> None:
    """A tag that names the platform manifest itself makes it an image a user asked for."""
    from store.queries import TagSeen

    store = open_backend()
    index, child = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    store.run(queries.save_report, _report(index))
    store.run(
        queries.save_scan_results, [TagSeen("127.0.0.1:5000", "app", "amd64", child), _lone(child, "amd64")]
    )
    assert {row.digest for row in store.run(queries.list_images)[0]} == {index, child}


def test_postgres_child_save_waits_for_a_concurrent_index_save(postgres_url: str) -> None:
    """Across replicas: the child's save, begun while its index's save is uncommitted, waits for it
    (the platform digest's advisory lock) and then sees that the index covers it."""
    from store.dialect import Db, writes
    from store.postgres import PostgresStore

    index, child = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    store = PostgresStore(postgres_url, pool_size=4)
    try:
        index_saving, child_done = threading.Event(), threading.Event()
        release = threading.Event()

        @writes
        def save_index_and_hold(db: Db) -> None:
            queries.save_report(db, _report(index))
            index_saving.set()
            assert release.wait(10)

        def save_index() -> None:
            store.run(save_index_and_hold)

        def save_child() -> None:
            assert index_saving.wait(10)
            store.run(queries.save_report, _lone(child))
            child_done.set()

        threads = [threading.Thread(target=save_index), threading.Thread(target=save_child)]
        for thread in threads:
            thread.start()
        assert index_saving.wait(10)
        assert not child_done.wait(0.5), "the child's save did not wait for the index's"
        release.set()
        for thread in threads:
            thread.join(10)
        assert child_done.is_set()
        assert [row.digest for row in store.run(queries.list_images)[0]] == [index]
    finally:
        release.set()
        store.close()


async def test_concurrent_scan_writes_share_commits_and_return_only_once_committed(
    open_backend: OpenBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    from store import AsyncStore, StoreUnavailable

    backend = open_backend()
    batches: list[int] = []
    failing = threading.Event()
    run = backend.run

    def counting(query: Any, *args: Any, **kwargs: Any) -> Any:
        if query is queries.save_scan_results:
            if failing.is_set():
                raise StoreUnavailable("the disk is full")
            batches.append(len(args[0]))
        return run(query, *args, **kwargs)

    monkeypatch.setattr(backend, "run", counting)
    store = AsyncStore(backend)
    cache = store.scan_cache
    reader = open_backend()  # another process's view: it sees only what was committed

    async def scan(n: int) -> None:
        digest = "sha256:" + f"{n:064x}"
        await cache.record_tag("127.0.0.1:5000", "app", f"v{n}", digest)
        assert reader.run(queries.resolve_tag, "127.0.0.1:5000", "app", f"v{n}") == digest
        await cache.save_report(_report(digest))
        assert reader.run(queries.report, digest) is not None  # durable before the await returns

    try:
        await asyncio.gather(*(scan(n) for n in range(1, 41)))
        assert sum(batches) == 80  # every tag and every report written, once
        assert len(batches) <= 10  # in a few shared transactions, not one each
        failing.set()
        outcomes = await asyncio.gather(*(scan(n) for n in range(41, 45)), return_exceptions=True)
        assert all(isinstance(outcome, StoreUnavailable) for outcome in outcomes), outcomes
        failing.clear()
        await scan(45)  # a failed batch leaves the writer ready for the next
    finally:
        await store.close()
        reader.close()


async def test_a_jobs_final_report_commits_with_its_end_and_a_failed_batch_loses_neither(
    open_backend: OpenBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's scan queues its config facts, its layer's cache entry and its final report; the
    final report supersedes the facts, and the job's end commits the rest in its own transaction
    (one hop, one commit). A batch that fails takes the report along to the worker's retry of the
    end: the job is never done without its report."""
    from store import AsyncStore, StoreUnavailable

    backend = open_backend()
    batches: list[list[str]] = []
    fail_next = threading.Event()
    committed = threading.Event()
    run = backend.run

    def counting(query: Any, *args: Any, **kwargs: Any) -> Any:
        if query is queries.save_scan_results:
            if fail_next.is_set():
                fail_next.clear()
                raise StoreUnavailable("the disk is full")
            batches.append(sorted(type(write).__name__ for write in args[0]))
            outcome = run(query, *args, **kwargs)
            committed.set()
            return outcome
        return run(query, *args, **kwargs)

    monkeypatch.setattr(backend, "run", counting)
    store = AsyncStore(backend)
    cache = store.scan_cache
    reader = open_backend()  # another process's view: it sees only what was committed
    layer, first, second, third, lone = ("sha256:" + n * 64 for n in "12345")
    try:
        backend.enqueue(
            [("127.0.0.1:5000/app:one", "127.0.0.1:5000"), ("127.0.0.1:5000/app:two", "127.0.0.1:5000")]
        )
        one, two = backend.claim_jobs(2, owner="w1", lease_seconds=30)

        await cache.save_report(_report(first).model_copy(update={"pending": True}), with_next_write=True)
        await cache.save_layer_evidence(layer, '{"schema_version": 2}')
        await cache.save_report(_report(first), with_next_write=True)
        assert await cache.layer_evidence(layer) == '{"schema_version": 2}'  # this process: from memory
        assert reader.run(queries.report, first) is None  # nothing committed yet: the end is to follow
        assert await store.finish_job(one.id, digest=first, owner="w1")
        assert batches == [["ImageReport", "JobEnd", "LayerSeen"]]  # one transaction, the facts superseded
        stored = reader.run(queries.report, first)
        assert stored is not None and not stored.pending
        assert reader.run(queries.layer_evidence, layer) == '{"schema_version": 2}'
        job_one = reader.run(queries.job, one.id)
        assert job_one is not None and (job_one.state, job_one.result_digest) == ("done", first)

        await cache.save_report(_report(second), with_next_write=True)
        fail_next.set()
        with pytest.raises(StoreUnavailable):
            await store.finish_job(two.id, digest=second, owner="w1")
        assert reader.run(queries.report, second) is None
        assert await store.finish_job(two.id, digest=second, owner="w1")  # the worker's retry
        assert batches[-1] == ["ImageReport", "JobEnd"]  # the report came along
        assert reader.run(queries.report, second) is not None
        job_two = reader.run(queries.job, two.id)
        assert job_two is not None and job_two.state == "done"
        assert not await store.finish_job(two.id, digest=second, owner="w1")  # its lease is gone

        # a job that fails: its queued report commits before the failure does
        backend.enqueue([("127.0.0.1:5000/app:three", "127.0.0.1:5000")])
        [three] = backend.claim_jobs(1, owner="w1", lease_seconds=30)
        await cache.save_report(_report(third), with_next_write=True)
        assert await store.fail_job(three.id, "a platform failed", retry_in=None, owner="w1") == "failed"
        assert reader.run(queries.report, third) is not None

        committed.clear()
        await cache.save_layer_evidence(lone, '{"schema_version": 2}')  # no write follows it
        assert await asyncio.to_thread(committed.wait, 5)  # it commits on its own, soon
        assert reader.run(queries.layer_evidence, lone) == '{"schema_version": 2}'
    finally:
        await store.close()
        reader.close()


async def test_a_jobs_config_facts_wait_for_its_final_report_while_other_batches_commit(
    open_backend: OpenBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a burst a batch is nearly always committing; the config facts of a scan whose layers
    read in moments are held back `FACTS_HOLD_SECONDS` rather than joining it, so the final report
    supersedes them and the image commits once. Facts no report follows commit on their own, and a
    job's failure commits them first."""
    from store import AsyncStore

    backend = open_backend()
    batches: list[list[str]] = []
    committed = threading.Event()
    run = backend.run

    def counting(query: Any, *args: Any, **kwargs: Any) -> Any:
        if query is queries.save_scan_results:
            batches.append(sorted(f"{type(w).__name__}:{getattr(w, 'pending', '')}" for w in args[0]))
            outcome = run(query, *args, **kwargs)
            committed.set()
            return outcome
        return run(query, *args, **kwargs)

    monkeypatch.setattr(backend, "run", counting)
    store = AsyncStore(backend)
    cache = store.scan_cache
    reader = open_backend()
    first, other, lone, failing = ("sha256:" + n * 64 for n in "6789")
    try:
        backend.enqueue(
            [("127.0.0.1:5000/app:one", "127.0.0.1:5000"), ("127.0.0.1:5000/app:two", "127.0.0.1:5000")]
        )
        one, two = backend.claim_jobs(2, owner="w1", lease_seconds=30)
        await cache.save_report(_report(first).model_copy(update={"pending": True}), with_next_write=True)
        await cache.save_report(_report(other))  # another scan's write commits meanwhile
        assert batches == [["ImageReport:False"]]  # without the held facts
        assert reader.run(queries.report, first) is None
        await cache.save_report(_report(first), with_next_write=True)
        assert await store.finish_job(one.id, digest=first, owner="w1")
        assert batches[-1] == ["ImageReport:False", "JobEnd:"]  # the facts were superseded
        stored = reader.run(queries.report, first)
        assert stored is not None and not stored.pending

        committed.clear()
        await cache.save_report(_report(lone).model_copy(update={"pending": True}), with_next_write=True)
        assert await asyncio.to_thread(committed.wait, 5)  # no report follows: they commit on their own
        held = reader.run(queries.report, lone)
        assert held is not None and held.pending

        await cache.save_report(_report(failing).model_copy(update={"pending": True}), with_next_write=True)
        assert await store.fail_job(two.id, "a platform failed", retry_in=None, owner="w1") == "failed"
        failed = reader.run(queries.report, failing)  # committed before the failure
        assert failed is not None and failed.pending

        # facts held for one tag, superseded by the same image's report under another: both tags stored
        shared = "sha256:" + "5" * 64
        tagged = {"pending": True, "tag": "one", "reference": "127.0.0.1:5000/app:one"}
        await cache.save_report(_report(shared).model_copy(update=tagged), with_next_write=True)
        await cache.save_report(
            _report(shared).model_copy(update={"tag": "two", "reference": "127.0.0.1:5000/app:two"})
        )
        await cache.flush()
        assert reader.run(queries.resolve_tag, "127.0.0.1:5000", "app", "two") == shared
        assert reader.run(queries.resolve_tag, "127.0.0.1:5000", "app", "one") == shared
        stored_shared = reader.run(queries.report, shared)
        assert stored_shared is not None and not stored_shared.pending

        # facts for one tag, then the same image's facts for another: the first sighting commits soon
        from store import facade

        monkeypatch.setattr(facade, "FACTS_HOLD_SECONDS", 30.0)
        again = "sha256:" + "4" * 64
        committed.clear()
        for tag in ("three", "four"):
            update = {"pending": True, "tag": tag, "reference": f"127.0.0.1:5000/app:{tag}"}
            await cache.save_report(_report(again).model_copy(update=update), with_next_write=True)
        assert await asyncio.to_thread(committed.wait, 5)
        assert reader.run(queries.resolve_tag, "127.0.0.1:5000", "app", "three") == again
        assert reader.run(queries.report, again) is None  # the facts under "four" are still held
    finally:
        await store.close()
        reader.close()


def test_the_postgres_dialect_spells_parameters_and_the_clock() -> None:
    from store.dialect import POSTGRES, SQLITE

    neutral = "SELECT :a::text[], '100%', coalesce(:b, 1) FROM t WHERE x < :now"
    assert (
        POSTGRES.translate(neutral)
        == "SELECT %(a)s::text[], '100%%', coalesce(%(b)s, 1) FROM t WHERE x < now()"
    )
    assert SQLITE.translate(neutral) == neutral  # SQLite binds :now to the process's clock


def test_a_listing_row_carries_every_platform_badge_once(open_backend: OpenBackend) -> None:
    """What the layers found (inferred CUDA, a mismatch, a requirement error) reaches the listing."""
    store = open_backend()
    report = _report("sha256:" + "a" * 64)
    badges = ["nvidia-gpu", "cuda-11.8", "cuda-12.4-inferred", "cuda-mismatch", "glibc"]
    arm = report.platforms[0].model_copy(update={"platform": "linux/arm64", "digest": "sha256:" + "e" * 64})
    platforms = [p.model_copy(update={"badges": badges}) for p in (report.platforms[0], arm)]
    store.run(queries.save_report, report.model_copy(update={"platforms": platforms}))
    store.run(queries.save_report, _report("sha256:" + "c" * 64))  # a report with no badges stored
    rows = {row.digest: row for row in store.run(queries.list_images)[0]}
    assert rows["sha256:" + "a" * 64].platform_badges == sorted(badges)
    assert rows["sha256:" + "c" * 64].platform_badges == []


async def test_the_front_door_covers_what_callers_need(open_backend: OpenBackend) -> None:
    """Every call web/ makes goes through `AsyncStore` (a method, `run` with a shared query, or
    `blocking` on a thread of its own), with the same answers on both engines."""
    from store import AsyncStore, EnqueueBatch, GpuTaken

    store = AsyncStore(open_backend(), threads=2)
    try:
        ids = await asyncio.to_thread(
            store.blocking.enqueue_many, [EnqueueBatch([("r.example/a:1", "r.example")], None, 5, 0.0)]
        )
        assert await asyncio.to_thread(store.blocking.run, queries.queued_jobs, cap=10) == 1
        health = await store.queue_health()
        assert (health.ready, health.running) == (1, 0)
        claimed = await store.claim_jobs(5, owner="w1", lease_seconds=0.0, per_registry=None)
        assert [job.id for job in claimed] == ids[0]
        assert [(load.registry, load.running) for load in await store.registry_load()] == [("r.example", 1)]
        assert await store.run(queries.lease_owners) == ["w1"]
        assert await store.renew_leases("w2", ids[0], 30.0) == []  # not w2's to renew
        await asyncio.sleep(0.01)  # the zero-second lease lapses
        assert [entry.job_id for entry in await store.expire_leases()] == ids[0]
        job = await store.run(queries.job, ids[0][0])
        assert job is not None and job.state == "queued"
        assert job.error == (  # one message, written once, on both engines
            "the worker w1 stopped renewing its lease (crashed, cut off, or unable to write) on attempt 1 of 5"
        )
        assert await store.run(queries.job, "no-such-job") is None
        await store.create_deployment("d1", "node-a", ["GPU-1"], '{"id": "d1"}')
        with pytest.raises(GpuTaken):
            await store.create_deployment("d2", "node-a", ["GPU-1"], '{"id": "d2"}')
    finally:
        await store.close()


async def test_a_claim_pass_learns_when_the_next_job_is_due_in_the_same_hop(
    open_backend: OpenBackend,
) -> None:
    """A worker's claim pass needs the claim and, when slots stay free, when the next queued job
    is due: one hop to the store's threads for both (each hop wakes a thread, then the loop)."""
    from store import AsyncStore

    backend = open_backend()
    backend.enqueue([("r.example/a:1", "r.example"), ("r.example/a:2", "r.example", 60.0)])
    store = AsyncStore(backend, threads=1)
    hops: list[object] = []
    hand_over = store._pool.run

    def counted(call: Any) -> Any:
        hops.append(call)
        return hand_over(call)

    store._pool.run = counted  # type: ignore[method-assign]
    try:
        claim = await store.claim_jobs_or_next_due(2, owner="w", lease_seconds=30)
        assert [job.reference for job in claim.jobs] == ["r.example/a:1"]
        due = claim.due
        assert due is not None and 50 < (due - datetime.now(UTC)).total_seconds() <= 60  # the delayed one
        assert claim.stored == {}  # a job by tag: the scan resolves its digest first
        assert len(hops) == 1
        claim = await store.claim_jobs_or_next_due(1, owner="w", lease_seconds=30)
        assert claim.jobs == [] and claim.due is not None  # nothing ready: still one hop, and the due time
        assert len(hops) == 2
        # a webhook's job names its digest: what the store holds for it comes with the claim
        known, unknown = "sha256:" + "a" * 64, "sha256:" + "c" * 64
        backend.run(queries.save_report, _report(known))
        backend.enqueue([(f"r.example/b:1@{known}", "r.example"), (f"r.example/b:2@{unknown}", "r.example")])
        claim = await store.claim_jobs_or_next_due(5, owner="w", lease_seconds=30)
        by_reference = {job.reference.rpartition("@")[2]: claim.stored[job.id] for job in claim.jobs}
        image, platform = by_reference[known]
        assert image is not None and image.digest == known and platform is None
        assert by_reference[unknown] == (None, None)
        assert len(hops) == 3
    finally:
        await store.close()
