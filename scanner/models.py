"""Pydantic models for what a scan finds.

These are the scanner's boundary: the CLI prints them as JSON, the store keeps
them, the API serves them and placement reads them. The JSON field names of
`ImageReport` are a public contract (`gpubadge scan --json`), so rename nothing.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

LibcFlavour = Literal["glibc", "musl", "none", "unknown"]
# Where a platform's layer verdicts (libc, inferred CUDA, archs) stand:
# `analysed`: the layers were read (the flavour says what was found, `unknown` included);
# `pending`: the config facts are published and the layers are being read now;
# `not_analysed`: no layer is read for this platform (not linux, outside GPUBADGE_PLATFORMS,
# a config-only scan); `reason` says which.
LayerState = Literal["analysed", "pending", "not_analysed"]


# The analysis a platform report comes from: bumped whenever a scan would now record facts that an
# earlier scan of the same image did not (a new judge's facts, a layer walk that keeps more evidence),
# so that a report stored before is read again instead of reused (`PlatformReport.analysis`).
# tests/test_analysis_version.py pins it to the report's shape and the evidence schemas, and fails
# when either changes without it.
ANALYSIS_VERSION = 2
# How a stored report's JSON is validated (`store.queries.reports`): a report without `analysis` was
# stored before versions were recorded, and counts as analysis 0.
STORED = {"stored": True}


def utc_now() -> datetime:
    return datetime.now(UTC)


# The PATH a container gets where its image's config sets none (Docker's and containerd's default).
DEFAULT_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


class Platform(BaseModel):
    """An OCI platform, printed the way Docker prints it (`linux/arm64/v8`)."""

    model_config = ConfigDict(frozen=True)

    os: str = "linux"
    architecture: str = "amd64"
    variant: str | None = None

    def __str__(self) -> str:
        parts = [self.os, self.architecture]
        if self.variant:
            parts.append(self.variant)
        return "/".join(parts)

    @classmethod
    def parse(cls, text: str) -> Platform:
        """Parse `os/arch[/variant]`; raises ValueError naming the bad part."""
        parts = text.strip().split("/")
        if len(parts) not in (2, 3) or not all(parts):
            raise ValueError(f"invalid platform {text!r}: expected os/arch or os/arch/variant")
        return cls(os=parts[0], architecture=parts[1], variant=parts[2] if len(parts) == 3 else None)

    def matches(self, other: Platform) -> bool:
        """True when `other` (from an index) satisfies this requested platform.

        A request without a variant matches any variant; `arm64` and `arm64/v8` are the same.
        """
        if self.os != other.os or self.architecture != other.architecture:
            return False
        if self.variant is None:
            return True
        mine = self.variant
        theirs = other.variant or ("v8" if other.architecture == "arm64" else None)
        return mine == theirs


class RequirementIssue(BaseModel):
    """A requirement variable that did not parse with NVIDIA's grammar."""

    variable: str
    value: str
    error: str


class ContainerArchs(BaseModel):
    """What one fatbin container (or `count` containers with the same content) holds."""

    model_config = ConfigDict(frozen=True)

    sass: tuple[str, ...] = ()
    ptx: tuple[str, ...] = ()
    ptx_isa: str | None = Field(default=None, description="the newest PTX ISA version among its PTX entries")
    count: int = 1
    section: str = Field(
        default=".nv_fatbin",
        description="the ELF section that holds it: `.nv_fatbin` is loaded at run time; `__nv_relfatbin` is"
        " device-link input (`-rdc`), never loaded from a shared library",
    )
    kernels: bool = Field(
        default=True,
        description="false when the container holds no kernel: no entries at all, or only uncompressed"
        " cubins whose symbol tables name no kernel entry (the empty module nvcc 13 puts first in every"
        " program's fatbin). No launch ever needs it. True where that cannot be told (compressed code, PTX)",
    )

    @property
    def signature(self) -> tuple[tuple[str, ...], tuple[str, ...], str | None, str, bool]:
        return self.sass, self.ptx, self.ptx_isa, self.section, self.kernels


FileKind = Literal["library", "modules"]
ImportState = Literal["required", "optional"]
PackageKind = Literal["python", "application", "nvidia"]


