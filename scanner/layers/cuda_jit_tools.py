"""Which tools the libraries that compile CUDA at run time find in an image, as their own code finds them. Pure.

FlashInfer (`flashinfer-python`) and apache-tvm-ffi (`tvm_ffi.cpp.load_inline`, with which SGLang builds
its own kernels) ship CUDA sources, and so do packages that build their extension with torch's
`cpp_extension` when imported (ExLlamaV2): at the first call of a kernel module (at the import) they
write a ninja file, compile it with `nvcc` and link it with a C++ compiler (FlashInfer's `jit/cpp_ext.py`, 0.2.6 to 0.7.4; 0.2.0 to
0.2.5 through torch's `cpp_extension.load`, which finds them the same way; tvm-ffi's `cpp/extension.py`),
unless the image carries the module built (`FlashInferFacts.prebuilt`). Where they find them (FlashInfer's
`get_cuda_path`, tvm-ffi's and torch's `_find_cuda_home`):

* `nvcc`: FlashInfer's `$FLASHINFER_NVCC` (`$PYTORCH_NVCC` before 0.4), else `bin/nvcc` below the CUDA
  home: `$CUDA_HOME`, else `$CUDA_PATH`, else two directories above the `nvcc` on PATH, else
  `/usr/local/cuda` where it exists (FlashInfer 0.4.x looks nowhere else: "Could not find nvcc");
* the C++ compiler: `$CXX`, else `c++` on PATH (every module is linked with it);
* for torch's `cpp_extension`, `ninja` on PATH (`verify_ninja_availability`), and the architectures of
  `$TORCH_CUDA_ARCH_LIST` where the config sets it.

A path the image carries, directly or through its toolkit links (`/usr/local/cuda/bin/nvcc` in
NVIDIA's `devel` images: `GpuArchs.nvcc_links`), gives that `nvcc`'s release; a path it does not carry
may be mounted at run time, so it is unknown (null) and nothing is claimed. "" means the image has
none: nothing is built there.
"""

from __future__ import annotations

import posixpath

from scanner.layers.code_loading import release_of
from scanner.layers.jax_ptxas import with_jax_ptxas
from scanner.layers.numba_nvrtc import with_numba_config
from scanner.models import GpuArchs, GpuFacts, TvmFfiFacts

DEFAULT_CUDA_HOME = "/usr/local/cuda"
NO_DEFAULT_HOME = ((0, 4), (0, 5))  # 0.4.x looks nowhere else: "Could not find nvcc"
NVCC_VARIABLE_FROM = (0, 4)  # `FLASHINFER_NVCC`; before it, torch's `PYTORCH_NVCC`


def nvcc_path(archs: GpuArchs, gpu: GpuFacts, version: str | None) -> str | None:
    """The `nvcc` FlashInfer `version` runs in this image; "" where it finds none; None where the image's
    names are not all known (a layer not read whole)."""
    release = release_of(version) or (0, 0)
    variable = "FLASHINFER_NVCC" if release >= NVCC_VARIABLE_FROM else "PYTORCH_NVCC"
    if gpu.flashinfer_env.get(variable):
        return gpu.flashinfer_env[variable]
    return _home_nvcc(archs, gpu, default_home=not NO_DEFAULT_HOME[0] <= release < NO_DEFAULT_HOME[1])


def _home_nvcc(archs: GpuArchs, gpu: GpuFacts, default_home: bool) -> str | None:
    """`bin/nvcc` below the CUDA home `_find_cuda_home` finds (module docstring)."""
    tools = gpu.flashinfer_env
    for home in (tools.get("CUDA_HOME"), tools.get("CUDA_PATH")):
        if home:
            return posixpath.join(home, "bin", "nvcc")
    if not _names_known(archs):
        return None
    for directory in gpu.executable_path:
        found = posixpath.join(directory, "nvcc")
        if _carried(archs, found):
            return posixpath.join(posixpath.dirname(posixpath.dirname(found)), "bin", "nvcc")
    if DEFAULT_CUDA_HOME in archs.toolkit_roots and default_home:
        return posixpath.join(DEFAULT_CUDA_HOME, "bin", "nvcc")
    return ""


def nvcc_release(archs: GpuArchs, path: str | None) -> str | None:
    """The CUDA release of the `nvcc` at `path` where the image carries it (through its links too), or
    None: not carried (mounted at run time, or absent below a CUDA home that is there), or no banner."""
    if not path:
        return None
    return archs.nvcc.get(archs.nvcc_links.get(path, path)) or None


def cxx_compiler(archs: GpuArchs, gpu: GpuFacts) -> str | None:
    """The C++ compiler FlashInfer links with: `$CXX`, else the first `c++` on the config's PATH; "" where
    there is none; None where the image's names are not all known."""
    if gpu.flashinfer_env.get("CXX"):
        return gpu.flashinfer_env["CXX"]
    return on_path("c++", archs.c_compilers, gpu)


