"""Hostile images: every shape ends with the named bound, or with Linux's verdict, cheaply.

The images are built with Python's `tarfile` (PAX headers; `fixtures/hostile.py`) into
OCI layouts and pushed with skopeo into the real registry. They are scanned by the real
scanner (layer content parsed in its analysis processes), and by a running `gpubadge
serve`, whose /healthz and /api/images must keep answering while the hostile scans run.
Timing is for bench/hostile_bench.py; here every wait is bounded and nothing asserts time.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fixtures import catalog
from fixtures.hostile import SHAPES, HostileShape
from fixtures.oci import LAYER_MEDIA_TYPES, fake_elf
from fixtures.registry import LocalRegistry
from fixtures.service import RunningService, run_service_process
from scanner.layer_reader import LayerProgress, LayerReader
from scanner.layers.analysis import AnalysisPool
from scanner.layers.errors import AnalysisCrashed
from scanner.layers.libc import LibcAnalysis
from scanner.layers.libc_paths import LayerEvidence, PathRecord
from scanner.layers.limits import AnalysisLimits, LimitExceeded
from scanner.layers.tarstream import TarEntry
from scanner.models import ImageReport
from scanner.registry.client import RegistryClient
from scanner.registry.descriptors import Descriptor
from scanner.registry.reference import parse_reference
from scanner.scan import Scanner
from scanner.settings import ScannerSettings
from tests.conftest import Pusher
from tests.test_service_e2e import call

BY_NAME = {shape.name: shape for shape in SHAPES}


def scanner_settings(**overrides: object) -> ScannerSettings:
    values: dict[str, object] = {"docker_config": None, "retries": 2, "request_timeout": 20.0}
    values.update(overrides)
    return ScannerSettings(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def pushed(push: Pusher, registry: LocalRegistry) -> dict[str, str]:
    """Every hostile shape pushed once: name -> reference."""
    references = {}
    for shape in SHAPES:
        push(shape.build(), f"hostile/{shape.name}:1")
        references[shape.name] = f"{registry.host}/hostile/{shape.name}:1"
    return references


def failure(report: ImageReport) -> str | None:
    """The error a scan ended with: the report's own, or its one platform's (whose config facts stand)."""
    if report.error is not None:
        return report.error
    (platform,) = report.platforms
    return platform.error


async def scan(reference: str, **overrides: object) -> tuple[ImageReport, ScannerSettings]:
    settings = scanner_settings(**overrides)
    async with RegistryClient(settings) as client:
        scanner = Scanner(client, None, settings)
        try:
            report = await scanner.scan(reference)
        finally:
            await scanner.close()
    return report, settings


@pytest.mark.parametrize("shape", SHAPES, ids=[shape.name for shape in SHAPES])
async def test_each_hostile_shape_ends_as_bounded(shape: HostileShape, pushed: dict[str, str]) -> None:
    report, _ = await scan(pushed[shape.name], **shape.settings)
    if shape.fails:
        error = failure(report)
        assert error is not None, report.model_dump_json()
        assert error.endswith(f"({shape.expect})"), error
        assert "; the limit is " in error
        assert report.retryable is False
        assert report.error is None  # the config facts stand ...
        (platform,) = report.platforms
        assert platform.config_digest is not None
        assert (
            platform.libc.flavour == "unknown" and platform.badges[-1] == "libc-unknown"
        )  # ... no verdict guessed
    else:
        assert report.error is None, report.error
        (platform,) = report.platforms
        assert platform.libc.flavour == shape.expect, platform.libc


async def test_the_layer_bound_names_the_count(pushed: dict[str, str]) -> None:
    report, _ = await scan(pushed["many-layers"], max_layers=32)
    assert failure(report) == "image has 40 layers; the limit is 32 (GPUBADGE_MAX_LAYERS)"


async def test_a_raised_bound_lets_the_same_image_through(pushed: dict[str, str]) -> None:
    report, _ = await scan(pushed["many-entries"], max_layer_entries=20_000)
    assert report.error is None and report.platforms[0].libc.flavour == "none"


async def test_a_layer_past_the_layer_bound_ends_its_platform_with_the_bound_named(
    pushed: dict[str, str],
) -> None:
    """The layer bound holds in every read; the platform's config facts still stand."""
    report, _ = await scan(pushed["gzip-bomb"], max_layer_bytes=16 << 20)
    assert report.error is None and report.retryable is False
    (platform,) = report.platforms
    assert platform.libc.flavour == "unknown" and platform.config_digest is not None
    assert platform.error is not None and platform.error.endswith("(GPUBADGE_MAX_LAYER_BYTES)"), (
        platform.error
    )


