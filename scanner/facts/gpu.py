"""Image config -> GpuFacts: does the image ask for an NVIDIA GPU, and on what terms.

Pure: it reads only the parsed image config JSON (`config.Env`, `config.Labels`) and
tolerates missing, null or garbage fields, because registries serve whatever was pushed.

Semantics follow NVIDIA's own code (see the shared nvidia_semantics note):
- `required` is our product signal: any of `NVIDIA_GPU` (a convention of ours and some
  images; NVIDIA's toolkit does not read it), `NVIDIA_REQUIRE_CUDA`, `CUDA_VERSION`,
  `NVIDIA_VISIBLE_DEVICES` selecting devices (not empty/`void`/`none`), or the nvidia-docker
  v1 label `com.nvidia.volumes.needed` (whose presence makes `nvidia-docker run` inject all
  GPUs and the driver volume). Empty values do not count, as in the toolkit.
- `runtime_gpu_request` is what the toolkit itself would do from the env alone:
  NVIDIA_VISIBLE_DEVICES set to anything but ""/`void`, or a legacy image with it unset.
- `requirements` are the NVIDIA_REQUIRE_* values ordered by variable name, without
  NVIDIA_REQUIRE_JETPACK* (Tegra mount flags the toolkit excludes; they stay in `env`).
- `effective_requirements` is what the runtime hook checks: nothing when
  NVIDIA_DISABLE_REQUIRE parses true with Go's strconv.ParseBool, else the requirements plus
  `cuda>=MAJOR.MINOR` for legacy images (CUDA_VERSION set, NVIDIA_REQUIRE_CUDA unset/empty).
- A requirement that NVIDIA's grammar rejects becomes a RequirementIssue, never an exception.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from scanner.facts.require_grammar import latent_error, parse_requirement_lenient
from scanner.layers.code_loading import build_digits_version
from scanner.models import DEFAULT_PATH, GpuFacts, RequirementIssue

REQUIRE_PREFIX = "NVIDIA_REQUIRE_"
JETPACK_PREFIX = "NVIDIA_REQUIRE_JETPACK"
V1_VOLUMES_LABEL = "com.nvidia.volumes.needed"
V1_CUDA_LABEL = "com.nvidia.cuda.version"

# Go's strconv.ParseBool true values: the only ones NVIDIA_DISABLE_REQUIRE honours.
_PARSEBOOL_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
# NVIDIA_GPU is not NVIDIA's; we read an explicit "no" as no.
_FALSEY = frozenset({"0", "false", "no", "off", "n", "f"})
_UINT32_MAX = 0xFFFFFFFF
# Masterminds/semver's identifier alphabet for pre-release and build parts (ASCII only).
_SEMVER_IDENTIFIER = re.compile(r"[0-9A-Za-z-]+", re.ASCII)
_DIGITS = re.compile(r"[0-9]+", re.ASCII)
# MAJOR[.MINOR], leading zeros dropped; a part of more than 9 digits is no version (and never meets
# int(), which refuses 4,300 digits).
_DOTTED = re.compile(r"^0*(\d{1,9})(?:\.0*(\d{1,9}))?(?!\d)")


def _config_section(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The runtime `config` object (`Config` in some old Docker dumps); {} when absent or junk."""
    if not isinstance(config, Mapping):
        return {}
    for key in ("config", "Config"):
        section = config.get(key)
        if isinstance(section, Mapping):
            return section
    return {}


def parse_env(raw: Any) -> dict[str, str]:
    """`["K=V", ...]` -> dict; later duplicates win (as Docker applies them); junk is skipped."""
    env: dict[str, str] = {}
    if not isinstance(raw, list):
        return env
    for item in raw:
        if not isinstance(item, str) or "=" not in item:
            continue
        name, _, value = item.partition("=")
        if name:
            env[name] = value
    return env


