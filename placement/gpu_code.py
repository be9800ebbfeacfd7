"""Which GPU code runs on which GPU, judged as CUDA and the packages that ship it load it. Pure; the one
home of these rules.

The scanner reports what the bytes say (`scanner.layers.fatbin`, `scanner.layers.gpu_modules`): per
file, its fatbin containers with their SASS and PTX archs, PTX ISA and section; the package that
ships the file; whether the image can load it (its CUDA libraries are there) and whether its package
selects it among builds for several CUDA versions (`scanner.layers.code_loading`). This module
decides where that code runs, for eligibility (`placement.cuda_needs`), the exports and the UI alike.

Per container, NVIDIA's rules for a GPU of compute capability X.Y:
* SASS `sm_XZ` runs on the same major with Z <= Y; `sm_XYa` only at exactly X.Y; `sm_XYf` (a family
  build) on the same major at or above its minor;
* PTX `compute_XZ` is JIT-compiled on any CC >= X.Z (an `a` PTX only at X.Z, an `f` PTX within its
  major), by a driver at least as new as the toolkit that wrote the PTX (`Jit`, `placement.cuda_needs`).

Which containers count, as CUDA loads a file:
* containers of `.nv_fatbin` (what CUDA registers), of standalone module files, and of other
  sections of a shared object or program, which the library loads itself through the module API
  (TensorFlow's generated kernels in `.rodata`, cuFFT 12's in `.ldata`, cuBLASLt's in
  `.cask_resource`); never device-link input (`__nv_relfatbin`), relocatable objects, or the
  containers NVIDIA's profiling libraries keep outside `.nv_fatbin` (CUPTI's instrumentation
  kernels, injected only under a profiler). Names cannot tell these apart: every CUDA library links
  the runtime statically, and with it the module API's names; what the library is does;
* never a container that holds no kernel (`ContainerArchs.kernels`: the empty module nvcc 13 puts
  in every program it builds), nor one with neither SASS nor PTX (cuFFT 12 keeps 12,728 whose entries
  are of another kind, 8, beside its kernels: no GPU runs them as they are);
* never a file the image cannot load, or a build its package does not select.

Two rules judge the counted code (`Rule`, the setting `GPUBADGE_GPU_CODE_RULE` and the request's
`gpu_code_rule`):

**`dispatch`** (the default): as packages run their code. Modules load lazily (CUDA 12.2 and
newer), so a kernel never launched is never loaded, and packages pick kernels by compute capability
and CUDA version at run time (vLLM builds sources for `MARLIN_SM75_ARCHS "7.5"`, `SCALED_MM_ARCHS
"9.0a"`; ONNX Runtime enables flash attention on 8.x and 9.0 only).
* A library runs on a GPU when some of its containers have a kernel image for it; its containers
  built only for other GPUs are kernels used there. Unless it was not built for that GPU: none of
  the code that covers it is built for it alone (`sm_90a`), and under 1 in `BUILT_FOR_SHARE` of its
  generic containers cover it. The same holds for a package over all its libraries: PaddlePaddle
  2.6.2 reaches an H100 in 4 odd objects of its 819 containers, the rest built for sm_61 to sm_86.
* A library with no code for a GPU, beside libraries of the same package that have it, is an
  extension used on other hardware (FlashAttention 3 is Hopper-only; `libtorch_cuda_linalg.so` of
  torch cu130 has no sm_75): the package runs, and the answer says "runs; without ..." naming it.
* Unless no SASS of the package was built for the GPU, so that its code runs there only through PTX.
  Then a library it loads at import (`FileArchs.imported` "required"), built like the rest (generic
  SASS up to the newest that its files running there have) but with no kernel image there, is not a
  build for other GPUs that it picks instead: it fails there, a reason. gpu4pyscf-cuda12x 1.9.0 is
  built for sm_70 to sm_90; on Blackwell its `libcupy_helper.so` JITs PTX compute_80, and its
  `libgint.so`, whose PTX is device-link input only, has nothing. Builds for one architecture or
  family only (vLLM's FlashMLA, sm_90a and sm_100a) and builds for older GPUs only stay extensions
  used on other hardware.
* Optional code (an optional package's files) with nothing for a GPU runs "without" there, unless
  the file was built for older GPUs (its newest SASS generic and older, no PTX) and the image's own
  code that runs there does so only through PTX: then the image was written before the GPU, and
  picks its optional paths by where they start, a reason (`BUILT_BEFORE`). vLLM 0.6.1 takes
  vllm-flash-attn 2.6.1 (sm_80, sm_90) from compute capability 8.0 up: on a T4 it runs without it, on
  a B200 (vLLM's PTX compute_90 only) it would load it. Per file: a package whose every extension
  import is guarded (as vLLM 0.8.5's `_custom_ops.py` imports its `_C`) has its generic builds for
  older GPUs as reasons there, and FlashMLA (sm_90a) and FlashAttention 3 (sm_80 with sm_90a, taken
  on Hopper alone) stay fast paths of an older GPU.
* A package whose every kernel is built for one architecture or family alone (`sm_90a`, `sm_100f`) is
  fast paths, picked on those GPUs only: where none of it runs but the image's other code does, the
  image runs without it (cuEquivariance's torch extension, built for sm_90a to sm_120a, beside
  cuequivariance-ops' library with its generic kernels, which the extension links).
* A package none of whose code runs on a GPU does not run there (torch 2.5.1 on sm_120; a library
  built only for `sm_120a` on a 12.1 GPU, with nothing else there), and then neither does the image,
  unless its GPU code is optional (`PackageFacts.optional`: only guarded or on-demand imports of its
  extensions, or only standalone module files it picks itself) or it is NVIDIA's: CUDA libraries
  serve some calls only, and images carry more of them than they call (torch pins NCCL and
  cuSPARSELt builds that stop at Hopper, and runs on Blackwell). Both run "without" that code,
  named. An image made of NVIDIA libraries alone runs where one of them runs.
* A container that covers a GPU only through PTX the server's driver cannot JIT (its toolkit is
  newer than the driver) fails there: a reason for a package that needs it, "without" otherwise.

**`strict`**: for images made of one application's own kernels, where every kernel may be launched
anywhere: every container of a file must have a kernel image for the GPU (containers built only for
one architecture or family, beside generic code in the same file, are its fast paths there), every
file of the image's own code must run, and NVIDIA's libraries that lack code are caveats.
"""

