"""numba-cuda's kernels, compiled at their first launch for an architecture NVRTC lists, judged per GPU
against numba-cuda's own source and NVRTC's own bytes, both from PyPI (cached, never committed).

* what numba-cuda compiles for on each GPU is what its own `find_closest_arch`, `get_arch_option` and
  `_ensure_cc` of each pinned wheel (0.16.0 to 0.30.4) pick, given the list the real `libnvrtc` of
  NVIDIA's wheels gives (`nvrtcGetSupportedArchs`, loaded with ctypes: no GPU needed), or where they raise;
* each real NVRTC's list is the one the placement's table gives its release, architecture for architecture;
* an image of numba-cuda beside NVIDIA's NVRTC wheel, read by the scanner's layer walk, is placed on the
  fleet: 0.30.4 with CUDA 12.8's NVRTC is refused on a GB10, 0.23.0 runs there; with CUDA 13's, a V100.
"""

from __future__ import annotations

import ast
import types
from collections.abc import Callable
from typing import Any

import pytest

from placement import gpu_code
from placement.compiler_releases import CC, Release
from placement.image_facts import ImageFacts
from placement.numba_compiler import compile_target, listed, numba_gap, numba_refusal
from scanner.layers.code_loading import Distribution, release_of
from scanner.layers.cuda_evidence import CudaLayerEvidence
from scanner.layers.cuda_jit_tools import with_jit_tools
from scanner.layers.numba_nvrtc import numba_facts
from scanner.models import GpuFacts, NumbaFacts
from tests.gpu_packages import CUDA13, SITE, layer_evidence, libraries, members
from tests.pypi_members import RemoteWheel, member_files
from tests.test_cupy_compiler import _CUPY_MEMBERS, CUPY, NVRTC, supported_archs
from tests.test_gpu_packages import ALL, FLEET_580, archs_of, eligible, image, only, place
from tests.test_jax_compiler import NVCC

pytestmark = pytest.mark.timeout(900)

_PLATFORM = "cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64"
NUMBA = {
    "0.16.0": RemoteWheel(
        "numba-cuda",
        "numba_cuda-0.16.0-py3-none-any.whl",
        "1c6c862ad3d7ac868a0f49aa6d98621b804462ca822a68ce7997d41f746af839",
    ),
    "0.20.0": RemoteWheel(
        "numba-cuda",
        "numba_cuda-0.20.0-py3-none-any.whl",
        "8a28ed3e39ddcb7cd81791099f76050f475e7e8efef04f545af31a6fd595fd82",
    ),
    "0.23.0": RemoteWheel(
        "numba-cuda",
        f"numba_cuda-0.23.0-{_PLATFORM}.whl",
        "402ef4f6e7e7930056acdad1528d3216a6c779f3e5ae3b6438a8bd99eb87d2b8",
    ),
    "0.24.0": RemoteWheel(
        "numba-cuda",
        f"numba_cuda-0.24.0-{_PLATFORM}.whl",
        "1616f9fe07fcff75ce0f3e14bef0d8017c6f80b8f2aa1665d712d8066d86e61c",
    ),
    "0.30.4": RemoteWheel(
        "numba-cuda",
        f"numba_cuda-0.30.4-{_PLATFORM}.whl",
        "59b0e895a4884a26323b9581ac6966b7b063b6f0ce87ac23d1192c95158f4d1e",
    ),
}
_NVRTC_PY = "numba_cuda/numba/cuda/cudadrv/nvrtc.py"
_CODEGEN_PY = "numba_cuda/numba/cuda/codegen.py"
# Every GPU generation, and the architectures only a list or a table names (older, and newer than any GPU here).
CCS: list[CC] = [
    (3, 5), (5, 0), (5, 3), (6, 0), (6, 1), (6, 2), (7, 0), (7, 2), (7, 5), (8, 0), (8, 6), (8, 7), (8, 8),
    (8, 9), (9, 0), (10, 0), (10, 1), (10, 3), (10, 7), (11, 0), (12, 0), (12, 1), (13, 0),
]  # fmt: skip


