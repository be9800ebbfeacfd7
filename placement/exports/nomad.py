"""Constraints as a Nomad task fragment: an arch `constraint` and a `device "nvidia/gpu"` block.

The nomad-device-nvidia plugin fingerprints `${device.model}` (the NVML name), memory in MiB,
and `driver_version`; not compute capability, CUDA version or brand. So a CUDA floor becomes the
driver floor from NVIDIA's CUDA/driver table, and compute-capability and brand clauses become
model lists from the known fleet. Nomad ANDs every constraint: where the image accepts several
alternatives, the export keeps one and the notes say so.

MIG: the plugin fingerprints every MIG device as a GPU of its own, named as NVML names it
(`NVIDIA A100-SXM4-40GB MIG 1g.5gb`, its memory the device's) and skips GPUs in MIG mode. So a
request for MIG devices selects those names (the known fleet's devices it accepts, or any
` MIG <profile>` name), and a whole-GPU request on a fleet with MIG devices excludes them with a
regular expression for names without ` MIG ` (RE2 has no negative look-ahead).
"""

from __future__ import annotations

import json
import re
from typing import Any

from placement.exports.core import Bound, Constraints, KnownGpu, PlatformConstraints, Term, Version, compare

# CUDA major.minor -> the first Linux x86_64 driver of that release (CUDA 13.1 release notes,
# table 3): a driver reports a CUDA version at least X.Y from this version on.
CUDA_DRIVER_FLOOR: dict[Version, Version] = {
    (13, 1): (590, 44, 1), (13, 0): (580, 65, 6), (12, 9): (575, 51, 3), (12, 8): (570, 26),
    (12, 6): (560, 28, 3), (12, 5): (555, 42, 2), (12, 4): (550, 54, 14), (12, 3): (545, 23, 6),
    (12, 2): (535, 54, 3), (12, 1): (530, 30, 2), (12,): (525, 60, 13), (11, 8): (520, 61, 5),
    (11, 7): (515, 43, 4), (11, 6): (510, 39, 1), (11, 5): (495, 29, 5), (11, 4): (470, 42, 1),
    (11, 3): (465, 19, 1), (11, 2): (460, 27, 3), (11, 1): (455, 23), (11,): (450, 36, 6),
    (10, 2): (440, 33), (10, 1): (418, 39), (10,): (410, 48), (9, 2): (396, 26), (9, 1): (390, 46),
    (9,): (384, 81), (8,): (367, 48), (7, 5): (352, 31), (7,): (346, 46),
}  # fmt: skip


def driver_floor(cuda: Bound) -> Version | None:
    """The oldest driver whose CUDA version satisfies `cuda` as a lower bound (None: beyond the table)."""
    for release, driver in sorted(CUDA_DRIVER_FLOOR.items(), key=lambda item: item[0]):
        order = compare(release, cuda.version)
        if order > 0 or (order == 0 and cuda.inclusive):
            return driver
    return None


# Names that do not contain " MIG " (a MIG device's name as NVML gives it), in RE2.
NOT_A_MIG_DEVICE = "^([^ ]| [^M]| M[^I]| MI[^G]| MIG[^ ])*( | M| MI| MIG)?$"


def _version(parts: Version) -> str:
    return ".".join(str(part) for part in (parts or (0,)))


def _hcl(text: str) -> str:
    return json.dumps(text)  # HCL string literals share JSON's escapes for these characters


def _constraint(indent: str, attribute: str, operator: str, value: str) -> list[str]:
    return [
        f"{indent}constraint {{",
        f"{indent}  attribute = {_hcl(attribute)}",
        f"{indent}  operator  = {_hcl(operator)}",
        f"{indent}  value     = {_hcl(value)}",
        f"{indent}}}",
    ]


def _term_constraints(
    term: Term, fleet: list[KnownGpu], notes: list[str]
) -> tuple[list[str], set[str] | None]:
    """(driver version clauses, allowed models or None) for one alternative."""
    clauses: list[str] = []
    models: set[str] | None = set(term.products) if term.products is not None else None
    for dimension, interval in term.versions:
        if dimension == "driver":
            if interval.low is not None:
                clauses.append(f"{'>=' if interval.low.inclusive else '>'} {_version(interval.low.version)}")
            if interval.high is not None:
                clauses.append(
                    f"{'<=' if interval.high.inclusive else '<'} {_version(interval.high.version)}"
                )
        elif dimension == "cuda":
            if interval.low is not None:
                floor = driver_floor(interval.low)
                if floor is None:
                    clauses.append(">= 99999")
                    notes.append(
                        "the CUDA version asked for is newer than NVIDIA's table: no driver qualifies"
                    )
                else:
                    clauses.append(f">= {_version(floor)}")
                    notes.append(
                        f"CUDA >= {_version(interval.low.version)} became driver >= {_version(floor)} "
                        "(NVIDIA's CUDA/driver table): the plugin reports no CUDA version"
                    )
            if interval.high is not None:
                notes.append(
                    "an upper bound on the driver's CUDA version cannot be expressed and was dropped"
                )
        else:  # compute capability: the known fleet's models with a matching one
            fitting = {gpu.name for gpu in fleet if _cc(gpu) is not None and interval.holds(_cc(gpu) or ())}
            models = fitting if models is None else models & fitting
            notes.append(
                "compute-capability clauses became the known fleet's models with such GPUs: the plugin "
                "reports no compute capability"
            )
    return clauses, models


