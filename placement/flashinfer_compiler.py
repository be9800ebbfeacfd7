"""Whether the image's FlashInfer can build its kernels for a GPU, and who needs them there. Pure.

FlashInfer (`flashinfer-python` on PyPI, every release from 0.2.0) ships CUDA sources and no built
kernel. At the first call of each of its kernel modules (sampling, attention, norms) it compiles the
module for the GPU at hand with `nvcc` and links it with a C++ compiler (`jit/core.py`,
`jit/cpp_ext.py`), unless the image carries the module built (`flashinfer-jit-cache`, or an AOT
build's `flashinfer/data/aot/`). Which tools it finds is the scan's answer
(`scanner.layers.cuda_jit_tools`); what stops it on a GPU (`_gap`), in the order it meets them:

* no `nvcc` ("Could not find nvcc and default cuda_home='/usr/local/cuda' doesn't exist"): every GPU;
  vllm-project/vllm#49497 and flashinfer-ai/flashinfer#1781 are vLLM dying so at start-up;
* no C++ compiler (`$CXX`, else `c++`): every GPU;
* its own minimum, compute capability 7.5 (`check_cuda_arch`, run by every module's spec, built ahead
  or not): every GPU below it;
* its own rule for compute capability 12.x (`CompilationContext._normalize_cuda_arch`): from 0.6.7
  it asks CUDA 12.9 of its `nvcc` there ("SM 12.x requires CUDA >= 12.9"); from 0.7.1, 12.8 for 12.0;
* an `nvcc` whose release does not know the GPU (`placement.compiler_releases`).

Nothing is claimed where the image carries built kernels (which modules and architectures they hold
is not read), or where a tool or its release is unknown (a path the image does not carry).

Where a package of the image calls FlashInfer's kernels on its default path on that GPU, as its own
source says (`DEFAULT_PATH_USERS`), the GPU is refused (`flashinfer_refusal`); elsewhere the answer
says what runs without them (`flashinfer_gap`):

* vLLM samples with FlashInfer's top-k/top-p kernels in its V1 engine, and its start-up profiling
  runs them whatever the requests will be (`_dummy_sampler_run`, `top_p=0.9`): from 0.9.0 where
  FlashInfer imports (0.8 and 0.9.0 to 0.10.0 compare its version as text with "0.2.3"), off by
  default from 0.11.1, on again from 0.21.0 on compute capability 7.5 to 12.1 (8.0 from 0.24.0).
  From 0.31.0 it samples without them where FlashInfer's own check of the GPU fails (its 12.x rule),
  and on GPUs of 16 streaming multiprocessors or fewer (every Jetson Orin, compute capability 8.7).
  `VLLM_USE_FLASHINFER_SAMPLER=0` turns the sampler off. Its attention backend is FlashInfer by
  default on compute capability 10.0 from 0.9.1, on any 10.x from 0.11.1, and on 7.5 from 0.11.1 to
  0.23 (FlashAttention needs 8.0), unless `VLLM_ATTENTION_BACKEND` names another.
* SGLang's default attention backend for models without MLA is FlashInfer where it is installed
  (`server_args.py`): on every GPU up to 0.4.4, and on every GPU but Hopper from 0.4.5 (FlashAttention
  3 there: for the models it lists until 0.5.7, for every one from 0.5.8); on compute capability 10.x
  from 0.5.7 its `trtllm_mha` backend, a subclass of it, also builds FlashInfer's launcher. Models
  with MLA (DeepSeek's) take Triton's kernels on GPUs other than Hopper and Blackwell: which model an
  image serves is not in its names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from placement.compiler_releases import CC, Release, compiles_for, release, releases_knowing
from placement.compiler_users import candidates, named
from scanner.layers.code_loading import release_parts
from scanner.models import FlashInferFacts, PackageFacts

GapKind = Literal["tool", "family", "arch"]

NO_NVCC = (
    "it finds no nvcc in the image ($CUDA_HOME, $CUDA_PATH, PATH or /usr/local/cuda) to compile them with"
)
ADD_NVCC = "a CUDA toolkit in the image (NVIDIA's devel images) gives it one, or flashinfer-jit-cache its kernels built"
NO_CXX = "it finds no C++ compiler in the image (c++ on its PATH, or $CXX) to link them with"
ADD_CXX = "a C++ compiler in the image (Debian's g++, build-essential) gives it one"
SAMPLER_FROM = (0, 21, 0)  # vLLM's FlashInfer sampler on by default again
SAMPLER_FLOOR: dict[tuple[int, ...], CC] = {(0, 21, 0): (7, 5), (0, 24, 0): (8, 0)}
SAMPLER_PREFLIGHT_FROM = (0, 31, 0)  # vLLM samples natively where FlashInfer's own GPU check fails
JETSON_ORIN: CC = (8, 7)  # 16 streaming multiprocessors or fewer in every model
OLDEST_TARGET: CC = (
    7,
    5,
)  # `check_cuda_arch`, which every module's spec runs: "requires GPUs with sm75 or higher"


def target(version: str | None, cc: CC) -> str:
    """The architecture FlashInfer compiles for on `cc`, as its `_normalize_cuda_arch` names it."""
    capability = cc[0] * 10 + cc[1]
    parts = release_parts(version) or (0, 0, 0)
    family = cc[0] == 12 and parts >= (0, 6, 7) and (cc == (12, 0) or parts < (0, 6, 8))
    return f"sm_{capability}{'f' if family else 'a' if cc >= (9, 0) else ''}"


def _family_floor(version: str | None, cc: CC) -> Release | None:
    """The `nvcc` release FlashInfer `version` itself asks for on `cc`, or None where it asks none."""
    parts = release_parts(version) or (0, 0, 0)
    if cc[0] != 12 or parts < (0, 6, 7):
        return None
    return (12, 8) if parts >= (0, 7, 1) and cc == (12, 0) else (12, 9)


def _gap(flashinfer: FlashInferFacts | None, cc: CC) -> tuple[GapKind, str, str] | None:
    """What stops FlashInfer building its kernels on `cc`: its kind, the words, and what gives it the
    means ("" where nothing in the image can); None where it can, carries them built, or a tool it runs
    is unknown."""
    if flashinfer is None:
        return None
    if cc < OLDEST_TARGET:  # its own check, before any module is built or loaded
        return "family", "it builds and loads them for compute capability 7.5 and later only", ""
    if flashinfer.prebuilt:
        return None
    if flashinfer.nvcc == "":
        return "tool", NO_NVCC, ADD_NVCC
    if flashinfer.cxx == "":
        return "tool", NO_CXX, ADD_CXX
    cuda = release(flashinfer.nvcc_release or "")
    if cuda is None:
        return None
    floor = _family_floor(flashinfer.version, cc)
    releases = releases_knowing(cuda, cc)
    remedy = "FLASHINFER_NVCC or CUDA_HOME can name " + (
        f"an nvcc that knows it ({releases})" if releases is not None else "a newer nvcc"
    )
    if floor is not None and cuda < floor:
        asks = f"{floor[0]}.{floor[1]}"
        return (
            "family",
            f"it asks CUDA {asks} or later of its nvcc on compute capability {cc[0]}.x, and its nvcc is"
            f" CUDA {cuda[0]}.{cuda[1]}",
            f"FLASHINFER_NVCC or CUDA_HOME can name an nvcc of CUDA {asks} or later",
        )
    if not compiles_for(cuda, cc):
        arch = target(flashinfer.version, cc)
        return "arch", f"its nvcc (CUDA {cuda[0]}.{cuda[1]}) does not know {arch}", remedy
    return None


def _vllm_sampler(version: tuple[int, int, int], flashinfer: FlashInferFacts, cc: CC, kind: GapKind) -> bool:
    """Whether vLLM `version` samples with FlashInfer's kernels on `cc` by default (module docstring)."""
    setting = flashinfer.settings.get("VLLM_USE_FLASHINFER_SAMPLER", "").strip()
    if setting == "0":
        return False
    text = flashinfer.version or ""
    if version < (0, 8, 0):
        return False
    if version < (0, 9, 0):
        return text < "0.2.3"  # as vLLM 0.8 compares them: as text
    if version < (0, 10, 1):
        return text >= "0.2.3"
    if version < (0, 11, 1):
        return (release_parts(text) or (0, 0, 0)) >= (0, 2, 3)
    if version < SAMPLER_FROM:
        return setting not in ("", "0")  # only where the image opts in
    floor = max((f for since, f in SAMPLER_FLOOR.items() if version >= since), default=(7, 5))
    if not floor <= cc <= (12, 1):
        return False
    if version >= SAMPLER_PREFLIGHT_FROM:  # not on 16 SMs or fewer (every Jetson Orin), nor where
        return cc != JETSON_ORIN and kind != "family"  # FlashInfer's own check of the GPU fails
    return True


