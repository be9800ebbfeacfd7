"""The scanner end to end against a real registry: verdicts, request budget, early stop, caching."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fixtures import catalog
from fixtures.oci import ImageSpec, LayerSpec, LayoutWriter, file, push_layout
from fixtures.registry import LocalRegistry
from scanner.models import ImageReport, Platform
from scanner.registry.client import RegistryClient
from scanner.registry.reference import parse_reference
from scanner.scan import Scanner, ScanOptions
from scanner.settings import ScannerSettings
from store import SqliteStore, open_store, queries
from tests.conftest import Pusher


@pytest.fixture(scope="module")
def samples(registry: LocalRegistry, push: Pusher) -> dict[str, str]:
    """Every catalog image pushed once; name -> full reference."""
    refs = {}
    for name, spec in catalog.SAMPLES.items():
        push(spec, name)
        refs[name] = f"{registry.host}/{name}"
    return refs


@pytest.fixture
async def scanner(tmp_path: Path) -> AsyncIterator[Scanner]:
    # The libc pass alone: a deep scan reads every layer whole (tests/test_deep_scan.py covers it).
    settings = ScannerSettings(docker_config=None, deep_scan="never")
    async with RegistryClient(settings) as client:
        store = open_store(tmp_path / "scan.db")
        try:
            yield Scanner(client, store.scan_cache, settings)
        finally:
            await store.close()


def only(report: ImageReport) -> dict[str, object]:
    assert report.error is None, report.error
    assert len(report.platforms) == 1
    platform = report.platforms[0]
    return {
        "gpu": platform.gpu.required,
        "cuda": platform.gpu.cuda_version,
        "libc": platform.libc.flavour,
        "distro": platform.libc.distro,
        "musl_also": platform.libc.musl_also,
    }


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("samples/cuda-ubuntu:12.2", {"gpu": True, "cuda": "12.2", "libc": "glibc", "musl_also": False}),
        ("samples/alpine-gpu:3.20", {"gpu": True, "cuda": None, "libc": "musl", "musl_also": False}),
        ("samples/static:1", {"gpu": False, "cuda": None, "libc": "none", "musl_also": False}),
        ("samples/legacy-cuda:10.0", {"gpu": True, "cuda": "10.0", "libc": "glibc", "musl_also": False}),
        ("samples/plain-glibc:22.04", {"gpu": False, "cuda": None, "libc": "glibc", "musl_also": False}),
        ("samples/zstd:1", {"gpu": False, "cuda": None, "libc": "musl", "musl_also": False}),
        ("samples/whiteout:1", {"gpu": False, "cuda": None, "libc": "none", "musl_also": False}),
        ("samples/glibc-musl:1", {"gpu": False, "cuda": None, "libc": "glibc", "musl_also": True}),
    ],
)
async def test_verdicts(
    scanner: Scanner, samples: dict[str, str], name: str, expected: dict[str, object]
) -> None:
    facts = only(await scanner.scan(samples[name]))
    assert {key: facts[key] for key in expected} == expected


async def test_cuda_image_records_requirements_and_env(scanner: Scanner, samples: dict[str, str]) -> None:
    report = await scanner.scan(samples["samples/cuda-ubuntu:12.2"])
    platform = report.platforms[0]
    assert platform.gpu.requirements == [catalog.cuda_images()[1]["NVIDIA_REQUIRE_CUDA"]]
    assert platform.gpu.env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert platform.gpu.visible_devices == "all"
    assert "PATH" not in platform.gpu.env
    assert platform.libc.evidence and "ld-linux-x86-64" in platform.libc.evidence
    assert {"nvidia-gpu", "cuda-12.2", "glibc"} <= set(platform.badges)


async def test_index_scans_every_platform_and_skips_attestations(
    scanner: Scanner, samples: dict[str, str]
) -> None:
    with scanner.client.track() as stats:
        report = await scanner.scan(samples["samples/multi-arch:12.4"], ScanOptions(config_only=True))
    assert report.error is None
    assert sorted(p.platform for p in report.platforms) == ["linux/amd64", "linux/arm64/v8"]
    assert stats.requests <= 2 + 2 * 2  # HEAD, index, then manifest + config per platform
    assert all(p.gpu.cuda_version == "12.4" for p in report.platforms)


async def test_platform_flag_limits_the_scan(scanner: Scanner, samples: dict[str, str]) -> None:
    report = await scanner.scan(
        samples["samples/multi-arch:12.4"], ScanOptions(platform=Platform.parse("linux/arm64"))
    )
    assert [p.platform for p in report.platforms] == ["linux/arm64/v8"]
    assert report.platforms[0].libc.evidence and "aarch64" in report.platforms[0].libc.evidence
    missing = await scanner.scan(
        samples["samples/multi-arch:12.4"], ScanOptions(platform=Platform.parse("linux/s390x"))
    )
    assert missing.error and "linux/s390x" in missing.error and "linux/amd64" in missing.error


async def test_request_budget_and_digest_reuse(scanner: Scanner, samples: dict[str, str]) -> None:
    ref = samples["samples/plain-glibc:22.04"]
    first = await scanner.scan(ref, ScanOptions(config_only=True))
    assert first.requests <= 3 and not first.cached
    again = await scanner.scan(ref, ScanOptions(config_only=True))
    assert again.cached and again.requests == 1  # HEAD only, the report is reused
    assert again.digest == first.digest
    by_digest = await scanner.scan(f"{ref.split(':22.04')[0]}@{first.digest}", ScanOptions(config_only=True))
    assert by_digest.cached and by_digest.requests == 0


async def test_with_a_store_a_tag_never_seen_costs_no_head_and_is_stored_with_its_report(
    scanner: Scanner, samples: dict[str, str]
) -> None:
    from store import queries
    from store.facade import StoreScanCache

    ref = samples["samples/cuda-ubuntu:12.2"]
    first = await scanner.scan(ref, ScanOptions(config_only=True))
    assert first.error is None and not first.cached
    assert first.requests == 2  # the manifest by tag (a HEAD would only have preceded it), the config
    assert isinstance(scanner.store, StoreScanCache) and first.digest is not None
    store = scanner.store.store
    # the report and its tag were one write: the tag resolves to the stored report's digest
    assert (
        await store.run(queries.resolve_tag, first.registry or "", first.repository or "", "12.2")
        == first.digest
    )
    assert await store.run(queries.report, first.digest) is not None
    again = await scanner.scan(ref, ScanOptions(config_only=True))
    assert again.cached and again.requests == 1  # a tag seen before: HEAD, and the report is reused


async def test_without_a_store_a_tag_costs_two_requests(samples: dict[str, str]) -> None:
    settings = ScannerSettings(docker_config=None)
    async with RegistryClient(settings) as client:
        report = await Scanner(client, None, settings).scan(
            samples["samples/plain-glibc:22.04"], ScanOptions(config_only=True)
        )
    assert report.error is None and report.requests == 2  # manifest by tag (verified), config


async def test_large_layer_stops_early(scanner: Scanner, registry: LocalRegistry, push: Pusher) -> None:
    """Evidence at the front of a 40 MiB layer: the read stops there. The layer is asked for in growing
    ranges, so the registry sends one small range, and `bytes_read` counts all of it."""
    push(catalog.large_layer_early_evidence(megabytes=40), "samples/large:1")
    report = await scanner.scan(f"{registry.host}/samples/large:1")
    platform = report.platforms[0]
    libc = platform.libc
    assert libc.flavour == "glibc"
    assert libc.bytes_total > 40 * 1024 * 1024
    assert 0 < libc.bytes_read <= 0.05 * libc.bytes_total, (libc.bytes_read, libc.bytes_total)
    assert platform.bytes_fetched >= libc.bytes_read and report.bytes_fetched >= platform.bytes_fetched


async def test_what_the_caller_read_for_the_digest_is_not_read_again(
    scanner: Scanner, registry: LocalRegistry, push: Pusher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service's workers read what the store holds for a job's digest with the job's claim
    (`ScanOptions.stored`): the scan takes it, with no read of its own, and reuses the report."""
    push(ImageSpec([catalog.ubuntu_base()]), "samples/given:1")
    first = await scanner.scan(f"{registry.host}/samples/given:1")
    assert first.error is None and first.digest is not None
    assert scanner.store is not None
    stored = await scanner.store.stored(first.digest)
    reads: list[str] = []
    read = scanner.store.stored

    async def counted(digest: str) -> tuple[ImageReport | None, object]:
        reads.append(digest)
        return await read(digest)

    monkeypatch.setattr(scanner.store, "stored", counted)
    by_digest = f"{registry.host}/samples/given:1@{first.digest}"
    again = await scanner.scan(by_digest, ScanOptions(stored=stored))
    assert again.cached and again.digest == first.digest and reads == []
    fresh = await scanner.scan(by_digest)  # nothing given: the scan reads it itself
    assert fresh.cached and reads == [first.digest]