def _functions(source: str, names: set[str]) -> list[ast.stmt]:
    """The module-level (or, for methods, class-level) functions of `source` named `names`, undecorated."""
    kept: list[ast.stmt] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            kept.append(node)
    return kept


def their_picker(wheel: RemoteWheel) -> types.CodeType:
    """numba-cuda's own `find_closest_arch` and `get_arch_option` (cudadrv/nvrtc.py) and `_ensure_cc`
    (codegen.py, a method of its code library, whose `self` it does not use), as one module."""
    files = member_files(wheel, lambda name: name in (_NVRTC_PY, _CODEGEN_PY))
    kept = _functions(files[_NVRTC_PY].read_text(), {"find_closest_arch", "get_arch_option"})
    kept += _functions(files[_CODEGEN_PY].read_text(), {"_ensure_cc"})
    assert sorted(n.name for n in kept if isinstance(n, ast.FunctionDef)) == [
        "_ensure_cc",
        "find_closest_arch",
        "get_arch_option",
    ]
    return compile(ast.Module(body=kept, type_ignores=[]), wheel.filename, "exec")


class CCSupportError(Exception):
    """numba-cuda's error for a GPU older than every architecture NVRTC lists."""


def their_target(code: types.CodeType, supported: list[CC], cc: CC) -> str:
    """What the wheel's own code compiles for on a GPU of `cc` with an NVRTC listing `supported`: the
    `-arch` option NVVM gets, or the error that stops the launch."""
    device = types.SimpleNamespace(compute_capability=cc)
    scope: dict[str, Any] = {
        "get_supported_ccs": lambda: list(supported),
        "config": types.SimpleNamespace(FORCE_CUDA_CC=None),
        "CCSupportError": CCSupportError,
        "devices": types.SimpleNamespace(get_context=lambda: types.SimpleNamespace(device=device)),
    }
    exec(code, scope)
    try:
        ensured = scope["_ensure_cc"](None, None)
        return str(scope["get_arch_option"](*ensured))
    except CCSupportError:
        return "CCSupportError"
    except ValueError as error:
        assert "arch-specific" in str(error)
        return "ValueError"


@pytest.fixture(scope="module")
def real_lists() -> dict[Release, list[CC]]:
    """What each real NVRTC lists, oldest first (as `get_supported_ccs` returns it)."""
    found: dict[Release, list[CC]] = {}
    for release, wheel in NVRTC.items():
        (library,) = member_files(
            wheel, lambda name: name.endswith(("/lib/libnvrtc.so.12", "/lib/libnvrtc.so.13"))
        ).values()
        found[release] = sorted(supported_archs(library))
    return found


def test_each_real_nvrtc_lists_what_the_table_gives_its_release(real_lists: dict[Release, list[CC]]) -> None:
    for release, real in real_lists.items():
        assert listed(release) == real, release


@pytest.mark.parametrize("version", sorted(NUMBA, key=lambda v: release_of(v) or (0, 0)))
def test_numba_compiles_for_what_its_own_source_picks(
    version: str, real_lists: dict[Release, list[CC]]
) -> None:
    code = their_picker(NUMBA[version])
    numba = release_of(version)
    assert numba is not None
    outcomes: set[str] = set()
    for nvrtc, supported in real_lists.items():
        for cc in CCS:
            theirs = their_target(code, supported, cc)
            ours = compile_target(numba, nvrtc, cc)
            assert (ours or theirs) == theirs and (ours is None) == (theirs.endswith("Error")), (nvrtc, cc)
            outcomes.add(theirs if theirs.endswith("Error") else "compiles")
            facts = NumbaFacts(distribution="numba-cuda", version=version, nvrtc=f"{nvrtc[0]}.{nvrtc[1]}")
            assert (numba_refusal(facts, cc, other_code=False) is None) == (ours is not None)
            assert (numba_gap(facts, cc, other_code=True) is None) == (ours is not None)
    arch_specific = numba >= (0, 24)
    assert outcomes == {"compiles", "CCSupportError", *(["ValueError"] if arch_specific else [])}


