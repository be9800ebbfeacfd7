"""CUDA an image carries without declaring it: evidence from layer files, merged top-down. Pure.

Most GPU images set no NVIDIA variable: `pip install torch` brings CUDA through `nvidia-*-cu12`
wheels, conda through `cudatoolkit`, others copy a toolkit tree. Each layer gives a small,
cacheable `CudaLayerEvidence` (by layer digest); `combine()` merges them with overlay rules:
an upper layer's file wins over a lower one at the same path, and whiteouts / opaque dirs hide
lower evidence as they hide files.

Sources (read by `scanner.layers.cuda_sources`; see the shared cuda_inference note for the facts behind each):
* `torch/version.py` (`cuda: Optional[str] = '12.1'`, or the old `cuda = '11.1'`; None = no CUDA);
* NVIDIA wheels: `nvidia_<comp>_cu11/12-<ver>.dist-info`, `nvidia/<comp>/lib/lib*.so.N`, and CUDA 13's
  unsuffixed wheels (files under `nvidia/cu13/`); 0.0.1 placeholders are skipped; only the runtime,
  nvrtc, cupti and nvcc wheels give major.minor, the others their CUDA major;
* `jax_cudaNN_plugin` / `jax_cudaNN_pjrt` (and old `jaxlib-*+cudaNN`), TensorFlow's `build_info.py`,
  `cupy_cudaNNx` (old `cupy_cuda102`: 10.2);
* conda: `conda-meta/*.json` `name`/`version` of cudatoolkit, cuda-cudart, cuda-version;
* toolkit trees `/usr/local/cuda-X.Y/` (and `version.json` / `version.txt` in `/usr/local/cuda*`);
* ELF files: DT_NEEDED CUDA SONAMEs and fatbin sections (`scanner.layers.cudaelf`), which also give archs.

One file never fails the layer: a parser that fails on a file (Python's parser out of memory or
recursion on a crafted `torch/version.py`, any error reading an ELF file) makes that file's
`problems` entry, the file hides what lower layers hold at its path (as any upper file does), and the
walk goes on. The GPU code of a layer is read under `scanner.layers.limits.GpuCodeWork`'s bounds,
per file and per layer; past the layer's, `gpu_code_unread` says so and the later files' fatbins are
left unread. Both reach the report as warnings (`layer_problems`).

`cuda` is the NEWEST CUDA the evidence names (the image needs the newest runtime it carries), as
precisely as the evidence for that major allows: a major.minor (a toolkit-versioned wheel's
dist-info, `torch/version.py`, a toolkit tree) wins over a major alone (a `-cu13` wheel name, a
SONAME); where nothing names the minor, the PTX ISA of a runnable file's GPU code says which toolkit
wrote it (`ptx` evidence: ISA 8.7 is CUDA 12.8). `set_by` quotes the evidence that set it; `versions` lists every source with its version.
"""

from __future__ import annotations

import posixpath
import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from scanner.layers import python_loads
from scanner.layers.code_loading import (
    DRIVER_LIBRARIES,
    Distribution,
    MissingLinks,
    annotate,
    cuda_library_file,
    distribution_from_record,
    release_of,
)
from scanner.layers.cuda_sources import (
    CONDA_META,
    CONDA_PACKAGES,
    JAX_DIR,
    NVIDIA_LIB,
    PYTORCH_BUILD,
    SONAME_IS_CUDA_MAJOR,
    TF_BUILD_INFO,
    TOOLKIT_DIR,
    TOOLKIT_VERSION_FILE,
    TORCH_VERSION,
    Finding,
    Source,
    dist_info_component,
    dist_info_finding,
    major_minor,
    needed_finding,
    parse_conda_meta,
    parse_tf_build_info,
    parse_toolkit_version,
    parse_torch_release,
    parse_torch_version,
    tf_cuda_version,
)
from scanner.layers.cudaelf import ELF_MAGIC_BYTES, ElfCudaFacts, ElfCudaProbe
from scanner.layers.cupy_nvrtc import cupy_facts
from scanner.layers.fatbin import RELOCATABLE_SECTION, ArchSummary, merge_signatures, ptx_toolkit, summarise
from scanner.layers.gpu_modules import PTX_HEAD_BYTES, ModuleError, ModuleSink, module_kind, parse_ptx_head
from scanner.layers.jax_ptxas import jax_facts
from scanner.layers.limits import DEFAULT_MAX_PATH_BYTES, AnalysisLimits, GpuCodeWork, LayerGpuCodeWork
from scanner.layers.numba_nvrtc import numba_facts
from scanner.layers.ptxas import ReleaseReader, is_nvcc, is_ptxas
from scanner.layers.python_builds import MAX_CLAUSE_SCAN_BYTES
from scanner.layers.python_headers import (
    PYVENV_BYTES,
    include_dir,
    is_python_header,
    is_venv_config,
    venv_home,
)
from scanner.layers.python_loads import (
    MAX_SOURCE_BYTES,
    PYTHON_TREES,
    LoadSites,
    dotted_module,
    extension_name,
)
from scanner.layers.tarstream import TarEntry
from scanner.layers.whiteouts import WhiteoutIndex, whiteout_target
from scanner.models import (
    ContainerArchs,
    CudaSource,
    FileArchs,
    FlashInferFacts,
    GpuArchs,
    GpuFacts,
    ImportState,
    InferredCuda,
    TorchExtensionFacts,
    TritonFacts,
    TvmFfiFacts,
)

