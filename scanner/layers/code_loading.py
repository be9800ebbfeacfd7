"""Which of an image's GPU code can load, and which package ships it. Pure facts about the image.

`scanner.layers.cuda_evidence.combine` calls these once the layers are merged; placement
(`placement.gpu_code`) judges the result. Four facts:

* **The CUDA libraries the image carries.** Every file or symlink named like a CUDA library
  (`libcudart.so.13`, `libcublasLt.so.12`, ...). The NVIDIA container runtime mounts the driver
  (`libcuda.so.1`), never the toolkit's libraries, so a library that links (DT_NEEDED) a CUDA
  library the image does not carry cannot be loaded by the dynamic loader: its code never runs and
  it sets no CUDA floor (`libbitsandbytes_cuda130.so` links `libcudart.so.13`; beside CUDA 12.8's
  runtime alone it is dead weight). Names are matched exactly, as the loader resolves SONAMEs.
* **Builds of one library for several CUDA versions.** Files of one directory whose names differ
  only in a CUDA version (`libbitsandbytes_cuda118.so` ... `_cuda132.so`, `foo_cu121.so`) are
  alternatives: the package loads one, picked by the CUDA runtime the image uses (`runtime_cuda`:
  `torch.version.cuda` where torch is there, else the CUDA runtime library or toolkit the image
  carries). The rule is bitsandbytes' (`cextension.py`, `get_cuda_bnb_library_path`), as each
  version wrote it. From 0.50.0: the build of that version if there is one, else the newest build
  of the same major below it, else the oldest of the same major above it; never another major.
  Before 0.50.0 (`EXACT_BUILD_PACKAGES`): the build of that version or none (0.43 to 0.45 then load
  their CPU library, 0.46 to 0.49 fail to load any; either way the package runs without its GPU
  code). Other packages follow the newer rule. Without a known runtime, the newest build the image
  can load. Only loadable builds are candidates. A variable of the image's config that names a
  build (`BNB_CUDA_VERSION=124`, `scanner.facts.gpu.build_overrides`) picks it instead, loadable
  or not: the package looks for no other.
* **Packages.** A file belongs to the Python distribution that installed it (`*.dist-info/RECORD`
  names each distribution's top-level modules), to NVIDIA (its libraries, by name and by where
  NVIDIA's wheels and toolkits put them), or to the application directory it lies in.
* **Optional GPU code.** A package whose every GPU-code library is an extension module its Python
  imports only under a guard or on demand (`scanner.layers.python_loads`), or that ships only
  standalone module files it loads itself, runs without that code.
"""

from __future__ import annotations

import posixpath
import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from pydantic import BaseModel, Field

from scanner.layers.cudaelf import AUDITWHEEL_HASH, CUDA_LIBRARIES
from scanner.models import FileArchs, PackageFacts

# The CUDA stack's libraries by name: what the image may carry for others to link.
CUDA_LIBRARY_FILE = re.compile(
    r"^lib(?:" + "|".join(CUDA_LIBRARIES) + r")" + AUDITWHEEL_HASH + r"\.so(?:\.[0-9]{1,8}){0,4}$"
)
DRIVER_LIBRARIES = re.compile(r"^lib(?:cuda|nvidia-[\w-]+|nvcuvid)\.so")  # mounted by the runtime
# NVIDIA's libraries, by the name their shared objects carry (lib<name>.so...).
_NVIDIA_LIBRARY = re.compile(
    r"^lib(cublas|cublasLt|cudnn\w*|nccl|cusparse|cusparseLt|cufft|cufftw|curand|cusolver|cusolverMg|"
    r"nvjpeg|npp\w*|nvrtc\w*|cupti|nvJitLink|cudart|nvblas|cufile\w*|nvinfer\w*|nvonnxparser|nvshmem\w*|"
    r"cudss|cutensor\w*|nvperf\w*|nvToolsExt|nvjitlink|nvcomp\w*|cuda|checkpoint|pcsamplingutil)"
    + AUDITWHEEL_HASH
    + r"\.so"
)  # auditwheel renames the copies it bundles: libnvjpeg.02b6d700.so.12, libcudart-e409450e.so.11.0
# Where NVIDIA's wheels and toolkits put them: {site,dist}-packages/nvidia/<component>[/<cuda>]/lib,
# cusparselt/lib, /usr/local/cuda[-X.Y]/. NVIDIA's packages with a Python front end of their own
# (DALI's `nvidia/dali/libdali.so`, nvImageCodec's `nvidia/nvimgcodec/`) are packages like any other.
_NVIDIA_TREE = re.compile(
    r"(?:/(?:site|dist)-packages/(?:nvidia/(?:[^/]+/){1,3}|cusparselt/)lib(?:64)?/|^/usr/local/cuda[-/])"
)
# Top-level directories that several distributions share (PEP 420 namespace packages): a file under one
# belongs to the distribution that installed its next directory (`nvidia/dali`: nvidia-dali-cuda130).
NAMESPACE_PACKAGES = frozenset({"nvidia"})
_SITE = re.compile(r"^(.*?/(?:site|dist)-packages)/([^/]+)(?:/|$)")
_BUILD = re.compile(r"(?<=[_.-])cu(?:da)?(\d{2,3})(?=[_.-])")
_DIST_INFO = re.compile(r"^(.*)/([A-Za-z0-9][A-Za-z0-9_.]*)-([^/-]+)\.dist-info$")
MAX_TOP_LEVEL = 64  # top-level names kept per distribution (torch has 3, vLLM 1)