# -- images: numba-cuda's package over NVIDIA's NVRTC wheel, read by the scanner's layer walk

_NUMBA_MEMBERS: Callable[[str], bool] = lambda name: (  # noqa: E731
    name.endswith(".dist-info/RECORD") or name in (_NVRTC_PY, _CODEGEN_PY)
)


NVVM = f"{SITE}/nvidia/cuda_nvcc/nvvm/lib64/libnvvm.so"  # NVIDIA's nvcc wheel's, which `[cu12]` installs


def nvvm_layer(major: int = 12) -> CudaLayerEvidence:
    """libNVVM as NVIDIA's nvcc wheel 12.8.93 installs it, or for CUDA 13 its nvvm wheel 13.0.88 (what
    numba-cuda compiles its kernels with)."""
    if major == 13:
        return layer_evidence([libraries(CUDA13["nvvm"], "libnvvm.so.4")])
    return layer_evidence([libraries(NVCC["12.8"], "libnvvm.so")])


def numba_image(version: str, nvrtc: Release, nvvm: bool = True) -> ImageFacts:
    soname = f"libnvrtc.so.{nvrtc[0]}"
    wheel = CUDA13["nvrtc"] if nvrtc[0] == 13 else NVRTC[nvrtc]
    return image(
        [
            layer_evidence([members(NUMBA[version], _NUMBA_MEMBERS, "numba-cuda")]),
            layer_evidence([libraries(wheel, soname)]),
            *([nvvm_layer(nvrtc[0])] if nvvm else []),
        ]
    )


def test_numba_cuda_0_30_with_cuda_12_8s_nvrtc_is_refused_on_gb10() -> None:
    """From 0.24 numba-cuda compiles for `compute_121a` on a GB10, which CUDA 12.8's NVRTC does not list
    (12.9 brought it): the first launch raises, where 0.23 compiled `compute_120` PTX for the driver."""
    facts = numba_image("0.30.4", (12, 8))
    archs = archs_of(facts)
    assert archs.numba == NumbaFacts(
        distribution="numba-cuda",
        version="0.30.4",
        nvrtc="12.8",
        nvrtc_paths=[f"{SITE}/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"],
        nvvm=NVVM,
        nvvm_release="12.8",
        nvjitlink="",  # none: the driver links what libNVVM writes
    )
    decision = place(facts, FLEET_580)
    assert eligible(decision) == ALL - {"gb10"}
    assert only(decision, "gb10") == (
        "1 free NVIDIA GB10: compute capability 12.1: numba-cuda 0.30.4 compiles every @cuda.jit kernel at its"
        " first launch, for an architecture its NVRTC lists: on compute capability 9.0 and later it compiles for"
        " the GPU's own architecture, which its NVRTC (CUDA 12.8) does not list, so the first launch stops:"
        ' "Can\'t use arch-specific compute_121a with closest found compute capability compute_120"; an NVRTC'
        " of CUDA 12.9 or later lists it"
    )
    assert eligible(place(numba_image("0.23.0", (12, 8)), FLEET_580)) == ALL


