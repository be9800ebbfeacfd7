"""One walk over a layer's tar entries, feeding every consumer attached to it.

A layer is decompressed and parsed once, whatever reads it. Each consumer plugs in as an
`EntryCollector`: for every entry the walk asks each collector how many leading content
bytes it `wants` (the walk reads the largest request once), hands the entry and that head
to every collector's `add`, lets one streaming collector read whole members as they pass
(the CUDA probe reads ELF files), and stops pulling bytes as soon as every collector is
`satisfied` (the early stop: a libc verdict is usually known after a few KiB of the top
layer; the CUDA collector is never satisfied, so with it attached the layer is read whole).

`scanner.layers.image.ImageAnalysis` decides per layer which collectors to attach (libc,
inferred CUDA) and builds the walk; the bounds of `AnalysisLimits` apply to the walk itself
(`LayerFeeder`), so every consumer reads under the same ones. Collectors run wherever the
walk runs: in an analysis process (`scanner.layers.analysis`), or in the scanning process
for tests and `analysis_processes = 0`. They must be pure and bounded per entry, and what
they build must be a small JSON-able summary. The walk is synchronous: it is pushed
compressed chunks, so the caller owns the I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from scanner.layers.limits import ScanBudget
from scanner.layers.tarstream import ContentSink, LayerFeeder, StreamStats, TarEntry


class EntryCollector(Protocol):
    """One analysis fed by a layer walk. See the module docstring."""

    position: int  # compressed bytes read so far in this layer; the walk keeps it current

    def wants(self, entry: TarEntry) -> int:
        """Leading content bytes of `entry` this collector needs (0: none)."""
        ...

    def add(self, entry: TarEntry, head: bytes) -> None:
        """Take one entry and (at least) the head it asked for; `head` may be longer."""
        ...

    @property
    def satisfied(self) -> bool:
        """True when no further entry of this layer can change what this collector finds."""
        ...


class StreamingCollector(EntryCollector, Protocol):
    """A collector that also reads whole members as they stream past (never buffered by the walk)."""

    def stream(self, entry: TarEntry) -> ContentSink | None:
        """A sink for `entry`'s content, or None. The walk feeds the head too."""
        ...


class LayerWalk:
    """Push compressed chunks of one layer; entries go to every collector. See the module docstring."""

    def __init__(
        self,
        media_type: str,
        collectors: Sequence[EntryCollector],
        *,
        budget: ScanBudget,
        stats: StreamStats | None = None,
    ) -> None:
        self.collectors = list(collectors)
        self.stats = stats if stats is not None else StreamStats()
        self._feeder = LayerFeeder(
            media_type,
            want=self._want,
            on_entry=self._add,
            stats=self.stats,
            stop=self._satisfied,
            budget=budget,
            stream=self._stream if any(hasattr(c, "stream") for c in self.collectors) else None,
        )

    def _stream(self, entry: TarEntry) -> ContentSink | None:
        for collector in self.collectors:
            stream = getattr(collector, "stream", None)
            sink: ContentSink | None = stream(entry) if stream is not None else None
            if sink is not None:
                return sink  # one streaming collector per walk (the CUDA probe)
        return None

    def _want(self, entry: TarEntry) -> int:
        return max((collector.wants(entry) for collector in self.collectors), default=0)

    def _add(self, entry: TarEntry, head: bytes) -> None:
        for collector in self.collectors:
            collector.add(entry, head)

    def _satisfied(self) -> bool:
        position = self.stats.compressed_bytes
        for collector in self.collectors:
            collector.position = position
        return all(collector.satisfied for collector in self.collectors)

    def feed(self, chunk: bytes) -> bool:
        """Take the next compressed chunk; False once no more is wanted (end, or all satisfied)."""
        return self._feeder.feed(chunk)

    def close(self) -> None:
        """End of input: checks the archive ended properly (raises CorruptLayer otherwise)."""
        self._feeder.close()
