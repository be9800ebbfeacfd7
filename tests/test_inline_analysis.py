"""Small images are analysed inline, in the scanning process, within a budget (scanner/layer_reader.py).

Handing an image's layers to an analysis process costs about 1.5 ms of CPU per image (frames, JSON,
two processes woken per layer), ten times the walk of the small top layer most pushes add. So an image
whose cache entries and layers still to read fit `inline_analysis_bytes` is analysed on the scanning
process's event loop, and one that reaches that budget (bytes taken or decompressed, CPU, GPU-code
steps) starts over in an analysis process. Each test pushes with skopeo into the real registry and
scans with a real analysis process beside; the verdicts are the ones an analysis process gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import pytest

from fixtures import catalog
from fixtures import hostile_gpu_code as crafted
from fixtures.oci import LAYER_MEDIA_TYPES, Entry, ImageSpec, LayerSpec, file, tar_bytes
from fixtures.registry import LocalRegistry
from scanner import layer_reader
from scanner.layer_reader import LayerProgress, LayerReader
from scanner.layers import image
from scanner.layers.analysis import AnalysisPool
from scanner.layers.image import ImageVerdict
from scanner.layers.limits import (
    DEFAULT_INLINE_ANALYSIS_BYTES,
    INLINE_GPU_CODE_STEPS,
    AnalysisLimits,
    InlineBudget,
)
from scanner.models import ImageReport
from scanner.registry.client import RegistryClient
from scanner.registry.descriptors import Descriptor
from scanner.registry.reference import parse_reference
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
    # The walk takes well under the default 5 ms; a full collection of this suite's heap may not.
    report, scanner, started = await scan(reference, inline_analysis_ms=1000.0)
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
    report, scanner, started = await scan(reference, inline_analysis_ms=1000.0)  # the bytes, not the CPU
    assert (scanner.layers.analysed_inline, scanner.layers.handed_over, started) == (0, 1, 1)
    alone, _, _ = await scan(reference, inline_analysis_bytes=0)
    assert verdicts(report) == verdicts(alone)
    assert (report.requests, report.bytes_fetched) == (alone.requests, alone.bytes_fetched)


async def test_an_inline_analysis_past_its_cpu_budget_starts_over(
    pushed: Callable[[str, ImageSpec], str],
) -> None:
    """`inline_analysis_ms` bounds the loop's CPU in the analysis: past it, an analysis process."""
    reference = pushed("cpu", catalog.plain_glibc())
    report, scanner, started = await scan(reference, inline_analysis_ms=0.001)
    assert (scanner.layers.analysed_inline, scanner.layers.handed_over, started) == (0, 1, 1)
    alone, _, _ = await scan(reference, inline_analysis_bytes=0)
    assert verdicts(report) == verdicts(alone)
    # The layer the inline walk was reading is not fetched again: its bytes go to the process.
    assert (report.requests, report.bytes_fetched) == (alone.requests, alone.bytes_fetched)


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


class _WatchedEvent(asyncio.Event):
    """An event that says when someone starts waiting for it."""

    def __init__(self) -> None:
        super().__init__()
        self.awaited = asyncio.Event()

    async def wait(self) -> Literal[True]:
        self.awaited.set()
        return await super().wait()


class _Blobs:
    """The registry client's one call the layer reader makes, over blobs in memory; the reads of
    `gated` stop after their first chunk until `gate` is set."""

    def __init__(self, blobs: dict[str, bytes], gated: str) -> None:
        self.blobs, self.gated, self.gate = blobs, gated, asyncio.Event()
        self.opened: list[str] = []  # the digests fetched, in order
        self.streams: list[_Stream] = []

    @contextlib.asynccontextmanager
    async def stream_blob(self, ref: object, digest: str, **_: object) -> AsyncIterator[_Stream]:
        self.opened.append(digest)
        self.streams.append(_Stream(self.blobs[digest], self.gate if digest == self.gated else None))
        yield self.streams[-1]


class _Stream:
    """A blob read as `BlobStream` reads one: one iterator, resumed where it stopped; `verified` once
    it reached its end."""

    def __init__(self, data: bytes, gate: asyncio.Event | None) -> None:
        self.data, self.gate, self.bytes_received, self.bytes_read = data, gate, 0, 0
        self.verified = False

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> bytes:
        step = 16 if self.gate is not None else 4096  # 16 bytes of gzipped zeros: a few KiB whole
        if self.gate is not None and self.bytes_read:
            await asyncio.wait_for(self.gate.wait(), 30)
        if self.bytes_read >= len(self.data):
            self.verified = True
            raise StopAsyncIteration
        chunk = self.data[self.bytes_read : self.bytes_read + step]
        self.bytes_received += len(chunk)
        self.bytes_read += len(chunk)
        return chunk


