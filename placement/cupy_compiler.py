"""Whether the image's CuPy can compile its kernels for a GPU. Pure.

CuPy compiles nearly every kernel it runs (each elementwise operation and ufunc, `arange`, `astype`,
most reductions along an axis) at first use with NVRTC; without them `cupy.arange(3) * 2` fails, so an
image whose CuPy cannot compile for a GPU does not run there. Which NVRTC it loads is the scan's
(`scanner.layers.cupy_nvrtc`); what it asks that NVRTC for is `cupy/cuda/compiler.py`'s, read in every
wheel from 10.0 to 14.2 (`_get_max_compute_capability`, `_get_arch`, `_get_arch_for_options_for_nvrtc`):

* a table gives the newest architecture it takes its NVRTC to know, by the NVRTC's release (`table_max`):
  14.x says 90 for 12.0 to 12.7, 120 for 12.8, 121 after; 13.4 to 13.6 say 120 from 12.8 on; 11.3 to
  13.3 say 90 from 11.8 on, so every CUDA 12 is 90 there;
* the GPU's capability, as a string (`"120"`), is lowered to that maximum, except for the Tegra GPUs it
  lists (`TEGRA`); up to 13.3 the `min` compares the strings, so a capability of three digits ("100" <
  "90") is kept as it is, and NVRTC before 12.8 rejects it ("invalid value for --gpu-architecture");
* it asks for a cubin of that architecture (`-arch=sm_90`) unless `CUPY_COMPILE_WITH_PTX=1` (or, up to
  12.x, a build for CUDA before 11.1, or an architecture past the maximum, a Tegra one) makes it PTX; a
  cubin runs only on GPUs of its own major at or above it: `sm_90` on a Blackwell GPU fails to load
  (`CUDA_ERROR_NO_BINARY_FOR_GPU`, cupy/cupy#9106: 13.4.1 with CUDA 12.0 on an RTX 5080). Nothing
  falls back: the first kernel raises.

PTX is compiled by the driver, which must be as new as the NVRTC that wrote it (NVRTC writes its own
release's PTX ISA; CuPy's `compiler.py` says so of CUDA 11.3 on): where CuPy asks for PTX on a GPU, a
server whose driver cannot compile that ISA is refused (`ptx_refusal`, the server's driver's judge),
and a cubin, where CuPy would ask for one without `CUPY_COMPILE_WITH_PTX`, is named as the remedy.
Which releases know which architecture is `placement.compiler_releases`'s table.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

from placement.compiler_releases import CC, Release, compiles_for, release, releases_knowing, written_isa
from scanner.layers.code_loading import release_of
from scanner.models import CupyFacts

WHAT = "compiles its kernels (every elementwise operation, most reductions) with NVRTC at first use"
# NVRTC releases where CuPy's tables change, or its architectures do: the remedies are looked for here.
RELEASES: tuple[Release, ...] = (
    (10, 2), (11, 0), (11, 1), (11, 2), (11, 4), (11, 8), (12, 0), (12, 4), (12, 8), (12, 9), (13, 0), (13, 4),
)  # fmt: skip
STRING_COMPARE_UNTIL = (13, 4)  # `min(cc, max)` on strings before 13.4.0 (cupy/cupy#8899 made it key=int)
_BUILT_FOR = re.compile(r"^cupy-cuda(\d{2})(\d)$")  # cupy-cuda110: built with CUDA 11.0


def table_max(cupy: Release, nvrtc: Release) -> int:
    """The newest architecture CuPy `cupy` takes an NVRTC of release `nvrtc` to know
    (`_get_max_compute_capability`), as an integer (`90`, `120`)."""
    if cupy >= (14, 0):
        return 90 if nvrtc[0] == 12 and nvrtc[1] < 8 else 120 if nvrtc == (12, 8) else 121
    if nvrtc < (11, 0):
        return 75
    if nvrtc == (11, 0):
        return 80
    if cupy >= (11, 3):
        newest_table = 120 if cupy >= (13, 4) and nvrtc >= (12, 8) else 90
        return 86 if nvrtc < (11, 8) else newest_table
    if cupy >= (11, 1):
        return 86
    if cupy >= (10, 2):
        return 86 if nvrtc < (11, 4) else 87
    return 86


def tegra(cupy: Release) -> frozenset[int]:
    """The Tegra capabilities CuPy `cupy` compiles for as they are (`_tegra_archs`)."""
    if cupy >= (11, 1):
        return frozenset({32, 53, 62, 72, 87})
    return frozenset({32, 53, 62, 72}) if cupy >= (10, 4) else frozenset({53, 62, 72})


def nvrtc_target(cupy: CupyFacts, nvrtc: Release, cc: CC) -> tuple[int, Literal["cubin", "ptx"]]:
    """The architecture CuPy asks its NVRTC for on `cc`, and what it asks for (module docstring)."""
    version = release_of(cupy.version) or (0, 0)
    maximum, device = table_max(version, nvrtc), cc[0] * 10 + cc[1]
    strings = version < STRING_COMPARE_UNTIL
    if device in tegra(version):
        arch = device
    else:
        arch = int(min(str(device), str(maximum))) if strings else min(device, maximum)
    built = _BUILT_FOR.match(cupy.distribution)
    before_cubins = version < (13, 0) and built is not None and (int(built[1]), int(built[2])) < (11, 1)
    within = str(arch) <= str(maximum) if strings else arch <= maximum
    return arch, "cubin" if within and not cupy.compile_with_ptx and not before_cubins else "ptx"


def _runs(cupy: CupyFacts, nvrtc: Release, cc: CC) -> bool:
    arch, kind = nvrtc_target(cupy, nvrtc, cc)
    device = cc[0] * 10 + cc[1]
    if not compiles_for(nvrtc, (arch // 10, arch % 10)) or arch > device:
        return False
    return kind == "ptx" or arch // 10 == cc[0]


def _remedy(cupy: CupyFacts, nvrtc: Release, cc: CC) -> str:
    """What gives CuPy code for `cc`: another NVRTC release that does (a newer one first), or PTX."""
    majors = {cupy.cuda_major} if cupy.cuda_major and cupy.soname else {12, 13}  # 14.x loads either
    working = [r for r in RELEASES if r[0] in majors and r != nvrtc and _runs(cupy, r, cc)]
    newer = [r for r in working if r > nvrtc]
    if newer:
        first = newer[0]
        later = all(_runs(cupy, r, cc) for r in RELEASES if r[0] in majors and r >= first)
        fix = (
            f"an NVRTC of CUDA {first[0]}.{first[1]}{' or later' if later else ''} gives it code for this GPU"
        )
    elif working:
        fix = f"an NVRTC of CUDA {working[-1][0]}.{working[-1][1]} gives it code for this GPU"
    else:
        fix = f"no NVRTC of CUDA {' or '.join(str(m) for m in sorted(majors))} gives this CuPy code for this GPU"
    ptx = cupy.model_copy(update={"compile_with_ptx": True})
    if not cupy.compile_with_ptx and _runs(ptx, nvrtc, cc):
        fix += " (or CUPY_COMPILE_WITH_PTX=1, whose PTX the driver compiles)"
    return fix


def cupy_refusal(
    cupy: CupyFacts | None, cc: CC, ptx_refusal: Callable[[str | None], str | None] | None = None
) -> str | None:
    """Why the image does not run on `cc` for want of the kernels its CuPy compiles, or None where it
    can compile them (or the NVRTC it loads is not known). `ptx_refusal`: why the server's driver cannot
    compile PTX of an ISA (`gpu_code.Jit.refusal`); without it, the driver is not judged."""
    if cupy is None or cupy.nvrtc is None:
        return None
    name = f"{cupy.distribution} {cupy.version}"
    if cupy.nvrtc == "":
        wanted = cupy.soname or "libnvrtc.so"
        fix = (
            "its [ctk] extra (NVIDIA's NVRTC wheel) gives it one"
            if (release_of(cupy.version) or (0, 0)) >= (14, 0)
            else "NVIDIA's CUDA images (runtime or devel) carry one"
        )
        return f"{name} {WHAT}, and the image carries no {wanted} for it to load; {fix}"
    nvrtc = release(cupy.nvrtc)
    if nvrtc is None:
        return None
    if _runs(cupy, nvrtc, cc):
        return _driver_refusal(cupy, name, nvrtc, cc, ptx_refusal)
    arch, kind = nvrtc_target(cupy, nvrtc, cc)
    target = f"{'sm' if kind == 'cubin' else 'compute'}_{arch}"
    said = f"its NVRTC (CUDA {nvrtc[0]}.{nvrtc[1]})"
    if not compiles_for(nvrtc, (arch // 10, arch % 10)):
        knowing = releases_knowing(nvrtc, (arch // 10, arch % 10))
        why = f"it asks {said} for {target}, which that NVRTC does not know" + (
            f" ({knowing})" if knowing else ""
        )
    else:
        why = (
            f"it asks {said} for a cubin of {target}, the newest architecture its table gives that release,"
            " and that cubin does not load on this GPU"
        )
    return f"{name} {WHAT}: {why}; {_remedy(cupy, nvrtc, cc)}"


def _driver_refusal(
    cupy: CupyFacts, name: str, nvrtc: Release, cc: CC, ptx_refusal: Callable[[str | None], str | None] | None
) -> str | None:
    """Where CuPy asks its NVRTC for PTX on `cc`: why this server's driver cannot compile it, or None."""
    arch, kind = nvrtc_target(cupy, nvrtc, cc)
    if kind != "ptx" or ptx_refusal is None:
        return None
    why = ptx_refusal(written_isa(nvrtc))
    if why is None:
        return None
    asked = " (CUPY_COMPILE_WITH_PTX=1)" if cupy.compile_with_ptx else ""
    fix = ""
    if cupy.compile_with_ptx and _runs(cupy.model_copy(update={"compile_with_ptx": False}), nvrtc, cc):
        fix = "; without CUPY_COMPILE_WITH_PTX it asks for a cubin, which this driver loads"
    return (
        f"{name} {WHAT}: it asks its NVRTC (CUDA {nvrtc[0]}.{nvrtc[1]}) for PTX of compute_{arch}{asked},"
        f" which the driver compiles, and {why}{fix}"
    )
