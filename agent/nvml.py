"""NVML -> the GPU facts placement needs (nvidia-ml-py, imported as `pynvml`).

The NVML module is a parameter so tests can hand in a stand-in; by default the real
`pynvml` is imported. NVML missing, failing or seeing no GPUs is not an error: the
server registers as a CPU server, and `NvmlFacts.reason` says why in one line.

A GPU in MIG mode is reported with its MIG devices, read as NVML gives them:
nvmlDeviceGetMaxMigDeviceCount slots, each nvmlDeviceGetMigDeviceHandleByIndex (an empty slot
answers NOT_FOUND), and per device its UUID, nvmlDeviceGetAttributes (memory, multiprocessors,
slice counts), its GPU and compute instance ids, and its profile from nvmlDeviceGetName
(`NVIDIA A100-SXM4-40GB MIG 1g.5gb`), else from the attributes as go-nvlib derives it (that
fallback cannot see a `+me` variant). The agent only reads: it never changes a GPU's MIG mode,
which needs a GPU reset.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from dataclasses import dataclass, field
from typing import Any

from placement.inventory import Gpu, MigDevice
from placement.mig import MAX_MIG_DEVICES_PER_GPU, profile_from_attributes, profile_from_name

log = logging.getLogger(__name__)

# nvmlBrandType_t -> the brand strings libnvidia-container compares `brand=` requirements with
# (src/driver.c @63d366ee). The enum numbers are NVML's C ABI, so they are spelled out here.
_BRANDS: dict[int, str] = {
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "GRID",
    5: "GeForce",
    6: "TITAN",
    7: "VApps",
    8: "VPC",
    9: "VCS",
    10: "VWS",
    11: "CloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}
_MIG_ENABLED = 1
_MIB = 1024 * 1024


def brand_name(brand: int) -> str:
    """NVML brand enum -> the runtime's brand name; anything unlisted is `Unknown`, as in the runtime.

    Recent drivers report 14 (NVML_BRAND_NVIDIA, "Nvidia") for data-center GPUs (H100, A100, L4,
    ...) that older ones called Tesla, and newer NVML adds 17-19 (DLA, vGameDev, NPU), which
    libnvidia-container does not name: they are `Unknown` to it, so they are `Unknown` here.
    """
    return _BRANDS.get(int(brand), "Unknown")


def _brand(nvml: Any, handle: Any) -> str:
    """The runtime's brand name, or "" (not known: the runtime's NULL brand) when NVML cannot tell."""
    try:
        return brand_name(nvml.nvmlDeviceGetBrand(handle))
    except nvml.NVMLError as exc:
        log.warning("NVML could not report a GPU's brand (%s); brand= requirements will not be checked", exc)
        return ""


def format_cuda_version(version: int) -> str:
    """12020 -> "12.2", formatted exactly as libnvidia-container does (major v/1000, minor v%100/10)."""
    return f"{version // 1000}.{version % 100 // 10}"


@dataclass(frozen=True)
class NvmlFacts:
    """What NVML said; `reason` is set (and `gpus` empty) when this host has no usable GPU."""

    driver_version: str | None = None
    cuda_driver_version: str | None = None
    gpus: list[Gpu] = field(default_factory=list)
    reason: str | None = None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _import_pynvml() -> Any:
    return importlib.import_module("pynvml")


def _mig_enabled(nvml: Any, handle: Any, index: int) -> bool:
    try:
        current, pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError:
        return False  # NOT_SUPPORTED on GPUs without MIG
    if pending != current:
        log.info(
            "GPU %d: MIG mode %s is pending and takes effect after a GPU reset; reporting the current mode",
            index,
            "on" if pending == _MIG_ENABLED else "off",
        )
    return bool(current == _MIG_ENABLED)


def _optional_id(nvml: Any, getter: str, handle: Any) -> int | None:
    try:
        return int(getattr(nvml, getter)(handle))
    except nvml.NVMLError:
        return None


def _read_mig_device(nvml: Any, mig: Any, index: int, parent_total_bytes: int) -> MigDevice:
    attributes = nvml.nvmlDeviceGetAttributes(mig)
    memory_mib = int(attributes.memorySizeMB)
    profile = None
    with contextlib.suppress(nvml.NVMLError):
        profile = profile_from_name(_text(nvml.nvmlDeviceGetName(mig)))
    if profile is None:
        profile = profile_from_attributes(
            int(attributes.gpuInstanceSliceCount),
            int(attributes.computeInstanceSliceCount),
            memory_mib,
            parent_total_bytes,
        )
    return MigDevice(
        index=index,
        uuid=_text(nvml.nvmlDeviceGetUUID(mig)),
        profile=profile,
        memory_mib=memory_mib,
        multiprocessors=int(attributes.multiprocessorCount),
        gpu_instance_id=_optional_id(nvml, "nvmlDeviceGetGpuInstanceId", mig),
        compute_instance_id=_optional_id(nvml, "nvmlDeviceGetComputeInstanceId", mig),
        decoders=int(attributes.sharedDecoderCount),
    )


def _read_mig_devices(nvml: Any, handle: Any, gpu_index: int, parent_total_bytes: int) -> list[MigDevice]:
    """The MIG devices of a GPU in MIG mode, in NVML's index order (slots may be empty)."""
    try:
        slots = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
    except nvml.NVMLError as exc:
        log.warning("GPU %d is in MIG mode but NVML cannot count its MIG devices: %s", gpu_index, exc)
        return []
    devices: list[MigDevice] = []
    for slot in range(min(slots, MAX_MIG_DEVICES_PER_GPU)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except nvml.NVMLError:
            continue  # NOT_FOUND: no compute instance behind this slot
        try:
            devices.append(_read_mig_device(nvml, mig, slot, parent_total_bytes))
        except (nvml.NVMLError, ValueError) as exc:
            log.warning("skipping MIG device %d of GPU %d: %s", slot, gpu_index, exc)
    if not devices:
        log.warning("GPU %d is in MIG mode with no MIG device: nothing on it can be handed out", gpu_index)
    return devices


def _cuda_driver_version(nvml: Any) -> str | None:
    getter = getattr(nvml, "nvmlSystemGetCudaDriverVersion_v2", None) or nvml.nvmlSystemGetCudaDriverVersion
    try:
        return format_cuda_version(int(getter()))
    except nvml.NVMLError as exc:
        log.warning("NVML could not report the driver's CUDA version: %s", exc)
        return None


def _read_gpu(nvml: Any, index: int) -> Gpu:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    total_bytes = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
    mig = _mig_enabled(nvml, handle, index)
    return Gpu(
        index=index,
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        name=_text(nvml.nvmlDeviceGetName(handle)),
        brand=_brand(nvml, handle),
        memory_mib=total_bytes // _MIB,
        compute_capability=f"{major}.{minor}",
        mig=mig,
        mig_devices=tuple(_read_mig_devices(nvml, handle, index, total_bytes)) if mig else (),
    )


def read_nvml(nvml: Any | None = None) -> NvmlFacts:
    """Ask NVML for the driver and every GPU. Never raises for a host without NVIDIA hardware."""
    if nvml is None:
        try:
            nvml = _import_pynvml()
        except ImportError as exc:
            return NvmlFacts(reason=f"nvidia-ml-py (pynvml) is not installed: {exc}")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return NvmlFacts(reason=f"NVML is not available: {exc}")
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        cuda = _cuda_driver_version(nvml)
        count = int(nvml.nvmlDeviceGetCount())
        gpus: list[Gpu] = []
        for index in range(count):
            try:
                gpus.append(_read_gpu(nvml, index))
            except nvml.NVMLError as exc:
                log.warning("skipping GPU %d: NVML error: %s", index, exc)
        reason = None if gpus else f"NVML (driver {driver}) found no usable GPU"
        return NvmlFacts(driver_version=driver, cuda_driver_version=cuda, gpus=gpus, reason=reason)
    except nvml.NVMLError as exc:
        return NvmlFacts(reason=f"NVML failed: {exc}")
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()
