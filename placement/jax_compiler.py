"""Whether the image's JAX can compile its computations for a GPU. Pure.

JAX compiles every jitted computation at run time: XLA writes PTX with LLVM and assembles it for the
GPU's own architecture (`sm_120a`) with a `ptxas` process; its CUDA wheels link no PTX compiler of their
own, and its precompiled kernels cover only a few helpers. Which `ptxas` is the scan's
(`scanner.layers.cuda_jit_tools`): `$CUDA_ROOT/bin` (0.4.35 on), else NVIDIA's nvcc wheel that JAX's
`with-cuda` extra installs (`nvidia/cu13`, then `nvidia/cuda_nvcc`: `jax/_src/lib/__init__.py`'s
`_cuda_path`), else the PATH, else `/usr/local/cuda` (XLA's `FindPtxAsExecutable`, which takes the first
of CUDA 11.8 or later).

A `ptxas` that does not know the GPU stops every compilation: "ptxas fatal : Value 'sm_120a' is not defined
for option 'gpu-name'", then `XlaRuntimeError: UNIMPLEMENTED: ... ptxas too old` (jaxlib 0.4.34 with CUDA
12.6 on an RTX 50xx; XLA logs "Falling back to the CUDA driver" but does not, and tries no other `ptxas`).
With none at all, 0.5.0 on stop with "No PTX compilation provider is available" (earlier ones abort),
unless `XLA_FLAGS` sets `--xla_gpu_unsafe_fallback_to_driver_on_ptxas_not_found`, where the driver compiles
the PTX. Either way nothing JAX computes runs, so the image is refused there. What the driver needs of the
PTX (its ISA) is not judged here; nor are XLA's own code-generation faults on single GPUs
(openxla/xla#47982).
"""

from __future__ import annotations

from placement.compiler_releases import CC, compiles_for, release, releases_knowing
from scanner.models import JaxFacts

WHAT = "compiles every jitted computation at run time with ptxas"


def jax_refusal(jax: JaxFacts | None, cc: CC) -> str | None:
    """Why the image does not run on `cc` for want of what JAX compiles, or None where it can compile (or
    the `ptxas` it runs is not known)."""
    if jax is None or jax.ptxas is None:
        return None
    name = f"{jax.distribution} {jax.version}"
    if jax.ptxas == "":
        if jax.driver_fallback:
            return None
        extra = "nvidia-cuda-nvcc" if jax.cuda_major == 13 else "nvidia-cuda-nvcc-cu12"
        return (
            f"{name} {WHAT}, and finds none in the image ($CUDA_ROOT, NVIDIA's nvcc wheel, PATH, /usr/local/cuda):"
            f' "No PTX compilation provider is available"; its with-cuda extra ({extra}) gives it one'
        )
    cuda = release(jax.ptxas_release or "")
    if cuda is None or compiles_for(cuda, cc):
        return None
    arch = f"sm_{cc[0] * 10 + cc[1]}{'a' if cc >= (9, 0) else ''}"
    knowing = releases_knowing(cuda, cc)
    remedy = f"; a ptxas of {knowing} does" if knowing else ""
    return (
        f"{name} {WHAT}, and the one it runs ({jax.ptxas}, CUDA {cuda[0]}.{cuda[1]}) does not know {arch}:"
        f' "ptxas too old", and XLA does not fall back to the driver{remedy}'
    )
