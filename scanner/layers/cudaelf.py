"""One ELF file's bytes, fed in order -> the CUDA libraries it links and the archs its fatbins hold.

Pure and streaming: a layer is read once, front to back, so the probe never seeks. It keeps
the first `HEAD_BYTES` (ELF and program headers), the PT_DYNAMIC segment, the section header
table and a window before it (where GNU ld puts `.shstrtab`), and it notes, as bytes pass:
* every fatbin container (see `scanner.layers.fatbin.FatbinScan`);
* every place a CUDA library name (`libcudart.so.12\\0`, or as auditwheel renames its bundled copy,
  `libcudart-c64a25f3.so.12.3.101\\0`) occurs, so that DT_NEEDED entries
  (offsets into `.dynstr`, which lies *before* `.dynamic` in linkers' output) can be resolved
  exactly at the end. Names are matched exactly: `libcuda.so.1` (the driver) is not `libcudart`;
* every place outside the loaded segments where a fatbin section's name (`.nv_fatbin`,
  `__nv_relfatbin`) occurs, so those sections are named even where the section name table lies
  outside the window (lld puts the symbol names, often hundreds of MB, between it and the section
  header table; patchelf moves the table past segments it appends), and device-link input is never
  taken for code CUDA loads.
Every region kept is bounded by a named limit; a file that exceeds one gets an `error`, never
an unbounded buffer. The work is bounded too (`scanner.layers.limits.GpuCodeWork`, counted by the
fatbin scan): a file past a bound gets that bound as its fatbin's error, and sections that name the
same bytes again are walked once; a layer past its bound leaves the fatbins of its later files unread,
each saying so. Their DT_NEEDED names are read all the same.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, Field

from scanner.layers.elf import (
    ET_REL,
    MAX_DYNAMIC_BYTES,
    MAX_SECTION_HEADER_SIZE,
    MAX_SECTION_HEADERS,
    PT_LOAD,
    SHT_NOBITS,
    ElfLayout,
    parse_dynamic,
    parse_layout,
    parse_sections,
)
from scanner.layers.fatbin import (
    LOADED_SECTION,
    MAX_SIGNATURES_PER_FILE,
    RELOCATABLE_SECTION,
    ArchSummary,
    FatbinError,
    FatbinScan,
    merge_signatures,
    summarise,
)
from scanner.layers.limits import GpuCodeWork
from scanner.models import ContainerArchs

HEAD_BYTES = 4096
ELF_MAGIC_BYTES = 64  # smaller files cannot be ELF (the ELF64 header alone is 64 bytes)
SECTION_NAMES_WINDOW = 64 << 10
MAX_NAME_SITES = 4096
MAX_LISTED_SECTIONS = 16  # section names a file's report lists (real files have one or two)
FATBIN_SECTIONS = (".nv_fatbin", "__nv_relfatbin")

# The CUDA libraries whose SONAME names a CUDA major (cuDNN, NCCL and friends: the CUDA stack).
CUDA_LIBRARIES = (
    "cudart",
    "cublas",
    "cublasLt",
    "cufft",
    "cufftw",
    "curand",
    "cusparse",
    "cusparseLt",
    "cusolver",
    "cusolverMg",
    "cudnn",
    "nccl",
    "nvrtc",
    "nvJitLink",
    "cupti",
    "nvjpeg",
    "cufile",
    "nvToolsExt",
    "npp[a-z]{0,16}",
    "cudnn_[a-z_]{1,64}",
    "cuda",
)
# auditwheel renames the copies of libraries it bundles into a wheel's `<name>.libs/` with 8 hex digits
# of their hash (`libcudart-c64a25f3.so.12.3.101`), and the files that link them name them so.
AUDITWHEEL_HASH = r"(?:[-.][0-9a-f]{8})?"
_NAME = re.compile(
    rb"lib(?:"
    + "|".join(CUDA_LIBRARIES).encode()
    + rb")"
    + AUDITWHEEL_HASH.encode()
    + rb"\.so(?:\.[0-9]{1,8}){0,4}\x00"
)
_NAME_KEEP = 128  # longer than any name the pattern matches, so a name split across chunks is found
# The fatbin sections' names, as the section name table holds them: where they stream past outside the
# loaded segments (the table is never loaded) is kept, so a section is named even when that table lies
# far before the section header table (lld puts `.strtab`, often the file's largest section, between
# them: TensorFlow 2.15's `libtensorflow_cc.so.2`, 140 MB; patchelf appends segments between them).
# Found by their last word, one pass over the unloaded bytes (most of them symbol names), then checked
# whole. (Naming `.rodata` and its kind too, for reports, would cost the probe 10 % more on torch.)
_SECTION_NAME_ENDS = {b"fatbin\0": (".nv_fatbin", "__nv_relfatbin")}
MAX_SECTION_NAME_SITES = 256  # places those names are kept (a real file has one of each)


class FatbinFacts(BaseModel):
    """The fatbin sections of one file and the distinct container contents in them."""

    sections: list[str] = Field(default_factory=list)
    containers: list[ContainerArchs] = Field(default_factory=list)
    archs: ArchSummary = Field(default_factory=ArchSummary)
    error: str | None = None


class ElfCudaFacts(BaseModel):
    """What one ELF file says about CUDA. `needed`: exact CUDA SONAMEs in DT_NEEDED."""

    elf_type: int = 0
    needed: list[str] = Field(default_factory=list)
    fatbin: FatbinFacts | None = None
    error: str | None = None

    @property
    def relevant(self) -> bool:
        return bool(self.needed or self.fatbin)


class _Capture:
    """Keeps the bytes of one file region [start, start+size) as they stream past."""

    def __init__(self, start: int, size: int) -> None:
        self.start, self.size = start, size
        self.data = bytearray()

    @property
    def full(self) -> bool:
        return len(self.data) >= self.size

    def feed(self, offset: int, data: bytes | memoryview) -> None:
        if self.full:
            return
        low = max(self.start + len(self.data), offset)
        high = min(self.start + self.size, offset + len(data))
        if low < high and low == self.start + len(self.data):
            self.data += data[low - offset : high - offset]


def unloaded_ranges(layout: ElfLayout, size: int) -> list[tuple[int, int]]:
    """The file ranges [low, high) of a file of `size` bytes that no PT_LOAD segment maps: where the
    section name table, never loaded, lies (patchelf appends segments after it)."""
    ranges, position = [], 0
    for low, high in sorted((s.offset, s.offset + s.filesz) for s in layout.segments if s.type == PT_LOAD):
        if low > position:
            ranges.append((position, min(low, size)))
        position = max(position, high)
    if position < size:
        ranges.append((position, size))
    return [(low, high) for low, high in ranges if low < high]


class ElfCudaProbe:
    """Feed `feed(data)` with consecutive bytes of one file, then call `finish()`.

    `feed` returns False once the probe wants no more bytes (the file is not ELF), so the
    caller can skip the rest without reading it.
    """

    def __init__(self, size: int, work: GpuCodeWork | None = None) -> None:
        self.size = size
        self._head = bytearray()
        self._position = 0
        self._layout: ElfLayout | None = None
        self._not_elf = False
        self._scan = FatbinScan(work)
        self._unread = self._scan.work.exhausted  # the layer's bound, crossed before this file
        self._names: dict[int, str] = {}
        self._carry = b""  # the last bytes seen, so a name split across chunks is found
        self._names_overflow = False
        self._section_names_at: dict[int, str] = {}  # file offset -> fatbin section name there
        self._unloaded: list[tuple[int, int]] = [(0, size)]  # file ranges no PT_LOAD segment maps
        self._dynamic: _Capture | None = None
        self._table: _Capture | None = None
        self._section_names: _Capture | None = None
        self._error: str | None = None

    @property
    def is_elf(self) -> bool | None:
        """None until enough bytes were seen to tell."""
        if self._layout is not None:
            return True
        return False if self._not_elf else None

    def feed(self, data: bytes | memoryview) -> bool:
        if self._not_elf:
            return False
        offset = self._position
        self._position += len(data)
        if self._layout is None:
            self._head += data[: HEAD_BYTES - len(self._head)]
            if len(self._head) >= 4 and self._head[:4] != b"\x7fELF":
                self._not_elf = True
                return False
            if len(self._head) < min(HEAD_BYTES, self.size) and self._position < self.size:
                self._feed_scan(offset, data)
                self._find_strings(offset, data)
                return True
            layout = parse_layout(bytes(self._head))
            if layout is None:
                self._not_elf = True
                return False
            self._start(layout)
        self._feed_scan(offset, data)
        self._find_strings(offset, data)
        for capture in (self._dynamic, self._table, self._section_names):
            if capture is not None:
                capture.feed(offset, data)
        return True

    def _feed_scan(self, offset: int, data: bytes | memoryview) -> None:
        if self._unread is None:
            self._scan.feed(offset, data)

    def _start(self, layout: ElfLayout) -> None:
        self._layout = layout
        self._unloaded = unloaded_ranges(layout, self.size)
        head = bytes(self._head)
        dynamic = layout.dynamic
        if dynamic is not None:
            if dynamic.filesz > MAX_DYNAMIC_BYTES:
                self._error = f"PT_DYNAMIC of {dynamic.filesz} bytes exceeds {MAX_DYNAMIC_BYTES}"
            else:
                self._dynamic = _Capture(dynamic.offset, dynamic.filesz)
        table = layout.section_table
        if table is not None and table[1] <= MAX_SECTION_HEADERS * MAX_SECTION_HEADER_SIZE:
            self._table = _Capture(*table)
            window_start = max(table[0] - SECTION_NAMES_WINDOW, 0)
            self._section_names = _Capture(window_start, table[0] - window_start)
        for capture in (self._dynamic, self._table, self._section_names):
            if capture is not None:
                capture.feed(0, head)

    def _find_strings(self, offset: int, data: bytes | memoryview) -> None:
        """Note where CUDA library names and fatbin section names stream past (resolved in `finish`)."""
        names_full = len(self._section_names_at) >= MAX_SECTION_NAME_SITES
        if self._names_overflow and names_full:
            return
        window = self._carry + data
        base = offset - len(self._carry)
        if not self._names_overflow:
            self._find_names(window, base)
        if not names_full:
            for low, high in self._unloaded:  # the section name table is never loaded
                if low < base + len(window) and high > base:
                    self._find_section_names(window, base, max(low - base, 0), min(high - base, len(window)))
        self._carry = window[-_NAME_KEEP:]

    def _find_names(self, window: bytes, base: int) -> None:
        for match in _NAME.finditer(window):
            at = base + match.start()
            if at in self._names:
                continue
            if len(self._names) >= MAX_NAME_SITES:
                self._names_overflow = True
                return
            self._names[at] = match.group()[:-1].decode("ascii")

    def _find_section_names(self, window: bytes, base: int, start: int, end: int) -> None:
        for last, names in _SECTION_NAME_ENDS.items():
            at = window.find(last, start, end)
            while at >= 0:
                for name in names:
                    begin = at + len(last) - 1 - len(name)
                    if begin >= start and window[begin : at + len(last) - 1] == name.encode():
                        self._section_names_at[base + begin] = name
                        if len(self._section_names_at) >= MAX_SECTION_NAME_SITES:
                            return
                at = window.find(last, at + 1, end)

    def finish(self) -> ElfCudaFacts | None:
        """None when the file is not ELF; else what it says about CUDA."""
        if self._layout is None:
            if self._not_elf or self._position == 0:
                return None
            layout = parse_layout(bytes(self._head))
            if layout is None:
                return None
            self._start(layout)
        assert self._layout is not None
        facts = ElfCudaFacts(elf_type=self._layout.elf_type, error=self._error)
        if self._position < self.size:
            facts.error = f"only {self._position} of {self.size} bytes were read"
        facts.needed = self._needed()
        facts.fatbin = self._fatbin()
        return facts

    def _needed(self) -> list[str]:
        layout = self._layout
        if layout is None or self._dynamic is None or not self._dynamic.full:
            return []
        info = parse_dynamic(layout, bytes(self._dynamic.data))
        if info.strtab_vaddr is None:
            return []
        strtab = layout.file_offset(info.strtab_vaddr)
        if strtab is None:
            return []
        names = (self._names.get(strtab + offset) for offset in info.needed)
        return sorted({name for name in names if name is not None})

    def _fatbin(self) -> FatbinFacts | None:
        layout = self._layout
        stopped = self._scan.stopped  # a bound crossed reading this file: its GPU code is not known
        if layout is None or self._table is None or not self._table.full:
            return FatbinFacts(error=str(stopped)) if stopped else None
        names = self._section_names
        try:
            sections = parse_sections(
                layout,
                bytes(self._table.data),
                bytes(names.data) if names is not None else None,
                names.start if names is not None else 0,
                self._section_names_at,
            )
        except ValueError as exc:
            return FatbinFacts(error=str(stopped or exc)) if self._scan.met_containers or stopped else None
        named = [s for s in sections if s.name in FATBIN_SECTIONS and s.type != SHT_NOBITS and s.size]
        if not named and not any(s.name for s in sections) and self._unread is None:
            # Section names lie outside what was kept: match by contents (containers tile the section).
            named = [
                s for s in sections if s.type != SHT_NOBITS and s.size and self._scan.tiles(s.offset, s.size)
            ]
        loose: list[ContainerArchs] = []
        if layout.elf_type != ET_REL and self._scan.met_containers and self._unread is None:
            fatbin_sections = {id(s) for s in named}  # by identity: comparing models pairwise was quadratic
            hosts = [
                (s.name or f"section at {s.offset:#x}", s.offset, s.size)
                for s in sections
                if s.type != SHT_NOBITS and s.size and id(s) not in fatbin_sections
            ]
            try:
                loose = self._scan.loose(hosts)
            except FatbinError as exc:
                return FatbinFacts(error=str(exc))
        if not named and not loose:
            return FatbinFacts(error=str(stopped)) if stopped else None
        listed = dict.fromkeys(s.name or f"section at {s.offset:#x}" for s in named)  # each name once
        facts = FatbinFacts(sections=list(listed)[:MAX_LISTED_SECTIONS])
        if self._unread is not None:
            facts.error = f"not read: {self._unread}"
            return facts
        containers: list[ContainerArchs] = []  # one shared record per container (see FatbinScan.chain)
        walked: set[tuple[int, int, str]] = set()  # sections naming bytes already walked are not walked again
        for section in named:
            kind = RELOCATABLE_SECTION if section.name == RELOCATABLE_SECTION else LOADED_SECTION
            if (section.offset, section.size, kind) in walked:
                continue
            walked.add((section.offset, section.size, kind))
            try:
                containers.extend(self._scan.chain(section.offset, section.size, section=kind))
            except FatbinError as exc:
                facts.error = f"{section.name or 'fatbin section'}: {exc}"
                break
        if facts.error is None:
            containers.extend(loose)
            extra = sorted({c.section for c in loose} - set(facts.sections))
            facts.sections = [*facts.sections, *extra][:MAX_LISTED_SECTIONS]
        signatures = merge_signatures(containers)
        if len(signatures) > MAX_SIGNATURES_PER_FILE:
            facts.error = f"more than {MAX_SIGNATURES_PER_FILE} distinct container contents"
            signatures = signatures[:MAX_SIGNATURES_PER_FILE]
        facts.containers = signatures
        if facts.error is None:
            facts.archs = summarise(signatures)
        if layout.elf_type == ET_REL:
            facts.sections = [f"{name} (relocatable object)" for name in facts.sections]
        return facts
