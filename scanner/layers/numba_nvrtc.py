"""Which NVRTC the image's numba-cuda asks for the architectures it compiles its kernels for. Pure.

numba-cuda compiles every `@cuda.jit` kernel at its first launch: NVVM writes PTX for the architecture
`get_arch_option` picks from the list the loaded NVRTC gives (`nvrtcGetSupportedArchs`, from 0.16;
`placement.numba_compiler` judges it). numba-cuda carries no NVRTC of its own; its `[cu12]` and `[cu13]`
extras install NVIDIA's wheel. Where it finds one, read in its source 0.16.0 to 0.30.4:

* 0.21 on call `cuda.bindings.nvrtc` (cuda-bindings 12.9.1 or later, which it requires), which loads the
  library through `cuda.pathfinder` (`scanner.layers.compiler_library_copies.pathfinder_copies`: NVIDIA's
  wheels of its own site directory first);
* 0.16 to 0.20 load it with ctypes through numba's own search (conda, NVIDIA's wheel, `CUDA_HOME`, the
  system) or, where `NUMBA_CUDA_USE_NVIDIA_BINDING` is set, through `cuda.bindings`: any copy the image
  carries may be the one, so a release is claimed only where every copy agrees;
* before 0.16 it kept a table keyed by the CUDA runtime's version: no NVRTC is read (the facts carry none).

NVVM compiles every kernel (numba's LLVM IR to PTX), and no NVIDIA runtime image or driver mount brings it:
NVIDIA's nvcc wheel (`nvidia/cuda_nvcc/nvvm/lib64/libnvvm.so`, CUDA 12, which the `[cu12]` extra installs),
its `nvidia-nvvm` wheel (`nvidia/cu13/lib/libnvvm.so.4`, CUDA 13) and a toolkit's `nvvm/lib64` (the `devel`
images) do. Where the image carries no file named like libNVVM, numba-cuda compiles nothing (`nvvm` "").
Its release (`nvvm_release`) is claimed only where every copy agrees: numba-cuda's own search for it changed
from release to release (its `cuda_paths`, then `cuda.pathfinder`).

The kernel is then linked (0.16 on, through `cuda.core`'s `Linker`): by nvJitLink where `cuda.bindings`
loads one of CUDA 12.3 or later (`_have_nvjitlink`), which links NVVM's LTO-IR (`lto` defaults to it), else
by the driver, which compiles NVVM's PTX. Which nvJitLink (`nvjitlink`): from 0.21 through
`cuda.pathfinder`, as for NVRTC; before, a release is claimed only where every copy agrees.

The config's `NUMBA_FORCE_CUDA_CC` replaces the GPU's architecture, and a `CUDA_HOME` or `CUDA_PATH` it
sets may name a mounted toolkit, whose libNVVM numba-cuda looks for there (`with_numba_config`).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping

from scanner.layers.code_loading import Distribution, release_of
from scanner.layers.compiler_library_copies import (
    NVJITLINK,
    NVVM,
    copies_release,
    library_files,
    nvrtc_files,
    pathfinder_copies,
)
from scanner.models import GpuArchs, GpuFacts, NumbaFacts

NVRTC_LIST_FROM = (0, 16)  # the architectures come from NVRTC's own list
BINDINGS_FROM = (0, 21)  # NVRTC through `cuda.bindings`, hence `cuda.pathfinder`
# Before 0.23, `NUMBA_CUDA_USE_NVIDIA_BINDING=0` gives it ctypes bindings, whose linker is the driver's.
CTYPES_UNTIL = (0, 23)
MAX_PATHS_SHOWN = 8


def numba_facts(
    distributions: Mapping[str, Distribution], library_paths: Iterable[str], nvvm: Iterable[str]
) -> NumbaFacts | None:
    """numba-cuda's facts where it is installed (the first found, by dist-info path): its version, the
    NVRTC copies it may load and their CUDA release, and a libNVVM the image carries (`nvvm`: the files
    named like one), "" where none (module docstring)."""
    for dist_info, distribution in sorted(distributions.items()):
        if distribution.name != "numba-cuda":
            continue
        version = release_of(distribution.version) or (0, 0)
        if version < NVRTC_LIST_FROM:
            return NumbaFacts(distribution=distribution.name, version=distribution.version)
        paths = list(library_paths)
        nvrtc, nvjitlink = nvrtc_files(paths), library_files(paths, NVJITLINK)
        if version >= BINDINGS_FROM:
            site = posixpath.dirname(dist_info)
            _, nvrtc_loaded = pathfinder_copies(site, nvrtc)
            _, nvjitlink_loaded = pathfinder_copies(site, nvjitlink, NVJITLINK)
        else:
            nvrtc_loaded, nvjitlink_loaded = nvrtc, nvjitlink
        nvvm_files = sorted(nvvm)
        return NumbaFacts(
            distribution=distribution.name,
            version=distribution.version,
            nvrtc=copies_release(nvrtc_loaded, nvrtc, distributions),
            nvrtc_paths=nvrtc_loaded[:MAX_PATHS_SHOWN],
            nvvm=nvvm_files[0] if nvvm_files else "",
            nvvm_release=copies_release(nvvm_files, nvvm_files, distributions, NVVM) or None,
            nvjitlink=copies_release(nvjitlink_loaded, nvjitlink, distributions, NVJITLINK),
            nvjitlink_paths=nvjitlink_loaded[:MAX_PATHS_SHOWN],
        )
    return None


def with_numba_config(archs: GpuArchs, gpu: GpuFacts) -> GpuArchs:
    """`archs` with the config's `NUMBA_FORCE_CUDA_CC`, and no libNVVM or nvJitLink taken as unknown where the
    config names a CUDA home (`CUDA_HOME`, `CUDA_PATH`), which may be mounted, where the image carries numba-cuda.
    Before 0.23, `NUMBA_CUDA_USE_NVIDIA_BINDING` set to anything but 1 may give it ctypes bindings, whose linker
    is the driver's: which links is not known then."""
    numba = archs.numba
    if numba is None:
        return archs
    version = release_of(numba.version or "") or (0, 0)
    forced = gpu.flashinfer_env.get("NUMBA_FORCE_CUDA_CC", "").strip()
    update: dict[str, str | None] = {"forced_cc": forced or None}
    if gpu.flashinfer_env.get("CUDA_HOME") or gpu.flashinfer_env.get("CUDA_PATH"):
        if numba.nvvm == "":
            update["nvvm"] = None
        if numba.nvjitlink == "":
            update["nvjitlink"] = None
    binding = gpu.flashinfer_env.get("NUMBA_CUDA_USE_NVIDIA_BINDING")
    if binding is not None and binding.lower() not in {"1", "true"} and version < CTYPES_UNTIL:
        update["nvjitlink"] = None
    changed = numba.model_copy(update=update)
    return archs if changed == numba else archs.model_copy(update={"numba": changed})
