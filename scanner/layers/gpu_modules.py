"""Standalone GPU code files -> containers. Pure, bounded, streaming.

Packages ship kernels as files of their own and load them through CUDA's module API
(`cuModuleLoadData`, `cuLibraryLoadData`) when their dispatch picks one for the GPU at hand:
flashinfer-cubin's 15,970 `.cubin` files (sm_100f, sm_100a, sm_103a), flashinfer's `.ptx` files
(`.target sm_103a`). Three kinds, by file name:

* `.cubin`: one CUDA ELF (`e_machine` 190). Its architecture is in `e_flags`: bits 0-7 in the
  ELF ABI of CUDA 12 and older (`EI_OSABI` 0x33, ABI version 7), bits 8-15 in the ABI of CUDA 12.8
  and newer (`EI_OSABI` 0x41, ABI version 8). An arch-specific (`a`) build is marked by the
  `.nv.compat` attribute 0x09 with value 1 (both ABIs; `e_flags` 0x800 in the old one and 0x08 in
  the new one say the same when set). A family build (`sm_100f`) carries no mark of its own and
  runs as plain `sm_100` SASS does, on its major at or above its minor; `cuobjdump` names it
  `sm_100` too. Checked against `cuobjdump --list-elf` on flashinfer-cubin's files and on cubins
  built by PyPI's nvcc 13.0 and ptxas 12.8 for every target.
* `.fatbin`: containers back to back from the first byte, as in a `.nv_fatbin` section
  (`scanner.layers.fatbin`).
* `.ptx`: text; `.version X.Y` is the PTX ISA and `.target sm_XY[a|f]` the architecture. NVIDIA's
  tools write both in the first lines, so the first `PTX_HEAD_BYTES` are read.

A cubin is kept whole while it streams past (the section headers that locate `.nv.compat` and the
symbol table come last), up to `MAX_MODULE_FILE_BYTES`; a larger one gives an error finding, never
an unbounded buffer. The symbols and containers read count in the file's and the layer's GPU-code
work (`scanner.layers.limits.GpuCodeWork`), as in libraries. Each file becomes one `ContainerArchs` with section `MODULE_FILE`; what
runs where is `placement.gpu_code`'s answer.
"""

from __future__ import annotations

import posixpath
import re
import struct
from typing import Literal

from scanner.layers.fatbin import FatbinError, FatbinScan, arch_name, cubin_has_kernel, merge_signatures
from scanner.layers.limits import GpuCodeWork, LimitExceeded
from scanner.models import ContainerArchs

ModuleKind = Literal["cubin", "fatbin", "ptx"]
MODULE_FILE = "module file"  # the section name given to code that comes from a standalone file
MODULE_SUFFIXES: dict[str, ModuleKind] = {".cubin": "cubin", ".fatbin": "fatbin", ".ptx": "ptx"}
MAX_MODULE_FILE_BYTES = 16 * 1024 * 1024  # flashinfer-cubin's largest is 610 KiB
PTX_HEAD_BYTES = 8 * 1024
EM_CUDA = 190
OSABI_CUDA_OLD, OSABI_CUDA_NEW = 0x33, 0x41
_COMPAT_ARCH_SPECIFIC = 0x09  # `.nv.compat` attribute: 1 = an `a` build
_MAX_SECTIONS = 4096
_PTX_VERSION = re.compile(rb"^[ \t]*\.version[ \t]+(\d{1,2})\.(\d{1,2})\b", re.M)
_PTX_TARGET = re.compile(rb"^[ \t]*\.target[ \t]+sm_(\d{2,4})([af]?)\b", re.M)


class ModuleError(ValueError):
    """A module file does not hold what its name says."""


def module_kind(path: str) -> ModuleKind | None:
    """The kind of standalone GPU code a path names, by its suffix, or None."""
    return MODULE_SUFFIXES.get(posixpath.splitext(path)[1])


def parse_ptx_head(head: bytes) -> ContainerArchs:
    """The architecture and ISA of a PTX file from its first lines."""
    target = _PTX_TARGET.search(head)
    if target is None:
        raise ModuleError("no .target directive in the first lines")
    version = _PTX_VERSION.search(head)
    number = int(target.group(1))
    variant = target.group(2).decode()
    isa = f"{int(version.group(1))}.{int(version.group(2))}" if version else None
    return ContainerArchs(
        ptx=(arch_name(number, variant),),  # type: ignore[arg-type]
        ptx_isa=isa,
        section=MODULE_FILE,
    )


