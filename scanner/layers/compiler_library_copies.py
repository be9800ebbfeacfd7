"""The copies of a CUDA compiler library an image carries (NVRTC, nvJitLink, libNVVM): which one
`cuda.pathfinder` loads, and each copy's release. Pure.

CuPy (`scanner.layers.cupy_nvrtc`) compiles kernels with NVRTC at run time; numba-cuda
(`scanner.layers.numba_nvrtc`) asks NVRTC for its architectures, compiles with libNVVM and links with
nvJitLink where it finds one. Files are matched by name, as `scanner.layers.code_loading.MissingLinks`
matches what the loader finds: a copy the process has already loaded (torch loads its wheel's NVRTC) or
one on `LD_LIBRARY_PATH` counts as found.

* `pathfinder_copies`: the copies `cuda.pathfinder`'s `load_nvidia_dynamic_lib` may load (CuPy 14.x asks
  it for NVRTC directly; numba-cuda 0.21 on, through `cuda.bindings`, for NVRTC and nvJitLink): the
  library's NVIDIA wheel directories of the package's own site directory (`nvidia/cu13/lib`, then
  `nvidia/cuda_nvrtc/lib` or `nvidia/nvjitlink/lib`); another site directory's (a user's, a venv's
  base), which may be on the interpreter's path; then the system's sonames (`libnvrtc.so.13`, `.so.12`,
  `libnvrtc.so`), newest first.
* `copies_release`: a copy's release is read from the dist-info of the NVIDIA wheel that installed it,
  from a versioned file beside it (`libnvrtc.so.12.8.93`; not for libNVVM, whose `libnvvm.so.4.0.0`
  numbers its own interface), or from a toolkit's directory (`/usr/local/cuda-12.4/`). Where the copies
  disagree, or one's release is not known, the release is unknown (None); where there is no copy, "".

Each copy's release is read from one index of the versioned files by directory and one of the wheels by
site, so a crafted image naming tens of thousands of copies costs their number, not its square.
"""

from __future__ import annotations

import functools
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from scanner.layers.code_loading import Distribution, release_of

_TOOLKIT = re.compile(r"^/usr/local/cuda-(\d{1,6})\.(\d{1,6})/")
_VERSIONS = r"(?:\.(\d{1,6})(?:\.(\d{1,6})(?:\.(\d{1,8}))?)?)?"


@dataclass(frozen=True)
class CompilerLibrary:
    """A CUDA library packages load at run time to compile or link kernels, as its copies are named and
    installed."""

    name: str  # as messages name it ("NVRTC")
    file: re.Pattern[str]  # its files and links; groups (major, minor, patch) where `versioned`
    versioned: bool  # whether a file's numbers are the CUDA release (`libnvrtc.so.12.8.93`)
    wheel_dirs: Mapping[str, re.Pattern[str]]  # below `<site>/nvidia/`, in pathfinder's order -> its wheel
    system_order: tuple[str, ...]  # the sonames pathfinder takes from the system, newest first

    @functools.cached_property
    def wheel_dir(self) -> re.Pattern[str]:
        """`<site>/nvidia/<one of wheel_dirs>`: groups (site, wheel directory)."""
        kinds = "|".join(re.escape(kind) for kind in self.wheel_dirs)
        return re.compile(rf"^(.*/(?:site|dist)-packages)/nvidia/({kinds})$")


NVRTC = CompilerLibrary(
    name="NVRTC",
    file=re.compile(rf"^libnvrtc\.so{_VERSIONS}$"),
    versioned=True,
    wheel_dirs={  # CUDA 13's unsuffixed wheel, CUDA 11's and 12's by suffix
        "cu13/lib": re.compile(r"^nvidia-cuda-nvrtc$"),
        "cuda_nvrtc/lib": re.compile(r"^nvidia-cuda-nvrtc-cu1[12]$"),
    },
    system_order=("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"),
)
NVJITLINK = CompilerLibrary(
    name="nvJitLink",
    file=re.compile(rf"^libnvJitLink\.so{_VERSIONS}$"),
    versioned=True,
    wheel_dirs={
        "cu13/lib": re.compile(r"^nvidia-nvjitlink$"),
        "nvjitlink/lib": re.compile(r"^nvidia-nvjitlink-cu12$"),
    },
    system_order=("libnvJitLink.so.13", "libnvJitLink.so.12", "libnvJitLink.so"),
)
NVVM = CompilerLibrary(
    name="libNVVM",
    file=re.compile(r"^libnvvm\.so(?:\.\d{1,6}){0,3}$"),
    versioned=False,
    wheel_dirs={  # CUDA 13's nvvm wheel; CUDA 11's and 12's nvcc wheel
        "cu13/lib": re.compile(r"^nvidia-nvvm$"),
        "cuda_nvcc/nvvm/lib64": re.compile(r"^nvidia-cuda-nvcc-cu1[12]$"),
    },
    system_order=("libnvvm.so.4", "libnvvm.so"),
)
NVRTC_FILE = NVRTC.file
PATHFINDER_SYSTEM_ORDER = NVRTC.system_order


