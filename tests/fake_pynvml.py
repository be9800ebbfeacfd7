"""STAND-IN for the `pynvml` module (nvidia-ml-py), for tests only.

`FakeNvml` answers the NVML calls agent/nvml.py makes, from a list of `FakeGpu`s,
with NVML's own conventions: brand enum numbers, memory in bytes, CUDA version as
an int (12020), MIG mode as [current, pending], NVMLError for unsupported queries.

MIG: a GPU in MIG mode answers nvmlDeviceGetMaxMigDeviceCount and, per slot,
nvmlDeviceGetMigDeviceHandleByIndex (NOT_FOUND for an empty slot); a MIG handle answers
nvmlDeviceGetUUID (`MIG-...`), nvmlDeviceGetName (`<parent> MIG <profile>`, as NVML names MIG
devices), nvmlDeviceGetAttributes (a c_nvmlDeviceAttributes-shaped record: memorySizeMB in MiB,
multiprocessorCount, slice and engine counts), nvmlDeviceGetGpuInstanceId and
nvmlDeviceGetComputeInstanceId, with the signatures of nvidia-ml-py 13.x. Layouts are built from
`MIG_PROFILES`, each row one product's GPU-instance profile as `nvidia-smi mig -lgip` reports it;
`mig_gpu` refuses a layout the GPU could not hold (more instances of a profile than it allows,
or more compute or memory slices than it has). The stand-in has no call that changes a GPU's MIG
mode or creates instances: gpubadge only reads them (enabling MIG needs a GPU reset).
"""

from __future__ import annotations

import uuid as uuid_module
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_LIBRARY_NOT_FOUND = 12
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
            NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
            NVML_ERROR_NOT_SUPPORTED: "Not Supported",
            NVML_ERROR_NOT_FOUND: "Not Found",
            NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
            NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        }.get(self.value, f"NVML error {self.value}")


# --- MIG profiles ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MigProfileRow:
    """One GPU-instance profile of one product, as `nvidia-smi mig -lgip` lists it.

    `memory_slices` is the profile's share of memory in eighths and `instances` how many can
    exist at once, both from NVIDIA's MIG User Guide ("Supported MIG Profiles"); `profile_id` is
    NVML's GPU instance profile id; `memory_mib` and `multiprocessors` are what the driver
    reports (memorySizeMB, multiprocessorCount). `captured` is False where no capture of the
    value was found and it is placed inside the documented share instead.
    """

    profile: str
    profile_id: int
    slices: int  # compute slices (the `g`)
    memory_slices: int
    instances: int
    memory_mib: int
    multiprocessors: int
    decoders: int = 0
    jpeg: int = 0
    ofa: int = 0
    captured: bool = True


