"""Whether the image's Triton can compile kernels for a GPU. Pure.

Triton builds every kernel (its users' and torch.compile's) on the GPU at hand: LLVM writes PTX for
`sm_{capability}`, with an `a` from 9.0 on (`sm_arch_from_capability` in its
`backends/nvidia/compiler.py`; before 3.3 at 9.0 alone), and a `ptxas` assembles it. Which one (its
`get_ptxas`, 3.3 to 3.9): `ptxas-blackwell` from capability 10.0 (9.0 from 3.9 on) where the wheel
ships one, else `ptxas`; `TRITON_PTXAS_PATH` (`TRITON_PTXAS_BLACKWELL_PATH`) replaces either
(`scanner.layers.cuda_evidence.with_triton_ptxas`).
A `ptxas` knows the architectures of its CUDA release and no later one, so on a newer GPU every
kernel fails to build: "ptxas fatal: Value 'sm_121a' is not defined for option 'gpu-name'" (triton
3.4.0 and 3.5.1, CUDA 12.8, on a GB10). Before any of that, Triton builds its launcher with a C
compiler at first use (`runtime/build.py`: `$CC`, else `gcc` or `clang` on PATH); in an image with
none ("Failed to find C compiler", vllm-project/vllm#15329, sgl-project/sglang#1067: an image moved
from NVIDIA's `devel` base to `runtime`), Triton builds nothing on any GPU
(`TritonFacts.c_compiler`, `scanner.layers.cuda_evidence.c_compiler_on`); nor where its interpreter has
no `Python.h`, which that build includes ("fatal error: Python.h: No such file or directory",
sgl-project/sglang#1117: `TritonFacts.python_header`, `scanner.layers.python_headers`).

Which releases know which architectures is `placement.compiler_releases`'s table.

Where a package of the image compiles Triton kernels on its default path, as its own source says
(`DEFAULT_PATH_USERS`: vLLM, SGLang, mamba-ssm, Unsloth), the GPU is refused (`compile_refusal`). A
package is found among those shipping GPU code or among the distributions whose sources import
Triton (`TritonFacts.user_versions`), so pure-Python ones count too. vLLM from 0.8.0: its V1 engine
compiles the model with torch.compile unless run with `--enforce-eager`, and runs Triton kernels of
its own either way (fused MoE, Mamba, some attention backends); from 0.19.0 its model runner builds
the KV cache's slot mapping with a Triton kernel at every step, so `--enforce-eager` keeps Triton in
every model. vllm-project/vllm#32575 is vLLM failing so on a GB10, and vllm-project/vllm#29469 the
same with torch.compile turned off (`TORCHDYNAMO_DISABLE=1`).

Elsewhere it is a caveat: the answer says "runs without" Triton's kernels there, naming the packages
that import Triton (`compile_gap`). Whether other packages build a Triton kernel depends on how they
are used (torch only under torch.compile), which their sources do not say line by line.
"""

from __future__ import annotations

from collections.abc import Sequence

from placement.compiler_releases import CC, Release, compiles_for, release, releases_knowing
from placement.compiler_users import candidates, named
from scanner.layers.code_loading import release_of, release_parts
from scanner.models import PackageFacts, TritonFacts

# Packages that compile Triton kernels on their default path, as their source says: from each version
# on (ascending), why.
# vLLM's V1 engine (the default from 0.8.0: `VLLM_USE_V1` defaults to 1 in its `envs.py`) sets
# torch.compile's piecewise level with Inductor unless the model is run eager (`VllmConfig.__post_init__`).
# From 0.19.0 `BlockTable.compute_slot_mapping` (`v1/worker/block_table.py`), which the GPU model
# runner calls for every step's inputs, is a `@triton.jit` kernel (0.18.1 computed it in numpy).
DEFAULT_PATH_USERS: dict[str, tuple[tuple[tuple[int, ...], str], ...]] = {
    "vllm": (
        (
            (0, 8),
            "compiles its model with torch.compile (Triton kernels) unless run with --enforce-eager, and runs"
            " Triton kernels of its own (fused MoE, Mamba, some attention backends) either way",
        ),
        (
            (0, 19),
            "builds a Triton kernel at every step (its KV cache's slot mapping), --enforce-eager or not",
        ),
    ),
    # SGLang computes each prefill batch's positions with `compute_position_triton`
    # (`srt/model_executor/forward_batch_info.py`): on every attention backend in 0.3.6, on every one but
    # `torch_native` from 0.4.0 (read to 0.5.9); 0.3.5.post2 had no Triton there.
    "sglang": (
        (
            (0, 3, 6),
            "computes every prefill's positions with a Triton kernel (any attention backend but torch_native)",
        ),
    ),
    # mamba-ssm updates a model's recurrent state with a Triton kernel at each decoding step
    # (`selective_state_update`, taken wherever Triton imports: `modules/mamba_simple.py`, 1.0.1 to 2.3.1,
    # as transformers' Mamba does too), and Mamba-2 scans its inputs with Triton (`ssd_combined`).
    "mamba-ssm": (((1, 0), "updates its models' state with a Triton kernel at every decoding step"),),
    # Unsloth patches the models it loads with its own Triton kernels (`unsloth/kernels/`: RoPE, RMS norm,
    # cross-entropy), which every training step runs.
    "unsloth": (
        ((2024, 0), "runs its own Triton kernels (RoPE, RMS norm, cross-entropy) at every training step"),
    ),
}


