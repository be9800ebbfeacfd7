"""Placement rules for the CUDA an image carries in its layers, declared or not (GPUBADGE_DEEP_SCAN). Pure.

The CUDA an image needs is the newest it declares or carries: a `FROM nvidia/cuda:12.8` image with
torch cu130 on top needs CUDA 13's driver. The declared CUDA is checked as NVIDIA's runtime checks
it (`NVIDIA_REQUIRE_CUDA`, `placement.nvidia_require`); the carried CUDA by the rules below, for
declared images as for the others.

A CUDA build is not a GPU requirement (PyPI's torch and TensorFlow are CUDA builds that also run on
a CPU), so a request without `gpus` places an image that declares nothing as before, with a hint.
When the request asks for GPUs, two NVIDIA rules decide, and every rejection names the evidence
that set the version (`InferredCuda.set_by`) or the file and the rule:

* **Driver floor** (minor-version compatibility, Linux): a CUDA 13.x runtime needs driver >= 580,
  12.x >= 525.60.13, 11.x >= 450.80.02 (11.0: 450.51.05); 10.2 and older have no minor-version
  compatibility and need their own release's driver. `CUDA_DRIVER_FLOORS` is the one table.
* **GPU code**, judged as CUDA loads it (`placement.gpu_code`: which containers count, which files
  decide, which only earn a caveat). When only PTX covers the GPU, the driver must be at least the
  one of the toolkit that produced the PTX (`PTX_ISA_TOOLKITS`, `TOOLKIT_DRIVERS`), because a
  driver cannot JIT a newer PTX ISA than it knows.
"""

from __future__ import annotations

from collections.abc import Sequence

from placement import gpu_code
from placement.gpu_code import KNOWN_COMPUTE_CAPABILITIES, version_key
from placement.nvidia_require import compare_version
from scanner.layers.fatbin import PTX_ISA_TOOLKITS
from scanner.models import GpuFacts

# Minor-version compatibility floors, by CUDA major (NVIDIA's CUDA compatibility guide).
CUDA_DRIVER_FLOORS: dict[int, str] = {13: "580", 12: "525.60.13", 11: "450.80.02"}
CUDA_11_0_FLOOR = "450.51.05"
# The Linux driver each toolkit release shipped with (its release notes, "CUDA Toolkit and Corresponding
# Driver Versions"). Used for 10.2 and older (no minor-version compatibility) and for PTX JIT.
TOOLKIT_DRIVERS: dict[tuple[int, int], str] = {
    (7, 0): "346.46",
    (7, 5): "352.31",
    (8, 0): "375.26",
    (9, 0): "384.81",
    (9, 1): "390.46",
    (9, 2): "396.26",
    (10, 0): "410.48",
    (10, 1): "418.39",
    (10, 2): "440.33",
    (11, 0): "450.51.05",
    (11, 1): "455.23",
    (11, 2): "460.27.03",
    (11, 3): "465.19.01",
    (11, 4): "470.42.01",
    (11, 5): "495.29.05",
    (11, 6): "510.39.01",
    (11, 7): "515.43.04",
    (11, 8): "520.61.05",
    (12, 0): "525.60.13",
    (12, 1): "530.30.02",
    (12, 2): "535.54.03",
    (12, 3): "545.23.06",
    (12, 4): "550.54.14",
    (12, 5): "555.42.02",
    (12, 6): "560.28.03",
    (12, 8): "570.26",
    (12, 9): "575.51.03",
    (13, 0): "580.65.06",
    (13, 1): "590.44.01",
}


def _pair(version: str) -> tuple[int, int] | None:
    major, _, minor = version.partition(".")
    if not major.isdigit():
        return None
    return int(major), int(minor) if minor.isdigit() else 0


def toolkit_driver(cuda: str) -> str | None:
    """The driver the CUDA `cuda` toolkit ("12.8") shipped with, or None where the table has no such release."""
    return TOOLKIT_DRIVERS.get(_pair(cuda) or (0, 0))


