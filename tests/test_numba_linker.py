"""numba-cuda's link step, judged per GPU and per driver against NVIDIA's own libNVVM and nvJitLink, both
from PyPI (cached, never committed), loaded with ctypes: no GPU needed.

* each real libNVVM (CUDA 12.6, 12.8, 12.9, 13.0) writes PTX of its release's ISA, which the driver must
  be new enough to compile where no nvJitLink links the kernel;
* numba-cuda's whole compile and link, as 0.30.4 runs it with an nvJitLink (`nvvmCompileProgram` with
  `-gen-lto` for the target it picks, then `nvJitLinkCreate`/`AddData`/`Complete` with `-lto` for the
  GPU's own `sm_XY(a)`), succeeds with each pair of real libraries on each GPU exactly where the
  placement says it does: an nvJitLink older than the libNVVM, or one that does not know the GPU, stops it;
* images of numba-cuda beside NVIDIA's wheels, read by the scanner's layer walk, are placed on the fleet:
  without nvJitLink, drivers older than CUDA 12.8 cannot compile 12.8's PTX; with it, they run.
"""

from __future__ import annotations

import ctypes
import functools

import pytest

from placement import gpu_code
from placement.compiler_releases import CC, Release, written_isa
from placement.numba_compiler import compile_target, numba_refusal
from scanner.layers.code_loading import Distribution
from scanner.layers.compiler_library_copies import NVVM, copies_release
from scanner.layers.cuda_evidence import CudaLayerEvidence
from scanner.layers.cuda_jit_tools import with_jit_tools
from scanner.layers.numba_nvrtc import numba_facts
from scanner.models import GpuFacts, NumbaFacts
from tests.gpu_packages import CUDA12, CUDA13, SITE, layer_evidence, libraries, members
from tests.pypi_members import RemoteWheel, member_files
from tests.test_cupy_compiler import NVRTC
from tests.test_gpu_packages import ALL, FLEET, archs_of, eligible, image, only, place
from tests.test_jax_compiler import NVCC
from tests.test_numba_compiler import _NUMBA_MEMBERS, NUMBA

pytestmark = pytest.mark.timeout(900)

LIBNVVM: dict[Release, RemoteWheel] = {
    (12, 6): NVCC["12.6"],
    (12, 8): NVCC["12.8"],
    (12, 9): RemoteWheel(
        "nvidia-cuda-nvcc-cu12",
        "nvidia_cuda_nvcc_cu12-12.9.86-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl",
        "5d6a0d32fdc7ea39917c20065614ae93add6f577d840233237ff08e9a38f58f0",
    ),
    (13, 0): CUDA13["nvvm"],
}
NVJITLINK: dict[Release, RemoteWheel] = {
    (12, 6): RemoteWheel(
        "nvidia-nvjitlink-cu12",
        "nvidia_nvjitlink_cu12-12.6.85-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl",
        "eedc36df9e88b682efe4309aa16b5b4e78c2407eac59e8c10a6a47535164369a",
    ),
    (12, 8): CUDA12["nvjitlink"],
    (13, 0): CUDA13["nvjitlink"],
}
# Every GPU of the fleet, and the architectures between.
GPUS: list[CC] = [(7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0), (12, 1)]
_KERNEL = """target triple = "nvptx64-nvidia-cuda"
target datalayout = "e-p:64:64:64-i1:8:8-i8:8:8-i16:16:16-i32:32:32-i64:64:64-i128:128:128-f32:32:32-f64:64:64-v16:16:16-v32:32:32-v64:64:64-v128:128:128-n16:32:64"
define void @k(i32* %p) {
  store i32 1, i32* %p
  ret void
}
!nvvm.annotations = !{!0}
!0 = !{void (i32*)* @k, !"kernel", i32 1}
!nvvmir.version = !{!1}
!1 = !{i32 MAJOR, i32 MINOR}
"""
_OPAQUE = _KERNEL.replace("void (i32*)* @k", "ptr @k").replace("i32*", "ptr")  # LLVM's later IR