from __future__ import annotations

import posixpath
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from placement.cuda_drivers import ptx_cuda_reason, ptx_driver_floor
from placement.cupy_compiler import cupy_refusal
from placement.flashinfer_compiler import flashinfer_gap, flashinfer_refusal
from placement.jax_compiler import jax_refusal
from placement.numba_compiler import numba_gap, numba_refusal
from placement.nvidia_require import compare_version
from placement.torch_extension_compiler import torch_extension_refusal
from placement.triton_compiler import compile_gap, compile_refusal
from placement.tvm_ffi_compiler import tvm_ffi_gap, tvm_ffi_refusal
from scanner.facts.gpu import BUILD_OVERRIDE_VARIABLES
from scanner.layers.code_loading import build_groups, nvidia_library, nvidia_profiling_library, package_of
from scanner.layers.fatbin import LOADED_SECTION, RELOCATABLE_SECTION, arch_sort_key, parse_arch
from scanner.layers.gpu_modules import MODULE_FILE
from scanner.models import ContainerArchs, FileArchs, GpuArchs, PackageFacts

CC = tuple[int, int]
Rule = Literal["dispatch", "strict"]
# A library (and a package) runs on a GPU when it has code built for that GPU only (`sm_90a`), or when at
# least 1 in BUILT_FOR_SHARE of its generic containers has code for it. PaddlePaddle 2.6.2 has 815
# generic containers built for sm_61 to sm_86 and 4 odd objects built for sm_35 to sm_90: it was not
# built for Hopper. Every other package read here (33, vLLM's included) covers at least 30 % of its
# generic containers wherever any of its code runs.
BUILT_FOR_SHARE = 20
NAMED_FILES = 4  # files a reason names before "and N more"
NOT_BUILT_FOR = (
    "loads it at import, and none of its code was built for this GPU: its other libraries run here only"
    " through PTX"
)
BUILT_BEFORE = (
    "was built only for older GPUs, as the image's code that runs here was (only its PTX runs here): code"
    " written before a GPU picks its optional paths by where they start (vLLM 0.6.1 takes FlashAttention"
    " from compute capability 8.0 up), so it would load it here"
)
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
# The GPUs a reader knows each compute capability by (NVIDIA's CUDA GPUs list), for tables.
ARCHITECTURES: dict[CC, str] = {
    (7, 0): "Volta (V100)", (7, 2): "Volta (Xavier)", (7, 5): "Turing (T4, RTX 20)",
    (8, 0): "Ampere (A100, A30)", (8, 6): "Ampere (A10, A40, RTX 30)", (8, 7): "Ampere (Orin)",
    (8, 9): "Ada (L4, L40S, RTX 40)", (9, 0): "Hopper (H100, H200, GH200)",
    (10, 0): "Blackwell (B200, GB200)", (10, 1): "Blackwell (Thor, before CUDA 13)",
    (10, 3): "Blackwell Ultra (B300, GB300)", (11, 0): "Blackwell (Thor)",
    (12, 0): "Blackwell (RTX PRO 6000, RTX 50)", (12, 1): "Blackwell (GB10, DGX Spark)",
}  # fmt: skip
# What a reader knows some libraries as, for "runs; without ..." (by file name, without suffixes).
KNOWN_LIBRARIES: dict[str, str] = {
    "_vllm_fa2_C": "FlashAttention 2",
    "_vllm_fa3_C": "FlashAttention 3",
    "_flashmla_C": "FlashMLA",
    "_flashmla_extension_C": "FlashMLA",
    "_qutlass_C": "QuTLASS (FP4 kernels)",
    "_deepselect_C": "DeepSeek sparse-attention top-k",
    "_flashkda_C": "FlashKDA",
    "libtorch_cuda_linalg": "torch.linalg",
    "flash_attn_2_cuda": "FlashAttention 2",
    "flash_attn_3_cuda": "FlashAttention 3",
}
# Sections a container may be loaded from by CUDA itself or by the package (see the module docstring).
_CUDA_LOADED = (LOADED_SECTION, MODULE_FILE)


