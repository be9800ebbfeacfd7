"""Read the layers of platform images: each layer fetched once, only when its answer is used.

The I/O around the pure layer walk: this module joins the registry client (blobs streamed by
`RegistryClient.stream_blob`), the layer cache (`scanner.cache.ScanCache`) and the analysis
processes (`scanner.layers.analysis`, where `scanner.layers.image.ImageAnalysis` takes bytes in
and gives verdicts out; nothing under scanner/layers/ imports scanner/registry/). The scan
(`scanner.scan`) drives it. For one platform image, layers go top layer first:

- a layer that must never be fetched (foreign or non-distributable: `not_distributable`) is
  skipped and named; the analysis counts it unread;
- the layer's cache entry (every consumer's evidence, by layer digest, in the store so it is
  shared by every image and process) is offered first, the entries of all the image's layers
  read in one go before the first; only when it does not cover every consumer that still needs
  the layer is the blob streamed, once, into one walk;
- a layer another scan of this process is reading right now is waited for, not fetched twice:
  the scans that need it wait for that one read, then take its cache entry all at once; one
  that fails fails them with it (the same bytes), one cancelled hands the read to the next, one
  whose inline budget ran out hands them the bytes it kept (below). So a
  thousand platforms of one index that share a layer cost one read and a thousand cache offers,
  not a thousand turns on it, each waking every scan still waiting;
- the loop ends as soon as no lower layer can change a verdict (`done`);
- an image whose cache entries and layers still to read are small is analysed inline, on this
  process's event loop within `inline_analysis_bytes` and `inline_analysis_ms` (`InlineBudget`),
  not handed to an analysis process; one that reaches that budget starts over in one, its layers
  read whole so far taken from the cache then, and the layer it was reading given the bytes the
  registry already sent (the rest of that small blob is read to its end and checked against its
  digest first), so a hand-over never fetches a layer twice.

Bytes are counted as the registry sends them (`BlobStream.bytes_received`: partial reads
included, and the rest of a range asked for when a read stops), per platform image in its
`LayerProgress`, which the UI shows while the read runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scanner.layers.analysis import AnalysisPool, Session
from scanner.layers.image import ImageVerdict
from scanner.layers.limits import (
    INLINE_FINISHED,
    INLINE_HANDED_OVER,
    INLINE_OUTCOMES,
    AnalysisLimits,
    InlineBudget,
    InlineBudgetSpent,
    LimitExceeded,
)
from scanner.models import SkippedLayer
from scanner.registry.descriptors import Descriptor, not_distributable

if TYPE_CHECKING:  # the registry client is only passed in; importing it costs TLS set-up at start
    from scanner.cache import ScanCache
    from scanner.registry.blobs import BlobStream
    from scanner.registry.client import RegistryClient
    from scanner.registry.reference import Reference

MiB = 1 << 20
# A layer inflates 2 to 5 times: the compressed size counts this much against the inline budget.
INLINE_INFLATION = 4


@dataclass
class LayerProgress:
    """How far one platform image's layer read has come; kept current as bytes stream in."""

    layers_total: int
    bytes_total: int
    layers_done: int = 0
    bytes_fetched: int = 0  # compressed bytes that reached this host, partial reads included
    skipped: list[SkippedLayer] = field(default_factory=list)

    def describe(self) -> str:
        return (
            f"reading layers: {self.layers_done} of {self.layers_total},"
            f" {self.bytes_fetched / MiB:.0f} of {self.bytes_total / MiB:.0f} MiB fetched"
        )


