"""The web UI and SVG badges.

Part one drives the aiohttp app in-process over a Store filled with ImageReport
objects (fast, exact). Part two (`-m browser`) runs `gpubadge serve` as a real
process, scans images pushed by skopeo to the real test registry, and looks at the
pages with headless Chromium. (The README's screenshots come from `make run`, by
`python -m fixtures.screenshots`, not from these fixtures.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import SecretStr

from fixtures.oci import ImageSpec, LayerSpec, fake_elf, file
from fixtures.registry import LocalRegistry, free_port
from scanner.facts.badges import badges
from scanner.models import (
    ContainerArchs,
    FileArchs,
    GpuArchs,
    GpuFacts,
    ImageReport,
    InferredCuda,
    LibcFlavour,
    LibcVerdict,
    PlatformReport,
    RequirementIssue,
)
from store import EnqueueBatch, queries
from store import SqliteStore as Store
from store.backend import StoreBackend
from tests.conftest import Pusher
from web.app import create_app
from web.routes.pages import badge_reference
from web.settings import ServiceSettings
from web.state import SERVICES, Services
from web.views.image_views import (
    ImageFilters,
    explain_error,
    platform_view,
    requirement_view,
    row_badges,
    short_reference,
)
from web.views.templating import human_bytes, time_ago

XSS_SCRIPT = "<script>window.__xss=1</script>"
XSS_IMG = '<img src=x onerror="window.__xss=2">'
REQUIRE_CUDA = "cuda>=12.2 brand=tesla,driver>=470,driver<471"

# ------------------------------------------------------------------ builders


def make_report(
    registry: str,
    repository: str,
    tag: str,
    *,
    index: int = 0,
    gpu: bool = False,
    cuda: str | None = None,
    libc: LibcFlavour = "glibc",
    distro: str | None = "Ubuntu 22.04.4 LTS",
    env: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    platforms: tuple[str, ...] = ("linux/amd64",),
    scanned_at: datetime | None = None,
    requirement_errors: list[RequirementIssue] | None = None,
) -> ImageReport:
    """A report shaped like the scanner's, with a digest derived from its name."""
    base = f"{registry}/{repository}:{tag}#{index}".encode().hex()
    digest = "sha256:" + (base * 64)[:64]
    platform_reports = []
    for number, name in enumerate(platforms):
        facts = GpuFacts(
            required=gpu,
            cuda_version=cuda,
            env=env or {},
            labels=labels or {},
            signals=sorted((env or {}).keys())[:2] if gpu else [],
            requirements=[v for k, v in sorted((env or {}).items()) if k.startswith("NVIDIA_REQUIRE_")],
            requirement_errors=requirement_errors or [],
        )
        verdict = LibcVerdict(
            flavour=libc,
            evidence="/usr/bin/env: ELF interpreter /lib64/ld-linux-x86-64.so.2" if libc == "glibc" else None,
            distro=distro,
            layers_read=1,
            layers_total=3,
            bytes_read=123_456,
            bytes_total=9_876_543,
        )
        platform_reports.append(
            PlatformReport(
                platform=name,
                digest=digest[:-2] + f"{number:02d}",
                gpu=facts,
                libc=verdict,
                badges=badges(facts, verdict),
            )
        )
    return ImageReport(
        reference=f"{registry}/{repository}:{tag}",
        digest=digest,
        platforms=platform_reports,
        registry=registry,
        repository=repository,
        tag=tag,
        media_type="application/vnd.oci.image.index.v1+json",
        scanned_at=scanned_at or datetime.now(UTC),
    )


def save(store: StoreBackend, report: ImageReport) -> None:
    store.run(queries.save_report, report)
    assert report.registry and report.repository and report.tag and report.digest
    store.run(queries.record_tag, report.registry, report.repository, report.tag, report.digest)


GPU_IMAGE = make_report(
    "127.0.0.1:5000",
    "ml/trainer",
    "12.2",
    gpu=True,
    cuda="12.2",
    env={"NVIDIA_REQUIRE_CUDA": REQUIRE_CUDA, "CUDA_VERSION": "12.2.0", "NVIDIA_VISIBLE_DEVICES": "all"},
    platforms=("linux/amd64", "linux/arm64"),
)
MUSL_IMAGE = make_report(
    "127.0.0.1:5000", "tools/alpine-cli", "3.20", libc="musl", distro="Alpine Linux v3.20"
)
STATIC_IMAGE = make_report("ghcr.io", "acme/static", "1", libc="none", distro=None)
XSS_IMAGE = make_report(
    "127.0.0.1:5000",
    "evil/app",
    "1",
    gpu=True,
    env={"NVIDIA_VISIBLE_DEVICES": XSS_SCRIPT, "NVIDIA_REQUIRE_X": "cuda>=oops"},
    labels={"com.nvidia.note": XSS_IMG},
    distro=XSS_SCRIPT,
    requirement_errors=[RequirementIssue(variable="NVIDIA_REQUIRE_X", value="cuda>=oops", error="bad <b>")],
)


@pytest.fixture
async def app_client(tmp_path: Path) -> AsyncIterator[tuple[TestClient[Any, Any], Services]]:
    settings = ServiceSettings(db=tmp_path / "ui.db", api_token=SecretStr("s3cret"))
    app = create_app(settings, start_workers=False)
    async with TestClient(TestServer(app)) as client:
        yield client, app[SERVICES]


