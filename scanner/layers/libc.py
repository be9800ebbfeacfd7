"""Which C library an image's root filesystem carries, read top-down from its layers.

The core is pure and incremental. Layers are fed **top layer first**; each contributes a
`LayerEvidence` (a small, serialisable summary: the relevant files, symlinks, whiteouts and
opaque dirs it holds, the ELF interpreters of the binaries that matter, os-release). The
merged view follows OCI overlay rules: an upper layer's entry shadows lower ones, a
`.wh.name` whiteout or a `.wh..wh..opq` opaque dir hides lower content, and a non-directory
hides everything a lower layer has beneath it.

Decisive evidence, strongest first:
1. the ELF interpreter (PT_INTERP) of `/bin/sh`, or of another common binary
   (`/usr/bin/env`, `/bin/busybox`, `/bin/bash`, python3, ...), after following symlinks
   (`/bin/sh -> busybox`, usrmerge `/bin -> usr/bin`) through the merged view:
   `ld-musl-*` => musl, `ld-linux*`/`ld64.so.*` => glibc. This decides as soon as it is
   known, so a scan stops reading mid-layer.
2. after every layer is read, the per-architecture loaders (`ld-linux-*.so.*`, `ld64.so.*`,
   `ld-musl-*.so.1` in /lib, /lib64, /usr/lib, /lib/<triplet>, ...; symlinks count): glibc
   if a glibc loader is present (with `musl_also` when a musl one is too), else musl.
3. no interpreter and no loader anywhere => `none` (scratch, static binaries).
`unknown` when not every layer could be read, or a probed binary's ELF header is unreadable.
`musl_also` reflects the layers read before the verdict was decided.

How the orchestrator drives it (per platform image):

    analysis = LibcAnalysis(arch, layers_total=len(layers))
    for layer in layers_top_down:
        if analysis.decided:
            break
        cached = cache.get(layer.digest)                      # LayerEvidence JSON, by digest
        if cached is not None and analysis.layer_from_cache(cached):
            continue                                           # False: partial and not enough
        evidence = await analyse_layer(analysis, chunks, media_type)
        cache.put(layer.digest, evidence)                      # prefer complete over partial
    verdict = analysis.verdict(bytes_read=..., bytes_total=...)

In the scanner this runs inside `scanner.layers.image.ImageAnalysis`, which attaches a
`LayerCollector` to the one walk of each layer (in an analysis process, `scanner.layers.analysis`)
beside the other consumers; `analyse_layer` is the libc walk alone on the caller's event loop.
A walk with only this collector stops pulling bytes once `analysis.decided`.

Cost (the content is hostile): the merged view is indexed as entries arrive, so a lookup
is a few dictionary probes whatever the number of layers, and the verdict is re-derived
only when an indexed change touches a path the last derivation looked at (a probe, a
component of its link chain, an os-release path) and the walk asks (once per decompressed
slice). Resolution follows Linux: more than `max_symlink_hops` links is ELOOP, a name past
`max_path_bytes` is ENAMETOOLONG; every component resolved is charged to the image's
`max_path_components`, and a layer keeps at most `max_layer_records` records. Past a
bound `LimitExceeded` propagates and the scan fails naming it.

Errors from the stream (CorruptLayer, LimitExceeded) propagate after the partial evidence has been recorded as incomplete, so
`verdict()` stays truthful (`unknown` unless already decided). `combine()` is the pure
one-shot form over cached evidences. Which paths matter, what each says, and the per-layer
`LayerEvidence` are `scanner.layers.libc_paths`.
"""

from __future__ import annotations

import posixpath
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Literal

