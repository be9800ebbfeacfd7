"""Reports an older analysis wrote (`scanner.models.ANALYSIS_VERSION`): read again, never reused, and
judged meanwhile with a warning that says so.

An older gpubadge stored reports without `analysis`; the tests write such reports the way it did
(the stored JSON with the key taken out) into a real SQLite store, then scan through a real registry
or ask the service.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import time
import typing
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from pydantic import BaseModel

from fixtures import catalog
from fixtures.oci import ImageSpec
from fixtures.registry import LocalRegistry, free_port
from fixtures.service import run_service_process
from placement.decide import decide
from placement.image_facts import ImageFacts
from placement.index import FleetIndex
from placement.inventory import parse_inventory
from placement.request import DeployRequest
from scanner.layers.cuda_evidence import CUDA_EVIDENCE_SCHEMA
from scanner.layers.image import CACHE_SCHEMA
from scanner.layers.libc_paths import EVIDENCE_SCHEMA
from scanner.models import ANALYSIS_VERSION, STORED, ImageReport, PlatformReport
from scanner.registry.client import RegistryClient
from scanner.scan import Scanner, ScanOptions
from scanner.settings import ScannerSettings
from store import open_store
from tests.conftest import Pusher
from tests.faultproxy import FaultProxy, Rule
from tests.test_admission import admit, container, pod
from tests.test_scale_out import wait_until
from tests.test_service_e2e import call, wait_job
from web.app import create_app
from web.settings import ServiceSettings

API_TOKEN = "analysis-api-token"


def _shape(model: type[BaseModel], seen: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every model a platform report holds, by name: its fields and their types (no prose, no
    defaults), as Python writes the annotations, so a new pydantic does not change it."""
    seen = {} if seen is None else seen
    if model.__name__ in seen:
        return seen
    fields = {name: str(info.annotation) for name, info in model.model_fields.items() if name != "analysis"}
    seen[model.__name__] = fields
    pending = [info.annotation for info in model.model_fields.values()]
    while pending:
        annotation = pending.pop()
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            _shape(annotation, seen)
        pending.extend(typing.get_args(annotation))
    return seen


def test_the_version_is_pinned_to_the_reports_shape_and_the_evidence_schemas() -> None:
    """Whoever changes what a report records, or what a layer walk keeps, bumps ANALYSIS_VERSION (so
    reports stored before are read again) and pins the new fingerprint here."""
    shape = {
        "report": _shape(PlatformReport),
        "evidence": [CUDA_EVIDENCE_SCHEMA, EVIDENCE_SCHEMA, CACHE_SCHEMA],
    }
    fingerprint = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]
    assert (ANALYSIS_VERSION, fingerprint) == (2, "4589a36108d540bb"), (
        "a report's shape or an evidence schema changed: bump scanner.models.ANALYSIS_VERSION and pin"
        f" ({ANALYSIS_VERSION + 1}, {fingerprint!r}) here"
    )


def test_a_stored_report_without_a_version_is_analysis_0_and_one_made_now_is_current() -> None:
    made = PlatformReport(platform="linux/amd64", digest="sha256:" + "1" * 64)
    assert made.analysis == ANALYSIS_VERSION and not made.outdated
    written = json.loads(ImageReport(reference="r", platforms=[made]).model_dump_json())
    assert (
        ImageReport.model_validate_json(json.dumps(written), context=STORED).platforms[0].analysis
        == ANALYSIS_VERSION
    )
    del written["platforms"][0]["analysis"]
    old = ImageReport.model_validate_json(json.dumps(written), context=STORED)
    assert old.platforms[0].analysis == 0 and old.platforms[0].outdated
    # outside the store (a client reading `gpubadge scan --json`), a missing key is today's default
    assert ImageReport.model_validate_json(json.dumps(written)).platforms[0].analysis == ANALYSIS_VERSION


