"""The copies of NVRTC an image carries: which one `cuda.pathfinder` loads, and each copy's release. Pure.

CuPy (`scanner.layers.cupy_nvrtc`) and numba-cuda (`scanner.layers.numba_nvrtc`) compile kernels with
NVRTC at run time. Files are matched by name, as `scanner.layers.code_loading.MissingLinks` matches what
the loader finds: a copy the process has already loaded (torch loads its wheel's NVRTC) or one on
`LD_LIBRARY_PATH` counts as found.

* `pathfinder_copies`: the copies `cuda.pathfinder`'s `load_nvidia_dynamic_lib("nvrtc")` may load (CuPy
  14.x asks it directly; numba-cuda 0.21 on through `cuda.bindings`): the `nvidia/cu13/lib` then
  `nvidia/cuda_nvrtc/lib` of the package's own site directory (NVIDIA's wheels); another site directory's
  (a user's, a venv's base), which may be on the interpreter's path; then the system's `libnvrtc.so.13`,
  `.so.12`, `libnvrtc.so`, newest first.
* `copies_release`: a copy's release is read from a versioned file beside it (`libnvrtc.so.12.8.93`), from
  the dist-info of the NVIDIA wheel that installed it, or from a toolkit's directory
  (`/usr/local/cuda-12.4/`). Where the copies disagree, or one's release is not known, the release is
  unknown (None); where there is no copy, "".

Each copy's release is read from one index of the versioned files by directory and one of the NVRTC wheels
by site, so a crafted image naming tens of thousands of copies costs their number, not its square.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence

from scanner.layers.code_loading import Distribution, release_of

NVRTC_FILE = re.compile(r"^libnvrtc\.so(?:\.(\d{1,6})(?:\.(\d{1,6})(?:\.(\d{1,8}))?)?)?$")
_TOOLKIT = re.compile(r"^/usr/local/cuda-(\d{1,6})\.(\d{1,6})/")
_WHEEL_DIR = re.compile(r"^(.*/(?:site|dist)-packages)/nvidia/(cu13|cuda_nvrtc)/lib$")
# The NVIDIA wheel that installs NVRTC there: CUDA 13's unsuffixed one, CUDA 11's and 12's by suffix.
_WHEEL_DIST = {
    "cu13": re.compile(r"^nvidia-cuda-nvrtc$"),
    "cuda_nvrtc": re.compile(r"^nvidia-cuda-nvrtc-cu1[12]$"),
}
PATHFINDER_SYSTEM_ORDER = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")


def nvrtc_files(library_paths: Iterable[str]) -> list[str]:
    """The image's files named like NVRTC (`libnvrtc.so`, `libnvrtc.so.12`, `libnvrtc.so.12.8.93`), sorted."""
    return sorted(p for p in library_paths if NVRTC_FILE.match(posixpath.basename(p)))


def _in_wheel(path: str) -> re.Match[str] | None:
    return _WHEEL_DIR.match(posixpath.dirname(path))


def pathfinder_copies(site: str, nvrtc: Sequence[str]) -> tuple[str | None, list[str]]:
    """(the system soname `cuda.pathfinder` settles on, None where it takes NVIDIA's wheels; the copies it may
    load) for a package in site directory `site`, of the image's NVRTC files `nvrtc` (module docstring)."""
    wheels = [
        p for p in nvrtc if _in_wheel(p) is not None and posixpath.basename(p) in PATHFINDER_SYSTEM_ORDER
    ]
    for kind in ("cu13", "cuda_nvrtc"):  # its own site directory's NVIDIA wheels first
        found = [p for p in wheels if (wheel := _in_wheel(p)) is not None and wheel.groups() == (site, kind)]
        if found:
            return None, found
    if wheels:  # another site directory's (a user's, a venv's base): on its path, perhaps
        return None, wheels
    for name in PATHFINDER_SYSTEM_ORDER:
        found = [p for p in nvrtc if posixpath.basename(p) == name and _in_wheel(p) is None]
        if found:
            return name, found
    return None, []


def copies_release(
    paths: Sequence[str], nvrtc: Sequence[str], distributions: Mapping[str, Distribution]
) -> str | None:
    """The CUDA release ("12.8") the copies at `paths` share; "" where there is none, None where they
    disagree or one's release is not known. `nvrtc` is every NVRTC file of the image (`nvrtc_files`)."""
    if not paths:
        return ""
    beside = _versions_by_directory(nvrtc)
    wheels = _wheel_releases(distributions)
    releases = {_release(path, beside, wheels) for path in paths}
    return releases.pop() if len(releases) == 1 else None


def _full_version(path: str) -> tuple[str, str] | None:
    """(major, minor) of a file named with NVRTC's full version (`libnvrtc.so.12.8.93`), else None."""
    match = NVRTC_FILE.match(posixpath.basename(path))
    return (match.group(1), match.group(2)) if match is not None and match.group(3) is not None else None


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
    match = NVRTC_FILE.match(posixpath.basename(path))
    major = match.group(1) if match is not None else None  # libnvrtc.so.12 -> "12"; libnvrtc.so -> None
    versions = {
        full for full in beside.get(posixpath.dirname(path), set()) if major is None or full[0] == major
    }
    if len(versions) == 1:
        found_major, found_minor = versions.pop()
        return f"{found_major}.{found_minor}"
    toolkit = _TOOLKIT.match(path)
    return f"{toolkit.group(1)}.{toolkit.group(2)}" if toolkit is not None and not versions else None