@dataclass(frozen=True, slots=True)
class Jit:
    """What a server's driver JIT-compiles: PTX of its own CUDA version or older (`driver_cuda`, as
    NVML reports it), else PTX whose toolkit's own driver is not newer than `driver`."""

    driver: str | None = None
    driver_cuda: str | None = None

    def refusal(self, isa: str | None) -> str | None:
        """Why this driver cannot JIT PTX of ISA `isa`, or None when it can (or nothing says)."""
        too_new = ptx_cuda_reason(isa, self.driver_cuda)
        if too_new is not None:
            return too_new
        floor = ptx_driver_floor(isa)
        if self.driver and floor is not None and not compare_version(self.driver, ">=", floor[0]):
            return f"{floor[1]}, this server has {self.driver}"
        return None


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


def counted_containers(file: FileArchs) -> list[ContainerArchs]:
    """The containers of a file that hold code the image runs (see the module docstring)."""
    profiling = nvidia_profiling_library(file.path)
    return [
        c
        for c in file.containers
        if c.kernels
        and (c.sass or c.ptx)
        and c.section != RELOCATABLE_SECTION
        and (c.section in _CUDA_LOADED or not profiling)
    ]


def loaded_containers(file: FileArchs) -> list[ContainerArchs]:
    """The strict rule's containers: the counted ones, less the fast paths (`a` / `f` only) where
    generic code sits beside them."""
    loaded = counted_containers(file)
    generic = [c for c in loaded if not specific_only(c)]
    return generic or loaded


def counted(file: FileArchs) -> bool:
    """A file whose code runs: readable, loadable, selected, not a relocatable object, with counted containers."""
    if file.error is not None or not file.loadable or any("relocatable" in s for s in file.sections):
        return False
    return bool(counted_containers(file))


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


def library_name(path: str) -> str:
    """A file as a reader knows it: ".../vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so (FlashAttention 3)"."""
    stem = posixpath.basename(path.rstrip("/")).split(".", 1)[0]
    known = KNOWN_LIBRARIES.get(stem)
    return f"{path} ({known})" if known else path


def _count(containers: Iterable[ContainerArchs]) -> int:
    return sum(c.count for c in containers)


@dataclass(frozen=True, slots=True)
class FileVerdict:
    """One file on one GPU: which of its counted containers have a kernel image there."""

    path: str
    package: str
    library: bool  # an NVIDIA library (its gaps are caveats), else the image's own code
    covering: tuple[tuple[ContainerArchs, Literal["sass", "ptx"]], ...]  # containers that run here, and how
    missing: tuple[ContainerArchs, ...]  # containers with no kernel image here (built for other GPUs)
    refused: tuple[tuple[ContainerArchs, str], ...]  # PTX-only here, and the driver cannot JIT it: why
    total: int  # containers that count
    strict: bool = False  # judged by the strict rule: every container must run
    at_import: bool = False  # its package loads it at import, unguarded (`FileArchs.imported` "required")
    newest_generic: CC | None = None  # its newest SASS built for a range of GPUs (not `a` / `f` only)
    thin: bool = False  # code here in too few of its generic containers to be built for this GPU
    generic: int = 0  # its generic containers (not `a` / `f` only), each counted
    generic_covering: int = 0  # ... of which have code here

    @property
    def runs(self) -> bool:
        if self.strict:
            return not self.missing and not self.refused
        return bool(self.covering) and not self.thin

    @property
    def through_ptx_only(self) -> bool:
        """Runs here, and only through PTX: no SASS of it was built for this GPU."""
        return bool(self.covering) and all(how == "ptx" for _, how in self.covering)

    @property
    def ptx_isa(self) -> str | None:
        """The newest PTX ISA among the containers that run here only through PTX (None: none do)."""
        isas = [c.ptx_isa for c, how in self.covering if how == "ptx" and c.ptx_isa]
        return max(isas, key=version_key) if isas else None

    def lacks(self, cc: CC) -> str:
        """ "libnccl.so.2 has no kernel image for compute capability 12.0 (SASS sm_50–sm_90, no PTX)"."""
        if self.thin:
            return f"{library_name(self.path)} {self.thin_text(cc)}"
        share = "" if _count(self.missing) == self.total else f" in {_count(self.missing)} of its containers"
        return (
            f"{library_name(self.path)} has no kernel image for compute capability {cc_text(cc)}{share}"
            f" ({describe_code(self.missing)})"
        )

    def thin_text(self, cc: CC) -> str:
        """ "was not built for compute capability 9.0: 1 of its 655 containers has a kernel image for it
        (the rest: SASS sm_61–sm_86, no PTX)"."""
        generic = self.generic_covering + _count(c for c in self.missing if not specific_only(c))
        return (
            f"was not built for compute capability {cc_text(cc)}: {self.generic_covering} of its {generic}"
            f" containers {'has' if self.generic_covering == 1 else 'have'} a kernel image for it"
            f" (the rest: {describe_code(self.missing)})"
        )

    def covered(self, cc: CC) -> str:
        """ "libtorch_cuda.so: SASS sm_90" (the code that runs here)."""
        sass = {a for c, how in self.covering if how == "sass" for a in c.sass if sass_runs_on(a, cc)}
        ptx = {a for c, how in self.covering if how == "ptx" for a in c.ptx if ptx_runs_on(a, cc)}
        parts = []
        if sass:
            parts.append("SASS " + ", ".join(f"sm_{a}" for a in sorted(sass, key=arch_sort_key)))
        if ptx:
            parts.append("PTX " + ", ".join(f"compute_{a}" for a in sorted(ptx, key=arch_sort_key)))
        return f"{library_name(self.path)}: {' and '.join(parts)}"