class LayerReader:
    """Shared by all scans of one process: the in-flight map, the memory cache, the analysis pool."""

    def __init__(
        self,
        client: RegistryClient,
        store: ScanCache | None,
        limits: AnalysisLimits,
        pool: AnalysisPool,
        inline: InlineBudget | None = None,
        inline_counts: dict[str, int] | None = None,
    ) -> None:
        self.client = client
        self.store = store
        self.limits = limits
        self.pool = pool
        self.inline = inline  # None: every image's analysis goes to the pool as it is
        # Images analysed inline, by outcome (`INLINE_OUTCOMES`); the caller's dict, when given, so
        # that /metrics reads it (`gpubadge_inline_analyses_total`).
        self.inline_counts = inline_counts if inline_counts is not None else dict.fromkeys(INLINE_OUTCOMES, 0)
        self._memory_cache: dict[str, str] = {}  # cache entries by digest, when running without a store
        self._inflight: dict[str, _Read] = {}  # digest -> the read of it running now

    @property
    def analysed_inline(self) -> int:
        """Images whose verdict came inline."""
        return self.inline_counts[INLINE_FINISHED]

    @property
    def handed_over(self) -> int:
        """Inline analyses that reached their budget and started over in the pool."""
        return self.inline_counts[INLINE_HANDED_OVER]

    async def _cached(self, digest: str) -> str | None:
        if self.store is None:
            return self._memory_cache.get(digest)
        return await self.store.layer_evidence(digest)

    async def _cached_all(self, layers: Sequence[Descriptor]) -> dict[str, str]:
        """The cache entries of every layer that may be fetched, in one read of the store."""
        digests = [layer.digest for layer in layers if not_distributable(layer) is None]
        if self.store is None:
            return {digest: self._memory_cache[digest] for digest in digests if digest in self._memory_cache}
        return await self.store.layer_evidences(digests) if digests else {}

    async def _remember(self, digest: str, entry_json: str) -> None:
        if self.store is None:
            self._memory_cache[digest] = entry_json
        else:
            await self.store.save_layer_evidence(digest, entry_json)

    async def _offer_cached(self, digest: str, session: Session, known: dict[str, str] | None) -> bool | None:
        """The layer's cache entry offered to `session`: True when it covers what the session needs,
        False when it was taken but does not cover it, None when there is none. `known`: the
        entries read for the whole image a moment ago (absent there is absent), else the cache is read."""
        cached = known.get(digest) if known is not None else await self._cached(digest)
        if cached is None:
            return None
        return await session.use_cached(cached)

    async def _layer(
        self,
        reference: Reference,
        layer: Descriptor,
        session: Session,
        progress: LayerProgress,
        *,
        whole: bool,
        known: dict[str, str],
        replay: dict[str, bytes] | None = None,
        inline: bool = False,
    ) -> None:
        """Feed one layer to `session`: from `replay` when an inline read of this image fetched it
        before its hand-over, else from the cache when it covers it (`known`: the image's entries as
        read before its first layer), else read once (a read of the same digest running now is
        waited for, then its entry offered, read afresh). `inline`: the session runs within the
        inline budget; where it spends it mid-layer, the layer's bytes are kept in `replay`."""
        digest = layer.digest
        first: dict[str, str] | None = known
        while True:
            # Fetched by an inline read before its hand-over; dropped once fed, so that a session
            # that is inline too and spends its budget on it leaves the bytes to the next one.
            kept = replay.get(digest) if replay is not None else None
            if kept is not None and replay is not None:
                await self._replay(kept, layer, session)
                del replay[digest]
                return
            covered = await self._offer_cached(digest, session, first)
            first = None
            if covered:
                return
            running = self._inflight.get(digest)
            if running is not None:
                await running.done.wait()
                if isinstance(running.error, InlineBudgetSpent):
                    # That scan's image went to an analysis process: its bytes, where it kept them,
                    # else the layer is read here.
                    if running.kept is not None and replay is not None:
                        replay[digest] = running.kept
                    continue
                if running.error is not None:
                    raise running.error  # the same bytes fail the same way for every scan of them
                if covered is None:
                    continue  # offer the entry it wrote
                while (running := self._inflight.get(digest)) is not None:
                    await running.done.wait()  # the session took a partial entry: read it after that
            read = self._inflight[digest] = _Read()
            try:
                await self._read(
                    reference, layer, session, progress, whole=whole, keep=replay if inline else None
                )
            except asyncio.CancelledError:
                raise  # this scan only: a scan waiting for the read takes it over
            except Exception as exc:
                read.error = exc
                if isinstance(exc, InlineBudgetSpent) and replay is not None:
                    read.kept = replay.get(digest)
                raise
            finally:
                del self._inflight[digest]
                read.done.set()
            return

    async def analyse(
        self,
        reference: Reference,
        layers: Sequence[Descriptor],
        arch: str,
        *,
        cuda: bool,
        deadline: float,
        progress: LayerProgress,
        overrides: Mapping[str, str] | None = None,
    ) -> ImageVerdict:
        """Every layer verdict of one platform image (layers as the manifest lists them). `overrides`:
        the builds its config makes packages load (`GpuFacts.build_overrides`).

        Raises `LimitExceeded` past a content bound, `LayerError` for a layer that is not a valid
        archive, `RegistryError` when a blob cannot be fetched; `progress` still says what was
        fetched and skipped.
        """
        if len(layers) > self.limits.max_layers:
            raise LimitExceeded(f"image has {len(layers):,} layers", self.limits.max_layers, "max_layers")
        known = await self._cached_all(layers)  # one read for the image, not one per layer
        inline = self._inline_budget(layers, known)
        replay: dict[str, bytes] = {}  # a layer the inline walk was reading at its hand-over: its bytes
        if inline is not None:
            try:
                verdict = await self._analyse(
                    reference, layers, arch, cuda, deadline, progress, known, inline, overrides, replay
                )
                self.inline_counts[INLINE_FINISHED] += 1
                return verdict
            except InlineBudgetSpent:
                self.inline_counts[INLINE_HANDED_OVER] += 1
                progress.layers_done = 0  # the bytes fetched stay counted: the registry sent them
                progress.skipped.clear()
                known = await self._cached_all(layers)  # with what the inline walk read whole
        return await self._analyse(
            reference, layers, arch, cuda, deadline, progress, known, None, overrides, replay
        )

    def _inline_budget(self, layers: Sequence[Descriptor], known: dict[str, str]) -> InlineBudget | None:
        """The inline budget, when the image's cache entries and the layers it may still read (their
        compressed sizes, `INLINE_INFLATION` times) fit in its bytes; else None."""
        budget = self.inline
        if budget is None or self.pool.processes <= 0:
            return None
        cost = sum(len(entry) for entry in known.values())
        for layer in layers:
            if layer.digest not in known and not_distributable(layer) is None:
                cost += INLINE_INFLATION * layer.size  # sizes are never negative (Descriptor)
        return budget if cost <= budget.bytes else None

    async def _analyse(
        self,
        reference: Reference,
        layers: Sequence[Descriptor],
        arch: str,
        cuda: bool,
        deadline: float,
        progress: LayerProgress,
        known: dict[str, str],
        inline: InlineBudget | None,
        overrides: Mapping[str, str] | None = None,
        replay: dict[str, bytes] | None = None,
    ) -> ImageVerdict:
        session = await self.pool.open(
            arch, len(layers), self.limits, deadline, cuda=cuda, inline=inline, overrides=overrides
        )
        try:
            for layer in reversed(layers):  # manifests list layers bottom-up
                if session.done:
                    break
                skip = not_distributable(layer)
                if skip is not None:
                    await session.skip_layer()
                    progress.skipped.append(
                        SkippedLayer(
                            digest=layer.digest, size=layer.size, media_type=layer.media_type, reason=skip
                        )
                    )
                else:
                    await self._layer(
                        reference,
                        layer,
                        session,
                        progress,
                        whole=cuda,
                        known=known,
                        replay=replay,
                        inline=inline is not None,
                    )
                progress.layers_done += 1
            return await session.verdict(progress.bytes_fetched, progress.bytes_total)
        finally:
            session.close()

    async def _read(
        self,
        reference: Reference,
        layer: Descriptor,
        session: Session,
        progress: LayerProgress,
        *,
        whole: bool,
        keep: dict[str, bytes] | None = None,
    ) -> None:
        """Stream one layer into the session: in one request when it will be read whole (a deep
        scan), else in growing ranges, so that an early stop costs at most the rest of one range.

        `keep` (an inline session): where the session spends its inline budget on this layer, and
        the blob is no bigger than that budget's bytes, the rest of the blob is read (its digest
        checked at the end) and all of it kept there under its digest, for the analysis process
        the image's analysis starts over in (`_replay`); a blob that cannot be read to its end
        is not kept, and that process fetches it."""
        stream: BlobStream | None = None
        taken: list[bytes] | None = None
        if keep is not None and self.inline is not None and layer.size <= self.inline.bytes:
            taken = []
        try:
            async with self.client.stream_blob(
                reference, layer.digest, size=layer.size, ranged=not whole
            ) as stream:
                try:
                    outcome = await session.read_layer(_counted(stream, progress, taken), layer.media_type)
                except InlineBudgetSpent:
                    if taken is not None and keep is not None:
                        whole_blob = await _rest_of(stream, progress, taken, layer.size)
                        if whole_blob is not None:
                            keep[layer.digest] = whole_blob
                    raise
        finally:
            if stream is not None:  # what arrived unread at the early close counts too
                progress.bytes_fetched += stream.bytes_received - stream.bytes_read
        if outcome.evidence_json is not None:
            await self._remember(layer.digest, outcome.evidence_json)

    async def _replay(self, data: bytes, layer: Descriptor, session: Session) -> None:
        """Feed `session` a layer's bytes that an inline read already fetched and checked: counted
        as fetched once, where the registry sent them."""
        outcome = await session.read_layer(_once(data), layer.media_type)
        if outcome.evidence_json is not None:
            await self._remember(layer.digest, outcome.evidence_json)