def driver_floor(cuda: str) -> tuple[str, str] | None:
    """(minimum driver, the rule in words) for a CUDA runtime version ("12.1" or "12"), or None."""
    pair = _pair(cuda)
    if pair is None:
        return None
    major, minor = pair
    if major in CUDA_DRIVER_FLOORS:
        if (major, minor) == (11, 0) and "." in cuda:
            return CUDA_11_0_FLOOR, "CUDA 11.0 needs driver >= 450.51.05"
        floor = CUDA_DRIVER_FLOORS[major]
        return floor, f"CUDA {major}.x needs driver >= {floor} (minor-version compatibility)"
    if major > max(CUDA_DRIVER_FLOORS):
        floor = CUDA_DRIVER_FLOORS[max(CUDA_DRIVER_FLOORS)]
        return floor, f"CUDA {cuda} is newer than this table; it needs at least driver {floor}"
    own = TOOLKIT_DRIVERS.get((major, minor))
    if own is None:
        return None
    return own, f"CUDA {major}.{minor} has no minor-version compatibility and needs its own driver >= {own}"


def ptx_driver_floor(isa: str | None) -> tuple[str, str] | None:
    """(minimum driver, rule) to JIT PTX of an ISA version, from the toolkit that produced it. For a
    toolkit newer than `TOOLKIT_DRIVERS`, the newest driver there: a floor, not the whole need (the
    server's own CUDA version settles it, `ptx_cuda_reason`)."""
    pair = _pair(isa) if isa else None
    if pair is None:
        return None
    toolkit = PTX_ISA_TOOLKITS.get(pair)
    newest = max(TOOLKIT_DRIVERS)
    if toolkit is None or toolkit > newest:
        floor = TOOLKIT_DRIVERS[newest]
        written = (
            "is newer than this table" if toolkit is None else f"comes from CUDA {toolkit[0]}.{toolkit[1]}"
        )
        return floor, f"PTX ISA {isa} {written}; JIT needs at least driver {floor}"
    own = TOOLKIT_DRIVERS.get(toolkit)
    if own is None:
        return None
    return (
        own,
        f"PTX ISA {isa} comes from CUDA {toolkit[0]}.{toolkit[1]}, whose driver {own} is the first to JIT it",
    )


def ptx_cuda_reason(isa: str | None, driver_cuda: str | None) -> str | None:
    """Why a driver of CUDA version `driver_cuda` (NVML's, `nvidia-smi`'s "CUDA Version") cannot
    JIT-compile PTX of ISA `isa`, or None. A driver compiles the PTX of its own CUDA and older: on an
    H200 with CUDA 13.0's driver, PTX from nvcc 13.0 ran and PTX from nvcc 13.5 (ISA 9.5) failed with
    "the provided PTX was compiled with an unsupported toolchain" (bench/gpu_host_check.py)."""
    pair = _pair(isa) if isa else None
    toolkit = PTX_ISA_TOOLKITS.get(pair) if pair else None
    supports = _pair(driver_cuda) if driver_cuda else None
    if toolkit is None or supports is None or toolkit <= supports:
        return None
    return (
        f"PTX ISA {isa} comes from CUDA {toolkit[0]}.{toolkit[1]}, and this server's driver supports CUDA"
        f" {supports[0]}.{supports[1]}: a driver JIT-compiles only the PTX of its own CUDA version or older"
    )


def _toolkit_min_cc(cuda: str | None) -> tuple[tuple[int, int], str] | None:
    """The oldest compute capability a CUDA release still builds for (NVIDIA's release notes)."""
    pair = _pair(cuda) if cuda else None
    if pair is None:
        return None
    if pair[0] >= 13:
        return (
            7,
            5,
        ), f"CUDA {cuda} supports compute capability 7.5 and newer (13.0 dropped Maxwell, Pascal, Volta)"
    if pair[0] == 12:
        return (5, 0), f"CUDA {cuda} supports compute capability 5.0 and newer (12.0 dropped Kepler)"
    return None


CcRange = tuple[tuple[int, int], tuple[int, int] | None, str | None]  # low, high (None: open), PTX driver


