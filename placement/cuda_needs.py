"""Placement rules for the CUDA an image carries in its layers, declared or not (GPUBADGE_DEEP_SCAN). Pure.

The CUDA an image needs is the newest it declares or carries: a `FROM nvidia/cuda:12.8` image with
torch cu130 on top needs CUDA 13's driver. The declared CUDA is checked as NVIDIA's runtime checks
it (`NVIDIA_REQUIRE_CUDA`, `placement.nvidia_require`); the carried CUDA by the rules below, for
declared images as for the others. Only code the image can load counts: the carried CUDA comes from
what the image loads (`scanner.layers.code_loading`), never from a build it cannot load.

A CUDA build is not a GPU requirement (PyPI's torch and TensorFlow are CUDA builds that also run on
a CPU), so a request without `gpus` places an image that declares nothing as before, with a hint.
When the request asks for GPUs, these rules decide, in this order, and a server is rejected for the
first that fails, alone (the GPU code is moot where the CUDA runtime cannot start):

1. **Driver floor** of the carried CUDA (minor-version compatibility, `placement.cuda_drivers`),
   naming the evidence that set the version (`InferredCuda.set_by`);
2. **the toolkit's compute capabilities** (CUDA 13 builds for 7.5 and newer, 12 for 5.0 and newer),
   where the image carries no GPU code to judge;
3. **GPU code**, judged as the packages that ship it load it (`placement.gpu_code`, under the rule
   asked for), with PTX JIT-compiled only by a driver that knows its ISA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from placement import gpu_code
from placement.cuda_drivers import (
    CUDA_DRIVER_FLOORS,
    TOOLKIT_DRIVERS,
    driver_floor,
    pair,
    ptx_cuda_reason,
    ptx_driver_floor,
    toolkit_driver,
)
from placement.gpu_code import KNOWN_COMPUTE_CAPABILITIES, Jit, Rule, version_key
from placement.nvidia_require import compare_version
from scanner.models import GpuFacts

__all__ = [  # the driver tables' readers, for callers that know this module as the CUDA rules' home
    "CUDA_DRIVER_FLOORS",
    "TOOLKIT_DRIVERS",
    "driver_floor",
    "ptx_cuda_reason",
    "ptx_driver_floor",
    "toolkit_driver",
]


def _toolkit_min_cc(cuda: str | None) -> tuple[tuple[int, int], str] | None:
    """The oldest compute capability a CUDA release still builds for (NVIDIA's release notes)."""
    found = pair(cuda) if cuda else None
    if found is None:
        return None
    if found[0] >= 13:
        return (
            7,
            5,
        ), f"CUDA {cuda} supports compute capability 7.5 and newer (13.0 dropped Maxwell, Pascal, Volta)"
    if found[0] == 12:
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


def driver_floor_of(gpu: GpuFacts) -> tuple[str, str] | None:
    """(minimum driver, the rule) the image's CUDA needs under minor-version compatibility: the floor
    of the newest CUDA it declares or carries; None when it names none."""
    needed = needed_cuda(gpu)
    return driver_floor(needed) if needed else None


def declared_vs_carried(gpu: GpuFacts) -> str | None:
    """When the declared and the carried CUDA disagree: which is newer and what it means for the
    driver, by minor-version compatibility. "declares CUDA 12.8, carries the newer CUDA 13.0 (torch
    2.9.1+cu130): needs driver >= 580 (CUDA 13.x ...), not the declared CUDA's"; within one major,
    where the floors agree, it says so. None when they agree or one is missing."""
    declared = gpu.cuda_version
    inferred = gpu.inferred
    carried = inferred.cuda if inferred is not None else None
    if not declared or not carried or inferred is None:
        return None
    if carried == declared or ("." not in carried and declared.split(".")[0] == carried):
        return None
    source = inferred.set_by or (inferred.evidence[0] if inferred.evidence else "its layers")
    if version_key(carried) > version_key(declared):
        floor, declared_floor = driver_floor(carried), driver_floor(declared)
        if floor is not None and declared_floor is not None and floor[0] == declared_floor[0]:
            return (
                f"declares CUDA {declared}, carries the newer CUDA {carried} ({source}): both run on driver"
                f" >= {floor[0]} ({floor[1]})"
            )
        need = f": needs driver >= {floor[0]} ({floor[1]}), not the declared CUDA's" if floor else ""
        return f"declares CUDA {declared}, but carries the newer CUDA {carried} ({source}){need}"
    return (
        f"declares CUDA {declared}, carries the older CUDA {carried} ({source}): the declared CUDA's"
        " driver requirement decides"
    )


def _floor_at(gpu: GpuFacts, cc: tuple[int, int], rule: Rule) -> tuple[bool, str | None]:
    """(runs, the driver PTX JIT needs there or None) for the image's GPU code on a GPU of CC `cc`."""
    assert gpu.archs is not None
    verdict = gpu_code.verdicts(gpu.archs, rule)[cc]
    if not verdict.runs:
        return False, None
    floor: str | None = None
    for file in verdict.ptx:
        needed = ptx_driver_floor(file.ptx_isa)
        if needed is not None and (floor is None or compare_version(needed[0], ">", floor)):
            floor = needed[0]
    return True, floor


def compute_capability_ranges(gpu: GpuFacts, rule: Rule = "dispatch") -> list[CcRange] | None:
    """Where an image's GPU code can run, as CC ranges with the driver PTX JIT needs in each.

    The same rules as `gpu_reasons` (`placement.gpu_code`), for schedulers that place by labels:
    known CCs that behave alike (same major, same driver need) merge into one range, and CCs newer
    than every known one are included when PTX covers them. None when there is nothing to check.
    """
    if not gpu_code.has_code(gpu.archs):
        support = _toolkit_min_cc(needed_cuda(gpu) if gpu.inferred is not None else None)
        return None if support is None else [(support[0], None, None)]
    ranges: list[CcRange] = []
    for cc in KNOWN_COMPUTE_CAPABILITIES:
        runs, floor = _floor_at(gpu, cc, rule)
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
    newer = gpu_code.NEWER_THAN_KNOWN
    runs, floor = _floor_at(gpu, newer, rule)
    if runs:  # GPUs newer than this table: only PTX can reach them
        ranges.append((newer, None, floor))
    return ranges


def carried_driver_reason(gpu: GpuFacts, driver: str | None) -> str | None:
    """Why a server's driver cannot start the CUDA runtime the image carries (minor-version
    compatibility), naming the evidence; None when it can or nothing says."""
    inferred = gpu.inferred
    if inferred is None or not inferred.cuda or not driver:
        return None
    floor = driver_floor(inferred.cuda)
    if floor is None or compare_version(driver, ">=", floor[0]):
        return None
    source = inferred.set_by or (inferred.evidence[0] if inferred.evidence else "the layers")
    declared = ""
    if gpu.cuda_version and version_key(inferred.cuda) > version_key(gpu.cuda_version):
        declared = f", newer than the CUDA {gpu.cuda_version} it declares"
    return f"driver {driver}: {floor[1]}; the image carries CUDA {inferred.cuda} ({source}){declared}"


def code_verdict(
    gpu: GpuFacts,
    compute_capability: str | None,
    driver: str | None,
    driver_cuda: str | None = None,
    rule: Rule = "dispatch",
) -> gpu_code.CodeVerdict | None:
    """The GPU code's verdict on one server's GPU (its CC, driver and the driver's CUDA), or None where
    the image carries no code to judge or the CC is unknown."""
    cc = pair(compute_capability) if compute_capability else None
    if cc is None or not gpu_code.has_code(gpu.archs):
        return None
    assert gpu.archs is not None
    return gpu_code.judge(gpu.archs, cc, Jit(driver, driver_cuda), rule)


def gpu_reasons(
    gpu: GpuFacts,
    compute_capability: str | None,
    driver: str | None,
    driver_cuda: str | None = None,
    rule: Rule = "dispatch",
) -> list[str]:
    """Why a GPU (its CC, its host's driver and that driver's CUDA version) cannot run the CUDA and
    GPU code an image carries, decisive first and alone (module docstring); [] when it can."""
    too_old = carried_driver_reason(gpu, driver)
    if too_old is not None:
        return [too_old]
    cc = pair(compute_capability) if compute_capability else None
    if cc is None:
        return []
    verdict = code_verdict(gpu, compute_capability, driver, driver_cuda, rule)
    if verdict is None:  # no GPU code CUDA loads was read: the toolkit's own support range is all we know
        support = _toolkit_min_cc(gpu.inferred.cuda if gpu.inferred is not None else None)
        if support is not None and cc < support[0]:
            return [f"compute capability {compute_capability}: {support[1]}"]
        return []
    return verdict.reasons


def gpu_caveats(gpu: GpuFacts, compute_capability: str | None, rule: Rule = "dispatch") -> list[str]:
    """What the image runs without on a GPU it runs on ("runs; without ..."): never a reason."""
    verdict = code_verdict(gpu, compute_capability, None, None, rule)
    return verdict.without if verdict is not None and verdict.runs else []


def gpu_passes(
    gpu: GpuFacts,
    compute_capability: str | None,
    driver: str | None,
    driver_cuda: str | None = None,
    rule: Rule = "dispatch",
) -> list[str]:
    """Why a GPU that `gpu_reasons` lets pass can run the CUDA and GPU code an image carries, in words
    (the eligibility answer's `why`): the carried CUDA's driver floor met, and the code that covers the
    compute capability ("…/libtorch_cuda.so: SASS sm_90"), PTX JIT-compiled by this driver named so."""
    lines: list[str] = []
    inferred = gpu.inferred
    if inferred is not None and inferred.cuda and driver:
        floor = driver_floor(inferred.cuda)
        if floor is not None:
            lines.append(f"driver {driver} runs the CUDA {inferred.cuda} it carries ({floor[1]})")
    verdict = code_verdict(gpu, compute_capability, driver, driver_cuda, rule)
    if verdict is None or not verdict.runs:
        return lines
    covered = "; ".join(verdict.covered_by)
    jit = " (its PTX JIT-compiled by this driver)" if verdict.ptx else ""
    lines.append(f"compute capability {compute_capability}: its GPU code runs here{jit}: {covered}")
    return lines


Status = Literal["runs", "runs without", "does not run"]


@dataclass(frozen=True, slots=True)
class GenerationRow:
    """One compute capability's line of the image page: whether the image's CUDA and GPU code run
    there, what decided it, and the driver it needs there (the CUDA runtime's floor, or PTX JIT's)."""

    cc: tuple[int, int]
    architecture: str
    status: Status
    decided_by: list[str]  # why not; what it runs without; or which code covers it
    driver: str | None


def _row(gpu: GpuFacts, cc: tuple[int, int], rule: Rule, floor: str | None) -> GenerationRow:
    """One compute capability judged as `gpu_reasons` judges it with no server's driver in view."""
    needed = needed_cuda(gpu)
    version = pair(needed) if needed else None
    name = gpu_code.ARCHITECTURES.get(cc, gpu_code.GENERATIONS.get(cc[0], ""))
    if version is not None and version[0] >= 13 and cc < (7, 5):
        return GenerationRow(
            cc, name, "does not run", [f"CUDA {version[0]} supports compute capability 7.5 and newer"], None
        )
    if not gpu_code.has_code(gpu.archs):
        support = _toolkit_min_cc(needed)
        if support is not None and cc < support[0]:
            return GenerationRow(cc, name, "does not run", [support[1]], None)
        said = f"CUDA {needed}: no GPU code of its own to judge" if needed else "no GPU code to judge"
        return GenerationRow(cc, name, "runs", [said], floor)
    assert gpu.archs is not None
    verdict = gpu_code.verdicts(gpu.archs, rule)[cc]
    if not verdict.runs:
        return GenerationRow(cc, name, "does not run", verdict.reasons, None)
    needs = floor
    for file in verdict.ptx:
        jit = ptx_driver_floor(file.ptx_isa)
        if jit is not None and (needs is None or compare_version(jit[0], ">", needs)):
            needs = jit[0]
    status: Status = "runs without" if verdict.without else "runs"
    return GenerationRow(cc, name, status, verdict.without or verdict.covered_by, needs)


def _floor(gpu: GpuFacts, driver: str | None) -> str | None:
    needed = needed_cuda(gpu)
    carried = driver_floor(needed) if needed else None
    return driver or (carried[0] if carried else None)


def generations(gpu: GpuFacts, rule: Rule = "dispatch", driver: str | None = None) -> list[GenerationRow]:
    """A row per compute capability from Volta (7.0) on, judged by the rules `gpu_reasons` applies
    with no server's driver in view. Each row's driver is the image's (`driver`: the floor its
    requirements and carried CUDA set, `placement.image_needs`; else the carried CUDA's), raised to
    PTX JIT's floor where its code runs through PTX."""
    floor = _floor(gpu, driver)
    return [_row(gpu, cc, rule, floor) for cc in KNOWN_COMPUTE_CAPABILITIES if cc >= (7, 0)]


def summary(gpu: GpuFacts, rule: Rule = "dispatch") -> str | None:
    """Where the image's CUDA and GPU code run, in one line: "GPU code for sm_50–sm_90, no PTX: compute
    capability 7.5–9.0" (a CUDA 13 image), the capabilities listed without holes; None without GPU code."""
    if gpu.archs is None or not (gpu.archs.files or gpu.archs.numba):
        return None
    code = gpu_code.summary(gpu.archs, rule).split(": compute capability", 1)[0].split(": runs on", 1)[0]
    if not gpu_code.has_code(gpu.archs):
        return code
    floor = _floor(gpu, None)
    newer = (KNOWN_COMPUTE_CAPABILITIES[-1][0] + 1, 0)
    where = [
        cc
        for cc in (*KNOWN_COMPUTE_CAPABILITIES, newer)
        if _row(gpu, cc, rule, floor).status != "does not run"
    ]
    known = [cc for cc in where if cc != newer]
    if not where:
        return f"{code}: runs on no known GPU"
    span = f"compute capability {gpu_code.cc_spans(known)}" if known else "GPUs newer than this table"
    return f"{code}: {span}" + (" and newer GPUs" if known and newer in where else "")


def hint(gpus: Sequence[GpuFacts], gpus_requested: int | None) -> str | None:
    """The hint for a request without GPUs (`gpus`, or MIG devices, counted in `gpus_requested`) for
    an image that carries CUDA but declares no GPU."""
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
