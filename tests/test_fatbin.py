"""Fatbin parsing and arch semantics against NVIDIA's real libraries (downloaded at set-up).

Error cases alter copies of those real bytes; nothing here writes a fatbin of its own.
The expected lists are what `cuobjdump --list-elf --list-ptx` prints for the same files.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from placement import gpu_code
from placement.gpu_code import container_runs_on, ptx_runs_on, sass_runs_on
from scanner.layers.cuda_sources import needed_finding
from scanner.layers.cudaelf import ElfCudaProbe, unloaded_ranges
from scanner.layers.elf import PT_DYNAMIC, PT_LOAD, ElfLayout, Segment
from scanner.layers.fatbin import (
    FatbinError,
    FatbinScan,
    summarise,
    walk_section,
)
from scanner.layers.limits import AnalysisLimits, GpuCodeWork
from scanner.models import ContainerArchs, FileArchs
from tests.conftest import skip_unless_required
from tests.nvidia_wheels import NVJPEG_CU12, NVJPEG_CU13, wheel_members

# cuobjdump on nvidia-nvjpeg-cu12 12.4.0.76's libnvjpeg.so.12 (see the shared cuda_inference note).
CU12_LIB = "nvidia/nvjpeg/lib/libnvjpeg.so.12"
CU12_FATBIN_OFFSET, CU12_FATBIN_SIZE = 2_740_688, 6_140_960
CU12_SASS = ["50", "52", "60", "61", "70", "75", "80", "86", "89", "90", "100", "101", "103", "120", "121"]
CU13_LIB = "nvidia/cu13/lib/libnvjpeg.so.13"
CU13_SASS = ["75", "80", "86", "89", "90", "100", "103", "107", "110", "120", "121"]


@pytest.fixture(scope="module")
def cu12() -> bytes:
    return wheel_members(NVJPEG_CU12)[CU12_LIB]


@pytest.fixture(scope="module")
def cu13() -> bytes:
    return wheel_members(NVJPEG_CU13)[CU13_LIB]


def probe(data: bytes, chunk: int = 1 << 18, size: int | None = None):  # type: ignore[no-untyped-def]
    elf = ElfCudaProbe(size if size is not None else len(data))
    for start in range(0, len(data), chunk):
        if not elf.feed(data[start : start + chunk]):
            break
    return elf.finish()


def container_offsets(data: bytes) -> list[int]:
    """Container starts in the real section, walked with the sizes the real headers give."""
    offsets, position = [], CU12_FATBIN_OFFSET
    while position < CU12_FATBIN_OFFSET + CU12_FATBIN_SIZE:
        offsets.append(position)
        (size,) = struct.unpack_from("<Q", data, position + 8)
        position += 16 + size
    return offsets


@pytest.mark.parametrize("chunk", [4093, 1 << 16, 1 << 20])
def test_cu12_every_container_any_chunking(cu12: bytes, chunk: int) -> None:
    facts = probe(cu12, chunk)
    assert facts is not None and facts.error is None
    assert facts.fatbin is not None and facts.fatbin.error is None
    assert facts.fatbin.sections == [".nv_fatbin"]
    containers = facts.fatbin.containers
    assert sum(c.count for c in containers) == 11
    assert all(list(c.sass) == CU12_SASS for c in containers)
    with_ptx = [c for c in containers if c.ptx]
    assert sum(c.count for c in with_ptx) == 10
    assert all(c.ptx == ("121",) and c.ptx_isa == "8.8" for c in with_ptx)
    # the summary lists the code present (container 0 has no PTX: placement.gpu_code judges that)
    assert facts.fatbin.archs.sass == CU12_SASS
    assert facts.fatbin.archs.ptx == ["121"]


def test_cu12_first_container_is_found_though_no_wrapper_names_it(cu12: bytes) -> None:
    section = cu12[CU12_FATBIN_OFFSET : CU12_FATBIN_OFFSET + CU12_FATBIN_SIZE]
    containers = walk_section(section)
    assert len(containers) == 11
    assert containers[0].ptx == ()  # the 18,656-byte uncompressed container 0
    assert len(container_offsets(cu12)) == 11


def test_cu13_zstd_wheel(cu13: bytes) -> None:
    facts = probe(cu13)
    assert facts is not None and facts.fatbin is not None and facts.fatbin.error is None
    assert facts.fatbin.archs.sass == CU13_SASS
    isas = {c.ptx_isa for c in facts.fatbin.containers if c.ptx}
    assert isas == {"9.4"}


def test_not_elf_stops_after_the_head(cu12: bytes) -> None:
    header = wheel_members(NVJPEG_CU12)["nvidia/nvjpeg/include/nvjpeg.h"]
    elf = ElfCudaProbe(len(header))
    assert elf.feed(header[:8192]) is False
    assert elf.finish() is None


def test_containers_outside_the_fatbin_section_are_reported_with_their_section(cu12: bytes) -> None:
    """A valid container in .rodata (TensorFlow keeps 1,149 there and loads them itself; libcupti keeps
    instrumentation kernels there) is reported with its section: a library's own code counts, a
    profiling library's does not (placement.gpu_code)."""
    altered = bytearray(cu12)
    kernels = container_offsets(cu12)[2]  # the first holds no kernel; this one fits in .rodata
    (size,) = struct.unpack_from("<Q", cu12, kernels + 8)
    rodata = 0x27A2C0  # .rodata of this file, 8-aligned
    altered[rodata : rodata + 16 + size] = cu12[kernels : kernels + 16 + size]
    facts = probe(bytes(altered))
    assert facts is not None and facts.fatbin is not None
    assert sum(c.count for c in facts.fatbin.containers) == 12
    assert facts.fatbin.sections == [".nv_fatbin", ".rodata"]
    (loose,) = [c for c in facts.fatbin.containers if c.section == ".rodata"]
    application = FileArchs(path="/app/lib/libkernels.so", containers=facts.fatbin.containers)
    assert loose in gpu_code.counted_containers(application)
    profiler = FileArchs(path="/usr/local/cuda/lib64/libcupti.so.12", containers=facts.fatbin.containers)
    assert loose not in gpu_code.counted_containers(profiler)