def needed_cuda(gpu: GpuFacts) -> str | None:
    """The CUDA the image needs: the newest it declares (CUDA_VERSION / NVIDIA_REQUIRE_CUDA) or carries."""
    declared = gpu.cuda_version
    carried = gpu.inferred.cuda if gpu.inferred is not None else None
    if declared and carried:
        if declared.split(".")[0] == carried and "." not in carried:
            return declared  # "13" carried agrees with "13.0" declared, and says less
        return max(declared, carried, key=version_key)
    return declared or carried


def declared_vs_carried(gpu: GpuFacts) -> str | None:
    """When the declared and the carried CUDA disagree: which is newer and what it means for the
    driver, e.g. "declares CUDA 12.8, carries the newer CUDA 13.0 (torch 2.9.1+cu130): needs driver >=
    580"; None when they agree or one is missing."""
    declared = gpu.cuda_version
    inferred = gpu.inferred
    carried = inferred.cuda if inferred is not None else None
    if not declared or not carried or inferred is None:
        return None
    if carried == declared or ("." not in carried and declared.split(".")[0] == carried):
        return None
    source = inferred.set_by or (inferred.evidence[0] if inferred.evidence else "its layers")
    if version_key(carried) > version_key(declared):
        floor = driver_floor(carried)
        need = f": needs driver >= {floor[0]} ({floor[1]}), not the declared CUDA's" if floor else ""
        return f"declares CUDA {declared}, but carries the newer CUDA {carried} ({source}){need}"
    return (
        f"declares CUDA {declared}, carries the older CUDA {carried} ({source}): the declared CUDA's"
        " driver requirement decides"
    )


def _floor_at(gpu: GpuFacts, cc: tuple[int, int]) -> tuple[bool, str | None]:
    """(runs, the driver PTX JIT needs there or None) for the image's GPU code on a GPU of CC `cc`."""
    assert gpu.archs is not None
    verdict = gpu_code.judge(gpu.archs, cc)
    if not verdict.runs:
        return False, None
    floor: str | None = None
    for file in verdict.ptx:
        needed = ptx_driver_floor(file.ptx_isa)
        if needed is not None and (floor is None or compare_version(needed[0], ">", floor)):
            floor = needed[0]
    return True, floor


def compute_capability_ranges(gpu: GpuFacts) -> list[CcRange] | None:
    """Where an image's GPU code can run, as CC ranges with the driver PTX JIT needs in each.

    The same rules as `gpu_reasons` (`placement.gpu_code`), for schedulers that place by labels:
    known CCs that behave alike (same major, same driver need) merge into one range, and CCs newer
    than every known one are included when PTX covers them. None when there is nothing to check.
    """
    if gpu.archs is None or not any(gpu_code.counted(f) for f in gpu.archs.files):
        support = _toolkit_min_cc(needed_cuda(gpu) if gpu.inferred is not None else None)
        return None if support is None else [(support[0], None, None)]
    ranges: list[CcRange] = []
    for cc in KNOWN_COMPUTE_CAPABILITIES:
        runs, floor = _floor_at(gpu, cc)
        if not runs:
            continue
        if ranges:
            low, high, last_floor = ranges[-1]
            adjacent = high is not None and KNOWN_COMPUTE_CAPABILITIES.index(high) + 1 == (
                KNOWN_COMPUTE_CAPABILITIES.index(cc)
            )
            if adjacent and low[0] == cc[0] and last_floor == floor:
                ranges[-1] = (low, cc, floor)
                continue
        ranges.append((cc, cc, floor))
    newer = (KNOWN_COMPUTE_CAPABILITIES[-1][0] + 1, 0)
    runs, floor = _floor_at(gpu, newer)
    if runs:  # GPUs newer than this table: only PTX can reach them
        ranges.append((newer, None, floor))
    return ranges


