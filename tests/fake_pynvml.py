"""STAND-IN for the `pynvml` module (nvidia-ml-py), for tests only.

`FakeNvml` answers the NVML calls agent/nvml.py makes, from a list of `FakeGpu`s,
with NVML's own conventions: brand enum numbers, memory in bytes, CUDA version as
an int (12020), MIG mode as [current, pending], NVMLError for unsupported queries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_GPU_IS_LOST = 15

# nvmlBrandType_t values (nvml.h); what the GPUs below report on a current (R535+) driver.
NVML_BRAND_TESLA = 2
NVML_BRAND_GEFORCE = 5
NVML_BRAND_NVIDIA_RTX = 13
NVML_BRAND_NVIDIA = 14
NVML_BRAND_NVIDIA_NPU = 19  # newer than libnvidia-container's table


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {
            NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
            NVML_ERROR_NOT_SUPPORTED: "Not Supported",
            NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        }.get(self.value, f"NVML error {self.value}")


@dataclass
class FakeGpu:
    uuid: str
    name: str
    brand: int | None  # None: nvmlDeviceGetBrand answers NOT_SUPPORTED
    memory_bytes: int
    compute_capability: tuple[int, int]
    mig_mode: tuple[int, int] | None = None  # None: MIG not supported
    lost: bool = False


@dataclass
class FakeNvml:
    gpus: list[FakeGpu] = field(default_factory=list)
    driver_version: str = "535.104.05"
    cuda_version: int = 12020
    init_error: int | None = None
    # nvidia-ml-py >= 11.515 decodes names to str (13.610 on a real H200 did); older ones gave bytes
    names_as_bytes: bool = False
    calls: list[str] = field(default_factory=list)
    NVMLError: type[NVMLError] = NVMLError

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.cuda_version

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        gpu = self.gpus[index]
        if gpu.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return gpu

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str:
        return handle.uuid

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str | bytes:
        return handle.name.encode() if self.names_as_bytes else handle.name

    def nvmlDeviceGetBrand(self, handle: FakeGpu) -> int:
        if handle.brand is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return handle.brand

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu) -> Any:
        # as on a real H200: `used` at idle is the driver's reservation (~0.4% of total), not 0
        reserved = handle.memory_bytes // 234
        return SimpleNamespace(total=handle.memory_bytes, free=handle.memory_bytes - reserved, used=reserved)

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeGpu) -> tuple[int, int]:
        return handle.compute_capability

    def nvmlDeviceGetMigMode(self, handle: FakeGpu) -> list[int]:
        if handle.mig_mode is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return list(handle.mig_mode)


def h100(uuid: str = "GPU-11111111-2222-3333-4444-555555555555") -> FakeGpu:
    """Data-center GPUs report NVML_BRAND_NVIDIA ("Product Brand: NVIDIA") on current drivers."""
    return FakeGpu(
        uuid, "NVIDIA H100 80GB HBM3", NVML_BRAND_NVIDIA, 81559 * 1024 * 1024, (9, 0), mig_mode=(0, 0)
    )


def h200(uuid: str = "GPU-0ce07f1d-9476-91fa-2833-b5669231b7a6") -> FakeGpu:
    """Recorded from a real NVIDIA H200 (driver 580.159.04, CUDA 13.0, nvidia-ml-py 13.610.43):
    brand 14 (NVIDIA), 150,754,820,096 bytes, compute capability (9, 0), MIG mode [0, 0]."""
    return FakeGpu(uuid, "NVIDIA H200", NVML_BRAND_NVIDIA, 150_754_820_096, (9, 0), mig_mode=(0, 0))


def a100_mig(uuid: str = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee") -> FakeGpu:
    return FakeGpu(
        uuid, "NVIDIA A100-SXM4-40GB", NVML_BRAND_NVIDIA, 40960 * 1024 * 1024, (8, 0), mig_mode=(1, 1)
    )


def t4_old_driver(uuid: str = "GPU-44444444-4444-4444-4444-444444444444") -> FakeGpu:
    """A Tesla T4 as a pre-R510 driver reports it: NVML_BRAND_TESLA."""
    return FakeGpu(uuid, "Tesla T4", NVML_BRAND_TESLA, 15360 * 1024 * 1024, (7, 5))


def rtx_4090(uuid: str = "GPU-40904090-4090-4090-4090-409040904090") -> FakeGpu:
    """GeForce cards report NVML_BRAND_GEFORCE; nvml.h marks GEFORCE_RTX (15) as unused."""
    return FakeGpu(uuid, "NVIDIA GeForce RTX 4090", NVML_BRAND_GEFORCE, 24564 * 1024 * 1024, (8, 9))


def rtx_a6000(uuid: str = "GPU-a6000a60-00a6-000a-6000-a6000a6000a6") -> FakeGpu:
    """Professional RTX cards report NVML_BRAND_NVIDIA_RTX ("NVIDIA RTX") on current drivers."""
    return FakeGpu(uuid, "NVIDIA RTX A6000", NVML_BRAND_NVIDIA_RTX, 49140 * 1024 * 1024, (8, 6))