CUDA_EVIDENCE_SCHEMA = 18  # 2: containers carry their section; 3: and whether they hold kernels;
# 4: the CUDA libraries carried, standalone module files, distributions, extension imports;
# 5: extensions loaded by path are named by globs and by the whole scope of the call (torchao 0.18);
# 6: CUDA libraries as auditwheel renames its bundled copies (`libcudart-c64a25f3.so.12.3.101`);
# 7: fatbin sections named wherever the section name table lies (lld's layout);
# 8: a distribution's top-level names inside the `nvidia/` namespace (`nvidia/dali`);
# 9: a PTX entry beside a kernel-free cubin of its arch holds no kernel (cuda-cccl);
# 10: an extension imported at module level is needed only where that module runs at import;
# 11: the modules of a package that imports them by a name made at run time run on demand;
# 12: a method defined with a load call's name (`def import_module(self, ...)`) loads nothing;
# 13: a load-by-path call's words name its own top-level package's extension modules only;
# 14: each `ptxas`'s CUDA release, and the packages that import Triton;
# 15: the links a toolkit's `ptxas` is reached by (`/usr/local/cuda -> /etc/alternatives/cuda`), and
#     the C compilers Triton looks for;
# 16: each `nvcc`'s CUDA release, the `c++` FlashInfer links with, the packages that import FlashInfer,
#     and the Python headers and virtual environments (where Triton's launcher finds `Python.h`);
# 17: the packages that build a CUDA extension with torch's `cpp_extension` when imported, and `ninja`
# 18: files named like libNVVM (what numba-cuda compiles its kernels with)
SMALL_FILE_BYTES = 64 << 10  # torch/version.py, build_info.py, version.json
CONDA_META_BYTES = 1 << 20  # conda-meta JSON lists every file; name/version may come after
ELF_MIN_BYTES = ELF_MAGIC_BYTES
MAX_FINDINGS_PER_LAYER = 4096
MAX_SHADOWS_PER_LAYER = 100_000
MAX_ARCH_FILES = 512
MAX_VERSION_SOURCES = 64  # pieces of versioned evidence listed per image
# Lines of evidence listed per image, then how many more: a CUDA toolkit's tree gives a few hundred,
# and 256 layers of 4,096 findings each would otherwise make a report of a million lines.
MAX_EVIDENCE_LINES = 2000
MAX_LIBRARIES_PER_LAYER = 4096  # CUDA library files and links a layer may name (a full toolkit: ~700)
MAX_MODULE_DIRS_PER_LAYER = 1024  # directories of module files (flashinfer-cubin: 12)
MAX_DISTRIBUTIONS_PER_LAYER = 4096
MAX_PTXAS_PER_LAYER = 64  # files named `ptxas` read for their release (a toolkit and triton: 3)
MAX_TOOLKIT_LINKS_PER_LAYER = 64  # links a toolkit's `ptxas` may be reached by (NVIDIA's images: 3)
MAX_NVCC_PER_LAYER = 64  # files named `nvcc` read for their release (a toolkit: 1)
MAX_PYTHON_HEADERS_PER_LAYER = 64  # files named `Python.h` (one per interpreter with its headers)
MAX_VENVS_PER_LAYER = 64  # virtual environments' `pyvenv.cfg` read for their base interpreter
MAX_C_COMPILERS_PER_LAYER = 64  # files and links named `gcc`, `clang` or `c++` (Debian's g++: 2)
MAX_NINJA_PER_LAYER = 64  # files and links named `ninja` (PyPI's ninja: 2, Debian's ninja-build: 1)
MAX_NVVM_PER_LAYER = 64  # files and links named like libNVVM (a toolkit: 3, NVIDIA's nvcc wheel: 1)
_NVVM = re.compile(r"^libnvvm\.so(?:\.\d{1,6}){0,3}$")
# What Triton's `_find_compiler` (`runtime/build.py`, 3.0 to 3.9) looks for on PATH: `gcc`, else `clang`.
C_COMPILERS = ("gcc", "clang")
# What FlashInfer links its kernels with where `$CXX` is unset (`jit/cpp_ext.py`, 0.2.6 to 0.7.4).
CXX_COMPILER = "c++"
# What torch's `cpp_extension` runs to build an extension (`verify_ninja_availability`: `ninja` on PATH).
NINJA = "ninja"
# Triton's driver module as its cache keeps it once built (`~/.triton/cache/<hash>/cuda_utils.*.so`): from
# 3.7 on the only thing Triton builds with a C compiler (3.0 to 3.6 also build a launcher per kernel).
_TRITON_UTILS = re.compile(r"^cuda_utils\.[^/]*\.so$")
PREBUILT_UTILS_FROM = (3, 7)
MAX_LINK_HOPS = 8  # links followed from a path to a `ptxas` (NVIDIA's images: 2)
MAX_PTXAS_ALIASES = 256  # paths reaching a carried `ptxas` through links, per image
MAX_ALIAS_STEPS = 20_000  # directories looked up for a link while following them, per image (NVIDIA's: ~20)
# A link a toolkit is reached by: `/usr/local/cuda -> /etc/alternatives/cuda -> /usr/local/cuda-12.8`
# (update-alternatives, as NVIDIA's CUDA images install the toolkit), `/usr/local/cuda-12`, or a
# link to a `ptxas` or an `nvcc` itself.
_TOOLKIT_LINK = re.compile(r"^(?:cuda(?:-\d+(?:\.\d+)?)?|ptxas(?:-blackwell)?|nvcc)$")
_TOOLKIT_ROOT = re.compile(r"^cuda(?:-\d+(?:\.\d+)?)?$")
# Where a directory named `cuda` is a package's or a header tree's, never a toolkit's root: torch's
# `torch/cuda`, `ATen/cuda` and a dozen more, FlashInfer's CCCL headers, a toolkit's own `include/cuda`.
_NO_TOOLKIT_HERE = re.compile(r"/(?:site|dist)-packages/|/include/")
RECORD_BYTES = 1 << 20  # a dist-info RECORD's head: the top-level names come early
_RECORD = re.compile(r"/[^/]+\.dist-info/RECORD$")
MAX_PROBLEMS_SHOWN = 16  # files that could not be read, listed per image (then a count)
MAX_PROBLEM_CHARS = 300

# Frameworks first: they name what a user installed; libraries and ELF files follow from them.
SOURCE_ORDER: tuple[Source, ...] = (
    "torch",
    "tensorflow",
    "jax",
    "cupy",
    "conda",
    "nvidia-wheel",
    "toolkit",
    "elf",
    "ptx",  # the toolkit that wrote a file's PTX: sets the version only where nothing else names the minor
)


class ModuleDir(BaseModel):
    """The standalone module files of one directory: how many, their distinct contents, their errors."""

    files: int = 0
    containers: list[ContainerArchs] = Field(default_factory=list)
    errors: int = 0
    error: str | None = Field(default=None, description="the first file's error, with its name")


class CudaLayerEvidence(BaseModel):
    """What one layer says about CUDA; cacheable by layer digest."""

    schema_version: int = CUDA_EVIDENCE_SCHEMA
    complete: bool = False
    findings: dict[str, Finding] = Field(default_factory=dict)
    elves: dict[str, ElfCudaFacts] = Field(default_factory=dict)
    shadows: list[str] = Field(
        default_factory=list, description="relevant files with nothing to say: they hide lower evidence"
    )
    whiteouts: list[str] = Field(default_factory=list)
    opaque_dirs: list[str] = Field(default_factory=list)
    libraries: list[str] = Field(
        default_factory=list, description="files and links named like CUDA libraries (others link them)"
    )
    modules: dict[str, ModuleDir] = Field(
        default_factory=dict, description="standalone module files (.cubin, .fatbin, .ptx) by directory"
    )
    distributions: dict[str, Distribution] = Field(
        default_factory=dict, description="Python distributions by their dist-info directory"
    )
    extensions: dict[str, ImportState] = Field(
        default_factory=dict, description="how the layer's Python loads its GPU-code extension modules"
    )
    ptxas: dict[str, str] = Field(
        default_factory=dict,
        description='files named `ptxas` -> the CUDA release their banner names ("12.8"; "": none found)',
    )
    nvcc: dict[str, str] = Field(
        default_factory=dict,
        description='files named `nvcc` -> the CUDA release their banner names ("12.8"; "": none found)',
    )
    triton_users: list[str] = Field(
        default_factory=list, description="top-level Python packages whose sources import `triton`"
    )
    flashinfer_users: list[str] = Field(
        default_factory=list, description="top-level Python packages whose sources import `flashinfer`"
    )
    tvm_ffi_users: list[str] = Field(
        default_factory=list,
        description="top-level Python packages whose sources import `tvm_ffi.cpp` (its `load_inline`, which"
        " builds with nvcc; vLLM's CuTe DSL kernels import `tvm_ffi` alone)",
    )
    c_compilers: list[str] = Field(
        default_factory=list,
        description="files and links named `gcc` or `clang` (the C compilers Triton looks for) or `c++` (the"
        " C++ compiler FlashInfer links with)",
    )
    ninja: list[str] = Field(
        default_factory=list,
        description="files and links named `ninja` (what torch's `cpp_extension` builds extensions with)",
    )
    nvvm: list[str] = Field(
        default_factory=list,
        description="files and links named like libNVVM (`libnvvm.so.4`: what numba-cuda compiles kernels with)",
    )
    torch_builds: dict[str, list[str]] = Field(
        default_factory=dict,
        description="top-level Python packages that build a CUDA extension with torch's `cpp_extension` when"
        " they are imported -> the modules the building file imports (the built extension among them spares"
        " the build: `scanner.layers.python_builds`)",
    )
    triton_utils: list[str] = Field(
        default_factory=list,
        description="built copies of Triton's driver module (`cuda_utils.*.so`, as its cache keeps them)",
    )
    python_headers: list[str] = Field(
        default_factory=list, description="files named `Python.h`: an interpreter's C headers"
    )
    venv_homes: dict[str, str] = Field(
        default_factory=dict,
        description="virtual environments (the directory of their `pyvenv.cfg`) -> the base interpreter's"
        ' directory their `home` names ("" where it names none)',
    )
    toolkit_links: dict[str, str] = Field(
        default_factory=dict,
        description="links named like a toolkit's root, a `ptxas` or an `nvcc` (`/usr/local/cuda`) -> their targets as"
        ' the link holds them; a directory so named -> "" (it replaces a lower layer\'s link there)',
    )
    bounds_reached: list[str] = Field(
        default_factory=list,
        description="the per-layer bounds hit, by name (`MAX_FINDINGS_PER_LAYER`, ...): evidence past each was dropped",
    )
    problems: dict[str, str] = Field(
        default_factory=dict, description="files whose evidence could not be read, and why (path -> problem)"
    )
    gpu_code_unread: str | None = Field(
        default=None,
        description="the per-layer bound on reading GPU code, when this layer crossed it: the fatbins of"
        " the files after that point were not read",
    )

    @property
    def truncated(self) -> bool:
        """A per-layer bound was hit; some evidence was dropped."""
        return bool(self.bounds_reached)


# -- one layer