from scanner.layers.elf import ElfInfo, parse_elf
from scanner.layers.libc_paths import (
    ANCESTORS,
    BIN_DIRS,
    EVIDENCE_SCHEMA,
    OS_RELEASE_PATHS,
    PROBES,
    TRIPLET_DIR,
    LayerEvidence,
    PathRecord,
    classify_interpreter,
    is_probe,
    is_relevant,
    loader_flavour,
    parse_os_release,
)
from scanner.layers.limits import AnalysisLimits, LimitExceeded, ScanBudget
from scanner.layers.tarstream import StreamStats, TarEntry
from scanner.layers.walk import LayerWalk
from scanner.layers.whiteouts import WhiteoutIndex, whiteout_target
from scanner.models import LibcFlavour, LibcVerdict

HEAD_BYTES = 4096
OS_RELEASE_BYTES = 16384
DISTRO_BUDGET = 256 << 10  # compressed bytes read past the decision while looking for os-release

# Substrings of loader names that belong to each Docker architecture (used to pick the evidence).
_ARCH_HINTS: dict[str, tuple[str, ...]] = {
    "amd64": ("x86-64", "x86_64"),
    "arm64": ("aarch64",),
    "arm": ("armhf", "ld-linux.so.3", "musl-arm"),
    "386": ("ld-linux.so.2", "i386"),
    "ppc64le": ("ld64.so.2", "powerpc64le"),
    "s390x": ("ld64.so.1", "s390x"),
    "riscv64": ("riscv64",),
    "loong64": ("loongarch",),
}

Lookup = Literal["found", "absent", "unknown"]


@dataclass
class _Layer:
    entries: dict[str, PathRecord] = field(default_factory=dict)
    whiteouts: set[str] = field(default_factory=set)
    opaque: set[str] = field(default_factory=set)
    complete: bool = False

    @classmethod
    def from_evidence(cls, evidence: LayerEvidence) -> _Layer:
        return cls(
            dict(evidence.entries), set(evidence.whiteouts), set(evidence.opaque_dirs), evidence.complete
        )

    def evidence(self) -> LayerEvidence:
        return LayerEvidence(
            complete=self.complete,
            entries=dict(self.entries),
            whiteouts=sorted(self.whiteouts),
            opaque_dirs=sorted(self.opaque),
        )


@dataclass(frozen=True)
class _Decision:
    flavour: Literal["glibc", "musl"]
    evidence: str


def _components(path: str) -> list[str]:
    """A path's components, dropping empty and `.` ones (they never change what a path names)."""
    return [part for part in path.split("/") if part and part != "."]


