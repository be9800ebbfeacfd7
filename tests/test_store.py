"""The store: reports by digest, tag history, layer cache, and the durable job queue."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from scanner.models import GpuFacts, ImageReport, LibcVerdict, PlatformReport
from store import SqliteStore as Store


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


def test_reports_round_trip_and_filter(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    store.save_report(_report("sha256:" + "a" * 64, gpu=True, cuda="12.2", libc="glibc"))
    store.save_report(_report("sha256:" + "c" * 64, libc="musl"))
    assert store.report("sha256:" + "a" * 64) is not None
    assert store.platform_report("sha256:" + "b" * 64) is not None
    gpu_rows, total = store.list_images(gpu=True)
    assert total == 1 and gpu_rows[0].cuda_versions == ["12.2"]
    assert store.list_images(libc="musl")[1] == 1
    assert store.list_images(cuda="12")[1] == 1
    assert store.list_images(cuda="11.8")[1] == 0
    assert store.list_images(query="100%")[1] == 0  # LIKE wildcards are escaped


def test_tag_history_and_gone(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    first, second = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    store.record_tag("r", "app", "v1", first)
    store.record_tag("r", "app", "v1", first)
    store.record_tag("r", "app", "v1", second)
    assert store.resolve_tag("r", "app", "v1") == second
    assert [event.digest for event in store.tag_history("r", "app")] == [second, first]
    store.mark_gone("r", "app", tag="v1", digest=None)
    assert store.resolve_tag("r", "app", "v1") is None
    store.mark_gone("r", "app", tag=None, digest=first)
    assert store.is_gone("r", "app", first)


def test_queue_coalesces_claims_once_and_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "q.db"
    store = Store(path)
    ids = store.enqueue([("r/app:1", "r"), ("r/app:1", "r"), ("r/app:2", "r")])
    assert ids[0] == ids[1] and ids[0] != ids[2]
    claimed: list[str] = []
    lock = threading.Lock()

    def claim() -> None:
        other = Store(path)
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
    reopened = Store(path)
    assert reopened.queue_depth()["running"] == 2  # a reopen alone steals no leased job
    assert reopened.release_leases(["w"], refund_attempt=False) == 2
    assert reopened.queue_depth()["queued"] == 2


def test_failed_job_retries_then_fails_and_can_be_retried_by_hand(tmp_path: Path) -> None:
    store = Store(tmp_path / "q.db")
    (job_id,) = store.enqueue([("r/app:1", "r")], max_attempts=2)
    store.claim_jobs(1, owner="w", lease_seconds=30)
    assert store.fail_job(job_id, "boom", retry_in=0, owner="w") == "queued"
    store.claim_jobs(1, owner="w", lease_seconds=30)
    assert store.fail_job(job_id, "boom again", retry_in=0, owner="w") == "failed"
    job = store.job(job_id)
    assert job is not None and job.state == "failed" and job.error == "boom again"
    retried = store.retry_job(job_id)
    assert retried is not None and retried.state == "queued" and retried.attempts == 0


def test_claims_respect_the_per_registry_limit(tmp_path: Path) -> None:
    store = Store(tmp_path / "q.db")
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


def _age_leases(path: Path, seconds: float) -> None:
    """Move every lease's expiry into the past, as time passing would (another connection, as a peer)."""
    import sqlite3
    from datetime import UTC, datetime, timedelta

    past = (datetime.now(UTC) - timedelta(seconds=seconds)).isoformat()
    with sqlite3.connect(path) as other:
        other.execute("UPDATE jobs SET lease_expires = ? WHERE state = 'running'", [past])


def test_a_lapsed_lease_is_claimed_again_and_the_old_owner_cannot_record(tmp_path: Path) -> None:
    path = tmp_path / "q.db"
    store = Store(path)
    (job_id,) = store.enqueue([("r/app:1", "r")], max_attempts=3)
    (first,) = store.claim_jobs(1, owner="crashed", lease_seconds=30)
    assert first.lease_owner == "crashed" and first.lease_expires is not None
    assert store.expire_leases() == []  # not lapsed yet
    assert store.renew_leases("crashed", [job_id], 30) == [job_id]
    _age_leases(path, 1)
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


def test_a_job_that_keeps_killing_its_worker_fails_for_good(tmp_path: Path) -> None:
    path = tmp_path / "q.db"
    store = Store(path)
    (job_id,) = store.enqueue([("r/bomb:1", "r")], max_attempts=2)
    for attempt in (1, 2):
        (job,) = store.claim_jobs(1, owner=f"w{attempt}", lease_seconds=30)
        assert job.attempts == attempt
        _age_leases(path, 1)
        (expiry,) = store.expire_leases()
    assert expiry.state == "failed"
    job_after = store.job(job_id)
    assert job_after is not None and job_after.state == "failed"
    assert job_after.error is not None and "stopped renewing its lease" in job_after.error


def test_shutdown_hands_leases_back_without_spending_an_attempt(tmp_path: Path) -> None:
    store = Store(tmp_path / "q.db")
    (job_id,) = store.enqueue([("r/app:1", "r")])
    store.claim_jobs(1, owner="leaving", lease_seconds=30)
    assert store.lease_owners() == ["leaving"]
    assert store.release_leases(["leaving"], refund_attempt=True) == 1
    job = store.job(job_id)
    assert job is not None and job.state == "queued" and job.attempts == 0 and job.lease_owner is None


def test_queue_health_tells_a_stall_from_a_backlog(tmp_path: Path) -> None:
    from web.health import stall_reason

    store = Store(tmp_path / "q.db")
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
    import sqlite3

    from store.sqlite import MIGRATIONS, SCHEMA_VERSION, _statements

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as old:  # the schema as it was shipped before migrations
        for statement in _statements(MIGRATIONS[0]):
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
    import sqlite3

    from store import StoreUnavailable

    path = tmp_path / "q.db"
    store = Store(path, busy_timeout=0.2)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # a backup tool or a migration holding the write lock
    try:
        with pytest.raises(StoreUnavailable, match="database is locked"):
            store.enqueue([("r/app:1", "r")])
        with pytest.raises(StoreUnavailable, match="cannot be written"):
            store.check_writable(0.2)
        assert store.queue_depth()["queued"] == 0  # reads go on beside the lock (WAL)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert len(store.enqueue([("r/app:1", "r")])) == 1
    store.check_writable(0.2)


def test_intake_commits_go_before_queued_scan_writes() -> None:
    from store.sqlite import _WriterLock

    lock = _WriterLock()
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
