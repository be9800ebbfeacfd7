"""CuPy's kernels, compiled with NVRTC at first use, judged per GPU against CuPy's own source and NVRTC's
own bytes, both from PyPI (cached, never committed).

* what CuPy asks its NVRTC for on each GPU is what `cupy/cuda/compiler.py` of each pinned wheel asks: its
  own functions run here with the NVRTC release and the GPU's capability given to them;
* what each NVRTC release can compile for is what the real `libnvrtc` of NVIDIA's wheels says
  (`nvrtcGetSupportedArchs`, loaded with ctypes: no GPU needed);
* an image of CuPy 13.6.0 beside NVIDIA's NVRTC wheel, read by the scanner's layer walk, is placed on
  the fleet: refused on Blackwell with CUDA 12.6's NVRTC (cupy/cupy#9106), run there with 12.8's.
"""

from __future__ import annotations

import ast
import ctypes
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from placement import gpu_code
from placement.compiler_releases import CC, Release, compiles_for, written_isa
from placement.cupy_compiler import cupy_refusal, nvrtc_target
from placement.image_facts import ImageFacts
from scanner.layers.code_loading import Distribution
from scanner.layers.cuda_jit_tools import with_jit_tools
from scanner.layers.cupy_nvrtc import cupy_facts
from scanner.models import CupyFacts, GpuFacts
from tests.gpu_packages import CUDA13, SITE, layer_evidence, libraries, members
from tests.pypi_members import RemoteWheel, member_files
from tests.test_gpu_packages import ALL, FLEET_580, archs_of, eligible, image, only, place

pytestmark = pytest.mark.timeout(900)

CUPY = {
    ("cupy-cuda12x", "13.3.0"): RemoteWheel(
        "cupy-cuda12x",
        "cupy_cuda12x-13.3.0-cp311-cp311-manylinux2014_x86_64.whl",
        "a0e3bead04e502ebde515f0343444ca3f4f7aed09cbc3a316a946cba97f2ea66",
    ),
    ("cupy-cuda12x", "13.6.0"): RemoteWheel(
        "cupy-cuda12x",
        "cupy_cuda12x-13.6.0-cp311-cp311-manylinux2014_x86_64.whl",
        "77ba6745a130d880c962e687e4e146ebbb9014f290b0a80dbc4e4634eb5c3b48",
    ),
    ("cupy-cuda12x", "14.2.0"): RemoteWheel(
        "cupy-cuda12x",
        "cupy_cuda12x-14.2.0-cp311-cp311-manylinux2014_x86_64.whl",
        "5fe2366cc5c61a7ee4a527ce1e8951cb89092d0fb0b5830623cf114d1942c585",
    ),
    ("cupy-cuda13x", "14.2.0"): RemoteWheel(
        "cupy-cuda13x",
        "cupy_cuda13x-14.2.0-cp311-cp311-manylinux2014_x86_64.whl",
        "f94843e54500a9c8c169135f79572bfaba946efe4f7178e834c227280c1b0c12",
    ),
    ("cupy-cuda11x", "12.3.0"): RemoteWheel(
        "cupy-cuda11x",
        "cupy_cuda11x-12.3.0-cp311-cp311-manylinux2014_x86_64.whl",
        "4173486906388c91a70f639003313b96e9449cb8a008137e8ac4bcd872bcf34c",
    ),
    ("cupy-cuda110", "10.6.0"): RemoteWheel(
        "cupy-cuda110",
        "cupy_cuda110-10.6.0-cp310-cp310-manylinux1_x86_64.whl",
        "b68f1a10610156c4134d98c2b8a2dac4ab4198c73e6373151aba08a4328234e7",
    ),
}
NVRTC = {
    (12, 6): RemoteWheel(
        "nvidia-cuda-nvrtc-cu12",
        "nvidia_cuda_nvrtc_cu12-12.6.85-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl",
        "800927308ccc5dd6246d3f61f7fcef2ed7ec4e59e199090d360d3293f78bd5a2",
    ),
    (12, 8): RemoteWheel(
        "nvidia-cuda-nvrtc-cu12",
        "nvidia_cuda_nvrtc_cu12-12.8.93-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl",
        "a7756528852ef889772a84c6cd89d41dfa74667e24cca16bb31f8f061e3e9994",
    ),
    (12, 9): RemoteWheel(
        "nvidia-cuda-nvrtc-cu12",
        "nvidia_cuda_nvrtc_cu12-12.9.86-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl",
        "210cf05005a447e29214e9ce50851e83fc5f4358df8b453155d5e1918094dcb4",
    ),
    (13, 0): CUDA13["nvrtc"],
    (13, 5): RemoteWheel(
        "nvidia-cuda-nvrtc",
        "nvidia_cuda_nvrtc-13.5.37-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl",
        "86b4d68058807988b7d9af5b44917a0601e9c337f35ccd657bfb3c759ff8d8bc",
    ),
}
# The NVRTC releases each build may load (14.x's `cuda.pathfinder` takes either major), and the CUDA it was built with.
LOADS: dict[str, tuple[tuple[Release, ...], int]] = {
    "cupy-cuda110": (((11, 0),), 11000),
    "cupy-cuda11x": (((11, 2), (11, 4), (11, 8)), 11080),
    "cupy-cuda12x": (((12, 0), (12, 4), (12, 6), (12, 8), (12, 9), (13, 0)), 12000),
    "cupy-cuda13x": (((12, 8), (12, 9), (13, 0), (13, 4)), 13000),
}
CCS: list[CC] = [
    (5, 3), (6, 2), (7, 0), (7, 2), (7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0),
    (10, 0), (10, 1), (10, 3), (11, 0), (12, 0), (12, 1),
]  # fmt: skip
_FUNCTIONS = ("_get_max_compute_capability", "_get_arch", "_get_arch_for_options_for_nvrtc")


