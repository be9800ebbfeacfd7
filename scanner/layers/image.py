"""The layer analysis of one platform image: one walk of each layer feeds every consumer. Pure.

Two consumers read layers: the libc analysis (`scanner.layers.libc`), which usually decides
in the first KiB of the top layer, and the inferred-CUDA collector (`scanner.layers.cuda_evidence`),
which must see every entry of every layer. `ImageAnalysis` is the one place that decides, layer
by layer (top layer first), which of them still need the layer:

- `use_cached(entry)` takes what the cache already holds for the layer (a `CachedLayer`: each
  consumer's evidence, complete or partial); it answers True when the cache covers every
  consumer that still needs the layer, so the layer is not fetched at all;
- otherwise `begin_layer` builds one `LayerWalk` with exactly the consumers the cache did not
  cover. With the CUDA collector attached the layer is read whole, so the libc collector rides
  along even after the verdict is decided (its evidence is then complete, for the cache);
  without it the walk stops as soon as the libc verdict is decided;
- `finish_layer` returns the layer's new cache entry: per consumer, the better of what the
  cache held and what was read (a complete read never gives way to a partial one);
- `skip_layer` records a layer that is never fetched (foreign or non-distributable): the
  consumers count it as unread, so their verdicts say so instead of guessing.

Every walk runs under the one `ScanBudget` of the image, so every consumer is bounded alike
(`scanner.layers.limits`). An analysis run inline (on the scanning process's event loop) is also
held to its `InlineBudget`: cache entries count their bytes, and a layer whose GPU code needs more
than `INLINE_GPU_CODE_STEPS` raises `InlineBudgetSpent` when it ends, its entry never returned.
The session protocol (`scanner.layers.analysis`) runs this in an analysis process, or in the
scanning process when it has none.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, Field, ValidationError

from scanner.layers.cuda_evidence import (
    CUDA_EVIDENCE_SCHEMA,
    MAX_ARCH_FILES,
    CudaEntryCollector,
    CudaLayerEvidence,
    combine,
    layer_problems,
)
from scanner.layers.libc import DISTRO_BUDGET, LayerCollector, LibcAnalysis
from scanner.layers.libc_paths import EVIDENCE_SCHEMA, LayerEvidence
from scanner.layers.limits import (
    INLINE_GPU_CODE_STEPS,
    AnalysisLimits,
    InlineBudget,
    InlineBudgetSpent,
    ScanBudget,
)
from scanner.layers.walk import EntryCollector, LayerWalk
from scanner.models import GpuArchs, InferredCuda, LibcVerdict

CACHE_SCHEMA = 2


class CachedLayer(BaseModel):
    """What one layer gave each consumer, cached by layer digest and shared by every image."""

    schema_version: int = CACHE_SCHEMA
    libc: LayerEvidence | None = None
    cuda: CudaLayerEvidence | None = None

    @classmethod
    def parse(cls, text: str) -> CachedLayer:
        """A cache entry; an entry of another schema, or unreadable, counts as empty."""
        try:
            data = json.loads(text)
        except ValueError:
            return cls()
        if not isinstance(data, dict):
            return cls()
        try:
            if data.get("schema_version") == CACHE_SCHEMA:
                return cls.model_validate(data)
            if data.get("schema_version") == EVIDENCE_SCHEMA and "entries" in data:
                return cls(libc=LayerEvidence.model_validate(data))  # written before the one walk
        except ValidationError:
            pass
        return cls()


class ImageVerdict(BaseModel):
    """Every layer verdict of one platform image."""

    libc: LibcVerdict
    inferred: InferredCuda | None = None
    archs: GpuArchs | None = None
    warnings: list[str] = Field(default_factory=list)


@dataclass(frozen=True)
class LayerReply:
    """What reading one layer gave: the new cache entry (JSON) and where the analysis stands."""

    evidence_json: str
    complete: bool
    done: bool


Evidence = TypeVar("Evidence", LayerEvidence, CudaLayerEvidence)


def _better(old: Evidence | None, new: Evidence | None) -> Evidence | None:
    """A complete read wins over a partial one; between equals, the newer."""
    if new is None:
        return old
    if old is not None and old.complete and not new.complete:
        return old
    return new


def _usable_cuda(evidence: CudaLayerEvidence | None) -> bool:
    return evidence is not None and evidence.complete and evidence.schema_version == CUDA_EVIDENCE_SCHEMA


@functools.lru_cache(maxsize=8)
def _inline_walk_limits(limits: AnalysisLimits, steps: int) -> AnalysisLimits:
    """`limits` with a layer's GPU code bounded by `steps` (one copy per limits and steps)."""
    if limits.max_layer_gpu_code_steps <= steps:
        return limits
    return limits.model_copy(update={"max_layer_gpu_code_steps": steps})


