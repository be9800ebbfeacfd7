"""CUDA fatbin containers -> the GPU architectures a binary can run on. Pure, bounded, streaming.

Layout (little-endian, checked against `cuobjdump --list-elf --list-ptx` on NVIDIA's wheels):

* a `.nv_fatbin` (shared objects, executables) or `__nv_relfatbin` (`-rdc` objects) section holds
  containers back to back; each starts with a 16-byte header: u32 magic 0xBA55ED50, u16 version 1,
  u16 header size 16, u64 bytes that follow;
* entries follow it; an entry header's size varies (64, 80, 96, 120), so it is read from the header:
  0x00 u16 kind (1 PTX, 2 ELF/SASS), 0x04 u32 header size, 0x08 u64 payload size,
  0x18 u16 minor, 0x1A u16 major (the PTX ISA for PTX), 0x1C u32 arch (90 = sm_90), 0x28 u64 flags
  (0x100000: an arch-specific `a` build, 0x200000: a family-specific `f` build).

Whether a container holds any kernel: a container with no entries holds none, and neither does one
whose every cubin (ELF) entry is small, uncompressed and has no kernel entry in its symbol table
(`STT_FUNC` with the CUDA entry bit, 0x10, in `st_other`; `cuobjdump -symbols` prints it as ENTRY),
and whose every PTX entry is of an arch one of those cubins is built for: nvcc assembles a real
arch's SASS from that arch's PTX, so both hold the same kernels. PTX is often compressed, so it is
never read for this; a PTX of an arch with no cubin beside it counts as holding kernels. cuda-cccl
1.2.1's `libcccl.c.parallel.so` (CUDA 13.1) carries 13 such containers, SASS and PTX for sm_75
holding libcu++'s global objects and no kernel (cuobjdump extracts no `.entry` from them); read as
code, their PTX ISA 9.1 asked every GPU past Turing for CUDA 13.1's driver.
nvcc 13 puts such an empty module first in the fatbin of every program it builds, beside the module
with the program's kernels: empty when only PTX is asked for, else a kernel-free cubin per real arch.
CUDA never needs it for a launch, so a program built for `sm_80` plus PTX runs on a Hopper GPU
though that module has no code for one (checked on an H200: bench/gpu_host_check.py). Those cubins
are read as they stream past, at most `MAX_INSPECTED_CUBIN` bytes each and `MAX_INSPECTED_BYTES`
per file, each distinct cubin once however many containers name it; any other entry, or one past
those bounds, counts as holding kernels.

Bounded in work as in bytes (`scanner.layers.limits.GpuCodeWork`): every container met and walked,
every entry header read (a chain that converges with another's is counted for each container
walking it) and every symbol the kernel-free check reads is counted against the file's bounds and
the layer's. Past one, the scan stops reading the file and every walk of it fails naming the bound.

Why a stream scanner: a layer is read once, front to back, and an ELF file's section headers
sit at its end, after the fatbin. `FatbinScan` therefore notes every container it meets (its
magic at an 8-byte aligned offset) and walks each one's entry headers as the bytes pass, keeping
only a few small numbers per container. Once the section headers are known, `chain()` walks the
section from its first byte, container after container, so containers outside the section (libcupti
keeps valid ones in `.rodata`) are ignored and containers no wrapper references are not.

What the scanner reports is what the bytes say: each container's SASS and PTX archs, its PTX ISA
and the section it sits in. Which GPU a container, a file or an image runs on is placement's
knowledge (`placement.gpu_code`), judged as CUDA loads the code.
"""

from __future__ import annotations

import heapq
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field

from scanner.layers.limits import GpuCodeWork, LimitExceeded
from scanner.models import ContainerArchs

