"""Deep scans end to end: images pushed with skopeo to a real registry, NVIDIA's real wheel inside."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fixtures.oci import ImageSpec, LayerSpec, file, whiteout
from fixtures.registry import LocalRegistry
from scanner.models import PlatformReport
from scanner.registry.client import RegistryClient
from scanner.registry.reference import parse_reference
from scanner.scan import Scanner
from scanner.settings import ScannerSettings
from store import open_store
from tests.conftest import Pusher
from tests.faultproxy import FaultProxy, Rule
from tests.nvidia_wheels import NVJPEG_CU12, wheel_members

SITE = "/usr/local/lib/python3.11/site-packages"
TORCH = "__version__ = '2.1.2+cu121'\ncuda: Optional[str] = '12.1'\nhip: Optional[str] = None\n"


def wheel_layer() -> LayerSpec:
    entries = [file(f"{SITE}/{path}", data) for path, data in wheel_members(NVJPEG_CU12).items()]
    entries.append(file(f"{SITE}/torch/version.py", TORCH))
    entries.append(file(f"{SITE}/nvidia_cuda_runtime_cu12-12.1.105.dist-info/METADATA", "Name: x\n"))
    return LayerSpec(entries)


@pytest.fixture(scope="module")
def images(registry: LocalRegistry, push: Pusher) -> dict[str, str]:
    shared = wheel_layer()
    app = LayerSpec([file("/app/main.py", "print('hi')\n")])
    specs = {
        "deep/torch:1": ImageSpec([shared]),
        "deep/torch-app:1": ImageSpec([shared, app]),
        "deep/declared:1": ImageSpec([shared], env={"CUDA_VERSION": "11.8.0"}),
        "deep/removed:1": ImageSpec(
            [
                shared,
                LayerSpec(
                    [
                        whiteout(f"{SITE}/torch"),
                        whiteout(f"{SITE}/nvidia"),
                        whiteout(f"{SITE}/nvidia_cuda_runtime_cu12-12.1.105.dist-info"),
                        whiteout(f"{SITE}/nvidia_nvjpeg_cu12-12.4.0.76.dist-info"),
                    ]
                ),
            ]
        ),
    }
    for name, spec in specs.items():
        push(spec, name)
    return {name: f"{registry.host}/{name}" for name in specs}


@pytest.fixture
async def scanner(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Scanner]:
    mode, processes = getattr(request, "param", ("always", 0))
    settings = ScannerSettings(docker_config=None, deep_scan=mode, analysis_processes=processes)
    store = open_store(tmp_path / "scan.db")
    try:
        async with RegistryClient(settings) as client:
            scanner = Scanner(client, store.scan_cache, settings)
            yield scanner
            await scanner.close()
    finally:
        await store.close()


async def platform_of(scanner: Scanner, reference: str) -> PlatformReport:
    report = await scanner.scan(reference)
    assert report.error is None, report.error
    return report.platforms[0]


@pytest.mark.parametrize(
    "scanner", [("always", 0), ("always", 2)], indirect=True, ids=["in-process", "2-processes"]
)
async def test_undeclared_cuda_is_inferred_with_archs(scanner: Scanner, images: dict[str, str]) -> None:
    platform = await platform_of(scanner, images["deep/torch:1"])
    gpu = platform.gpu
    assert not gpu.required and gpu.cuda_version is None  # declared signals stay as they are
    assert gpu.inferred is not None and gpu.inferred.cuda == "12.1"
    assert gpu.inferred.evidence[0] == f"{SITE}/torch/version.py: torch 2.1.2+cu121, cuda = '12.1'"
    assert f"{SITE}/nvidia/nvjpeg/lib/libnvjpeg.so.12: GPU code in .nv_fatbin" in gpu.inferred.evidence
    assert gpu.archs is not None and "90" in gpu.archs.sass and gpu.archs.ptx == ["121"]
    assert gpu.archs.files[0].path == f"{SITE}/nvidia/nvjpeg/lib/libnvjpeg.so.12"
    assert "cuda-12.1-inferred" in platform.badges and "nvidia-gpu" not in platform.badges


@pytest.mark.parametrize(
    "scanner", [("auto", 0), ("auto", 2)], indirect=True, ids=["in-process", "2-processes"]
)
async def test_a_shared_layer_is_read_once(scanner: Scanner, images: dict[str, str]) -> None:
    await platform_of(scanner, images["deep/torch:1"])
    platform = await platform_of(scanner, images["deep/torch-app:1"])
    app_layer = platform.layers[1]
    assert platform.libc.bytes_read == app_layer.size  # only the app layer; 0 bytes of the shared one
    assert platform.gpu.inferred is not None and platform.gpu.inferred.cuda == "12.1"


async def test_whiteouts_hide_evidence(scanner: Scanner, images: dict[str, str]) -> None:
    platform = await platform_of(scanner, images["deep/removed:1"])
    assert platform.gpu.inferred is None and platform.gpu.archs is None


@pytest.mark.parametrize("scanner", [("auto", 0)], indirect=True)
async def test_auto_skips_images_that_declare_cuda(scanner: Scanner, images: dict[str, str]) -> None:
    platform = await platform_of(scanner, images["deep/declared:1"])
    assert platform.gpu.required and platform.gpu.inferred is None


async def test_by_default_a_declared_image_is_read_and_a_newer_carried_cuda_flagged(
    scanner: Scanner, images: dict[str, str]
) -> None:
    platform = await platform_of(scanner, images["deep/declared:1"])
    assert platform.gpu.cuda_version == "11.8"
    assert platform.gpu.inferred is not None and platform.gpu.inferred.cuda == "12.1"
    assert platform.gpu.inferred.set_by == f"{SITE}/torch/version.py: torch 2.1.2+cu121, cuda = '12.1'"
    assert "cuda-newer-inside" in platform.badges and "cuda-mismatch" not in platform.badges
    assert (
        f"the config declares CUDA 11.8, but the layers carry the newer CUDA 12.1 ({SITE}/torch/version.py:"
        " torch 2.1.2+cu121, cuda = '12.1'): the image needs a driver for CUDA 12, which NVIDIA_REQUIRE_CUDA does not check"
    ) in platform.warnings


@pytest.mark.parametrize("scanner", [("never", 0)], indirect=True)
async def test_never(scanner: Scanner, images: dict[str, str]) -> None:
    platform = await platform_of(scanner, images["deep/torch:1"])
    assert platform.gpu.inferred is None


async def test_progress_while_a_deep_scan_runs(images: dict[str, str], registry: LocalRegistry) -> None:
    """A layer blob held by the proxy: the scan shows where it is, and forgets it once done."""
    settings = ScannerSettings(docker_config=None, deep_scan="always", analysis_processes=0)
    async with FaultProxy(registry.url) as proxy, RegistryClient(settings) as client:
        scanner = Scanner(client, None, settings)
        reference = parse_reference(images["deep/torch-app:1"].replace(registry.host, proxy.host))
        layers = (await client.manifest(reference)).layers
        proxy.add(Rule("hang", method="GET", path=f"/blobs/{layers[1].digest}$"))
        task = asyncio.create_task(scanner.scan(str(reference)))
        async with proxy.arrivals:
            await asyncio.wait_for(
                proxy.arrivals.wait_for(lambda: any(layers[1].digest in seen.path for seen in proxy.seen)), 30
            )
        total = sum(layer.size for layer in layers) / (1 << 20)
        assert scanner.layer_progress() == {
            str(reference): f"linux/amd64: reading layers: 0 of 2, 0 of {total:.0f} MiB fetched"
        }
        proxy.release.set()
        report = await asyncio.wait_for(task, 60)
        assert report.platforms[0].gpu.inferred is not None and scanner.layer_progress() == {}
        await scanner.close()
