"""Which GPU code runs on which GPU, judged as CUDA loads it. Pure; the one home of these rules.

The scanner reports what the bytes say (`scanner.layers.fatbin`): per file, its fatbin containers,
each with its SASS and PTX archs, its PTX ISA and the ELF section it sits in. This module decides
where that code runs, for eligibility (`placement.cuda_needs`), the exports and the UI alike.

Per container, NVIDIA's rules for a GPU of compute capability X.Y:
* SASS `sm_XZ` runs on the same major with Z <= Y; `sm_XYa` only at exactly X.Y; `sm_XYf` (a family
  build) on the same major at or above its minor;
* PTX `compute_XZ` is JIT-compiled on any CC >= X.Z (an `a` PTX only at X.Z, an `f` PTX within its
  major), by a driver at least as new as the toolkit that wrote the PTX (`placement.cuda_needs`).

Per file, as CUDA loads a library:
* only containers of `.nv_fatbin` count: `__nv_relfatbin` is device-link input (`-rdc`) that nvlink
  reads at build time and CUDA never loads from a shared object (NCCL ships 127 of them beside its
  one runtime container); relocatable objects (`.o`) do not run at all;
* a container that holds no kernel (`ContainerArchs.kernels`: the empty module nvcc 13 puts in
  every program it builds) never decides: a program built for `sm_80` plus PTX ran on an H200,
  though that module had only a kernel-free `sm_80` cubin;
* a container built only for one architecture (`sm_90a`) or one family (`sm_100f`), beside generic
  code in the same file, is that library's fast path on that hardware (cuSPARSELt's Hopper kernels),
  not a requirement to run elsewhere: CUDA loads modules lazily and a kernel never launched is never
  loaded. A file with nothing but such code needs that hardware;
* the file runs on a GPU when every other container has a kernel image for it.

Per image (documented in the README, "What the GPU code decides"):
* the image's own GPU code (any file that is not an NVIDIA library: torch's `libtorch_cuda.so`, an
  application's kernels) decides: every such file must run there, or the image is not eligible
  (torch 2.5.1 cu124 on a CC 12.0 GPU: SASS up to sm_90 and no PTX);
* NVIDIA's own libraries (cuBLAS, cuDNN, NCCL, cuSPARSELt, ...: recognised by file name and by
  where NVIDIA's wheels and toolkit put them) are used for some calls only, and real images carry
  more of them than they call (torch pins NCCL and cuSPARSELt builds that stop at Hopper, and runs
  on Blackwell): one that lacks code for a GPU never rejects the image on its own, but every answer
  names it and the architectures it lacks, as a caveat. Where the image has no GPU code of its own
  (an image made of NVIDIA libraries), it runs where at least one of them runs.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from scanner.layers.fatbin import RELOCATABLE_SECTION, arch_sort_key, parse_arch
from scanner.models import ContainerArchs, FileArchs, GpuArchs

CC = tuple[int, int]
RULE = "SASS runs only on its own major at or above its minor, an `a` build only at its exact CC, PTX at or above its arch"

# Every compute capability NVIDIA has shipped (its CUDA GPUs list). A scheduler can only compare a
# node's CC with numbers, so exports walk these to turn "the image runs here" into ranges.
KNOWN_COMPUTE_CAPABILITIES: tuple[CC, ...] = (
    (3, 0), (3, 2), (3, 5), (3, 7), (5, 0), (5, 2), (5, 3), (6, 0), (6, 1), (6, 2), (7, 0), (7, 2),
    (7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 1), (10, 3), (11, 0), (12, 0), (12, 1),
)  # fmt: skip
GENERATIONS: dict[int, str] = {
    3: "Kepler", 5: "Maxwell", 6: "Pascal", 7: "Volta/Turing", 8: "Ampere/Ada", 9: "Hopper",
    10: "Blackwell", 11: "Blackwell", 12: "Blackwell",
}  # fmt: skip

# NVIDIA's libraries, by the name their shared objects carry (lib<name>.so...).
_NVIDIA_LIBRARY = re.compile(
    r"^lib(cublas|cublasLt|cudnn\w*|nccl|cusparse|cusparseLt|cufft|cufftw|curand|cusolver|cusolverMg|"
    r"nvjpeg|npp\w*|nvrtc\w*|cupti|nvJitLink|cudart|nvblas|cufile\w*|nvinfer\w*|nvonnxparser|nvshmem\w*|"
    r"cudss|cutensor\w*|nvperf\w*|nvToolsExt|nvjitlink|nvcomp\w*|cuda)(?:[-.][0-9a-f]{8})?\.so"
)  # auditwheel renames the copies it bundles: libnvjpeg.02b6d700.so.12, libcudart-e409450e.so.11.0
# Where NVIDIA's wheels and toolkits put them: {site,dist}-packages/nvidia/<component>/lib, cusparselt/lib,
# /usr/local/cuda[-X.Y]/.
_NVIDIA_TREE = re.compile(r"(?:/(?:site|dist)-packages/(?:nvidia|cusparselt)/|^/usr/local/cuda[-/])")


def sass_runs_on(arch: str, cc: CC) -> bool:
    """SASS: same major and a lower or equal minor; an `a` build only at exactly its CC."""
    major, minor, variant = parse_arch(arch)
    if variant == "a":
        return (major, minor) == cc
    return major == cc[0] and minor <= cc[1]


def ptx_runs_on(arch: str, cc: CC) -> bool:
    """PTX JIT: any CC at or above it; `a` PTX only at its CC, `f` PTX only within its major."""
    major, minor, variant = parse_arch(arch)
    if variant == "a":
        return (major, minor) == cc
    if variant == "f":
        return major == cc[0] and minor <= cc[1]
    return (major, minor) <= cc


def container_runs_on(container: ContainerArchs, cc: CC) -> Literal["sass", "ptx"] | None:
    """How a container runs on a GPU of compute capability `cc`, if it does."""
    if any(sass_runs_on(arch, cc) for arch in container.sass):
        return "sass"
    if any(ptx_runs_on(arch, cc) for arch in container.ptx):
        return "ptx"
    return None


def specific_only(container: ContainerArchs) -> bool:
    """Built only for one architecture or family (`sm_90a`, `sm_100f`): a fast path, where generic code
    sits beside it."""
    archs = [*container.sass, *container.ptx]
    return bool(archs) and all(parse_arch(arch)[2] for arch in archs)


def nvidia_library(path: str) -> bool:
    """A library NVIDIA ships (cuBLAS, NCCL, cuSPARSELt, ...), by its file name or where it lies."""
    return bool(_NVIDIA_LIBRARY.match(posixpath.basename(path)) or _NVIDIA_TREE.search(path))


def loaded_containers(file: FileArchs) -> list[ContainerArchs]:
    """The containers CUDA loads from a file, the ones that decide where it runs: device-link input
    left out, containers that hold no kernel too (no launch needs them), and fast-path containers
    (`a` / `f` only) where generic code sits beside them."""
    loaded = [c for c in file.containers if c.section != RELOCATABLE_SECTION and c.kernels]
    generic = [c for c in loaded if not specific_only(c)]
    return generic or loaded


def counted(file: FileArchs) -> bool:
    """A file whose code runs: readable, not a relocatable object, with containers CUDA loads."""
    if file.error is not None or any("relocatable" in section for section in file.sections):
        return False
    return bool(loaded_containers(file))


def _arch_range(archs: Iterable[str], prefix: str) -> str:
    ordered = sorted(set(archs), key=arch_sort_key)
    if not ordered:
        return ""
    if len(ordered) <= 2:
        return ", ".join(f"{prefix}{a}" for a in ordered)
    return f"{prefix}{ordered[0]}–{prefix}{ordered[-1]}"


def describe_code(containers: Sequence[ContainerArchs]) -> str:
    """ "SASS sm_50–sm_90 + sm_90a, no PTX", "SASS sm_100f, no PTX", "no SASS, PTX compute_100" for a
    set of containers."""
    sass = {a for c in containers for a in c.sass}
    ptx = {a for c in containers for a in c.ptx}
    generic = [a for a in sass if not parse_arch(a)[2]]
    specific = ", ".join(f"sm_{a}" for a in sorted((a for a in sass if parse_arch(a)[2]), key=arch_sort_key))
    shown = [part for part in (_arch_range(generic, "sm_"), specific) if part]
    text = "SASS " + " + ".join(shown) if shown else "no SASS"
    text += ", PTX " + _arch_range(ptx, "compute_") if ptx else ", no PTX"
    return text


def cc_text(cc: CC) -> str:
    return f"{cc[0]}.{cc[1]}"


@dataclass(frozen=True, slots=True)
class FileVerdict:
    """One file on one GPU: whether CUDA finds a kernel image for each container it loads there."""

    path: str
    library: bool  # an NVIDIA library (its gaps are caveats), else the image's own code
    missing: tuple[ContainerArchs, ...]  # containers with no kernel image for this GPU
    total: int  # containers that count (after the rules above)
    ptx_isa: str | None  # the newest PTX ISA that must be JIT-compiled here (None: all from SASS)

    @property
    def runs(self) -> bool:
        return not self.missing

    def lacks(self, cc: CC) -> str:
        """ "libnccl.so.2 has no kernel image for compute capability 12.0 (SASS sm_50–sm_90, no PTX)"."""
        share = "" if _count(self.missing) == self.total else f" in {_count(self.missing)} of its containers"
        return (
            f"{self.path} has no kernel image for compute capability {cc_text(cc)}{share}"
            f" ({describe_code(self.missing)})"
        )


def _count(containers: Iterable[ContainerArchs]) -> int:
    return sum(c.count for c in containers)


def judge_file(file: FileArchs, cc: CC) -> FileVerdict:
    containers = loaded_containers(file)
    missing: list[ContainerArchs] = []
    isa: str | None = None
    for container in containers:
        how = container_runs_on(container, cc)
        if how is None:
            missing.append(container)
        elif (
            how == "ptx"
            and container.ptx_isa is not None
            and (isa is None or version_key(container.ptx_isa) > version_key(isa))
        ):
            isa = container.ptx_isa
    return FileVerdict(
        file.path, nvidia_library(file.path), tuple(missing), _count(containers), isa if not missing else None
    )


def version_key(version: str) -> tuple[int, int]:
    """(major, minor) of a version ("12.8", a PTX ISA "8.5") for ordering; 0 for a part that is not a number."""
    major, _, minor = version.partition(".")
    return (int(major) if major.isdigit() else 0, int(minor) if minor.isdigit() else 0)


@dataclass(slots=True)
class CodeVerdict:
    """The image's GPU code on one GPU: `runs`, why not (`reasons`), the NVIDIA libraries that lack
    code there while the image runs (`caveats`), and the files that must JIT PTX there (`ptx`)."""

    runs: bool
    reasons: list[str] = field(default_factory=list)
    caveats: list[str] = field(default_factory=list)
    ptx: list[FileVerdict] = field(default_factory=list)


def judge(archs: GpuArchs, cc: CC) -> CodeVerdict:
    """Whether the image's GPU code runs on a GPU of compute capability `cc` (rules: module docstring)."""
    verdicts = [judge_file(file, cc) for file in archs.files if counted(file)]
    own = [v for v in verdicts if not v.library]
    libraries = [v for v in verdicts if v.library]
    if own:
        failing = [v for v in own if not v.runs]
        runs = not failing
        deciding = own
    else:
        runs = not libraries or any(v.runs for v in libraries)
        failing = [] if runs else libraries
        deciding = [v for v in libraries if v.runs]
    verdict = CodeVerdict(runs=runs)
    if failing:
        verdict.reasons = [
            f"compute capability {cc_text(cc)}: {v.lacks(cc)}"
            + (": none of the image's GPU libraries runs here" if not own else "")
            + f"; {RULE}"
            for v in failing
        ]
        return verdict
    verdict.caveats = [v.lacks(cc) for v in libraries if not v.runs]
    if own:
        verdict.ptx = [v for v in deciding if v.ptx_isa is not None]
    elif deciding and all(v.ptx_isa is not None for v in deciding):
        # only libraries, each needing JIT here: the one with the oldest PTX is the floor
        verdict.ptx = [min(deciding, key=lambda v: version_key(v.ptx_isa or "0"))]
    return verdict


