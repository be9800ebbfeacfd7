"""The store: reports by digest, tag history, layer cache, and the durable job queue."""

from __future__ import annotations

import threading
from pathlib import Path

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