@functools.cache
def _library(wheel: RemoteWheel, suffixes: tuple[str, ...]) -> ctypes.CDLL:
    (path,) = member_files(wheel, lambda name: name.endswith(suffixes)).values()
    return ctypes.CDLL(str(path))


def libnvvm(release: Release) -> ctypes.CDLL:
    return _library(LIBNVVM[release], ("/libnvvm.so", "/libnvvm.so.4"))


def libnvjitlink(release: Release) -> ctypes.CDLL:
    return _library(NVJITLINK[release], ("/libnvJitLink.so.12", "/libnvJitLink.so.13"))


@functools.cache
def nvvm_compile(release: Release, arch: str, lto: bool) -> bytes | str:
    """What a real libNVVM writes for a one-store kernel (`-arch=compute_90a`, `-gen-lto` for LTO-IR), or
    its log where it refuses."""
    nvvm = libnvvm(release)
    ir_version = [ctypes.c_int() for _ in range(4)]
    assert nvvm.nvvmIRVersion(*(ctypes.byref(v) for v in ir_version)) == 0
    log = ""
    for text in (_KERNEL, _OPAQUE):
        source = text.replace("MAJOR", str(ir_version[0].value)).replace("MINOR", str(ir_version[1].value))
        program = ctypes.c_void_p()
        assert nvvm.nvvmCreateProgram(ctypes.byref(program)) == 0
        data = source.encode()
        assert nvvm.nvvmAddModuleToProgram(program, data, ctypes.c_size_t(len(data)), b"k") == 0
        options = [f"-arch={arch}".encode(), *([b"-gen-lto"] if lto else [])]
        if nvvm.nvvmCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options)) == 0:
            size = ctypes.c_size_t()
            assert nvvm.nvvmGetCompiledResultSize(program, ctypes.byref(size)) == 0
            out = ctypes.create_string_buffer(size.value)
            assert nvvm.nvvmGetCompiledResult(program, out) == 0
            return out.raw[: size.value]
        size = ctypes.c_size_t()
        nvvm.nvvmGetProgramLogSize(program, ctypes.byref(size))
        text_log = ctypes.create_string_buffer(size.value + 1)
        nvvm.nvvmGetProgramLog(program, text_log)
        log = text_log.value.decode(errors="replace")
        if "unsupported option" in log:
            return log  # the architecture, not the IR's dialect
    return log


@functools.cache
def nvjitlink_link(release: Release, arch: str, ltoir: bytes) -> str | None:
    """A real nvJitLink's link of `ltoir` for `arch` (`sm_90a`), as numba-cuda asks it (`-lto`): None where
    it links, else its error log."""
    jit = libnvjitlink(release)
    suffix = f"{release[0]}_{release[1]}"  # its versioned entry points, as nvJitLink.h names them

    def call(name: str) -> ctypes._CFuncPtr:
        return getattr(jit, f"__nvJitLink{name}_{suffix}")  # type: ignore[no-any-return]

    handle = ctypes.c_void_p()
    options = [f"-arch={arch}".encode(), b"-lto"]
    if call("Create")(ctypes.byref(handle), ctypes.c_uint32(2), (ctypes.c_char_p * 2)(*options)) != 0:
        return f"nvJitLinkCreate refused -arch={arch}"
    failed = call("AddData")(handle, ctypes.c_int(3), ltoir, ctypes.c_size_t(len(ltoir)), b"k")  # LTOIR
    if not failed:
        failed = call("Complete")(handle)
    if not failed:
        return None
    size = ctypes.c_size_t()
    call("GetErrorLogSize")(handle, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value + 1)
    call("GetErrorLog")(handle, log)
    return log.value.decode(errors="replace").strip() or f"error {failed}"


def _text(release: Release) -> str:
    return f"{release[0]}.{release[1]}"


@pytest.mark.parametrize("release", sorted(LIBNVVM))
def test_each_real_libnvvm_writes_the_ptx_isa_of_its_release(release: Release) -> None:
    ptx = nvvm_compile(release, "compute_80", lto=False)
    assert isinstance(ptx, bytes), ptx
    (version,) = [line for line in ptx.decode().splitlines() if line.startswith(".version ")]
    assert version == f".version {written_isa(release)}"


