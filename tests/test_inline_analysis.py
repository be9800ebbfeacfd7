"""Small images are analysed inline, in the scanning process, within a budget (scanner/layer_reader.py).

Handing an image's layers to an analysis process costs about 1.5 ms of CPU per image (frames, JSON,
two processes woken per layer), ten times the walk of the small top layer most pushes add. So an image
whose cache entries and layers still to read fit `inline_analysis_bytes` is analysed on the scanning
process's event loop, and one that reaches that budget (bytes taken or decompressed, CPU, GPU-code
steps) starts over in an analysis process. Each test pushes with skopeo into the real registry and
scans with a real analysis process beside; the verdicts are the ones an analysis process gives.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterator

import pytest

from fixtures import catalog
from fixtures import hostile_gpu_code as crafted
from fixtures.oci import ImageSpec, LayerSpec, file, tar_bytes
from fixtures.registry import LocalRegistry
from scanner.layers import image
from scanner.layers.limits import DEFAULT_INLINE_ANALYSIS_BYTES, INLINE_GPU_CODE_STEPS
from scanner.models import ImageReport
from scanner.registry.client import RegistryClient
from scanner.scan import Scanner
from scanner.settings import ScannerSettings
from tests.conftest import Pusher


@pytest.fixture(scope="module")
def pushed(push: Pusher, registry: LocalRegistry) -> Iterator[Callable[[str, ImageSpec], str]]:
    def push_as(name: str, spec: ImageSpec) -> str:
        push(spec, f"inline/{name}:1")
        return f"{registry.host}/inline/{name}:1"

    yield push_as


async def scan(reference: str, **overrides: object) -> tuple[ImageReport, Scanner, int]:
    """The report, the scanner (closed) and how many analysis processes it started."""
    values: dict[str, object] = {"docker_config": None, "retries": 2, "analysis_processes": 1}
    values.update(overrides)
    settings = ScannerSettings(**values)  # type: ignore[arg-type]
    async with RegistryClient(settings) as client:
        scanner = Scanner(client, None, settings)
        try:
            report = await scanner.scan(reference)
            started = len(scanner.layers.pool._workers)
        finally:
            await scanner.close()
    return report, scanner, started


def verdicts(report: ImageReport) -> list[dict[str, object]]:
    """What a scan decided, per platform: not the bytes it took, nor which layers came from the cache."""
    assert report.error is None, report.error
    return [
        platform.model_dump(include={"platform", "gpu", "badges", "warnings", "error"})
        | {"libc": platform.libc.model_dump(exclude={"bytes_read", "layers_cached"})}
        for platform in report.platforms
    ]


async def test_a_small_image_is_analysed_inline_with_an_analysis_process_verdict(
    pushed: Callable[[str, ImageSpec], str],
) -> None:
    """The common push: a base and a small app layer. Deep-scanned inline, no process started; the
    verdict is the analysis process's, bytes read included."""
    reference = pushed("small", catalog.plain_glibc())
    report, scanner, started = await scan(reference)
    assert (scanner.layers.analysed_inline, scanner.layers.handed_over, started) == (1, 0, 0)
    alone, elsewhere, started = await scan(reference, inline_analysis_bytes=0)
    assert (elsewhere.layers.analysed_inline, started) == (0, 1)
    assert verdicts(report) == verdicts(alone)
    assert report.platforms[0].libc.flavour == "glibc"
    assert report.platforms[0].libc.bytes_read == alone.platforms[0].libc.bytes_read