class Distribution(BaseModel):
    """A Python distribution as its `*.dist-info` says: name, version, the top-level names it installs."""

    name: str
    version: str
    top_level: list[str] = Field(default_factory=list)


def nvidia_library(path: str) -> bool:
    """A library NVIDIA ships (cuBLAS, NCCL, cuSPARSELt, ...), by its file name or where it lies."""
    return bool(_NVIDIA_LIBRARY.match(posixpath.basename(path)) or _NVIDIA_TREE.search(path))


_PROFILING = re.compile(r"^lib(?:cupti|nvperf_\w+|checkpoint|pcsamplingutil)" + AUDITWHEEL_HASH + r"\.so")


def nvidia_profiling_library(path: str) -> bool:
    """NVIDIA's profiling and checkpointing libraries (CUPTI, NVPerf): the fatbins they keep outside
    `.nv_fatbin` are instrumentation injected under a profiler, never the application's code."""
    return _PROFILING.match(posixpath.basename(path)) is not None


def cuda_library_file(path: str) -> bool:
    """A file named like a CUDA library, which other files may link by that name."""
    return CUDA_LIBRARY_FILE.match(posixpath.basename(path)) is not None


class MissingLinks:
    """Which CUDA libraries the loader cannot find, for any file of one image (the driver's are the
    host's): a needed library the image does not carry, or a carried one that links, in turn, one it
    does not ("libcusparse.so.12 -> libnvJitLink.so.13"). `links`: carried library name -> the CUDA
    libraries it links (DT_NEEDED).

    Built once per image in time linear in the links (a breadth-first walk back from every missing
    library marks each carried library that reaches one, with its next hop on a shortest way there),
    so each file's answer costs only its own DT_NEEDED list, however long the chains an image's
    author made: a chain of 4,000 libraries, each a file whose way was walked and spelt out anew, cost
    seconds per layer, and cubically more for longer ones. A way is shown to its `SHOWN_HOPS`th library
    and its end.
    """

    SHOWN_HOPS = 4

    def __init__(self, carried: set[str], links: Mapping[str, Sequence[str]] | None = None) -> None:
        self._carried = carried
        self._next: dict[str, str] = {}  # a carried library -> its next hop toward a missing one
        self._end: dict[str, str] = {}  # ... and the missing one that way reaches
        linked_by: dict[str, list[str]] = {}
        queue: deque[str] = deque()
        for name, deeper in (links or {}).items():
            if name not in carried:
                continue
            for hop in deeper:
                if DRIVER_LIBRARIES.match(hop):
                    continue
                if hop in carried:
                    linked_by.setdefault(hop, []).append(name)
                elif name not in self._next:
                    self._next[name] = self._end[name] = hop
                    queue.append(name)
        while queue:
            hop = queue.popleft()
            for name in linked_by.get(hop, ()):
                if name not in self._next:
                    self._next[name], self._end[name] = hop, self._end[hop]
                    queue.append(name)

    def of(self, needed: Iterable[str]) -> list[str]:
        """The missing libraries of a file that needs `needed`: each it names and the image lacks, and
        for each it names that reaches a missing one, one shortest way there (the loader stops at the
        first library it cannot find, so one is reason enough)."""
        missing: set[str] = set()
        for name in needed:
            if DRIVER_LIBRARIES.match(name):
                continue
            if name not in self._carried:
                missing.add(name)
            elif name in self._next:
                missing.add(self._way(name))
        return sorted(missing)

    def _way(self, name: str) -> str:
        way, at = [name], name
        while at in self._carried:
            at = self._next[at]
            if len(way) == self.SHOWN_HOPS and at in self._carried:  # the rest of a long way: its end
                way += ["...", self._end[name]]
                break
            way.append(at)
        return " -> ".join(way)