class FileArchs(BaseModel):
    """The GPU code of one file (`kind: library`, an ELF shared object or program) or of one directory
    of standalone module files a package loads itself (`kind: modules`: `.cubin`, `.fatbin`, `.ptx`),
    with the facts placement (`placement.gpu_code`) judges it by: its distinct containers, the package
    that ships it, whether the image can load it, and whether it is one of several builds of one
    library for different CUDA versions."""

    path: str
    kind: FileKind = "library"
    sections: list[str] = Field(default_factory=list)
    sass: list[str] = Field(default_factory=list)
    ptx: list[str] = Field(default_factory=list)
    containers: list[ContainerArchs] = Field(default_factory=list)
    error: str | None = None
    files: int = Field(default=1, description="module files in the directory (kind `modules`)")
    package: str | None = Field(
        default=None, description="the `GpuArchs.packages` id of the package that ships it"
    )
    needed: list[str] = Field(
        default_factory=list, description="the CUDA libraries it links (DT_NEEDED), the driver's excluded"
    )
    missing: list[str] = Field(
        default_factory=list,
        description="needed CUDA libraries the image does not carry: the dynamic loader cannot load the"
        " file, so its code never runs and it sets no CUDA floor",
    )
    cuda_build: str | None = Field(
        default=None,
        description="the CUDA version in its name, where it is one of several builds of one library"
        " (`libbitsandbytes_cuda128.so`: 12.8)",
    )
    selected: bool = Field(
        default=True,
        description="false for a build the package does not load: among builds of one library for"
        " several CUDA versions, the image's CUDA runtime selects one",
    )
    imported: ImportState | None = Field(
        default=None,
        description="for a Python extension module: `required` where its package imports it at module"
        " level unguarded, `optional` where every import is guarded (try/except, contextlib.suppress)"
        " or made inside a function; None where no import of it was found",
    )

    @property
    def loadable(self) -> bool:
        """The image can load it and its package loads it: every needed library is there, and it is
        the build the package selects."""
        return not self.missing and self.selected


class PackageFacts(BaseModel):
    """A package that ships GPU code: a Python distribution, an NVIDIA library, or the directory an
    application's libraries live in."""

    id: str
    name: str
    version: str | None = None
    kind: PackageKind = "application"
    optional: bool = Field(
        default=False,
        description="the package runs without its GPU code: every library holding it is an extension"
        " module imported only under a guard or on demand, or it is standalone module files the"
        " package loads itself",
    )


class TritonFacts(BaseModel):
    """Triton as the image carries it: the compiler that builds its kernels (and torch.compile's) for
    the GPU at hand, with the `ptxas` it runs (`scanner.layers.ptxas`)."""

    version: str | None = Field(default=None, description="the installed distribution's version")
    ptxas: dict[str, str] = Field(
        default_factory=dict,
        description='`ptxas` or `ptxas-blackwell` -> the CUDA release of the copy Triton runs ("12.8"):'
        " its own, or the one a config variable (`TRITON_PTXAS_PATH`) names where the image carries it",
    )
    paths: dict[str, str] = Field(default_factory=dict, description="the same tools -> the file's path")
    users: list[str] = Field(
        default_factory=list, description="top-level Python packages whose sources import triton"
    )
    prebuilt_utils: list[str] = Field(
        default_factory=list,
        description="built copies of its driver module the image carries in a Triton cache (`cuda_utils.*.so`):"
        " from 3.7 on, what spares it a C compiler",
    )
    c_compiler: str | None = Field(
        default=None,
        description="the C compiler Triton builds its launcher with at first use: `$CC`, else `gcc` or"
        ' `clang` on the image\'s PATH; "" where there is none (nothing Triton compiles runs); null where'
        " unknown",
    )
    user_versions: dict[str, str] = Field(
        default_factory=dict,
        description="the installed distributions that ship those packages (as PyPI names them) -> their"
        ' versions ({"sglang": "0.5.9"}); a package no distribution claims is not here',
    )
    python_include: str | None = Field(
        default=None,
        description="the C header directory of the interpreter Triton is installed for, as `sysconfig` names"
        " it (`/usr/include/python3.11`), which its launcher's build includes; null where not known",
    )
    python_header: str | None = Field(
        default=None,
        description='that directory\'s `Python.h` where the image carries it; "" where it does not (Triton'
        " builds nothing: Debian's python3-dev gives it one); null where unknown or not needed",
    )


