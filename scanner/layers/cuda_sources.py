"""What each kind of file says about CUDA: the paths and names that carry evidence, and the
parsers of the small files among them (`torch/version.py`, TensorFlow's `build_info.py`,
conda-meta JSON, a toolkit's `version.json` / `version.txt`), of `*.dist-info` names and of ELF
DT_NEEDED SONAMEs. Pure, bounded by the caller's read. Text that is not what it should be gives no
finding (a version number of more than `VERSION_DIGITS` digits is not a CUDA version, and never
reaches `int()`, which refuses 4,300 digits); what Python's own parser cannot take at all
(`MemoryError`, `RecursionError` from `ast.parse`) is raised, and the collector makes it that file's
finding. Each gives a `Finding`; `scanner.layers.cuda_evidence` collects them per layer and merges
the layers.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, Field

from scanner.layers.cudaelf import AUDITWHEEL_HASH

Source = Literal["torch", "nvidia-wheel", "jax", "tensorflow", "cupy", "conda", "toolkit", "elf", "ptx"]
TORCH_VERSION = re.compile(r"/torch/version\.py$")
TF_BUILD_INFO = re.compile(r"/tensorflow/python/platform/build_info\.py$")
_NVIDIA_DIST = re.compile(r"^nvidia_([a-z0-9_]+?)(?:_cu(\d{2,3}))?-([0-9][^/-]*)\.dist-info$")
NVIDIA_LIB = re.compile(r"/nvidia/([a-z0-9_]+)/lib/lib([A-Za-z_]+)\.so\.(\d{1,6})(?!\d)")
JAX_DIR = re.compile(r"^(?:jax_cuda(\d{1,6})_(?:plugin|pjrt)|xla_cuda(\d{1,6}))$")
_JAX_DIST = re.compile(r"^jax_cuda(\d{1,6})_(?:plugin|pjrt)-([0-9][^/-]*)\.dist-info$")
_JAXLIB_DIST = re.compile(r"^jaxlib-[0-9][^/-]*\+cuda(\d{1,6})(?!\d)[^/-]*\.dist-info$")
_CUPY_DIST = re.compile(r"^cupy_cuda(\d{1,6})(x?)-([0-9][^/-]*)\.dist-info$")
CONDA_META = re.compile(r"/conda-meta/([^/]+)-([^-/]+)-([^-/]+)\.json$")
TOOLKIT_DIR = re.compile(r"^/usr/local/cuda-(\d{1,6})\.(\d{1,6})(?:/|$)")
TOOLKIT_VERSION_FILE = re.compile(r"^/usr/local/cuda(?:-\d+\.\d+)?/version\.(json|txt)$")
VERSION_DIGITS = 6  # digits in one part of a version: CUDA 12.9 needs 2; more is not a CUDA version
_DOTTED = re.compile(r"^(\d{1,6})(?:\.(\d{1,6}))?(?!\d)")
PYTORCH_BUILD = re.compile(r"cuda(\d{1,6})\.(\d{1,6})(?!\d)")

# Wheels whose version is the CUDA toolkit's own (12.1.105 -> 12.1); the others version separately.
TOOLKIT_VERSIONED_WHEELS = frozenset({"cuda_runtime", "cuda_nvrtc", "cuda_cupti", "cuda_nvcc"})
CONDA_PACKAGES = frozenset({"cudatoolkit", "cuda-cudart", "cuda-version", "pytorch"})
# SONAMEs whose number is the CUDA major (cuFFT, cuRAND, cuSOLVER, cuDNN, NCCL number their own; so
# does cuSPARSE since CUDA 13.0, which ships cuSPARSE 12.x as libcusparse.so.12, as torch 2.11.0+cu130's
# libtorch_cuda.so links it beside libcudart.so.13).
SONAME_IS_CUDA_MAJOR = frozenset({"cudart", "cublas", "cublasLt", "nvrtc", "cupti", "nvJitLink", "nvjpeg"})
_NEEDED = re.compile(r"^lib([A-Za-z_]+)" + AUDITWHEEL_HASH + r"\.so(?:\.(\d{1,6})(?!\d))?")


class Finding(BaseModel):
    """One piece of evidence. `cuda` None: it proves CUDA is there (or, with `no_cuda`, is not)
    without saying which version."""

    source: Source
    cuda: str | None = Field(default=None, pattern=r"^\d{1,6}(\.\d{1,6})?$")
    detail: str
    no_cuda: bool = Field(default=False, description="says this is a CPU/ROCm/XPU build")


# -- parsers of small files (pure, never raise)


def major_minor(version: str) -> str | None:
    match = _DOTTED.match(version.strip())
    if not match:
        return None
    return f"{int(match.group(1))}.{int(match.group(2))}" if match.group(2) else str(int(match.group(1)))


def parse_torch_version(text: str) -> str | Literal[False] | None:
    """`cuda` of torch/version.py: "12.1", None (a CPU/ROCm/XPU build), or False when unreadable."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    for node in tree.body:
        target: ast.expr | None = None
        value: ast.expr | None = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        if isinstance(target, ast.Name) and target.id == "cuda" and isinstance(value, ast.Constant):
            if value.value is None:
                return None
            if isinstance(value.value, str):
                return major_minor(value.value) or False
    return False