# ------------------------------------------------------------- pure helpers


def test_human_bytes_and_relative_times() -> None:
    assert human_bytes(0) == "0 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(9_876_543) == "9.41 MiB"  # placement.sizes: two decimals, rounded down
    assert human_bytes(23028 * 1024**2) == "22.48 GiB"
    now = datetime(2026, 1, 1, 12, tzinfo=UTC)
    assert time_ago((now - timedelta(seconds=5)).isoformat(), now) == "just now"
    assert time_ago((now - timedelta(minutes=3)).isoformat(), now) == "3 min ago"
    assert time_ago((now - timedelta(days=2)).isoformat(), now) == "2 d ago"


def test_errors_are_explained_in_plain_words() -> None:
    assert "no such image" in explain_error(
        "GET 127.0.0.1:5000/v2/x/manifests/1: not found (MANIFEST_UNKNOWN)"
    )
    assert "refused access" in explain_error("GET r/v2/: access denied (401) anonymously")
    assert "could not be reached" in explain_error("GET r/v2/: Connection refused")
    assert explain_error(None) == "The scan failed without a message."


def test_requirement_view_lays_out_alternatives_and_conditions() -> None:
    view = requirement_view("NVIDIA_REQUIRE_CUDA", REQUIRE_CUDA)
    assert [[c.words for c in alt] for alt in view.alternatives] == [
        ["driver CUDA at least 12.2"],
        ["brand is tesla", "driver at least 470", "driver below 471"],
    ]
    broken = requirement_view("NVIDIA_REQUIRE_X", "cuda>=12 foo=bar")
    assert broken.errors and "unknown key" in broken.errors[0]
    assert broken.alternatives[1][0].error is not None


def test_platform_view_adds_the_legacy_derived_requirement() -> None:
    facts = GpuFacts(
        required=True,
        cuda_version="11.0",
        legacy=True,
        env={"CUDA_VERSION": "11.0.3"},
        effective_requirements=["cuda>=11.0"],
    )
    view = platform_view(PlatformReport(platform="linux/amd64", digest="sha256:" + "0" * 64, gpu=facts))
    assert [(r.variable, r.value, r.derived) for r in view.requirements] == [
        ("CUDA_VERSION (legacy image)", "cuda>=11.0", True)
    ]


def test_listing_rows_show_what_the_layers_found() -> None:
    from store import ImageRow

    def row(gpu: bool, cuda: list[str], found: list[str]) -> list[str]:
        image = ImageRow(
            "sha256:" + "a" * 64,
            "r",
            "app",
            "r/app:1",
            gpu,
            cuda,
            ["glibc"],
            ["linux/amd64"],
            None,
            "2026-01-01T00:00:00+00:00",
            ["1"],
            found,
        )
        return [badge.text for badge in row_badges(image)]

    assert row(False, [], []) == ["CPU only", "glibc"]
    assert row(False, [], ["cuda-12.1-inferred", "glibc"]) == ["GPU optional", "CUDA 12.1 inside", "glibc"]
    newer = row(
        True, ["11.8"], ["nvidia-gpu", "cuda-11.8", "cuda-12.4-inferred", "cuda-newer-inside", "glibc"]
    )
    assert newer == [
        "NVIDIA GPU",
        "CUDA 11.8",
        "CUDA 12.4 inside",
        "carries a newer CUDA than declared: needs its driver",
        "glibc",
    ]
    older = row(True, ["12.4"], ["nvidia-gpu", "cuda-12.4", "cuda-11.8-inferred", "cuda-mismatch", "glibc"])
    assert "carries an older CUDA than declared" in older
    assert "requirement error" in row(True, ["12.2"], ["nvidia-gpu", "requirement-error"])


def test_badge_paths_and_filters_parse() -> None:
    assert str(badge_reference("127.0.0.1:5000/team/app/1.0")) == "127.0.0.1:5000/team/app:1.0"
    pinned = badge_reference("docker.io/library/alpine/sha256:" + "a" * 64)
    assert pinned.digest == "sha256:" + "a" * 64
    filters = ImageFilters.from_query({"gpu": "bogus", "cuda": "12; drop", "page": "x", "q": " ml "})
    assert (filters.gpu, filters.cuda, filters.page, filters.q) == ("", "", 1, "ml")
    assert ImageFilters(gpu="gpu", page=1).page_url(2) == "/?gpu=gpu&page=2"


# ----------------------------------------------------------- pages in-process


async def test_empty_state_tells_how_to_send_webhooks(
    app_client: tuple[TestClient[Any, Any], Services],
) -> None:
    client, _ = app_client
    response = await client.get("/")
    body = await response.text()
    assert response.status == 200
    assert "No images yet" in body
    assert f"POST http://{client.host}:{client.port}/hooks/distribution" in body
    assert "/api/scans" in body and "Authorization: Bearer" in body
    assert "script-src 'self'" in response.headers["Content-Security-Policy"]
    for nav in ('href="/scans"', 'href="/servers"', 'href="/eligibility"'):
        assert nav in body