def as_an_older_gpubadge_wrote(db: Path) -> int:
    """Take `analysis` out of every stored report, as gpubadge stored them before it recorded one;
    the number of platform reports changed."""
    changed = 0
    with sqlite3.connect(db) as conn:
        for table in ("reports", "platform_reports"):
            for rowid, text in conn.execute(f"SELECT rowid, report FROM {table}").fetchall():
                document = json.loads(text)
                platforms = document.get("platforms", [document] if table == "platform_reports" else [])
                for platform in platforms:
                    changed += platform.pop("analysis", None) is not None
                conn.execute(f"UPDATE {table} SET report = ? WHERE rowid = ?", (json.dumps(document), rowid))
    conn.close()
    return changed


async def scan_into(
    db: Path, reference: str, options: ScanOptions | None = None, database_url: str | None = None
) -> ImageReport:
    settings = ScannerSettings(docker_config=None, deep_scan="never")
    async with RegistryClient(settings) as client:
        store = open_store(db, database_url=database_url)
        try:
            return await Scanner(client, store.scan_cache, settings).scan(reference, options)
        finally:
            await store.close()


@pytest.mark.parametrize("name", ["analysis/single:1", "analysis/index:1"])
async def test_a_report_an_older_analysis_wrote_is_read_again_then_reused(
    name: str, tmp_path: Path, registry: LocalRegistry, push: Pusher
) -> None:
    push(catalog.multi_arch() if name.endswith("index:1") else ImageSpec([catalog.ubuntu_base()]), name)
    reference, db = f"{registry.host}/{name}", tmp_path / "scan.db"
    first = await scan_into(db, reference)
    assert first.error is None and not first.cached
    assert all(p.analysis == ANALYSIS_VERSION and p.libc.flavour == "glibc" for p in first.platforms)
    assert (await scan_into(db, reference)).cached  # today's report is reused

    assert as_an_older_gpubadge_wrote(db) >= len(first.platforms)
    again = await scan_into(db, reference)
    assert again.error is None and not again.cached and again.requests > 1  # read again, not reused
    assert [p.analysis for p in again.platforms] == [ANALYSIS_VERSION] * len(first.platforms)
    assert [p.libc.flavour for p in again.platforms] == [p.libc.flavour for p in first.platforms]
    assert (await scan_into(db, reference)).cached  # and stored as today's: reused from now on

    if len(first.platforms) > 1:  # a platform of the index, asked for by its own digest
        child = f"{registry.host}/{name.split(':')[0]}@{first.platforms[0].digest}"
        assert (await scan_into(db, child)).cached
        as_an_older_gpubadge_wrote(db)
        by_digest = await scan_into(db, child)
        assert not by_digest.cached and by_digest.platforms[0].analysis == ANALYSIS_VERSION


def test_placement_warns_on_an_outdated_platform_and_only_there() -> None:
    fleet = parse_inventory((Path(__file__).parent.parent / "fixtures" / "fleet.yaml").read_text()).servers
    today = PlatformReport(platform="linux/amd64", digest="sha256:" + "2" * 64)
    older = today.model_copy(update={"analysis": 0})
    index = FleetIndex.build(fleet)  # one index: the kept decision of one must not answer the other
    current = decide(
        ImageFacts.from_report(ImageReport(reference="r", platforms=[today])), DeployRequest(), index
    )
    assert not any("older gpubadge analysis" in w for w in current.warnings)
    outdated = decide(
        ImageFacts.from_report(ImageReport(reference="r", platforms=[older])), DeployRequest(), index
    )
    (warning,) = [w for w in outdated.warnings if "older gpubadge analysis" in w]
    assert warning.startswith(
        f"linux/amd64: read by an older gpubadge analysis (0; this service runs {ANALYSIS_VERSION})"
    )
    assert "rescan" in warning