def test_the_link_step_is_judged_as_real_libnvvm_and_nvjitlink_link() -> None:
    """numba-cuda 0.30.4 with an nvJitLink: NVVM writes LTO-IR for the target `get_arch_option` picks from
    NVRTC's list, nvJitLink links it for the GPU's own architecture. For every pair of real libraries, every
    NVRTC list and every GPU, the placement refuses exactly where the real pipeline fails."""
    outcomes: dict[str, int] = {}
    for nvrtc in sorted(LIBNVVM):
        for nvvm in sorted(LIBNVVM):
            for linker in sorted(NVJITLINK):
                for cc in GPUS:
                    target = compile_target((0, 30), nvrtc, cc)
                    if target is None:
                        continue  # the first launch stops before NVVM (tests/test_numba_compiler.py)
                    ltoir = nvvm_compile(nvvm, target, lto=True)
                    real = ltoir if isinstance(ltoir, str) else None
                    if real is None:
                        assert isinstance(ltoir, bytes)
                        real = nvjitlink_link(
                            linker, f"sm_{cc[0]}{cc[1]}{'a' if cc >= (9, 0) else ''}", ltoir
                        )
                    facts = NumbaFacts(
                        distribution="numba-cuda",
                        version="0.30.4",
                        nvrtc=_text(nvrtc),
                        nvvm="/x/libnvvm.so",
                        nvvm_release=_text(nvvm),
                        nvjitlink=_text(linker),
                    )
                    ours = numba_refusal(facts, cc, other_code=False)
                    assert (ours is None) == (real is None), (nvrtc, nvvm, linker, cc, real, ours)
                    kind = (
                        "links"
                        if real is None
                        else "nvvm arch"
                        if "unsupported option" in real and isinstance(ltoir, str)
                        else "newer libNVVM"
                        if "may need newer version of nvJitLink" in real
                        else "linker arch"
                    )
                    outcomes[kind] = outcomes.get(kind, 0) + 1
    assert set(outcomes) == {"links", "nvvm arch", "newer libNVVM", "linker arch"}, outcomes


# -- images: numba-cuda 0.30.4 over NVIDIA's NVRTC, nvcc (libNVVM) and nvJitLink wheels, read by the layer walk


def _layer(wheel: RemoteWheel, name: str) -> CudaLayerEvidence:
    return layer_evidence([libraries(wheel, name)])


def numba_image(nvvm: Release, linker: Release | None) -> list[CudaLayerEvidence]:
    return [
        layer_evidence([members(NUMBA["0.30.4"], _NUMBA_MEMBERS, "numba-cuda")]),
        _layer(NVRTC[(12, 8)], "libnvrtc.so.12"),
        _layer(LIBNVVM[nvvm], "libnvvm.so"),
        *([_layer(NVJITLINK[linker], "libnvJitLink.so.12")] if linker is not None else []),
    ]


def test_without_nvjitlink_the_driver_compiles_nvvms_ptx_and_older_drivers_cannot() -> None:
    """`pip install numba-cuda` with NVRTC and nvcc 12.8 but no nvJitLink: the driver links the PTX (ISA 8.7)
    libNVVM writes, which drivers of CUDA 12.2 and 12.4 cannot compile; with nvJitLink 12.8 they run it."""
    facts = image(numba_image((12, 8), None))
    numba = archs_of(facts).numba
    assert numba is not None and (numba.nvvm_release, numba.nvjitlink) == ("12.8", "")
    decision = place(facts, FLEET)
    older = {"v100", "t4-535", "a100"}  # drivers 535 and 550: CUDA 12.2 and 12.4
    assert eligible(decision) == ALL - older - {"gb10"}  # GB10: NVRTC 12.8 does not list sm_121
    assert only(decision, "a100") == (
        "1 free NVIDIA A100-SXM4-80GB: compute capability 8.0: numba-cuda 0.30.4 compiles every @cuda.jit kernel"
        " at its first launch, for an architecture its NVRTC lists: with no nvJitLink of CUDA 12.3 or later for"
        " it to load, the driver links the PTX its libNVVM (CUDA 12.8) writes: PTX ISA 8.7 comes from CUDA 12.8,"
        " and this server's driver supports CUDA 12.4: a driver JIT-compiles only the PTX of its own CUDA version"
        " or older; NVIDIA's nvJitLink wheel of CUDA 12.8 or later (its [cu12] extra installs one) links them"
        " without the driver"
    )
    linked = image(numba_image((12, 8), (12, 8)))
    numba = archs_of(linked).numba
    assert numba is not None and numba.nvjitlink == "12.8"
    assert numba.nvjitlink_paths == [f"{SITE}/nvidia/nvjitlink/lib/libnvJitLink.so.12"]
    assert eligible(place(linked, FLEET)) == ALL - {"gb10"}