async def test_a_layer_past_the_inline_bytes_starts_over_in_an_analysis_process(
    pushed: Callable[[str, ImageSpec], str],
) -> None:
    """A layer that looks small (a 1 MiB run of zeros gzips to 1 KiB) but decompresses past
    `inline_analysis_bytes`: the inline walk stops there and the image's analysis starts over in a
    process, with the same verdict as if it had gone there first."""
    zeros = LayerSpec([file("opt/app/zeros.bin", bytes(1 << 20))])
    assert len(gzip.compress(tar_bytes(zeros.entries))) * 4 < DEFAULT_INLINE_ANALYSIS_BYTES
    spec = ImageSpec([catalog.ubuntu_base(), zeros])
    reference = pushed("zeros", spec)
    report, scanner, started = await scan(reference)
    assert (scanner.layers.analysed_inline, scanner.layers.handed_over, started) == (0, 1, 1)
    alone, _, _ = await scan(reference, inline_analysis_bytes=0)
    assert verdicts(report) == verdicts(alone)


async def test_an_inline_analysis_past_its_cpu_budget_starts_over(
    pushed: Callable[[str, ImageSpec], str],
) -> None:
    """`inline_analysis_ms` bounds the loop's CPU in the analysis: past it, an analysis process."""
    reference = pushed("cpu", catalog.plain_glibc())
    report, scanner, started = await scan(reference, inline_analysis_ms=0.001)
    assert (scanner.layers.analysed_inline, scanner.layers.handed_over, started) == (0, 1, 1)
    alone, _, _ = await scan(reference, inline_analysis_bytes=0)
    assert verdicts(report) == verdicts(alone)


async def test_gpu_code_past_the_inline_steps_is_read_in_an_analysis_process(
    pushed: Callable[[str, ImageSpec], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A few KiB of converging fatbin chains (well inside the inline bytes) need 8,000 GPU-code steps:
    inline they stop at `INLINE_GPU_CODE_STEPS`, and the layer is read again in an analysis process
    under the real bounds, so the report says what the image's own bounds say, never the inline one."""
    chains = crafted.converging_cubins(containers=40, cubin_size=2048, tail_entries=200)
    assert len(chains) * 2 < DEFAULT_INLINE_ANALYSIS_BYTES
    spec = crafted.gpu_code_image(file("/usr/lib/libchains.so", chains))
    reference = pushed("chains", spec)
    report, scanner, started = await scan(reference, inline_analysis_ms=1000.0)  # not the CPU bound
    assert (scanner.layers.analysed_inline, scanner.layers.handed_over, started) == (0, 1, 1)
    alone, _, _ = await scan(reference, inline_analysis_bytes=0)
    assert verdicts(report) == verdicts(alone)
    text = report.model_dump_json()
    assert f"{INLINE_GPU_CODE_STEPS:,}" not in text and "GPUBADGE_MAX_LAYER_GPU_CODE_STEPS" not in text
    monkeypatch.setattr(image, "INLINE_GPU_CODE_STEPS", 1 << 30)  # the steps, not the bytes, sent it over
    _, scanner, started = await scan(reference, inline_analysis_ms=1000.0)
    assert (scanner.layers.analysed_inline, started) == (1, 0)


async def test_a_big_cache_entry_keeps_the_image_in_an_analysis_process(
    pushed: Callable[[str, ImageSpec], str],
) -> None:
    """What the cache holds counts too: an image whose cached entries alone pass the inline bytes
    (here with the budget set below them) goes straight to an analysis process, nothing inline."""
    reference = pushed("cached", catalog.plain_glibc())
    values: dict[str, object] = {"docker_config": None, "retries": 2, "analysis_processes": 1}
    settings = ScannerSettings(**values, inline_analysis_bytes=600)  # type: ignore[arg-type]
    async with RegistryClient(settings) as client:
        scanner = Scanner(client, None, settings)
        try:
            first = await scanner.scan(reference)  # too big to go inline: the process reads, the cache fills
            assert (scanner.layers.analysed_inline, scanner.layers.handed_over) == (0, 0)
            assert len(scanner.layers._memory_cache) == 2
            assert sum(map(len, scanner.layers._memory_cache.values())) > 600
            again = await scanner.scan(reference)
            assert (scanner.layers.analysed_inline, scanner.layers.handed_over) == (0, 0)
        finally:
            await scanner.close()
    assert verdicts(first) == verdicts(again)