def judge_file(file: FileArchs, cc: CC, jit: Jit | None = None, rule: Rule = "dispatch") -> FileVerdict:
    """Which counted containers of `file` run on a GPU of compute capability `cc` under `rule`, with
    the server's JIT (`jit`; None: PTX is taken to JIT, and its floor reported by the caller)."""
    containers = loaded_containers(file) if rule == "strict" else counted_containers(file)
    covering: list[tuple[ContainerArchs, Literal["sass", "ptx"]]] = []
    missing: list[ContainerArchs] = []
    refused: list[tuple[ContainerArchs, str]] = []
    for container in containers:
        how = container_runs_on(container, cc)
        if how is None:
            missing.append(container)
            continue
        why = jit.refusal(container.ptx_isa) if how == "ptx" and jit is not None else None
        if why is not None:
            refused.append((container, why))
        else:
            covering.append((container, how))
    library = nvidia_library(file.path)
    generic = _count(c for c in containers if not specific_only(c))
    generic_covering = _count(c for c, _ in covering if not specific_only(c))
    thin = (
        rule == "dispatch"
        and file.kind == "library"
        and not library
        and bool(covering)
        and not any(specific_only(c) for c, _ in covering)
        and generic_covering * BUILT_FOR_SHARE < generic
    )
    return FileVerdict(
        file.path,
        file.package or file.path,
        library,
        tuple(covering),
        tuple(missing),
        tuple(refused),
        _count(containers),
        strict=rule == "strict",
        at_import=file.kind == "library" and file.imported == "required",
        newest_generic=max(
            (parse_arch(a)[:2] for c in containers for a in c.sass if not parse_arch(a)[2]), default=None
        ),
        thin=thin,
        generic=generic,
        generic_covering=generic_covering,
    )


def version_key(version: str) -> tuple[int, int]:
    """(major, minor) of a version ("12.8", a PTX ISA "8.5") for ordering; 0 for a part that is not a number."""
    major, _, minor = version.partition(".")
    return (int(major) if major.isdigit() else 0, int(minor) if minor.isdigit() else 0)


@dataclass(slots=True)
class CodeVerdict:
    """The image's GPU code on one GPU: `runs`, why not (`reasons`), what it runs without there
    (`without`: extensions used on other hardware, optional packages, NVIDIA libraries), which code
    covers the GPU (`covered_by`), and the files whose code there is PTX to JIT (`ptx`)."""

    runs: bool
    reasons: list[str] = field(default_factory=list)
    without: list[str] = field(default_factory=list)
    covered_by: list[str] = field(default_factory=list)
    ptx: list[FileVerdict] = field(default_factory=list)

    @property
    def caveats(self) -> list[str]:
        return self.without


def _package_of(file: FileArchs, packages: dict[str, PackageFacts]) -> PackageFacts:
    """The package that ships a file, as the report names it (reports from before packages were
    read: one package per file, NVIDIA's by name)."""
    found = packages.get(file.package or "")
    return found if found is not None else package_of(file.path, {})


def _package_text(package: PackageFacts) -> str:
    if package.kind == "python":
        return f"{package.name} {package.version}" if package.version else package.name
    if package.kind == "application":
        return f"the application in {package.name}"
    return package.name


def _ptx_text(container: ContainerArchs) -> str:
    """ "PTX compute_80, ISA 9.5": the PTX of a container that JIT would compile."""
    archs = ", ".join(f"compute_{a}" for a in sorted(container.ptx, key=arch_sort_key))
    return f"PTX {archs}, ISA {container.ptx_isa}" if container.ptx_isa else f"PTX {archs}"