class NvccBuilder(BaseModel):
    """A library that compiles CUDA sources with `nvcc` at first use, for the GPU at hand, as the image
    carries it: the tools it finds (`scanner.layers.cuda_jit_tools`) and who imports it."""

    version: str | None = Field(default=None, description="the installed distribution's version")
    nvcc: str | None = Field(
        default=None,
        description="the `nvcc` it runs (`bin/nvcc` below `$CUDA_HOME`, `$CUDA_PATH`, the `nvcc` on PATH or"
        ' `/usr/local/cuda`; FlashInfer\'s `$FLASHINFER_NVCC` first); "" where there is none; null where unknown',
    )
    nvcc_release: str | None = Field(
        default=None, description='the CUDA release of that `nvcc` ("12.8"); null where unknown'
    )
    cxx: str | None = Field(
        default=None,
        description='the C++ compiler it links with (`$CXX`, else `c++` on PATH); "" where there is none;'
        " null where unknown",
    )
    users: list[str] = Field(
        default_factory=list, description="top-level Python packages whose sources import it"
    )
    user_versions: dict[str, str] = Field(
        default_factory=dict,
        description='the installed distributions that ship those packages -> their versions ({"sglang": "0.5.9"})',
    )


class FlashInferFacts(NvccBuilder):
    """FlashInfer as the image carries it: it compiles its kernels with `nvcc` at first use, for the GPU at
    hand (`placement.flashinfer_compiler`), unless the image carries them built."""

    prebuilt: list[str] = Field(
        default_factory=list,
        description="built kernels the image carries, which FlashInfer loads instead of compiling them:"
        " `flashinfer-jit-cache <version>`, or the path of an AOT build's modules (`flashinfer/data/aot`)",
    )
    settings: dict[str, str] = Field(
        default_factory=dict,
        description="the config's variables that decide whether its users call it (vLLM's"
        " `VLLM_USE_FLASHINFER_SAMPLER`, `VLLM_ATTENTION_BACKEND`) -> their values",
    )


class TvmFfiFacts(NvccBuilder):
    """apache-tvm-ffi as the image carries it: its `cpp.load_inline` compiles its users' CUDA kernels with
    `nvcc` at first use, for the GPU at hand (SGLang's own kernels: `placement.tvm_ffi_compiler`)."""


class TorchExtensionFacts(NvccBuilder):
    """Torch's `cpp_extension` as the image carries it, where packages build a CUDA extension with it when
    they are imported (`users`: ExLlamaV2 and ExLlamaV3 as PyPI serves them): the build runs ninja, `nvcc`
    and a C++ compiler for the GPU at hand, and the package does not import without it
    (`placement.torch_extension_compiler`). `version` is torch's."""

    prebuilt: list[str] = Field(
        default_factory=list,
        description="built extensions the image carries that builders import first, which spares their"
        " build (`exllamav2_ext.cpython-311-x86_64-linux-gnu.so`, from ExLlamaV2's own wheels)",
    )
    ninja_carried: list[str] | None = Field(
        default_factory=list,
        description="files and links named `ninja` the image carries; null where its names are not all known",
    )
    ninja: str | None = Field(
        default=None,
        description='the `ninja` on the config\'s PATH that torch runs; "" where there is none; null where unknown',
    )
    arch_list: str | None = Field(
        default=None,
        description="the config's `TORCH_CUDA_ARCH_LIST`: the architectures torch builds for, in place of the GPU's",
    )
    python_include: str | None = Field(
        default=None, description="the include directory of the interpreter torch is installed for"
    )
    python_header: str | None = Field(
        default=None,
        description='that directory\'s `Python.h`, which every build includes; "" where the image lacks it;'
        " null where unknown",
    )