async def test_big_zero_layers_under_the_ratio_floor_are_read_through_with_the_defaults(
    pushed: dict[str, str],
) -> None:
    """96 MiB of zeros is a legal layer (sparse files): with the default bounds it is streamed to glibc."""
    report, _ = await scan(pushed["gzip-bomb"])
    (platform,) = report.platforms
    assert platform.error is None and platform.libc.flavour == "glibc", platform


async def test_the_wall_time_bound_fails_the_scan_for_good(pushed: dict[str, str]) -> None:
    report, _ = await scan(pushed["many-legal-layers"], max_scan_seconds=0.001)
    assert report.error is not None and report.error.endswith("(GPUBADGE_MAX_SCAN_SECONDS)"), report.error
    assert report.retryable is False


@pytest.mark.parametrize("deep_scan", ["auto", "never"])
@pytest.mark.parametrize("processes", [0, 1])
async def test_the_ratio_guard_stops_gzip_and_zstd_bombs_in_every_read_path(
    pushed: dict[str, str], deep_scan: str, processes: int
) -> None:
    """In the scanning process or an analysis process, with the CUDA consumer on the walk or not."""
    for name in ("gzip-ratio-bomb", "zstd-ratio-bomb"):
        report, _ = await scan(
            pushed[name], analysis_processes=processes, deep_scan=deep_scan, **BY_NAME[name].settings
        )
        error = failure(report)
        assert error is not None and error.endswith("(GPUBADGE_MAX_INFLATION_RATIO)"), (name, error)


async def test_in_process_analysis_gives_the_same_answers(pushed: dict[str, str]) -> None:
    """`analysis_processes = 0` (the walk on the caller's loop) bounds the same shapes the same way."""
    for name in ("long-pax-link", "symlink-loop", "huge-pax-record"):
        shape = BY_NAME[name]
        report, _ = await scan(pushed[name], analysis_processes=0, **shape.settings)
        if shape.fails:
            error = failure(report)
            assert error is not None and error.endswith(f"({shape.expect})")
        else:
            assert report.platforms[0].libc.flavour == shape.expect


