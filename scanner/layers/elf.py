"""The head of a file -> ELF class, machine and program interpreter (PT_INTERP).

Pure and defensive: it reads only the bytes it is given (the scanner asks for the first
few KiB of a file) and never raises, because layer contents are untrusted. The
interpreter path is what names the C library: `/lib/ld-musl-x86_64.so.1` is musl,
`/lib64/ld-linux-x86-64.so.2` is glibc; a static binary has none.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict

ELF_MAGIC = b"\x7fELF"
PT_INTERP = 3
MAX_PROGRAM_HEADERS = 1024
MAX_INTERP_LENGTH = 4096

MACHINES: dict[int, str] = {
    3: "i386",
    8: "mips",
    20: "ppc",
    21: "ppc64",
    22: "s390",
    40: "arm",
    62: "x86_64",
    183: "aarch64",
    243: "riscv",
    258: "loongarch",
}


class ElfInfo(BaseModel):
    """What the ELF header says. `error` is set when the magic is there but the rest is not."""

    model_config = ConfigDict(frozen=True)

    bits: Literal[32, 64] | None = None
    endian: Literal["little", "big"] | None = None
    machine: int | None = None
    interpreter: str | None = None
    error: str | None = None

    @property
    def machine_name(self) -> str:
        if self.machine is None:
            return "unknown"
        return MACHINES.get(self.machine, f"machine-{self.machine}")

    @property
    def static(self) -> bool:
        return self.error is None and self.interpreter is None


def is_elf(head: bytes) -> bool:
    return head[:4] == ELF_MAGIC


def parse_elf(head: bytes) -> ElfInfo | None:
    """None if `head` is not an ELF file; an ElfInfo (maybe with `error`) if it is."""
    if not is_elf(head):
        return None
    if len(head) < 20:
        return ElfInfo(error="ELF header truncated")
    elf_class, data = head[4], head[5]
    if elf_class not in (1, 2):
        return ElfInfo(error=f"unknown ELF class {elf_class}")
    if data not in (1, 2):
        return ElfInfo(error=f"unknown ELF data encoding {data}")
    bits: Literal[32, 64] = 32 if elf_class == 1 else 64
    endian: Literal["little", "big"] = "little" if data == 1 else "big"
    order = "<" if data == 1 else ">"
    (machine,) = struct.unpack_from(order + "H", head, 18)
    partial = ElfInfo(bits=bits, endian=endian, machine=machine)
    try:
        if bits == 64:
            (phoff,) = struct.unpack_from(order + "Q", head, 32)
            phentsize, phnum = struct.unpack_from(order + "HH", head, 54)
            header_format, min_entry = order + "IIQQQQ", 56
        else:
            (phoff,) = struct.unpack_from(order + "I", head, 28)
            phentsize, phnum = struct.unpack_from(order + "HH", head, 42)
            header_format, min_entry = order + "IIIIII", 32
    except struct.error:
        return partial.model_copy(update={"error": "ELF header truncated"})
    if phnum == 0:
        return partial
    if phentsize < min_entry or phnum > MAX_PROGRAM_HEADERS:
        return partial.model_copy(update={"error": "implausible program header table"})
    for index in range(phnum):
        offset = phoff + index * phentsize
        if offset + min_entry > len(head):
            return partial.model_copy(
                update={"error": f"program headers extend past the first {len(head)} bytes"}
            )
        fields = struct.unpack_from(header_format, head, offset)
        if fields[0] != PT_INTERP:
            continue
        # ELF64: type, flags, offset, vaddr, paddr, filesz; ELF32: type, offset, vaddr, paddr, filesz
        interp_offset, interp_size = (fields[2], fields[5]) if bits == 64 else (fields[1], fields[4])
        if interp_size == 0 or interp_size > MAX_INTERP_LENGTH:
            return partial.model_copy(update={"error": "implausible PT_INTERP size"})
        if interp_offset + interp_size > len(head):
            return partial.model_copy(update={"error": f"PT_INTERP lies past the first {len(head)} bytes"})
        raw = head[interp_offset : interp_offset + interp_size].split(b"\0", 1)[0]
        if not raw:
            return partial.model_copy(update={"error": "empty PT_INTERP"})
        return partial.model_copy(update={"interpreter": raw.decode("utf-8", "replace")})
    return partial


# -- layout, section headers and the dynamic section (for the CUDA probe in scanner.layers.cudaelf)
#
# Every size and count below comes from an untrusted file, so each is checked against a
# named limit before anything is allocated or sliced.

ET_REL, ET_EXEC, ET_DYN = 1, 2, 3
PT_LOAD, PT_DYNAMIC = 1, 2
SHT_NOBITS = 8
DT_NULL, DT_NEEDED, DT_STRTAB, DT_STRSZ = 0, 1, 5, 10
MAX_SECTION_HEADERS = 4096
MAX_SECTION_HEADER_SIZE = 256
MAX_DYNAMIC_BYTES = 64 << 10
MAX_DYNAMIC_ENTRIES = 4096
MAX_SECTION_NAME_BYTES = 64 << 10
MAX_SECTION_NAME = 256


class Segment(BaseModel):
    """One program header: where its bytes lie in the file and in memory."""

    model_config = ConfigDict(frozen=True)

    type: int
    offset: int
    vaddr: int
    filesz: int


class ElfLayout(BaseModel):
    """The parts of an ELF header that locate everything else in the file."""

    model_config = ConfigDict(frozen=True)

    bits: Literal[32, 64]
    endian: Literal["little", "big"]
    elf_type: int
    machine: int
    segments: tuple[Segment, ...] = ()
    shoff: int = 0
    shentsize: int = 0
    shnum: int = 0
    shstrndx: int = 0
    error: str | None = None

    @property
    def order(self) -> str:
        return "<" if self.endian == "little" else ">"

    @property
    def section_table(self) -> tuple[int, int] | None:
        """(offset, size) of the section header table, or None when the file has none."""
        if self.shoff == 0 or self.shnum == 0:
            return None
        return self.shoff, self.shnum * self.shentsize

    @property
    def dynamic(self) -> Segment | None:
        return next((s for s in self.segments if s.type == PT_DYNAMIC), None)

    def file_offset(self, vaddr: int) -> int | None:
        """The file offset a virtual address is loaded from (PT_LOAD), or None."""
        for segment in self.segments:
            if segment.type == PT_LOAD and segment.vaddr <= vaddr < segment.vaddr + segment.filesz:
                return segment.offset + (vaddr - segment.vaddr)
        return None


class Section(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    type: int
    offset: int
    size: int


def parse_layout(head: bytes) -> ElfLayout | None:
    """None if `head` is not ELF (or its header is unreadable); else the layout, maybe with `error`.

    Program headers must lie inside `head` (they follow the ELF header in every linker's output).
    """
    if not is_elf(head) or len(head) < 52 or head[4] not in (1, 2) or head[5] not in (1, 2):
        return None
    bits: Literal[32, 64] = 32 if head[4] == 1 else 64
    endian: Literal["little", "big"] = "little" if head[5] == 1 else "big"
    order = "<" if endian == "little" else ">"
    try:
        if bits == 64:
            elf_type, machine = struct.unpack_from(order + "HH", head, 16)
            phoff, shoff = struct.unpack_from(order + "QQ", head, 32)
            phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from(order + "HHHHH", head, 54)
            ph_format, ph_min = order + "IIQQQQ", 56
        else:
            elf_type, machine = struct.unpack_from(order + "HH", head, 16)
            phoff, shoff = struct.unpack_from(order + "II", head, 28)
            phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from(order + "HHHHH", head, 42)
            ph_format, ph_min = order + "IIIIII", 32
    except struct.error:
        return None
    layout = ElfLayout(
        bits=bits,
        endian=endian,
        elf_type=elf_type,
        machine=machine,
        shoff=shoff,
        shentsize=shentsize,
        shnum=shnum,
        shstrndx=shstrndx,
    )
    if shnum and not (
        (40 if bits == 32 else 64) <= shentsize <= MAX_SECTION_HEADER_SIZE and shnum <= MAX_SECTION_HEADERS
    ):
        layout = layout.model_copy(update={"shnum": 0, "error": "implausible section header table"})
    if phnum == 0:
        return layout
    if phentsize < ph_min or phnum > MAX_PROGRAM_HEADERS:
        return layout.model_copy(update={"error": "implausible program header table"})
    segments: list[Segment] = []
    for index in range(phnum):
        offset = phoff + index * phentsize
        if offset + ph_min > len(head):
            return layout.model_copy(
                update={"error": f"program headers extend past the first {len(head)} bytes"}
            )
        fields = struct.unpack_from(ph_format, head, offset)
        if bits == 64:  # type, flags, offset, vaddr, paddr, filesz
            segment = Segment(type=fields[0], offset=fields[2], vaddr=fields[3], filesz=fields[5])
        else:  # type, offset, vaddr, paddr, filesz, memsz
            segment = Segment(type=fields[0], offset=fields[1], vaddr=fields[2], filesz=fields[4])
        if segment.type in (PT_LOAD, PT_DYNAMIC):
            segments.append(segment)
    return layout.model_copy(update={"segments": tuple(segments)})


def parse_sections(
    layout: ElfLayout,
    table: bytes,
    names: bytes | None,
    names_offset: int,
    known: Mapping[int, str] | None = None,
) -> list[Section]:
    """The section headers in `table` (the whole table), named from `names`.

    `names` holds file bytes starting at `names_offset` that should contain the section name
    string table; `known` maps file offsets to names seen there as the file streamed past (the
    fatbin sections' names, wherever the string table lies). A name found in neither comes back as
    "" (the caller may still match a section by its contents). Raises ValueError on a table that
    does not fit its own header.
    """
    if len(table) != layout.shnum * layout.shentsize:
        raise ValueError("section header table truncated")
    order = layout.order
    raw: list[tuple[int, int, int, int]] = []
    for index in range(layout.shnum):
        at = index * layout.shentsize
        if layout.bits == 64:
            name, kind, _flags, _addr, offset, size = struct.unpack_from(order + "IIQQQQ", table, at)
        else:
            name, kind, _flags, _addr, offset, size = struct.unpack_from(order + "IIIIII", table, at)
        raw.append((name, kind, offset, size))
    strtab: tuple[int, int] | None = None
    if 0 < layout.shstrndx < len(raw):
        _, _, offset, size = raw[layout.shstrndx]
        if size <= MAX_SECTION_NAME_BYTES:
            strtab = (offset, size)
    sections: list[Section] = []
    for name_index, kind, offset, size in raw:
        name = ""
        if strtab is not None and names is not None and name_index < strtab[1]:
            start = strtab[0] + name_index - names_offset
            if 0 <= start < len(names):
                end = names.find(b"\0", start, start + MAX_SECTION_NAME)
                if end >= 0:
                    name = names[start:end].decode("ascii", "replace")
        if not name and strtab is not None and known and name_index < strtab[1]:
            name = known.get(strtab[0] + name_index, "")
        sections.append(Section(name=name, type=kind, offset=offset, size=size))
    return sections


class DynamicInfo(BaseModel):
    """DT_NEEDED string offsets and where the dynamic string table lives (a virtual address)."""

    model_config = ConfigDict(frozen=True)

    needed: tuple[int, ...] = ()
    strtab_vaddr: int | None = None
    strtab_size: int | None = None


def parse_dynamic(layout: ElfLayout, data: bytes) -> DynamicInfo:
    """Read the PT_DYNAMIC entries in `data` (at most MAX_DYNAMIC_ENTRIES, up to DT_NULL)."""
    order = layout.order
    entry_format, entry_size = (order + "qQ", 16) if layout.bits == 64 else (order + "iI", 8)
    needed: list[int] = []
    strtab: int | None = None
    strsz: int | None = None
    for index in range(min(len(data) // entry_size, MAX_DYNAMIC_ENTRIES)):
        tag, value = struct.unpack_from(entry_format, data, index * entry_size)
        if tag == DT_NULL:
            break
        if tag == DT_NEEDED:
            needed.append(value)
        elif tag == DT_STRTAB:
            strtab = value
        elif tag == DT_STRSZ:
            strsz = value
    return DynamicInfo(needed=tuple(needed), strtab_vaddr=strtab, strtab_size=strsz)