def _absent(file: FileVerdict, cc: CC) -> str:
    """Why a file has no code that runs here, after its name: none built for this GPU, or PTX its
    driver cannot JIT. "…/_vllm_fa3_C.abi3.so (FlashAttention 3): no kernel image for compute
    capability 10.0 (SASS sm_90a, no PTX)"."""
    if file.thin:
        return f"{library_name(file.path)} {file.thin_text(cc)}"
    if file.refused and not file.missing:
        container, why = file.refused[0]
        return f"{library_name(file.path)} runs here only through PTX ({_ptx_text(container)}), and {why}"
    return f"{library_name(file.path)}: no kernel image for compute capability {cc_text(cc)} ({describe_code(file.missing)})"


def _not_built_for(package: PackageFacts, files: Sequence[FileVerdict], covered: int, generic: int) -> str:
    """ "paddlepaddle-gpu 2.6.2 was not built for this GPU: 4 of its 819 containers have a kernel image
    for it (in .../libphi.so, .../libwarpctc.so); the rest: SASS sm_61–sm_86, no PTX"."""
    covering = [library_name(f.path) for f in files if f.generic_covering]
    shown = covering[:NAMED_FILES]
    where = ", ".join(shown) + (
        f" and {len(covering) - len(shown)} more" if len(covering) > len(shown) else ""
    )
    rest = describe_code([c for f in files for c in f.missing if not specific_only(c)])
    return (
        f"{_package_text(package)} was not built for this GPU: {covered} of its {generic} containers"
        f" {'has' if covered == 1 else 'have'} a kernel image for it (in {where}); the rest: {rest}"
    )


FAST_PATHS_ONLY = "is built for some GPUs alone: used on other GPUs"


def _built_before(file: FileVerdict, cc: CC) -> bool:
    """The file has no code for `cc` because it was built for older GPUs, for a range of them: its
    newest SASS is generic and below `cc` (an `a` or `f` build past it is a fast path for that GPU:
    vLLM's FlashAttention 3, sm_80 and sm_90a, which vLLM picks on Hopper alone), and it has no PTX
    (which would JIT here, or is for newer GPUs)."""
    if file.refused or file.newest_generic is None or file.newest_generic >= cc:
        return False
    archs = [parse_arch(arch) for container in file.missing for arch in container.sass]
    return not any(container.ptx for container in file.missing) and all(
        arch[:2] <= file.newest_generic for arch in archs if arch[2]
    )


def _no_code_here(package: PackageFacts, files: Sequence[FileVerdict], cc: CC) -> str:
    """The reason a package that needs its code does not run on a GPU where none of it runs."""
    lacking = "; ".join(f.lacks(cc) if not f.refused else _absent(f, cc) for f in files)
    return f"compute capability {cc_text(cc)}: {lacking}: no GPU code of {_package_text(package)} runs here; {RULE}"


def unselected_builds(archs: GpuArchs) -> list[str]:
    """Builds of one library for several CUDA versions of which the package loads none, though the
    image could load some: none is for the image's CUDA runtime, and the package loads that or none
    (`scanner.layers.code_loading.exact_builds_only`: bitsandbytes 0.45.5 beside torch cu126), or
    none is the one a variable of the image's config names (`GpuArchs.build_overrides`). One line per
    library, its builds named; the package runs without them on every GPU."""
    packages = {package.id: package for package in archs.packages}
    lines = []
    for members in build_groups(archs.files):
        if any(m.selected for m in members) or all(m.missing for m in members):
            continue
        ordered = sorted(members, key=lambda m: version_key(m.cuda_build or "0"))
        names = [posixpath.basename(m.path) for m in ordered]
        shown = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
        versions = ", ".join(dict.fromkeys(m.cuda_build or "?" for m in ordered))
        shipper = _package_of(ordered[0], packages)
        package = _package_text(shipper)
        forced = archs.build_overrides.get(shipper.name)
        if forced is not None:
            why = f"the image's {BUILD_OVERRIDE_VARIABLES[shipper.name]} names CUDA {forced}'s build"
        elif archs.runtime_cuda is not None:
            why = f"no build for CUDA {archs.runtime_cuda}, the image's CUDA runtime"
        else:
            continue
        lines.append(
            f"{posixpath.dirname(ordered[0].path)}/{{{shown}}} ({package}): {why} (builds for {versions});"
            f" {package} loads only the build of that version, so none"
        )
    return lines