class LayerCollector:
    """Builds one layer's evidence from its tar entries. Get one from `LibcAnalysis.begin_layer`.

    It is an `EntryCollector` (see `scanner.layers.walk`): `wants` says how much of an entry's
    content to read, `add` takes the entry, `satisfied` says the layer walk may stop.
    """

    def __init__(self, analysis: LibcAnalysis, layer: _Layer, index: int, distro_budget: int) -> None:
        self._analysis = analysis
        self._layer = layer
        self._index = index
        self._bin_elves: dict[str, ElfInfo] = {}  # probed ELF files of this layer, for later hardlinks
        self._wanted: set[str] = set()  # symlink targets of probes not seen yet
        self._finished = False
        self._distro_budget = distro_budget
        self._decided_at: int | None = None
        self.position = 0  # compressed bytes read so far, kept up to date by the walk
        self._kept = 0  # records, whiteouts and ELF heads kept, against max_layer_records

    def _keep(self) -> None:
        """Count one more thing this layer keeps in memory (and in its evidence)."""
        self._kept += 1
        limit = self._analysis.limits.max_layer_records
        if self._kept > limit:
            raise LimitExceeded(
                f"a layer holds more than {limit:,} entries the libc analysis must keep",
                limit,
                "max_layer_records",
            )

    def wants(self, entry: TarEntry) -> int:
        """How many leading content bytes of `entry` to read (0: none)."""
        if entry.kind != "file":
            return 0
        if entry.path in OS_RELEASE_PATHS:
            return OS_RELEASE_BYTES
        if posixpath.dirname(entry.path) in BIN_DIRS or entry.path in self._wanted:
            return HEAD_BYTES
        return 0

    @property
    def satisfied(self) -> bool:
        """The verdict is decided and os-release found, or looked for long enough past the decision."""
        if not self._analysis.decided:
            return False
        if self._decided_at is None:
            self._decided_at = self.position
        return self._analysis.distro_known or self.position - self._decided_at > self._distro_budget

    def add(self, entry: TarEntry, head: bytes) -> None:
        if self._finished:
            raise RuntimeError("layer already finished")
        path = entry.path
        directory, name = posixpath.split(path)
        hidden = whiteout_target(directory, name)
        if hidden is not None:
            self._add_whiteout(*hidden)
            return
        elf: ElfInfo | None = None
        probed = bool(head) or (entry.kind == "file" and self.wants(entry) > 0)
        if entry.kind == "file" and probed:
            elf = parse_elf(head)
            if elf is not None:
                self._keep()
                self._bin_elves[path] = elf
        wanted = path in self._wanted
        if not (is_relevant(path) or wanted):
            return
        record = PathRecord(kind=entry.kind, probed=probed and entry.kind == "file", elf=elf)
        if entry.kind == "symlink":
            record.target = entry.linkname
            self._want_target(path, entry.linkname)
        elif entry.kind == "hardlink":
            record.target = entry.linkname
            if entry.linkname in self._bin_elves:  # tar puts a hardlink after its target
                record.probed, record.elf = True, self._bin_elves[entry.linkname]
        if path in OS_RELEASE_PATHS and entry.kind == "file":
            record.os_release = parse_os_release(head.decode("utf-8", "replace"))
        self._wanted.discard(path)
        self._keep()
        self._layer.entries[path] = record
        self._analysis._index_record(self._index, path, record)

    def _add_whiteout(self, kind: str, path: str) -> None:
        """Keep the whiteouts and opaque dirs that can hide something the verdict looks at."""
        if kind == "opaque":
            if path in ANCESTORS or TRIPLET_DIR.match(path):
                self._keep()
                self._layer.opaque.add(path)
                self._analysis._index_hide(self._index, path, opaque=True)
        elif is_relevant(path):
            self._keep()
            self._layer.whiteouts.add(path)
            self._analysis._index_hide(self._index, path, opaque=False)

    def _want_target(self, path: str, target: str) -> None:
        """Remember where a probe's symlink points, so that file's head is read too."""
        if not (is_probe(path) or path in self._wanted) or not target:
            return
        absolute = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
        if absolute in self._layer.entries:
            return
        if absolute in self._bin_elves:  # the target came first: record it now
            record = PathRecord(kind="file", probed=True, elf=self._bin_elves[absolute])
            self._layer.entries[absolute] = record
            self._analysis._index_record(self._index, absolute, record)
        else:
            self._wanted.add(absolute)

    def finish(self, complete: bool) -> LayerEvidence:
        """Close the layer; `complete` says whether every entry was seen."""
        if not self._finished:
            self._finished = True
            self._layer.complete = complete
            self._analysis._end_layer(complete)
        return self._layer.evidence()


