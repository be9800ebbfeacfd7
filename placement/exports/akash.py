"""Constraints as an Akash SDL compute profile: GPU units and the models that may serve them.

Akash providers advertise GPUs by vendor, model (a lowercase token from Akash's PCI-id registry:
`a100`, `h100`, `t4`, `rtx4090`), memory size and interface. An SDL lists acceptable
`{model, ram?, interface?}` alternatives; `ram` picks a memory variant (an exact size, not a
minimum). Akash knows nothing of drivers, CUDA or compute capability, so those clauses cannot be
enforced there; the models are the known fleet's products that the rest of the request allows.

Akash has no MIG: a provider discovers its GPUs by PCI id and leases whole ones, so a request
for MIG devices has no SDL (the notes say so).
"""

from __future__ import annotations

import re
from typing import Any

from placement.exports.core import Constraints, KnownGpu

_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "quadro"}
_FORM_WORDS = {
    "sxm",
    "sxm2",
    "sxm3",
    "sxm4",
    "sxm5",
    "pcie",
    "hbm2",
    "hbm2e",
    "hbm3",
    "hbm3e",
    "nvl",
    "generation",
}
_MEMORY = re.compile(r"^(\d+)gb$")


def akash_gpu(nvml_name: str) -> dict[str, str]:
    """`{model, ram?, interface?}` for an NVML name, e.g. `NVIDIA A100-SXM4-40GB` -> a100, 40Gi, sxm."""
    words = [word for word in re.split(r"[\s\-_]+", nvml_name.lower()) if word]
    model_words, ram, interface = [], None, None
    for word in words:
        memory = _MEMORY.match(word)
        if memory:
            ram = f"{memory.group(1)}Gi"
        elif word.startswith("sxm") or word.startswith("hbm"):
            interface = interface or "sxm"
        elif word == "pcie":
            interface = "pcie"
        elif word not in _VENDOR_WORDS and word not in _FORM_WORDS:
            model_words.append(re.sub(r"[^a-z0-9]", "", word))
    entry = {"model": "".join(model_words)}
    if ram is not None:
        entry["ram"] = ram
    if interface is not None:
        entry["interface"] = interface
    return entry


def _allowed(gpu: KnownGpu, constraints: Constraints) -> bool:
    """The product passes every clause Akash could know about (model, brand, memory, compute capability)."""
    for platform in constraints.platforms:
        if platform.gpus == 0:
            continue
        if gpu.architectures and platform.architecture not in gpu.architectures:
            continue  # only seen on servers of another CPU architecture
        if platform.min_memory_mib is not None and gpu.memory_mib < platform.min_memory_mib:
            continue
        cc = tuple(int(part) for part in gpu.compute_capability.split(".") if part.isdigit())
        for term in platform.terms:
            if term.products is not None and gpu.name not in term.products:
                continue
            interval = term.interval("cc")
            if interval is not None and not interval.holds(cc):
                continue
            return True
    return False


def export(constraints: Constraints) -> dict[str, Any]:
    """`{"sdl", "notes"}`: `sdl` is `{"profiles": {"compute": {"app": ...}}}`, or None when nothing fits."""
    notes = list(constraints.notes)
    request = constraints.request
    if any(platform.mig_devices for platform in constraints.platforms):
        notes.append(
            "Akash has no MIG: providers discover GPUs by PCI id and lease whole ones; a request for MIG "
            "devices cannot be expressed in an SDL (ask for whole GPUs there)"
        )
        return {"sdl": None, "notes": notes}
    gpus = max((platform.gpus for platform in constraints.platforms), default=0)
    resources: dict[str, Any] = {
        "cpu": {"units": request.cpus if request.cpus is not None else 1},
        "memory": {"size": _size(request.memory) if request.memory is not None else "1Gi"},
        "storage": {"size": "1Gi"},
    }
    if request.cpus is None or request.memory is None:
        notes.append("CPU units, memory and storage not given in the request are set to 1, 1Gi and 1Gi")
    if gpus > 0:
        alternatives: list[dict[str, str]] = []
        for gpu in constraints.fleet:
            if _allowed(gpu, constraints):
                entry = akash_gpu(gpu.name)
                if entry not in alternatives and entry["model"]:
                    alternatives.append(entry)
        notes.append(
            "Akash has no driver, CUDA or compute-capability attributes: the image's driver and CUDA "
            "requirements cannot be enforced there; the models are the known fleet's products that the "
            "other clauses allow"
        )
        if not alternatives or not constraints.satisfiable:
            notes.append("no known GPU model qualifies: no SDL (an empty model list would accept any GPU)")
            return {"sdl": None, "notes": notes}
        resources["gpu"] = {"units": gpus, "attributes": {"vendor": {"nvidia": alternatives}}}
    elif not constraints.satisfiable:
        return {"sdl": None, "notes": notes}
    archs = sorted({platform.architecture for platform in constraints.platforms if platform.terms})
    if archs and archs != ["amd64"]:
        notes.append(f"Akash providers run amd64; the image's platforms are {', '.join(archs)}")
    return {"sdl": {"profiles": {"compute": {"app": {"resources": resources}}}}, "notes": notes}


def _size(value: int) -> str:
    for unit, size in (("Ti", 1024**4), ("Gi", 1024**3), ("Mi", 1024**2)):
        if value % size == 0:
            return f"{value // size}{unit}"
    return str(value)