@dataclass
class CudaLayerCollector:
    """Builds one layer's CUDA evidence from its tar entries.

    For each entry: `wants(entry)` says how many leading bytes to hand to `add(entry, head)`;
    `sink(entry)` returns what to stream the whole file into (an ELF probe, or a module file's
    reader), which records what it found when closed.
    """

    evidence: CudaLayerEvidence = field(default_factory=CudaLayerEvidence)
    limits: AnalysisLimits = field(default_factory=AnalysisLimits)
    _dirs_seen: set[str] = field(default_factory=set)
    _loads: LoadSites = field(default_factory=LoadSites)
    _work: LayerGpuCodeWork | None = None

    @property
    def work(self) -> LayerGpuCodeWork:
        """The layer's GPU-code work so far (`max_layer_gpu_code_steps`)."""
        if self._work is None:
            self._work = LayerGpuCodeWork(self.limits.max_layer_gpu_code_steps)
        return self._work

    def wants(self, entry: TarEntry) -> int:
        if entry.kind != "file":
            return 0
        path = entry.path
        if TORCH_VERSION.search(path) or TF_BUILD_INFO.search(path) or TOOLKIT_VERSION_FILE.match(path):
            return SMALL_FILE_BYTES
        conda = CONDA_META.search(path)
        if conda and conda.group(1) in CONDA_PACKAGES:
            return CONDA_META_BYTES
        if path.endswith(".py") and PYTHON_TREES.search(path):
            return MAX_SOURCE_BYTES
        if _RECORD.search(path):
            return RECORD_BYTES
        if module_kind(path) == "ptx":
            return PTX_HEAD_BYTES
        if is_venv_config(path):
            return PYVENV_BYTES
        return 0

    def sink(self, entry: TarEntry) -> _ElfSink | _ModuleSink | _ReleaseSink | None:
        """What reads the whole file: a module file's reader (`.cubin`, `.fatbin`), the release banner's
        reader for a `ptxas` or an `nvcc`, else an ELF probe for any regular file that may be ELF (it
        gives up after its first bytes)."""
        if entry.kind != "file" or self.wants(entry):
            return None
        if is_ptxas(entry.path):
            return self._release_sink(
                self.evidence.ptxas, entry.path, MAX_PTXAS_PER_LAYER, "MAX_PTXAS_PER_LAYER"
            )
        if is_nvcc(entry.path):
            return self._release_sink(
                self.evidence.nvcc, entry.path, MAX_NVCC_PER_LAYER, "MAX_NVCC_PER_LAYER"
            )
        kind = module_kind(entry.path)
        if kind in ("cubin", "fatbin"):
            return _ModuleSink(
                self, entry.path, ModuleSink(kind, entry.size, GpuCodeWork(self.limits, self.work))
            )
        if entry.size < ELF_MIN_BYTES:
            return None
        return _ElfSink(self, entry, ElfCudaProbe(entry.size, GpuCodeWork(self.limits, self.work)))

    def unreadable(self, path: str, exc: BaseException) -> None:
        """A parser failed on the file at `path`: that is the file's finding, and the walk goes on. The
        file hides lower layers' evidence at its path, as any file there would."""
        detail = str(exc).strip()
        problem = f"not read: {type(exc).__name__}" + (f": {detail}" if detail else "")
        if len(self.evidence.problems) >= MAX_FINDINGS_PER_LAYER:
            self._bound_reached("MAX_FINDINGS_PER_LAYER")
        else:
            self.evidence.problems[path] = problem[:MAX_PROBLEM_CHARS]
        self.evidence.findings.pop(path, None)
        self.evidence.elves.pop(path, None)
        self._shadow(path)

    def _release_sink(self, found: dict[str, str], path: str, bound: int, name: str) -> _ReleaseSink | None:
        """The reader of a CUDA tool's release banner, recording into `found`, within its bound."""
        if len(found) >= bound:
            self._bound_reached(name)
            return None
        found[path] = ""
        return _ReleaseSink(found, path)

    def _keep_name(
        self,
        kept: list[str],
        path: str,
        bound: int = MAX_C_COMPILERS_PER_LAYER,
        name: str = "MAX_C_COMPILERS_PER_LAYER",
    ) -> None:
        """`path` kept in `kept` (a C compiler's, Triton's built module, a Python header), up to `bound`."""
        if len(kept) >= bound:
            self._bound_reached(name)
        else:
            kept.append(path)

    def _bound_reached(self, bound: str) -> None:
        """A per-layer bound was hit: evidence past it is dropped, and the report will say which."""
        if bound not in self.evidence.bounds_reached:
            self.evidence.bounds_reached.append(bound)

    def _finding(self, path: str, finding: Finding) -> None:
        if len(self.evidence.findings) >= MAX_FINDINGS_PER_LAYER:
            self._bound_reached("MAX_FINDINGS_PER_LAYER")
            return
        self.evidence.findings[path] = finding

    def _shadow(self, path: str) -> None:
        if len(self.evidence.shadows) >= MAX_SHADOWS_PER_LAYER:
            self._bound_reached("MAX_SHADOWS_PER_LAYER")
            return
        self.evidence.shadows.append(path)

    def add(self, entry: TarEntry, head: bytes = b"") -> None:
        path = entry.path
        directory, name = posixpath.split(path)
        hidden = whiteout_target(directory, name)
        if hidden is not None:
            kind, target = hidden
            (self.evidence.opaque_dirs if kind == "opaque" else self.evidence.whiteouts).append(target)
            return
        try:
            self._add_path_evidence(path, entry)
            if entry.kind in ("file", "symlink", "hardlink") and cuda_library_file(path):
                if len(self.evidence.libraries) < MAX_LIBRARIES_PER_LAYER:
                    self.evidence.libraries.append(path)
                else:
                    self._bound_reached("MAX_LIBRARIES_PER_LAYER")
            if entry.kind == "file" and head:
                self._add_content(path, head)
        except Exception as exc:  # one file's parser failing is that file's finding, never the layer's
            self.unreadable(path, exc)

    def _add_content(self, path: str, head: bytes) -> None:
        """Evidence from the head of a file (`wants`): its parser by path."""
        if path.endswith(".py"):
            self._loads.add_source(path, head)
        if _RECORD.search(path):
            self._add_distribution(path, head)
            return
        if module_kind(path) == "ptx":
            try:
                self.add_module(path, [parse_ptx_head(head)], None)
            except ModuleError as exc:
                self.add_module(path, [], str(exc))
            return
        text = head.decode("utf-8", "replace")
        if is_venv_config(path):
            if len(self.evidence.venv_homes) >= MAX_VENVS_PER_LAYER:
                self._bound_reached("MAX_VENVS_PER_LAYER")
            else:
                self.evidence.venv_homes[posixpath.dirname(path)] = venv_home(text)
            return
        if TORCH_VERSION.search(path):
            cuda = parse_torch_version(text)
            if cuda is False:
                self._shadow(path)
            elif cuda is None:
                self._finding(
                    path,
                    Finding(source="torch", detail="cuda = None (a CPU, ROCm or XPU build)", no_cuda=True),
                )
            else:
                release = parse_torch_release(text)
                detail = f"torch {release}, cuda = '{cuda}'" if release else f"cuda = '{cuda}'"
                self._finding(path, Finding(source="torch", cuda=cuda, detail=detail))
        elif TF_BUILD_INFO.search(path):
            self._add_tf(path, text)
        elif (match := TOOLKIT_VERSION_FILE.match(path)) is not None:
            version = parse_toolkit_version(match.group(1), text)
            if version:
                self._finding(path, Finding(source="toolkit", cuda=version, detail=f"CUDA toolkit {version}"))
            else:
                self._shadow(path)
        elif (conda := CONDA_META.search(path)) is not None:
            self._add_conda(path, text, conda)

    def _add_tf(self, path: str, text: str) -> None:
        info = parse_tf_build_info(text)
        if info is None:
            self._shadow(path)
            return
        if info.get("is_cuda_build") is False or "cuda_version" not in info:
            self._finding(path, Finding(source="tensorflow", detail="is_cuda_build False", no_cuda=True))
            return
        cuda = tf_cuda_version(str(info["cuda_version"]))
        capabilities = info.get("cuda_compute_capabilities")
        detail = f"cuda_version '{info['cuda_version']}'"
        if isinstance(capabilities, list) and capabilities:
            detail += f", compute capabilities {', '.join(str(c) for c in capabilities[:16])}"
        self._finding(path, Finding(source="tensorflow", cuda=cuda, detail=detail))

    def _add_conda(self, path: str, text: str, match: re.Match[str]) -> None:
        parsed = parse_conda_meta(text)
        if parsed is None:  # the JSON was longer than what was read: its file name says the same
            parsed = (match.group(1), match.group(2))
        name, version = parsed
        if name not in CONDA_PACKAGES:
            self._shadow(path)
            return
        if name == "pytorch":
            build = match.group(3)
            found = PYTORCH_BUILD.search(build)
            if found is None:
                self._finding(
                    path, Finding(source="conda", detail=f"pytorch {version} {build}", no_cuda=True)
                )
            else:
                cuda = f"{found.group(1)}.{found.group(2)}"
                self._finding(path, Finding(source="conda", cuda=cuda, detail=f"pytorch {version} {build}"))
            return
        self._finding(path, Finding(source="conda", cuda=major_minor(version), detail=f"{name} {version}"))

    def _add_path_evidence(self, path: str, entry: TarEntry) -> None:
        """Evidence from names alone: dist-info, nvidia/<comp>/lib, jax plugin dirs, toolkit trees and
        the links that reach them."""
        name = posixpath.basename(path)
        if entry.kind in ("file", "symlink", "hardlink") and (name in C_COMPILERS or name == CXX_COMPILER):
            self._keep_name(self.evidence.c_compilers, path)
        if entry.kind in ("file", "symlink", "hardlink") and name == NINJA:
            self._keep_name(self.evidence.ninja, path, MAX_NINJA_PER_LAYER, "MAX_NINJA_PER_LAYER")
        if entry.kind in ("file", "symlink", "hardlink") and _NVVM.match(name):
            self._keep_name(self.evidence.nvvm, path, MAX_NVVM_PER_LAYER, "MAX_NVVM_PER_LAYER")
        if entry.kind == "file" and _TRITON_UTILS.match(name):
            self._keep_name(self.evidence.triton_utils, path)
        if entry.kind in ("file", "symlink", "hardlink") and is_python_header(path):
            self._keep_name(
                self.evidence.python_headers,
                path,
                MAX_PYTHON_HEADERS_PER_LAYER,
                "MAX_PYTHON_HEADERS_PER_LAYER",
            )
        if (
            entry.kind == "symlink" or (entry.kind == "dir" and not _NO_TOOLKIT_HERE.search(path))
        ) and _TOOLKIT_LINK.match(name):
            if len(self.evidence.toolkit_links) >= MAX_TOOLKIT_LINKS_PER_LAYER:
                self._bound_reached("MAX_TOOLKIT_LINKS_PER_LAYER")
            else:  # a directory ("") replaces a lower layer's link there
                self.evidence.toolkit_links[path] = entry.linkname if entry.kind == "symlink" else ""
        dist = dist_info_component(path)
        if dist is not None and dist[0] not in self._dirs_seen:
            self._dirs_seen.add(dist[0])
            finding = dist_info_finding(dist[1])
            if finding is not None:
                self._finding(dist[0], finding)
        toolkit = TOOLKIT_DIR.match(path)
        if toolkit is not None:
            root = f"/usr/local/cuda-{toolkit.group(1)}.{toolkit.group(2)}"
            if root not in self._dirs_seen:
                self._dirs_seen.add(root)
                version = f"{int(toolkit.group(1))}.{int(toolkit.group(2))}"
                self._finding(
                    root, Finding(source="toolkit", cuda=version, detail=f"CUDA toolkit tree {version}")
                )
        parts = path.split("/")
        for index, part in enumerate(parts[:-1] if entry.kind != "dir" else parts):
            jax = JAX_DIR.match(part)
            if jax is not None:
                root = "/".join(parts[: index + 1])
                if root not in self._dirs_seen:
                    self._dirs_seen.add(root)
                    self._finding(
                        root, Finding(source="jax", cuda=jax.group(1) or jax.group(2), detail=f"{part}")
                    )
                break
            if part == "nvidia" and index + 2 < len(parts) and parts[index + 1] == "cu13":
                root = "/".join(parts[: index + 2])
                if root not in self._dirs_seen:
                    self._dirs_seen.add(root)
                    self._finding(
                        root, Finding(source="nvidia-wheel", cuda="13", detail="CUDA 13 wheel files")
                    )
                break
        lib = NVIDIA_LIB.search(path)
        if lib is not None and lib.group(2) in SONAME_IS_CUDA_MAJOR and entry.kind in ("file", "symlink"):
            root = path[: lib.start()] + f"/nvidia/{lib.group(1)}/lib"
            if root not in self._dirs_seen:
                self._dirs_seen.add(root)
                detail = f"lib{lib.group(2)}.so.{lib.group(3)}"
                self._finding(root, Finding(source="nvidia-wheel", cuda=lib.group(3), detail=detail))

    def _add_distribution(self, path: str, record: bytes) -> None:
        distribution = distribution_from_record(posixpath.dirname(path), record)
        if distribution is None:
            return
        if len(self.evidence.distributions) >= MAX_DISTRIBUTIONS_PER_LAYER:
            self._bound_reached("MAX_DISTRIBUTIONS_PER_LAYER")
            return
        self.evidence.distributions[posixpath.dirname(path)] = distribution

    def add_module(self, path: str, containers: list[ContainerArchs], error: str | None) -> None:
        """Record one standalone module file in its directory's summary."""
        directory = posixpath.dirname(path)
        found = self.evidence.modules.get(directory)
        if found is None:
            if len(self.evidence.modules) >= MAX_MODULE_DIRS_PER_LAYER:
                self._bound_reached("MAX_MODULE_DIRS_PER_LAYER")
                return
            found = self.evidence.modules[directory] = ModuleDir()
        found.files += 1
        if error is not None:
            found.errors += 1
            found.error = found.error or f"{posixpath.basename(path)}: {error}"
            return
        found.containers = merge_signatures([*found.containers, *containers])

    def add_elf(self, entry: TarEntry, facts: ElfCudaFacts | None) -> None:
        """Record what the probe of one file found (None: not ELF)."""
        if facts is None:
            return
        if not facts.relevant:
            self._shadow(entry.path)
            return
        if len(self.evidence.elves) >= MAX_FINDINGS_PER_LAYER:
            self._bound_reached("MAX_FINDINGS_PER_LAYER")
            return
        self.evidence.elves[entry.path] = facts

    def finish(self, complete: bool) -> CudaLayerEvidence:
        """The layer's evidence: with how its Python loads each extension module that holds GPU code
        (the sources and the modules of one layer are read together, in any order)."""
        self.evidence.complete = complete
        for path, facts in self.evidence.elves.items():
            if facts.fatbin is not None and extension_name(path) is not None:
                state = self._loads.state(path)
                if state is not None:
                    self.evidence.extensions[path] = state
        self.evidence.triton_users = self._loads.importers_of("triton")
        self.evidence.flashinfer_users = self._loads.importers_of("flashinfer")
        self.evidence.tvm_ffi_users = self._loads.importers_of("tvm_ffi.cpp")
        self.evidence.torch_builds = self._loads.torch_builders()
        if self._loads.truncated_by is not None:
            self._bound_reached(self._loads.truncated_by)
        if self._work is not None and self._work.exceeded is not None:
            self.evidence.gpu_code_unread = str(self._work.exceeded)
        return self.evidence