def _parse_labels(raw: Any) -> dict[str, str]:
    if not isinstance(raw, Mapping):
        return {}
    return {str(k): v if isinstance(v, str) else str(v) for k, v in raw.items() if v is not None}


def _valid_identifiers(text: str) -> bool:
    """Dot-separated, non-empty identifiers of [0-9A-Za-z-]."""
    return all(_SEMVER_IDENTIFIER.fullmatch(part) for part in text.split("."))


def parse_cuda_version(cuda_version: str) -> tuple[int, int, int] | None:
    """CUDA_VERSION as the toolkit's Masterminds/semver `NewVersion` (coercing) reads it, else None.

    An optional lowercase `v`; build metadata after the first `+` and a pre-release after the first
    `-`, each dot-separated non-empty [0-9A-Za-z-] identifiers, numeric pre-release identifiers
    without leading zeros; then one to three dot-separated runs of ASCII digits (leading zeros are
    coerced). No whitespace is trimmed: `' 11.6'` fails in the toolkit, so it fails here. Segments
    beyond uint32 are refused, as in the toolkit's own test table (`9.4294967296`).
    """
    text = cuda_version.removeprefix("v")
    text, plus, metadata = text.partition("+")
    if plus and not _valid_identifiers(metadata):
        return None
    text, dash, prerelease = text.partition("-")
    if dash:
        if not _valid_identifiers(prerelease):
            return None
        if any(
            _DIGITS.fullmatch(part) and len(part) > 1 and part[0] == "0" for part in prerelease.split(".")
        ):
            return None
    segments = text.split(".")
    if len(segments) > 3 or not all(_DIGITS.fullmatch(segment) for segment in segments):
        return None
    significant = [segment.lstrip("0") or "0" for segment in segments]  # coerced, as the toolkit does
    if any(len(segment) > len(str(_UINT32_MAX)) for segment in significant):
        return None
    numbers = [int(segment) for segment in significant] + [0] * (3 - len(segments))
    if any(number > _UINT32_MAX for number in numbers):
        return None
    return numbers[0], numbers[1], numbers[2]


def cuda_major_minor(cuda_version: str) -> str | None:
    """CUDA_VERSION -> "MAJOR.MINOR" the way the toolkit derives it ("9.0.116" -> "9.0", "8" -> "8.0").

    None when the toolkit would reject the value (e.g. "9.", "7.foo", "9.0.116.50", " 11.6").
    """
    parsed = parse_cuda_version(cuda_version)
    return None if parsed is None else f"{parsed[0]}.{parsed[1]}"


def _cuda_from_requirement(value: str) -> str | None:
    """MAJOR.MINOR of the first `cuda>=X.Y` factor (key matched case-insensitively, like dsl.c)."""
    for condition in parse_requirement_lenient(value).conditions:
        if condition.key.lower() == "cuda" and condition.op == ">=" and condition.valid:
            match = _DOTTED.match(condition.value)
            if match:
                return f"{int(match.group(1))}.{int(match.group(2) or 0)}"
    return None


def _selects_devices(visible_devices: str) -> bool:
    """NVIDIA_VISIBLE_DEVICES naming real devices: not empty, `void` or `none`."""
    items = [item.strip() for item in visible_devices.split(",") if item.strip()]
    if not items or "void" in items:
        return False
    return items[0] != "none"


# Variables of an image's config that name the build of a library a package loads among its builds
# for several CUDA versions, bypassing its own choice: package -> variable. bitsandbytes 0.43 to 0.50
# (`cextension.py`) then loads `libbitsandbytes_cuda{value}.so`, and no other.
BUILD_OVERRIDE_VARIABLES = {"bitsandbytes": "BNB_CUDA_VERSION"}