def test_an_nvjitlink_older_than_the_libnvvm_refuses_every_kernel() -> None:
    """nvJitLink 12.6 beside nvcc 12.8's libNVVM (a pin that holds one back): every link fails."""
    facts = image(numba_image((12, 8), (12, 6)))
    decision = place(facts, FLEET)
    assert eligible(decision) == set()
    assert only(decision, "h100").endswith(
        "its nvJitLink (CUDA 12.6) links the LTO-IR its libNVVM (CUDA 12.8) writes, and refuses LTO-IR of a"
        ' newer libNVVM ("ERROR 4 in nvvmAddNVVMContainerToProgram, may need newer version of nvJitLink'
        ' library"), so every first launch stops; an nvJitLink of CUDA 12.8 or later links it'
    )


def test_an_nvjitlink_that_does_not_know_the_gpu_refuses_it_where_the_driver_would_not() -> None:
    """numba-cuda 0.23 with NVRTC, libNVVM and nvJitLink of 12.6 on an RTX 5090: NVVM writes `compute_90`
    LTO-IR, and nvJitLink 12.6 cannot link it for sm_120; without nvJitLink the driver compiles the PTX there.
    (From 0.24 it asks NVRTC 12.6 for `compute_120a`, and stops before.)"""
    facts = NumbaFacts(
        distribution="numba-cuda",
        version="0.23.0",
        nvrtc="12.6",
        nvvm="/x",
        nvvm_release="12.6",
        nvjitlink="12.6",
    )
    archs = archs_of(image(numba_image((12, 8), (12, 8)))).model_copy(update={"numba": facts})
    (reason,) = gpu_code.judge(archs, (12, 0)).reasons
    assert reason.endswith(
        "its nvJitLink (CUDA 12.6) links every kernel for the GPU's own architecture, sm_120, which it does not"
        " know, so the first launch stops; an nvJitLink of CUDA 12.8 or later knows it"
    )
    driver = archs.model_copy(update={"numba": facts.model_copy(update={"nvjitlink": ""})})
    assert gpu_code.judge(driver, (12, 0)).runs


# -- which libNVVM and nvJitLink, by numba-cuda's version (`scanner.layers.numba_nvrtc`)

PY = "/usr/local/lib/python3.11/site-packages"
_DIST = {f"{PY}/numba_cuda-{v}.dist-info": v for v in ("0.30.4", "0.20.0")}
_WHEELS = {
    f"{PY}/nvidia_nvjitlink_cu12-12.9.86.dist-info": Distribution(
        name="nvidia-nvjitlink-cu12", version="12.9.86"
    ),
    f"{PY}/nvidia_cuda_nvcc_cu12-12.9.86.dist-info": Distribution(
        name="nvidia-cuda-nvcc-cu12", version="12.9.86"
    ),
}
_WHEEL_NVJITLINK = f"{PY}/nvidia/nvjitlink/lib/libnvJitLink.so.12"
_SYSTEM_NVJITLINK = (
    "/usr/local/cuda-12.4/lib64/libnvJitLink.so.12",
    "/usr/local/cuda-12.4/lib64/libnvJitLink.so.12.4.127",
)


