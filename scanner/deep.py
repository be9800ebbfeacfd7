"""Deep scan: read every layer once for the CUDA an image carries without declaring it.

The pure parts are `scanner.inferred` (files -> evidence, merged view) and `scanner.cudaelf` /
`scanner.fatbin` (ELF files -> DT_NEEDED and archs). This module plugs them into the shared
layer walk (`scanner.walk`) as a streaming collector and does the I/O:

* every layer of the image is streamed (CUDA can sit in any layer, and a lower layer's
  evidence can be hidden by an upper whiteout), decompressed once, its tar headers parsed,
  the few small files read (torch/version.py, build_info.py, conda-meta JSON) and ELF files
  fed through the probe as they pass; nothing is buffered beyond the probe's named bounds;
* each layer's evidence is cached by digest (`cuda:<digest>` beside the libc evidence), and a
  layer being read by one scan is waited for by another, so a 5 GB torch layer shared by 100
  images is read once;
* parsing runs in a worker thread, a megabyte of compressed input at a time, so the event loop
  keeps answering while a big layer is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scanner.cudaelf import ELF_MAGIC_BYTES, ElfCudaProbe
from scanner.inferred import CUDA_EVIDENCE_SCHEMA, CudaLayerCollector, CudaLayerEvidence, combine
from scanner.limits import AnalysisLimits, LimitExceeded, ScanBudget
from scanner.models import GpuArchs, InferredCuda
from scanner.tarstream import LayerError, StreamStats, TarEntry
from scanner.walk import LayerWalk

if TYPE_CHECKING:  # the registry client is only passed in; importing it costs TLS set-up at start
    from scanner.reference import Reference
    from scanner.registry import Descriptor, RegistryClient
    from scanner.store import Store

CACHE_PREFIX = "cuda:"
FEED_BYTES = 1 << 20  # compressed bytes handed to the parsing thread at a time


class _ElfSink:
    """Streams one file into an `ElfCudaProbe`; records the outcome in the layer's collector."""

    __slots__ = ("_collector", "_entry", "_probe")

    def __init__(self, collector: CudaLayerCollector, entry: TarEntry) -> None:
        self._collector = collector
        self._entry = entry
        self._probe = ElfCudaProbe(entry.size)

    def feed(self, data: memoryview) -> bool:
        return self._probe.feed(data)

    def close(self, complete: bool) -> None:
        if self._probe.is_elf:
            self._collector.add_elf(self._entry, self._probe.finish())


class CudaEntryCollector:
    """The CUDA analysis as a streaming `EntryCollector` of the layer walk. Never satisfied early."""

    def __init__(self) -> None:
        self.layer = CudaLayerCollector()
        self.position = 0

    def wants(self, entry: TarEntry) -> int:
        return self.layer.wants(entry)

    def add(self, entry: TarEntry, head: bytes) -> None:
        want = self.layer.wants(entry)
        self.layer.add(entry, head[:want] if want else b"")

    @property
    def satisfied(self) -> bool:
        return False  # evidence can sit in any entry of any layer

    def stream(self, entry: TarEntry) -> _ElfSink | None:
        if entry.kind != "file" or entry.size < ELF_MAGIC_BYTES or self.layer.wants(entry):
            return None
        return _ElfSink(self.layer, entry)


@dataclass
class DeepResult:
    inferred: InferredCuda | None = None
    archs: GpuArchs | None = None
    warnings: list[str] = field(default_factory=list)
    bytes_read: int = 0
    layers_from_cache: int = 0


class DeepReader:
    """Shared by all scans of one process: the in-flight map and the memory cache live here."""

    def __init__(self, client: RegistryClient, store: Store | None, limits: AnalysisLimits) -> None:
        self.client = client
        self.store = store
        self.limits = limits
        self._memory_cache: dict[str, str] = {}
        self._inflight: dict[str, asyncio.Event] = {}

    def _cached(self, digest: str) -> CudaLayerEvidence | None:
        key = CACHE_PREFIX + digest
        raw = self._memory_cache.get(key) if self.store is None else self.store.layer_evidence(key)
        if raw is None:
            return None
        evidence = CudaLayerEvidence.model_validate_json(raw)
        if evidence.schema_version != CUDA_EVIDENCE_SCHEMA or not evidence.complete:
            return None
        return evidence

    def _remember(self, digest: str, evidence: CudaLayerEvidence) -> None:
        if not evidence.complete:
            return  # only a whole layer's evidence can stand for the layer
        key = CACHE_PREFIX + digest
        if self.store is None:
            self._memory_cache[key] = evidence.model_dump_json()
        else:
            self.store.save_layer_evidence(key, evidence.model_dump_json())

    async def scan(self, reference: Reference, layers: Sequence[Descriptor]) -> DeepResult:
        """Inferred CUDA and archs for one platform image (layers as the manifest lists them)."""
        result = DeepResult()
        budget = ScanBudget(self.limits, time.monotonic() + self.limits.max_scan_seconds)
        evidences: list[CudaLayerEvidence] = []
        for layer in reversed(layers):  # top layer first, as `combine` wants them
            while layer.digest in self._inflight:
                await self._inflight[layer.digest].wait()
            cached = self._cached(layer.digest)
            if cached is not None:
                evidences.append(cached)
                result.layers_from_cache += 1
                continue
            done = asyncio.Event()
            self._inflight[layer.digest] = done
            try:
                evidence, read = await self._read(reference, layer, budget)
                result.bytes_read += read
                self._remember(layer.digest, evidence)
                evidences.append(evidence)
            except (LayerError, LimitExceeded) as exc:
                result.warnings.append(f"deep scan: layer {layer.digest[:19]}: {exc}")
                evidences.append(CudaLayerEvidence(complete=False))
                if isinstance(exc, LimitExceeded) and exc.setting in ("max_image_bytes", "max_scan_seconds"):
                    break
            finally:
                with contextlib.suppress(KeyError):
                    del self._inflight[layer.digest]
                done.set()
        result.inferred, result.archs = combine(evidences, layers_total=len(layers))
        if result.inferred is not None and not result.inferred.complete:
            result.warnings.append("deep scan: not every layer could be read; CUDA evidence may be missing")
        return result

    async def _read(
        self, reference: Reference, layer: Descriptor, budget: ScanBudget
    ) -> tuple[CudaLayerEvidence, int]:
        collector = CudaEntryCollector()
        stats = StreamStats()
        walk = LayerWalk(
            layer.media_type,
            [collector],
            max_decompressed=self.limits.max_layer_bytes,
            budget=budget,
            stats=stats,
        )
        pending: list[bytes] = []
        size = 0
        async with self.client.stream_blob(reference, layer.digest) as chunks:
            async for chunk in chunks:
                pending.append(chunk)
                size += len(chunk)
                if size >= FEED_BYTES:
                    batch, pending, size = b"".join(pending), [], 0
                    if not await asyncio.to_thread(walk.feed, batch):
                        break
            else:
                if pending:
                    await asyncio.to_thread(walk.feed, b"".join(pending))
                await asyncio.to_thread(walk.close)
        return collector.layer.finish(complete=stats.reached_end), stats.compressed_bytes