def test_bad_container_magic_names_the_offset(cu12: bytes) -> None:
    altered = bytearray(cu12)
    second = container_offsets(cu12)[1]
    altered[second : second + 4] = b"\0\0\0\0"
    facts = probe(bytes(altered))
    assert facts is not None and facts.fatbin is not None
    assert facts.fatbin.error == f".nv_fatbin: no fatbin container at offset {second:#x}"
    assert facts.fatbin.archs.sass == []


def test_implausible_entry_header_size(cu12: bytes) -> None:
    altered = bytearray(cu12)
    first = container_offsets(cu12)[0]
    struct.pack_into("<I", altered, first + 16 + 4, 8)  # first entry's header size
    facts = probe(bytes(altered))
    assert facts is not None and facts.fatbin is not None and facts.fatbin.error is not None
    assert "implausible header size 8" in facts.fatbin.error


def test_container_size_past_its_section(cu12: bytes) -> None:
    altered = bytearray(cu12)
    last = container_offsets(cu12)[-1]
    (size,) = struct.unpack_from("<Q", cu12, last + 8)
    struct.pack_into("<Q", altered, last + 8, size + 4096)
    facts = probe(bytes(altered))
    assert facts is not None and facts.fatbin is not None and facts.fatbin.error is not None
    assert facts.fatbin.error.startswith(".nv_fatbin: container at")


def test_entry_payload_past_its_container(cu12: bytes) -> None:
    altered = bytearray(cu12)
    first = container_offsets(cu12)[0]
    struct.pack_into("<Q", altered, first + 16 + 8, 1 << 40)
    facts = probe(bytes(altered))
    assert facts is not None and facts.fatbin is not None and facts.fatbin.error is not None
    assert "runs past the end of its container" in facts.fatbin.error


def test_truncated_file_is_an_error_not_a_guess(cu12: bytes) -> None:
    facts = probe(cu12[: CU12_FATBIN_OFFSET + 100_000], size=len(cu12))
    assert facts is not None
    assert facts.error == f"only {CU12_FATBIN_OFFSET + 100_000} of {len(cu12)} bytes were read"
    assert facts.fatbin is None  # the section headers were never seen


def test_lost_section_names_fall_back_to_containers_that_tile_a_section(cu12: bytes) -> None:
    altered = bytearray(cu12)
    names = cu12.rfind(b".nv_fatbin\0")
    altered[names : names + 10] = b"XXXXXXXXXX"
    facts = probe(bytes(altered))
    assert facts is not None and facts.fatbin is not None  # names are read: the section is not a fatbin one,
    assert facts.fatbin.sections == ["XXXXXXXXXX"]  # so its containers are code the library loads itself
    assert {c.section for c in facts.fatbin.containers} == {"XXXXXXXXXX"}
    struct.pack_into("<H", altered, 0x3E, 0)  # e_shstrndx = 0: no names at all
    facts = probe(bytes(altered))
    assert facts is not None and facts.fatbin is not None and facts.fatbin.error is None
    assert facts.fatbin.sections == [f"section at {CU12_FATBIN_OFFSET:#x}"]
    assert facts.fatbin.archs.sass == CU12_SASS