def _compat_arch_specific(data: bytes, offset: int, size: int) -> bool:
    """Whether `.nv.compat` (attributes of 4 bytes: format, attribute, u16 value; format 4 carries a
    u16 length and that many bytes instead) marks an arch-specific build."""
    end = offset + size
    at = offset
    while at + 4 <= end:
        form, attribute, value = data[at], data[at + 1], struct.unpack_from("<H", data, at + 2)[0]
        if form == 4:
            at += 4 + value
            continue
        if attribute == _COMPAT_ARCH_SPECIFIC and form in (2, 3):
            return bool(value & 0xFF == 1)
        at += 4 if form in (2, 3) else 2
    return False


def parse_cubin(data: bytes, work: GpuCodeWork | None = None) -> ContainerArchs:
    """One whole cubin file -> its SASS arch (with `a` where it is arch-specific) and whether it holds
    a kernel entry (its symbols counted in `work`). Raises ModuleError where the bytes are not a
    64-bit CUDA ELF."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise ModuleError("not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise ModuleError("not a 64-bit little-endian ELF")
    (machine,) = struct.unpack_from("<H", data, 18)
    if machine != EM_CUDA:
        raise ModuleError(f"ELF machine {machine} is not CUDA ({EM_CUDA})")
    osabi = data[7]
    (flags,) = struct.unpack_from("<I", data, 0x30)
    if osabi == OSABI_CUDA_NEW:
        number, specific = (flags >> 8) & 0xFF, bool(flags & 0x08)
    else:
        number, specific = flags & 0xFF, bool(flags & 0x800)
    if not 10 <= number <= 255:
        raise ModuleError(f"implausible arch {number} in e_flags {flags:#x}")
    specific = specific or _compat_in_sections(data)
    return ContainerArchs(
        sass=(arch_name(number, "a" if specific else ""),),
        section=MODULE_FILE,
        kernels=cubin_has_kernel(data, work),
    )


def _compat_in_sections(data: bytes) -> bool:
    """Find `.nv.compat` through the section headers and read its arch-specific mark."""
    try:
        (table,) = struct.unpack_from("<Q", data, 0x28)
        entry_size, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
        if (
            entry_size < 64
            or count > _MAX_SECTIONS
            or names_index >= count
            or table + count * entry_size > len(data)
        ):
            return False
        names_at = struct.unpack_from("<Q", data, table + names_index * entry_size + 0x18)[0]
        for index in range(count):
            header = table + index * entry_size
            name, _ = struct.unpack_from("<II", data, header)
            offset, size = struct.unpack_from("<QQ", data, header + 0x18)
            start = names_at + name
            if data[start : start + 11] == b".nv.compat\x00" and offset + size <= len(data):
                return _compat_arch_specific(data, offset, size)
    except (struct.error, IndexError):
        return False
    return False


class ModuleSink:
    """Streams one module file (`feed`, then `close`); `result` is its containers or `error`.

    A `.cubin` is kept whole up to `MAX_MODULE_FILE_BYTES`; a `.fatbin` streams through a
    `FatbinScan` (a few numbers per container); a `.ptx` keeps its first `PTX_HEAD_BYTES`.
    """

    __slots__ = ("_data", "_kind", "_scan", "_size", "_work", "containers", "error")

    def __init__(self, kind: ModuleKind, size: int, work: GpuCodeWork | None = None) -> None:
        self._kind = kind
        self._size = size
        self._work = work or GpuCodeWork()
        self._data = bytearray()
        self._scan = FatbinScan(self._work) if kind == "fatbin" else None
        self.containers: list[ContainerArchs] = []
        self.error: str | None = None
        if kind == "cubin" and size > MAX_MODULE_FILE_BYTES:
            self.error = (
                f"a {size:,}-byte cubin is past the {MAX_MODULE_FILE_BYTES:,}-byte bound on module files"
            )

    def feed(self, data: memoryview) -> bool:
        if self.error is not None:
            return False
        if self._scan is not None:
            self._scan.feed(self._scan.position, data)
            return True
        want = PTX_HEAD_BYTES if self._kind == "ptx" else self._size
        self._data += data[: max(want - len(self._data), 0)]
        return len(self._data) < want

    def close(self, complete: bool) -> None:
        if self.error is not None:
            return
        try:
            if self._kind == "ptx":
                self.containers = [parse_ptx_head(bytes(self._data))]
            elif not complete:
                self.error = "the file was not read whole"
            elif self._scan is not None:
                self.containers = merge_signatures(
                    c.model_copy(update={"section": MODULE_FILE})
                    for c in self._scan.chain(0, self._size, trailing_padding=15)
                )
            else:
                self.containers = [parse_cubin(bytes(self._data), self._work)]
        except (ModuleError, FatbinError, LimitExceeded) as exc:
            self.error = str(exc)
        finally:
            self._data = bytearray()