class _ElfSink:
    """Streams one file into an `ElfCudaProbe`; records the outcome in the layer's collector. A probe
    that fails is that file's finding (`CudaLayerCollector.unreadable`), never the walk's error."""

    __slots__ = ("_collector", "_entry", "_probe")

    def __init__(self, collector: CudaLayerCollector, entry: TarEntry, probe: ElfCudaProbe) -> None:
        self._collector = collector
        self._entry = entry
        self._probe: ElfCudaProbe | None = probe

    def feed(self, data: bytes | memoryview) -> bool:
        if self._probe is None:
            return False
        try:
            return self._probe.feed(data)
        except Exception as exc:
            self._fail(exc)
            return False

    def close(self, complete: bool) -> None:
        probe = self._probe
        if probe is None or not probe.is_elf:
            return
        try:
            facts = probe.finish()
        except Exception as exc:
            self._fail(exc)
            return
        self._collector.add_elf(self._entry, facts)

    def _fail(self, exc: Exception) -> None:
        self._probe = None
        self._collector.unreadable(self._entry.path, exc)


class _ModuleSink:
    """Streams one standalone module file into its reader; records it in the layer's collector. A
    reader that fails is that file's finding, never the walk's error."""

    __slots__ = ("_collector", "_path", "_reader")

    def __init__(self, collector: CudaLayerCollector, path: str, reader: ModuleSink) -> None:
        self._collector = collector
        self._path = path
        self._reader: ModuleSink | None = reader

    def feed(self, data: memoryview) -> bool:
        if self._reader is None:
            return False
        try:
            return self._reader.feed(data)
        except Exception as exc:
            self._fail(exc)
            return False

    def close(self, complete: bool) -> None:
        reader = self._reader
        if reader is None:
            return
        try:
            reader.close(complete)
        except Exception as exc:
            self._fail(exc)
            return
        self._collector.add_module(self._path, reader.containers, reader.error)

    def _fail(self, exc: Exception) -> None:
        self._reader = None
        self._collector.add_module(self._path, [], f"not read: {type(exc).__name__}")