def distribution_from_record(dist_info: str, record: bytes) -> Distribution | None:
    """A distribution from its dist-info directory's path and the head of its RECORD file."""
    match = _DIST_INFO.match(dist_info)
    if match is None:
        return None
    top: list[str] = []
    for line in record.decode("utf-8", "replace").splitlines():
        path = line.split(",", 1)[0].strip().strip('"')
        if not path or path.startswith(("..", "/")):
            continue
        first = path.split("/", 1)[0]
        if first.endswith((".dist-info", ".data")) or first == "__pycache__":
            continue
        name = first.split(".", 1)[0] if "/" not in path else first
        if name in NAMESPACE_PACKAGES and path.count("/") >= 2:
            name = "/".join(path.split("/", 2)[:2])  # `nvidia/dali`, never the shared `nvidia`
        elif name in NAMESPACE_PACKAGES:
            continue
        if name and name not in top:
            top.append(name)
            if len(top) >= MAX_TOP_LEVEL:
                break
    name = re.sub(r"[-_.]+", "-", match.group(2)).lower()  # as PyPI names it (PEP 503)
    return Distribution(name=name, version=match.group(3), top_level=top)


def package_of(path: str, distributions: Mapping[str, Distribution]) -> PackageFacts:
    """The package that ships the file (or module directory) at `path`. `distributions` maps a
    site-packages directory plus a top-level name (`/usr/lib/python3/dist-packages/vllm`) to its
    distribution."""
    if nvidia_library(path):
        name = posixpath.basename(path.rstrip("/"))
        return PackageFacts(id=f"nvidia:{name}", name=name, kind="nvidia")
    site = _SITE.match(path)
    if site is not None:
        first = site.group(2)  # a directory (`faiss_gpu_cu12.libs`, as auditwheel names it) or a module file
        top = first.split(".", 1)[0]
        if first in NAMESPACE_PACKAGES:
            inner = path[site.end() :].split("/", 1)[0]
            first = top = f"{first}/{inner}" if inner else first
        found = distributions.get(f"{site.group(1)}/{first}") or distributions.get(f"{site.group(1)}/{top}")
        if found is not None:
            return PackageFacts(
                id=f"python:{found.name}", name=found.name, version=found.version, kind="python"
            )
        return PackageFacts(id=f"python:{top}", name=top, kind="python")
    directory = path.rstrip("/") if path.endswith("/") else posixpath.dirname(path)  # a module dir is its own
    return PackageFacts(id=f"app:{directory}", name=directory, kind="application")


def distribution_index(distributions: Mapping[str, Distribution]) -> dict[str, Distribution]:
    """dist-info path -> distribution, as `package_of` looks them up (site directory + top-level name)."""
    index: dict[str, Distribution] = {}
    for dist_info, distribution in distributions.items():
        site = posixpath.dirname(dist_info)
        for name in distribution.top_level:
            index.setdefault(f"{site}/{name}", distribution)
    return index


def build_version(path: str) -> str | None:
    """The CUDA version a file name carries as a build tag (`_cuda128` -> 12.8, `_cu12` -> 12), or None."""
    match = _BUILD.search(posixpath.basename(path))
    return build_digits_version(match.group(1)) if match is not None else None


def build_digits_version(digits: str) -> str:
    """The CUDA version two or three digits of a build tag name: "128" -> 12.8, "12" -> 12, "92" -> 9.2."""
    if len(digits) == 3:
        return f"{int(digits[:2])}.{int(digits[2])}"
    value = int(digits)
    return str(value) if 10 <= value <= 19 else f"{digits[0]}.{digits[1]}"


def _key(version: str) -> tuple[int, int]:
    major, _, minor = version.partition(".")
    return int(major), int(minor) if minor else -1


def build_groups(files: Sequence[FileArchs]) -> list[list[FileArchs]]:
    """Groups of alternative builds among `files`: two or more libraries of one directory whose names
    are equal but for the CUDA version they carry."""
    groups: dict[tuple[str, str], list[FileArchs]] = {}
    for file in files:
        if file.kind != "library" or build_version(file.path) is None:
            continue
        directory, name = posixpath.split(file.path)
        groups.setdefault((directory, _BUILD.sub("{}", name, count=1)), []).append(file)
    return [members for members in groups.values() if len(members) > 1]