async def test_images_page_shows_badges_and_filters(
    app_client: tuple[TestClient[Any, Any], Services],
) -> None:
    client, services = app_client
    for report in (GPU_IMAGE, MUSL_IMAGE, STATIC_IMAGE):
        save(services.store.backend, report)
    backend = services.store.backend
    backend.enqueue_many([EnqueueBatch([("127.0.0.1:5000/gone/app:1", "127.0.0.1:5000")], source="api")])
    (job,) = backend.claim_jobs(1, owner="test", lease_seconds=30)
    backend.fail_job(
        job.id, "GET 127.0.0.1:5000/v2/gone/app/manifests/1: not found", retry_in=None, owner="test"
    )

    body = await (await client.get("/")).text()
    for text in (
        "ml/trainer",
        "tools/alpine-cli",
        "acme/static",
        "NVIDIA GPU",
        "CUDA 12.2",
        "musl",
        "no libc",
    ):
        assert text in body
    assert "linux/arm64" in body and "Alpine Linux v3.20" in body
    assert "gone/app" in body and "The registry has no such image" in body  # failed scans, in words
    assert "What the badges mean" in body

    async def names(query: str) -> set[str]:
        text = await (await client.get("/?" + query)).text()
        return {
            n
            for n in ("ml/trainer", "tools/alpine-cli", "acme/static")
            if f'title="127.0.0.1:5000/{n}"' in text or f'title="ghcr.io/{n}"' in text
        }

    assert await names("gpu=gpu") == {"ml/trainer"}
    assert await names("gpu=cpu") == {"tools/alpine-cli", "acme/static"}
    assert await names("libc=musl") == {"tools/alpine-cli"}
    assert await names("libc=none") == {"acme/static"}
    assert await names("cuda=12") == {"ml/trainer"}
    assert await names("registry=ghcr.io") == {"acme/static"}
    assert await names("q=alpine") == {"tools/alpine-cli"}
    assert "No image matches these filters" in await (await client.get("/?cuda=9.9")).text()


async def test_pagination_keeps_filters(app_client: tuple[TestClient[Any, Any], Services]) -> None:
    client, services = app_client
    start = datetime(2026, 1, 1, tzinfo=UTC)
    for number in range(60):
        save(
            services.store.backend,
            make_report(
                "127.0.0.1:5000",
                f"bulk/n{number:02d}",
                "1",
                gpu=True,
                scanned_at=start + timedelta(seconds=number),
            ),
        )
    first = await (await client.get("/?gpu=gpu")).text()
    second = await (await client.get("/?gpu=gpu&page=2")).text()
    assert first.count('class="image-name"') == 50 and second.count('class="image-name"') == 10
    assert "page 1 of 2" in first and 'href="/?gpu=gpu&amp;page=2"' in first
    assert "bulk/n59" in first and "bulk/n00" in second


async def test_detail_page_shows_evidence_and_escapes_image_values(
    app_client: tuple[TestClient[Any, Any], Services],
) -> None:
    client, services = app_client
    save(services.store.backend, GPU_IMAGE)
    save(services.store.backend, XSS_IMAGE)

    response = await client.get("/images/127.0.0.1:5000/ml/trainer:12.2")
    body = await response.text()
    assert response.status == 200
    assert body.count('class="platform-card"') == 2
    assert "NVIDIA_REQUIRE_CUDA" in body and "cuda&gt;=12.2 brand=tesla,driver&gt;=470,driver&lt;471" in body
    assert "driver CUDA at least 12.2" in body and "driver below 471" in body and "Any one of:" in body
    assert "ELF interpreter /lib64/ld-linux-x86-64.so.2" in body and "Ubuntu 22.04.4 LTS" in body
    assert "1 of 3" in body and "120.56 KiB of 9.41 MiB" in body
    assert "/badge/127.0.0.1:5000/ml/trainer/12.2.svg" in body

    evil = await (await client.get("/images/127.0.0.1:5000/evil/app:1")).text()
    assert "<script>window" not in evil and "<img src=x" not in evil
    assert "&lt;script&gt;window.__xss=1&lt;/script&gt;" in evil
    assert "&lt;img src=x onerror=&#34;window.__xss=2&#34;&gt;" in evil
    assert "bad &lt;b&gt;" in evil  # requirement parse errors are shown, as warnings, escaped

    by_digest = await client.get(f"/images/127.0.0.1:5000/ml/trainer@{GPU_IMAGE.digest}")
    assert by_digest.status == 200 and "driver CUDA at least 12.2" in await by_digest.text()


async def test_a_pending_report_whose_scan_no_longer_runs_says_it_was_interrupted(
    app_client: tuple[TestClient[Any, Any], Services],
) -> None:
    """While the job reading the layers holds its lease the page says they are being read; once it
    does not (pre-empted, its worker gone), that the read was interrupted, with the Rescan button
    (and the token field the service asks for)."""
    client, services = app_client
    backend = services.store.backend
    (job_id,) = backend.enqueue([("127.0.0.1:5000/ml/pending:1", "127.0.0.1:5000")], source="test")
    (job,) = backend.claim_jobs(1, owner="worker-a", lease_seconds=60)
    pending = make_report("127.0.0.1:5000", "ml/pending", "1", gpu=True)
    platform = pending.platforms[0]
    platform.libc = LibcVerdict(state="pending", layers_total=3, bytes_total=9_876_543)
    platform.pending_scan = job.id
    save(backend, pending.model_copy(update={"pending": True}))

    page = await (await client.get("/images/127.0.0.1:5000/ml/pending:1")).text()
    assert "Reading the layers." in page and "interrupted" not in page
    assert 'name="rescan" value="1"' in page and 'name="token" type="password"' in page
    assert backend.preempt_job(job_id, owner="worker-a")
    page = await (await client.get("/images/127.0.0.1:5000/ml/pending:1")).text()
    assert "The layer read was interrupted." in page and "Reading the layers." not in page