def their_compiler(wheel: RemoteWheel) -> types.CodeType:
    """The three functions of the wheel's own `cupy/cuda/compiler.py` that choose what NVRTC is asked for
    (and its `_tegra_archs`), undecorated (`_util.memoize` caches per device)."""
    (source,) = member_files(wheel, lambda name: name == "cupy/cuda/compiler.py").values()
    tree = ast.parse(source.read_text())
    kept: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in _FUNCTIONS:
            node.decorator_list = []
            kept.append(node)
        elif isinstance(node, ast.Assign) and any(
            getattr(t, "id", "") == "_tegra_archs" for t in node.targets
        ):
            kept.append(node)
    assert {n.name for n in kept if isinstance(n, ast.FunctionDef)} == set(_FUNCTIONS)
    return compile(ast.Module(body=kept, type_ignores=[]), str(source), "exec")


def their_target(code: types.CodeType, nvrtc: Release, cc: CC, built: int, use_ptx: bool) -> tuple[int, str]:
    """What the wheel's own code asks NVRTC for: (architecture, "cubin" or "ptx")."""
    device = types.SimpleNamespace(compute_capability=f"{cc[0]}{cc[1]}")
    scope: dict[str, Any] = {
        "_get_nvrtc_version": lambda: nvrtc,
        "_use_ptx": use_ptx,
        "_cuda_hip_version": built,
        "device": types.SimpleNamespace(Device=lambda: device),
        "driver": types.SimpleNamespace(_is_cuda_python=lambda: False, get_build_version=lambda: built),
        "runtime": types.SimpleNamespace(runtimeGetVersion=lambda: built, is_hip=False),
    }
    exec(code, scope)
    option, kind = scope["_get_arch_for_options_for_nvrtc"]()
    prefix = "-arch=sm_" if kind == "cubin" else "-arch=compute_"
    assert option.startswith(prefix), option
    return int(option.removeprefix(prefix)), kind


