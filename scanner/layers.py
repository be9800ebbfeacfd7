"""Read layers for the libc verdict: top-down, cached by layer digest, stopping early.

This is the I/O glue around the pure `scanner.libc` analysis. Each layer's
evidence is cached in the store by digest, so a base layer shared by many images
is read once; while one scan is reading a layer, another scan that needs the
same layer waits for it instead of downloading it a second time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from scanner.libc import LayerEvidence, LibcAnalysis, analyse_layer
from scanner.models import LibcVerdict
from scanner.reference import Reference
from scanner.registry import Descriptor, RegistryClient
from scanner.tarstream import LayerTooLarge, StreamStats

if TYPE_CHECKING:
    from scanner.cache import ScanCache


class LayerReader:
    """Shared by all scans of one process (it holds the in-flight map)."""

    def __init__(self, client: RegistryClient, store: ScanCache | None, *, max_layer_bytes: int) -> None:
        self.client = client
        self.store = store
        self.max_layer_bytes = max_layer_bytes
        self._memory_cache: dict[str, LayerEvidence] = {}  # when running without a store
        self._inflight: dict[str, asyncio.Event] = {}

    async def _cached(self, digest: str) -> LayerEvidence | None:
        if self.store is None:
            return self._memory_cache.get(digest)
        raw = await self.store.layer_evidence(digest)
        return LayerEvidence.model_validate_json(raw) if raw else None

    async def _remember(self, digest: str, evidence: LayerEvidence) -> None:
        previous = await self._cached(digest)
        if previous is not None and previous.complete and not evidence.complete:
            return  # never replace a full read with a partial one
        if self.store is None:
            self._memory_cache[digest] = evidence
        else:
            await self.store.save_layer_evidence(digest, evidence.model_dump_json())

    async def libc_verdict(
        self, reference: Reference, layers: Sequence[Descriptor], arch: str
    ) -> tuple[LibcVerdict, list[str]]:
        """The libc verdict for one platform image, plus warnings worth showing."""
        analysis = LibcAnalysis(arch, layers_total=len(layers))
        warnings: list[str] = []
        bytes_read = 0
        for layer in reversed(layers):  # manifests list layers bottom-up
            if analysis.decided:
                break
            while layer.digest in self._inflight:  # someone else is reading it right now
                await self._inflight[layer.digest].wait()
            # Claim the digest before the first await, so a concurrent scan waits for this read.
            done = asyncio.Event()
            self._inflight[layer.digest] = done
            stats = StreamStats()
            try:
                cached = await self._cached(layer.digest)
                if cached is not None and analysis.layer_from_cache(cached):
                    continue
                async with self.client.stream_blob(reference, layer.digest) as chunks:
                    evidence = await analyse_layer(
                        analysis,
                        chunks,
                        layer.media_type,
                        max_decompressed=self.max_layer_bytes,
                        stats=stats,
                    )
                await self._remember(layer.digest, evidence)
            except LayerTooLarge as exc:
                warnings.append(f"layer {layer.digest[:19]}: {exc}")
                break
            finally:
                bytes_read += stats.compressed_bytes
                with contextlib.suppress(KeyError):
                    del self._inflight[layer.digest]
                done.set()
        verdict = analysis.verdict(bytes_read=bytes_read, bytes_total=sum(layer.size for layer in layers))
        return verdict, warnings