async def test_a_report_an_older_analysis_wrote_says_so_with_the_rescan_button(
    app_client: tuple[TestClient[Any, Any], Services],
) -> None:
    client, services = app_client
    report = make_report("127.0.0.1:5000", "ml/older", "1", gpu=True)
    save(services.store.backend, report)
    page = await (await client.get("/images/127.0.0.1:5000/ml/older:1")).text()
    assert "older gpubadge analysis" not in page
    older = report.model_copy(
        update={"platforms": [p.model_copy(update={"analysis": 0}) for p in report.platforms]}
    )
    save(services.store.backend, older)
    services.store.report_lookups.forget()  # as a store event from the process that saved it would
    page = await (await client.get("/images/127.0.0.1:5000/ml/older:1")).text()
    assert "Read by an older gpubadge analysis." in page and 'name="rescan" value="1"' in page


async def test_the_image_page_shows_its_repositorys_newest_tag_events(
    app_client: tuple[TestClient[Any, Any], Services],
) -> None:
    """A CI repository may tag every commit: the page lists the newest TAG_HISTORY_ROWS events and says so."""
    from store.queries.tags import TagSeen
    from web.routes.pages import TAG_HISTORY_ROWS

    client, services = app_client
    report = make_report("127.0.0.1:5000", "ci/busy", "commit-0", gpu=True)
    save(services.store.backend, report)
    events = [TagSeen("127.0.0.1:5000", "ci/busy", f"commit-{n}", f"sha256:{n:064x}") for n in range(1, 151)]
    services.store.backend.run(queries.record_tags, events)
    page = await (await client.get("/images/127.0.0.1:5000/ci/busy:commit-0")).text()
    history = page[page.index('id="history-title"') :]
    assert history.count('<a class="tag"') == TAG_HISTORY_ROWS
    assert ">commit-150<" in history and ">commit-51<" in history and ">commit-50<" not in history
    assert (
        f"The newest {TAG_HISTORY_ROWS} tag events of this repository; older ones are not shown." in history
    )


# The requirement of nvidia/cuda:12.8.1-runtime-ubuntu24.04 (21 clauses), as Docker Hub serves it.
REQUIRE_CUDA_128 = "cuda>=12.8 " + " ".join(
    f"brand={brand},driver>={major},driver<{major + 1}"
    for major in (470, 535, 550, 560, 565)
    for brand in ("unknown", "grid", "tesla", "nvidia")
)


async def test_image_page_says_what_it_declares_carries_and_where_its_code_runs(
    app_client: tuple[TestClient[Any, Any], Services],
) -> None:
    """Issue 29: CUDA and GPU code at a glance; the brand clauses in one line, the raw value one click away."""
    client, services = app_client
    report = make_report(
        "127.0.0.1:5000",
        "ml/cu130",
        "1",
        gpu=True,
        cuda="12.8",
        env={"CUDA_VERSION": "12.8.1", "NVIDIA_REQUIRE_CUDA": REQUIRE_CUDA_128},
    )
    torch = "/usr/lib/python3/dist-packages/torch/version.py: torch 2.9.1+cu130, cuda = '13.0'"
    lib = "/usr/lib/python3/dist-packages/torch/lib/libtorch_cuda.so"
    gpu = report.platforms[0].gpu.model_copy(
        update={
            "inferred": InferredCuda(cuda="13.0", set_by=torch, evidence=[torch], sources=["torch"]),
            "archs": GpuArchs(
                sass=["50", "60", "70", "75", "80", "86", "90", "90a"],
                files=[
                    FileArchs(
                        path=lib,
                        containers=[
                            ContainerArchs(sass=("50", "60", "70", "75", "80", "86", "90"), count=40),
                            ContainerArchs(sass=("90a",)),
                        ],
                    )
                ],
            ),
        }
    )
    report.platforms[0] = report.platforms[0].model_copy(update={"gpu": gpu})
    save(services.store.backend, report)
    body = await (await client.get("/images/127.0.0.1:5000/ml/cu130:1")).text()
    # the answer in placement.image_needs' words: the carried CUDA 13.0 sets the floor, not the 12.8
    assert (
        "Needs an NVIDIA GPU with driver ≥ 580: it declares CUDA 12.8 and carries CUDA 13.0 (torch 2.9.1+cu130)"
        in body
    )
    assert "GPU code for sm_50–sm_90, no PTX: compute capability 7.5–9.0" in body  # CUDA 13: 7.5 and newer
    assert "Needs driver CUDA at least 12.8; or, on an older driver, one of 20 brand exceptions" in body
    raw = REQUIRE_CUDA_128.replace(">", "&gt;").replace("<", "&lt;")
    assert body.count(raw) == 1  # once, inside <details>: not in the environment table too
    assert body.index('<details class="raw-requirement">') < body.index(raw)


