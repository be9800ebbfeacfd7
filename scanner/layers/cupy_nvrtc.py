"""Which NVRTC the image's CuPy compiles its kernels with, as CuPy's own code finds it. Pure.

CuPy compiles nearly every kernel it runs (each elementwise operation and ufunc, `arange`, `astype`,
most reductions along an axis, RawKernel, `cupyx.jit`) at first use with NVRTC, for the GPU at hand
(`cupy/cuda/compiler.py`); only copies, memsets, the CUDA libraries' calls and its Thrust and CUB
routines run precompiled code. So the NVRTC it loads decides where CuPy does anything
(`placement.cupy_compiler` judges it). No CuPy wheel carries an NVRTC. Where CuPy finds one, read in
its wheels 10.0 to 14.2:

* up to 12.x, its extension modules link it (DT_NEEDED): `libnvrtc.so.11.0` (cupy-cuda110),
  `libnvrtc.so.11.2` (cupy-cuda111 to 117, cupy-cuda11x), `libnvrtc.so.12` (cupy-cuda12x);
* 13.x loads the soname of the CUDA major it was built with by `dlopen` at the first compile
  (`cupy_backends/cuda/_softlink.pyx`): `libnvrtc.so.11.2`, `.12` or `.13`;
* 14.x asks `cuda.pathfinder`: the `nvidia/cu13/lib` then `nvidia/cuda_nvrtc/lib` of the site
  directories first (its own; another's counts too, as it may be on the path) (NVIDIA's wheels, which its `[ctk]` extra installs), then the system's
  `libnvrtc.so.13`, `.so.12`, `libnvrtc.so`, newest first, whatever major CuPy was built for.

How copies are matched and their releases read is `scanner.layers.compiler_library_copies`'s. Where the
candidates CuPy may load disagree, or one's release is not known, the release is unknown and nothing is
claimed; where the image carries none, CuPy compiles nothing ("").
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence

from scanner.layers.code_loading import Distribution, release_of
from scanner.layers.compiler_library_copies import (
    PATHFINDER_SYSTEM_ORDER,
    copies_release,
    nvrtc_files,
    pathfinder_copies,
)
from scanner.models import CupyFacts

# CuPy's CUDA distributions: `cupy-cuda12x` (and `cupy-cuda112`, `cupy-cuda110`, ...), and `cupy` built from source.
_CUPY = re.compile(r"^cupy(?:-cuda(\d{2,3})(x?))?$")
SOFTLINK_FROM = (13, 0)  # loaded by dlopen at the first compile, not linked
PATHFINDER_FROM = (14, 0)  # found by cuda.pathfinder
MAX_PATHS_SHOWN = 8


def cupy_facts(distributions: Mapping[str, Distribution], library_paths: Iterable[str]) -> CupyFacts | None:
    """CuPy's facts where a CUDA build of it is installed (the first found, by dist-info path): its
    distribution, the NVRTC soname it loads and that copy's CUDA release (module docstring)."""
    for dist_info, distribution in sorted(distributions.items()):
        match = _CUPY.match(distribution.name)
        if match is None:
            continue
        built_for = _built_for(match.group(1), match.group(2))
        version = release_of(distribution.version) or (0, 0)
        nvrtc = nvrtc_files(library_paths)
        soname, paths = _candidates(version, built_for, posixpath.dirname(dist_info), nvrtc)
        return CupyFacts(
            distribution=distribution.name,
            version=distribution.version,
            cuda_major=built_for[0] if built_for else None,
            soname=soname,
            nvrtc=copies_release(paths, nvrtc, distributions),
            nvrtc_paths=paths[:MAX_PATHS_SHOWN],
        )
    return None


def _built_for(digits: str | None, any_minor: str | None) -> tuple[int, int | None] | None:
    """The CUDA CuPy was built with, from its distribution's name: `cuda12x` -> (12, None), `cuda110` ->
    (11, 0), `cuda102` -> (10, 2); None for a source build."""
    if digits is None:
        return None
    if any_minor:
        return int(digits), None
    return int(digits[:-1]), int(digits[-1])


def _soname(built_for: tuple[int, int | None] | None) -> str | None:
    """The NVRTC soname CuPy up to 13.x loads, by the CUDA it was built with (None where unknown)."""
    if built_for is None:
        return None
    major, minor = built_for
    if major >= 12:
        return f"libnvrtc.so.{major}"
    if major == 11:
        return "libnvrtc.so.11.2" if minor is None or minor >= 2 else f"libnvrtc.so.11.{minor}"
    return f"libnvrtc.so.{major}.{minor or 0}"


def _candidates(
    version: tuple[int, int], built_for: tuple[int, int | None] | None, site: str, nvrtc: Sequence[str]
) -> tuple[str | None, list[str]]:
    """(the soname CuPy asks for, None where it takes any of several; the carried files it may load)."""
    if version >= PATHFINDER_FROM:
        return pathfinder_copies(site, nvrtc)
    soname = _soname(built_for)
    if soname is None:  # a source build: the soname of whichever CUDA it was built with
        return None, [p for p in nvrtc if posixpath.basename(p) in PATHFINDER_SYSTEM_ORDER]
    return soname, [p for p in nvrtc if posixpath.basename(p) == soname]