class CupyFacts(BaseModel):
    """CuPy as the image carries it: it compiles nearly every kernel it runs (elementwise operations,
    most reductions) at first use with NVRTC, for the GPU at hand (`scanner.layers.cupy_nvrtc`)."""

    distribution: str = Field(description='the installed distribution ("cupy-cuda12x")')
    version: str | None = Field(default=None, description="its version")
    cuda_major: int | None = Field(
        default=None, description="the CUDA major its name says it was built with; null for a source build"
    )
    soname: str | None = Field(
        default=None,
        description="the NVRTC library it loads by name (`libnvrtc.so.12`); null where it takes the first of"
        " several (14.x: NVIDIA's wheels, then `libnvrtc.so.13`, `.12`)",
    )
    nvrtc: str | None = Field(
        default=None,
        description='the CUDA release of the NVRTC it loads ("12.8"); "" where the image carries none (CuPy'
        " compiles nothing); null where the copies it may load disagree or their release is not known",
    )
    nvrtc_paths: list[str] = Field(default_factory=list, description="the copies it may load")
    compile_with_ptx: bool = Field(
        default=False,
        description="the config sets `CUPY_COMPILE_WITH_PTX=1`: it asks NVRTC for PTX, which the driver compiles",
    )


class NumbaFacts(BaseModel):
    """numba-cuda as the image carries it: it compiles every `@cuda.jit` kernel at its first launch, for an
    architecture NVRTC lists (`scanner.layers.numba_nvrtc`)."""

    distribution: str = Field(description='the installed distribution ("numba-cuda")')
    version: str | None = Field(default=None, description="its version")
    nvrtc: str | None = Field(
        default=None,
        description='the CUDA release of the NVRTC whose list of architectures it compiles for ("12.8"); ""'
        " where the image carries none; null where the copies it may load disagree or their release is not known",
    )
    nvrtc_paths: list[str] = Field(default_factory=list, description="the copies it may load")
    nvvm: str | None = Field(
        default=None,
        description='a libNVVM the image carries, which compiles every kernel (its path); "" where the image'
        " carries none; null where not known (a layer not read whole, or a CUDA home the config names and the"
        " image does not carry: a mount, perhaps)",
    )
    nvvm_release: str | None = Field(
        default=None,
        description='the CUDA release of the libNVVM copies the image carries ("12.8"): the PTX ISA it writes, and'
        " the oldest nvJitLink that links what it writes; null where they disagree, or none is known",
    )
    nvjitlink: str | None = Field(
        default=None,
        description='the CUDA release of the nvJitLink it links its kernels with ("12.8"; from 12.3 on, else the'
        ' driver links them); "" where the image carries none; null where the copies it may load disagree or'
        " their release is not known",
    )
    nvjitlink_paths: list[str] = Field(default_factory=list, description="the nvJitLink copies it may load")
    forced_cc: str | None = Field(
        default=None,
        description="the config's `NUMBA_FORCE_CUDA_CC`: the architecture it compiles for instead of the GPU's",
    )


class JaxFacts(BaseModel):
    """JAX as the image carries it: XLA compiles every jitted computation at run time and assembles it
    with a `ptxas` process for the GPU at hand (`scanner.layers.jax_ptxas`)."""

    distribution: str = Field(description='the distribution that carries XLA ("jax-cuda12-pjrt")')
    version: str | None = Field(default=None, description="its version")
    cuda_major: int | None = Field(default=None, description="the CUDA major it was built for")
    site: str | None = Field(
        default=None, description="its site directory, where NVIDIA's nvcc wheel is looked for"
    )
    ptxas: str | None = Field(
        default=None,
        description='the `ptxas` XLA runs (its path); "" where the image has none; null where not known',
    )
    ptxas_release: str | None = Field(default=None, description='that `ptxas`\'s CUDA release ("12.8")')
    driver_fallback: bool = Field(
        default=False,
        description="`XLA_FLAGS` sets `--xla_gpu_unsafe_fallback_to_driver_on_ptxas_not_found`: with no `ptxas`,"
        " the driver compiles the PTX",
    )