async def test_unscanned_image_is_a_404_with_the_scan_form(
    app_client: tuple[TestClient[Any, Any], Services],
) -> None:
    client, services = app_client
    response = await client.get("/images/127.0.0.1:5000/not/yet:1")
    body = await response.text()
    assert response.status == 404
    assert "has not been scanned yet" in body and 'action="/scans"' in body and 'name="token"' in body
    services.store.backend.enqueue_many(
        [EnqueueBatch([("127.0.0.1:5000/not/yet:1", "127.0.0.1:5000")], source="api")]
    )
    body = await (await client.get("/images/127.0.0.1:5000/not/yet:1")).text()
    assert "A scan is queued" in body
    bad = await client.get("/images/UPPER/Case:1")
    assert bad.status == 400 and "repository" in (await bad.text()).lower()


async def test_scan_form_checks_token_and_allowlist_then_redirects(
    app_client: tuple[TestClient[Any, Any], Services],
) -> None:
    client, services = app_client
    ref = "127.0.0.1:5000/team/app:1.0"
    wrong = await client.post("/scans", data={"ref": ref, "token": "nope"}, allow_redirects=False)
    assert wrong.status == 401 and "not valid" in await wrong.text()
    assert services.store.backend.run(queries.jobs) == []
    refused = await client.post(
        "/scans", data={"ref": "evil.example.com/x:1", "token": "s3cret"}, allow_redirects=False
    )
    assert refused.status == 403 and "allowlist" in await refused.text()
    api_refused = await client.post(
        "/api/scans", json={"ref": "evil.example.com/x:1"}, headers={"Authorization": "Bearer s3cret"}
    )
    assert api_refused.status == 403  # the JSON API applies the same shared rule
    assert (await api_refused.json())["error"] in await refused.text()
    malformed = await client.post("/scans", data={"ref": "a b", "token": "s3cret"}, allow_redirects=False)
    assert malformed.status == 400
    assert services.store.backend.run(queries.jobs) == []
    accepted = await client.post("/scans", data={"ref": ref, "token": "s3cret"}, allow_redirects=False)
    assert accepted.status == 303 and accepted.headers["Location"] == "/scans"
    (job,) = services.store.backend.run(queries.jobs)
    assert (job.reference, job.source, job.state) == (ref, "ui", "queued")
    page = await (await client.get("/scans")).text()
    assert ref in page and "1 queued" in page


async def test_badge_endpoint_serves_cacheable_svg(app_client: tuple[TestClient[Any, Any], Services]) -> None:
    client, services = app_client
    save(services.store.backend, GPU_IMAGE)
    response = await client.get("/badge/127.0.0.1:5000/ml/trainer/12.2.svg")
    assert response.status == 200
    assert response.headers["Content-Type"] == "image/svg+xml; charset=utf-8"
    assert response.headers["Cache-Control"] == "max-age=300, public"
    root = ET.fromstring(await response.text())
    assert root.findtext("{http://www.w3.org/2000/svg}title") == "nvidia gpu: cuda 12.2"
    again = await client.get(
        "/badge/127.0.0.1:5000/ml/trainer/12.2.svg", headers={"If-None-Match": response.headers["ETag"]}
    )
    assert again.status == 304
    missing = await client.get("/badge/127.0.0.1:5000/ml/trainer/9.svg")
    assert missing.headers["Cache-Control"] == "no-cache"
    assert (
        ET.fromstring(await missing.text()).findtext("{http://www.w3.org/2000/svg}title")
        == "gpu: not scanned"
    )


# ------------------------------------------------------------------ a big store
# Render time is a benchmark (bench/ui_bench.py), not a timed test; this checks the pages work at size.