def judge(archs: GpuArchs, cc: CC, jit: Jit | None = None, rule: Rule = "dispatch") -> CodeVerdict:
    """Whether the image's GPU code runs on a GPU of compute capability `cc` (rules: module docstring)."""
    if rule == "strict":
        return _judge_strict(archs, cc, jit)
    packages = {package.id: package for package in archs.packages}
    groups: dict[str, tuple[PackageFacts, list[FileVerdict]]] = {}
    for file in archs.files:
        if counted(file):
            package = _package_of(file, packages)
            groups.setdefault(package.id, (package, []))[1].append(judge_file(file, cc, jit))
    where = f"compute capability {cc_text(cc)}"
    verdict = CodeVerdict(runs=True)
    own = [g for g in groups.values() if g[0].kind != "nvidia"]
    own_running: list[FileVerdict] = []  # the image's own files with code here
    fast_path_packages: list[tuple[PackageFacts, list[FileVerdict]]] = []  # decided once that is known
    optional_absent: list[tuple[PackageFacts, list[FileVerdict]]] = []  # the same
    for package, files in groups.values():
        needs_it = package.kind != "nvidia" and not package.optional
        running = [f for f in files if f.runs]
        if package.kind != "nvidia":
            own_running += running
        generic = sum(f.generic for f in files)
        covered = sum(f.generic_covering for f in files)
        fast_paths = any(specific_only(c) for f in files for c, _ in f.covering)  # built for this GPU
        if running and package.kind != "nvidia" and not fast_paths and covered * BUILT_FOR_SHARE < generic:
            line = _not_built_for(package, files, covered, generic)
            if needs_it:
                verdict.reasons.append(f"{where}: {line}")
            else:
                verdict.without.append(f"{line}; the image runs without {_package_text(package)}")
            continue
        if not running:
            if needs_it and all(not f.refused and all(specific_only(c) for c in f.missing) for f in files):
                fast_path_packages.append((package, files))  # built for some GPUs alone
            elif needs_it and all(f.refused and not f.missing for f in files):
                verdict.reasons += [f"{where}: {_absent(f, cc)}" for f in files]
            elif needs_it:
                verdict.reasons.append(_no_code_here(package, files, cc))
            elif package.optional:
                optional_absent.append((package, files))
            else:
                verdict.without += [
                    f"{_absent(f, cc)}; calls into this NVIDIA library fail here" for f in files
                ]
            continue
        if needs_it and all(one.through_ptx_only for one in running):
            # No SASS of the package was built for this GPU, so nothing it lacks here is a build for
            # other GPUs that it picks instead: what it loads at import without code here fails.
            # A gap is built like the rest: for GPUs up to the newest the running files were built for.
            # One built only for older GPUs (a Turing-only library) is an extension used there.
            newest = max((one.newest_generic for one in running if one.newest_generic), default=None)
            gaps = [
                f
                for f in files
                if not f.runs
                and not f.refused
                and f.at_import
                and f.newest_generic is not None
                and (newest is None or f.newest_generic >= newest)
            ]
            verdict.reasons += [
                f"{where}: {f.lacks(cc)}: {_package_text(package)} {NOT_BUILT_FOR}" for f in gaps
            ]
        for one in running:
            verdict.covered_by.append(one.covered(cc))
            if one.ptx_isa is not None:
                verdict.ptx.append(one)
            for container, why in one.refused:  # PTX meant for this GPU that its driver cannot compile
                line = f"{library_name(one.path)} runs here only through PTX in some kernels ({_ptx_text(container)}), and {why}"
                if needs_it:
                    verdict.reasons.append(f"{where}: {line}")
                else:
                    verdict.without.append(line)
        verdict.without += [f"{_absent(f, cc)}; used on other GPUs" for f in files if not f.runs]
    built_before_here = bool(own_running) and all(one.through_ptx_only for one in own_running)
    for package, files in optional_absent:
        # Optional code with nothing for this GPU. Code that knows the GPU, or that was built for GPUs
        # past it (FlashAttention 2 starts at sm_80: vLLM uses XFormers on a T4), leaves it unpicked.
        # Where the GPU is newer than a file's every build and than the image's code that runs here,
        # that code was written before the GPU: it picks by lower bounds, so the file is loaded.
        for f in files:
            if built_before_here and _built_before(f, cc):
                verdict.reasons.append(f"{where}: {f.lacks(cc)}: {_package_text(package)} {BUILT_BEFORE}")
            else:
                verdict.without.append(f"{_absent(f, cc)}; {_package_text(package)} runs without it")
    for package, files in fast_path_packages:
        # Every kernel of the package is built for one architecture or family alone (`sm_90a`,
        # `sm_100f`): fast paths, which it and its callers pick on those GPUs only (cuEquivariance's
        # torch extension beside the library with its generic kernels). Used on other GPUs where the
        # image's other code runs; where none does, nothing runs.
        if own_running:
            verdict.without += [
                f"{_absent(f, cc)}; {_package_text(package)} {FAST_PATHS_ONLY}" for f in files
            ]
        else:
            verdict.reasons.append(_no_code_here(package, files, cc))
    if not own and groups and not verdict.covered_by:
        verdict.reasons.append(f"{where}: none of the image's GPU libraries runs here; {RULE}")
    verdict.without += unselected_builds(archs)
    _judge_compilers(archs, cc, verdict, jit)
    verdict.runs = not verdict.reasons
    if not verdict.runs:
        verdict.without, verdict.covered_by, verdict.ptx = [], [], []
    elif not own and verdict.ptx and len(verdict.ptx) == len(verdict.covered_by):
        # only NVIDIA libraries, each needing JIT here: the one with the oldest PTX is the floor
        verdict.ptx = [min(verdict.ptx, key=lambda f: version_key(f.ptx_isa or "0"))]
    elif not own:
        verdict.ptx = []  # some NVIDIA library runs here from SASS: the image needs no JIT to run
    return verdict