def gpu_reasons(
    gpu: GpuFacts, compute_capability: str | None, driver: str | None, driver_cuda: str | None = None
) -> list[str]:
    """Why a GPU (its CC, its host's driver and that driver's CUDA version) cannot run the CUDA and
    GPU code an image carries; [] when it can."""
    reasons: list[str] = []
    inferred = gpu.inferred
    if inferred is not None and inferred.cuda and driver:
        floor = driver_floor(inferred.cuda)
        if floor is not None and not compare_version(driver, ">=", floor[0]):
            source = inferred.set_by or (inferred.evidence[0] if inferred.evidence else "the layers")
            declared = ""
            if gpu.cuda_version and version_key(inferred.cuda) > version_key(gpu.cuda_version):
                declared = f", newer than the CUDA {gpu.cuda_version} it declares"
            reasons.append(
                f"driver {driver}: {floor[1]}; the image carries CUDA {inferred.cuda} ({source}){declared}"
            )
    archs = gpu.archs
    cc = _pair(compute_capability) if compute_capability else None
    if cc is None:
        return reasons
    if archs is None or not any(gpu_code.counted(f) for f in archs.files):
        # no GPU code CUDA loads was read: the toolkit's own support range is all we know
        support = _toolkit_min_cc(inferred.cuda if inferred is not None else None)
        if support is not None and cc < support[0]:
            reasons.append(f"compute capability {compute_capability}: {support[1]}")
        return reasons
    verdict = gpu_code.judge(archs, cc)
    reasons += verdict.reasons
    for file in verdict.ptx:
        through = f"compute capability {compute_capability}: {file.path} runs here only through PTX"
        too_new = ptx_cuda_reason(file.ptx_isa, driver_cuda)
        if too_new is not None:
            reasons.append(f"{through}; {too_new}")
            continue
        floor = ptx_driver_floor(file.ptx_isa) if driver else None
        if driver and floor is not None and not compare_version(driver, ">=", floor[0]):
            reasons.append(f"{through} (PTX ISA {file.ptx_isa}); {floor[1]}, this server has {driver}")
    return reasons


def gpu_passes(gpu: GpuFacts, compute_capability: str | None, driver: str | None) -> list[str]:
    """Why a GPU that `gpu_reasons` lets pass can run the CUDA and GPU code an image carries, in
    words (the eligibility answer's `why`): the carried CUDA's driver floor met, and the GPU code
    that covers the compute capability (SASS, or PTX JIT-compiled by this driver)."""
    lines: list[str] = []
    inferred = gpu.inferred
    if inferred is not None and inferred.cuda and driver:
        floor = driver_floor(inferred.cuda)
        if floor is not None:
            lines.append(f"driver {driver} runs the CUDA {inferred.cuda} it carries ({floor[1]})")
    cc = _pair(compute_capability) if compute_capability else None
    if cc is None or gpu.archs is None or not any(gpu_code.counted(f) for f in gpu.archs.files):
        return lines
    verdict = gpu_code.judge(gpu.archs, cc)
    if verdict.ptx:
        files = ", ".join(f"{v.path} (PTX ISA {v.ptx_isa})" for v in verdict.ptx)
        lines.append(
            f"compute capability {compute_capability}: its GPU code runs here, {files} through PTX JIT"
        )
    else:
        lines.append(
            f"compute capability {compute_capability}: its GPU code has a kernel image (SASS) for it"
        )
    return lines


def gpu_caveats(gpu: GpuFacts, compute_capability: str | None) -> list[str]:
    """The NVIDIA libraries of the image that lack code for a GPU the image runs on (never a reason)."""
    cc = _pair(compute_capability) if compute_capability else None
    if cc is None or gpu.archs is None:
        return []
    verdict = gpu_code.judge(gpu.archs, cc)
    return verdict.caveats if verdict.runs else []


def hint(gpus: Sequence[GpuFacts], gpus_requested: int | None) -> str | None:
    """The hint for a request without `gpus` for an image that carries CUDA but declares no GPU."""
    if gpus_requested:
        return None
    for gpu in gpus:
        if gpu.required or gpu.inferred is None:
            continue
        inferred = gpu.inferred
        version = f"CUDA {inferred.cuda}" if inferred.cuda else "CUDA"
        source = inferred.sources[0] if inferred.sources else "its layers"  # the framework, when one is there
        return f"carries {version} ({source}): ask for gpus to run it on a GPU"
    return None