@pytest.fixture(scope="module")
def big_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10,000 scanned images over three registries, a quarter of them GPU images."""
    path = tmp_path_factory.mktemp("big") / "big.db"
    store = Store(path)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    batch: list[queries.ScanWrite] = []
    for number in range(10_000):
        registry = ("127.0.0.1:5000", "ghcr.io", "docker.io")[number % 3]
        gpu = number % 4 == 0
        report = make_report(
            registry,
            f"team{number % 50}/app{number}",
            "latest",
            gpu=gpu,
            cuda=f"12.{number % 6}" if gpu else None,
            libc=("glibc", "musl", "none")[number % 3],
            env={"NVIDIA_REQUIRE_CUDA": REQUIRE_CUDA} if gpu else {},
            scanned_at=start + timedelta(seconds=number),
        )
        assert report.registry and report.repository and report.tag and report.digest
        batch += [report, queries.TagSeen(report.registry, report.repository, report.tag, report.digest)]
        if len(batch) == 2_000:  # the store's group commit, as the scan workers write: one per 1,000
            store.run(queries.save_scan_results, batch)
            batch = []
    store.close()
    return path


async def test_pages_work_with_10000_images(big_store: Path) -> None:
    app = create_app(ServiceSettings(db=big_store), start_workers=False)
    async with TestClient(TestServer(app)) as client:
        first = await (await client.get("/")).text()
        assert "team49/app9999" in first  # newest first
        deep = await client.get("/?page=150")
        assert deep.status == 200 and "team" in await deep.text()
        filtered = await (await client.get("/?gpu=gpu&libc=glibc&cuda=12.0")).text()
        shown = {int(number) for number in re.findall(r"team\d+/app(\d+)", filtered)}
        assert shown and all(number % 12 == 0 for number in shown)  # GPU, glibc and CUDA 12.0: every 12th
        for url in ("/?q=app99", "/images/127.0.0.1:5000/team0/app0:latest", "/scans"):
            response = await client.get(url)
            assert response.status == 200, url
        badge = await client.get("/badge/127.0.0.1:5000/team0/app0/latest.svg")
        assert badge.status == 200 and "cuda 12.0" in await badge.text()


# ===================================================================== browser


@dataclass
class RunningService:
    url: str
    process: subprocess.Popen[str]
    log: list[str]

    def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=15) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()

    def post_json(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=15) as response:
            result: dict[str, Any] = json.loads(response.read())
            return result

    def scan(self, reference: str) -> dict[str, Any]:
        """POST /api/scans, then long-poll the job until it settles (bounded)."""
        job = self.post_json("/api/scans", {"ref": reference})
        deadline = time.monotonic() + 60
        while job["state"] in ("queued", "running") and time.monotonic() < deadline:
            _, _, body = self.get(f"/api/scans/{job['id']}?wait=10")
            job = json.loads(body)
        assert job["state"] == "done", (job, self.log[-20:])
        return job


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    """`gpubadge serve` as its own process on a free loopback port."""
    port = free_port()
    database = tmp_path_factory.mktemp("service") / "gpubadge.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUBADGE_")}
    env["GPUBADGE_INTAKE_PORT"] = str(free_port())  # not the host's one 8081 (the first-hour demo's default)
    process = subprocess.Popen(
        [sys.executable, "-m", "gpubadge.cli", "serve", "--port", str(port), "--db", str(database)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
    )
    log: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            log.append(line)
            if "Running on" in line:
                ready.set()
        ready.set()  # the process ended: stop waiting

    threading.Thread(target=drain, daemon=True).start()
    try:
        assert ready.wait(30) and process.poll() is None, "".join(log)
        yield RunningService(f"http://127.0.0.1:{port}", process, log)
    finally:
        process.terminate()
        process.wait(timeout=30)


def ubuntu_cuda(arch: str) -> ImageSpec:
    loader = "/lib64/ld-linux-x86-64.so.2" if arch == "amd64" else "/lib/ld-linux-aarch64.so.1"
    return ImageSpec(
        layers=[
            LayerSpec([file("usr/share/doc/README", "base layer\n")]),
            LayerSpec(
                [
                    file(
                        "etc/os-release", 'PRETTY_NAME="Ubuntu 22.04.4 LTS"\nID=ubuntu\nVERSION_ID="22.04"\n'
                    ),
                    file(loader.lstrip("/"), fake_elf(None, arch)),
                    file("usr/bin/env", fake_elf(loader, arch)),
                ]
            ),
            LayerSpec([file("opt/app/train.py", "print('hi')\n")]),
        ],
        env={
            "PATH": "/usr/local/cuda/bin:/usr/bin:/bin",
            "CUDA_VERSION": "12.2.2",
            "NVIDIA_REQUIRE_CUDA": REQUIRE_CUDA,
            "NVIDIA_VISIBLE_DEVICES": "all",
            "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
        },
        labels={"com.nvidia.volumes.needed": "nvidia_driver"},
        architecture=arch,
        variant="v8" if arch == "arm64" else None,
    )


ALPINE = ImageSpec(
    layers=[
        LayerSpec(
            [
                file("etc/os-release", 'PRETTY_NAME="Alpine Linux v3.20"\nID=alpine\n'),
                file("lib/ld-musl-x86_64.so.1", fake_elf(None)),
                file("bin/busybox", fake_elf("/lib/ld-musl-x86_64.so.1")),
            ]
        )
    ],
    env={"PATH": "/bin"},
)
STATIC = ImageSpec(layers=[LayerSpec([file("app", fake_elf(None))])], env={"PATH": "/"})
EVIL = ImageSpec(
    layers=[
        LayerSpec(
            [file("etc/os-release", f'PRETTY_NAME="{XSS_SCRIPT}"\nID=evil\n'), file("app", fake_elf(None))]
        )
    ],
    env={"X": XSS_SCRIPT, "NVIDIA_VISIBLE_DEVICES": XSS_SCRIPT, "NVIDIA_REQUIRE_EVIL": "cuda>=1 <b>"},
    labels={"com.nvidia.note": XSS_IMG},
)


@dataclass
class Scanned:
    service: RunningService
    registry: str

    def ref(self, name: str) -> str:
        return f"{self.registry}/{name}"


@pytest.fixture(scope="module")
def scanned(service: RunningService, registry: LocalRegistry, push: Pusher) -> Scanned:
    """Images pushed with skopeo and scanned through the service's API."""
    pushes: dict[str, ImageSpec | list[ImageSpec]] = {
        "ml/trainer:12.2": [ubuntu_cuda("amd64"), ubuntu_cuda("arm64")],
        "tools/alpine-cli:3.20": ALPINE,
        "tools/static:1": STATIC,
        "evil/app:1": EVIL,
    }
    for name, spec in pushes.items():
        push(spec, name)
        service.scan(f"{registry.host}/{name}")
    return Scanned(service, registry.host)


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(10_000)
    try:
        yield context.new_page()
    finally:
        context.close()


def screenshot_path(name: str, tmp_path: Path) -> Path:
    """Where a test keeps its shot (docs/*.png come from `make run`: python -m fixtures.screenshots)."""
    return tmp_path / name


def names_of(page: Any) -> list[str]:
    """The listed images' full names (registry/repository: each row's link title)."""
    titles: list[str] = page.locator("table.images .image-name").evaluate_all("els => els.map(e => e.title)")
    return titles


