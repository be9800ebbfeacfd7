"""Whether apache-tvm-ffi can build its users' CUDA kernels for a GPU, and who needs them there. Pure.

tvm-ffi's `cpp.load_inline` compiles CUDA sources at their first call with `nvcc` below the CUDA home
its `_find_cuda_home` finds (`$CUDA_HOME`, `$CUDA_PATH`, the `nvcc` on PATH, `/usr/local/cuda`) and
links them with `$CXX`, else `c++` (`cpp/extension.py`; the scan finds both:
`scanner.layers.cuda_jit_tools`). What stops it on a GPU: no `nvcc`, no C++ compiler, or an `nvcc`
whose release does not know the GPU (`placement.compiler_releases`).

SGLang builds its own kernels so (`sglang.jit_kernel`, from 0.5.11 `sglang.kernels.jit` too), and from
0.5.11 its `SiluAndMul` and `GeluAndMul`, the activation of every model's MLP, call them on CUDA with no
fallback (`srt/layers/activation.py`; 0.5.17 on take sgl-kernel's only for widths the kernel does not
fit). Its earlier uses try the build and fall back (`can_use_store_cache`, 0.5.8). So SGLang from 0.5.11
is refused on every GPU where tvm-ffi cannot build (`tvm_ffi_refusal`); elsewhere the answer says what
runs without those kernels (`tvm_ffi_gap`).
"""

from __future__ import annotations

from collections.abc import Sequence

from placement.compiler_releases import CC, compiles_for, release, toolkit_remedy
from placement.compiler_users import candidates, named
from placement.flashinfer_compiler import ADD_CXX, NO_CXX, NO_NVCC
from scanner.layers.code_loading import release_parts
from scanner.models import PackageFacts, TvmFfiFacts

ADD_NVCC = "a CUDA toolkit in the image (NVIDIA's devel images) gives it one"
# Importers that build nothing through `load_inline`: tvm-ffi itself, and FlashInfer, which loads its
# modules with tvm-ffi but builds them itself (`placement.flashinfer_compiler` judges those).
OWN_BUILDERS = frozenset({"tvm_ffi", "flashinfer"})
# Packages that call kernels tvm-ffi compiles on their default path: from each version on, why.
DEFAULT_PATH_USERS: dict[str, tuple[tuple[int, int, int], str]] = {
    "sglang": (
        (0, 5, 11),
        "builds its own kernels with it at first use, every model's MLP activation among them",
    ),
}


def _gap(tvm_ffi: TvmFfiFacts | None, cc: CC) -> tuple[str, str] | None:
    """What stops tvm-ffi building kernels on `cc`, and what gives it the means; None where it can, or where
    a tool it runs is unknown."""
    if tvm_ffi is None:
        return None
    if tvm_ffi.nvcc == "":
        return NO_NVCC, ADD_NVCC
    if tvm_ffi.cxx == "":
        return NO_CXX, ADD_CXX
    cuda = release(tvm_ffi.nvcc_release or "")
    if cuda is None or compiles_for(cuda, cc):
        return None
    arch = f"sm_{cc[0] * 10 + cc[1]}{'a' if cc >= (9, 0) else ''}"
    return f"its nvcc (CUDA {cuda[0]}.{cuda[1]}) does not know {arch}", toolkit_remedy(cuda, cc)


def default_path_use(package: PackageFacts) -> str | None:
    """How `package` calls kernels tvm-ffi builds on its default path, at its version, or None."""
    stage = DEFAULT_PATH_USERS.get(package.name) if package.kind == "python" else None
    if stage is None or (release_parts(package.version) or (0, 0, 0)) < stage[0]:
        return None
    return stage[1]


def tvm_ffi_refusal(tvm_ffi: TvmFfiFacts | None, packages: Sequence[PackageFacts], cc: CC) -> str | None:
    """Why the image does not run on `cc` for want of the kernels tvm-ffi builds, or None."""
    found = _gap(tvm_ffi, cc)
    if tvm_ffi is None or found is None:
        return None
    gap, remedy = found
    for package in candidates(tvm_ffi.user_versions, packages):
        why = default_path_use(package)
        if why is not None:
            return f"tvm-ffi cannot build kernels here: {gap}, and {package.name} {package.version} {why}; {remedy}"
    return None


def tvm_ffi_gap(tvm_ffi: TvmFfiFacts | None, cc: CC) -> str | None:
    """Why tvm-ffi cannot build kernels on `cc`, as a "without" line, or None where it can (or what it would
    build with is unknown)."""
    found = _gap(tvm_ffi, cc)
    if tvm_ffi is None or found is None:
        return None
    gap, remedy = found
    users = [user for user in tvm_ffi.users if user not in OWN_BUILDERS]
    if not users:
        return None  # nothing in the image builds through it
    shown = named(users)
    what = f" ({shown} import{'s' if len(users) == 1 else ''} it)"
    return f"the kernels tvm-ffi builds: {gap}, so none of them builds here{what}; {remedy}"
