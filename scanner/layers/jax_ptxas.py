"""Which `ptxas` the image's JAX assembles its computations with, as JAX and XLA find it. Pure.

JAX compiles every jitted computation at run time, and XLA assembles the PTX with a `ptxas` process (its
wheels link no PTX compiler). JAX names XLA's CUDA directory on every compilation (`jax/_src/lib`'s
`_cuda_path`): `$CUDA_ROOT` (from 0.4.35), else the directory of the `nvidia.cu13` (from 0.7.2) or
`nvidia.cuda_nvcc` package its `with-cuda` extra installs. XLA then takes the first `ptxas` of CUDA 11.8 or later
(`FindPtxAsExecutable`): that directory's `bin/ptxas`, else one on the PATH, else `/usr/local/cuda`'s or
`/opt/cuda`'s.

A path is known where the image carries a `ptxas` there, directly or through its toolkit links
(`GpuArchs.ptxas`, `GpuArchs.ptxas_links`); `$CUDA_ROOT` naming a directory the image does not carry may be
a mount, so nothing is claimed. "" means the image has none: XLA compiles nothing.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Mapping

from scanner.layers.code_loading import Distribution, release_of, release_parts
from scanner.models import GpuArchs, GpuFacts, JaxFacts

# XLA's CUDA code ships in the PJRT plugin (0.4.30 on), the plugin's kernels beside it, or a CUDA jaxlib before.
_JAX_CUDA = re.compile(r"^jax-cuda(\d{2})-(pjrt|plugin)$")
_JAXLIB_CUDA = re.compile(r"\+cuda(\d{2})")
CUDA_ROOT_FROM = (0, 4, 35)  # `_cuda_path` reads `$CUDA_ROOT` first
CU13_FROM = (0, 7, 2)  # and looks for CUDA 13's `nvidia.cu13` before `nvidia.cuda_nvcc`
OLDEST_PTXAS = (11, 8)  # XLA passes over an older one
SYSTEM_ROOTS = ("/usr/local/cuda", "/opt/cuda")
_WHEEL_PTXAS = re.compile(r"^(.*/(?:site|dist)-packages)/nvidia/(cu13|cuda_nvcc)/bin/ptxas$")
DRIVER_FALLBACK = "--xla_gpu_unsafe_fallback_to_driver_on_ptxas_not_found"


def jax_facts(distributions: Mapping[str, Distribution]) -> JaxFacts | None:
    """JAX's facts where a CUDA build is installed: the distribution that carries XLA (the PJRT plugin
    first), its version and CUDA major, and its site directory. The `ptxas` it runs depends on the config
    (`with_jax_ptxas`)."""
    found: list[tuple[int, str, Distribution, int]] = []
    for dist_info, distribution in distributions.items():
        match = _JAX_CUDA.match(distribution.name)
        if match is not None:
            found.append((0 if match.group(2) == "pjrt" else 1, dist_info, distribution, int(match.group(1))))
        elif distribution.name == "jaxlib" and (cuda := _JAXLIB_CUDA.search(distribution.version)):
            found.append((2, dist_info, distribution, int(cuda.group(1))))
    if not found:
        return None
    _, dist_info, distribution, major = min(found, key=lambda item: (item[0], item[1]))
    return JaxFacts(
        distribution=distribution.name,
        version=distribution.version,
        cuda_major=major,
        site=posixpath.dirname(dist_info),
    )


def with_jax_ptxas(archs: GpuArchs, gpu: GpuFacts) -> GpuArchs:
    """`archs` with the `ptxas` the image's JAX runs (module docstring) and whether `XLA_FLAGS` lets the
    driver compile where there is none."""
    jax = archs.jax
    if jax is None:
        return archs
    path, found = _ptxas(archs, jax, gpu)
    update = {
        "ptxas": path,
        "ptxas_release": found,
        "driver_fallback": _driver_fallback(gpu.flashinfer_env.get("XLA_FLAGS", "")),
    }
    return archs.model_copy(update={"jax": jax.model_copy(update=update)})


def _carried(archs: GpuArchs, path: str) -> str | None:
    """The release the image's `ptxas` at `path` (or reached through its links) names ("" where its banner
    names none), or None where the image carries none there."""
    return archs.ptxas.get(archs.ptxas_links.get(path, path))


def _ptxas(archs: GpuArchs, jax: JaxFacts, gpu: GpuFacts) -> tuple[str | None, str | None]:
    """The `ptxas` XLA runs for this JAX and its release: its path, "" where the image has none, None where
    unknown."""
    version = release_parts(jax.version) or (0, 0, 0)
    candidates: list[str] = []
    cuda_root = gpu.flashinfer_env.get("CUDA_ROOT") if version >= CUDA_ROOT_FROM else None
    if cuda_root:
        named = posixpath.join(posixpath.normpath(cuda_root), "bin", "ptxas")
        if _carried(archs, named) is None:
            return None, None  # a directory the image does not carry: a mount, perhaps
        candidates.append(named)
    elif jax.site:
        kinds = ("cu13", "cuda_nvcc") if version >= CU13_FROM else ("cuda_nvcc",)
        candidates += [posixpath.join(jax.site, "nvidia", kind, "bin", "ptxas") for kind in kinds]
        # the same wheels in another site directory (a user's, a venv's base), which may be on its path
        candidates += sorted(p for p in archs.ptxas if (m := _WHEEL_PTXAS.match(p)) and m.group(2) in kinds)
    candidates += [posixpath.join(directory, "ptxas") for directory in gpu.executable_path]
    candidates += [posixpath.join(root, "bin", "ptxas") for root in SYSTEM_ROOTS]
    for path in candidates:
        found = _carried(archs, path)
        if found is None:
            continue
        parsed = release_of(found)
        if parsed is None:
            return None, None  # carried, but its release is not known
        if parsed >= OLDEST_PTXAS:
            return path, found
    return (
        "" if archs.c_compilers is not None else None
    ), None  # every name known (a layer read whole), or not


def _driver_fallback(flags: str) -> bool:
    """Whether `XLA_FLAGS` turns on XLA's fallback to the driver where it finds no `ptxas`."""
    try:
        words = shlex.split(flags)
    except ValueError:
        words = flags.split()
    on = False
    for word in words:
        name, equals, value = word.partition("=")
        if name == DRIVER_FALLBACK:
            on = not equals or value.lower() in ("true", "1")
    return on