_R = MigProfileRow
# Memory and SM counts: A100-SXM4-40GB from the `nvidia-smi mig -lgip` output in NVIDIA's MIG User
# Guide (R525+ drivers print 4.75 / 9.75 / 19.62 / 39.50 GiB); A100-SXM4-80GB, H100 80GB HBM3 from
# public -lgip captures on real boards; H200 (1g.18gb: 16.00 GiB, 16 SMs; 2g.35gb: 32 SMs; 3g.71gb:
# 60 SMs) and B200 (1g.23gb: 20992 MiB, 18 SMs) from public captures of MIG devices.
MIG_PROFILES: dict[str, tuple[MigProfileRow, ...]] = {
    "NVIDIA A100-SXM4-40GB": (
        _R("1g.5gb", 19, 1, 1, 7, 4864, 14),
        _R("1g.5gb+me", 20, 1, 1, 1, 4864, 14, decoders=1, jpeg=1, ofa=1),
        _R("1g.10gb", 15, 1, 2, 4, 9984, 14, decoders=1),
        _R("2g.10gb", 14, 2, 2, 3, 9984, 28, decoders=1),
        _R("3g.20gb", 9, 3, 4, 2, 20096, 42, decoders=2),
        _R("4g.20gb", 5, 4, 4, 1, 20096, 56, decoders=2),
        _R("7g.40gb", 0, 7, 8, 1, 40448, 98, decoders=5, jpeg=1, ofa=1),
    ),
    "NVIDIA A100-SXM4-80GB": (
        _R("1g.10gb", 19, 1, 1, 7, 9728, 14),
        _R("1g.10gb+me", 20, 1, 1, 1, 9728, 14, decoders=1, jpeg=1, ofa=1),
        _R("1g.20gb", 15, 1, 2, 4, 19968, 14, decoders=1),
        _R("2g.20gb", 14, 2, 2, 3, 19968, 28, decoders=1),
        _R("3g.40gb", 9, 3, 4, 2, 40192, 42, decoders=2),
        _R("4g.40gb", 5, 4, 4, 1, 40192, 56, decoders=2),
        _R("7g.80gb", 0, 7, 8, 1, 80384, 98, decoders=5, jpeg=1, ofa=1),
    ),
    "NVIDIA H100 80GB HBM3": (
        _R("1g.10gb", 19, 1, 1, 7, 9984, 16, decoders=1, jpeg=1),
        _R("1g.10gb+me", 20, 1, 1, 1, 9984, 16, decoders=1, jpeg=1, ofa=1),
        _R("1g.20gb", 15, 1, 2, 4, 20096, 26, decoders=1, jpeg=1),
        _R("2g.20gb", 14, 2, 2, 3, 20096, 32, decoders=2, jpeg=2),
        _R("3g.40gb", 9, 3, 4, 2, 40448, 60, decoders=3, jpeg=3),
        _R("4g.40gb", 5, 4, 4, 1, 40448, 64, decoders=4, jpeg=4),
        _R("7g.80gb", 0, 7, 8, 1, 81152, 132, decoders=7, jpeg=7, ofa=1),
    ),
    "NVIDIA H200": (
        _R("1g.18gb", 19, 1, 1, 7, 16384, 16, decoders=1, jpeg=1),
        _R("1g.18gb+me", 20, 1, 1, 1, 16384, 16, decoders=1, jpeg=1, ofa=1),
        _R("1g.35gb", 15, 1, 2, 4, 32896, 26, decoders=1, jpeg=1, captured=False),
        _R("2g.35gb", 14, 2, 2, 3, 32896, 32, decoders=2, jpeg=2, captured=False),
        _R("3g.71gb", 9, 3, 4, 2, 66560, 60, decoders=3, jpeg=3, captured=False),
        _R("4g.71gb", 5, 4, 4, 1, 66560, 64, decoders=4, jpeg=4, captured=False),
        _R("7g.141gb", 0, 7, 8, 1, 132864, 132, decoders=7, jpeg=7, ofa=1, captured=False),
    ),
    "NVIDIA B200": (_R("1g.23gb", 19, 1, 1, 7, 20992, 18, decoders=1, jpeg=1),),
}
COMPUTE_SLICES = 7  # every product above: seven compute slices, eight memory slices
MEMORY_SLICES = 8


@dataclass
class FakeMigDevice:
    """A MIG device: one GPU instance of `row`'s profile with one full-width compute instance."""

    parent: FakeGpu
    row: MigProfileRow
    uuid: str
    gpu_instance_id: int
    compute_instance_id: int = 0
    broken: bool = False  # nvmlDeviceGetAttributes fails (a device being torn down)

    @property
    def name(self) -> str:
        return f"{self.parent.name} MIG {self.row.profile}"


@dataclass
class FakeGpu:
    uuid: str
    name: str
    brand: int | None  # None: nvmlDeviceGetBrand answers NOT_SUPPORTED
    memory_bytes: int
    compute_capability: tuple[int, int]
    mig_mode: tuple[int, int] | None = None  # None: MIG not supported
    lost: bool = False
    # slot -> MIG device; a slot without one answers NOT_FOUND, as after a destroyed instance
    mig_slots: dict[int, FakeMigDevice] = field(default_factory=dict)
    max_mig_devices: int = 7


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

    # --- MIG (nvidia-ml-py 13.x signatures) ---

    def nvmlDeviceGetMaxMigDeviceCount(self, device: FakeGpu) -> int:
        """Zero when MIG is not supported or not enabled, as nvml.h says."""
        if device.mig_mode is None or device.mig_mode[0] != 1:
            return 0
        return device.max_mig_devices

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: FakeGpu, index: int) -> FakeMigDevice:
        if isinstance(device, FakeMigDevice) or not 0 <= index < device.max_mig_devices:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        found = device.mig_slots.get(index)
        if found is None or device.mig_mode is None or device.mig_mode[0] != 1:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return found

    def nvmlDeviceGetAttributes(self, device: FakeGpu | FakeMigDevice) -> Any:
        """Shaped like pynvml's c_nvmlDeviceAttributes (memorySizeMB is in MiB)."""
        if not isinstance(device, FakeMigDevice):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if device.broken:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        row = device.row
        return SimpleNamespace(
            multiprocessorCount=row.multiprocessors,
            sharedCopyEngineCount=row.slices,
            sharedDecoderCount=row.decoders,
            sharedEncoderCount=0,
            sharedJpegCount=row.jpeg,
            sharedOfaCount=row.ofa,
            gpuInstanceSliceCount=row.slices,
            computeInstanceSliceCount=row.slices,
            memorySizeMB=row.memory_mib,
        )

    def nvmlDeviceGetGpuInstanceId(self, device: FakeGpu | FakeMigDevice) -> int:
        if not isinstance(device, FakeMigDevice):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return device.gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, device: FakeGpu | FakeMigDevice) -> int:
        if not isinstance(device, FakeMigDevice):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return device.compute_instance_id


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
    """An A100-SXM4-40GB in MIG mode, split into seven 1g.5gb MIG devices."""
    return a100_40gb_mig(uuid)