class _ReleaseSink:
    """Streams one `ptxas` or `nvcc` into a `ReleaseReader`; records the release it names, if any."""

    __slots__ = ("_found", "_path", "_reader")

    def __init__(self, found: dict[str, str], path: str) -> None:
        self._found = found
        self._path = path
        self._reader = ReleaseReader()

    def feed(self, data: memoryview) -> bool:
        return self._reader.feed(data)

    def close(self, complete: bool) -> None:
        self._found[self._path] = self._reader.release or ""


class CudaEntryCollector:
    """The CUDA analysis as a streaming `EntryCollector` of the layer walk. Never satisfied early:
    evidence can sit in any entry of any layer, so a walk with it attached reads the layer whole."""

    def __init__(self, limits: AnalysisLimits | None = None) -> None:
        self.layer = CudaLayerCollector(limits=limits or AnalysisLimits())
        self.position = 0  # compressed bytes read so far, kept current by the walk

    def wants(self, entry: TarEntry) -> int:
        return self.layer.wants(entry)

    def add(self, entry: TarEntry, head: bytes) -> None:
        want = self.layer.wants(entry)
        self.layer.add(entry, head[:want] if want else b"")

    @property
    def satisfied(self) -> bool:
        return False

    @property
    def gpu_code_exceeded(self) -> bool:
        """Whether the layer's GPU code crossed `max_layer_gpu_code_steps` so far."""
        return self.layer.work.exceeded is not None

    def finish(self, complete: bool) -> CudaLayerEvidence:
        return self.layer.finish(complete)

    def stream(self, entry: TarEntry) -> _ElfSink | _ModuleSink | _ReleaseSink | None:
        return self.layer.sink(entry)


def collect_layer(
    entries: Iterable[tuple[TarEntry, bytes]], limits: AnalysisLimits | None = None
) -> CudaLayerEvidence:
    """One layer's evidence from whole entries in memory (tests, small layers)."""
    collector = CudaLayerCollector(limits=limits or AnalysisLimits())
    for entry, content in entries:
        want = collector.wants(entry)
        collector.add(entry, content[:want] if want else b"")
        sink = collector.sink(entry)
        if sink is not None:
            complete = True
            for start in range(0, len(content), 1 << 20):
                if not sink.feed(memoryview(content)[start : start + (1 << 20)]):
                    complete = start + (1 << 20) >= len(content)
                    break
            sink.close(complete)
    return collector.finish(complete=True)


# -- the merged view


def _version_key(version: str) -> tuple[int, int]:
    major, _, minor = version.partition(".")
    return int(major), int(minor) if minor else -1


def choose_cuda(versions: Iterable[str]) -> tuple[str | None, bool]:
    """The newest major, as precisely as its evidence allows (the newest major.minor of that major,
    else the major alone); `conflict` when sources name different versions."""
    found = sorted(set(versions), key=_version_key)
    if not found:
        return None, False
    newest_major = found[-1].split(".")[0]
    precise = [v for v in found if v.split(".")[0] == newest_major and "." in v]
    conflict = len({v.split(".")[0] for v in found}) > 1 or len({v for v in found if "." in v}) > 1
    return (precise[-1] if precise else newest_major), conflict


@dataclass
class _Merged:
    """The evidence the layers leave visible, top layer first (an upper layer's file wins; whiteouts
    and opaque directories hide what lies below them)."""

    findings: list[tuple[str, Finding]] = field(default_factory=list)
    elves: list[tuple[str, ElfCudaFacts]] = field(default_factory=list)
    carried: set[str] = field(default_factory=set)  # names of the CUDA libraries the image carries
    library_paths: set[str] = field(default_factory=set)  # and where
    modules: dict[str, ModuleDir] = field(default_factory=dict)
    distributions: dict[str, Distribution] = field(default_factory=dict)
    extensions: dict[str, ImportState] = field(default_factory=dict)
    ptxas: dict[str, str] = field(default_factory=dict)
    nvcc: dict[str, str] = field(default_factory=dict)
    triton_users: set[str] = field(default_factory=set)
    flashinfer_users: set[str] = field(default_factory=set)
    tvm_ffi_users: set[str] = field(default_factory=set)
    toolkit_links: dict[str, str] = field(default_factory=dict)
    c_compilers: set[str] = field(default_factory=set)
    ninja: set[str] = field(default_factory=set)
    nvvm: set[str] = field(default_factory=set)
    torch_builds: dict[str, set[str]] = field(default_factory=dict)
    triton_utils: set[str] = field(default_factory=set)
    python_headers: set[str] = field(default_factory=set)
    venv_homes: dict[str, str] = field(default_factory=dict)


def _merge(layers_top_down: Sequence[CudaLayerEvidence]) -> _Merged:
    merged = _Merged()
    hides = WhiteoutIndex()  # whiteouts and opaque dirs of the layers above
    occupied: set[str] = set()  # paths an upper layer has evidence at: the upper one wins
    for index, layer in enumerate(layers_top_down):

        def visible(path: str, index: int = index) -> bool:
            return path not in occupied and not hides.hidden_above(path, index)

        merged.findings += [(p, f) for p, f in layer.findings.items() if visible(p)]
        merged.elves += [(p, e) for p, e in layer.elves.items() if visible(p)]
        libraries = [p for p in layer.libraries if not hides.hidden_above(p, index)]
        merged.carried.update(posixpath.basename(p) for p in libraries)
        merged.library_paths.update(libraries)
        for directory, found in layer.modules.items():
            if directory not in merged.modules and not hides.hidden_above(directory + "/", index):
                merged.modules[directory] = found
        for dist_info, distribution in layer.distributions.items():
            if not hides.hidden_above(dist_info, index):
                merged.distributions.setdefault(dist_info, distribution)
        for path, state in layer.extensions.items():
            merged.extensions.setdefault(path, state)
        merged.ptxas.update((p, r) for p, r in layer.ptxas.items() if visible(p))
        merged.nvcc.update((p, r) for p, r in layer.nvcc.items() if visible(p))
        merged.toolkit_links.update((p, t) for p, t in layer.toolkit_links.items() if visible(p))
        merged.c_compilers.update(p for p in layer.c_compilers if not hides.hidden_above(p, index))
        merged.ninja.update(p for p in layer.ninja if not hides.hidden_above(p, index))
        merged.nvvm.update(p for p in layer.nvvm if not hides.hidden_above(p, index))
        for top, imports in layer.torch_builds.items():
            merged.torch_builds.setdefault(top, set()).update(imports)
        merged.triton_utils.update(p for p in layer.triton_utils if not hides.hidden_above(p, index))
        merged.python_headers.update(p for p in layer.python_headers if not hides.hidden_above(p, index))
        for root, home in layer.venv_homes.items():
            if not hides.hidden_above(posixpath.join(root, "pyvenv.cfg"), index):
                merged.venv_homes.setdefault(root, home)
        merged.triton_users.update(layer.triton_users)
        merged.flashinfer_users.update(layer.flashinfer_users)
        merged.tvm_ffi_users.update(layer.tvm_ffi_users)
        occupied.update(
            layer.findings.keys(),
            layer.elves.keys(),
            layer.shadows,
            layer.ptxas.keys(),
            layer.nvcc.keys(),
            layer.toolkit_links.keys(),
        )
        for path in layer.whiteouts:
            hides.delete(index, path)
        for path in layer.opaque_dirs:
            hides.cover(index, path)
    return merged