@pytest.fixture
async def service_on(tmp_path: Path) -> AsyncIterator[Any]:
    """Start the service on a SQLite file prepared beforehand; yields a function of the file."""
    runners: list[web.AppRunner] = []

    async def start(db: Path, **overrides: Any) -> str:
        inventory = tmp_path / "fleet.yaml"
        inventory.write_text(yaml.safe_dump({"servers": []}))
        settings = ServiceSettings(
            db=db, port=0, inventory_file=inventory, api_token=API_TOKEN, docker_config=None, **overrides
        )
        runner = web.AppRunner(create_app(settings))
        await runner.setup()
        runners.append(runner)
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def _eligibility(url: str, image: str, token: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/api/eligibility", json={"image": image}, headers=headers) as response,
    ):
        body = await response.json()
        assert response.status == 200, body
        return dict(body)


async def test_the_service_answers_an_outdated_report_with_a_warning_and_reads_it_again_with_the_token(
    tmp_path: Path, registry: LocalRegistry, push: Pusher, service_on: Any
) -> None:
    push(catalog.cuda_ubuntu(), "analysis/service:1")
    reference, db = f"{registry.host}/analysis/service:1", tmp_path / "service.db"
    assert (await scan_into(db, reference)).error is None
    as_an_older_gpubadge_wrote(db)
    url = await service_on(db)

    anonymous = await _eligibility(url, reference, None)  # may not scan: judged as stored, and told so
    assert any("older gpubadge analysis (0;" in w for w in anonymous["warnings"]), anonymous["warnings"]
    store = open_store(db)
    try:
        stored = await store.scan_cache.stored(anonymous["image"]["digest"])
    finally:
        await store.close()
    assert stored[0] is not None and stored[0].platforms[0].analysis == 0  # nothing was scanned

    with_token = await _eligibility(url, reference, API_TOKEN)  # read again before it is judged
    assert not any("older gpubadge analysis" in w for w in with_token["warnings"]), with_token["warnings"]
    assert not any(
        "older gpubadge analysis" in w for w in (await _eligibility(url, reference, None))["warnings"]
    )


async def test_a_registry_that_does_not_answer_holds_an_outdated_answer_only_for_the_wait(
    tmp_path: Path, registry: LocalRegistry, push: Pusher, service_on: Any
) -> None:
    """With the token, an outdated image is scanned again before it is judged; but where its registry does
    not answer, that scan holds the answer only GPUBADGE_OUTDATED_SCAN_WAIT: then the stored report
    answers, with its warning, and a queued scan finishes once the registry answers. (The scan once held
    the request for the registry's timeouts and retries: minutes.)"""
    push(catalog.cuda_ubuntu(), "analysis/hanging:1")
    async with FaultProxy(registry.url) as proxy, aiohttp.ClientSession() as session:
        reference, db = f"{proxy.host}/analysis/hanging:1", tmp_path / "service.db"
        assert (await scan_into(db, reference)).error is None
        as_an_older_gpubadge_wrote(db)
        url = await service_on(db, outdated_scan_wait=1.0)
        proxy.add(Rule("hang", path="/manifests/", times=None))

        started = time.monotonic()
        held = await _eligibility(url, reference, API_TOKEN)
        assert time.monotonic() - started < 6  # the 1 s wait and a margin
        assert any("older gpubadge analysis (0;" in w for w in held["warnings"]), held["warnings"]
        async with session.get(f"{url}/api/scans", params={"state": "queued,running"}) as reply:
            (job,) = [job for job in (await reply.json())["jobs"] if job["reference"] == reference]
        assert job["source"] == "outdated"
        await proxy.wait_for_in_flight(1, timeout=30)  # the queued scan waits on the registry now

        proxy.release.set()
        async with session.get(f"{url}/api/scans/{job['id']}", params={"wait": "30"}) as reply:
            assert (await reply.json())["state"] == "done"
        answered = await _eligibility(url, reference, None)
        assert not any("older gpubadge analysis" in w for w in answered["warnings"]), answered["warnings"]


