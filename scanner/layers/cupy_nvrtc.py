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

Files are matched by name, as `scanner.layers.code_loading.MissingLinks` matches what the loader finds:
a copy the process has already loaded (torch loads its wheel's NVRTC) or one on `LD_LIBRARY_PATH` counts
as found. A copy's release is read from a versioned file beside it (`libnvrtc.so.12.8.93`), from the
dist-info of the NVIDIA wheel that installed it, or from a toolkit's directory (`/usr/local/cuda-12.4/`).
Where the candidates CuPy may load disagree, or one's release is not known, the release is unknown and
nothing is claimed; where the image carries none, CuPy compiles nothing ("").
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence

from scanner.layers.code_loading import Distribution, release_of
from scanner.models import CupyFacts

# CuPy's CUDA distributions: `cupy-cuda12x` (and `cupy-cuda112`, `cupy-cuda110`, ...), and `cupy` built from source.
_CUPY = re.compile(r"^cupy(?:-cuda(\d{2,3})(x?))?$")
_NVRTC = re.compile(r"^libnvrtc\.so(?:\.(\d{1,6})(?:\.(\d{1,6})(?:\.(\d{1,8}))?)?)?$")
_TOOLKIT = re.compile(r"^/usr/local/cuda-(\d{1,6})\.(\d{1,6})/")
_WHEEL_DIR = re.compile(r"^(.*/(?:site|dist)-packages)/nvidia/(cu13|cuda_nvrtc)/lib$")
# The NVIDIA wheel that installs NVRTC there: CUDA 13's unsuffixed one, CUDA 11's and 12's by suffix.
_WHEEL_DIST = {
    "cu13": re.compile(r"^nvidia-cuda-nvrtc$"),
    "cuda_nvrtc": re.compile(r"^nvidia-cuda-nvrtc-cu1[12]$"),
}
SOFTLINK_FROM = (13, 0)  # loaded by dlopen at the first compile, not linked
PATHFINDER_FROM = (14, 0)  # found by cuda.pathfinder
PATHFINDER_SYSTEM_ORDER = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")
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
        nvrtc = sorted(p for p in library_paths if _NVRTC.match(posixpath.basename(p)))
        soname, paths = _candidates(version, built_for, posixpath.dirname(dist_info), nvrtc)
        beside = _versions_by_directory(nvrtc)
        wheels = _wheel_releases(distributions)
        releases = {_release(path, beside, wheels) for path in paths}
        return CupyFacts(
            distribution=distribution.name,
            version=distribution.version,
            cuda_major=built_for[0] if built_for else None,
            soname=soname,
            nvrtc="" if not paths else releases.pop() if len(releases) == 1 else None,
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


def _full_version(path: str) -> tuple[str, str] | None:
    """(major, minor) of a file named with NVRTC's full version (`libnvrtc.so.12.8.93`), else None."""
    match = _NVRTC.match(posixpath.basename(path))
    return (match.group(1), match.group(2)) if match is not None and match.group(3) is not None else None


def _in_wheel(path: str) -> re.Match[str] | None:
    return _WHEEL_DIR.match(posixpath.dirname(path))


def _candidates(
    version: tuple[int, int], built_for: tuple[int, int | None] | None, site: str, nvrtc: Sequence[str]
) -> tuple[str | None, list[str]]:
    """(the soname CuPy asks for, None where it takes any of several; the carried files it may load)."""
    if version >= PATHFINDER_FROM:
        wheels = [
            p for p in nvrtc if _in_wheel(p) is not None and posixpath.basename(p) in PATHFINDER_SYSTEM_ORDER
        ]
        for kind in ("cu13", "cuda_nvrtc"):  # its own site directory's NVIDIA wheels first
            found = [
                p for p in wheels if (wheel := _in_wheel(p)) is not None and wheel.groups() == (site, kind)
            ]
            if found:
                return None, found
        if wheels:  # another site directory's (a user's, a venv's base): on its path, perhaps
            return None, wheels
        for name in PATHFINDER_SYSTEM_ORDER:
            found = [p for p in nvrtc if posixpath.basename(p) == name and _in_wheel(p) is None]
            if found:
                return name, found
        return None, []
    soname = _soname(built_for)
    if soname is None:  # a source build: the soname of whichever CUDA it was built with
        return None, [p for p in nvrtc if posixpath.basename(p) in PATHFINDER_SYSTEM_ORDER]
    return soname, [p for p in nvrtc if posixpath.basename(p) == soname]


def _versions_by_directory(nvrtc: Sequence[str]) -> dict[str, set[tuple[str, str]]]:
    """Directory -> the (major, minor) its files named with NVRTC's full version say, one pass over them."""
    found: dict[str, set[tuple[str, str]]] = {}
    for path in nvrtc:
        full = _full_version(path)
        if full is not None:
            found.setdefault(posixpath.dirname(path), set()).add(full)
    return found


def _wheel_releases(distributions: Mapping[str, Distribution]) -> dict[tuple[str, str], str | None]:
    """(site directory, wheel kind) -> the CUDA release of the NVIDIA NVRTC wheel installed there."""
    found: dict[tuple[str, str], str | None] = {}
    for dist_info, distribution in sorted(distributions.items()):
        for kind, name in _WHEEL_DIST.items():
            if name.match(distribution.name):
                parts = release_of(distribution.version)
                found.setdefault(
                    (posixpath.dirname(dist_info), kind), f"{parts[0]}.{parts[1]}" if parts else None
                )
    return found


def _release(
    path: str, beside: Mapping[str, set[tuple[str, str]]], wheels: Mapping[tuple[str, str], str | None]
) -> str | None:
    """The CUDA release of the NVRTC at `path` ("12.8"), or None where nothing beside it says."""
    wheel = _in_wheel(path)
    if wheel is not None:
        site, kind = wheel.groups()
        return wheels.get((site, kind))
    match = _NVRTC.match(posixpath.basename(path))
    major = match.group(1) if match is not None else None  # libnvrtc.so.12 -> "12"; libnvrtc.so -> None
    versions = {
        full for full in beside.get(posixpath.dirname(path), set()) if major is None or full[0] == major
    }
    if len(versions) == 1:
        found_major, found_minor = versions.pop()
        return f"{found_major}.{found_minor}"
    toolkit = _TOOLKIT.match(path)
    return f"{toolkit.group(1)}.{toolkit.group(2)}" if toolkit is not None and not versions else None