@pytest.mark.parametrize(("distribution", "version"), sorted(CUPY))
def test_cupy_asks_nvrtc_for_what_its_own_source_asks(distribution: str, version: str) -> None:
    code = their_compiler(CUPY[distribution, version])
    releases, built = LOADS[distribution]
    for use_ptx in (False, True):
        facts = CupyFacts(distribution=distribution, version=version, compile_with_ptx=use_ptx)
        for nvrtc in releases:
            for cc in CCS:
                theirs = their_target(code, nvrtc, cc, built, use_ptx)
                assert nvrtc_target(facts, nvrtc, cc) == theirs, (nvrtc, cc, use_ptx)


def supported_archs(library: Path) -> set[CC]:
    """The architectures a real NVRTC compiles for, as it says (`nvrtcGetSupportedArchs`)."""
    nvrtc = ctypes.CDLL(str(library))
    count = ctypes.c_int()
    assert nvrtc.nvrtcGetNumSupportedArchs(ctypes.byref(count)) == 0
    found = (ctypes.c_int * count.value)()
    assert nvrtc.nvrtcGetSupportedArchs(found) == 0
    return {(arch // 10, arch % 10) for arch in found}


@pytest.mark.parametrize("release", sorted(NVRTC))
def test_each_nvrtc_knows_the_architectures_the_release_table_gives_it(release: Release) -> None:
    files = member_files(
        NVRTC[release], lambda name: name.endswith(("/lib/libnvrtc.so.12", "/lib/libnvrtc.so.13"))
    )
    (library,) = files.values()
    nvrtc = ctypes.CDLL(str(library))
    major, minor = ctypes.c_int(), ctypes.c_int()
    assert nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) == 0
    assert (major.value, minor.value) == release
    known = supported_archs(library)
    assert {cc for cc in CCS if compiles_for(release, cc)} == {cc for cc in CCS if cc in known}


@pytest.mark.parametrize("release", sorted(NVRTC))
def test_each_nvrtc_writes_the_ptx_isa_the_table_gives_its_release(release: Release) -> None:
    """The driver that compiles CuPy's PTX must know its ISA: each real NVRTC writes its release's (12.6, which
    brought none, 12.5's 8.5)."""
    files = member_files(
        NVRTC[release],
        lambda name: (
            name.endswith(("/lib/libnvrtc.so.12", "/lib/libnvrtc.so.13")) or "/libnvrtc-builtins.so." in name
        ),
    )
    (library,) = [path for name, path in files.items() if "builtins" not in name]
    (builtins,) = [path for name, path in files.items() if "builtins" in name]
    ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)  # found by its soname when NVRTC opens it
    nvrtc = ctypes.CDLL(str(library))
    program = ctypes.c_void_p()
    source = b'extern "C" __global__ void k(int *p) { *p = 1; }'
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, b"k.cu", 0, None, None) == 0
    option = (ctypes.c_char_p * 1)(b"-arch=compute_80")
    assert nvrtc.nvrtcCompileProgram(program, 1, option) == 0
    size = ctypes.c_size_t()
    assert nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size)) == 0
    ptx = ctypes.create_string_buffer(size.value)
    assert nvrtc.nvrtcGetPTX(program, ptx) == 0
    (version,) = [line for line in ptx.value.decode().splitlines() if line.startswith(".version ")]
    assert version == f".version {written_isa(release)}"


# -- an image: CuPy 13.6.0's package (its CUB module carries its precompiled code) over an NVRTC wheel

_CUPY_MEMBERS: Callable[[str], bool] = lambda name: (  # noqa: E731
    name.endswith(".dist-info/RECORD") or name == "cupy/cuda/compiler.py" or name.startswith("cupy/cuda/cub.")
)


def cupy_image(nvrtc: Release) -> ImageFacts:
    return image(
        [
            layer_evidence([members(CUPY["cupy-cuda12x", "13.6.0"], _CUPY_MEMBERS, "cupy-cub")]),
            layer_evidence([libraries(NVRTC[nvrtc], "libnvrtc.so.12")]),
        ]
    )