def _judge_compilers(archs: GpuArchs, cc: CC, verdict: CodeVerdict, jit: Jit | None) -> None:
    """The kernels Triton, FlashInfer, tvm-ffi, torch's `cpp_extension`, CuPy's NVRTC, JAX's XLA and
    numba-cuda build on `cc` (`placement.triton_compiler`, `placement.flashinfer_compiler`,
    `placement.tvm_ffi_compiler`, `placement.torch_extension_compiler`, `placement.cupy_compiler`,
    `placement.jax_compiler`, `placement.numba_compiler`): for each, a reason where a package needs them on its
    default path (torch's: at its import; CuPy's and JAX's: for nearly anything they do; numba-cuda's: where
    it is the image's only GPU code) and they cannot be built here, else a line of what the image runs without.
    `jit`: the server's driver, which compiles the PTX CuPy asks for where it asks for PTX, and numba-cuda's
    where no nvJitLink links it."""
    torch = archs.torch_extensions
    own = _loads_code(archs)  # numba-cuda's kernels beside GPU code the image carries
    driver = jit.refusal if jit is not None else None  # why the server's driver cannot compile PTX of an ISA
    judges = (
        (compile_refusal(archs.triton, archs.packages, cc), compile_gap(archs.triton, cc)),
        (flashinfer_refusal(archs.flashinfer, archs.packages, cc), flashinfer_gap(archs.flashinfer, cc)),
        (tvm_ffi_refusal(archs.tvm_ffi, archs.packages, cc), tvm_ffi_gap(archs.tvm_ffi, cc)),
        (torch_extension_refusal(torch, archs.files, archs.packages, cc), None),
        (cupy_refusal(archs.cupy, cc, driver), None),
        (jax_refusal(archs.jax, cc), None),
        (numba_refusal(archs.numba, cc, own, driver), numba_gap(archs.numba, cc, own, driver)),
    )
    for refusal, gap in judges:
        if refusal is not None:
            verdict.reasons.append(f"compute capability {cc_text(cc)}: {refusal}")
        elif gap is not None:
            verdict.without.append(gap)


def _judge_strict(archs: GpuArchs, cc: CC, jit: Jit | None) -> CodeVerdict:
    """The strict rule: every counted container of the image's own files must run (module docstring)."""
    verdicts = [judge_file(file, cc, jit, "strict") for file in archs.files if counted(file)]
    own = [v for v in verdicts if not v.library]
    libraries = [v for v in verdicts if v.library]
    where = f"compute capability {cc_text(cc)}"
    if own:
        failing = [v for v in own if not v.runs]
        deciding = own
    else:
        failing = [] if not libraries or any(v.runs for v in libraries) else libraries
        deciding = [v for v in libraries if v.runs]
    verdict = CodeVerdict(runs=not failing)
    if failing:
        for v in failing:
            if v.missing:
                suffix = ": none of the image's GPU libraries runs here" if not own else ""
                verdict.reasons.append(f"{where}: {v.lacks(cc)}{suffix}; {RULE}")
            for container, why in v.refused:
                verdict.reasons.append(
                    f"{where}: {library_name(v.path)} runs here only through PTX ({_ptx_text(container)}), and {why}"
                )
        return verdict
    verdict.without = [
        f"{_absent(v, cc)}; calls into this NVIDIA library fail here" for v in libraries if not v.runs
    ] + unselected_builds(archs)
    _judge_compilers(archs, cc, verdict, jit)
    if verdict.reasons:
        verdict.runs, verdict.without = False, []
        return verdict
    verdict.covered_by = [v.covered(cc) for v in deciding]
    if own:
        verdict.ptx = [v for v in deciding if v.ptx_isa is not None]
    elif deciding and all(v.ptx_isa is not None for v in deciding):
        verdict.ptx = [min(deciding, key=lambda v: version_key(v.ptx_isa or "0"))]
    return verdict


def has_code(archs: GpuArchs | None) -> bool:
    """Whether the image carries GPU code to judge (else only its CUDA version can be judged): code it can
    load, or numba-cuda, which carries none and compiles every kernel at run time (`placement.numba_compiler`)."""
    return archs is not None and (archs.numba is not None or _loads_code(archs))


def _loads_code(archs: GpuArchs) -> bool:
    """Whether the image carries GPU code it can load."""
    return any(counted(f) for f in archs.files)


NEWER_THAN_KNOWN: CC = (KNOWN_COMPUTE_CAPABILITIES[-1][0] + 1, 0)  # what only PTX can reach
_TABLES: OrderedDict[tuple[object, ...], dict[CC, CodeVerdict]] = OrderedDict()
_TABLES_KEPT = 256  # images whose verdicts are kept (a vLLM image's take about 20 ms to make)
_TABLES_LOCK = threading.Lock()


