"""Database faults, injected for real against `gpubadge serve`: scanning is delayed, never stopped.

- Another connection holds SQLite's write lock for longer than a job lease, as a backup tool, a
  migration or a failover would. /healthz says so within its budget, reads go on, new webhooks get
  503 with Retry-After, scans that finish meanwhile cannot record, and once the lock is gone every
  job accepted before the outage finishes, without a restart.
- The filesystem under the database fills up (a small tmpfs): the same, with SQLite's own words.
- A worker process is killed with SIGKILL mid-scan while a second process shares the store: the
  job's lease lapses, the other process runs it, and the image ends with one stored report.

The registry sits behind the fault proxy so each test decides when scans may finish: the proxy
holds manifest reads until released, which is the event the tests synchronise on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fixtures.notifications import distribution_push
from fixtures.oci import ImageSpec, LayerSpec, file
from fixtures.registry import LocalRegistry, free_port
from fixtures.service import RunningService, run_service_process
from tests.conftest import Pusher
from tests.faultproxy import FaultProxy, Rule
from tests.test_service_e2e import metric_values

SECRET = "faults-secret"
LEASE_SECONDS = 2.0
TIMEOUT = aiohttp.ClientTimeout(total=10)


def payload(host: str, repository: str, digest: str) -> bytes:
    """A Distribution push notification for `repository:1` as seen through `host`."""
    return distribution_push(host, repository, digest, "1")


def fault_env(proxy: FaultProxy, **extra: str) -> dict[str, str]:
    return {
        "GPUBADGE_REGISTRIES": proxy.host,
        "GPUBADGE_WEBHOOK_SECRET": SECRET,
        "GPUBADGE_WORKERS": "4",
        "GPUBADGE_PER_REGISTRY_SCANS": "4",  # one registry here: every image's scan in flight at once
        "GPUBADGE_LEASE_SECONDS": str(LEASE_SECONDS),
        "GPUBADGE_SQLITE_BUSY_TIMEOUT": "0.3",
        "GPUBADGE_HEALTH_TIMEOUT": "0.5",
        "GPUBADGE_RETRY_BACKOFF": "0.2",
        **extra,
    }


@pytest.fixture(scope="module")
def images(registry: LocalRegistry, push: Pusher) -> dict[str, str]:
    """Three small distinct images: repository -> manifest digest."""
    return {
        f"faults/img{n}": push(
            ImageSpec([LayerSpec([file("etc/os-release", f"ID=fault{n}\n")])]), f"faults/img{n}:1"
        )
        for n in range(3)
    }


@contextlib.asynccontextmanager
async def gated_proxy(registry: LocalRegistry) -> AsyncIterator[tuple[FaultProxy, Rule]]:
    """The registry behind a proxy that holds every manifest GET until `proxy.release` is set."""
    async with FaultProxy(f"http://{registry.host}") as proxy:
        gate = proxy.add(Rule("hang", method="GET", path=r"/manifests/", times=None))
        yield proxy, gate


async def send(session: aiohttp.ClientSession, service: RunningService, body: bytes) -> tuple[int, Any, Any]:
    async with session.post(
        f"{service.url}/hooks/distribution",
        data=body,
        headers={"Authorization": f"Bearer {SECRET}", "Content-Type": "application/json"},
    ) as response:
        return response.status, await response.json(), response.headers


async def get_json(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as response:
        return response.status, await response.json()


async def eventually(check: Any, what: str, timeout: float = 30.0) -> None:
    """Re-run the async `check` until it is true: a bounded wait on service state, not a sleep."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.1)


async def metric(session: aiohttp.ClientSession, service: RunningService, name: str) -> float:
    async with session.get(f"{service.url}/metrics") as response:
        return sum(metric_values(await response.text(), name).values())


async def queue_webhooks(
    session: aiohttp.ClientSession, service: RunningService, proxy: FaultProxy, images: dict[str, str]
) -> list[str]:
    job_ids = []
    for repository, digest in images.items():
        status, body, _ = await send(session, service, payload(proxy.host, repository, digest))
        assert status == 202, body
        job_ids.extend(body["jobs"])
    return job_ids