def test_cupy_13_6_with_cuda_12_6s_nvrtc_is_refused_on_blackwell() -> None:
    """CuPy 13.6.0 takes CUDA 12.6's NVRTC to know sm_90 at most and asks it for a cubin of sm_90 on a
    Blackwell GPU, which does not load there (cupy/cupy#9106: `CUDA_ERROR_NO_BINARY_FOR_GPU` on an RTX
    5080 with CUDA 12.0), though its own CUB and Thrust code carries PTX that would run."""
    facts = cupy_image((12, 6))
    archs = archs_of(facts)
    assert archs.cupy == CupyFacts(
        distribution="cupy-cuda12x",
        version="13.6.0",
        cuda_major=12,
        soname="libnvrtc.so.12",
        nvrtc="12.6",
        nvrtc_paths=[f"{SITE}/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"],
    )
    decision = place(facts, FLEET_580)
    assert eligible(decision) == ALL - {"b200", "rtx5090", "gb10"}
    assert only(decision, "rtx5090") == (
        "1 free NVIDIA GeForce RTX 5090: compute capability 12.0: cupy-cuda12x 13.6.0 compiles its kernels (every"
        " elementwise operation, most"
        " reductions) with NVRTC at first use: it asks its NVRTC (CUDA 12.6) for a cubin of sm_90, the newest"
        " architecture its table gives that release, and that cubin does not load on this GPU; an NVRTC of CUDA"
        " 12.8 or later gives it code for this GPU (or CUPY_COMPILE_WITH_PTX=1, whose PTX the driver compiles)"
    )
    assert gpu_code.judge(archs, (9, 0)).runs


def test_cupy_13_6_with_cuda_12_8s_nvrtc_runs_on_blackwell() -> None:
    facts = cupy_image((12, 8))
    archs = archs_of(facts)
    assert archs.cupy is not None and archs.cupy.nvrtc == "12.8"
    assert eligible(place(facts, FLEET_580)) == ALL
    # B300 (sm_103) came with CUDA 12.9: CuPy 13.6 asks 12.8's NVRTC for it, which does not know it
    refusal = cupy_refusal(archs.cupy, (10, 3))
    assert (
        refusal is not None and "for sm_103, which that NVRTC does not know (CUDA 12.9 or later)" in refusal
    )


def test_cupy_compile_with_ptx_in_the_config_lifts_the_refusal() -> None:
    archs = archs_of(cupy_image((12, 6)))
    configured = with_jit_tools(archs, GpuFacts(flashinfer_env={"CUPY_COMPILE_WITH_PTX": "1"}))
    assert configured.cupy is not None and configured.cupy.compile_with_ptx
    assert gpu_code.judge(configured, (12, 0)).runs and not gpu_code.judge(archs, (12, 0)).runs
    for value in ("0", "yes", "2"):  # CuPy reads it as the integer 1 or not at all
        unset = with_jit_tools(archs, GpuFacts(flashinfer_env={"CUPY_COMPILE_WITH_PTX": value}))
        assert unset.cupy is not None and not unset.cupy.compile_with_ptx


# -- which NVRTC CuPy loads, by its version (`scanner.layers.cupy_nvrtc`)

PY = "/usr/local/lib/python3.11/site-packages"


def facts_of(cupy: str, *paths: str, more: dict[str, Distribution] | None = None) -> CupyFacts | None:
    name, version = cupy.rsplit(" ", 1)
    distributions = {
        f"{PY}/{name.replace('-', '_')}-{version}.dist-info": Distribution(name=name, version=version)
    }
    return cupy_facts({**distributions, **(more or {})}, paths)