class GpuArchs(BaseModel):
    """GPU architectures found in the image's GPU code, as facts; where they run is placement's answer.

    `sass`: every SASS arch of the code the image can load (`.nv_fatbin` of loadable files, module
    files); `ptx`: every PTX arch among them. `files` has the containers per file, which
    `placement.gpu_code` judges per package (`packages`).
    """

    sass: list[str] = Field(default_factory=list)
    ptx: list[str] = Field(default_factory=list)
    files: list[FileArchs] = Field(default_factory=list)
    files_not_listed: int = Field(
        default=0,
        description="files with GPU code past the report's bound (`MAX_ARCH_FILES`, in path order):"
        " neither listed nor judged, and the report warns",
    )
    packages: list[PackageFacts] = Field(default_factory=list)
    libraries: list[str] = Field(
        default_factory=list,
        description="the CUDA libraries the image carries (file names, e.g. libcudart.so.13)",
    )
    runtime_cuda: str | None = Field(
        default=None,
        description="the CUDA runtime the image loads (torch.version.cuda, else its CUDA runtime library or"
        " toolkit): it selects among builds of one library for several CUDA versions",
    )
    build_overrides: dict[str, str] = Field(
        default_factory=dict,
        description="package -> the CUDA version whose build a config variable makes it load instead"
        " (`GpuFacts.build_overrides`)",
    )
    triton: TritonFacts | None = Field(
        default=None, description="Triton, where the image carries it: what it compiles kernels with"
    )
    ptxas: dict[str, str] = Field(
        default_factory=dict,
        description="every `ptxas` the image carries (path -> CUDA release), which `TRITON_PTXAS_PATH` may name",
    )
    ptxas_links: dict[str, str] = Field(
        default_factory=dict,
        description="paths that reach one of those `ptxas` through the image's links -> that file's path"
        " (`/usr/local/cuda/bin/ptxas` -> `/usr/local/cuda-12.8/bin/ptxas`)",
    )
    c_compilers: list[str] | None = Field(
        default=None,
        description="the files and links the image carries named `gcc` or `clang` (the C compilers Triton"
        " looks for) or `c++` (FlashInfer's); null where a layer was not read whole",
    )
    nvcc: dict[str, str] = Field(
        default_factory=dict,
        description='every `nvcc` the image carries (path -> CUDA release; "" where its banner names none)',
    )
    nvcc_links: dict[str, str] = Field(
        default_factory=dict,
        description="paths that reach one of those `nvcc` through the image's links -> that file's path",
    )
    toolkit_roots: list[str] = Field(
        default_factory=list,
        description="directories and links named like a toolkit's root (`/usr/local/cuda`), which FlashInfer"
        " takes for `CUDA_HOME` where it finds no other",
    )
    flashinfer: FlashInferFacts | None = Field(
        default=None, description="FlashInfer, where the image carries it: what it compiles kernels with"
    )
    tvm_ffi: TvmFfiFacts | None = Field(
        default=None,
        description="apache-tvm-ffi, where the image carries it: what it compiles its users' kernels with",
    )
    jax: JaxFacts | None = Field(
        default=None,
        description="JAX, where the image carries a CUDA build of it: the ptxas XLA assembles with",
    )
    cupy: CupyFacts | None = Field(
        default=None,
        description="CuPy, where the image carries a CUDA build of it: the NVRTC it compiles with",
    )
    numba: NumbaFacts | None = Field(
        default=None,
        description="numba-cuda, where the image carries it: the NVRTC whose architectures its kernels are"
        " compiled for",
    )
    torch_extensions: TorchExtensionFacts | None = Field(
        default=None,
        description="torch's `cpp_extension`, where packages of the image build a CUDA extension with it when"
        " imported (ExLlamaV2 from PyPI): what it builds with",
    )


class CudaSource(BaseModel):
    """One piece of evidence that names a CUDA version: what it is, where, and which version."""

    source: str = Field(description="kind of evidence: torch, nvidia-wheel, conda, toolkit, elf, ...")
    cuda: str = Field(description='the version it names: "12.8", or "13" where it names only the major')
    evidence: str = Field(description='"<path>: <what it says>"')