def runtime_cuda(findings: Sequence[tuple[str, Finding]], carried: set[str]) -> str | None:
    """The CUDA runtime the image uses, which picks among builds of a library for several CUDA
    versions: torch's `torch.version.cuda`, else the CUDA runtime wheel's or the toolkit's version,
    else the major of the `libcudart.so.N` it carries."""
    for source, runtime in (("torch", True), ("nvidia-wheel", True), ("conda", True), ("toolkit", False)):
        versions = [
            f.cuda
            for _, f in findings
            if f.source == source and f.cuda and not f.no_cuda and (not runtime or _is_runtime(f))
        ]
        if versions:
            return max(versions, key=_version_key)
    majors = [name.split(".so.")[1].split(".")[0] for name in carried if name.startswith("libcudart.so.")]
    return max(majors, key=_version_key) if majors else None


def _is_runtime(finding: Finding) -> bool:
    """Torch's own version, or a finding of the CUDA runtime package (wheel or conda)."""
    detail = finding.detail.replace("-", "_")
    return (
        finding.source == "torch"
        or "cuda_runtime" in detail
        or "cuda_cudart" in detail
        or "cudatoolkit" in detail
    )


def combine(
    layers_top_down: Sequence[CudaLayerEvidence],
    layers_total: int | None = None,
    overrides: Mapping[str, str] | None = None,
) -> tuple[InferredCuda | None, GpuArchs | None]:
    """Merge per-layer evidence (top layer first) into the image's inferred CUDA and GPU code. Only code
    the image can load speaks: a library whose CUDA libraries the image does not carry, or a build
    its package does not select, names no CUDA version (`scanner.layers.code_loading`). `overrides`:
    the builds the config's variables make packages load (`scanner.facts.gpu.build_overrides`)."""
    merged = _merge(layers_top_down)
    findings = list(merged.findings)
    runtime = runtime_cuda(findings, merged.carried)
    missing = MissingLinks(merged.carried, _links(merged))
    archs = image_archs(merged, runtime, missing, overrides)
    dead = {f.path for f in archs.files if not f.loadable} if archs is not None else set()
    ptx: list[tuple[str, Finding]] = []  # what wrote the PTX: a version only where nothing else names one
    for path, facts in merged.elves:
        if path in dead or missing.of(facts.needed):
            continue
        if facts.needed:
            findings.append((path, needed_finding(facts.needed)))
        elif facts.fatbin is not None:
            findings.append(
                (path, Finding(source="elf", detail=f"GPU code in {', '.join(facts.fatbin.sections)}"))
            )
    for file in archs.files if archs is not None else ():
        if not file.loadable or file.error is not None or any("relocatable" in s for s in file.sections):
            continue
        isas = [c.ptx_isa for c in file.containers if c.ptx_isa and c.section != RELOCATABLE_SECTION]
        isa = max(isas, key=_version_key) if isas else None
        toolkit = ptx_toolkit(isa)
        if toolkit is not None:
            ptx.append(
                (
                    file.path,
                    Finding(source="ptx", cuda=toolkit, detail=f"PTX ISA {isa}, written by CUDA {toolkit}"),
                )
            )
        elif file.kind == "modules":
            findings.append(
                (file.path, Finding(source="elf", detail=f"GPU code in {file.files} module files"))
            )
    positive = [(p, f) for p, f in findings if not f.no_cuda]
    complete = all(layer.complete for layer in layers_top_down) and (
        layers_total is None or len(layers_top_down) >= layers_total
    )
    if not positive and not ptx:
        return None, None
    cuda, conflict = choose_cuda(f.cuda for _, f in positive if f.cuda)
    ptx_decides = cuda is None
    if ptx_decides:  # nothing else names a version: what wrote the PTX does
        positive += ptx
        cuda, conflict = choose_cuda(f.cuda for _, f in positive if f.cuda)
    elif (
        cuda is not None and "." not in cuda
    ):  # only the major is named: the PTX of that major is more precise
        same_major = [f.cuda for _, f in ptx if f.cuda and f.cuda.split(".")[0] == cuda]
        if same_major:
            cuda = max(same_major, key=_version_key)
    ordered = sorted(findings, key=lambda item: (item[1].no_cuda, item[1].source != "torch", item[0]))
    named = sorted(
        ((p, f) for p, f in (positive if ptx_decides else [*positive, *ptx]) if f.cuda),
        key=lambda item: (
            tuple(-part for part in _version_key(item[1].cuda or "0")),
            SOURCE_ORDER.index(item[1].source),
            item[0],
        ),
    )
    setter = next(((p, f) for p, f in named if f.cuda == cuda), None)
    inferred = InferredCuda(
        cuda=cuda,
        set_by=f"{setter[0]}: {setter[1].detail}" if setter else None,
        versions=[
            CudaSource(source=f.source, cuda=f.cuda, evidence=f"{p}: {f.detail}")
            for p, f in named[:MAX_VERSION_SOURCES]
            if f.cuda
        ],
        evidence=[f"{path}: {finding.detail}" for path, finding in ordered[:MAX_EVIDENCE_LINES]]
        + (
            [f"... and {len(ordered) - MAX_EVIDENCE_LINES:,} more"]
            if len(ordered) > MAX_EVIDENCE_LINES
            else []
        ),
        sources=sorted({f.source for _, f in positive}, key=SOURCE_ORDER.index),
        conflict=conflict,
        complete=complete,
    )
    if archs is not None and not complete:  # a name past a layer's read is unseen: no compiler is not known
        triton = archs.triton.model_copy(update={"python_header": None}) if archs.triton else None
        torch = archs.torch_extensions
        if torch is not None:
            torch = torch.model_copy(update={"python_header": None, "ninja_carried": None})
        cupy, numba = archs.cupy, archs.numba  # and no NVRTC or libNVVM found is not known either
        if cupy is not None and cupy.nvrtc == "":
            cupy = cupy.model_copy(update={"nvrtc": None})
        if numba is not None:
            numba = numba.model_copy(
                update={
                    "nvrtc": numba.nvrtc or None,
                    "nvvm": numba.nvvm or None,
                    "nvjitlink": numba.nvjitlink or None,
                }
            )
        archs = archs.model_copy(
            update={
                "c_compilers": None,
                "triton": triton,
                "torch_extensions": torch,
                "cupy": cupy,
                "numba": numba,
            }
        )
    return inferred, archs


def _bounds_text() -> dict[str, str]:
    """What each per-layer bound counts, with its value, as a warning names it."""
    return {
        "MAX_FINDINGS_PER_LAYER": f"{MAX_FINDINGS_PER_LAYER:,} files with CUDA evidence",
        "MAX_SHADOWS_PER_LAYER": f"{MAX_SHADOWS_PER_LAYER:,} files that hide lower layers' evidence",
        "MAX_LIBRARIES_PER_LAYER": f"{MAX_LIBRARIES_PER_LAYER:,} files named like CUDA libraries",
        "MAX_DISTRIBUTIONS_PER_LAYER": f"{MAX_DISTRIBUTIONS_PER_LAYER:,} Python distributions",
        "MAX_MODULE_DIRS_PER_LAYER": f"{MAX_MODULE_DIRS_PER_LAYER:,} directories of GPU module files",
        "MAX_PTXAS_PER_LAYER": f"{MAX_PTXAS_PER_LAYER:,} files named ptxas",
        "MAX_TOOLKIT_LINKS_PER_LAYER": f"{MAX_TOOLKIT_LINKS_PER_LAYER:,} links to a CUDA toolkit or a ptxas",
        "MAX_NVCC_PER_LAYER": f"{MAX_NVCC_PER_LAYER:,} files named nvcc",
        "MAX_PYTHON_HEADERS_PER_LAYER": f"{MAX_PYTHON_HEADERS_PER_LAYER:,} files named Python.h",
        "MAX_VENVS_PER_LAYER": f"{MAX_VENVS_PER_LAYER:,} virtual environments",
        "MAX_C_COMPILERS_PER_LAYER": f"{MAX_C_COMPILERS_PER_LAYER:,} files named gcc, clang or c++, or Triton's built modules",
        "MAX_SITES_PER_LAYER": f"{python_loads.MAX_SITES_PER_LAYER:,} Python import sites",
        "MAX_BLOCK_HEADERS": f"{python_loads.MAX_BLOCK_HEADERS:,} Python block headers",
        "MAX_PATH_LOADS_PER_LAYER": f"{python_loads.MAX_PATH_LOADS_PER_LAYER:,} libraries loaded by path",
        "MAX_GLOBS_PER_LAYER": f"{python_loads.MAX_GLOBS_PER_LAYER:,} globs naming libraries",
        "MAX_LOAD_NAMES": f"{python_loads.MAX_LOAD_NAMES:,} names Python loads",
        "MAX_NINJA_PER_LAYER": f"{MAX_NINJA_PER_LAYER:,} files named ninja",
        "MAX_NVVM_PER_LAYER": f"{MAX_NVVM_PER_LAYER:,} files named like libNVVM",
        "MAX_CLAUSE_SCAN_BYTES": f"{MAX_CLAUSE_SCAN_BYTES:,} bytes of Python read for the clauses of a try: around a build",
    }