def far_names(data: bytes, fatbin_name: str, gap: int = 256 << 10) -> bytes:
    """A copy with `gap` bytes between the section name table and the section header table, as lld
    lays files out (its `.strtab` lies between them), and its fatbin section named `fatbin_name`: a
    name added at the start of the gap, the name table grown over it."""
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    entry, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    table = bytearray(data[shoff:])
    (names_at,) = struct.unpack_from("<Q", table, names_index * entry + 0x18)
    name = fatbin_name.encode() + b"\0"
    struct.pack_into("<Q", table, names_index * entry + 0x20, shoff + len(name) - names_at)
    for index in range(count):
        if struct.unpack_from("<Q", table, index * entry + 0x18)[0] == CU12_FATBIN_OFFSET:
            struct.pack_into("<I", table, index * entry, shoff - names_at)
    head = bytearray(data[:shoff])
    struct.pack_into("<Q", head, 0x28, shoff + gap)
    return bytes(head) + name + bytes(gap - len(name)) + bytes(table)


def test_fatbin_sections_are_named_wherever_the_name_table_lies(cu12: bytes) -> None:
    """lld puts the symbol names between the section name table and the section header table, often
    hundreds of MB (TensorFlow 2.15's `libtensorflow_cc.so.2`): the fatbin sections are named all the
    same, so device-link input is never taken for code CUDA loads; a name split across two reads too."""
    (shoff,) = struct.unpack_from("<Q", cu12, 0x28)
    relocatable = far_names(cu12, "__nv_relfatbin")
    for facts in (probe(relocatable), split_probe(relocatable, shoff + 5)):
        assert facts is not None and facts.fatbin is not None
        assert facts.fatbin.sections == ["__nv_relfatbin"]
        assert {c.section for c in facts.fatbin.containers} == {"__nv_relfatbin"}
        assert facts.fatbin.archs.sass == [] and facts.fatbin.archs.ptx == []
    loaded = probe(far_names(cu12, ".nv_fatbin"))
    assert loaded is not None and loaded.fatbin is not None and loaded.fatbin.sections == [".nv_fatbin"]
    assert loaded.fatbin.archs.sass == CU12_SASS


def test_the_name_table_is_looked_for_where_no_segment_is_loaded() -> None:
    """patchelf appends loaded segments after the section name table (auditwheel's libcuml.so):
    the gaps between segments are looked in, as well as the file's tail."""
    segments = (
        Segment(type=PT_LOAD, offset=200, vaddr=0, filesz=100),
        Segment(type=PT_LOAD, offset=0, vaddr=0, filesz=150),
        Segment(type=PT_DYNAMIC, offset=500, vaddr=0, filesz=10),
        Segment(type=PT_LOAD, offset=250, vaddr=0, filesz=10),
    )
    layout = ElfLayout(bits=64, endian="little", elf_type=3, machine=62, segments=segments)
    assert unloaded_ranges(layout, 1000) == [(150, 200), (300, 1000)]
    assert unloaded_ranges(layout, 280) == [(150, 200)]
    assert unloaded_ranges(layout.model_copy(update={"segments": ()}), 1000) == [(0, 1000)]


def split_probe(data: bytes, at: int):  # type: ignore[no-untyped-def]
    elf = ElfCudaProbe(len(data))
    elf.feed(data[:at])
    elf.feed(data[at:])
    return elf.finish()


def test_arch_specific_flag_runs_only_at_its_cc(cu12: bytes) -> None:
    """Set the `a` flag on every sm_90 entry of a real copy: 90a, which only a CC 9.0 GPU runs."""
    altered = bytearray(cu12)
    for start in container_offsets(cu12):
        (size,) = struct.unpack_from("<Q", cu12, start + 8)
        position = start + 16
        while position < start + 16 + size:
            kind, _, header, payload = struct.unpack_from("<HHIQ", cu12, position)
            (arch,) = struct.unpack_from("<I", cu12, position + 0x1C)
            if kind == 2 and arch == 90:
                (flags,) = struct.unpack_from("<Q", cu12, position + 0x28)
                struct.pack_into("<Q", altered, position + 0x28, flags | 0x100000)
            position += header + payload
    facts = probe(bytes(altered))
    assert facts is not None and facts.fatbin is not None
    archs = facts.fatbin.archs.sass
    assert "90a" in archs and "90" not in archs
    container = facts.fatbin.containers[0]
    assert container_runs_on(container, (9, 0)) == "sass"
    assert container_runs_on(container, (8, 9)) == "sass"  # sm_89 still covers 8.9