async def test_shared_base_layer_is_read_once(
    scanner: Scanner, registry: LocalRegistry, push: Pusher
) -> None:
    base = catalog.ubuntu_base()
    push(ImageSpec([base, LayerSpec([file("one/app", "1")])]), "samples/shared-a:1")
    push(ImageSpec([base, LayerSpec([file("two/app", "2")])]), "samples/shared-b:1")
    first = (await scanner.scan(f"{registry.host}/samples/shared-a:1")).platforms[0]
    second = (await scanner.scan(f"{registry.host}/samples/shared-b:1")).platforms[0]
    base_size = first.layers[0].size
    assert first.libc.bytes_read >= base_size
    assert second.libc.bytes_read < base_size  # only its own top layer was fetched
    assert second.libc.flavour == "glibc"


async def test_a_jobs_facts_are_stored_at_once_when_its_layers_take_a_while_and_wait_when_they_are_small(
    registry: LocalRegistry, push: Pusher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pending badge is what users see while a big image's layers are read: stored before the
    read starts. A small image's facts wait for the store's next write (its final report, moments
    later, takes their place)."""
    from scanner import scan as scan_module

    push(ImageSpec([catalog.ubuntu_base()]), "samples/facts-big:1")
    push(ImageSpec([catalog.alpine_base()]), "samples/facts-small:1")
    settings = ScannerSettings(docker_config=None, analysis_processes=0)
    database = tmp_path / "scan.db"
    store = open_store(database)
    other = SqliteStore(database)  # another process's view: only what is committed
    stored_when_published: dict[str, bool] = {}
    try:
        async with RegistryClient(settings) as client:
            scanner = Scanner(client, store.scan_cache, settings, publish_facts=True)
            for name in ("facts-big", "facts-small"):
                reference = f"{registry.host}/samples/{name}:1"
                digest = (await client.resolve(parse_reference(reference))).digest
                size = (await client.manifest(parse_reference(reference), digest)).layers[0].size
                # the big image's one layer is past the bound, the small one's within it
                monkeypatch.setattr(
                    scan_module, "QUICK_READ_BYTES", size - 1 if name == "facts-big" else size
                )

                def published(name: str = name, digest: str = digest) -> None:
                    stored_when_published[name] = other.run(queries.report, digest) is not None

                report = await scanner.scan(reference, ScanOptions(job=f"job-{name}", on_facts=published))
                assert report.error is None and not report.pending
    finally:
        other.close()
        await store.close()
    assert stored_when_published == {"facts-big": True, "facts-small": False}


async def test_the_cache_entries_of_an_images_layers_are_read_in_one_go(
    registry: LocalRegistry, push: Pusher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deep scan needs every layer: an image whose lower layers another process has read asks the
    store for their entries once, not once per layer, and fetches only its own top layer."""
    base = [catalog.ubuntu_base(), LayerSpec([file("opt/one/a", "1")]), LayerSpec([file("opt/two/b", "2")])]
    push(ImageSpec([*base, catalog.app_layer("first")]), "samples/layered-a:1")
    push(ImageSpec([*base, catalog.app_layer("second")]), "samples/layered-b:1")
    settings = ScannerSettings(docker_config=None, deep_scan="always", analysis_processes=0)
    database = tmp_path / "scan.db"
    async with RegistryClient(settings) as client:
        store = open_store(database)
        try:
            first = await Scanner(client, store.scan_cache, settings).scan(
                f"{registry.host}/samples/layered-a:1"
            )
        finally:
            await store.close()  # commits the layers' entries
        other = open_store(database)  # another process: nothing of them in its memory
        reads: list[str] = []
        run = other.run

        async def counted(query: Any, *args: Any, **kwargs: Any) -> Any:
            if query is queries.layer_evidence:
                reads.append("one layer")
            elif query is queries.layer_evidences:
                reads.append("the image's layers")
            return await run(query, *args, **kwargs)

        monkeypatch.setattr(other, "run", counted)
        try:
            second = await Scanner(client, other.scan_cache, settings).scan(
                f"{registry.host}/samples/layered-b:1"
            )
        finally:
            await other.close()
    assert first.error is None and second.error is None, (first.error, second.error)
    assert second.platforms[0].libc.flavour == "glibc"
    assert reads == ["the image's layers"]  # one read for four layers
    platform = second.platforms[0]
    assert platform.libc.bytes_read == platform.layers[-1].size  # only its own top layer was fetched


async def test_real_cuda_require_strings_parse(
    scanner: Scanner, registry: LocalRegistry, push: Pusher
) -> None:
    images = catalog.cuda_images()
    for position, image in enumerate(images[:6]):
        push(
            catalog.cuda_ubuntu(image["NVIDIA_REQUIRE_CUDA"], image["cuda_version"]),
            f"samples/cuda-real:{position}",
        )
    for position, image in enumerate(images[:6]):
        report = await scanner.scan(
            f"{registry.host}/samples/cuda-real:{position}", ScanOptions(config_only=True)
        )
        gpu = report.platforms[0].gpu
        assert gpu.required and gpu.requirement_errors == []
        assert gpu.cuda_version == ".".join(image["cuda_version"].split(".")[:2])


async def test_a_corrupt_layer_is_named_on_its_platform_and_the_facts_stand(
    scanner: Scanner, registry: LocalRegistry, tmp_path: Path
) -> None:
    layout = LayoutWriter(tmp_path / "corrupt")
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {}, "rootfs": {"type": "layers"}})
    garbage = b"\x1f\x8b\x08\x00" + b"not really gzip" * 40
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": layout.descriptor("application/vnd.oci.image.config.v1+json", config.encode()),
        "layers": [layout.descriptor("application/vnd.oci.image.layer.v1.tar+gzip", garbage)],
    }
    descriptor = layout.descriptor(
        "application/vnd.oci.image.manifest.v1+json", json.dumps(manifest).encode()
    )
    layout.tag(descriptor, "bad")
    push_layout(tmp_path / "corrupt", "bad", f"{registry.host}/samples/corrupt:1")
    report = await scanner.scan(f"{registry.host}/samples/corrupt:1")
    (platform,) = report.platforms
    assert report.error is None and report.retryable is False  # the same bytes fail the same way
    assert platform.error and platform.error.startswith("corrupt layer:"), platform.error
    assert platform.libc.flavour == "unknown" and platform.config_digest is not None
    assert scanner.store is not None
    stored = await scanner.store.report(descriptor["digest"])
    assert stored is not None and stored.platforms[0].error == platform.error