def _vllm_attention(version: tuple[int, int, int], flashinfer: FlashInferFacts, cc: CC) -> bool:
    """Whether vLLM `version`'s attention backend is FlashInfer on `cc` by default."""
    backend = flashinfer.settings.get("VLLM_ATTENTION_BACKEND", "").strip()
    if backend:
        return backend == "FLASHINFER"
    if version < (0, 9, 1):
        return False
    if version < (0, 11, 1):
        return cc == (10, 0)
    return cc[0] == 10 or (cc == (7, 5) and version < (0, 24, 0))


def _vllm(version: str, flashinfer: FlashInferFacts, cc: CC, kind: GapKind) -> str | None:
    parts = release_parts(version) or (0, 0, 0)
    if _vllm_sampler(parts, flashinfer, cc, kind):
        return (
            "samples with FlashInfer's top-k/top-p kernels, at start-up whatever the requests"
            " (VLLM_USE_FLASHINFER_SAMPLER=0 turns that off)"
        )
    if _vllm_attention(parts, flashinfer, cc):
        return "takes FlashInfer's attention kernels on this GPU by default (another --attention-backend avoids it)"
    return None


def _sglang(version: str, flashinfer: FlashInferFacts, cc: CC, kind: GapKind) -> str | None:
    parts = release_parts(version) or (0, 0, 0)
    if parts < (0, 3, 0) or (cc[0] == 9 and parts >= (0, 4, 5)):
        return None
    return (
        "takes FlashInfer's attention kernels for models without MLA by default on this GPU (another"
        " --attention-backend avoids it)"
    )