@dataclass
class _Read:
    """One layer read running now: set `done` when it ends, with `error` when it failed (and `kept`,
    the blob's bytes, where an inline read that spent its budget kept them)."""

    done: asyncio.Event = field(default_factory=asyncio.Event)
    error: Exception | None = None
    kept: bytes | None = None


async def _counted(
    stream: BlobStream, progress: LayerProgress, taken: list[bytes] | None = None
) -> AsyncIterator[bytes]:
    """The stream's chunks, counted in `progress`; each also kept in `taken` when given."""
    async for chunk in stream:
        progress.bytes_fetched += len(chunk)
        if taken is not None:
            taken.append(chunk)
        yield chunk


async def _rest_of(
    stream: BlobStream, progress: LayerProgress, taken: list[bytes], size: int
) -> bytes | None:
    """The whole blob: `taken`, what was read of `stream` so far, and the rest of it, read here (no
    more than `size` bytes in all) and checked against its digest; None where it cannot be read to
    its end, is not `size` bytes long or does not match (the analysis process then fetches it afresh)."""
    try:
        async for _ in _counted(stream, progress, taken):
            if stream.bytes_read > size:
                return None
    except Exception:  # a registry error or a digest mismatch, met again by the fetch that follows
        return None
    return b"".join(taken) if stream.verified and stream.bytes_read == size else None


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data