@pytest.mark.browser
def test_images_page_shows_badges_and_filters_without_javascript(
    scanned: Scanned, browser: Any, tmp_path: Path
) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 900}, java_script_enabled=False)
    context.set_default_timeout(10_000)
    page = context.new_page()
    try:
        page.goto(scanned.service.url + "/")
        rows = page.locator("table.images tbody tr")
        assert rows.count() == 4
        trainer = rows.filter(has_text="ml/trainer")
        for text in ("NVIDIA GPU", "CUDA 12.2", "glibc"):
            assert trainer.locator(".badge", has_text=text).is_visible()
        assert trainer.get_by_text("linux/arm64/v8").is_visible()
        assert rows.filter(has_text="alpine-cli").locator(".badge", has_text="musl").is_visible()
        assert rows.filter(has_text="tools/static").locator(".badge", has_text="no libc").is_visible()
        assert page.get_by_role("heading", name="What the badges mean").is_visible()
        page.screenshot(path=str(screenshot_path("images.png", tmp_path)), full_page=True)

        page.select_option("select[name=gpu]", "gpu")
        page.get_by_role("button", name="Filter").click()
        page.wait_for_url("**/?gpu=gpu**")
        names = names_of(page)
        assert sorted(names) == sorted([scanned.ref("evil/app"), scanned.ref("ml/trainer")])

        page.goto(scanned.service.url + "/")
        page.select_option("select[name=libc]", "musl")
        page.fill("input[name=q]", "alpine")
        page.keyboard.press("Enter")
        page.wait_for_url("**q=alpine**")
        assert names_of(page) == [scanned.ref("tools/alpine-cli")]
    finally:
        context.close()


@pytest.mark.browser
def test_filter_dropdown_submits_itself_with_javascript(scanned: Scanned, page: Any) -> None:
    page.goto(scanned.service.url + "/")
    page.select_option("select[name=libc]", "none")
    page.wait_for_url("**libc=none**")
    names = names_of(page)
    assert sorted(names) == [scanned.ref("evil/app"), scanned.ref("tools/static")]


@pytest.mark.browser
def test_detail_page_shows_the_evidence(scanned: Scanned, page: Any, tmp_path: Path) -> None:
    page.goto(scanned.service.url + "/images/" + scanned.ref("ml/trainer:12.2"))
    cards = page.locator(".platform-card")
    assert cards.count() == 2
    amd64 = cards.filter(has=page.get_by_role("heading", name="linux/amd64"))
    env = amd64.locator("table.env")
    assert (
        env.locator("tr", has_text="NVIDIA_DRIVER_CAPABILITIES").locator("td").inner_text()
        == "compute,utility"
    )
    assert env.locator("tr", has_text="CUDA_VERSION").locator("td").inner_text() == "12.2.2"
    alternatives = amd64.locator("ol.alternatives > li")
    assert alternatives.count() == 2
    assert alternatives.nth(0).inner_text().strip() == "driver CUDA at least 12.2"
    assert alternatives.nth(1).locator(".condition").all_inner_texts() == [
        "brand is tesla",
        "driver at least 470",
        "driver below 471",
    ]
    libc = amd64.locator("section.libc")
    assert "/lib64/ld-linux-x86-64.so.2" in libc.locator(".evidence").inner_text()
    assert "Ubuntu 22.04.4 LTS" in libc.inner_text()
    assert "of 3" in libc.inner_text()
    badge = page.locator("img.svg-badge")
    assert badge.evaluate("img => img.complete && img.naturalWidth > 0")
    assert page.locator(".history tr.current").count() == 1
    page.screenshot(path=str(screenshot_path("detail.png", tmp_path)), full_page=True)


@pytest.mark.browser
def test_hostile_image_values_render_as_text(scanned: Scanned, page: Any) -> None:
    dialogs: list[str] = []

    def on_dialog(dialog: Any) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", on_dialog)
    for path in ("/", "/scans", "/images/" + scanned.ref("evil/app:1")):
        page.goto(scanned.service.url + path)
        assert page.evaluate("typeof window.__xss") == "undefined", path
    assert page.get_by_text(XSS_SCRIPT).first.is_visible()
    assert page.get_by_text(XSS_IMG).is_visible()
    assert page.locator("img[src=x]").count() == 0 and page.locator("main script").count() == 0
    assert dialogs == []


@pytest.mark.browser
def test_svg_badge_is_valid_and_renders(scanned: Scanned, page: Any) -> None:
    status, headers, body = scanned.service.get("/badge/" + scanned.ref("ml/trainer") + "/12.2.svg")
    assert status == 200 and headers["Content-Type"] == "image/svg+xml; charset=utf-8"
    assert ET.fromstring(body).findtext("{http://www.w3.org/2000/svg}title") == "nvidia gpu: cuda 12.2"
    _, _, cpu = scanned.service.get("/badge/" + scanned.ref("tools/alpine-cli") + "/3.20.svg")
    assert ET.fromstring(cpu).findtext("{http://www.w3.org/2000/svg}title") == "gpu: cpu only"
    page.goto(scanned.service.url + "/badge/" + scanned.ref("ml/trainer") + "/12.2.svg")
    assert page.evaluate("document.documentElement.localName") == "svg"
    box = page.locator("svg").bounding_box()
    assert box is not None and box["height"] == 20 and 100 < box["width"] < 160