def test_numba_cuda_without_libnvvm_is_refused_everywhere_unless_a_cuda_home_may_bring_one() -> None:
    """`pip install numba-cuda` on NVIDIA's runtime image: NVRTC is there, libNVVM is not, and every kernel
    fails to compile. A CUDA home the config names and the image lacks may be mounted: nothing is claimed."""
    facts = numba_image("0.30.4", (12, 8), nvvm=False)
    archs = archs_of(facts)
    assert archs.numba is not None and archs.numba.nvvm == "" and archs.numba.nvrtc == "12.8"
    decision = place(facts, FLEET_580)
    assert eligible(decision) == set()
    assert only(decision, "h100") == (
        "1 free NVIDIA H100 80GB HBM3: compute capability 9.0: numba-cuda 0.30.4 compiles every @cuda.jit kernel"
        " at its first launch, for an architecture its NVRTC lists: the image carries no libNVVM, which compiles"
        " every kernel, so the first launch stops; its [cu12] or [cu13] extra (NVIDIA's nvcc or nvvm wheel)"
        " gives it one, as a CUDA devel image does"
    )
    mounted = with_jit_tools(archs, GpuFacts(flashinfer_env={"CUDA_HOME": "/opt/cuda"}))
    assert mounted.numba is not None and mounted.numba.nvvm is None
    assert all(gpu_code.judge(mounted, cc).runs for cc in [(7, 0), (9, 0), (12, 0)])
    partial = image(
        [
            layer_evidence([members(NUMBA["0.30.4"], _NUMBA_MEMBERS, "numba-cuda")]),
            layer_evidence([libraries(NVRTC[(12, 8)], "libnvrtc.so.12")]).model_copy(
                update={"complete": False}
            ),
        ]
    )
    unread = archs_of(partial).numba  # a layer not read whole: its names are not all known
    assert unread is not None and unread.nvvm is None and unread.nvrtc == "12.8"


def test_beside_gpu_code_of_its_own_the_image_runs_without_numbas_kernels() -> None:
    """cuDF's stack: numba-cuda beside packages that carry GPU code (CuPy's CUB module here), which call
    numba-cuda on demand (cuDF's UDFs): the GB10 is not refused, and what it runs without is named."""
    facts = image(
        [
            layer_evidence([members(NUMBA["0.30.4"], _NUMBA_MEMBERS, "numba-cuda")]),
            layer_evidence([members(CUPY["cupy-cuda12x", "13.6.0"], _CUPY_MEMBERS, "cupy-cub")]),
            layer_evidence([libraries(NVRTC[(12, 8)], "libnvrtc.so.12")]),
            nvvm_layer(),
        ]
    )
    decision = place(facts, FLEET_580)
    assert eligible(decision) == ALL
    verdict = gpu_code.judge(archs_of(facts), (12, 1))
    assert verdict.runs and verdict.without == [
        "numba-cuda 0.30.4's kernels: on compute capability 9.0 and later it compiles for the GPU's own"
        " architecture, which its NVRTC (CUDA 12.8) does not list, so the first launch stops: \"Can't use"
        ' arch-specific compute_121a with closest found compute capability compute_120"; an NVRTC of CUDA'
        " 12.9 or later lists it, so no @cuda.jit kernel runs here"
    ]


def test_numba_cuda_with_cuda_13s_nvrtc_is_refused_on_a_v100() -> None:
    facts = numba_image("0.30.4", (13, 0))
    archs = archs_of(facts)
    assert archs.numba is not None and archs.numba.nvrtc == "13.0"
    assert eligible(place(facts, FLEET_580)) == ALL - {"v100"}  # a CUDA 13 image, by its NVRTC wheel, too
    (reason,) = gpu_code.judge(archs, (7, 0)).reasons
    assert reason.endswith(
        'its NVRTC (CUDA 13.0) lists nothing this old, so the first launch stops: "GPU compute capability 7.0'
        ' is not supported(requires >=7.5)"; an NVRTC of CUDA 12 or earlier lists it'
    )
    assert gpu_code.judge(archs, (12, 1)).runs  # 13.0 lists sm_121


