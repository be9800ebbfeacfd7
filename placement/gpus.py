"""GPU model names, brands and memory sizes: the fuzzy parts of matching a request to a GPU.

* Model aliases: people say `h100`, `a100-80gb` or `t4`; NVML says `NVIDIA H100 80GB HBM3`,
  `NVIDIA A100-SXM4-80GB`, `Tesla T4`; GFD says `NVIDIA-H100-80GB-HBM3`. Every spelling is
  squashed to lowercase letters and digits before comparing, and each known NVML name carries
  the short aliases it answers to (table from NVIDIA's GPU pages and real nvidia-smi captures).
* Brands: the runtime's `brand=` check sees libnvidia-container's names (`Tesla`, `Nvidia`, ...),
  and libnvidia-container builds before 2022 report `Unknown` for every brand after TITAN, which
  includes the `NVIDIA` brand of today's data-center GPUs. Both names are kept as candidates.
* Memory: NVML totals sit below marketing sizes (a "16GB" T4 reports 15360 MiB, a "48GB" L40S
  46068 MiB, an A100-40GB 39538 or 40960 MiB depending on the driver), so a minimum matches when
  the reported total is within MEMORY_TOLERANCE of it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

# A GPU satisfies `min_gpu_memory` when it reports at least (1 - 8%) of it. 8% admits every card's
# NVML total against its marketing size in binary units (T4 15360/16384 = 93.8%, A10G 23028/24576
# = 93.7%, L40S 46068/49152 = 93.7%), while neighbouring sizes stay apart (32 GB vs 40Gi is 80%).
MEMORY_TOLERANCE = 0.08

_MIB = 1024 * 1024
_NON_ALNUM = re.compile(r"[^a-z0-9]+")
_VENDOR_WORDS = ("nvidia", "tesla", "geforce", "quadro")


def squash(text: str) -> str:
    """Lowercase letters and digits only: `A100-80GB`, `a100 80gb`, `a100_80gb` all compare equal."""
    return _NON_ALNUM.sub("", text.lower())


@dataclass(frozen=True, slots=True)
class GpuModel:
    """One NVML product name and the short names people use for it."""

    nvml_name: str
    aliases: tuple[str, ...]
    compute_capability: str
    memory_gb: int | None = None


# From the GPU table in the placement reference (NVML names as reported by nvidia-smi / RunPod IDs,
# CC from developer.nvidia.com/cuda-gpus). Aliases are listed most specific first.
GPU_MODELS: tuple[GpuModel, ...] = (
    GpuModel("NVIDIA H100 80GB HBM3", ("h100-sxm5", "h100-sxm", "h100-80gb", "h100"), "9.0", 80),
    GpuModel("NVIDIA H100 PCIe", ("h100-pcie", "h100-80gb", "h100"), "9.0", 80),
    GpuModel("NVIDIA H100 NVL", ("h100-nvl", "h100-94gb", "h100"), "9.0", 94),
    GpuModel("NVIDIA H200", ("h200-141gb", "h200"), "9.0", 141),
    GpuModel("NVIDIA B200", ("b200-180gb", "b200"), "10.0", 180),
    GpuModel("NVIDIA GB200", ("gb200",), "10.0", 186),
    GpuModel("NVIDIA GB300", ("gb300",), "10.3", 288),
    GpuModel(
        "NVIDIA A100-SXM4-40GB", ("a100-sxm4-40gb", "a100-sxm4", "a100-sxm", "a100-40gb", "a100"), "8.0", 40
    ),
    GpuModel(
        "NVIDIA A100-SXM4-80GB", ("a100-sxm4-80gb", "a100-sxm4", "a100-sxm", "a100-80gb", "a100"), "8.0", 80
    ),
    GpuModel("NVIDIA A100-PCIE-40GB", ("a100-pcie-40gb", "a100-pcie", "a100-40gb", "a100"), "8.0", 40),
    GpuModel("NVIDIA A100 80GB PCIe", ("a100-pcie-80gb", "a100-pcie", "a100-80gb", "a100"), "8.0", 80),
    GpuModel("NVIDIA A30", ("a30-24gb", "a30"), "8.0", 24),
    GpuModel("NVIDIA A10G", ("a10g-24gb", "a10g"), "8.6", 24),
    GpuModel("NVIDIA A10", ("a10-24gb", "a10"), "8.6", 24),
    GpuModel("NVIDIA L40S", ("l40s-48gb", "l40s"), "8.9", 48),
    GpuModel("NVIDIA L40", ("l40-48gb", "l40"), "8.9", 48),
    GpuModel("NVIDIA L4", ("l4-24gb", "l4"), "8.9", 24),
    GpuModel("Tesla T4", ("t4-16gb", "t4"), "7.5", 16),
    GpuModel("NVIDIA T4", ("t4-16gb", "t4"), "7.5", 16),
    GpuModel("Tesla V100-SXM2-16GB", ("v100-sxm2-16gb", "v100-sxm2", "v100-16gb", "v100"), "7.0", 16),
    GpuModel("Tesla V100-SXM2-32GB", ("v100-sxm2-32gb", "v100-sxm2", "v100-32gb", "v100"), "7.0", 32),
    GpuModel("Tesla V100-PCIE-16GB", ("v100-pcie-16gb", "v100-pcie", "v100-16gb", "v100"), "7.0", 16),
    GpuModel("Tesla V100-PCIE-32GB", ("v100-pcie-32gb", "v100-pcie", "v100-32gb", "v100"), "7.0", 32),
    GpuModel("Tesla P100-PCIE-16GB", ("p100-16gb", "p100"), "6.0", 16),
    GpuModel("Tesla P40", ("p40-24gb", "p40"), "6.1", 24),
    GpuModel("Tesla P4", ("p4-8gb", "p4"), "6.1", 8),
    GpuModel("NVIDIA RTX A6000", ("rtx-a6000", "a6000"), "8.6", 48),
    GpuModel("NVIDIA RTX 6000 Ada Generation", ("rtx-6000-ada", "rtx6000-ada"), "8.9", 48),
    GpuModel(
        "NVIDIA RTX PRO 6000 Blackwell Server Edition", ("rtx-pro-6000-server", "rtx-pro-6000"), "12.0", 96
    ),
    GpuModel("NVIDIA GeForce RTX 5090", ("rtx-5090", "5090"), "12.0", 32),
    GpuModel("NVIDIA GeForce RTX 4090", ("rtx-4090", "4090"), "8.9", 24),
    GpuModel("NVIDIA GeForce RTX 3090", ("rtx-3090", "3090"), "8.6", 24),
    GpuModel("NVIDIA GeForce RTX 2080", ("rtx-2080", "2080"), "7.5", 8),
)
_BY_NAME: dict[str, GpuModel] = {squash(m.nvml_name): m for m in GPU_MODELS}
_FAMILY = re.compile(r"^(?:rtx)?[a-z]{0,3}\d{1,4}[a-z]?$")
_SIZE = re.compile(r"(\d+)gb")


def known_model(nvml_name: str) -> GpuModel | None:
    return _BY_NAME.get(squash(nvml_name))


@lru_cache(maxsize=4096)
def model_keys(nvml_name: str) -> frozenset[str]:
    """Every squashed name this GPU answers to: full NVML/GFD name, short aliases, family(-size)."""
    full = squash(nvml_name)
    keys = {full}
    model = _BY_NAME.get(full)
    if model is not None:
        keys.update(squash(alias) for alias in model.aliases)
        return frozenset(keys)
    # Unknown product: derive `family` and `family-NNgb` from the name, as SkyPilot's GFD mapping does.
    words = [w for w in re.split(r"[^a-z0-9]+", nvml_name.lower()) if w and w not in _VENDOR_WORDS]
    rest = "".join(words)
    keys.add(rest)
    family = "".join(words[:2]) if words[:1] == ["rtx"] else "".join(words[:1])
    if _FAMILY.match(family):
        keys.add(family)
        sizes = [w for w in words if _SIZE.fullmatch(w)]
        if sizes:
            keys.add(f"{family}{sizes[0]}")
    return frozenset(keys)


def matches_model(nvml_name: str, wanted: str) -> bool:
    """True when the GPU called `nvml_name` is what a request for `wanted` means."""
    return squash(wanted) in model_keys(nvml_name)


def memory_satisfies(reported_mib: int, wanted_bytes: int) -> bool:
    """NVML total vs a requested minimum, with MEMORY_TOLERANCE of slack (see module docstring)."""
    return reported_mib * _MIB >= wanted_bytes * (1 - MEMORY_TOLERANCE)


# --- brands ---------------------------------------------------------------------------------------

# NVML brand enum -> libnvidia-container's name (src/driver.c). Index = enum value.
RUNTIME_BRANDS: tuple[str, ...] = (
    "Unknown",
    "Quadro",
    "Tesla",
    "NVS",
    "GRID",
    "GeForce",
    "TITAN",
    "VApps",
    "VPC",
    "VCS",
    "VWS",
    "CloudGaming",
    "QuadroRTX",
    "NvidiaRTX",
    "Nvidia",
    "GeForceRTX",
    "TitanRTX",
)
_LEGACY_LAST = 6  # libnvidia-container before 6845f41 (2022) names only enums 0..6; the rest are Unknown

# Every spelling we may receive (nvidia-smi "Product Brand", go-nvlib, NVML constant names) -> enum.
_BRAND_SPELLINGS: dict[str, int] = {}
for _value, _name in enumerate(RUNTIME_BRANDS):
    _BRAND_SPELLINGS[squash(_name)] = _value
_BRAND_SPELLINGS.update(
    {
        "titan": 6,
        "nvidiavapps": 7,
        "nvidiavirtualapplications": 7,
        "nvidiavpc": 8,
        "nvidiavirtualpc": 8,
        "nvidiavcs": 9,
        "nvidiavirtualcomputeserver": 9,
        "nvidiavws": 10,
        "nvidiartxvirtualworkstation": 10,
        "nvidiacloudgaming": 11,
        "nvidiavgaming": 11,
        "nvidiartx": 13,
        "nvidia": 14,
        "geforcertx": 15,
        "titanrtx": 16,
    }
)


# NVML enums after TitanRTX (17 DLA, 18 vGameDev, 19 NPU in nvidia-ml-py 12.x/13.x):
# libnvidia-container's switch has no case for them, so the runtime's `brand=` sees `Unknown`.
_RUNTIME_UNKNOWN_SPELLINGS = frozenset(
    {"17", "18", "19", "nvidiadla", "nvidiavgamedev", "nvidiartxvirtualgamedev", "nvidianpu"}
)


def brand_enum(brand: str | int) -> int | None:
    """An NVML brand in any common spelling (or its enum number) -> the NVML enum, None if unknown."""
    if isinstance(brand, int):
        return brand if 0 <= brand < len(RUNTIME_BRANDS) else None
    text = squash(brand)
    if text.isdigit():
        return brand_enum(int(text))
    text = text.removeprefix("nvmlbrand")
    if text in _BRAND_SPELLINGS:
        return _BRAND_SPELLINGS[text]
    return _BRAND_SPELLINGS.get(text.replace("_", ""))


@lru_cache(maxsize=256)
def runtime_brands(brand: str) -> tuple[str, ...]:
    """The names nvidia-container-cli may compare `brand=` against for this GPU.

    Current libnvidia-container first; older builds' `Unknown` second when they differ. An empty
    brand gives (), which means "not known" (the runtime's NULL brand: true); a spelling we do not
    recognise is passed through as it is.
    """
    if not brand:
        return ()
    if squash(brand).removeprefix("nvmlbrand").replace("_", "") in _RUNTIME_UNKNOWN_SPELLINGS:
        return ("Unknown",)
    value = brand_enum(brand)
    if value is None:
        return (brand,)
    modern = RUNTIME_BRANDS[value]
    if value > _LEGACY_LAST:
        return (modern, "Unknown")
    return (modern,)