# Packages that call FlashInfer's kernels on their default path, as their source says: name -> how, on a
# GPU, given the gap's kind (module docstring).
DEFAULT_PATH_USERS: dict[str, Callable[[str, FlashInferFacts, CC, GapKind], str | None]] = {
    "vllm": _vllm,
    "sglang": _sglang,
}


def default_path_use(package: PackageFacts, flashinfer: FlashInferFacts, cc: CC, kind: GapKind) -> str | None:
    """How `package` calls FlashInfer's kernels on `cc` on its default path, or None where it does not."""
    judge = DEFAULT_PATH_USERS.get(package.name) if package.kind == "python" else None
    return judge(package.version or "", flashinfer, cc, kind) if judge is not None else None


def flashinfer_refusal(
    flashinfer: FlashInferFacts | None, packages: Sequence[PackageFacts], cc: CC
) -> str | None:
    """Why the image does not run on `cc` for want of FlashInfer's kernels, or None: a package calls them
    on its default path there (`DEFAULT_PATH_USERS`) and FlashInfer cannot build them."""
    found = _gap(flashinfer, cc)
    if flashinfer is None or found is None:
        return None
    kind, gap, remedy = found
    for package in candidates(flashinfer.user_versions, packages):
        why = default_path_use(package, flashinfer, cc, kind)
        if why is not None:
            return (
                f"{_name(flashinfer)} cannot build its kernels here: {gap}, and {package.name}"
                f" {package.version} {why}" + (f"; {remedy}" if remedy else "")
            )
    return None


def flashinfer_gap(flashinfer: FlashInferFacts | None, cc: CC) -> str | None:
    """Why FlashInfer cannot build its kernels on `cc`, as a "without" line, or None where it can (or
    what it would build with is unknown)."""
    found = _gap(flashinfer, cc)
    if flashinfer is None or found is None:
        return None
    _, gap, remedy = found
    users = [user for user in flashinfer.users if user != "flashinfer"]
    shown = named(users)
    what = f" ({shown} import{'s' if len(users) == 1 else ''} it)" if users else ""
    return f"{_name(flashinfer)}'s kernels: {gap}, so none of them builds here{what}" + (
        f"; {remedy}" if remedy else ""
    )


def _name(flashinfer: FlashInferFacts) -> str:
    return f"FlashInfer {flashinfer.version}" if flashinfer.version else "FlashInfer"