def build_overrides(env: Mapping[str, str]) -> dict[str, str]:
    """package -> the CUDA version ("12.4") whose build a config variable makes it load. A value of
    two or three digits names one, read as a build's file name tags it ("124": 12.4, "13": 13); an
    empty value is no override, as bitsandbytes reads it; anything else names no build a wheel ships
    and is left out."""
    found: dict[str, str] = {}
    for package, variable in BUILD_OVERRIDE_VARIABLES.items():
        value = env.get(variable, "").strip()
        if value.isascii() and value.isdigit() and len(value) in (2, 3):
            found[package] = build_digits_version(value)  # as the build's own file name tags it
    return found


# Variables of an image's config that name the `ptxas` Triton runs instead of its own copy (its
# `knobs.py`; 3.3 spells the second `TRITON_PTXAS-BLACKWELL_PATH`): variable -> the tool it replaces.
TRITON_PTXAS_VARIABLES = {
    "TRITON_PTXAS_PATH": "ptxas",
    "TRITON_PTXAS_BLACKWELL_PATH": "ptxas-blackwell",
    "TRITON_PTXAS-BLACKWELL_PATH": "ptxas-blackwell",
}


def triton_ptxas(env: Mapping[str, str]) -> dict[str, str]:
    """Tool -> the absolute path a config variable makes Triton run (an empty or relative value, which
    the image's working directory would resolve, is left out)."""
    return {
        tool: env[variable].strip()
        for variable, tool in TRITON_PTXAS_VARIABLES.items()
        if env.get(variable, "").strip().startswith("/")
    }


# Variables of an image's config that decide FlashInfer's kernels: the tools it compiles them with
# (`jit/cpp_ext.py`: its CUDA home, its `nvcc` (`PYTORCH_NVCC` before 0.4), its C++ compiler), and whether
# vLLM calls them by default (its sampler, its attention backend: `envs.py`); the same home and C++ compiler
# serve tvm-ffi and torch's `cpp_extension`, whose builds target `TORCH_CUDA_ARCH_LIST` where it is set.
# CuPy's `CUPY_COMPILE_WITH_PTX` makes its NVRTC write PTX rather than a cubin (`placement.cupy_compiler`).
# JAX's `CUDA_ROOT` names the `ptxas` XLA runs, and `XLA_FLAGS` may let the driver compile (`placement.jax_compiler`).
# numba-cuda's `NUMBA_FORCE_CUDA_CC` replaces the GPU's architecture in its compiles, and before 0.23
# `NUMBA_CUDA_USE_NVIDIA_BINDING=0` has the driver link them (`placement.numba_compiler`).
FLASHINFER_VARIABLES = (
    "CUDA_HOME",
    "CUDA_PATH",
    "FLASHINFER_NVCC",
    "PYTORCH_NVCC",
    "CXX",
    "VLLM_USE_FLASHINFER_SAMPLER",
    "VLLM_ATTENTION_BACKEND",
    "TORCH_CUDA_ARCH_LIST",
    "CUPY_COMPILE_WITH_PTX",
    "CUDA_ROOT",
    "XLA_FLAGS",
    "NUMBA_FORCE_CUDA_CC",
    "NUMBA_CUDA_USE_NVIDIA_BINDING",
)


def flashinfer_env(env: Mapping[str, str]) -> dict[str, str]:
    """Variable -> its value, for those of `FLASHINFER_VARIABLES` the config sets to a non-empty value."""
    return {name: env[name].strip() for name in FLASHINFER_VARIABLES if env.get(name, "").strip()}


def executable_path(env: Mapping[str, str]) -> list[str]:
    """The absolute directories of the config's `PATH`, in order (Docker's default where it sets none)."""
    if "PATH" not in env:
        return list(DEFAULT_PATH)
    return [part.rstrip("/") or "/" for part in env["PATH"].split(":") if part.startswith("/")]