async def test_an_outdated_image_is_read_again_for_the_answer_with_no_worker_free(
    tmp_path: Path, registry: LocalRegistry, push: Pusher, service_on: Any
) -> None:
    """The answer's own scan does not wait its turn in the queue (after an upgrade, `db rescan-outdated`
    may have queued thousands): an API replica with no worker at all answers an outdated image current."""
    push(catalog.cuda_ubuntu(), "analysis/no-worker:1")
    reference, db = f"{registry.host}/analysis/no-worker:1", tmp_path / "service.db"
    assert (await scan_into(db, reference)).error is None
    as_an_older_gpubadge_wrote(db)
    url = await service_on(db, workers=0, worker_processes=0, outdated_scan_wait=30.0)
    answered = await _eligibility(url, reference, API_TOKEN)
    assert not any("older gpubadge analysis" in w for w in answered["warnings"]), answered["warnings"]
    assert not any(
        "older gpubadge analysis" in w for w in (await _eligibility(url, reference, None))["warnings"]
    )


async def test_admission_judges_an_outdated_report_with_a_warning_and_queues_its_scan(
    tmp_path: Path, registry: LocalRegistry, push: Pusher
) -> None:
    push(catalog.cuda_ubuntu(require="cuda>=12.2"), "analysis/admit:1")
    image, db = f"{registry.host}/analysis/admit:1", tmp_path / "admit.db"
    assert (await scan_into(db, image)).error is None
    as_an_older_gpubadge_wrote(db)
    env = {
        "GPUBADGE_REGISTRIES": registry.host,
        "GPUBADGE_API_TOKEN": API_TOKEN,
        "GPUBADGE_ADMISSION": "deny",
    }
    gpu_pod = pod(container("x", image, gpus=1))

    def jobs() -> list[dict[str, Any]]:
        listed = call("GET", f"{service.url}/api/scans?limit=200").body["jobs"]
        return [job for job in listed if "analysis/admit" in job["reference"]]

    with run_service_process(db, env=env) as service:
        anonymous = admit(service, gpu_pod)  # no token: judged as stored, told so, nothing queued
        assert anonymous["allowed"] is True
        assert any("older gpubadge analysis" in w for w in anonymous["warnings"]), anonymous
        assert any("queued no scan" in w for w in anonymous["warnings"]), anonymous
        assert jobs() == []
        with_token = admit(service, gpu_pod, token=API_TOKEN)
        assert any("older gpubadge analysis" in w for w in with_token["warnings"]), with_token
        wait_until(lambda: bool(jobs()), 15, "the admission's scan queued")  # queued after the answer
        (job,) = jobs()
        assert job["source"] == "admission" and wait_job(service.url, str(job["id"]))["state"] == "done"
        after = admit(service, gpu_pod)
        assert after["allowed"] is True and not after.get("warnings"), after