CONTAINER_MAGIC = 0xBA55ED50
CONTAINER_PREFIX = struct.pack("<IHH", CONTAINER_MAGIC, 1, 16)
CONTAINER_HEADER = 16
ENTRY_HEADER_MIN = 64  # the fields read end at 0x40
MAX_ENTRY_HEADER = 4096
MAX_ENTRIES_PER_CONTAINER = 4096
MAX_SIGNATURES_PER_FILE = 32  # distinct container contents kept per file (real libraries: 1-3)
# nvcc 13's empty module is a 1.4-1.7 KiB cubin per arch; a kernel's cubin is larger, and so is read
# only up to here; the per-file bound keeps a library of many small cubins from costing more.
MAX_INSPECTED_CUBIN = 64 * 1024
MAX_INSPECTED_BYTES = 4 * 1024 * 1024
ELF_MAGIC = b"\x7fELF"
KIND_PTX, KIND_ELF = 1, 2
FLAG_ARCH_SPECIFIC = 0x100000
FLAG_FAMILY_SPECIFIC = 0x200000
LOADED_SECTION = ".nv_fatbin"  # what CUDA registers and loads from a shared object or executable
RELOCATABLE_SECTION = "__nv_relfatbin"  # device-link input (`-rdc`): nvlink reads it, CUDA never loads it
_KEEP = ENTRY_HEADER_MIN + len(CONTAINER_PREFIX)  # bytes carried between chunks

# PTX ISA version -> the toolkit that introduced it (the PTX ISA release history, as NVIDIA's cuda-python
# maps it too). 9.0 and 9.2-9.5 are also what PyPI's nvcc 13.0.88, 13.2.86, 13.3.73, 13.4.92 and 13.5.37
# write (`nvcc -ptx`, `.version`).
PTX_ISA_TOOLKITS: dict[tuple[int, int], tuple[int, int]] = {
    (3, 0): (4, 1), (3, 1): (5, 0), (3, 2): (5, 5), (4, 0): (6, 0), (4, 1): (6, 5), (4, 2): (7, 0),
    (4, 3): (7, 5), (5, 0): (8, 0), (6, 0): (9, 0), (6, 1): (9, 1), (6, 2): (9, 2), (6, 3): (10, 0),
    (6, 4): (10, 1), (6, 5): (10, 2),
    **{(7, minor): (11, minor) for minor in range(9)},
    **{(8, minor): (12, minor) for minor in range(6)},
    (8, 6): (12, 7),
    (8, 7): (12, 8),
    (8, 8): (12, 9),
    **{(9, minor): (13, minor) for minor in range(6)},
}  # fmt: skip
NEWEST_PTX_ISA = max(PTX_ISA_TOOLKITS)


_ARCH = re.compile(r"^(\d{2,4})([af]?)$")
Variant = Literal["", "a", "f"]
CC = tuple[int, int]


class FatbinError(ValueError):
    """A fatbin section or container does not hold what its headers say."""


def parse_arch(arch: str) -> tuple[int, int, Variant]:
    """`"90a"` -> (9, 0, "a"); `"121"` -> (12, 1, ""). Raises ValueError on anything else."""
    match = _ARCH.match(arch)
    if match is None:
        raise ValueError(f"not a CUDA arch: {arch!r}")
    number = int(match.group(1))
    variant: Variant = match.group(2)  # type: ignore[assignment]
    return number // 10, number % 10, variant


def arch_name(number: int, variant: Variant = "") -> str:
    return f"{number}{variant}"


def arch_sort_key(arch: str) -> tuple[int, int, str]:
    major, minor, variant = parse_arch(arch)
    return major, minor, variant


class ArchSummary(BaseModel):
    """Every arch the given containers hold code for: `sass` (cubins), `ptx` (PTX to JIT). Facts, not
    a verdict: where the code runs is `placement.gpu_code`'s answer."""

    sass: list[str] = Field(default_factory=list)
    ptx: list[str] = Field(default_factory=list)


def summarise(containers: Sequence[ContainerArchs]) -> ArchSummary:
    """The union of the archs of the containers CUDA loads (device-link input left out)."""
    loaded = [c for c in containers if c.section != RELOCATABLE_SECTION]
    sass = {arch for c in loaded for arch in c.sass}
    ptx = {arch for c in loaded for arch in c.ptx}
    return ArchSummary(sass=sorted(sass, key=arch_sort_key), ptx=sorted(ptx, key=arch_sort_key))


