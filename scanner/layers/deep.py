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
* parsing runs in the analysis processes (`scanner.analysis`, a "cuda" session: the layer walk
  with only the CUDA collector), like the libc analysis, so the event loop keeps answering while
  a big layer is read; this process only merges the per-layer evidence.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scanner.layers.inferred import CUDA_EVIDENCE_SCHEMA, CudaLayerEvidence, combine
from scanner.layers.limits import AnalysisLimits, LimitExceeded
from scanner.layers.tarstream import LayerError
from scanner.models import GpuArchs, InferredCuda

if TYPE_CHECKING:  # the registry client is only passed in; importing it costs TLS set-up at start
    from scanner.cache import ScanCache
    from scanner.layers.analysis import AnalysisPool, Session
    from scanner.registry.client import RegistryClient
    from scanner.registry.descriptors import Descriptor
    from scanner.registry.reference import Reference

CACHE_PREFIX = "cuda:"


@dataclass
class DeepProgress:
    """How far one image's deep scan has come (for the UI); updated as bytes stream in."""

    layers_total: int
    layers_done: int = 0
    bytes_total: int = 0
    bytes_read: int = 0

    def describe(self) -> str:
        mib = 1 << 20
        return (
            f"deep scan: {self.layers_done} of {self.layers_total} layers, "
            f"{self.bytes_read / mib:.0f} of {self.bytes_total / mib:.0f} MiB"
        )


@dataclass
class DeepResult:
    inferred: InferredCuda | None = None
    archs: GpuArchs | None = None
    warnings: list[str] = field(default_factory=list)
    bytes_read: int = 0
    layers_from_cache: int = 0


class DeepReader:
    """Shared by all scans of one process: the in-flight map and the memory cache live here.

    Layers are parsed where the libc analysis is: in the analysis processes of `pool`
    (`analysis_processes`), or in this process when it has none.
    """

    def __init__(
        self, client: RegistryClient, store: ScanCache | None, limits: AnalysisLimits, pool: AnalysisPool
    ) -> None:
        self.client = client
        self.store = store
        self.limits = limits
        self.pool = pool
        self._memory_cache: dict[str, str] = {}
        self._inflight: dict[str, asyncio.Event] = {}
        self.progress: dict[str, DeepProgress] = {}  # by reference, while its deep scan runs

    async def _cached(self, digest: str) -> CudaLayerEvidence | None:
        key = CACHE_PREFIX + digest
        raw = self._memory_cache.get(key) if self.store is None else await self.store.layer_evidence(key)
        if raw is None:
            return None
        evidence = CudaLayerEvidence.model_validate_json(raw)
        if evidence.schema_version != CUDA_EVIDENCE_SCHEMA or not evidence.complete:
            return None
        return evidence

    async def _remember(self, digest: str, evidence_json: str) -> None:
        key = CACHE_PREFIX + digest
        if self.store is None:
            self._memory_cache[key] = evidence_json
        else:
            await self.store.save_layer_evidence(key, evidence_json)

    async def scan(self, reference: Reference, layers: Sequence[Descriptor]) -> DeepResult:
        """Inferred CUDA and archs for one platform image (layers as the manifest lists them)."""
        result = DeepResult()
        deadline = time.monotonic() + self.limits.max_scan_seconds
        evidences: list[CudaLayerEvidence] = []
        session: Session | None = None
        progress = DeepProgress(layers_total=len(layers), bytes_total=sum(layer.size for layer in layers))
        key = str(reference)
        self.progress[key] = progress
        try:
            for layer in reversed(layers):  # top layer first, as `combine` wants them
                progress.layers_done = len(evidences)
                while layer.digest in self._inflight:
                    await self._inflight[layer.digest].wait()
                cached = await self._cached(layer.digest)
                if cached is not None:
                    evidences.append(cached)
                    result.layers_from_cache += 1
                    continue
                done = asyncio.Event()
                self._inflight[layer.digest] = done
                try:
                    if session is None:
                        session = await self.pool.open("any", 1, self.limits, deadline, kind="cuda")
                    async with self.client.stream_blob(reference, layer.digest) as chunks:
                        outcome = await session.read_layer(_counted(chunks, progress), layer.media_type)
                    result.bytes_read += outcome.compressed_bytes
                    evidence = CudaLayerEvidence.model_validate_json(outcome.evidence_json or "{}")
                    if outcome.complete and outcome.evidence_json is not None:
                        await self._remember(layer.digest, outcome.evidence_json)
                    evidences.append(evidence)
                except (LayerError, LimitExceeded) as exc:
                    result.warnings.append(f"deep scan: layer {layer.digest[:19]}: {exc}")
                    evidences.append(CudaLayerEvidence(complete=False))
                    if isinstance(exc, LimitExceeded) and exc.setting in (
                        "max_image_bytes",
                        "max_scan_seconds",
                    ):
                        break
                finally:
                    with contextlib.suppress(KeyError):
                        del self._inflight[layer.digest]
                    done.set()
        finally:
            if session is not None:
                session.close()
            if self.progress.get(key) is progress:
                del self.progress[key]
        result.inferred, result.archs = combine(evidences, layers_total=len(layers))
        if result.inferred is not None and not result.inferred.complete:
            result.warnings.append("deep scan: not every layer could be read; CUDA evidence may be missing")
        return result


async def _counted(chunks: AsyncIterator[bytes], progress: DeepProgress) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        progress.bytes_read += len(chunk)
        yield chunk
