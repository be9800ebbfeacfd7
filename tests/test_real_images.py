"""Images shaped like the ones people push (fixtures/real_shapes.py), scanned with the default settings.

A CUDA runtime image whose libraries layer inflates past 512 MiB, an image built on it, a Docker
official image's index (linux platforms with attestations, Windows entries, one with a foreign
base layer), and a pip-installed torch. They are generated from seeded data at test time, pushed
with skopeo into Debian's registry (which must allow loopback `urls` for the foreign layer), and the
bytes are counted where the registry sends them: in its access log, not by the scanner.
"""

from __future__ import annotations

import http.server
import subprocess
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from fixtures.oci import LAYER_MEDIA_TYPES, push_layout
from fixtures.real_shapes import (
    BigFile,
    CudaImage,
    MiB,
    OfficialIndex,
    ShapeWriter,
    WindowsShape,
    cuda_environment,
    cuda_runtime,
    debian_base,
    official_index,
    on_cuda,
    pip_torch,
)
from fixtures.registry import ACCESS_LOG, Access, LocalRegistry, logged, run_registry
from scanner.models import ImageReport
from scanner.registry.client import RegistryClient
from scanner.scan import Scanner
from scanner.settings import ScannerSettings
from store import AsyncStore, open_store

CUDA_LAYER_BYTES = 640 * MiB  # a quarter of the real one, past the old 512 MiB bound
URLS_ALLOWED = {"validation": {"manifests": {"urls": {"allow": [r"^https?://127\.0\.0\.1(:[0-9]+)?/"]}}}}


class _Listener(http.server.BaseHTTPRequestHandler):
    requests: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        _Listener.requests.append(self.path)
        self.send_response(404)
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture(scope="module")
def foreign_host() -> Iterator[tuple[str, list[str]]]:
    """Where foreign layers say they live: a local listener that records any request it gets."""
    _Listener.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Listener)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", _Listener.requests
    finally:
        server.shutdown()


@dataclass
class Shapes:
    registry: LocalRegistry
    cuda: CudaImage
    on_cuda_layer: str
    official: OfficialIndex
    windows_alone: str
    linux_and_windows: str
    nondistributable: str
    foreign_url: str
    foreign_requests: list[str]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory, foreign_host: tuple[str, list[str]]) -> Iterator[Shapes]:
    url, requests = foreign_host
    root = tmp_path_factory.mktemp("real-shapes")
    writer = ShapeWriter(root / "layout")
    cuda = cuda_runtime(writer, CUDA_LAYER_BYTES, "cuda-runtime")
    _, app = on_cuda(writer, cuda, 2 * MiB, "cuda-app")
    pip_torch(writer, 24 * MiB, "pip-torch")
    official = official_index(
        writer,
        "golang",
        platform_bytes=3 * MiB,
        platforms=("amd64", "arm64/v8", "s390x", "ppc64le"),
        windows=[
            WindowsShape("10.0.20348.2340", 12 * MiB, 4 * MiB),
            WindowsShape("10.0.17763.5576", 12 * MiB, 4 * MiB, foreign_url=f"{url}/windows-base"),
        ],
    )
    win = next(
        d
        for d in _children(writer, official.digest)
        if d.get("platform", {}).get("os.version") == "10.0.17763.5576"
    )
    windows_alone = str(win["digest"])
    linux_and_windows = writer.tag(writer.index([official.linux["linux/amd64"], win]), "linux-and-windows")
    base = writer.layer(debian_base("amd64", filler=2 * MiB, seed=5))
    top = writer.layer([BigFile("srv/data.bin", 1 * MiB, 6, 0o644)])
    plain = writer.image([base, top], foreign={base.digest: f"{url}/nondistributable"})
    nondistributable = writer.tag(plain, "nondistributable")
    with run_registry(extra_config={**ACCESS_LOG, **URLS_ALLOWED}) as registry:
        for tag in ("cuda-runtime", "cuda-app", "pip-torch", "golang", "linux-and-windows"):
            push_layout(writer.root, tag, f"{registry.host}/real/{tag}:1", timeout=600)
        # A Windows image on its own (a docker v2 manifest, which an OCI layout cannot tag): skopeo
        # copies it out of the index, registry to registry, leaving its foreign layer where it lives.
        subprocess.run(
            [
                "skopeo",
                "copy",
                "--quiet",
                "--preserve-digests",
                "--src-tls-verify=false",
                "--dest-tls-verify=false",
                f"docker://{registry.host}/real/golang@{windows_alone}",
                f"docker://{registry.host}/real/windows-foreign:1",
            ],
            check=True,
            timeout=120,
            capture_output=True,
        )
        push_layout(writer.root, "nondistributable", f"{registry.host}/real/nondistributable:1")
        yield Shapes(
            registry,
            cuda,
            app.digest,
            official,
            windows_alone,
            linux_and_windows,
            nondistributable,
            url,
            requests,
        )


