"""The fleet: servers and their GPUs, in the shape agents report and inventory files hold.

Other tools write inventory files in exactly this shape, so optional fields take
defaults and unknown fields are ignored rather than rejected.
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from placement.mig import MAX_MIG_DEVICES_PER_GPU, normalise_profile

RuntimeMode = Literal["runtime", "device-requests", "cdi"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int | float) -> int:
    """`256Gi`, `40GB`, `512Mi` or a plain number of bytes -> bytes. Raises ValueError naming the bad part."""
    if isinstance(value, bool):
        raise ValueError(f"invalid quantity {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError(f"invalid quantity {value!r}")
        return int(value)
    if not isinstance(value, str):  # a TypeError here would escape pydantic as a 500
        raise ValueError(
            f"invalid quantity: expected a number or a string such as 40Gi, not {type(value).__name__}"
        )
    match = _QUANTITY.match(value)
    if not match:
        raise ValueError(f"invalid quantity {value!r}: expected a number with an optional unit such as 40Gi")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"invalid quantity {value!r}: unknown unit {unit!r}")
    size = float(number) * factor
    if not math.isfinite(size):
        raise ValueError(f"invalid quantity {value[:40]!r}: too large")
    return int(size)


class MigDevice(BaseModel):
    """One MIG device of a GPU in MIG mode (a GPU instance and one compute instance), as NVML gives it.

    The CUDA version, driver, brand and compute capability are its parent GPU's: placement judges
    an image's requirements on the parent, and hands out the MIG device by its own UUID.
    """

    model_config = ConfigDict(extra="ignore")

    index: int = Field(ge=0, description="NVML's MIG device index under its parent GPU")
    uuid: str = Field(min_length=1, description="MIG-...: what NVIDIA_VISIBLE_DEVICES and CDI take")
    profile: str = Field(description="e.g. 1g.10gb, 1c.3g.40gb, 1g.10gb+me (a leading `MIG ` is dropped)")
    memory_mib: int = Field(default=0, ge=0)
    multiprocessors: int = Field(default=0, ge=0)
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    decoders: int | None = Field(
        default=None,
        ge=0,
        description="video decoders (NVDEC) in the MIG device, NVML's sharedDecoderCount: a 1g.5gb of an A100"
        " has none, its 1g.5gb+me one; None: not known",
    )

    @field_validator("profile", mode="before")
    @classmethod
    def _profile(cls, value: Any) -> str:
        return normalise_profile(value)


class Gpu(BaseModel):
    """One GPU as NVML describes it; a GPU in MIG mode (`mig`) lists its MIG devices and is never
    handed out whole."""

    model_config = ConfigDict(extra="ignore")

    index: int
    uuid: str
    name: str
    brand: str = ""
    memory_mib: int = 0
    compute_capability: str = ""
    mig: bool = False
    # a tuple: no per-GPU allocation for the many GPUs without MIG devices (fleets of 100,000 servers)
    mig_devices: tuple[MigDevice, ...] = Field(default=(), max_length=MAX_MIG_DEVICES_PER_GPU)

    @model_validator(mode="after")
    def _mig_devices_mean_mig_mode(self) -> Gpu:
        if self.mig_devices and not self.mig:
            self.mig = True  # a file that lists MIG devices and forgets `mig: true`
        return self

    @property
    def device_uuids(self) -> list[str]:
        """The GPU's UUID and its MIG devices' UUIDs: everything a reservation may name."""
        return [self.uuid, *(device.uuid for device in self.mig_devices)]


class Server(BaseModel):
    """A server that can run containers; a CPU server has no GPUs."""

    model_config = ConfigDict(extra="ignore")

    name: str
    arch: str = "amd64"
    cpus: int = 0
    memory: int = Field(default=0, description="bytes; files may say 256Gi")
    labels: dict[str, str] = Field(default_factory=dict)
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    musl: bool = False
    runtime_modes: list[RuntimeMode] = Field(default_factory=list)
    gpus: list[Gpu] = Field(default_factory=list)
    gpus_in_use: list[str] = Field(
        default_factory=list, description="GPU and MIG device UUIDs reserved or busy"
    )
    last_heartbeat: datetime | None = None
    source: Literal["file", "agent"] = "file"

    @field_validator("memory", mode="before")
    @classmethod
    def _memory_quantity(cls, value: Any) -> int:
        return parse_bytes(value) if value is not None else 0

    @field_validator("arch", mode="before")
    @classmethod
    def _normalise_arch(cls, value: Any) -> str:
        aliases = {"x86_64": "amd64", "aarch64": "arm64", "arm64/v8": "arm64"}
        text = str(value).lower()
        return aliases.get(text, text)

    @property
    def free_gpus(self) -> list[Gpu]:
        """Whole GPUs that may be handed out: not in use and not in MIG mode."""
        busy = set(self.gpus_in_use)
        return [gpu for gpu in self.gpus if gpu.uuid not in busy and not gpu.mig]

    @property
    def device_uuids(self) -> list[str]:
        """Every GPU and MIG device UUID of this server, GPUs in index order."""
        return [uuid for gpu in self.gpus for uuid in gpu.device_uuids]


class Inventory(BaseModel):
    model_config = ConfigDict(extra="ignore")

    servers: list[Server] = Field(default_factory=list)


def parse_json_or_yaml(text: str) -> Any:
    """A JSON document, else a YAML one (JSON is tried first: it is the faster parser and the
    common case). Raises ValueError "neither JSON nor YAML: ..." with YAML's reason."""
    try:
        return json.loads(text)
    except ValueError:
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"neither JSON nor YAML: {exc}") from None


def parse_inventory(text: str) -> Inventory:
    """Parse an inventory document, JSON or YAML (`{"servers": [...]}` or a bare list of servers).

    Pure: callers read the file, so placement stays free of I/O. Raises ValueError with the reason.
    """
    try:
        data = parse_json_or_yaml(text)
    except ValueError as exc:
        raise ValueError(f"inventory is {exc}") from None
    if isinstance(data, list):
        data = {"servers": data}
    return Inventory.model_validate(data or {})
