"""The head of a file -> ELF class, machine and program interpreter (PT_INTERP).

Pure and defensive: it reads only the bytes it is given (the scanner asks for the first
few KiB of a file) and never raises, because layer contents are untrusted. The
interpreter path is what names the C library: `/lib/ld-musl-x86_64.so.1` is musl,
`/lib64/ld-linux-x86-64.so.2` is glibc; a static binary has none.
"""

from __future__ import annotations

import struct
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