_TORCH_RELEASE = re.compile(r"""^__version__\s*(?::[^=]*)?=\s*['"]([0-9][0-9A-Za-z.+_-]{0,63})['"]""", re.M)


def parse_torch_release(text: str) -> str | None:
    """`__version__` of torch/version.py ("2.9.1+cu130"), or None."""
    match = _TORCH_RELEASE.search(text)
    return match.group(1) if match else None


def parse_tf_build_info(text: str) -> dict[str, object] | None:
    """The `build_info` mapping of TensorFlow's build_info.py (a dict or an OrderedDict of pairs)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target = node.targets[0]
        if not (isinstance(target, ast.Name) and target.id == "build_info"):
            continue
        value = node.value
        if isinstance(value, ast.Call) and len(value.args) == 1:
            value = value.args[0]  # collections.OrderedDict([(k, v), ...])
        try:
            literal = ast.literal_eval(value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        if isinstance(literal, dict):
            return {str(k): v for k, v in literal.items()}
        if isinstance(literal, list) and all(isinstance(p, tuple) and len(p) == 2 for p in literal):
            return {str(k): v for k, v in literal}
    return None


def tf_cuda_version(raw: str) -> str | None:
    """'12.1' -> 12.1; Windows '64_112' -> 11.2; '11' -> 11."""
    if "_" in raw:
        digits = raw.rsplit("_", 1)[1]
        return major_minor(f"{digits[:-1]}.{digits[-1]}") if len(digits) >= 2 and digits.isdigit() else None
    return major_minor(raw)


def parse_conda_meta(text: str) -> tuple[str, str] | None:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    version = data.get("version")
    return (data["name"], version) if isinstance(version, str) else None


def parse_toolkit_version(kind: str, text: str) -> str | None:
    if kind == "json":
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            return None
        cuda = data.get("cuda") if isinstance(data, dict) else None
        version = cuda.get("version") if isinstance(cuda, dict) else None
        return major_minor(version) if isinstance(version, str) else None
    match = re.search(r"CUDA Version (\d+\.\d+)", text)
    return major_minor(match.group(1)) if match else None


def dist_info_component(path: str) -> tuple[str, str] | None:
    """(dist-info dir path, its name) when `path` lies in or is a `*.dist-info` directory."""
    parts = path.split("/")
    for index, part in enumerate(parts):
        if part.endswith(".dist-info"):
            return "/".join(parts[: index + 1]), part
    return None


def dist_info_finding(name: str) -> Finding | None:
    """Evidence from a `*.dist-info` directory name, or None."""
    match = _NVIDIA_DIST.match(name)
    if match:
        component, suffix, version = match.groups()
        if version.startswith("0.0."):
            return None  # placeholder packages (nvidia-*-cu13 0.0.1, nvidia-*-cu110..116 0.0.1.dev5)
        if suffix is None:
            major = version.split(".", 1)[0]
            if (
                component not in TOOLKIT_VERSIONED_WHEELS
                or not major.isdigit()
                or len(major) > VERSION_DIGITS
                or int(major) < 13
            ):
                return None  # unsuffixed: CUDA 13+ toolkit wheels only (nvidia-ml-py is not CUDA)
            return Finding(
                source="nvidia-wheel", cuda=major_minor(version), detail=f"nvidia-{component} {version}"
            )
        major = suffix if len(suffix) == 2 else suffix[:2]
        pip_name = f"nvidia-{component.replace('_', '-')}-cu{suffix}"
        cuda = major_minor(version) if component in TOOLKIT_VERSIONED_WHEELS else major
        if cuda is not None and component in TOOLKIT_VERSIONED_WHEELS and cuda.split(".")[0] != major:
            cuda = major
        return Finding(source="nvidia-wheel", cuda=cuda, detail=f"{pip_name} {version}")
    match = _JAX_DIST.match(name)
    if match:
        return Finding(source="jax", cuda=match.group(1), detail=f"{name.removesuffix('.dist-info')}")
    match = _JAXLIB_DIST.match(name)
    if match:
        return Finding(source="jax", cuda=match.group(1), detail=f"{name.removesuffix('.dist-info')}")
    match = _CUPY_DIST.match(name)
    if match:
        digits, family, version = match.groups()
        if family:
            cuda = digits
        elif len(digits) == 3:
            cuda = f"{digits[:2]}.{digits[2]}"
        elif len(digits) == 2:
            cuda = f"{digits[0]}.{digits[1]}"
        else:
            return None
        return Finding(source="cupy", cuda=cuda, detail=f"cupy-cuda{digits}{family} {version}")
    return None


def needed_finding(needed: Sequence[str]) -> Finding:
    majors = []
    for soname in needed:
        match = _NEEDED.match(soname)
        if match and match.group(1) in SONAME_IS_CUDA_MAJOR and match.group(2):
            majors.append(int(match.group(2)))
    cuda = str(min(majors)) if majors else None
    return Finding(source="elf", cuda=cuda, detail=f"links {', '.join(needed)}")