def runs_at(archs: GpuArchs) -> list[tuple[CC, CodeVerdict]]:
    """The known compute capabilities (and one past the newest, which only PTX reaches) where the
    image's GPU code runs, each with its verdict."""
    found = []
    for cc in (*KNOWN_COMPUTE_CAPABILITIES, (KNOWN_COMPUTE_CAPABILITIES[-1][0] + 1, 0)):
        verdict = judge(archs, cc)
        if verdict.runs:
            found.append((cc, verdict))
    return found


def summary(archs: GpuArchs) -> str:
    """Where the image's GPU code runs, in one line: "GPU code for sm_50–sm_90, no PTX: compute
    capability 5.0–9.0, not Blackwell"."""
    own = [f for f in archs.files if counted(f) and not nvidia_library(f.path)]
    shown = own or [f for f in archs.files if counted(f)]
    if not shown:
        return "no GPU code CUDA loads"
    containers = [c for f in shown for c in loaded_containers(f)]
    sass = {a for c in containers for a in c.sass if not parse_arch(a)[2]}
    ptx = {a for c in containers for a in c.ptx}
    code = "GPU code for " + (_arch_range(sass, "sm_") or "no generic SASS")
    code += f", PTX {_arch_range(ptx, 'compute_')}" if ptx else ", no PTX"
    where = runs_at(archs)
    if not where:
        return f"{code}: runs on no known GPU"
    known = [cc for cc, _ in where if cc in KNOWN_COMPUTE_CAPABILITIES]
    newer = len(known) < len(where)
    span = f"compute capability {cc_text(known[0])}–{cc_text(known[-1])}" if known else "no known GPU"
    if newer:
        span = f"compute capability {cc_text(known[0])} and newer" if known else "GPUs newer than this table"
    if known and not newer:
        later = [
            GENERATIONS[cc[0]] for cc in KNOWN_COMPUTE_CAPABILITIES if cc > known[-1] and cc[0] > known[-1][0]
        ]
        gaps = list(dict.fromkeys(later))
        if gaps:
            return f"{code}: {span}, not {' or '.join(gaps)}"
    return f"{code}: {span}"


def caveats(archs: GpuArchs) -> list[str]:
    """One line per NVIDIA library that lacks code where the image runs, naming the architectures."""
    lacking: dict[str, list[CC]] = {}
    code: dict[str, str] = {}
    for cc, _ in runs_at(archs):
        if cc not in KNOWN_COMPUTE_CAPABILITIES:
            continue
        for file in archs.files:
            if counted(file) and nvidia_library(file.path):
                one = judge_file(file, cc)
                if not one.runs:
                    lacking.setdefault(file.path, []).append(cc)
                    code[file.path] = describe_code(one.missing)
    return [
        f"{path} has no kernel image for compute capability {', '.join(cc_text(cc) for cc in ccs)}"
        f" ({code[path]}): the image runs there, but calls into this NVIDIA library fail"
        for path, ccs in lacking.items()
    ]