# Packages that load only the build of the runtime's exact CUDA version before a release: their name
# as `*.dist-info` spells it -> the first (major, minor) that falls back to a nearby build instead.
EXACT_BUILD_PACKAGES = {"bitsandbytes": (0, 50)}


def release_of(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a distribution's version ("0.49.2", "3.5.0+git7416ffcb"), or None."""
    numbers = re.match(r"^(\d{1,6})\.(\d{1,6})", version or "")
    return (int(numbers[1]), int(numbers[2])) if numbers is not None else None


def release_parts(version: str | None) -> tuple[int, int, int] | None:
    """(major, minor, micro) of a distribution's version ("0.3.6.post2" -> (0, 3, 6); "2.1" -> (2, 1, 0)),
    or None."""
    numbers = re.match(r"^(\d{1,6})\.(\d{1,6})(?:\.(\d{1,6}))?", version or "")
    if numbers is None:
        return None
    return int(numbers[1]), int(numbers[2]), int(numbers[3] or 0)


def exact_builds_only(package: PackageFacts | None) -> bool:
    """Whether `package` loads the build of the runtime's exact CUDA version or none (bitsandbytes
    before 0.50.0, whose `cextension.py` looks for `libbitsandbytes_cuda{torch.version.cuda}` alone)."""
    if package is None or package.name not in EXACT_BUILD_PACKAGES:
        return False
    release = release_of(package.version)
    return release is not None and release < EXACT_BUILD_PACKAGES[package.name]


def chosen_build(
    members: Sequence[FileArchs], runtime_cuda: str | None, *, exact: bool = False
) -> FileArchs | None:
    """The build a package loads among alternatives (see the module docstring), or None. `exact`: the
    package loads the build of the runtime's version or none (`exact_builds_only`)."""
    candidates = [m for m in members if not m.missing and m.cuda_build is not None]

    def by_version(member: FileArchs) -> tuple[int, int]:
        return _key(member.cuda_build or "0")

    if runtime_cuda is None:
        return max(candidates, key=by_version, default=None)
    runtime = _key(runtime_cuda)
    same_major = [m for m in candidates if by_version(m)[0] == runtime[0]]
    if "." not in runtime_cuda:  # only the major is known: the newest of it
        return max(same_major, key=by_version, default=None)
    if exact:
        return next((m for m in same_major if by_version(m) == runtime), None)
    below = [m for m in same_major if by_version(m) <= runtime]
    if below:
        return max(below, key=by_version)
    return min(same_major, key=by_version, default=None)


def annotate(
    files: Sequence[FileArchs],
    *,
    missing: MissingLinks,
    runtime_cuda: str | None,
    distributions: Mapping[str, Distribution],
    imports: Mapping[str, str],
    overrides: Mapping[str, str] | None = None,
) -> tuple[list[FileArchs], list[PackageFacts]]:
    """The files with `package`, `missing`, `cuda_build`, `selected` and `imported` set, and the
    packages they belong to (`optional` set). `missing`: the image's CUDA libraries resolved
    (`MissingLinks`); `imports`: extension path -> `required`/`optional`; `overrides`: package name ->
    the CUDA version whose build a config variable makes it load (`scanner.facts.gpu.build_overrides`)."""
    index = distribution_index(distributions)
    annotated: list[FileArchs] = []
    packages: dict[str, PackageFacts] = {}
    for file in files:
        package = package_of(file.path, index)
        packages.setdefault(package.id, package)
        state = imports.get(file.path)
        annotated.append(
            file.model_copy(
                update={
                    "package": package.id,
                    "missing": missing.of(file.needed),
                    "imported": state if state in ("required", "optional") else None,
                }
            )
        )
    position = {file.path: at for at, file in enumerate(annotated)}
    for members in build_groups(annotated):
        tagged = [m.model_copy(update={"cuda_build": build_version(m.path)}) for m in members]
        shipper = packages.get(tagged[0].package or "")
        forced = (overrides or {}).get(shipper.name) if shipper is not None else None
        if forced is not None:  # the build named, loadable or not: the package looks for no other
            chosen = next((m for m in tagged if m.cuda_build == forced), None)
        else:
            chosen = chosen_build(tagged, runtime_cuda, exact=exact_builds_only(shipper))
        for member in tagged:
            annotated[position[member.path]] = member.model_copy(update={"selected": member is chosen})
    for package in packages.values():
        own = [f for f in annotated if f.package == package.id and f.loadable and f.containers]
        package.optional = bool(own) and all(f.kind == "modules" or f.imported == "optional" for f in own)
    return annotated, list(packages.values())