def test_too_many_containers_is_bounded(cu12: bytes) -> None:
    scan = FatbinScan(GpuCodeWork(AnalysisLimits(max_fatbin_containers=3)))
    scan.feed(0, cu12)
    with pytest.raises(
        FatbinError, match=r"more than 3 fatbin containers.*\(GPUBADGE_MAX_FATBIN_CONTAINERS\)"
    ):
        scan.chain(CU12_FATBIN_OFFSET, CU12_FATBIN_SIZE)


# -- semantics (no bytes involved)


def test_sass_and_ptx_rules() -> None:
    assert sass_runs_on("80", (8, 6)) and not sass_runs_on("86", (8, 0))
    assert not sass_runs_on("80", (9, 0))  # SASS never crosses a major
    assert sass_runs_on("90a", (9, 0)) and not sass_runs_on("90a", (9, 1))
    assert ptx_runs_on("80", (9, 0)) and ptx_runs_on("80", (12, 0)) and not ptx_runs_on("90", (8, 9))
    assert ptx_runs_on("90a", (9, 0)) and not ptx_runs_on("90a", (10, 0))
    assert ptx_runs_on("100f", (10, 3)) and not ptx_runs_on("100f", (12, 0))


def test_summary_lists_the_code_present_and_leaves_device_link_input_out() -> None:
    one = ContainerArchs(sass=("80", "90"), ptx=("90",))
    two = ContainerArchs(sass=("80",), ptx=("80",))
    summary = summarise([one, two])
    assert summary.sass == ["80", "90"] and summary.ptx == ["80", "90"]  # facts; placement judges
    assert container_runs_on(two, (9, 0)) == "ptx" and container_runs_on(one, (9, 0)) == "sass"
    link_input = ContainerArchs(sass=("100",), ptx=("100",), section="__nv_relfatbin")
    assert summarise([two, link_input]).sass == ["80"]


# -- DT_NEEDED, on binaries built by the real toolchain


@pytest.fixture(scope="module")
def linked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    if shutil.which("gcc") is None:
        skip_unless_required("gcc is not installed (make deps-system installs it)")
    work: Path = tmp_path_factory.mktemp("linked")
    (work / "stub.c").write_text("int stub(void) { return 0; }\n")
    (work / "main.c").write_text("int stub(void);\nint main(void) { return stub(); }\n")
    for soname in ("libcudart.so.12", "libcuda.so.1", "libcudart_wrapper.so.1"):
        subprocess.run(
            [
                "gcc",
                "-shared",
                "-fPIC",
                f"-Wl,-soname,{soname}",
                "-o",
                str(work / soname),
                str(work / "stub.c"),
            ],
            check=True,
        )
    built: dict[str, bytes] = {}
    for name, libs in {
        "runtime": ["libcudart.so.12", "libcuda.so.1"],
        "driver-only": ["libcuda.so.1"],
        "lookalike": ["libcudart_wrapper.so.1"],
    }.items():
        output = work / name
        subprocess.run(
            [
                "gcc",
                "-Wl,--no-as-needed",
                "-o",
                str(output),
                str(work / "main.c"),
                *[str(work / lib) for lib in libs],
            ],
            check=True,
        )
        built[name] = output.read_bytes()
    return built


def test_needed_names_are_exact(linked: dict[str, bytes]) -> None:
    runtime = probe(linked["runtime"], chunk=97)
    assert runtime is not None and runtime.needed == ["libcuda.so.1", "libcudart.so.12"]
    assert needed_finding(runtime.needed).cuda == "12"
    driver = probe(linked["driver-only"])
    assert driver is not None and driver.needed == ["libcuda.so.1"]
    assert needed_finding(driver.needed).cuda is None  # the driver library has no CUDA version
    lookalike = probe(linked["lookalike"])
    assert lookalike is not None and lookalike.needed == [] and not lookalike.relevant