def _children(writer: ShapeWriter, index_digest: str) -> list[dict[str, object]]:
    import json

    path = writer.root / "blobs" / "sha256" / index_digest.removeprefix("sha256:")
    manifests: list[dict[str, object]] = json.loads(path.read_bytes())["manifests"]
    return manifests


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[AsyncStore]:
    opened = open_store(tmp_path / "real.db")
    try:
        yield opened
    finally:
        await opened.close()


async def scan(reference: str, store: AsyncStore | None = None, **settings: object) -> ImageReport:
    """A scan with the defaults (analysis processes, deep scan auto, default platforms)."""
    configured = ScannerSettings(docker_config=None, **settings)  # type: ignore[arg-type]
    async with RegistryClient(configured) as client:
        scanner = Scanner(client, store.scan_cache if store else None, configured)
        try:
            return await scanner.scan(reference)
        finally:
            await scanner.close()


def blob_gets(lines: list[Access]) -> Counter[str]:
    """Blob digest -> GETs of it, as the registry logged them."""
    return Counter(
        line.path.rsplit("/", 1)[-1] for line in lines if line.method == "GET" and "/blobs/" in line.path
    )


def sent_per_blob(lines: list[Access]) -> Counter[str]:
    """Blob digest -> bytes the registry sent of it (over all its range requests)."""
    sent: Counter[str] = Counter()
    for line in lines:
        if line.method == "GET" and "/blobs/" in line.path:
            sent[line.path.rsplit("/", 1)[-1]] += line.size
    return sent


def blob_bytes(lines: list[Access]) -> int:
    return sum(line.size for line in lines if line.method == "GET" and "/blobs/" in line.path)


async def test_a_cuda_runtime_image_scans_to_glibc_with_the_defaults_and_the_next_image_reads_only_its_layer(
    shapes: Shapes, store: AsyncStore
) -> None:
    registry, cuda = shapes.registry, shapes.cuda
    assert cuda.inflated > 512 * MiB  # the old GPUBADGE_MAX_LAYER_BYTES gave up here
    with logged(registry, "cuda-first") as first_lines:
        report = await scan(f"{registry.host}/real/cuda-runtime:1", store)
    (platform,) = report.platforms
    assert report.error is None and platform.error is None, platform.error
    declared = ".".join(cuda_environment()["CUDA_VERSION"].split(".")[:2])
    assert platform.gpu.required and platform.gpu.cuda_version == declared
    assert platform.libc.flavour == "glibc" and platform.libc.state == "analysed"
    assert "glibc" in platform.badges and "nvidia-gpu" in platform.badges
    layers_total = sum(layer.size for layer in cuda.layers)
    sizes = {layer.digest: layer.size for layer in cuda.layers}
    sent = sent_per_blob(first_lines)
    assert all(sent[digest] <= size for digest, size in sizes.items()), sent  # no byte fetched twice
    assert blob_bytes(first_lines) <= 1.02 * layers_total  # a single-platform pull, and no more
    layer_digests = {layer.digest for layer in cuda.layers}
    layers_sent = sum(
        line.size
        for line in first_lines
        if line.method == "GET" and line.path.rsplit("/", 1)[-1] in layer_digests
    )
    # Never under the registry's own count. The default reads a declared image's layers whole too, once,
    # for the CUDA and GPU code it carries (GPUBADGE_DEEP_SCAN=always); the next image reads only its own.
    assert layers_sent <= platform.libc.bytes_read == layers_total
    assert platform.gpu.inferred is not None and platform.gpu.inferred.cuda is not None
    assert platform.libc.bytes_read < platform.bytes_fetched <= report.bytes_fetched

    with logged(registry, "cuda-next") as next_lines:
        app = await scan(f"{registry.host}/real/cuda-app:1", store)
    (app_platform,) = app.platforms
    assert app_platform.libc.flavour == "glibc" and app_platform.error is None
    fetched_layers = {digest for digest in blob_gets(next_lines) if digest in {d.digest for d in cuda.layers}}
    assert fetched_layers == set()  # the CUDA image's layers come from the cache
    new_layer = next(layer for layer in app_platform.layers if layer.digest == shapes.on_cuda_layer)
    assert blob_bytes(next_lines) <= new_layer.size + MiB


async def test_an_official_index_reads_only_the_gpu_fleet_platforms_layers(shapes: Shapes) -> None:
    registry, official = shapes.registry, shapes.official
    with logged(registry, "official") as lines:
        report = await scan(f"{registry.host}/real/golang:1")
    assert report.error is None
    by_platform = {platform.platform: platform for platform in report.platforms}
    assert (
        set(by_platform)
        == {
            "linux/amd64",
            "linux/arm64/v8",
            "linux/s390x",
            "linux/ppc64le",
            "windows/amd64",
        }
        and len(report.platforms) == 6
    )  # two windows entries; no attestation manifest
    for name in ("linux/amd64", "linux/arm64/v8"):
        assert by_platform[name].libc.flavour == "glibc" and by_platform[name].libc.state == "analysed"
    for name in ("linux/s390x", "linux/ppc64le"):
        libc = by_platform[name].libc
        assert (
            libc.state == "not_analysed" and libc.reason is not None and "GPUBADGE_PLATFORMS" in libc.reason
        )
    windows = [p for p in report.platforms if p.platform == "windows/amd64"]
    assert all(
        p.libc.state == "not_analysed" and "linux platforms only" in (p.libc.reason or "") for p in windows
    )
    assert all(p.config_digest is not None and p.error is None for p in windows)  # config facts stand

    fetched = set(blob_gets(lines))
    wanted = set(official.layers["linux/amd64"]) | set(official.layers["linux/arm64/v8"])
    others = {digest for name, digests in official.layers.items() for digest in digests} - wanted
    assert fetched & others == set()  # no Windows layer, no layer of another platform
    assert wanted <= fetched
    pull = sum(size for size in _layer_sizes(report).values())
    assert blob_bytes(lines) <= 0.6 * pull  # 2 of 4 linux platforms; Windows layers dominate a real pull
    assert shapes.foreign_requests == []