class InferredCuda(BaseModel):
    """CUDA the image carries in its layers (declared or not). See scanner.layers.cuda_evidence."""

    cuda: str | None = Field(
        default=None,
        description="the newest CUDA the evidence names, as precisely as the evidence for that major allows",
    )
    set_by: str | None = Field(
        default=None, description='the evidence that set `cuda`: "<path>: <what it says>"'
    )
    evidence: list[str] = Field(default_factory=list, description='"<path>: <what it says>"')
    versions: list[CudaSource] = Field(
        default_factory=list, description="every piece of evidence that names a version, newest first"
    )
    sources: list[str] = Field(default_factory=list, description="kinds of evidence: torch, conda, elf, ...")
    conflict: bool = Field(
        default=False, description="sources name different CUDA versions; the newest is kept"
    )
    complete: bool = Field(default=True, description="every layer was read")


class GpuFacts(BaseModel):
    """What an image config says about NVIDIA GPUs. Derived from the config alone."""

    required: bool = False
    cuda_version: str | None = Field(default=None, description="major.minor of CUDA, if known")
    requirements: list[str] = Field(
        default_factory=list, description="values of every NVIDIA_REQUIRE_* variable, ordered by name"
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="every NVIDIA_* and CUDA_* variable found, with its value"
    )
    labels: dict[str, str] = Field(default_factory=dict, description="NVIDIA labels such as com.nvidia.*")
    signals: list[str] = Field(
        default_factory=list, description="the names that made `required` true, for the UI's 'why'"
    )
    disable_require: bool = False
    visible_devices: str | None = None
    driver_capabilities: str | None = None
    requirement_errors: list[RequirementIssue] = Field(default_factory=list)
    legacy: bool = Field(
        default=False,
        description="CUDA_VERSION set without NVIDIA_REQUIRE_CUDA: the toolkit derives cuda>=X.Y",
    )
    effective_requirements: list[str] = Field(
        default_factory=list,
        description="what NVIDIA's runtime hook checks: requirements (+ legacy cuda>=X.Y), none if disabled",
    )
    runtime_gpu_request: bool = Field(
        default=False, description="the NVIDIA runtime would inject GPUs from this env alone (not void/none)"
    )
    build_overrides: dict[str, str] = Field(
        default_factory=dict,
        description="package -> the CUDA version whose build it loads, as a variable of the config forces"
        " it (`BNB_CUDA_VERSION=124`: bitsandbytes loads `libbitsandbytes_cuda124.so`)",
    )
    triton_ptxas: dict[str, str] = Field(
        default_factory=dict,
        description="`ptxas` or `ptxas-blackwell` -> the path a config variable makes Triton run"
        " (`TRITON_PTXAS_PATH`, `TRITON_PTXAS_BLACKWELL_PATH`)",
    )
    executable_path: list[str] = Field(
        default_factory=lambda: list(DEFAULT_PATH),
        description="the directories of the config's `PATH` (Docker's default where it sets none), where"
        " Triton looks for a C compiler",
    )
    c_compiler: str | None = Field(
        default=None, description="the config's `CC`, the C compiler Triton builds its launcher with if set"
    )
    flashinfer_env: dict[str, str] = Field(
        default_factory=dict,
        description="the config's variables that decide the kernels FlashInfer, tvm-ffi and torch's"
        " `cpp_extension` build (`CUDA_HOME`, `CUDA_PATH`, `FLASHINFER_NVCC`, `PYTORCH_NVCC`, `CXX`,"
        " `TORCH_CUDA_ARCH_LIST`; vLLM's `VLLM_USE_FLASHINFER_SAMPLER` and `VLLM_ATTENTION_BACKEND`; CuPy's"
        " `CUPY_COMPILE_WITH_PTX`; JAX's `CUDA_ROOT` and `XLA_FLAGS`) -> their values",
    )
    inferred: InferredCuda | None = Field(
        default=None,
        description="CUDA the image carries in its layers (GPUBADGE_DEEP_SCAN); null when none was found or"
        " looked for",
    )
    archs: GpuArchs | None = Field(default=None, description="GPU architectures in the image's fatbins")