async def all_done(session: aiohttp.ClientSession, service: RunningService, job_ids: list[str]) -> None:
    for job_id in job_ids:
        status, job = await get_json(session, f"{service.url}/api/scans/{job_id}?wait=30")
        assert status == 200 and job["state"] == "done", job


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (a service's worker processes)."""
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def stored_reports(db: Path) -> dict[str, str]:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as connection:
        return dict(connection.execute("SELECT repository, digest FROM reports").fetchall())


async def outage_then_recovery(
    service: RunningService,
    proxy: FaultProxy,
    images: dict[str, str],
    db: Path,
    *,
    break_database: Any,
    mend_database: Any,
    cause: str,
    intake_goes_on: bool | None = False,
) -> None:
    """Scans in flight, then the database breaks for longer than a lease, then it mends.

    `intake_goes_on`: the outage leaves the intake's journal writable (a lock held on the store's
    file), so a delivery meanwhile is still accepted (202) and scanned after; None: it may (a full
    disk refuses the journal's commit unless its WAL already has the room), else 503."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        job_ids = await queue_webhooks(session, service, proxy, images)
        await proxy.wait_for_in_flight(len(images), timeout=20)  # every scan is claimed and running
        break_database()
        try:
            status, health = await get_json(session, f"{service.url}/healthz")
            assert status == 503 and cause in health["reasons"][0], health
            status, listing = await get_json(session, f"{service.url}/api/images")
            assert status == 200, listing  # reads do not wait for the broken writes
            status, body, headers = await send(
                session, service, payload(proxy.host, "faults/late", "sha256:" + "e" * 64)
            )
            late_jobs: list[str] = []
            if intake_goes_on or (intake_goes_on is None and status == 202):
                assert status == 202, body  # durable in the journal; the job reaches the store when it mends
                late_jobs = body["jobs"]
            else:
                assert status == 503 and cause in body["error"] and headers["Retry-After"], body
            proxy.release.set()  # the scans finish now, and cannot record their outcome

            async def gave_up() -> bool:  # every outcome write outlived its lease
                return service.log().count("its lease will bring it back") >= len(images)

            await eventually(gave_up, "the workers to give up recording")
            assert await metric(session, service, "gpubadge_worker_restarts_total") > 0
            assert service.process is not None and service.process.poll() is None  # the service stays up
        finally:
            mend_database()
        await all_done(session, service, job_ids)  # every job accepted before the outage finishes
        if late_jobs:  # and the one accepted during it is queued or scanned too (its image does not exist)
            status, late = await get_json(session, f"{service.url}/api/scans/{late_jobs[0]}?wait=30")
            assert status == 200 and late["reference"].startswith(f"{proxy.host}/faults/late"), late
        status, health = await get_json(session, f"{service.url}/healthz")
        assert status == 200, health
        assert await metric(session, service, "gpubadge_lease_expiries_total") >= len(images)
    assert stored_reports(db) == images  # one report per image, nothing lost


async def test_a_write_lock_held_past_the_lease_delays_scans_and_loses_none(
    registry: LocalRegistry, images: dict[str, str], tmp_path: Path
) -> None:
    db = tmp_path / "locked.db"
    blocker = sqlite3.connect(db, isolation_level=None)
    async with gated_proxy(registry) as (proxy, _):
        with run_service_process(db, env=fault_env(proxy)) as service:
            await outage_then_recovery(
                service,
                proxy,
                images,
                db,
                break_database=lambda: blocker.execute("BEGIN IMMEDIATE"),
                mend_database=lambda: blocker.execute("ROLLBACK"),
                cause="database is locked",
                intake_goes_on=True,
            )
    blocker.close()


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs, mounted for this test: filling it is a real ENOSPC for SQLite."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the README's test command runs as root)")
    mountpoint = tmp_path / "small"
    mountpoint.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def fill(directory: Path) -> Path:
    """Write zeros until the filesystem refuses (ENOSPC); returns the filler to delete later."""
    filler = directory / "filler"
    with contextlib.suppress(OSError), filler.open("wb") as out:
        while True:
            out.write(b"\0" * 65536)
            out.flush()
    return filler


async def test_a_full_disk_delays_scans_and_loses_none(
    registry: LocalRegistry, images: dict[str, str], small_filesystem: Path
) -> None:
    db = small_filesystem / "full.db"
    filler: list[Path] = []
    async with gated_proxy(registry) as (proxy, _):
        with run_service_process(
            db, env=fault_env(proxy), log_path=small_filesystem.parent / "full.log"
        ) as service:
            await outage_then_recovery(
                service,
                proxy,
                images,
                db,
                break_database=lambda: filler.append(fill(small_filesystem)),
                mend_database=lambda: [path.unlink() for path in filler],
                cause="database or disk is full",
                intake_goes_on=None,
            )


async def test_kill_9_of_a_worker_mid_scan_hands_the_job_to_another(
    registry: LocalRegistry, images: dict[str, str], tmp_path: Path
) -> None:
    db = tmp_path / "shared.db"
    repository, digest = "faults/img0", images["faults/img0"]
    async with gated_proxy(registry) as (proxy, _), aiohttp.ClientSession(timeout=TIMEOUT) as session:
        env = fault_env(proxy)
        with run_service_process(db, env=env, log_path=tmp_path / "doomed.log") as doomed:
            (job_id,) = await queue_webhooks(session, doomed, proxy, {repository: digest})
            await proxy.wait_for_in_flight(1, timeout=20)  # the doomed process is mid-scan
            with run_service_process(
                db, env=env, port=free_port(), log_path=tmp_path / "rescuer.log"
            ) as rescuer:
                assert doomed.process is not None
                # the service and its worker processes die at once, as in a crash of its host or container
                workers = children(doomed.process.pid)
                assert workers  # the scan runs in one of them
                doomed.process.send_signal(signal.SIGKILL)
                for pid in workers:
                    os.kill(pid, signal.SIGKILL)
                assert doomed.process.wait(timeout=10) == -signal.SIGKILL
                proxy.release.set()
                status, job = await get_json(session, f"{rescuer.url}/api/scans/{job_id}?wait=30")
                assert status == 200 and job["state"] == "done", job
                assert job["attempts"] == 2  # the lapsed lease counted the first, killed attempt
                assert await metric(session, rescuer, "gpubadge_lease_expiries_total") == 1
    assert stored_reports(db) == {repository: digest}