class LibcAnalysis:
    """Pure, incremental libc analysis over layers fed top-down. See the module docstring.

    The merged view is indexed as layers arrive: `_records` keeps the topmost visible
    record of each relevant path, and `_hides` (`scanner.layers.whiteouts.WhiteoutIndex`)
    what whiteouts, opaque dirs and non-directories hide from lower layers. A lookup is then
    a few dictionary probes, whatever the number of layers. The verdict is re-decided only
    when an indexed change touches a path the last decision looked at (`_watched`), so the
    work is O(entries + changes), not O(entries x layers).
    """

    def __init__(self, arch: str, layers_total: int, limits: AnalysisLimits | None = None) -> None:
        self.arch = arch
        self.layers_total = layers_total
        self.limits = limits or AnalysisLimits()
        self.budget = ScanBudget(self.limits)
        self._layers: list[_Layer] = []
        self._incomplete = 0  # layers not (yet) read to their end, so `all_read` is O(1)
        self._from_cache = 0  # layers taken from the layer cache, not streamed
        self._open: LayerCollector | None = None
        self._records: dict[str, tuple[int, PathRecord]] = {}
        self._hides = WhiteoutIndex()
        self._watched: set[str] = set()
        self._dirty = True
        self._decision: _Decision | None = None
        self._distro_found: str | None = None
        self.decisions = 0  # how often the verdict was re-derived (tests assert it stays O(changes))

    # -- feeding

    def begin_layer(self, distro_budget: int = DISTRO_BUDGET) -> LayerCollector:
        """Start streaming the next lower layer."""
        if self._open is not None:
            raise RuntimeError("finish the current layer before starting another")
        layer = _Layer()
        self._layers.append(layer)
        self._incomplete += 1  # until finished complete
        self._open = LayerCollector(self, layer, len(self._layers) - 1, distro_budget)
        return self._open

    def layer_from_cache(self, evidence: LayerEvidence) -> bool:
        """Use cached evidence for the next lower layer.

        Returns False (and changes nothing) when the evidence cannot be used: another
        schema, or a partial layer that does not decide the verdict for this image; the
        caller then streams the layer instead.
        """
        if self._open is not None:
            raise RuntimeError("finish the current layer before adding another")
        if evidence.schema_version != EVIDENCE_SCHEMA:
            return False
        self._add_layer(_Layer.from_evidence(evidence))
        if evidence.complete or self.decided:
            self._from_cache += 1
            return True
        self._drop_last_layer()
        return False

    def _add_layer(self, layer: _Layer) -> None:
        index = len(self._layers)
        self._layers.append(layer)
        self._incomplete += 0 if layer.complete else 1
        for path in layer.whiteouts:
            self._index_hide(index, path, opaque=False)
        for path in layer.opaque:
            self._index_hide(index, path, opaque=True)
        for path, record in layer.entries.items():
            self._index_record(index, path, record)

    def forget_last_layer(self) -> None:
        """Undo the last `layer_from_cache`, so the same layer can be streamed instead."""
        if self._open is not None or not self._layers:
            raise RuntimeError("no cached layer to forget")
        self._drop_last_layer()

    def _drop_last_layer(self) -> None:
        """Undo `_add_layer` of the lowest layer: it only ever added keys of its own index."""
        index = len(self._layers) - 1
        layer = self._layers.pop()
        self._incomplete -= 0 if layer.complete else 1
        for path in layer.entries:
            if path in self._records and self._records[path][0] == index:
                del self._records[path]
        self._hides.forget(index, [*layer.entries, *layer.whiteouts, *layer.opaque])
        self._dirty = True

    def _index_record(self, index: int, path: str, record: PathRecord) -> None:
        current = self._records.get(path)
        if current is not None and current[0] < index:
            return  # shadowed by an upper layer
        if current is None and self._hides.hidden_above(path, index):
            return
        self._records[path] = (index, record)
        if record.kind != "dir":
            self._hides.cover(index, path)  # a non-directory hides what lower layers have under it
        self._touch(path)

    def _index_hide(self, index: int, path: str, *, opaque: bool) -> None:
        """A whiteout (`path` and all under it) or an opaque dir (all under it) of layer `index`."""
        changed = self._hides.cover(index, path) if opaque else self._hides.delete(index, path)
        if changed:
            self._touch(path)

    def _touch(self, path: str) -> None:
        if path in self._watched:
            self._dirty = True

    def _end_layer(self, complete: bool) -> None:
        # Not a change of the merged view: the decision stands (it reads only what is found, and a
        # layer's end turns lookups from unknown to absent at most).
        self._open = None
        if complete:
            self._incomplete -= 1

    # -- state

    @property
    def layers_read(self) -> int:
        return len(self._layers)

    @property
    def all_read(self) -> bool:
        """Every layer was seen to its end: nothing more can change the verdict."""
        return self._open is None and len(self._layers) >= self.layers_total and self._incomplete == 0

    @property
    def decided(self) -> bool:
        """True when reading further layers (or further into this one) cannot change the flavour."""
        return self._current_decision() is not None or self.all_read

    @property
    def distro_known(self) -> bool:
        """os-release was found in the merged view read so far."""
        self._current_decision()
        return self._distro_found is not None

    def _current_decision(self) -> _Decision | None:
        if self._dirty and not self._records:  # nothing read yet: nothing to find, and still to decide
            self._decision = self._distro_found = None
            return None
        if self._dirty:
            self.decisions += 1
            self._watched = set()
            self._decision = self._decide()
            self._distro_found = self._distro()
            self._dirty = False
        return self._decision

    # -- the merged view

    def _lookup(self, path: str, parent_hidden: bool) -> tuple[Lookup, PathRecord | None]:
        """`path` in the merged view; `parent_hidden`: a layer hides everything under its parent."""
        self._watched.add(path)
        hit = self._records.get(path)
        if hit is not None:
            return "found", hit[1]
        if parent_hidden or self._hides.is_deleted(path):
            return "absent", None
        return ("absent" if self.all_read else "unknown"), None

    def _resolve(self, path: str) -> tuple[Lookup, str, PathRecord | None]:
        """Follow symlinks component by component through the merged view.

        Linux semantics: more than `max_symlink_hops` links is a loop (ELOOP) and a name
        longer than `max_path_bytes` does not exist (ENAMETOOLONG); both count as absent.
        Every component resolved is charged to the scan's `max_path_components`.
        """
        limits = self.limits
        stack: list[tuple[str, bool]] = [("/", False)]  # directories walked, and "all below hidden"
        pending = _components(path)[::-1]
        hops = 0
        while pending:
            part = pending.pop()
            self.budget.spend_components(1)
            if part == "..":
                if len(stack) > 1:
                    stack.pop()
                continue
            current, below_hidden = stack[-1]
            candidate = f"{current}/{part}" if current != "/" else f"/{part}"
            if len(candidate) > limits.max_path_bytes:
                return "absent", candidate, None
            status, record = self._lookup(candidate, below_hidden)
            if record is not None and record.kind == "symlink" and record.target:
                hops += 1
                if hops > limits.max_symlink_hops:
                    return "absent", candidate, None
                if record.target.startswith("/"):
                    stack = [("/", False)]
                pending.extend(reversed(_components(record.target)))
                continue
            if not pending:
                if record is not None and record.kind == "hardlink" and not record.probed and record.target:
                    hops += 1
                    if hops > limits.max_symlink_hops:
                        return "absent", candidate, None
                    stack = [("/", False)]
                    pending = _components(record.target)[::-1]
                    continue
                return status, candidate, record
            if record is not None and record.kind != "dir":
                return "absent", candidate, None  # a file where a directory should be
            hidden = below_hidden or self._hides.hides_below(candidate)
            stack.append((candidate, hidden))  # a directory, explicit or implied by its children
        return "found", stack[-1][0], None

    def _decide(self) -> _Decision | None:
        for probe in PROBES:
            status, final, record = self._resolve(probe)
            if status != "found" or record is None or record.elf is None:
                continue
            interpreter = record.elf.interpreter
            flavour = classify_interpreter(interpreter) if interpreter is not None else None
            if flavour is None:
                continue
            shown = probe if final == probe else f"{probe} -> {final}"
            return _Decision(flavour, f"{shown}: ELF interpreter {interpreter}")
        return None

    def _visible_loaders(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {"glibc": [], "musl": []}
        for path, (_, record) in self._records.items():
            flavour = loader_flavour(path)
            if flavour is not None and record.kind not in ("dir", "other"):
                found[flavour].append(path)
        hints = _ARCH_HINTS.get(self.arch, ())
        for paths in found.values():
            paths.sort(key=lambda p: (not any(h in posixpath.basename(p) for h in hints), p))
        return found

    def _unreadable_probe(self) -> str | None:
        for probe in PROBES:
            status, final, record = self._resolve(probe)
            if status == "found" and record is not None and record.elf is not None and record.elf.error:
                return f"{final}: unreadable ELF header ({record.elf.error})"
        return None

    def _distro(self) -> str | None:
        for path in OS_RELEASE_PATHS:
            status, _, record = self._resolve(path)
            if status == "found" and record is not None and record.os_release:
                return record.os_release
        return None

    def verdict(self, *, bytes_read: int = 0, bytes_total: int = 0) -> LibcVerdict:
        """The verdict from what has been fed so far (`unknown` if undecided and unfinished)."""
        decision = self._current_decision()
        loaders = self._visible_loaders()
        flavour: LibcFlavour
        musl_also = False
        if decision is not None:
            flavour, evidence = decision.flavour, decision.evidence
            musl_also = flavour == "glibc" and bool(loaders["musl"])
            if flavour == "musl" and loaders["glibc"]:
                evidence += f" (glibc loader {loaders['glibc'][0]} also present)"
        elif not self.all_read:
            flavour, evidence = "unknown", "not every layer could be read"
        elif loaders["glibc"]:
            flavour, evidence = "glibc", f"loader {loaders['glibc'][0]}"
            if loaders["musl"]:
                musl_also = True
                evidence += f" (musl loader {loaders['musl'][0]} also present)"
        elif loaders["musl"]:
            flavour, evidence = "musl", f"loader {loaders['musl'][0]}"
        elif (unreadable := self._unreadable_probe()) is not None:
            flavour, evidence = "unknown", unreadable
        else:
            flavour, evidence = "none", "no ELF interpreter or C library loader in any layer"
        return LibcVerdict(
            flavour=flavour,
            evidence=evidence,
            distro=self._distro_found,
            musl_also=musl_also,
            layers_read=self.layers_read,
            layers_total=self.layers_total,
            layers_cached=self._from_cache,
            bytes_read=bytes_read,
            bytes_total=bytes_total,
        )


def combine(
    evidences_top_down: Iterable[LayerEvidence], arch: str = "amd64", layers_total: int | None = None
) -> LibcVerdict:
    """The verdict from already-built layer evidences (top layer first), e.g. all from cache."""
    evidences = list(evidences_top_down)
    analysis = LibcAnalysis(arch, layers_total if layers_total is not None else len(evidences))
    for evidence in evidences:
        if analysis.decided:
            break
        analysis._add_layer(_Layer.from_evidence(evidence))
    return analysis.verdict()


async def analyse_layer(
    analysis: LibcAnalysis,
    chunks: AsyncIterator[bytes],
    media_type: str,
    *,
    distro_budget: int = DISTRO_BUDGET,
    stats: StreamStats | None = None,
) -> LayerEvidence:
    """Stream one layer into `analysis` in this process, stopping as soon as the verdict is decided.

    Once decided, it reads on for os-release only while the distro is unknown and at most
    `distro_budget` more compressed bytes (cheap in a base layer, never a whole big layer).
    Returns the layer's evidence (`complete=False` when it stopped early). Stream errors
    propagate after the partial evidence is recorded as incomplete. This is the libc analysis
    alone, for tests and tools; the scanner drives it through `scanner.layers.image`.
    """
    collector = analysis.begin_layer(distro_budget)
    walk = LayerWalk(media_type, [collector], budget=analysis.budget, stats=stats)
    try:
        async with aclosing(_aiter(chunks)) as iterator:
            async for chunk in iterator:
                if not walk.feed(chunk):
                    break
            else:
                walk.close()
    except BaseException:
        collector.finish(complete=False)
        raise
    return collector.finish(complete=walk.stats.reached_end)


async def _aiter(chunks: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    async for chunk in chunks:
        yield chunk
