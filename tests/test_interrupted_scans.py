"""A scan interrupted while it reads layers is finished later, and users can rescan (issue 43, point 1).

Before, the next run of the interrupted job (or any scan of the image) found the pending report the
interrupted read had published, took it as cached and marked the job done: the badge said "pending"
for good. Now a pending report is trusted only while the job that wrote it holds a live lease.

The images are pushed with skopeo into the real registry; a proxy in front of it holds the layer
blobs, so a read stays in flight until the test interrupts it: by `kill -9` or a SIGTERM whose drain
ends mid-read of a running `gpubadge serve`, by pre-emption and by a lapsed lease in the scanner
over a real store. A rescan (POST /api/scans with `rescan: true`) reads an image again whatever is
stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest

from fixtures import catalog
from fixtures.registry import LocalRegistry
from fixtures.service import run_service_process
from scanner.models import ImageReport
from scanner.registry.client import RegistryClient
from scanner.scan import Scanner, ScanOptions
from scanner.settings import ScannerSettings
from store import AsyncStore, open_store, queries
from tests.conftest import Pusher
from tests.faultproxy import FaultProxy, Rule
from tests.test_pending_reports import layer_digests
from tests.test_service_e2e import Reply, call

TOKEN = "api-token-interrupted"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def ask(method: str, url: str, body: dict[str, object] | None = None, timeout: float = 40) -> Reply:
    """An HTTP call off the loop: the proxy answers on this loop meanwhile."""
    return await asyncio.to_thread(call, method, url, body, AUTH, timeout)


@dataclass
class Held:
    proxy: FaultProxy
    registry: LocalRegistry
    reference: str  # through the proxy, whose layer blobs hang until `proxy.release` is set


@pytest.fixture
async def held(registry: LocalRegistry, push: Pusher) -> AsyncIterator[Held]:
    name = f"interrupted/app{os.urandom(3).hex()}"
    push(catalog.plain_glibc(), f"{name}:1")
    layers = "|".join(re.escape(digest) for digest in layer_digests(registry, name, "1"))
    async with FaultProxy(registry.url) as proxy:
        proxy.add(Rule("hang", method="GET", path=rf"/blobs/({layers})$", times=None))
        try:
            yield Held(proxy, registry, f"{proxy.host}/{name}:1")
        finally:
            proxy.release.set()


# ------------------------------------------------------------ a running service, stopped mid-read


@pytest.mark.parametrize("stop", ["kill -9", "SIGTERM, drain ends mid-read"])
async def test_a_scan_stopped_mid_read_is_read_again_when_its_job_runs_again(
    held: Held, tmp_path: Path, stop: str
) -> None:
    """The service publishes the config facts, then is stopped while the layers are read. The next
    service on the same database runs the job again (its dead owner's lease released at start, or the
    lease handed back at shutdown): it reads the layers and the report is complete, not pending."""
    env = {
        "GPUBADGE_REGISTRIES": f"{held.registry.host},{held.proxy.host}",
        "GPUBADGE_API_TOKEN": TOKEN,
        "GPUBADGE_DRAIN_SECONDS": "0.5",
    }
    database = tmp_path / "svc.db"
    by_ref = f"/api/images/by-ref?ref={quote(held.reference)}"
    with contextlib.ExitStack() as stack:
        first = await asyncio.to_thread(stack.enter_context, run_service_process(database, env=env))
        assert first.process is not None
        queued = await ask("POST", f"{first.url}/api/scans", {"ref": held.reference})
        assert queued.status == 202, queued.text
        facts = await ask("GET", f"{first.url}{by_ref}&wait=30&until=facts")
        assert facts.status == 200 and facts.body["pending"] is True, facts.text
        (platform,) = facts.body["platforms"]
        assert platform["pending_scan"] == queued.body["id"]  # the job reading the layers
        if stop == "kill -9":
            first.process.kill()
        else:
            first.process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(first.process.wait, 30)
        stack.close()
        held.proxy.release.set()
        second = await asyncio.to_thread(stack.enter_context, run_service_process(database, env=env))
        done = await ask("GET", f"{second.url}{by_ref}&wait=30")
        assert done.status == 200, done.text
        assert done.body["pending"] is False, done.text
        (platform,) = done.body["platforms"]
        assert platform["libc"]["state"] == "analysed" and platform["libc"]["flavour"] == "glibc"
        assert platform["pending_scan"] is None
        job = await ask("GET", f"{second.url}/api/scans/{queued.body['id']}?wait=30")
        assert job.body["state"] == "done", job.text


# ------------------------------------------------------------ the scanner over a real store


@contextlib.asynccontextmanager
async def scanner_and_store(tmp_path: Path, held: Held) -> AsyncIterator[tuple[Scanner, AsyncStore]]:
    settings = ScannerSettings(
        docker_config=None,
        registries=[{"host": held.registry.host}, {"host": held.proxy.host}],
        analysis_processes=1,
        retries=1,
    )  # type: ignore[list-item]
    store = open_store(tmp_path / "scans.db")
    try:
        async with RegistryClient(settings) as client:
            scanner = Scanner(client, store.scan_cache, settings, publish_facts=True)
            try:
                yield scanner, store
            finally:
                await scanner.close()
    finally:
        await store.close()


async def start_and_interrupt(scanner: Scanner, store: AsyncStore, reference: str, job: str) -> None:
    """Scan `reference` as `job` until its config facts are stored, then cancel it mid-read."""
    published = asyncio.Event()
    task = asyncio.create_task(scanner.scan(reference, ScanOptions(job=job, on_facts=published.set)))
    await asyncio.wait_for(published.wait(), 30)
    await store.scan_cache.flush()  # a job's facts commit with the store's next write, or within moments
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def claimed(store: AsyncStore, reference: str, registry: str, lease_seconds: float) -> str:
    (job_id,) = await store.enqueue([(reference, registry)], source="test")
    (job,) = await store.claim_jobs(1, owner="worker-a", lease_seconds=lease_seconds)
    assert job.id == job_id
    return job_id


def complete(report: ImageReport) -> bool:
    (platform,) = report.platforms
    return not report.pending and platform.libc.state == "analysed" and platform.libc.flavour == "glibc"


async def test_a_pending_report_is_reused_only_while_its_job_holds_a_live_lease(
    held: Held, tmp_path: Path
) -> None:
    """Job A is reading the layers: another job's scan takes A's pending report (A will finish it).
    Pre-empted, A's job is queued: a scan now reads the layers itself."""
    async with scanner_and_store(tmp_path, held) as (scanner, store):
        job = await claimed(store, held.reference, held.proxy.host, lease_seconds=60)
        await start_and_interrupt(scanner, store, held.reference, job)
        while_live = await scanner.scan(held.reference, ScanOptions(job="another-job"))
        assert while_live.cached and while_live.pending  # A holds its lease: its read gives the answer
        assert await store.preempt_job(job, owner="worker-a")  # pre-empted: back in the queue
        held.proxy.release.set()
        after = await scanner.scan(held.reference, ScanOptions(job="another-job"))
        assert complete(after), after.model_dump_json()