def layer_problems(layers_top_down: Sequence[CudaLayerEvidence]) -> list[str]:
    """What could not be read, in words: each file a parser failed on, each layer whose GPU code was
    left partly unread by its bound, and each layer that held more evidence than a per-layer bound
    keeps (at most `MAX_PROBLEMS_SHOWN`, then how many more)."""
    found = [
        f"{path}: {problem}" for layer in layers_top_down for path, problem in sorted(layer.problems.items())
    ]
    found += [
        f"layer {index + 1} from the top: the GPU code of its later files was not read: {layer.gpu_code_unread}"
        for index, layer in enumerate(layers_top_down)
        if layer.gpu_code_unread
    ]
    bounds = _bounds_text()
    found += [
        f"layer {index + 1} from the top: more than {bounds[bound]} ({bound}); evidence past it was"
        " not kept, and placement judges what was"
        for index, layer in enumerate(layers_top_down)
        for bound in layer.bounds_reached
    ]
    if len(found) > MAX_PROBLEMS_SHOWN:
        found = [
            *found[: MAX_PROBLEMS_SHOWN - 1],
            f"and {len(found) - MAX_PROBLEMS_SHOWN + 1} more files not read",
        ]
    return found


def file_archs(path: str, facts: ElfCudaFacts) -> FileArchs | None:
    """One ELF file's fatbin as the report lists it (None: the file has no fatbin)."""
    fatbin = facts.fatbin
    if fatbin is None:
        return None
    return FileArchs(
        path=path,
        sections=fatbin.sections,
        sass=fatbin.archs.sass,
        ptx=fatbin.archs.ptx,
        containers=fatbin.containers,
        error=fatbin.error or facts.error,
        needed=[name for name in facts.needed if not DRIVER_LIBRARIES.match(name)],
    )


def _links(merged: _Merged) -> dict[str, list[str]]:
    """What each carried CUDA library links in turn (its name -> CUDA DT_NEEDED), for the loader's
    transitive resolution."""
    links: dict[str, list[str]] = {}
    for path, facts in merged.elves:
        name = posixpath.basename(path)
        if facts.needed and name in merged.carried:
            links.setdefault(name, facts.needed)
    return links


def image_archs(
    merged: _Merged, runtime: str | None, missing: MissingLinks, overrides: Mapping[str, str] | None = None
) -> GpuArchs | None:
    """The image's GPU code: each file's (and each directory of module files') containers, annotated
    with its package and whether it can load (`scanner.layers.code_loading.annotate`); for the image,
    every arch its loadable code holds (union).

    Relocatable objects (`.o`) are listed but do not run, and device-link input (`__nv_relfatbin`) is
    never loaded, so neither counts in the image's archs. Where the code runs is
    `placement.gpu_code`'s answer.
    """
    files: list[FileArchs] = []
    for path, facts in sorted(merged.elves):
        file = file_archs(path, facts)
        if file is not None:
            files.append(file)
    for directory, found in sorted(merged.modules.items()):
        held = summarise(found.containers)
        files.append(
            FileArchs(
                path=directory + "/",
                kind="modules",
                sections=["module files"],
                sass=held.sass,
                ptx=held.ptx,
                containers=found.containers,
                files=found.files,
                error=None if found.containers or found.error is None else found.error,
            )
        )
    numba = numba_facts(merged.distributions, merged.library_paths, merged.nvvm)
    if not files and numba is None:  # numba-cuda carries no GPU code: it compiles every kernel at run time
        return None
    listed = len(files)
    files, packages = annotate(
        files[:MAX_ARCH_FILES],
        missing=missing,
        runtime_cuda=runtime,
        distributions=merged.distributions,
        imports=merged.extensions,
        overrides=overrides,
    )
    runnable = [
        c
        for f in files
        if f.loadable and f.error is None and not any("relocatable" in s for s in f.sections)
        for c in f.containers
    ]
    summary: ArchSummary = summarise(runnable)
    used = {f.package for f in files}
    carried_ptxas = dict(sorted((p, r) for p, r in merged.ptxas.items() if r))
    carried_nvcc = dict(sorted(merged.nvcc.items()))
    return GpuArchs(
        sass=summary.sass,
        ptx=summary.ptx,
        files=files,
        files_not_listed=max(0, listed - MAX_ARCH_FILES),
        packages=[p for p in packages if p.id in used],
        libraries=sorted(merged.carried),
        runtime_cuda=runtime,
        build_overrides=dict(overrides or {}),
        triton=_triton(merged, carried_ptxas),
        ptxas=carried_ptxas,
        ptxas_links=ptxas_aliases(carried_ptxas, merged.toolkit_links),
        c_compilers=sorted(merged.c_compilers),
        nvcc=carried_nvcc,
        nvcc_links=ptxas_aliases(carried_nvcc, merged.toolkit_links),
        toolkit_roots=sorted(p for p in merged.toolkit_links if _TOOLKIT_ROOT.match(posixpath.basename(p))),
        flashinfer=_flashinfer(merged),
        tvm_ffi=_tvm_ffi(merged),
        torch_extensions=_torch_extensions(merged),
        cupy=cupy_facts(merged.distributions, merged.library_paths),
        jax=jax_facts(merged.distributions),
        numba=numba,
    )


TRITON_DISTRIBUTIONS = frozenset({"triton", "pytorch-triton"})  # PyPI's, and PyTorch's nightly index's


def _triton(merged: _Merged, carried_ptxas: Mapping[str, str]) -> TritonFacts | None:
    """Triton's facts where a Triton distribution is installed: the `ptxas` copies it ships, by tool
    (3.x keeps them in `triton/backends/nvidia/bin/`, 2.x in `triton/third_party/cuda/bin/`)."""
    for dist_info, distribution in sorted(merged.distributions.items()):
        if distribution.name not in TRITON_DISTRIBUTIONS:
            continue
        package = posixpath.join(posixpath.dirname(dist_info), "triton") + "/"
        own = sorted(
            (p for p in carried_ptxas if p.startswith(package)),
            key=lambda p: "/backends/nvidia/bin/" not in p,
        )
        paths: dict[str, str] = {}
        for path in own:
            paths.setdefault(posixpath.basename(path), path)
        users = sorted(merged.triton_users)
        include, header = _python_header(merged, dist_info)
        return TritonFacts(
            version=distribution.version,
            python_header=header,
            python_include=include,
            ptxas={tool: carried_ptxas[path] for tool, path in paths.items()},
            paths=paths,
            users=users,
            prebuilt_utils=sorted(merged.triton_utils),
            user_versions=_shippers(merged, users),
        )
    return None


# FlashInfer's distributions: PyPI's JIT package (0.2 on), and the name its own index used before that.
FLASHINFER_DISTRIBUTIONS = frozenset({"flashinfer-python", "flashinfer"})
# Its built kernels: the jit-cache wheels (flashinfer.ai's index; 0.7 on also one per architecture,
# `flashinfer-jit-cache-<tag>`), and the modules an AOT build keeps (`flashinfer/data/aot/`, 0.2.6 on;
# `flashinfer/_kernels` and `flashinfer_kernels`, 0.2.0 to 0.2.5).
_JIT_CACHE = re.compile(r"^flashinfer-jit-cache(?:-[\w.]+)?$")
_AOT_MODULE = re.compile(
    r"(?:^|/)(?:flashinfer/data/aot/|flashinfer/_kernels[^/]*\.so$|flashinfer_kernels[^/]*\.so$)"
)