def test_a_toolkits_nvrtc_is_read_by_its_versioned_file_or_directory() -> None:
    toolkit = "/usr/local/cuda-12.4/targets/x86_64-linux/lib"
    found = facts_of("cupy-cuda12x 13.6.0", f"{toolkit}/libnvrtc.so.12", f"{toolkit}/libnvrtc.so.12.4.127")
    assert found is not None and (found.soname, found.nvrtc) == ("libnvrtc.so.12", "12.4")
    found = facts_of("cupy-cuda12x 13.6.0", f"{toolkit}/libnvrtc.so.12")  # the link alone: the directory says
    assert found is not None and found.nvrtc == "12.4"
    debian = "/usr/lib/x86_64-linux-gnu"
    found = facts_of("cupy-cuda11x 12.3.0", f"{debian}/libnvrtc.so.11.2", f"{debian}/libnvrtc.so.11.8.89")
    assert found is not None and (found.soname, found.nvrtc) == ("libnvrtc.so.11.2", "11.8")


def test_copies_that_disagree_or_say_nothing_leave_the_release_unknown_and_none_is_empty() -> None:
    paths = ("/usr/local/cuda-12.4/lib64/libnvrtc.so.12", "/opt/cuda-12.8/lib64/libnvrtc.so.12.8.93")
    found = facts_of("cupy-cuda12x 13.6.0", paths[0], "/opt/cuda-12.8/lib64/libnvrtc.so.12", paths[1])
    assert found is not None and found.nvrtc is None and cupy_refusal(found, (12, 0)) is None
    found = facts_of("cupy-cuda12x 13.6.0", "/opt/nvrtc/libnvrtc.so.12")
    assert found is not None and found.nvrtc is None
    found = facts_of("cupy-cuda12x 13.6.0", "/usr/local/cuda-13.0/lib64/libnvrtc.so.13")  # not its soname
    assert found is not None and found.nvrtc == ""
    refusal = cupy_refusal(found, (9, 0))
    assert refusal is not None and "the image carries no libnvrtc.so.12 for it to load" in refusal
    found = facts_of("cupy-cuda12x 14.2.0")
    assert found is not None and found.nvrtc == ""
    refusal = cupy_refusal(found, (8, 0))
    assert refusal is not None and "its [ctk] extra (NVIDIA's NVRTC wheel) gives it one" in refusal


def test_cupy_14_takes_its_own_sites_wheel_first_then_the_newest_system_soname() -> None:
    wheel = {
        f"{PY}/nvidia_cuda_nvrtc_cu12-12.9.86.dist-info": Distribution(
            name="nvidia-cuda-nvrtc-cu12", version="12.9.86"
        )
    }
    system = ("/usr/local/cuda-13.0/lib64/libnvrtc.so.13", "/usr/local/cuda-12.6/lib64/libnvrtc.so.12")
    found = facts_of("cupy-cuda12x 14.2.0", f"{PY}/nvidia/cuda_nvrtc/lib/libnvrtc.so.12", *system, more=wheel)
    assert found is not None and (found.soname, found.nvrtc) == (None, "12.9")
    found = facts_of("cupy-cuda12x 14.2.0", *system)
    assert found is not None and (found.soname, found.nvrtc) == ("libnvrtc.so.13", "13.0")
    # 13.x loads its own major's soname by dlopen, wherever the file lies
    found = facts_of("cupy-cuda12x 13.6.0", f"{PY}/nvidia/cuda_nvrtc/lib/libnvrtc.so.12", *system, more=wheel)
    assert found is not None and found.nvrtc is None  # the wheel's 12.9 or the toolkit's 12.6: unknown
    found = facts_of("cupy-cuda110 10.6.0", "/usr/local/cuda-11.0/lib64/libnvrtc.so.11.0")
    assert found is not None and (found.soname, found.nvrtc) == ("libnvrtc.so.11.0", "11.0")


def test_images_with_the_same_files_and_another_nvrtc_are_judged_apart() -> None:
    """The verdict table is kept per image content: what a run-time compiler builds with is part of it,
    or an image with CUDA 12.8's NVRTC would be answered with the table of one with 12.6's."""
    older, newer = archs_of(cupy_image((12, 6))), archs_of(cupy_image((12, 8)))
    same_files = newer.model_copy(update={"files": older.files, "packages": older.packages})
    assert not gpu_code.verdicts(older)[(12, 0)].runs
    assert gpu_code.verdicts(same_files)[(12, 0)].runs