def verdicts(archs: GpuArchs, rule: Rule = "dispatch") -> dict[CC, CodeVerdict]:
    """The image's GPU code judged on every known compute capability and on one past the newest,
    with no server's driver in view (PTX taken to JIT; the floors are the caller's). The summary,
    caveats, the page's generations and the exports' ranges all read this one table, kept for the
    last `_TABLES_KEPT` images by content, so an image is judged once however often it is shown."""
    key = (
        rule,
        tuple(
            (
                f.path,
                f.package,
                f.kind,
                f.error,
                f.loadable,
                f.imported,
                tuple(f.sections),
                tuple((c.signature, c.count) for c in f.containers),
            )
            for f in archs.files
        ),
        tuple((p.id, p.kind, p.optional, p.name, p.version) for p in archs.packages),
        archs.runtime_cuda,  # and what chose the builds, which `unselected_builds` names
        tuple(sorted(archs.build_overrides.items())),
        # and what the run-time compilers build with: two images with the same files may differ there
        tuple(
            facts.model_dump_json() if facts is not None else None
            for facts in (
                archs.triton,
                archs.flashinfer,
                archs.tvm_ffi,
                archs.torch_extensions,
                archs.cupy,
                archs.jax,
                archs.numba,
            )
        ),
    )
    with _TABLES_LOCK:  # pages, by-ref and placement judge from several threads
        table = _TABLES.get(key)
        if table is not None:
            _TABLES.move_to_end(key)
            return table
    table = {cc: judge(archs, cc, rule=rule) for cc in (*KNOWN_COMPUTE_CAPABILITIES, NEWER_THAN_KNOWN)}
    with _TABLES_LOCK:
        _TABLES[key] = table
        if len(_TABLES) > _TABLES_KEPT:
            _TABLES.popitem(last=False)
    return table


def runs_at(archs: GpuArchs, rule: Rule = "dispatch") -> list[tuple[CC, CodeVerdict]]:
    """The known compute capabilities (and one past the newest, which only PTX reaches) where the
    image's GPU code runs, each with its verdict."""
    return [(cc, verdict) for cc, verdict in verdicts(archs, rule).items() if verdict.runs]


def cc_spans(ccs: Sequence[CC]) -> str:
    """Known compute capabilities as spans without holes: "7.5–9.0, 10.0–10.3, 12.0–12.1"."""
    positions = sorted(KNOWN_COMPUTE_CAPABILITIES.index(cc) for cc in ccs if cc in KNOWN_COMPUTE_CAPABILITIES)
    spans: list[tuple[int, int]] = []
    for position in positions:
        if spans and spans[-1][1] + 1 == position:
            spans[-1] = (spans[-1][0], position)
        else:
            spans.append((position, position))
    texts = []
    for low, high in spans:
        first, last = KNOWN_COMPUTE_CAPABILITIES[low], KNOWN_COMPUTE_CAPABILITIES[high]
        texts.append(cc_text(first) if low == high else f"{cc_text(first)}–{cc_text(last)}")
    return ", ".join(texts)


def summary(archs: GpuArchs, rule: Rule = "dispatch") -> str:
    """Where the image's GPU code runs, in one line: "GPU code for sm_75–sm_120, no PTX: compute
    capability 7.5–9.0, 10.0–12.1" (the capabilities where it runs, never a range with holes)."""
    shown = [f for f in archs.files if counted(f) and not nvidia_library(f.path)] or [
        f for f in archs.files if counted(f)
    ]
    if not shown and archs.numba is None:
        return "no GPU code CUDA loads"
    if shown:
        containers = [c for f in shown for c in counted_containers(f)]
        sass = {a for c in containers for a in c.sass if not parse_arch(a)[2]}
        ptx = {a for c in containers for a in c.ptx}
        code = "GPU code for " + (_arch_range(sass, "sm_") or "no generic SASS")
        code += f", PTX {_arch_range(ptx, 'compute_')}" if ptx else ", no PTX"
    else:
        code = "no precompiled GPU code (numba-cuda compiles its kernels at run time)"
    where = runs_at(archs, rule)
    if not where:
        return f"{code}: runs on no known GPU"
    known = [cc for cc, _ in where if cc in KNOWN_COMPUTE_CAPABILITIES]
    newer = len(known) < len(where)
    span = f"compute capability {cc_spans(known)}" if known else "no known GPU"
    if newer:
        span += " and newer GPUs" if known else ": GPUs newer than this table"
    return f"{code}: {span}"


def caveats(archs: GpuArchs, rule: Rule = "dispatch") -> list[str]:
    """What the image runs without, by compute capability where it runs: one line per library or package."""
    lacking: dict[str, list[CC]] = {}
    for cc, verdict in runs_at(archs, rule):
        if cc not in KNOWN_COMPUTE_CAPABILITIES:
            continue
        for line in verdict.without:
            name = line.split(": ", 1)[0]
            lacking.setdefault(name, []).append(cc)
    return [f"runs without {name} on compute capability {cc_spans(ccs)}" for name, ccs in lacking.items()]