def facts_of(version: str, *paths: str, nvvm: tuple[str, ...] = ()) -> NumbaFacts:
    dist = {f"{PY}/numba_cuda-{version}.dist-info": Distribution(name="numba-cuda", version=version)}
    found = numba_facts({**dist, **_WHEELS}, paths, nvvm)
    assert found is not None
    return found


def test_numba_cuda_from_0_21_links_with_the_nvjitlink_cuda_pathfinder_loads() -> None:
    assert facts_of("0.30.4", _WHEEL_NVJITLINK, *_SYSTEM_NVJITLINK).nvjitlink == "12.9"  # its site's wheel
    assert facts_of("0.30.4", *_SYSTEM_NVJITLINK).nvjitlink == "12.4"  # the toolkit's, by the file beside it
    assert facts_of("0.30.4").nvjitlink == ""  # none: the driver links
    before = facts_of("0.20.0", _WHEEL_NVJITLINK, *_SYSTEM_NVJITLINK)  # any copy may be the one
    assert before.nvjitlink is None  # not known: the link step is not judged


def test_libnvvms_release_is_claimed_where_every_copy_agrees() -> None:
    wheel = f"{PY}/nvidia/cuda_nvcc/nvvm/lib64/libnvvm.so"
    toolkit = (
        "/usr/local/cuda-12.8/nvvm/lib64/libnvvm.so.4",
        "/usr/local/cuda-12.8/nvvm/lib64/libnvvm.so.4.0.0",
    )
    assert facts_of("0.30.4", nvvm=(wheel,)).nvvm_release == "12.9"
    assert (
        facts_of("0.30.4", nvvm=toolkit).nvvm_release == "12.8"
    )  # not 4.0: libnvvm.so.4 numbers its interface
    assert facts_of("0.30.4", nvvm=(wheel, *toolkit)).nvvm_release is None
    assert facts_of("0.30.4").nvvm_release is None and copies_release([], [], {}, NVVM) == ""


def test_a_cuda_home_or_a_layer_not_read_whole_may_bring_an_nvjitlink() -> None:
    archs = archs_of(image(numba_image((12, 8), None)))
    mounted = with_jit_tools(archs, GpuFacts(flashinfer_env={"CUDA_HOME": "/opt/cuda"}))
    assert mounted.numba is not None and mounted.numba.nvjitlink is None
    assert all(
        gpu_code.judge(mounted, cc, gpu_code.Jit("535.104.05", "12.2")).runs for cc in [(7, 0), (9, 0)]
    )
    assert not gpu_code.judge(archs, (9, 0), gpu_code.Jit("535.104.05", "12.2")).runs
    layers = numba_image((12, 8), None)
    partial = image([*layers[:-1], layers[-1].model_copy(update={"complete": False})])
    unread = archs_of(partial).numba
    assert unread is not None and unread.nvjitlink is None


def test_numba_cuda_before_0_23_with_ctypes_bindings_leaves_the_link_step_unjudged() -> None:
    """`NUMBA_CUDA_USE_NVIDIA_BINDING=0` gives numba-cuda 0.16 to 0.20 ctypes bindings, whose linker is the
    driver's, whatever nvJitLink the image carries; from 0.23 it has no ctypes bindings."""
    layers = numba_image((12, 8), (12, 6))
    archs = archs_of(image(layers))
    old = archs.model_copy(update={"numba": archs.numba.model_copy(update={"version": "0.20.0"})})  # type: ignore[union-attr]
    ctypes_env = GpuFacts(flashinfer_env={"NUMBA_CUDA_USE_NVIDIA_BINDING": "0"})
    unjudged = with_jit_tools(old, ctypes_env)
    assert unjudged.numba is not None and unjudged.numba.nvjitlink is None
    assert gpu_code.judge(unjudged, (9, 0)).runs and not gpu_code.judge(old, (9, 0)).runs
    assert with_jit_tools(archs, ctypes_env).numba == archs.numba  # 0.30.4: bindings always
