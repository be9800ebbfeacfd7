"""Read layers for the libc verdict: top-down, cached by layer digest, stopping early.

This is the I/O glue around the pure `scanner.libc` analysis, which runs in an analysis
process (`scanner.analysis`) so that parsing untrusted layers never holds up the event
loop. Each layer's evidence is cached in the store by digest (as the JSON the analysis
produced; this process never parses it), so a base layer shared by many images is read
once; while one scan is reading a layer, another scan that needs the same layer waits
for it instead of downloading it a second time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from scanner.layers.analysis import AnalysisPool, evidence_is_complete
from scanner.layers.limits import AnalysisLimits, LimitExceeded
from scanner.layers.tarstream import LayerTooLarge
from scanner.models import LibcVerdict
from scanner.registry.client import RegistryClient
from scanner.registry.descriptors import Descriptor
from scanner.registry.reference import Reference

if TYPE_CHECKING:
    from scanner.cache import ScanCache


class LayerReader:
    """Shared by all scans of one process (it holds the in-flight map and the analysis pool)."""

    def __init__(
        self,
        client: RegistryClient,
        store: ScanCache | None,
        *,
        limits: AnalysisLimits | None = None,
        pool: AnalysisPool | None = None,
    ) -> None:
        self.client = client
        self.store = store
        self.limits = limits or AnalysisLimits()
        self.pool = pool or AnalysisPool(0)
        self._memory_cache: dict[str, str] = {}  # evidence JSON by digest, when running without a store
        self._inflight: dict[str, asyncio.Event] = {}

    async def _cached(self, digest: str) -> str | None:
        if self.store is None:
            return self._memory_cache.get(digest)
        return await self.store.layer_evidence(digest)

    async def _remember(self, digest: str, evidence_json: str, complete: bool) -> None:
        previous = await self._cached(digest)
        if previous is not None and not complete and evidence_is_complete(previous):
            return  # never replace a full read with a partial one
        if self.store is None:
            self._memory_cache[digest] = evidence_json
        else:
            await self.store.save_layer_evidence(digest, evidence_json)

    async def libc_verdict(
        self, reference: Reference, layers: Sequence[Descriptor], arch: str, deadline: float | None = None
    ) -> tuple[LibcVerdict, list[str]]:
        """The libc verdict for one platform image, plus warnings worth showing.

        Raises `LimitExceeded` past a content bound (too many layers, a path too long, ...).
        """
        limits = self.limits
        if len(layers) > limits.max_layers:
            raise LimitExceeded(f"image has {len(layers):,} layers", limits.max_layers, "max_layers")
        deadline = deadline if deadline is not None else time.monotonic() + limits.max_scan_seconds
        session = await self.pool.open(arch, len(layers), limits, deadline)
        try:
            warnings: list[str] = []
            bytes_read = 0
            for layer in reversed(layers):  # manifests list layers bottom-up
                if session.decided:
                    break
                while layer.digest in self._inflight:  # someone else is reading it right now
                    await self._inflight[layer.digest].wait()
                # Claim the digest before the first await, so a concurrent scan waits for this read.
                done = asyncio.Event()
                self._inflight[layer.digest] = done
                try:
                    cached = await self._cached(layer.digest)
                    if cached is not None and await session.use_cached(cached):
                        continue
                    async with self.client.stream_blob(reference, layer.digest) as chunks:
                        outcome = await session.read_layer(chunks, layer.media_type)
                    bytes_read += outcome.compressed_bytes
                    if outcome.evidence_json is not None:
                        await self._remember(layer.digest, outcome.evidence_json, outcome.complete)
                except LayerTooLarge as exc:
                    # A real layer can be this big (CUDA libraries): the verdict stays unknown, the
                    # GPU facts from the config still stand, and the warning names the setting.
                    warnings.append(f"layer {layer.digest[:19]}: {exc}")
                    break
                finally:
                    with contextlib.suppress(KeyError):
                        del self._inflight[layer.digest]
                    done.set()
            verdict = await session.verdict(bytes_read, sum(layer.size for layer in layers))
            return verdict, warnings
        finally:
            session.close()