def gpu_facts(config: Mapping[str, Any]) -> GpuFacts:
    """What the image config says about NVIDIA GPUs. Never raises on odd input."""
    section = _config_section(config)
    env = parse_env(section.get("Env"))
    labels = _parse_labels(section.get("Labels"))

    nvidia_env = {k: env[k] for k in sorted(env) if k.startswith(("NVIDIA_", "CUDA_"))}
    nvidia_labels = {k: labels[k] for k in sorted(labels) if k.startswith("com.nvidia.")}
    require_vars = sorted(
        k for k in nvidia_env if k.startswith(REQUIRE_PREFIX) and not k.startswith(JETPACK_PREFIX)
    )
    requirements = [nvidia_env[k] for k in require_vars]

    visible_devices = env.get("NVIDIA_VISIBLE_DEVICES")
    cuda_version_raw = env.get("CUDA_VERSION", "")
    require_cuda = env.get("NVIDIA_REQUIRE_CUDA", "")
    legacy = bool(cuda_version_raw) and not require_cuda
    disable_require = env.get("NVIDIA_DISABLE_REQUIRE", "") in _PARSEBOOL_TRUE

    signals: list[str] = []
    nvidia_gpu = env.get("NVIDIA_GPU", "").strip()
    if nvidia_gpu and nvidia_gpu.lower() not in _FALSEY:
        signals.append("NVIDIA_GPU")
    if require_cuda:
        signals.append("NVIDIA_REQUIRE_CUDA")
    if cuda_version_raw:
        signals.append("CUDA_VERSION")
    if visible_devices is not None and _selects_devices(visible_devices):
        signals.append("NVIDIA_VISIBLE_DEVICES")
    if V1_VOLUMES_LABEL in labels:
        signals.append(V1_VOLUMES_LABEL)

    if visible_devices is None:
        runtime_gpu_request = legacy
    else:
        items = [item.strip() for item in visible_devices.split(",") if item.strip()]
        runtime_gpu_request = bool(items) and "void" not in items

    issues: list[RequirementIssue] = []
    for name in require_vars:
        # One issue per malformed clause: the runtime fails on whichever one its evaluation reaches.
        # (Also well-formed clauses the runtime still rejects: too long, numbers too large.)
        conditions = parse_requirement_lenient(nvidia_env[name]).conditions
        issues.extend(
            RequirementIssue(variable=name, value=nvidia_env[name], error=error)
            for condition in conditions
            if (error := condition.error or latent_error(condition)) is not None
        )

    cuda_version = cuda_major_minor(cuda_version_raw) if cuda_version_raw else None
    if cuda_version_raw and cuda_version is None and legacy and not disable_require:
        issues.append(
            RequirementIssue(
                variable="CUDA_VERSION",
                value=cuda_version_raw,
                error=f"CUDA_VERSION {cuda_version_raw!r} is not a version NVIDIA's runtime hook can "
                "parse; a legacy image with it fails to start",
            )
        )
    if cuda_version is None and require_cuda:
        cuda_version = _cuda_from_requirement(require_cuda)
    if cuda_version is None and V1_CUDA_LABEL in labels:
        match = _DOTTED.match(labels[V1_CUDA_LABEL].strip())
        cuda_version = f"{int(match.group(1))}.{int(match.group(2) or 0)}" if match else None

    effective: list[str] = []
    if not disable_require:
        effective = list(requirements)
        legacy_cuda = cuda_major_minor(cuda_version_raw) if legacy else None
        if legacy_cuda is not None:
            effective.append(f"cuda>={legacy_cuda}")

    return GpuFacts(
        required=bool(signals),
        cuda_version=cuda_version,
        requirements=requirements,
        env=nvidia_env,
        labels=nvidia_labels,
        signals=signals,
        disable_require=disable_require,
        visible_devices=visible_devices,
        driver_capabilities=env.get("NVIDIA_DRIVER_CAPABILITIES"),
        requirement_errors=issues,
        legacy=legacy,
        effective_requirements=effective,
        runtime_gpu_request=runtime_gpu_request,
        build_overrides=build_overrides(env),
        triton_ptxas=triton_ptxas(env),
        executable_path=executable_path(env),
        c_compiler=env.get("CC") or None,
        flashinfer_env=flashinfer_env(env),
    )