async def test_gpubadge_platforms_all_reads_every_linux_platform_and_never_windows(shapes: Shapes) -> None:
    registry, official = shapes.registry, shapes.official
    with logged(registry, "official-all") as lines:
        report = await scan(f"{registry.host}/real/golang:1", platforms="all")
    linux = [p for p in report.platforms if p.platform.startswith("linux/")]
    assert len(linux) == 4 and all(p.libc.flavour == "glibc" for p in linux)
    windows_layers = {
        d for name, digests in official.layers.items() if name.startswith("windows") for d in digests
    }
    assert set(blob_gets(lines)) & windows_layers == set()


async def test_the_fleets_architectures_join_the_default_platforms(shapes: Shapes) -> None:
    configured = ScannerSettings(docker_config=None)

    async def fleet() -> set[str]:
        return {"s390x"}

    async with RegistryClient(configured) as client:
        scanner = Scanner(client, None, configured, fleet_architectures=fleet)
        try:
            report = await scanner.scan(f"{shapes.registry.host}/real/golang:1")
        finally:
            await scanner.close()
    states = {p.platform: p.libc.state for p in report.platforms if p.platform.startswith("linux/")}
    assert states == {
        "linux/amd64": "analysed",
        "linux/arm64/v8": "analysed",
        "linux/s390x": "analysed",
        "linux/ppc64le": "not_analysed",
    }


async def test_foreign_layers_are_never_fetched_and_never_fail_a_scan(shapes: Shapes) -> None:
    registry = shapes.registry
    alone = await scan(f"{registry.host}/real/windows-foreign:1")
    assert alone.error is None
    (windows,) = alone.platforms
    assert windows.platform == "windows/amd64" and windows.libc.state == "not_analysed"
    both = await scan(f"{registry.host}/real/linux-and-windows:1")
    assert both.error is None and [p.platform for p in both.platforms] == ["linux/amd64", "windows/amd64"]
    assert both.platforms[0].libc.flavour == "glibc"

    with logged(registry, "nondistributable") as lines:
        linux = await scan(f"{registry.host}/real/nondistributable:1")
    (platform,) = linux.platforms
    assert linux.error is None and platform.error is None
    (skipped,) = platform.skipped_layers
    assert skipped.digest == platform.layers[0].digest and "non-distributable" in skipped.reason
    assert skipped.digest.removeprefix("sha256:") not in " ".join(line.path for line in lines)
    assert platform.libc.flavour == "unknown"  # its shell lives in the layer nobody may fetch
    assert any("not fetched" in warning for warning in platform.warnings)
    assert shapes.foreign_requests == []  # not from their URLs either


async def test_a_pip_torch_image_is_read_once_for_glibc_and_inferred_cuda(shapes: Shapes) -> None:
    registry = shapes.registry
    with logged(registry, "pip-torch") as lines:
        report = await scan(f"{registry.host}/real/pip-torch:1")
    (platform,) = report.platforms
    assert not platform.gpu.required  # no NVIDIA variable anywhere
    assert platform.gpu.inferred is not None and platform.gpu.inferred.cuda == "12.1"
    assert platform.libc.flavour == "glibc"
    gets = blob_gets(lines)
    layer_digests = [layer.digest.removeprefix("sha256:") for layer in platform.layers]
    assert all(gets[f"sha256:{digest}"] == 1 for digest in layer_digests), gets  # one read per layer
    assert blob_bytes(lines) <= 1.02 * sum(layer.size for layer in platform.layers) + 64 * 1024
    assert platform.libc.bytes_read == sum(layer.size for layer in platform.layers)


def _layer_sizes(report: ImageReport) -> dict[str, int]:
    return {layer.digest: layer.size for platform in report.platforms for layer in platform.layers}


def test_the_shapes_are_what_they_claim(shapes: Shapes) -> None:
    """Guard the fixture: real proportions, not small synthetic images."""
    assert shapes.cuda.inflated >= CUDA_LAYER_BYTES
    assert shapes.cuda.cuda_layer.size < shapes.cuda.inflated / 2  # compresses like binaries do
    assert len(shapes.official.foreign) == 1
    assert LAYER_MEDIA_TYPES["gzip"] == shapes.cuda.cuda_layer.media_type