def ptx_toolkit(isa: str | None) -> str | None:
    """The CUDA release that wrote PTX of this ISA ("8.7" -> "12.8"), or None when unknown (older than
    CUDA 4.1, or newer than the table: `placement.cuda_drivers` judges those)."""
    major, _, minor = (isa or "").partition(".")
    if not (major.isdigit() and minor.isdigit()):
        return None
    toolkit = PTX_ISA_TOOLKITS.get((int(major), int(minor)))
    return f"{toolkit[0]}.{toolkit[1]}" if toolkit else None


def merge_signatures(containers: Iterable[ContainerArchs]) -> list[ContainerArchs]:
    """Collapse containers with identical contents into one with a count (order of first sight)."""
    counts: dict[tuple[tuple[str, ...], tuple[str, ...], str | None, str, bool], int] = {}
    for container in containers:
        counts[container.signature] = counts.get(container.signature, 0) + container.count
    return [
        ContainerArchs(sass=sass, ptx=ptx, ptx_isa=isa, count=count, section=section, kernels=kernels)
        for (sass, ptx, isa, section, kernels), count in counts.items()
    ]


_FUNC_INFO = bytes(1 if value & 0xF == 2 else 0 for value in range(256))  # st_info says STT_FUNC
_ENTRY_OTHER = bytes(1 if value & 0x10 else 0 for value in range(256))  # st_other has CUDA's entry bit


def cubin_has_kernel(cubin: bytes | bytearray, work: GpuCodeWork | None = None) -> bool:
    """Whether an uncompressed cubin (a 64-bit little-endian ELF) names a kernel entry in its symbol
    tables. Anything unreadable counts as having one: this only ever lets an empty module off.

    Each distinct SYMTAB is read once, its symbols tested in bulk; they are counted in `work`
    (`max_cubin_symbols`), which raises `LimitExceeded` past its bound."""
    if cubin[:4] != ELF_MAGIC or len(cubin) < 64 or cubin[4] != 2 or cubin[5] != 1:
        return True
    (section_headers,) = struct.unpack_from("<Q", cubin, 0x28)
    header_size, count = struct.unpack_from("<HH", cubin, 0x3A)
    if header_size < 64 or section_headers + count * header_size > len(cubin):
        return True  # the section headers lie outside the cubin (e_shoff may be anything up to 2^64)
    tables: dict[tuple[int, int, int], None] = {}
    for index in range(count):
        at = section_headers + index * header_size
        (kind,) = struct.unpack_from("<I", cubin, at + 4)
        if kind != 2:  # SHT_SYMTAB
            continue
        offset, size = struct.unpack_from("<QQ", cubin, at + 0x18)
        (entry_size,) = struct.unpack_from("<Q", cubin, at + 0x38)
        if entry_size < 24 or offset + size > len(cubin):
            return True
        tables[offset, size, entry_size] = None
    for offset, size, entry_size in tables:
        symbols = size // entry_size
        if work is not None:
            work.read_symbols(symbols)
        end = offset + symbols * entry_size
        functions = cubin[offset + 4 : end : entry_size].translate(_FUNC_INFO)
        entries = cubin[offset + 5 : end : entry_size].translate(_ENTRY_OTHER)
        if int.from_bytes(functions, "little") & int.from_bytes(entries, "little"):
            return True  # some symbol is both STT_FUNC and a CUDA entry
    return False


# -- the stream scanner