async def test_a_killed_analysis_process_fails_the_scan_as_retryable(
    push: Pusher, registry: LocalRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    """A process that dies mid-layer (OOM killer, kill -9) fails only that scan, retryably; the next works."""
    push(catalog.plain_glibc(), "hostile/victim:1")
    reference = f"{registry.host}/hostile/victim:1"
    settings = scanner_settings(analysis_processes=1, inline_analysis_bytes=0)  # the process, always
    async with RegistryClient(settings) as client:
        scanner = Scanner(client, None, settings)
        try:
            pool = scanner.layers.pool
            session = await pool.open("amd64", 1, AnalysisLimits(), time.monotonic() + 30, cuda=False)
            workers = list(pool._workers)
            assert len(workers) == 1
            workers[0].process.kill()
            await asyncio.wait_for(workers[0].process.wait(), 10)
            with pytest.raises(AnalysisCrashed):
                await session.use_cached(LayerEvidence().model_dump_json())
            session.close()
            assert any("the analysis process exited" in r.getMessage() for r in caplog.records)
            report = await scanner.scan(reference)  # a fresh process takes over
            assert report.error is None and report.platforms[0].libc.flavour == "glibc"
            caplog.clear()
        finally:
            await scanner.close()
    assert not [r for r in caplog.records if "analysis process" in r.getMessage()]  # an orderly close


async def test_a_stuck_analysis_process_is_killed_after_the_scan_deadline(
    push: Pusher, registry: LocalRegistry
) -> None:
    """A process that stops answering (SIGSTOP stands in for a runaway loop) fails the scan at its
    wall-time bound, is killed once the grace after it passes, and a fresh one serves the next scan."""
    push(catalog.plain_glibc(), "hostile/stuck:1")
    reference = f"{registry.host}/hostile/stuck:1"
    settings = scanner_settings(analysis_processes=1, inline_analysis_bytes=0, max_scan_seconds=2.0)
    async with RegistryClient(settings) as client:
        scanner = Scanner(client, None, settings)
        try:
            pool = scanner.layers.pool
            pool.kill_grace = 0.5
            (await pool.open("amd64", 1, AnalysisLimits(), time.monotonic() + 30, cuda=False)).close()
            (stuck,) = pool._workers
            os.kill(stuck.process.pid, signal.SIGSTOP)
            report = await scanner.scan(reference)
            error = failure(report)
            assert error is not None and error.endswith("(GPUBADGE_MAX_SCAN_SECONDS)"), error
            assert report.retryable is False
            await asyncio.wait_for(stuck.process.wait(), 30)  # killed by the watchdog (even while stopped)
            assert not stuck.alive and stuck.process.returncode is not None
            again = await scanner.scan(reference)
            assert again.error is None and again.platforms[0].libc.flavour == "glibc"
        finally:
            await scanner.close()


# ------------------------------------------------------------------ O(changes), not O(entries x layers)


def test_libc_analysis_redecides_only_on_changes_that_matter() -> None:
    """Thousands of irrelevant entries and layers cost no decision; each watched change costs one."""
    layers = 200
    analysis = LibcAnalysis("amd64", layers_total=layers, limits=AnalysisLimits())
    for index in range(layers - 1):
        collector = analysis.begin_layer()
        for n in range(50):
            collector.add(TarEntry(f"/srv/{index}/{n}", "file", 1, 0o644), b"")
        assert not analysis.decided
        collector.finish(complete=True)
    # Nothing any probe looks at was read: no decision was needed at all.
    assert analysis.decisions == 0, analysis.decisions
    collector = analysis.begin_layer()
    for n in range(5_000):  # entries nobody looks at: no decision
        collector.add(TarEntry(f"/usr/share/doc/{n}", "file", 1, 0o644), b"")
    assert analysis.decided is False
    assert analysis.decisions == 0
    collector.add(TarEntry("/bin/sh", "symlink", 0, 0o777, "busybox"), b"")
    assert not analysis.decided
    assert analysis.decisions == 1
    collector.add(TarEntry("/bin/busybox", "file", 64, 0o755), _musl_elf())
    assert analysis.decided
    assert analysis.decisions == 2


def test_repeated_writes_of_a_watched_path_cost_one_decision_per_check() -> None:
    """A layer that rewrites /bin/sh 10,000 times: the walk asks once per slice, not per entry."""
    analysis = LibcAnalysis("amd64", layers_total=2)
    collector = analysis.begin_layer()
    for _ in range(10_000):
        collector.add(TarEntry("/bin/sh", "symlink", 0, 0o777, "dash"), b"")
    assert not analysis.decided
    assert analysis.decisions == 1


def test_cached_partial_evidence_is_rolled_back_cleanly() -> None:
    analysis = LibcAnalysis("amd64", layers_total=2)
    collector = analysis.begin_layer()
    collector.add(TarEntry("/bin/.wh.sh", "file", 0, 0o644), b"")
    collector.finish(complete=True)
    partial = LayerEvidence(
        complete=False,
        entries={"/bin/sh": PathRecord(kind="symlink", target="busybox"), "/usr": PathRecord(kind="file")},
    )
    assert analysis.layer_from_cache(partial) is False
    assert analysis._records == {} and analysis._hides.covered == {} and analysis.layers_read == 1


def _musl_elf() -> bytes:
    return fake_elf("/lib/ld-musl-x86_64.so.1")


# ------------------------------------------------------------------ through a running service


SERVICE_SHAPES = (
    "long-pax-link",
    "many-layers",
    "huge-pax-record",
    "deep-path",
    "symlink-loop",
    "many-whiteouts",
)


@pytest.fixture(scope="module")
def service(
    pushed: dict[str, str], registry: LocalRegistry, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningService]:
    root: Path = tmp_path_factory.mktemp("hostile-service")
    env = {
        "GPUBADGE_REGISTRIES": json.dumps([{"host": registry.host}]),
        "GPUBADGE_MAX_ATTEMPTS": "1",
        "GPUBADGE_MAX_LAYERS": "32",
        "GPUBADGE_ANALYSIS_PROCESSES": "2",
        "DOCKER_CONFIG": str(root / "docker"),
    }
    with run_service_process(root / "service.db", env=env) as running:
        yield running


def test_the_api_keeps_answering_while_hostile_scans_run(
    service: RunningService, pushed: dict[str, str], push: Pusher, registry: LocalRegistry
) -> None:
    push(catalog.plain_glibc(), "hostile/normal:1")
    normal = f"{registry.host}/hostile/normal:1"
    jobs: dict[str, str] = {}
    for name in SERVICE_SHAPES:
        reply = call("POST", f"{service.url}/api/scans", {"ref": pushed[name]})
        assert reply.status == 202, reply.text
        jobs[name] = reply.body["id"]
    normal_job = call("POST", f"{service.url}/api/scans", {"ref": normal}).body["id"]

    answers: list[int] = []
    seen_running = False
    states: dict[str, dict[str, object]] = {}
    deadline = time.monotonic() + 180  # a bound on the wait, not an assertion about speed
    while time.monotonic() < deadline:
        answers.append(call("GET", f"{service.url}/healthz", timeout=10).status)
        answers.append(call("GET", f"{service.url}/api/images?limit=50", timeout=10).status)
        listing = call("GET", f"{service.url}/api/scans?limit=200", timeout=10).body["jobs"]
        states = {job["id"]: job for job in listing}
        seen_running = seen_running or any(job["state"] == "running" for job in listing)
        if all(
            states.get(job_id, {}).get("state") in ("done", "failed")
            for job_id in [*jobs.values(), normal_job]
        ):
            break
    assert seen_running, "the API was never polled while a scan ran"
    assert answers and all(status == 200 for status in answers), answers

    for name, job_id in jobs.items():
        job = states[job_id]
        shape = BY_NAME[name]
        if shape.fails:
            assert job["state"] == "failed", job
            assert str(job["error"]).endswith(f"({shape.expect})"), job
        else:
            assert job["state"] == "done", job
    assert states[normal_job]["state"] == "done", states[normal_job]

    # The badge of a failed image says "unknown" with the bound; it never guesses.
    name, _, tag = pushed["many-layers"].rpartition(":")
    path = f"{name}/{tag}"
    badge = call("GET", f"{service.url}/badge/{path}.svg", timeout=10)
    assert badge.status == 200
    assert "gpu: unknown (image has 40 layers; the limit is 32 (GPUBADGE_MAX_LAYERS))" in badge.text


async def test_1500_layers_are_refused_before_any_read() -> None:
    """The issue's shape: the count alone fails the image (no registry request, no analysis process)."""
    layers = [Descriptor(LAYER_MEDIA_TYPES["gzip"], f"sha256:{n:064x}", 100) for n in range(1_500)]
    settings = scanner_settings()
    async with RegistryClient(settings) as client:
        pool = AnalysisPool(1)
        reader = LayerReader(client, None, settings.analysis_limits(), pool)
        progress = LayerProgress(layers_total=len(layers), bytes_total=0)
        with pytest.raises(LimitExceeded) as raised:
            await reader.analyse(
                parse_reference("127.0.0.1:9/none/such:1"),
                layers,
                "amd64",
                cuda=True,
                deadline=time.monotonic() + 30,
                progress=progress,
            )
        assert pool._workers == []  # no analysis process was started
    assert str(raised.value) == "image has 1,500 layers; the limit is 256 (GPUBADGE_MAX_LAYERS)"
    assert client.totals.requests == 0