async def test_a_scan_waiting_for_an_inline_read_that_was_handed_over_takes_the_bytes_it_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two images share a layer that looks small and is not. The small image reads it inline; the
    other, too big to go inline, waits for that read instead of fetching the layer twice. When the
    inline read reaches its budget, that is no error of the layer: the inline read takes the rest of
    the small blob, and both analyses, each in an analysis process, are given those bytes. Both get
    their verdicts, and the layer was fetched once."""
    watched: list[_WatchedEvent] = []

    def watched_event() -> asyncio.Event:
        watched.append(_WatchedEvent())
        return watched[-1]

    @dataclass
    class Read:
        done: asyncio.Event = field(default_factory=watched_event)
        error: Exception | None = None

    monkeypatch.setattr(layer_reader, "_Read", Read)

    def layer(*entries: Entry) -> tuple[Descriptor, bytes]:
        data = gzip.compress(tar_bytes(entries), compresslevel=6)
        return Descriptor(
            LAYER_MEDIA_TYPES["gzip"], "sha256:" + hashlib.sha256(data).hexdigest(), len(data)
        ), data

    base, base_data = layer(*catalog.ubuntu_base().entries)
    zeros, zeros_data = layer(file("opt/app/zeros.bin", bytes(1 << 20)))  # 1 KiB gzipped, 1 MiB whole
    big, big_data = layer(file("opt/data.bin", os.urandom(DEFAULT_INLINE_ANALYSIS_BYTES)))
    blobs = _Blobs(
        {d.digest: data for d, data in ((base, base_data), (zeros, zeros_data), (big, big_data))},
        zeros.digest,
    )
    pool = AnalysisPool(1)
    reader = LayerReader(blobs, None, AnalysisLimits(), pool, InlineBudget())  # type: ignore[arg-type]
    reference = parse_reference("r.example/app:1")

    async def analyse(layers: list[Descriptor]) -> ImageVerdict:
        progress = LayerProgress(len(layers), sum(d.size for d in layers))
        return await reader.analyse(
            reference, layers, "amd64", cuda=True, deadline=time.monotonic() + 60, progress=progress
        )

    try:
        await pool.start()
        small = asyncio.create_task(analyse([base, zeros]))  # inline, reads `zeros` first (top layer first)
        await asyncio.wait_for(blobs_started(reader, zeros.digest), 30)
        large = asyncio.create_task(analyse([big, zeros]))  # to a process; waits for that read
        await asyncio.wait_for(watched[0].awaited.wait(), 30)
        blobs.gate.set()
        small_verdict, large_verdict = await asyncio.wait_for(asyncio.gather(small, large), 60)
    finally:
        await pool.close()
    assert (reader.analysed_inline, reader.handed_over) == (0, 1)
    assert sorted(blobs.opened) == sorted([zeros.digest, base.digest, big.digest]), blobs.opened
    assert small_verdict.libc.flavour == "glibc"
    assert large_verdict.libc.flavour == "none" and large_verdict.libc.layers_read == 2


async def blobs_started(reader: LayerReader, digest: str) -> None:
    """Until a read of `digest` is in flight (bounded by the caller)."""
    while digest not in reader._inflight:
        await asyncio.sleep(0.001)


async def test_a_blob_longer_than_its_descriptor_is_not_kept_at_a_hand_over() -> None:
    """A registry that sends more than the manifest's size for a small layer: the inline read that
    spends its budget there reads the rest of the blob for the analysis process only up to that size,
    then lets the process fetch it afresh, so what it keeps stays bounded by the inline budget."""
    data = gzip.compress(tar_bytes([file("opt/app/zeros.bin", bytes(1 << 20))]), compresslevel=6)
    zeros = Descriptor(
        LAYER_MEDIA_TYPES["gzip"], "sha256:" + hashlib.sha256(data).hexdigest(), len(data) // 2
    )
    blobs = _Blobs({zeros.digest: data}, gated=zeros.digest)
    blobs.gate.set()  # never waits: the blob comes 16 bytes at a time
    pool = AnalysisPool(1)
    reader = LayerReader(blobs, None, AnalysisLimits(), pool, InlineBudget())  # type: ignore[arg-type]
    progress = LayerProgress(1, zeros.size)
    try:
        await pool.start()
        await asyncio.wait_for(
            reader.analyse(
                parse_reference("r.example/app:1"),
                [zeros],
                "amd64",
                cuda=True,
                deadline=time.monotonic() + 60,
                progress=progress,
            ),
            60,
        )
    finally:
        await pool.close()
    assert reader.handed_over == 1
    assert blobs.opened == [zeros.digest, zeros.digest]  # nothing kept: the process fetched it
    assert blobs.streams[0].bytes_read <= zeros.size + 16  # the inline read stopped at the size