@dataclass(slots=True)
class _Candidate:
    """A container met in the stream; filled in as its entry headers pass by."""

    start: int
    end: int = -1  # -1 until the container header was read
    sass: set[str] = field(default_factory=set)
    ptx: set[str] = field(default_factory=set)
    ptx_isa: tuple[int, int] | None = None
    entries: int = 0
    may_hold_kernels: int = 0  # entries not known to be kernel-free (read, or past the bounds)
    reading: int = 0  # cubins of this container still being read
    done: bool = False
    error: str | None = None

    def signature(self, section: str) -> tuple[tuple[str, ...], tuple[str, ...], str | None, str, bool]:
        """What `ContainerArchs.signature` of this container in `section` is."""
        return (
            tuple(sorted(self.sass, key=arch_sort_key)),
            tuple(sorted(self.ptx, key=arch_sort_key)),
            f"{self.ptx_isa[0]}.{self.ptx_isa[1]}" if self.ptx_isa else None,
            section,
            bool(self.may_hold_kernels or self.reading or not self.ptx <= self.sass),
        )


@dataclass(slots=True)
class _Cubin:
    """One small cubin's bytes, kept as they stream past until it is whole, and the containers whose
    entry it is (converging chains make one cubin the entry of many)."""

    start: int
    size: int
    containers: list[int] = field(default_factory=list)  # their starts
    data: bytearray = field(default_factory=bytearray)

    def feed(self, window: bytes, base: int) -> bool:
        """Take this cubin's next bytes from `window` (file offset `base`); True once it is whole."""
        low = max(self.start + len(self.data), base)
        high = min(self.start + self.size, base + len(window))
        if low < high and low == self.start + len(self.data):
            self.data += window[low - base : high - base]
        return len(self.data) >= self.size


_CONTAINER, _ENTRY = 0, 1