async def test_the_interrupted_job_run_again_reads_the_layers(held: Held, tmp_path: Path) -> None:
    """A job pre-empted (or handed back at shutdown) runs again as the same job: its own pending report
    is no answer, even while it holds its new lease."""
    async with scanner_and_store(tmp_path, held) as (scanner, store):
        job = await claimed(store, held.reference, held.proxy.host, lease_seconds=60)
        await start_and_interrupt(scanner, store, held.reference, job)
        assert await store.preempt_job(job, owner="worker-a")
        (again,) = await store.claim_jobs(1, owner="worker-b", lease_seconds=60)
        assert again.id == job
        held.proxy.release.set()
        rerun = await scanner.scan(held.reference, ScanOptions(job=job))
        assert complete(rerun), rerun.model_dump_json()


async def test_a_lapsed_lease_makes_the_pending_report_no_answer(held: Held, tmp_path: Path) -> None:
    """A worker cut off from the database stops renewing: once its lease lapses, a scan reads the
    layers (before the lapse, and before the job's lease is requeued, nothing else had to happen)."""
    async with scanner_and_store(tmp_path, held) as (scanner, store):
        job = await claimed(store, held.reference, held.proxy.host, lease_seconds=0.5)
        await start_and_interrupt(scanner, store, held.reference, job)

        async def lapsed() -> None:  # the lease's own clock: nothing renews it
            while await store.run(queries.scan_in_flight, job):
                await asyncio.sleep(0.05)

        await asyncio.wait_for(lapsed(), 10)
        held.proxy.release.set()
        after = await scanner.scan(held.reference, ScanOptions(job="another-job"))
        assert complete(after), after.model_dump_json()


# ------------------------------------------------------------ a forced rescan, through the API


async def test_a_rescan_reads_the_image_again_whatever_is_stored(
    registry: LocalRegistry, push: Pusher, tmp_path: Path
) -> None:
    """POST /api/scans answers a stored image from its report; with `rescan: true` it is read again
    (a new scan time, nothing cached), and the job says it was a rescan. The route is declared once,
    its body model in the OpenAPI document."""
    push(catalog.plain_glibc(), "interrupted/rescan:1")
    reference = f"{registry.host}/interrupted/rescan:1"
    env = {"GPUBADGE_REGISTRIES": registry.host, "GPUBADGE_API_TOKEN": TOKEN}
    by_ref = f"/api/images/by-ref?ref={quote(reference)}"
    with run_service_process(tmp_path / "svc.db", env=env) as service:

        async def scan(body: dict[str, object]) -> dict[str, object]:
            queued = await ask("POST", f"{service.url}/api/scans", body)
            assert queued.status == 202, queued.text
            job = await ask("GET", f"{service.url}/api/scans/{queued.body['id']}?wait=30")
            assert job.body["state"] == "done", job.text
            report = await ask("GET", f"{service.url}{by_ref}")
            return {"job": job.body, "report": report.body}

        first = await scan({"ref": reference})
        plain = await scan({"ref": reference})
        assert plain["report"]["scanned_at"] == first["report"]["scanned_at"]  # type: ignore[index]
        assert plain["job"]["rescan"] is False  # type: ignore[index]
        rescanned = await scan({"ref": reference, "rescan": True})
        assert rescanned["job"]["rescan"] is True  # type: ignore[index]
        assert rescanned["report"]["scanned_at"] > first["report"]["scanned_at"]  # type: ignore[index,operator]
        openapi = await ask("GET", f"{service.url}/api/openapi.json")
        schemas = openapi.body["components"]["schemas"]
        assert schemas["ScanBody"]["properties"]["rescan"]["type"] == "boolean"
        assert schemas["JobView"]["properties"]["rescan"]["type"] == "boolean"