def test_cupy_14_takes_another_site_directorys_wheel_rather_than_none() -> None:
    user = "/root/.local/lib/python3.11/site-packages"
    wheel = {
        f"{user}/nvidia_cuda_nvrtc_cu12-12.8.93.dist-info": Distribution(
            name="nvidia-cuda-nvrtc-cu12", version="12.8.93"
        )
    }
    found = facts_of("cupy-cuda12x 14.2.0", f"{user}/nvidia/cuda_nvrtc/lib/libnvrtc.so.12", more=wheel)
    assert found is not None and found.nvrtc == "12.8" and cupy_refusal(found, (12, 0)) is None


def test_many_copies_of_nvrtc_cost_their_number_not_its_square() -> None:
    """A crafted image may name tens of thousands of `libnvrtc.so.12` (4,096 a layer): each copy's release
    is read from one index of the files beside it, not from a pass over all of them (which took minutes)."""
    import time

    paths = [f"/d{i}/libnvrtc.so.12" for i in range(40_000)] + [
        f"/d{i}/libnvrtc.so.12.{i % 9}.1" for i in range(40_000)
    ]
    started = time.process_time()
    found = facts_of("cupy-cuda12x 13.6.0", *paths)
    assert time.process_time() - started < 10
    assert found is not None and found.nvrtc is None and len(found.nvrtc_paths) == 8


def test_a_layer_not_read_whole_leaves_a_missing_nvrtc_unknown() -> None:
    """An NVRTC past a layer's read is unseen: CuPy is not refused everywhere for want of one."""
    cub = layer_evidence([members(CUPY["cupy-cuda12x", "13.6.0"], _CUPY_MEMBERS, "cupy-cub")])
    whole = archs_of(image([cub])).cupy
    assert whole is not None and whole.nvrtc == ""
    partial = archs_of(image([cub.model_copy(update={"complete": False})])).cupy
    assert partial is not None and partial.nvrtc is None and cupy_refusal(partial, (9, 0)) is None


def test_the_ptx_cupy_asks_for_needs_a_driver_as_new_as_its_nvrtc() -> None:
    """With `CUPY_COMPILE_WITH_PTX=1` CuPy asks NVRTC for PTX, which the driver compiles, and NVRTC writes
    its own release's ISA: CUDA 12.8's PTX (ISA 8.7) does not load with a driver of CUDA 12.2, where the
    cubin CuPy asks for without the setting does (CUDA's minor-version compatibility)."""
    archs = archs_of(cupy_image((12, 8)))
    configured = with_jit_tools(archs, GpuFacts(flashinfer_env={"CUPY_COMPILE_WITH_PTX": "1"}))
    old, new = gpu_code.Jit("535.104.05", "12.2"), gpu_code.Jit("570.86.10", "12.8")
    refused = gpu_code.judge(configured, (8, 0), old)
    assert refused.reasons == [
        "compute capability 8.0: cupy-cuda12x 13.6.0 compiles its kernels (every elementwise operation, most"
        " reductions) with NVRTC at first use: it asks its NVRTC (CUDA 12.8) for PTX of compute_80"
        " (CUPY_COMPILE_WITH_PTX=1), which the driver compiles, and PTX ISA 8.7 comes from CUDA 12.8, and this"
        " server's driver supports CUDA 12.2: a driver JIT-compiles only the PTX of its own CUDA version or"
        " older; without CUPY_COMPILE_WITH_PTX it asks for a cubin, which this driver loads"
    ]
    assert gpu_code.judge(configured, (8, 0), new).runs
    assert gpu_code.judge(archs, (8, 0), old).runs  # the cubin
    assert gpu_code.judge(configured, (8, 0)).runs  # no driver known: not judged