@pytest.mark.browser
def test_scan_form_queues_and_redirects(scanned: Scanned, page: Any, push: Pusher) -> None:
    push(STATIC, "fresh/app:2")
    reference = scanned.ref("fresh/app:2")
    page.goto(scanned.service.url + "/images/" + reference)
    assert page.get_by_text("has not been scanned yet").is_visible()
    page.fill("input[name=ref]", reference)
    page.get_by_role("button", name="Scan").click()
    page.wait_for_url("**/scans")
    assert page.locator("table.jobs-table a", has_text=reference).first.is_visible()


@pytest.mark.browser
def test_the_image_page_rescans_the_image(scanned: Scanned, page: Any) -> None:
    """The image page's Rescan button queues a rescan: the job says so, and the image is read again
    (a new scan time) though its report was stored."""
    reference = scanned.ref("tools/static:1")
    lookup = f"/api/images/by-ref?ref={urllib.parse.quote(reference)}"
    before = json.loads(scanned.service.get(lookup)[2])["scanned_at"]
    page.goto(scanned.service.url + "/images/" + reference)
    page.get_by_role("button", name="Rescan").click()
    page.wait_for_url("**/scans")
    assert page.locator("table.jobs-table a", has_text=reference).first.is_visible()
    jobs = json.loads(scanned.service.get("/api/scans?limit=20")[2])["jobs"]
    job = next(job for job in jobs if job["reference"] == reference and job["rescan"])
    deadline = time.monotonic() + 60
    while job["state"] in ("queued", "running") and time.monotonic() < deadline:
        job = json.loads(scanned.service.get(f"/api/scans/{job['id']}?wait=10")[2])
    assert job["state"] == "done", job
    assert json.loads(scanned.service.get(lookup)[2])["scanned_at"] > before


@pytest.mark.browser
def test_desktop_scans_table_fits_and_the_favicon_is_served(
    scanned: Scanned, page: Any, push: Pusher
) -> None:
    """At 1280 px the scans table fits its box though a row names a digest (shortened, whole on
    hover and copy), and no page asks for anything that is missing (/favicon.ico included)."""
    digest = push(STATIC, "wide/app:1")
    reference = scanned.ref(f"wide/app@{digest}")
    scanned.service.scan(reference)
    missing: list[str] = []
    page.on("response", lambda response: missing.append(response.url) if response.status >= 400 else None)
    page.goto(scanned.service.url + "/scans")
    link = page.locator("table.jobs-table td.job-ref a", has=page.locator(f"text={digest[:19]}")).first
    assert link.get_attribute("title") == reference and link.get_attribute("data-copy") == reference
    assert link.inner_text() == short_reference(reference) and digest not in link.inner_text()
    sizes = page.evaluate(
        "() => { const w = document.querySelector('.table-wrap'), t = w.querySelector('table');"
        " return [t.getBoundingClientRect().width, w.clientWidth, document.documentElement.scrollWidth,"
        " window.innerWidth]; }"
    )
    table_width, box_width, page_width, viewport = sizes
    assert table_width <= box_width and page_width <= viewport, sizes
    headers = page.locator("table.jobs-table thead th").all()
    assert all(h.evaluate("h => h.scrollWidth <= h.clientWidth") for h in headers)  # none cut short
    page.locator("table.jobs-table button.copy").first.wait_for()
    for path in ("/", "/images/" + scanned.ref("ml/trainer:12.2")):
        page.goto(scanned.service.url + path)
    status, headers_, body = scanned.service.get("/favicon.ico")
    assert (
        status == 200
        and headers_["Content-Type"] in ("image/x-icon", "image/vnd.microsoft.icon")
        and body[:4] == b"\0\0\1\0"
    )
    assert missing == []


@pytest.mark.browser
def test_layers_from_the_cache_are_said_to_be(scanned: Scanned, page: Any, push: Pusher) -> None:
    """An image whose layers were read before for another image: read, from the cache, 0 B fetched."""
    twin = ImageSpec(layers=STATIC.layers, env={"PATH": "/", "TWIN": "1"})  # same layer, own config
    push(twin, "twin/static:1")
    scanned.service.scan(scanned.ref("twin/static:1"))
    page.goto(scanned.service.url + "/images/" + scanned.ref("twin/static:1"))
    layers = page.locator("section.libc .layers-read").inner_text()
    assert layers == "1 of 1: all from the layer cache (read before, no download)", layers
    assert page.locator("section.libc .bytes-read").inner_text().startswith("0 B of ")
    assert "(cached layers need none)" in page.locator("section.libc .bytes-read").inner_text()


@pytest.mark.browser
def test_phone_layout_lists_images_as_cards_without_sideways_scroll(scanned: Scanned, browser: Any) -> None:
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
    try:
        page = context.new_page()
        page.goto(scanned.service.url + "/")
        sizes = page.evaluate(
            "() => { const w = document.querySelector('.table-wrap');"
            " return [document.documentElement.scrollWidth, window.innerWidth, w.scrollWidth, w.clientWidth]; }"
        )
        page_width, viewport, table_width, wrap_width = sizes
        assert page_width <= viewport and table_width <= wrap_width  # neither the page nor the list scrolls
        assert page.locator("table.images thead").is_hidden()  # each row is a card, each cell labelled
    finally:
        context.close()