def with_jit_tools(archs: GpuArchs, gpu: GpuFacts) -> GpuArchs:
    """`archs` with the tools the image's config makes FlashInfer, tvm-ffi and torch's `cpp_extension`
    compile with (module docstring), the `ptxas` JAX runs (`scanner.layers.jax_ptxas`), the architecture it
    forces on numba-cuda (`scanner.layers.numba_nvrtc`), and whether it makes CuPy's NVRTC write PTX."""
    chosen = _with_torch_extension_config(_with_tvm_ffi_config(_with_flashinfer_config(archs, gpu), gpu), gpu)
    chosen = with_numba_config(with_jax_ptxas(chosen, gpu), gpu)
    if chosen.cupy is None or not _cupy_ptx(gpu.flashinfer_env.get("CUPY_COMPILE_WITH_PTX", "")):
        return chosen
    return chosen.model_copy(update={"cupy": chosen.cupy.model_copy(update={"compile_with_ptx": True})})


def _cupy_ptx(value: str) -> bool:
    """`CUPY_COMPILE_WITH_PTX` as CuPy reads it (`_get_bool_env_variable`): on where it is the integer 1."""
    try:
        return int(value) == 1
    except ValueError:
        return False


def _found(archs: GpuArchs, nvcc: str | None) -> str | None:
    """`nvcc`, or "" where it lies below a CUDA home the image has and is not there (NVIDIA's `runtime`
    images: libraries only)."""
    return "" if nvcc and _in_own_toolkit(archs, nvcc) and not _carried(archs, nvcc) else nvcc


def _with_tvm_ffi_config(archs: GpuArchs, gpu: GpuFacts) -> GpuArchs:
    tvm_ffi: TvmFfiFacts | None = archs.tvm_ffi
    if tvm_ffi is None:
        return archs
    nvcc = _found(archs, _home_nvcc(archs, gpu, default_home=True))
    facts = tvm_ffi.model_copy(
        update={"nvcc": nvcc, "nvcc_release": nvcc_release(archs, nvcc), "cxx": cxx_compiler(archs, gpu)}
    )
    return archs.model_copy(update={"tvm_ffi": facts})


def _with_torch_extension_config(archs: GpuArchs, gpu: GpuFacts) -> GpuArchs:
    torch = archs.torch_extensions
    if torch is None:
        return archs
    nvcc = _found(archs, _home_nvcc(archs, gpu, default_home=True))  # torch's `_find_cuda_home`
    facts = torch.model_copy(
        update={
            "nvcc": nvcc,
            "nvcc_release": nvcc_release(archs, nvcc),
            "cxx": cxx_compiler(archs, gpu),
            "ninja": on_path("ninja", torch.ninja_carried, gpu),
            "arch_list": gpu.flashinfer_env.get("TORCH_CUDA_ARCH_LIST"),
        }
    )
    return archs.model_copy(update={"torch_extensions": facts})


def on_path(name: str, carried: list[str] | None, gpu: GpuFacts) -> str | None:
    """The first `name` on the config's PATH among the `carried` paths; "" where there is none; None where
    the image's names are not all known (`carried` is None)."""
    if carried is None:
        return None
    names = set(carried)
    for directory in gpu.executable_path:
        path = posixpath.join(directory, name)
        if path in names:
            return path
    return ""


def _with_flashinfer_config(archs: GpuArchs, gpu: GpuFacts) -> GpuArchs:
    flashinfer = archs.flashinfer
    if flashinfer is None:
        return archs
    nvcc = _found(archs, nvcc_path(archs, gpu, flashinfer.version))
    settings = {name: value for name, value in gpu.flashinfer_env.items() if name.startswith("VLLM_")}
    facts = flashinfer.model_copy(
        update={
            "nvcc": nvcc,
            "nvcc_release": nvcc_release(archs, nvcc),
            "cxx": cxx_compiler(archs, gpu),
            "settings": settings,
        }
    )
    return archs.model_copy(update={"flashinfer": facts})


def _carried(archs: GpuArchs, path: str) -> bool:
    return path in archs.nvcc or path in archs.nvcc_links


def _in_own_toolkit(archs: GpuArchs, path: str) -> bool:
    """Whether `path` lies below a toolkit root the image has (`/usr/local/cuda/bin/nvcc`), all its names
    known: what is not there is not there."""
    home = posixpath.dirname(posixpath.dirname(path))
    return _names_known(archs) and home in archs.toolkit_roots


def _names_known(archs: GpuArchs) -> bool:
    """Whether every layer was read whole, so a name the image lacks is absent, not unseen (the scan nulls
    `GpuArchs.c_compilers` where one was not)."""
    return archs.c_compilers is not None
