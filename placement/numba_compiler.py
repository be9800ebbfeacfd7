"""Whether the image's numba-cuda can compile its kernels for a GPU. Pure.

numba-cuda compiles every `@cuda.jit` kernel at its first launch: NVVM writes PTX for the architecture
`nvrtc.get_arch_option` picks from the list its NVRTC gives (`nvrtcGetSupportedArchs`), and the PTX is
linked for the GPU (by nvJitLink or the driver). Which NVRTC it asks, and whether the image carries the
libNVVM it compiles with, is the scan's (`scanner.layers.numba_nvrtc`). What it picks, read in its
source 0.16.0 to 0.30.4 (`find_closest_arch`, `get_arch_option`, `codegen._ensure_cc`):

* the GPU's own architecture where NVRTC lists it, else the newest listed below it (PTX the driver
  compiles forward), else, past the whole list, the newest listed;
* a GPU older than every listed architecture stops the first launch: "GPU compute capability 7.0 is not
  supported(requires >=7.5)" (a V100 with CUDA 13's NVRTC);
* from 0.24, on compute capability 9.0 and later it asks for the architecture-specific target
  (`compute_103a`), which has no older stand-in: where NVRTC does not list the GPU's own architecture the
  first launch stops with "Can't use arch-specific compute_121a with closest found compute capability
  compute_120" (a GB10 with CUDA 12.8's NVRTC).

With no libNVVM in the image (NVIDIA's runtime images carry none) nothing compiles at all. Nothing falls
back: the launch raises. Where numba-cuda is the image's only GPU code, its kernels are what the image
runs on the GPU, and it is refused there; beside GPU code of its own (cuDF, which calls numba-cuda for its
UDFs), what the image runs without is named instead. `NUMBA_FORCE_CUDA_CC` in the config replaces the
GPU's architecture, and nothing is judged then. Not judged either: numba-cuda before 0.16 (its table keyed
by the CUDA runtime, PTX of the closest older architecture), numba's own built-in CUDA target, and the
link step (an nvJitLink or driver older than NVVM's PTX). Which releases list which architecture is
`placement.compiler_releases`'s table; the tests hold it against NVIDIA's NVRTC of 12.6, 12.8, 12.9, 13.0
and 13.5.
"""

from __future__ import annotations

from placement.compiler_releases import CC, FIRST_RELEASE, Release, compiles_for, release, releases_knowing
from scanner.layers.code_loading import release_of
from scanner.models import NumbaFacts

WHAT = "compiles every @cuda.jit kernel at its first launch, for an architecture its NVRTC lists"
ARCH_SPECIFIC_FROM = (0, 24)  # `_ensure_cc` asks for `compute_XYa` on 9.0 and later
NVRTC_LIST_FROM = (0, 16)
# Every architecture an NVRTC has listed, oldest first; which release lists which is `compiles_for`'s.
ARCHITECTURES: tuple[CC, ...] = tuple(
    sorted({(3, 0), (3, 2), (3, 5), (3, 7), (5, 0), (5, 2), (5, 3), (6, 0), (6, 1), (6, 2), (7, 0), (7, 2),
            (7, 5), *FIRST_RELEASE})
)  # fmt: skip


def listed(nvrtc: Release) -> list[CC]:
    """The architectures an NVRTC of release `nvrtc` lists (`nvrtcGetSupportedArchs`), oldest first."""
    return [cc for cc in ARCHITECTURES if compiles_for(nvrtc, cc)]


def compile_target(numba: Release, nvrtc: Release, cc: CC) -> str | None:
    """The target numba-cuda of release `numba` compiles for on `cc` with an NVRTC of release `nvrtc`
    (`compute_90a`, `compute_80`), or None where its first launch stops (module docstring)."""
    supported = listed(nvrtc)
    below = [known for known in supported if known <= cc]
    if not below:
        return None
    closest = below[-1]
    suffix = "a" if numba >= ARCH_SPECIFIC_FROM and cc >= (9, 0) else ""
    if suffix and closest != cc:
        return None
    return f"compute_{closest[0]}{closest[1]}{suffix}"


def numba_refusal(numba: NumbaFacts | None, cc: CC, other_code: bool) -> str | None:
    """Why the image does not run on `cc` for want of the kernels its numba-cuda compiles, or None where it
    can compile them, the NVRTC it asks is not known, or the image carries GPU code of its own
    (`other_code`: there numba-cuda serves what its users call on demand, cuDF's UDFs among them, and
    `numba_gap` names what the image runs without)."""
    found = _gap(numba, cc)
    if found is None or other_code:
        return None
    name, why = found
    return f"{name} {WHAT}: {why}"


def numba_gap(numba: NumbaFacts | None, cc: CC, other_code: bool) -> str | None:
    """What the image runs without on `cc` where numba-cuda cannot compile there beside GPU code of its
    own, as a "without" line, or None."""
    found = _gap(numba, cc)
    if found is None or not other_code:
        return None
    name, why = found
    return f"{name}'s kernels: {why}, so no @cuda.jit kernel runs here"


def _gap(numba: NumbaFacts | None, cc: CC) -> tuple[str, str] | None:
    """(numba-cuda's name, why it cannot compile its kernels on `cc`, with the remedy), or None where it
    can (or the NVRTC it asks is not known, or the config forces an architecture)."""
    if numba is None or numba.nvrtc is None or numba.forced_cc:
        return None
    version = release_of(numba.version) or (0, 0)
    if version < NVRTC_LIST_FROM:
        return None
    name = f"{numba.distribution} {numba.version}"
    if numba.nvvm == "":
        return name, (
            "the image carries no libNVVM, which compiles every kernel, so the first launch stops; its [cu12] or"
            " [cu13] extra (NVIDIA's nvcc or nvvm wheel) gives it one, as a CUDA devel image does"
        )
    if numba.nvrtc == "":
        return name, (
            "the image carries no NVRTC for it to ask, so the first launch stops; its [cu12] or [cu13] extra"
            " (NVIDIA's NVRTC wheel) gives it one"
        )
    nvrtc = release(numba.nvrtc)
    if nvrtc is None or compile_target(version, nvrtc, cc) is not None:
        return None
    supported = listed(nvrtc)
    said = f"its NVRTC (CUDA {nvrtc[0]}.{nvrtc[1]})"
    oldest = supported[0] if supported else None
    if oldest is None or cc < oldest:
        needs = f"{oldest[0]}.{oldest[1]}" if oldest else "an architecture it lists"
        why = (
            f'{said} lists nothing this old, so the first launch stops: "GPU compute capability'
            f' {cc[0]}.{cc[1]} is not supported(requires >={needs})"'
        )
    else:
        closest = max(known for known in supported if known <= cc)
        why = (
            f"on compute capability 9.0 and later it compiles for the GPU's own architecture, which {said}"
            f" does not list, so the first launch stops: \"Can't use arch-specific compute_{cc[0]}{cc[1]}a with"
            f' closest found compute capability compute_{closest[0]}{closest[1]}"'
        )
    knowing = releases_knowing(nvrtc, cc)
    return name, why + (f"; an NVRTC of {knowing} lists it" if knowing else "")