def test_numba_force_cuda_cc_in_the_config_leaves_the_gpu_unjudged() -> None:
    archs = archs_of(numba_image("0.30.4", (12, 8)))
    forced = with_jit_tools(archs, GpuFacts(flashinfer_env={"NUMBA_FORCE_CUDA_CC": "12.0"}))
    assert forced.numba is not None and forced.numba.forced_cc == "12.0"
    assert gpu_code.judge(forced, (12, 1)).runs and not gpu_code.judge(archs, (12, 1)).runs
    assert with_jit_tools(archs, GpuFacts(flashinfer_env={"NUMBA_FORCE_CUDA_CC": " "})) == archs


def test_images_with_the_same_files_and_another_nvrtc_are_judged_apart() -> None:
    """The verdict table is kept per image content, numba-cuda's NVRTC included."""
    older, newer = archs_of(numba_image("0.30.4", (12, 8))), archs_of(numba_image("0.30.4", (13, 0)))
    same_files = older.model_copy(update={"numba": newer.numba})
    assert not gpu_code.verdicts(older)[(12, 1)].runs
    assert gpu_code.verdicts(same_files)[(12, 1)].runs


# -- which NVRTC numba-cuda asks, by its version (`scanner.layers.numba_nvrtc`)

PY = "/usr/local/lib/python3.11/site-packages"


def facts_of(version: str, *paths: str, more: dict[str, Distribution] | None = None) -> NumbaFacts | None:
    dist = {f"{PY}/numba_cuda-{version}.dist-info": Distribution(name="numba-cuda", version=version)}
    return numba_facts({**dist, **(more or {})}, paths, [NVVM])


_WHEEL_12_9 = {
    f"{PY}/nvidia_cuda_nvrtc_cu12-12.9.86.dist-info": Distribution(
        name="nvidia-cuda-nvrtc-cu12", version="12.9.86"
    )
}
_SYSTEM = ("/usr/local/cuda-13.0/lib64/libnvrtc.so.13", "/usr/local/cuda-12.6/lib64/libnvrtc.so.12")


def test_numba_cuda_from_0_21_asks_the_nvrtc_cuda_pathfinder_loads() -> None:
    found = facts_of("0.30.4", f"{PY}/nvidia/cuda_nvrtc/lib/libnvrtc.so.12", *_SYSTEM, more=_WHEEL_12_9)
    assert found is not None and found.nvrtc == "12.9"
    found = facts_of("0.21.0", *_SYSTEM)  # no wheel: the newest system soname
    assert found is not None and found.nvrtc == "13.0"


def test_numba_cuda_before_0_21_claims_a_release_only_where_every_copy_agrees() -> None:
    found = facts_of("0.20.0", f"{PY}/nvidia/cuda_nvrtc/lib/libnvrtc.so.12", *_SYSTEM, more=_WHEEL_12_9)
    assert (
        found is not None and found.nvrtc is None and numba_refusal(found, (7, 0), other_code=False) is None
    )
    found = facts_of("0.16.0", f"{PY}/nvidia/cuda_nvrtc/lib/libnvrtc.so.12", more=_WHEEL_12_9)
    assert found is not None and found.nvrtc == "12.9"


def test_numba_cuda_before_0_16_is_not_judged_and_none_is_refused_everywhere() -> None:
    found = facts_of("0.15.2", *_SYSTEM)
    assert found == NumbaFacts(distribution="numba-cuda", version="0.15.2")  # nothing read: not judged
    assert all(numba_refusal(found, cc, other_code=False) is None for cc in CCS)
    found = facts_of("0.30.4")
    assert found is not None and found.nvrtc == ""
    refusal = numba_refusal(found, (9, 0), other_code=False)
    assert refusal is not None and refusal.endswith(
        "the image carries no NVRTC for it to ask, so the first launch stops; its [cu12] or [cu13] extra"
        " (NVIDIA's NVRTC wheel) gives it one"
    )
    assert (
        numba_facts({f"{PY}/numba-0.60.0.dist-info": Distribution(name="numba", version="0.60.0")}, [], [])
        is None
    )