class FatbinScan:
    """Feed a file's bytes in order (`feed(offset, data)`); then ask `chain(start, size)`.

    Memory: a few numbers per container met (at most `max_fatbin_containers`), `_KEEP` carried bytes,
    and the small cubins read to tell kernel-free containers (at most `MAX_INSPECTED_BYTES` per file).
    Work: counted in `work` (see the module docstring); past a bound the scan stops (`stopped`).
    """

    def __init__(self, work: GpuCodeWork | None = None) -> None:
        self.work = work or GpuCodeWork()
        self._candidates: dict[int, _Candidate] = {}
        self._requests: list[tuple[int, int, int]] = []  # (file offset, kind, container start)
        self._carry = b""
        self._scanned = 0  # magic searched at every offset below this
        self._position = 0  # file offset just past the last byte fed
        self._cubins: dict[tuple[int, int], _Cubin] = {}  # small cubins being read, by (start, size)
        self._kernels: dict[tuple[int, int], bool] = {}  # cubins read: whether each names a kernel
        self._inspected = 0  # cubin bytes taken for that so far
        self._met = False
        self._records: dict[
            tuple[tuple[str, ...], tuple[str, ...], str | None, str, bool], ContainerArchs
        ] = {}
        self.stopped: LimitExceeded | None = None  # the bound that stopped the scan, if one did

    @property
    def position(self) -> int:
        return self._position

    @property
    def met_containers(self) -> bool:
        """A container magic was seen somewhere in the bytes fed."""
        return self._met

    def feed(self, offset: int, data: bytes | memoryview) -> None:
        if offset != self._position:
            raise ValueError(f"fatbin scan fed at {offset}, expected {self._position}")
        if not data:
            return
        self._position = offset + len(data)
        if self.stopped is not None:
            return
        window = self._carry + data
        base = offset - len(self._carry)
        try:
            self._find_magic(window, base)
            self._serve(window, base)
            if self._cubins:
                self._read_cubins(window, base)
        except LimitExceeded as exc:
            self._stop(exc)
            return
        self._carry = window[-_KEEP:]

    def _stop(self, exc: LimitExceeded) -> None:
        """A bound was crossed: keep the error, drop what the scan held, read nothing more."""
        self.stopped = exc
        self._candidates.clear()
        self._requests.clear()
        self._cubins.clear()
        self._carry = b""

    def _read_cubins(self, window: bytes, base: int) -> None:
        for key, cubin in list(self._cubins.items()):
            if not cubin.feed(window, base):
                continue
            del self._cubins[key]
            kernels = self._kernels[key] = cubin_has_kernel(cubin.data, self.work)
            for start in cubin.containers:
                candidate = self._candidates[start]
                candidate.reading -= 1
                candidate.may_hold_kernels += kernels

    def _find_magic(self, window: bytes, base: int) -> None:
        at = window.find(CONTAINER_PREFIX, max(self._scanned - base, 0))
        while at >= 0:
            start = base + at
            if start % 8 == 0 and start not in self._candidates:
                self.work.meet_container()
                self._met = True
                self._candidates[start] = _Candidate(start)
                heapq.heappush(self._requests, (start, _CONTAINER, start))
            at = window.find(CONTAINER_PREFIX, at + 1)
        self._scanned = base + len(window) - len(CONTAINER_PREFIX) + 1

    def _serve(self, window: bytes, base: int) -> None:
        end = base + len(window)
        while self._requests:
            offset, kind, start = self._requests[0]
            need = CONTAINER_HEADER if kind == _CONTAINER else ENTRY_HEADER_MIN
            if offset + need > end:
                return
            heapq.heappop(self._requests)
            candidate = self._candidates[start]
            at = offset - base
            if kind == _CONTAINER:
                (size,) = struct.unpack_from("<Q", window, at + 8)
                candidate.end = start + CONTAINER_HEADER + size
                if size == 0:
                    candidate.done = True
                else:
                    heapq.heappush(self._requests, (start + CONTAINER_HEADER, _ENTRY, start))
            else:
                self._entry(candidate, offset, window, at)

    def _entry(self, candidate: _Candidate, offset: int, window: bytes, at: int) -> None:
        self.work.read_entry()
        entry_kind, _, header_size, payload = struct.unpack_from("<HHIQ", window, at)
        minor, major, arch = struct.unpack_from("<HHI", window, at + 0x18)
        (flags,) = struct.unpack_from("<Q", window, at + 0x28)
        if not ENTRY_HEADER_MIN <= header_size <= MAX_ENTRY_HEADER:
            candidate.error = f"entry at {offset:#x} has an implausible header size {header_size}"
            return
        next_entry = offset + header_size + payload
        if next_entry > candidate.end:
            candidate.error = f"entry at {offset:#x} runs past the end of its container"
            return
        candidate.entries += 1
        if candidate.entries > MAX_ENTRIES_PER_CONTAINER:
            candidate.error = f"more than {MAX_ENTRIES_PER_CONTAINER} entries in one container"
            return
        variant: Variant = "a" if flags & FLAG_ARCH_SPECIFIC else "f" if flags & FLAG_FAMILY_SPECIFIC else ""
        if not 10 <= arch <= 9999:
            candidate.error = f"entry at {offset:#x} names an implausible arch {arch}"
            return
        if entry_kind == KIND_ELF:
            self._cubin(candidate, offset + header_size, payload)
        elif entry_kind != KIND_PTX:  # a PTX entry holds what its arch's cubin holds (`signature`)
            candidate.may_hold_kernels += 1
        if entry_kind == KIND_ELF:
            candidate.sass.add(arch_name(arch, variant))
        elif entry_kind == KIND_PTX:
            candidate.ptx.add(arch_name(arch, variant))
            if candidate.ptx_isa is None or (major, minor) > candidate.ptx_isa:
                candidate.ptx_isa = (major, minor)
        # other kinds (e.g. LTO IR) neither run nor JIT on their own
        if next_entry == candidate.end:
            candidate.done = True
        else:
            heapq.heappush(self._requests, (next_entry, _ENTRY, candidate.start))

    def _cubin(self, candidate: _Candidate, start: int, size: int) -> None:
        """A cubin entry of `candidate`: tell whether it names a kernel (once per distinct cubin)."""
        key = (start, size)
        known = self._kernels.get(key)
        if known is not None:
            candidate.may_hold_kernels += known
            return
        reading = self._cubins.get(key)
        if reading is None and size <= MAX_INSPECTED_CUBIN and self._inspected + size <= MAX_INSPECTED_BYTES:
            self._inspected += size  # read as it passes (`_read_cubins`): kernel-free or not
            reading = self._cubins[key] = _Cubin(start, size)
        if reading is None:
            candidate.may_hold_kernels += 1
            return
        reading.containers.append(candidate.start)
        candidate.reading += 1

    def chain(
        self, start: int, size: int, *, trailing_padding: int = 15, section: str = LOADED_SECTION
    ) -> list[ContainerArchs]:
        """The containers that tile the section [start, start+size), walked from its first byte,
        each tagged with `section` (the section's name).

        Raises FatbinError naming the offset where the walk fails, or the bound that stopped the
        scan. Up to `trailing_padding` bytes after the last container are taken as alignment padding.
        Each container visited counts in `work` (`max_fatbin_containers`, walked).
        """
        if self.stopped is not None:
            raise FatbinError(str(self.stopped))
        end = start + size
        if end > self._position:
            raise FatbinError(f"section ends at {end:#x}, past the {self._position} bytes read")
        position = start
        found: list[ContainerArchs] = []
        while position < end:
            candidate = self._candidates.get(position)
            if candidate is None:
                if found and end - position <= trailing_padding:
                    break
                raise FatbinError(f"no fatbin container at offset {position:#x}")
            if candidate.error:
                raise FatbinError(f"container at {position:#x}: {candidate.error}")
            if candidate.end > end:
                raise FatbinError(f"container at {position:#x} runs past the end of its section")
            if not candidate.done:
                raise FatbinError(f"container at {position:#x} is truncated")
            self._walk_one()
            found.append(self._record(candidate, section))
            position = candidate.end
        if not found:
            raise FatbinError("empty fatbin section")
        return found

    def loose(self, sections: Sequence[tuple[str, int, int]]) -> list[ContainerArchs]:
        """Whole, well-formed containers that lie outside the fatbin sections, each tagged with the
        section that holds it (`sections`: name, offset, size of the sections that may: not the
        fatbin sections, not NOBITS). A library keeps such containers to load them itself through
        CUDA's module API (TensorFlow's generated kernels in `.rodata`, cuFFT's in `.ldata`,
        cuBLASLt's in `.cask_resource`). A container inside another is part of it, not one of its own.
        Each container taken counts in `work` (`max_fatbin_containers`, walked), as a section's do."""
        if self.stopped is not None:
            return []
        found: list[ContainerArchs] = []
        end = -1
        ordered = sorted(sections, key=lambda s: s[1])
        for start in sorted(self._candidates):
            candidate = self._candidates[start]
            if start < end or not candidate.done or candidate.error is not None or candidate.end < 0:
                continue
            host = next(
                (name for name, at, size in ordered if at <= start and candidate.end <= at + size), None
            )
            if host is None:
                continue
            self._walk_one()
            found.append(self._record(candidate, host))
            end = candidate.end
        return found

    def _walk_one(self) -> None:
        """One more container walked (`max_fatbin_containers`); past the bound the scan stops and
        FatbinError names it."""
        try:
            self.work.walk_containers(1)
        except LimitExceeded as exc:
            self._stop(exc)
            raise FatbinError(str(exc)) from None

    def _record(self, candidate: _Candidate, section: str) -> ContainerArchs:
        """The container as the report lists it: one shared record per distinct content, so however
        many containers (or walks over them) there are, memory grows with what differs."""
        signature = candidate.signature(section)
        record = self._records.get(signature)
        if record is None:
            sass, ptx, isa, _, kernels = signature
            record = self._records[signature] = ContainerArchs(
                sass=sass, ptx=ptx, ptx_isa=isa, section=section, kernels=kernels
            )
        return record

    def tiles(self, start: int, size: int) -> bool:
        """True when containers tile [start, start+size) exactly (used when section names are lost)."""
        try:
            self.chain(start, size, trailing_padding=0)
        except FatbinError:
            return False
        return True


def walk_section(data: bytes) -> list[ContainerArchs]:
    """Every container of one whole fatbin section held in memory (tests, small objects)."""
    scan = FatbinScan()
    scan.feed(0, data)
    return scan.chain(0, len(data))
