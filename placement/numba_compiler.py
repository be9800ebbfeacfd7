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

With no libNVVM in the image (NVIDIA's runtime images carry none) nothing compiles at all. Then the
kernel is linked for the GPU's own architecture (`sm_121a` from 0.24, `sm_121` before), read in the same
source (`_have_nvjitlink`, `decorators.jit`, `codegen.get_cubin`) and checked against NVIDIA's own libNVVM
and nvJitLink of CUDA 12.6 to 13.0:

* where `cuda.bindings` loads an nvJitLink of CUDA 12.3 or later, NVVM writes LTO-IR and nvJitLink links
  it. nvJitLink refuses LTO-IR a newer libNVVM wrote ("ERROR 4 in nvvmAddNVVMContainerToProgram, may
  need newer version of nvJitLink library"; CUDA 12's into 13's links), and an architecture it does not
  know ("-arch=compute_120 is an unsupported option" from 12.6's on an RTX 5090, where the driver would
  have compiled NVRTC 12.6's `compute_90` PTX);
* else the driver links NVVM's PTX, of its release's ISA (12.8's writes 8.7), which a driver older than
  that release cannot compile (`ptx_refusal`, the server's driver's judge).

A libNVVM that does not know the architecture NVRTC lists stops the launch too. Nothing falls back: the
launch raises. Where numba-cuda is the image's only GPU code, its kernels are what the image
runs on the GPU, and it is refused there; beside GPU code of its own (cuDF, which calls numba-cuda for its
UDFs), what the image runs without is named instead. `NUMBA_FORCE_CUDA_CC` in the config replaces the
GPU's architecture, and nothing is judged then. Not judged either: numba-cuda before 0.16 (its table keyed
by the CUDA runtime, PTX of the closest older architecture), numba's own built-in CUDA target, and whether
a driver of an older major loads the cubin a newer nvJitLink links. Which releases list which architecture is
`placement.compiler_releases`'s table; the tests hold it against NVIDIA's NVRTC of 12.6, 12.8, 12.9, 13.0
and 13.5.
"""

from __future__ import annotations

from collections.abc import Callable

from placement.compiler_releases import (
    CC,
    FIRST_RELEASE,
    Release,
    compiles_for,
    release,
    releases_knowing,
    written_isa,
)
from scanner.layers.code_loading import release_of
from scanner.models import NumbaFacts

PtxRefusal = Callable[[str | None], str | None]

WHAT = "compiles every @cuda.jit kernel at its first launch, for an architecture its NVRTC lists"
ARCH_SPECIFIC_FROM = (0, 24)  # `_ensure_cc` asks for `compute_XYa` on 9.0 and later
NVRTC_LIST_FROM = (0, 16)
LTO_FROM = (
    12,
    3,
)  # `_have_nvjitlink`: an nvJitLink this old or newer links LTO-IR; below, the driver links PTX
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


def numba_refusal(
    numba: NumbaFacts | None, cc: CC, other_code: bool, ptx_refusal: PtxRefusal | None = None
) -> str | None:
    """Why the image does not run on `cc` for want of the kernels its numba-cuda compiles, or None where it
    can compile and link them, the NVRTC it asks is not known, or the image carries GPU code of its own
    (`other_code`: there numba-cuda serves what its users call on demand, cuDF's UDFs among them, and
    `numba_gap` names what the image runs without). `ptx_refusal`: why the server's driver cannot compile
    PTX of an ISA (`gpu_code.Jit.refusal`); without it, a link by the driver is not judged."""
    found = _gap(numba, cc, ptx_refusal)
    if found is None or other_code:
        return None
    name, why = found
    return f"{name} {WHAT}: {why}"


def numba_gap(
    numba: NumbaFacts | None, cc: CC, other_code: bool, ptx_refusal: PtxRefusal | None = None
) -> str | None:
    """What the image runs without on `cc` where numba-cuda cannot compile there beside GPU code of its
    own, as a "without" line, or None."""
    found = _gap(numba, cc, ptx_refusal)
    if found is None or not other_code:
        return None
    name, why = found
    return f"{name}'s kernels: {why}, so no @cuda.jit kernel runs here"


def _gap(numba: NumbaFacts | None, cc: CC, ptx_refusal: PtxRefusal | None) -> tuple[str, str] | None:
    """(numba-cuda's name, why it cannot compile or link its kernels on `cc`, with the remedy), or None where
    it can (or the NVRTC it asks is not known, or the config forces an architecture)."""
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
    if nvrtc is None:
        return None
    target = compile_target(version, nvrtc, cc)
    if target is not None:
        link = _link_gap(numba, target, cc, ptx_refusal)
        return (name, link) if link is not None else None
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


def linker(numba: NumbaFacts) -> Release | None:
    """The release of the nvJitLink that links numba-cuda's kernels, (0, 0) where the driver links them (no
    nvJitLink, or one older than `LTO_FROM`), None where that is not known."""
    if numba.nvjitlink is None:
        return None
    if numba.nvjitlink == "":
        return (0, 0)
    found = release(numba.nvjitlink)
    if found is None:
        return None
    return found if found >= LTO_FROM else (0, 0)


def _link_gap(numba: NumbaFacts, target: str, cc: CC, ptx_refusal: PtxRefusal | None) -> str | None:
    """Why libNVVM cannot compile numba-cuda's kernel for `target` (`compute_90a`), or it cannot be linked on
    `cc`, with the remedy; None where it can, or what would say is not known (module docstring)."""
    nvvm = release(numba.nvvm_release) if numba.nvvm_release else None
    arch = target.removeprefix("compute_").rstrip("a")
    wanted = (int(arch[:-1]), int(arch[-1]))
    if nvvm is not None and not compiles_for(nvvm, wanted):
        knowing = releases_knowing(nvvm, wanted)
        return (
            f"its libNVVM (CUDA {nvvm[0]}.{nvvm[1]}) does not know {target}, which its NVRTC lists, so the first"
            " launch stops" + (f"; a libNVVM of {knowing} knows it" if knowing else "")
        )
    linking = linker(numba)
    if linking is None:
        return None
    if linking != (0, 0):
        said = f"its nvJitLink (CUDA {linking[0]}.{linking[1]})"
        if nvvm is not None and nvvm > linking:
            return (
                f"{said} links the LTO-IR its libNVVM (CUDA {nvvm[0]}.{nvvm[1]}) writes, and refuses LTO-IR of a"
                ' newer libNVVM ("ERROR 4 in nvvmAddNVVMContainerToProgram, may need newer version of nvJitLink'
                f' library"), so every first launch stops; an nvJitLink of CUDA {nvvm[0]}.{nvvm[1]} or later'
                " links it"
            )
        if not compiles_for(linking, cc):
            knowing = releases_knowing(linking, cc)
            return (
                f"{said} links every kernel for the GPU's own architecture, sm_{cc[0]}{cc[1]}, which it does not"
                " know, so the first launch stops"
                + (f"; an nvJitLink of {knowing} knows it" if knowing else "")
            )
        return None
    if nvvm is None or ptx_refusal is None:
        return None
    why = ptx_refusal(written_isa(nvvm))
    if why is None:
        return None
    return (
        f"with no nvJitLink of CUDA {LTO_FROM[0]}.{LTO_FROM[1]} or later for it to load, the driver links the"
        f" PTX its libNVVM (CUDA {nvvm[0]}.{nvvm[1]}) writes: {why}; NVIDIA's nvJitLink wheel of"
        f" CUDA {nvvm[0]}.{nvvm[1]} or later (its [cu{nvvm[0]}] extra installs one) links them without the driver"
    )