async def test_missing_image_and_bad_reference(scanner: Scanner, registry: LocalRegistry) -> None:
    missing = await scanner.scan(f"{registry.host}/samples/nope:1")
    assert missing.error and "not found" in missing.error.lower()
    bad = await scanner.scan("Upper/Case")
    assert bad.error and "lowercase" in bad.error and bad.requests == 0


def _cli(*args: str, db: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", "scan", "--db", str(db), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_json_contract_and_exit_codes(samples: dict[str, str], tmp_path: Path) -> None:
    db = tmp_path / "cli.db"
    ok = _cli("--json", samples["samples/alpine-gpu:3.20"], samples["samples/multi-arch:12.4"], db=db)
    assert ok.returncode == 0, ok.stderr
    lines = [json.loads(line) for line in ok.stdout.splitlines()]
    assert len(lines) == 2
    for line in lines:
        assert {"reference", "digest", "error", "platforms"} <= set(line)
        for platform in line["platforms"]:
            assert {"platform", "digest", "gpu", "libc", "badges"} <= set(platform)
            assert {"required", "cuda_version", "requirements", "env"} <= set(platform["gpu"])
            assert {"flavour", "evidence", "distro"} <= set(platform["libc"])
    failed = _cli(samples["samples/static:1"], f"{samples['samples/static:1']}-missing", db=db)
    assert failed.returncode == 1
    assert "no libc" in failed.stdout or "none" in failed.stdout
    assert failed.stderr.count("\n") == 1 and "missing" in failed.stderr
    usage = _cli("--platform", "linux", samples["samples/static:1"], db=db)
    assert usage.returncode == 2


def test_cli_prints_each_report_once_stored_and_fails_when_a_commit_fails(
    samples: dict[str, str], tmp_path: Path
) -> None:
    import sqlite3

    refs = [
        samples["samples/alpine-gpu:3.20"],
        samples["samples/multi-arch:12.4"],
        samples["samples/static:1"],
    ]
    db = tmp_path / "cli.db"
    ok = _cli("--json", *refs, db=db)
    assert ok.returncode == 0, ok.stderr
    printed = [json.loads(line)["digest"] for line in ok.stdout.splitlines()]
    with contextlib.closing(sqlite3.connect(db)) as conn:
        stored = {row[0] for row in conn.execute("SELECT digest FROM reports")}
        tags = {row[0] for row in conn.execute("SELECT tag FROM tags WHERE gone_at IS NULL")}
    assert len(printed) == 3 and set(printed) <= stored  # every printed report is in the store
    assert tags == {ref.rsplit(":", 1)[1] for ref in refs}

    # A store that refuses every report (as a full disk would): nothing is claimed stored.
    broken = tmp_path / "broken.db"
    assert _cli("--json", refs[0], db=broken).returncode == 0  # created and migrated
    with contextlib.closing(sqlite3.connect(broken)) as conn, conn:
        conn.execute("DELETE FROM reports")
        conn.execute("DELETE FROM platform_reports")
        conn.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON reports BEGIN SELECT RAISE(ABORT, 'disk is full'); END"
        )
    failed = _cli("--json", *refs, db=broken)
    assert failed.returncode == 1
    assert failed.stderr.count("not stored") == 3 and "disk is full" in failed.stderr
    assert len(failed.stdout.splitlines()) == 3  # the scans' answers are still shown