def tool_for(triton: TritonFacts, cc: CC) -> str:
    """The `ptxas` tool Triton runs for compute capability `cc`."""
    capability = cc[0] * 10 + cc[1]
    newer = 90 if (release_of(triton.version) or (0, 0)) >= (3, 9) else 100
    return "ptxas-blackwell" if "ptxas-blackwell" in triton.ptxas and capability >= newer else "ptxas"


def arch_name(triton: TritonFacts, cc: CC) -> str:
    """The `--gpu-name` Triton asks its `ptxas` for."""
    capability = cc[0] * 10 + cc[1]
    specific = capability >= 90 if (release_of(triton.version) or (0, 0)) >= (3, 3) else capability == 90
    return f"sm_{capability}{'a' if specific else ''}"


NO_C_COMPILER = (
    "it finds no C compiler in the image (gcc or clang on its PATH, or $CC) to build its launcher with"
)
ADD_A_COMPILER = "a C compiler in the image (Debian's gcc, build-essential) gives it one"
NO_PYTHON_HEADER = "it finds no C header of its Python in the image"
ADD_PYTHON_HEADERS = "the interpreter's headers (Debian's python3-dev) give it them"


def _gap(triton: TritonFacts | None, cc: CC) -> tuple[str, str] | None:
    """Why Triton cannot build kernels on `cc`, and what gives it the means: no C compiler in the image
    (on every GPU), or "its ptxas (CUDA 12.8) does not know sm_121a"; None where it can, or where the
    compiler or the release of the `ptxas` it runs there is unknown."""
    if triton is None:
        return None
    if triton.c_compiler == "":
        return NO_C_COMPILER, ADD_A_COMPILER
    if triton.python_header == "" and triton.c_compiler is not None:  # where it builds with a compiler
        where = triton.python_include or "its interpreter's include directory"
        return f"{NO_PYTHON_HEADER} ({where}/Python.h) to build its launcher with", ADD_PYTHON_HEADERS
    tool = tool_for(triton, cc)
    cuda = release(triton.ptxas.get(tool, ""))
    if cuda is None or compiles_for(cuda, cc):
        return None
    return f"its {tool} (CUDA {cuda[0]}.{cuda[1]}) does not know {arch_name(triton, cc)}", ptxas_remedy(
        cuda, cc
    )


def ptxas_remedy(cuda: Release, cc: CC) -> str:
    """What `TRITON_PTXAS_PATH` can name instead of a `ptxas` of release `cuda`, which does not know
    `cc`: by the releases whose `ptxas` does."""
    releases = releases_knowing(cuda, cc)
    if releases is None:
        return "TRITON_PTXAS_PATH can name a newer ptxas"
    return f"TRITON_PTXAS_PATH can name a ptxas that knows it ({releases})"


def compile_gap(triton: TritonFacts | None, cc: CC) -> str | None:
    """Why Triton cannot build kernels on compute capability `cc`, as a "without" line, or None
    where it can (or the release of its `ptxas` is unknown)."""
    found = _gap(triton, cc)
    if triton is None or found is None:
        return None
    gap, remedy = found
    users = [user for user in triton.users if user != "triton"]
    shown = named(users)
    what = f"torch.compile, and the Triton kernels of {shown}" if users else "torch.compile"
    return f"{_name(triton)}'s kernels: {gap}, so nothing Triton compiles runs here ({what}); {remedy}"


def compile_refusal(triton: TritonFacts | None, packages: Sequence[PackageFacts], cc: CC) -> str | None:
    """Why the image does not run on compute capability `cc` for want of Triton's kernels, or None: a
    package that compiles Triton kernels on its default path (`DEFAULT_PATH_USERS`) meets a Triton
    that cannot build them there."""
    found = _gap(triton, cc)
    if triton is None or found is None:
        return None
    gap, remedy = found
    for package in candidates(triton.user_versions, packages):
        why = default_path_use(package)
        if why is not None:
            return (
                f"{_name(triton)} cannot compile kernels here: {gap}, and {package.name} {package.version}"
                f" {why}; {remedy}"
            )
    return None


def default_path_use(package: PackageFacts) -> str | None:
    """How `package` builds Triton kernels on its default path, at its version (`DEFAULT_PATH_USERS`), or
    None where it does not (or its version is not read)."""
    stages = DEFAULT_PATH_USERS.get(package.name) if package.kind == "python" else None
    version = release_parts(package.version) or (0, 0, 0)
    reached = [why for since, why in stages or () if version >= since]
    return reached[-1] if reached else None


def _name(triton: TritonFacts) -> str:
    return f"Triton {triton.version}" if triton.version else "Triton"