def t4_old_driver(uuid: str = "GPU-44444444-4444-4444-4444-444444444444") -> FakeGpu:
    """A Tesla T4 as a pre-R510 driver reports it: NVML_BRAND_TESLA."""
    return FakeGpu(uuid, "Tesla T4", NVML_BRAND_TESLA, 15360 * 1024 * 1024, (7, 5))


def rtx_4090(uuid: str = "GPU-40904090-4090-4090-4090-409040904090") -> FakeGpu:
    """GeForce cards report NVML_BRAND_GEFORCE; nvml.h marks GEFORCE_RTX (15) as unused."""
    return FakeGpu(uuid, "NVIDIA GeForce RTX 4090", NVML_BRAND_GEFORCE, 24564 * 1024 * 1024, (8, 9))


def rtx_a6000(uuid: str = "GPU-a6000a60-00a6-000a-6000-a6000a6000a6") -> FakeGpu:
    """Professional RTX cards report NVML_BRAND_NVIDIA_RTX ("NVIDIA RTX") on current drivers."""
    return FakeGpu(uuid, "NVIDIA RTX A6000", NVML_BRAND_NVIDIA_RTX, 49140 * 1024 * 1024, (8, 6))


def mig_gpu(
    uuid: str,
    name: str,
    memory_bytes: int,
    compute_capability: tuple[int, int],
    layout: list[str],
    *,
    pending: int = 1,
) -> FakeGpu:
    """A GPU of product `name` in MIG mode with one MIG device per profile in `layout`, in slot
    order, each a GPU instance with one full-width compute instance. Raises ValueError for a
    layout the GPU could not hold."""
    rows = {row.profile: row for row in MIG_PROFILES[name]}
    chosen = [rows[profile] for profile in layout]
    for profile, count in Counter(layout).items():
        if count > rows[profile].instances:
            raise ValueError(f"{name} holds at most {rows[profile].instances} × {profile}, not {count}")
    if sum(row.slices for row in chosen) > COMPUTE_SLICES:
        raise ValueError(f"{layout} needs more than {COMPUTE_SLICES} compute slices")
    if sum(row.memory_slices for row in chosen) > MEMORY_SLICES:
        raise ValueError(f"{layout} needs more than {MEMORY_SLICES} memory slices")
    gpu = FakeGpu(uuid, name, NVML_BRAND_NVIDIA, memory_bytes, compute_capability, mig_mode=(1, pending))
    for slot, row in enumerate(chosen):
        # NVML's MIG UUIDs are opaque (R470+: `MIG-` and a UUID): derived here from the parent and slot.
        mig_uuid = f"MIG-{uuid_module.uuid5(uuid_module.NAMESPACE_OID, f'{uuid}/{slot}')}"
        gpu.mig_slots[slot] = FakeMigDevice(gpu, row, mig_uuid, gpu_instance_id=slot + 1)
    return gpu


def a100_40gb_mig(
    uuid: str = "GPU-a1004040-0000-4000-8000-000000000000", layout: list[str] | None = None
) -> FakeGpu:
    """An A100-SXM4-40GB (40960 MiB on driver 570) split into seven 1g.5gb devices by default."""
    return mig_gpu(uuid, "NVIDIA A100-SXM4-40GB", 40960 * 1024 * 1024, (8, 0), layout or ["1g.5gb"] * 7)


def a100_80gb_mig(
    uuid: str = "GPU-a1008080-0000-4000-8000-000000000000", layout: list[str] | None = None
) -> FakeGpu:
    return mig_gpu(uuid, "NVIDIA A100-SXM4-80GB", 81920 * 1024 * 1024, (8, 0), layout or ["1g.10gb"] * 7)


def h100_mig(
    uuid: str = "GPU-91008080-0000-4000-8000-000000000000", layout: list[str] | None = None
) -> FakeGpu:
    return mig_gpu(uuid, "NVIDIA H100 80GB HBM3", 81559 * 1024 * 1024, (9, 0), layout or ["1g.10gb"] * 7)


def h200_mig(
    uuid: str = "GPU-92000141-0000-4000-8000-000000000000", layout: list[str] | None = None
) -> FakeGpu:
    return mig_gpu(uuid, "NVIDIA H200", 150_754_820_096, (9, 0), layout or ["1g.18gb"] * 7)


def b200_mig(
    uuid: str = "GPU-b2000180-0000-4000-8000-000000000000", layout: list[str] | None = None
) -> FakeGpu:
    return mig_gpu(uuid, "NVIDIA B200", 183359 * 1024 * 1024, (10, 0), layout or ["1g.23gb"] * 7)