def _any_of(names: set[str]) -> str:
    return "^(" + "|".join(re.escape(name) for name in sorted(names)) + ")$" if names else "^$"


def _whole_pattern(models: set[str] | None, fleet: list[KnownGpu], notes: list[str]) -> str | None:
    """Whole GPUs: the allowed models, or (on a fleet with MIG devices) any name but a MIG device's."""
    if models is not None:
        return _any_of(models)  # whole products' names: a MIG device's name never matches
    if any(gpu.mig_profiles for gpu in fleet):
        notes.append(
            "the plugin fingerprints MIG devices as GPUs named '<product> MIG <profile>': the model "
            "constraint leaves them out of a whole-GPU request"
        )
        return NOT_A_MIG_DEVICE
    return None


def _mig_pattern(platform: PlatformConstraints, term: Term, models: set[str] | None, notes: list[str]) -> str:
    """MIG devices: their NVML names (`<product> MIG <profile>`), from the known fleet where the
    request or the image restricts the product or the profile."""
    notes.append(
        "the plugin fingerprints each MIG device as a GPU named '<product> MIG <profile>' with its own "
        "memory: the model constraint selects MIG devices"
    )
    if models is None and term.products is None and not platform.mig_profiles:
        return "^.+ MIG [^ ]+$"
    if models is None and term.products is None:
        return "^.+ MIG (" + "|".join(re.escape(profile) for profile in platform.mig_profiles) + ")$"
    choices = [c for c in platform.choices_for(term) if models is None or c.product in models]
    return _any_of({f"{choice.product} MIG {choice.profile}" for choice in choices})


def _cc(gpu: KnownGpu) -> Version | None:
    parts = gpu.compute_capability.split(".")
    if not all(part.isdigit() for part in parts):
        return None
    return tuple(int(part) for part in parts)


def export(constraints: Constraints) -> dict[str, Any]:
    """`{"hcl", "notes"}`: a task-level `constraint` and `device "nvidia/gpu"` block."""
    notes = list(constraints.notes)
    fleet = constraints.fleet
    archs = sorted({platform.architecture for platform in constraints.platforms if platform.terms})
    lines: list[str] = []
    if archs:
        pattern = "^(" + "|".join(re.escape(arch) for arch in archs) + ")$"
        lines += _constraint("", "${attr.cpu.arch}", "regexp", pattern)
    else:
        lines += _constraint("", "${attr.cpu.arch}", "=", "none")  # no node matches
    for key, value in sorted(constraints.request.labels.items()):
        lines += _constraint("", f"${{meta.{key}}}", "=", value)
    if constraints.request.labels:
        notes.append("gpubadge server labels are required as Nomad client meta of the same name and value")
    gpu_platforms = [platform for platform in constraints.platforms if platform.wants_gpu and platform.terms]
    if gpu_platforms:
        platform = gpu_platforms[0]
        if len({tuple(map(str, p.terms)) for p in gpu_platforms}) > 1:
            notes.append(f"the platforms demand different GPUs; the device block follows {platform.platform}")
        term = platform.terms[0]
        if len(platform.terms) > 1:
            notes.append(
                f"the image accepts {len(platform.terms)} alternatives and Nomad ANDs every constraint: only "
                "the first is kept, so some nodes that could run it are not selected"
            )
        clauses, models = _term_constraints(term, fleet, notes)
        count = platform.mig_devices or platform.gpus
        lines += ['device "nvidia/gpu" {', f"  count = {count}"]
        if platform.min_memory_mib is not None:
            lines += _constraint("  ", "${device.attr.memory}", ">=", f"{platform.min_memory_mib} MiB")
        if clauses:
            lines += _constraint("  ", "${device.attr.driver_version}", "version", ", ".join(clauses))
        if models is not None and term.products is not None:
            notes.append(
                "brand and model clauses became the known fleet's models: the plugin reports no brand"
            )
        model_pattern = (
            _mig_pattern(platform, term, models, notes)
            if platform.mig_devices
            else _whole_pattern(models, fleet, notes)
        )
        if model_pattern is not None:
            lines += _constraint("  ", "${device.model}", "regexp", model_pattern)
        lines.append("}")
    elif any(platform.wants_gpu for platform in constraints.platforms):
        lines += ['device "nvidia/gpu" {', "  count = 1"]
        lines += _constraint("  ", "${device.model}", "regexp", "^$")  # nothing can be eligible
        lines.append("}")
    return {"hcl": "\n".join(lines) + "\n", "notes": list(dict.fromkeys(notes))}