def _rescan_outdated(db: Path | None, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpubadge.cli",
            "db",
            "rescan-outdated",
            *(["--db", str(db)] if db else []),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0 and not done.stderr, done
    return done.stdout


async def test_rescan_outdated_queues_each_outdated_image_once_within_its_limit_and_the_workers_bring_it_up(
    tmp_path: Path, registry: LocalRegistry, push: Pusher
) -> None:
    push(ImageSpec([catalog.ubuntu_base()]), "analysis/sweep-one:1")
    push(catalog.multi_arch(), "analysis/sweep-index:1")
    push(catalog.plain_glibc(), "analysis/sweep-today:1")
    db = tmp_path / "sweep.db"
    old = [await scan_into(db, f"{registry.host}/analysis/sweep-{name}:1") for name in ("one", "index")]
    as_an_older_gpubadge_wrote(db)
    assert (await scan_into(db, f"{registry.host}/analysis/sweep-today:1")).error is None

    first = _rescan_outdated(db, "--limit", "1")
    assert first.startswith(
        f"3 stored images read; 2 read by an analysis older than this one ({ANALYSIS_VERSION}): 1 scans queued now,"
    )
    assert "1 not queued (past --limit 1" in first
    second = _rescan_outdated(db)  # the first is waiting: not queued twice
    assert (
        f"2 read by an analysis older than this one ({ANALYSIS_VERSION}): 1 scans queued now, 1 already waiting"
        in second
    )
    assert "not queued" not in second

    env = {"GPUBADGE_REGISTRIES": registry.host}
    with run_service_process(db, env=env) as service:
        listed = call("GET", f"{service.url}/api/scans?limit=200").body["jobs"]
        jobs = {job["reference"]: job for job in listed if job["source"] == "outdated"}
        assert sorted(jobs) == sorted(f"{registry.host}/{r.repository}@{r.digest}" for r in old)
        for job in jobs.values():
            assert wait_job(service.url, str(job["id"]), wait=30)["state"] == "done"
    assert (
        f"0 read by an analysis older than this one ({ANALYSIS_VERSION}): 0 scans queued now"
        in _rescan_outdated(db)
    )
    with sqlite3.connect(db) as conn:
        stored = [
            ImageReport.model_validate_json(row[0], context=STORED)
            for row in conn.execute("SELECT report FROM reports")
        ]
    conn.close()
    assert len(stored) == 3 and all(not p.outdated for report in stored for p in report.platforms)


async def test_rescan_outdated_on_postgresql(
    tmp_path: Path, registry: LocalRegistry, push: Pusher, postgres_url: str
) -> None:
    import psycopg

    push(ImageSpec([catalog.ubuntu_base()]), "analysis/sweep-pg:1")
    reference = f"{registry.host}/analysis/sweep-pg:1"
    report = await scan_into(tmp_path / "unused.db", reference, database_url=postgres_url)
    assert report.error is None
    env = {"GPUBADGE_DATABASE_URL": postgres_url}
    assert "1 stored images read; 0 read by an analysis older" in _rescan_outdated(None, env=env)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        (text,) = conn.execute("SELECT report FROM reports").fetchone()  # type: ignore[misc]
        document = json.loads(text) if isinstance(text, str) else text
        del document["platforms"][0]["analysis"]  # as an older gpubadge stored it
        conn.execute("UPDATE reports SET report = %s", (json.dumps(document),))
    out = _rescan_outdated(None, env=env)
    assert (
        f"1 read by an analysis older than this one ({ANALYSIS_VERSION}): 1 scans queued now, 0 already waiting"
        in out
    )
    assert (
        f"1 read by an analysis older than this one ({ANALYSIS_VERSION}): 0 scans queued now, 1 already waiting"
        in _rescan_outdated(None, env=env)
    )
    with psycopg.connect(postgres_url) as conn:
        jobs = conn.execute("SELECT reference, source, state FROM jobs").fetchall()
    assert jobs == [(f"{registry.host}/analysis/sweep-pg@{report.digest}", "outdated", "queued")]


async def test_rescan_outdated_follow_waits_for_the_workers_and_queues_every_outdated_image_in_one_pass(
    tmp_path: Path, registry: LocalRegistry, push: Pusher
) -> None:
    db = tmp_path / "follow.db"
    for name in ("a", "b", "c"):
        push(ImageSpec([catalog.ubuntu_base(), catalog.app_layer(name)]), f"analysis/follow-{name}:1")
        assert (await scan_into(db, f"{registry.host}/analysis/follow-{name}:1")).error is None
    as_an_older_gpubadge_wrote(db)
    with run_service_process(db, env={"GPUBADGE_REGISTRIES": registry.host}):
        out = _rescan_outdated(db, "--limit", "2", "--follow")
    assert "2 scans waiting; going on once the queue has drained to 1" in out
    assert (
        f"3 stored images read; 3 read by an analysis older than this one ({ANALYSIS_VERSION}): 3 scans queued now"
        in out
    )
    assert "not queued" not in out
