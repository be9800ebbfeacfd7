"""Which NVRTC the image's numba-cuda asks for the architectures it compiles its kernels for. Pure.

numba-cuda compiles every `@cuda.jit` kernel at its first launch: NVVM writes PTX for the architecture
`get_arch_option` picks from the list the loaded NVRTC gives (`nvrtcGetSupportedArchs`, from 0.16;
`placement.numba_compiler` judges it). numba-cuda carries no NVRTC of its own; its `[cu12]` and `[cu13]`
extras install NVIDIA's wheel. Where it finds one, read in its source 0.16.0 to 0.30.4:

* 0.21 on call `cuda.bindings.nvrtc` (cuda-bindings 12.9.1 or later, which it requires), which loads the
  library through `cuda.pathfinder` (`scanner.layers.nvrtc_copies.pathfinder_copies`: NVIDIA's wheels of
  its own site directory first);
* 0.16 to 0.20 load it with ctypes through numba's own search (conda, NVIDIA's wheel, `CUDA_HOME`, the
  system) or, where `NUMBA_CUDA_USE_NVIDIA_BINDING` is set, through `cuda.bindings`: any copy the image
  carries may be the one, so a release is claimed only where every copy agrees;
* before 0.16 it kept a table keyed by the CUDA runtime's version: no NVRTC is read (the facts carry none).

The config's `NUMBA_FORCE_CUDA_CC` replaces the GPU's architecture (`with_numba_config`).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping

from scanner.layers.code_loading import Distribution, release_of
from scanner.layers.nvrtc_copies import copies_release, nvrtc_files, pathfinder_copies
from scanner.models import GpuArchs, GpuFacts, NumbaFacts

NVRTC_LIST_FROM = (0, 16)  # the architectures come from NVRTC's own list
BINDINGS_FROM = (0, 21)  # NVRTC through `cuda.bindings`, hence `cuda.pathfinder`
MAX_PATHS_SHOWN = 8


def numba_facts(distributions: Mapping[str, Distribution], library_paths: Iterable[str]) -> NumbaFacts | None:
    """numba-cuda's facts where it is installed (the first found, by dist-info path): its version, the
    NVRTC copies it may load and their CUDA release (module docstring)."""
    for dist_info, distribution in sorted(distributions.items()):
        if distribution.name != "numba-cuda":
            continue
        version = release_of(distribution.version) or (0, 0)
        if version < NVRTC_LIST_FROM:
            return NumbaFacts(distribution=distribution.name, version=distribution.version)
        nvrtc = nvrtc_files(library_paths)
        if version >= BINDINGS_FROM:
            _, paths = pathfinder_copies(posixpath.dirname(dist_info), nvrtc)
        else:
            paths = nvrtc
        return NumbaFacts(
            distribution=distribution.name,
            version=distribution.version,
            nvrtc=copies_release(paths, nvrtc, distributions),
            nvrtc_paths=paths[:MAX_PATHS_SHOWN],
        )
    return None


def with_numba_config(archs: GpuArchs, gpu: GpuFacts) -> GpuArchs:
    """`archs` with the config's `NUMBA_FORCE_CUDA_CC`, where it sets one and the image carries numba-cuda."""
    forced = gpu.flashinfer_env.get("NUMBA_FORCE_CUDA_CC", "").strip()
    if archs.numba is None or not forced:
        return archs
    return archs.model_copy(update={"numba": archs.numba.model_copy(update={"forced_cc": forced})})