def _flashinfer(merged: _Merged) -> FlashInferFacts | None:
    """FlashInfer's facts where its distribution is installed: its version, the built kernels the image
    carries for it, and who imports it. The tools it compiles with depend on the config
    (`scanner.layers.cuda_jit_tools.with_jit_tools`)."""
    found = [d for _, d in sorted(merged.distributions.items()) if d.name in FLASHINFER_DISTRIBUTIONS]
    if not found:
        return None
    prebuilt = [
        f"{d.name} {d.version}" for _, d in sorted(merged.distributions.items()) if _JIT_CACHE.match(d.name)
    ]
    aot = sorted({path for path, _ in merged.elves if _AOT_MODULE.search(path)})
    users = sorted(merged.flashinfer_users)
    return FlashInferFacts(
        version=found[0].version,
        prebuilt=prebuilt + aot[:1],
        users=users,
        user_versions=_shippers(merged, users),
    )


def _tvm_ffi(merged: _Merged) -> TvmFfiFacts | None:
    """apache-tvm-ffi's facts where it is installed: its version and who imports it. The tools it compiles
    with depend on the config (`scanner.layers.cuda_jit_tools.with_jit_tools`)."""
    found = [d for _, d in sorted(merged.distributions.items()) if d.name == "apache-tvm-ffi"]
    if not found:
        return None
    users = sorted(merged.tvm_ffi_users)
    return TvmFfiFacts(version=found[0].version, users=users, user_versions=_shippers(merged, users))


def _python_header(merged: _Merged, dist_info: str) -> tuple[str | None, str | None]:
    """The include directory of the interpreter whose site directory holds `dist_info`, and its `Python.h`
    where the image carries it ("" where it does not; None where the interpreter is not known)."""
    include = include_dir(posixpath.dirname(dist_info), merged.venv_homes)
    if include is None:
        return None, None
    header = posixpath.join(include, "Python.h")
    return include, header if header in merged.python_headers else ""


def _torch_extensions(merged: _Merged) -> TorchExtensionFacts | None:
    """Torch's facts where packages of the image build a CUDA extension with its `cpp_extension` when
    imported: who builds (less those whose built extension the image carries, which they import first), and
    what the build needs that the image's layers alone say (`Python.h`, the `ninja` files). The tools found
    on the config's paths: `scanner.layers.cuda_jit_tools.with_jit_tools`."""
    torch = [(path, d) for path, d in sorted(merged.distributions.items()) if d.name == "torch"]
    if not merged.torch_builds or not torch:
        return None
    built = {dotted_module(path): path for path, _ in merged.elves if extension_name(path) is not None}
    users, prebuilt = [], []
    for top, imports in sorted(merged.torch_builds.items()):
        carried = sorted(built[name] for name in imports if name in built)
        if carried:
            prebuilt.append(carried[0])
        else:
            users.append(top)
    include, header = _python_header(merged, torch[0][0])
    return TorchExtensionFacts(
        version=torch[0][1].version,
        users=users,
        user_versions=_shippers(merged, users),
        prebuilt=prebuilt,
        ninja_carried=sorted(merged.ninja),
        python_include=include,
        python_header=header,
    )


def _shippers(merged: _Merged, users: Sequence[str]) -> dict[str, str]:
    """The installed distributions that ship any of the top-level packages `users` -> their versions."""
    return {
        shipper.name: shipper.version
        for _, shipper in sorted(merged.distributions.items())
        if set(shipper.top_level).intersection(users)
    }


def ptxas_aliases(carried: Mapping[str, str], links: Mapping[str, str]) -> dict[str, str]:
    """The paths that reach a carried `ptxas` through the image's toolkit links -> that file's path:
    `/usr/local/cuda/bin/ptxas` -> `/usr/local/cuda-12.8/bin/ptxas` where `/usr/local/cuda` ->
    `/etc/alternatives/cuda` -> `/usr/local/cuda-12.8`, as the kernel resolves them (a relative target
    from the link's directory). Each reached path's directories are looked up once among the links'
    targets (breadth first, up to `MAX_LINK_HOPS` links deep), so the work is bounded by
    `MAX_ALIAS_STEPS` lookups and `MAX_PTXAS_ALIASES` paths of at most `DEFAULT_MAX_PATH_BYTES`."""
    linking: dict[str, list[str]] = {}  # a link's resolved target -> the links that point there
    for link, target in sorted(links.items()):
        if target:
            linking.setdefault(
                posixpath.normpath(posixpath.join(posixpath.dirname(link), target)), []
            ).append(link)
    reached = {path: path for path in carried}
    queue = deque((path, 0) for path in sorted(carried))  # a reached path, and the links followed to it
    steps = 0
    while queue and steps < MAX_ALIAS_STEPS:
        path, hops = queue.popleft()
        directory = path
        while hops < MAX_LINK_HOPS and steps < MAX_ALIAS_STEPS:
            steps += 1
            rest = path if directory == "/" else path[len(directory) :]
            for link in linking.get(directory, ()):
                alias = link + rest
                if alias in reached or len(alias) > DEFAULT_MAX_PATH_BYTES:
                    continue
                if len(reached) >= len(carried) + MAX_PTXAS_ALIASES:
                    break
                reached[alias] = reached[path]
                queue.append((alias, hops + 1))
            if directory == "/":
                break
            directory = posixpath.dirname(directory)
    return {alias: real for alias, real in sorted(reached.items()) if alias != real}


def c_compiler_on(archs: GpuArchs, gpu: GpuFacts) -> str | None:
    """The C compiler Triton builds its launcher with in this image (its `_find_compiler`): the config's
    `CC` if set, else the first `gcc` on its PATH, else the first `clang`; "" where there is none; None
    where the image's names are not all known (`GpuArchs.c_compilers`)."""
    if gpu.c_compiler:
        return gpu.c_compiler
    if archs.c_compilers is None or _launcher_built(archs):
        return None  # unknown, or nothing left for a compiler to build
    carried = set(archs.c_compilers)
    for name in C_COMPILERS:
        for directory in gpu.executable_path:
            path = posixpath.join(directory, name)
            if path in carried:
                return path
    return ""


def with_triton_config(archs: GpuArchs, gpu: GpuFacts) -> GpuArchs:
    """`archs` with what the image's config decides for Triton: the `ptxas` it runs
    (`with_triton_ptxas`) and the C compiler it builds its launcher with (`c_compiler_on`)."""
    chosen = with_triton_ptxas(archs, gpu.triton_ptxas)
    if chosen.triton is None:
        return chosen
    update: dict[str, str | None] = {"c_compiler": c_compiler_on(chosen, gpu)}
    if _launcher_built(chosen):  # nor for Python's headers
        update["python_header"] = None
    return chosen.model_copy(update={"triton": chosen.triton.model_copy(update=update)})


def _launcher_built(archs: GpuArchs) -> bool:
    """Whether the image's Triton cache holds what Triton would build with a C compiler: its driver module,
    the only such build from 3.7 on (before it, each new kernel's launcher is built too)."""
    triton = archs.triton
    return (
        triton is not None
        and bool(triton.prebuilt_utils)
        and (release_of(triton.version) or (0, 0)) >= PREBUILT_UTILS_FROM
    )


def with_triton_ptxas(archs: GpuArchs, chosen: Mapping[str, str]) -> GpuArchs:
    """`archs` with the `ptxas` copies the image's config makes Triton run (`GpuFacts.triton_ptxas`:
    tool -> path), for the tools this Triton runs. A path the image carries as a `ptxas` file, or that
    reaches one through the image's toolkit links (`/usr/local/cuda/bin/ptxas` in NVIDIA's images:
    `ptxas_aliases`), gives its release; any other path (a file mounted at run time, a link the walk
    does not record, or none at all, where Triton falls back to its own copy) leaves the release
    unknown, and nothing is claimed for that tool."""
    triton = archs.triton
    if triton is None or not chosen:
        return archs
    ptxas, paths = dict(triton.ptxas), dict(triton.paths)
    for tool, path in chosen.items():
        if tool in ptxas:  # a variable for a tool this Triton does not run is not read
            paths[tool] = posixpath.normpath(path)
            ptxas[tool] = archs.ptxas.get(archs.ptxas_links.get(paths[tool], paths[tool]), "")
    return archs.model_copy(update={"triton": triton.model_copy(update={"ptxas": ptxas, "paths": paths})})