def library_files(library_paths: Iterable[str], library: CompilerLibrary = NVRTC) -> list[str]:
    """The image's files named like `library` (`libnvrtc.so`, `libnvrtc.so.12`, `libnvrtc.so.12.8.93`), sorted."""
    return sorted(p for p in library_paths if library.file.match(posixpath.basename(p)))


def nvrtc_files(library_paths: Iterable[str]) -> list[str]:
    """The image's files named like NVRTC, sorted."""
    return library_files(library_paths, NVRTC)


def _in_wheel(path: str, library: CompilerLibrary) -> re.Match[str] | None:
    return library.wheel_dir.match(posixpath.dirname(path))


def pathfinder_copies(
    site: str, files: Sequence[str], library: CompilerLibrary = NVRTC
) -> tuple[str | None, list[str]]:
    """(the system soname `cuda.pathfinder` settles on, None where it takes NVIDIA's wheels; the copies it may
    load) for a package in site directory `site`, of the image's files of `library` (module docstring)."""
    wheels = [
        p
        for p in files
        if _in_wheel(p, library) is not None and posixpath.basename(p) in library.system_order
    ]
    for kind in library.wheel_dirs:  # its own site directory's NVIDIA wheels first
        found = [
            p
            for p in wheels
            if (wheel := _in_wheel(p, library)) is not None and wheel.groups() == (site, kind)
        ]
        if found:
            return None, found
    if wheels:  # another site directory's (a user's, a venv's base): on its path, perhaps
        return None, wheels
    for name in library.system_order:
        found = [p for p in files if posixpath.basename(p) == name and _in_wheel(p, library) is None]
        if found:
            return name, found
    return None, []


def copies_release(
    paths: Sequence[str],
    files: Sequence[str],
    distributions: Mapping[str, Distribution],
    library: CompilerLibrary = NVRTC,
) -> str | None:
    """The CUDA release ("12.8") the copies of `library` at `paths` share; "" where there is none, None where
    they disagree or one's release is not known. `files` is every file of `library` the image carries."""
    if not paths:
        return ""
    beside = _versions_by_directory(files, library) if library.versioned else {}
    wheels = _wheel_releases(distributions, library)
    releases = {_release(path, beside, wheels, library) for path in paths}
    return releases.pop() if len(releases) == 1 else None


def _full_version(path: str, library: CompilerLibrary) -> tuple[str, str] | None:
    """(major, minor) of a file named with the library's full version (`libnvrtc.so.12.8.93`), else None."""
    match = library.file.match(posixpath.basename(path))
    return (match.group(1), match.group(2)) if match is not None and match.group(3) is not None else None


def _versions_by_directory(files: Sequence[str], library: CompilerLibrary) -> dict[str, set[tuple[str, str]]]:
    """Directory -> the (major, minor) its files named with the full version say, one pass over them."""
    found: dict[str, set[tuple[str, str]]] = {}
    for path in files:
        full = _full_version(path, library)
        if full is not None:
            found.setdefault(posixpath.dirname(path), set()).add(full)
    return found


def _wheel_releases(
    distributions: Mapping[str, Distribution], library: CompilerLibrary
) -> dict[tuple[str, str], str | None]:
    """(site directory, wheel directory) -> the CUDA release of the NVIDIA wheel that installs `library` there."""
    found: dict[tuple[str, str], str | None] = {}
    for dist_info, distribution in sorted(distributions.items()):
        for kind, name in library.wheel_dirs.items():
            if name.match(distribution.name):
                parts = release_of(distribution.version)
                found.setdefault(
                    (posixpath.dirname(dist_info), kind), f"{parts[0]}.{parts[1]}" if parts else None
                )
    return found


def _release(
    path: str,
    beside: Mapping[str, set[tuple[str, str]]],
    wheels: Mapping[tuple[str, str], str | None],
    library: CompilerLibrary,
) -> str | None:
    """The CUDA release of the copy at `path` ("12.8"), or None where nothing beside it says."""
    wheel = _in_wheel(path, library)
    if wheel is not None:
        site, kind = wheel.groups()
        return wheels.get((site, kind))
    versions: set[tuple[str, str]] = set()
    if library.versioned:
        match = library.file.match(posixpath.basename(path))
        major = match.group(1) if match is not None else None  # libnvrtc.so.12 -> "12"; libnvrtc.so -> None
        versions = {
            full for full in beside.get(posixpath.dirname(path), set()) if major is None or full[0] == major
        }
        if len(versions) == 1:
            found_major, found_minor = versions.pop()
            return f"{found_major}.{found_minor}"
    toolkit = _TOOLKIT.match(path)
    return f"{toolkit.group(1)}.{toolkit.group(2)}" if toolkit is not None and not versions else None