class LibcVerdict(BaseModel):
    """Which C library the image's root filesystem carries, and how we know."""

    flavour: LibcFlavour = "unknown"
    state: LayerState = Field(
        default="analysed", description="analysed, pending (layers being read) or not_analysed (see reason)"
    )
    reason: str | None = Field(default=None, description="why the layers are not analysed, when they are not")
    evidence: str | None = Field(default=None, description="the file or ELF interpreter that decided")
    distro: str | None = Field(default=None, description="PRETTY_NAME or ID+VERSION_ID from os-release")
    musl_also: bool = Field(default=False, description="a musl loader is present beside glibc")
    layers_read: int = 0
    layers_total: int = 0
    layers_cached: int = Field(
        default=0,
        description="of layers_read, those whose C-library facts came from the layer cache (read before,"
        " for this or another image), not from bytes this scan fetched",
    )
    bytes_read: int = Field(
        default=0,
        description="compressed layer bytes the registry sent for this verdict, partial reads included",
    )
    bytes_total: int = Field(default=0, description="compressed size of all layers")


class LayerInfo(BaseModel):
    digest: str
    size: int
    media_type: str


class SkippedLayer(BaseModel):
    """A layer that was never fetched, and why (foreign or non-distributable content)."""

    digest: str
    size: int
    media_type: str
    reason: str


class PlatformReport(BaseModel):
    """One platform image (a single manifest) inside a reference."""

    platform: str
    digest: str
    config_digest: str | None = None
    gpu: GpuFacts = Field(default_factory=GpuFacts)
    libc: LibcVerdict = Field(default_factory=LibcVerdict)
    badges: list[str] = Field(default_factory=list)
    layers: list[LayerInfo] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    created: str | None = None
    error: str | None = Field(
        default=None,
        description="why this platform has no full answer (its manifest, config or layers could not be"
        " read); the other platforms' answers stand",
    )
    skipped_layers: list[SkippedLayer] = Field(
        default_factory=list, description="layers never fetched (foreign or non-distributable)"
    )
    bytes_fetched: int = Field(
        default=0,
        description="compressed bytes the registry sent for this platform in this scan (config and layers)",
    )
    pending_scan: str | None = Field(
        default=None,
        description="while its layers are being read (`libc.state` pending): the scan job reading them. A"
        " pending report is trusted only while that job holds a live lease; once it does not, the read was"
        " interrupted and the next scan of the image reads the layers again",
    )
    analysis: int = Field(
        default=ANALYSIS_VERSION,
        ge=0,
        description="the version of gpubadge's analysis that read this platform; one older than the"
        " running service's is not reused: a scan reads the image again (0: stored before versions)",
    )

    @model_validator(mode="before")
    @classmethod
    def _stored_before_versions(cls, data: Any, info: ValidationInfo) -> Any:
        """A stored report (validated with the `STORED` context) that records no analysis is analysis 0."""
        if info.context == STORED and isinstance(data, dict) and "analysis" not in data:
            return {**data, "analysis": 0}
        return data

    @property
    def outdated(self) -> bool:
        """Read by an older analysis than this one: its facts may lack what newer judges read."""
        return self.analysis < ANALYSIS_VERSION


class ImageReport(BaseModel):
    """Everything we know about one reference. The `--json` line and the API shape."""

    reference: str
    digest: str | None = None
    error: str | None = None
    platforms: list[PlatformReport] = Field(default_factory=list)
    registry: str | None = None
    repository: str | None = None
    tag: str | None = None
    media_type: str | None = None
    scanned_at: datetime = Field(default_factory=utc_now)
    requests: int = Field(default=0, description="HTTP requests this scan made (cached tokens excluded)")
    cached: bool = Field(default=False, description="the digest was already scanned; no new requests")
    config_only: bool = False
    pending: bool = Field(
        default=False,
        description="config facts are published; layer verdicts (libc, inferred CUDA) are still being read",
    )
    bytes_fetched: int = Field(
        default=0, description="bytes the registry sent for this scan: manifests, configs and layers"
    )
    retryable: bool = Field(
        default=True,
        description="false when scanning again cannot succeed (a malformed reference, or the image crosses a"
        " configured bound)",
    )
    not_an_image: bool = Field(
        default=False, exclude=True, description="an artifact (attestation, signature), not a container image"
    )
    retry_after: float | None = Field(
        default=None,
        exclude=True,
        description="seconds until the registry, which answered a Retry-After, may be asked again",
    )

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def gpu_required(self) -> bool:
        return any(p.gpu.required for p in self.platforms)