class ImageAnalysis:
    """The layer analysis of one platform image. See the module docstring.

    `cuda`: whether the carried-CUDA and GPU-code consumer runs (GPUBADGE_DEEP_SCAN: every image by
    default; chosen per image by the scanner). `overrides`: package -> the CUDA version of the build
    its config makes it load (`GpuFacts.build_overrides`). Layers are fed top layer first, each exactly once: through
    `use_cached`, `begin_layer` + `finish_layer` (or `fail_layer`), or `skip_layer`.
    """

    def __init__(
        self,
        arch: str,
        layers_total: int,
        limits: AnalysisLimits,
        deadline: float,
        *,
        cuda: bool,
        inline: InlineBudget | None = None,
        overrides: Mapping[str, str] | None = None,
    ) -> None:
        self.limits = limits
        self.overrides = dict(overrides or {})  # the builds the config makes packages load
        self.layers_total = layers_total
        self.budget = ScanBudget(limits, deadline, inline)
        # Inline, a layer's GPU code is read within INLINE_GPU_CODE_STEPS (checked in `finish_layer`).
        self._walk_limits = limits if inline is None else _inline_walk_limits(limits, INLINE_GPU_CODE_STEPS)
        self.libc = LibcAnalysis(arch, layers_total, limits)
        self.libc.budget = self.budget
        self.cuda = cuda
        self._cuda_layers: list[CudaLayerEvidence] = []
        self._cached = CachedLayer()  # the cache entry of the layer being read
        self._libc_from_cache = False
        self._cuda_from_cache = False
        self._libc_collector: LayerCollector | None = None
        self._cuda_collector: CudaEntryCollector | None = None
        self._walk: LayerWalk | None = None
        self.layers_fed = 0  # layers taken so far, by any of the three ways

    @property
    def done(self) -> bool:
        """No lower layer can change a verdict: libc is decided and CUDA is not looked for."""
        return not self.cuda and self.libc.decided

    @property
    def finished(self) -> bool:
        """Nothing more will be fed: the image is done, or every one of its layers was taken."""
        return self.done or self.layers_fed >= self.layers_total

    # -- one layer

    def use_cached(self, entry_json: str) -> bool:
        """Take the cached evidence of the next layer; True when no consumer needs it read."""
        self.budget.spend_inline_bytes(len(entry_json))
        entry = CachedLayer.parse(entry_json)
        self._cached = entry
        self._libc_from_cache = False
        if not self.libc.decided and entry.libc is not None:
            self._libc_from_cache = self.libc.layer_from_cache(entry.libc)
        self._cuda_from_cache = self.cuda and _usable_cuda(entry.cuda)
        if self._cuda_from_cache:
            assert entry.cuda is not None
            self._cuda_layers.append(entry.cuda)
        covered = (self._libc_from_cache or self.libc.decided) and (not self.cuda or self._cuda_from_cache)
        if covered:
            self.layers_fed += 1
            self._reset()  # this layer is done; the next one starts clean
        return covered

    def begin_layer(self, media_type: str) -> LayerWalk:
        """The walk of the next layer, with the consumers the cache did not cover."""
        if self._walk is not None:
            raise RuntimeError("finish the current layer before starting another")
        collectors: list[EntryCollector] = []
        read_whole = self.cuda and not self._cuda_from_cache
        cached_libc = self._cached.libc
        libc_partial = not (cached_libc is not None and cached_libc.complete)
        if read_whole and self._libc_from_cache and libc_partial:
            # A partial cached read decided the verdict, but this walk reads the layer whole anyway:
            # take the libc evidence from it, complete, for the next image sharing the layer.
            self.libc.forget_last_layer()
            self._libc_from_cache = False
        if not self._libc_from_cache and (not self.libc.decided or (read_whole and libc_partial)):
            self._libc_collector = self.libc.begin_layer(DISTRO_BUDGET)
            collectors.append(self._libc_collector)
        if read_whole:
            self._cuda_collector = CudaEntryCollector(self._walk_limits)
            collectors.append(self._cuda_collector)
        self._walk = LayerWalk(media_type, collectors, budget=self.budget)
        return self._walk

    def finish_layer(self) -> LayerReply:
        """Close the layer being read; its new cache entry and whether the image is done."""
        walk = self._walk
        if walk is None:
            raise RuntimeError("no layer is being read")
        complete = walk.stats.reached_end
        collector = self._cuda_collector
        if self._walk_limits is not self.limits and collector is not None and collector.gpu_code_exceeded:
            raise InlineBudgetSpent(f"a layer's GPU code needs more than {INLINE_GPU_CODE_STEPS:,} steps")
        libc, cuda = self._close_collectors(complete)
        entry = CachedLayer(libc=_better(self._cached.libc, libc), cuda=_better(self._cached.cuda, cuda))
        self.layers_fed += 1
        self._reset()
        return LayerReply(entry.model_dump_json(exclude_none=True), complete, self.done)

    def fail_layer(self) -> None:
        """The layer could not be read to its end (an error): every consumer counts it unread."""
        if self._walk is not None:
            self._close_collectors(False)
        self.layers_fed += 1
        self._reset()

    def skip_layer(self) -> None:
        """A layer that is never fetched (foreign, non-distributable): counted as unread."""
        self._cached, self._libc_from_cache, self._cuda_from_cache = CachedLayer(), False, False
        self.begin_layer("application/vnd.oci.image.layer.v1.tar")
        self.fail_layer()

    def _close_collectors(self, complete: bool) -> tuple[LayerEvidence | None, CudaLayerEvidence | None]:
        libc = self._libc_collector.finish(complete) if self._libc_collector is not None else None
        cuda = None
        if self._cuda_collector is not None:
            cuda = self._cuda_collector.finish(complete)
            self._cuda_layers.append(cuda)
        return libc, cuda

    def _reset(self) -> None:
        self._walk, self._libc_collector, self._cuda_collector = None, None, None
        self._cached, self._libc_from_cache, self._cuda_from_cache = CachedLayer(), False, False

    # -- the verdicts

    def verdict(self, *, bytes_read: int, bytes_total: int) -> ImageVerdict:
        """Every verdict from what was fed so far (unknown where a needed layer was not read)."""
        libc = self.libc.verdict(bytes_read=bytes_read, bytes_total=bytes_total)
        if not self.cuda:
            return ImageVerdict(libc=libc)
        inferred, archs = combine(self._cuda_layers, layers_total=self.layers_total, overrides=self.overrides)
        warnings = []
        if inferred is not None and not inferred.complete:
            warnings.append("not every layer could be read; CUDA evidence may be missing")
        warnings += layer_problems(list(reversed(self._cuda_layers)))
        if archs is not None and archs.files_not_listed:
            warnings.append(
                f"{archs.files_not_listed:,} more files with GPU code were neither listed nor judged (the"
                f" report keeps {MAX_ARCH_FILES:,}, in path order)"
            )
        return ImageVerdict(libc=libc, inferred=inferred, archs=archs, warnings=warnings)
