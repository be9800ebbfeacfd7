"""What a deploy asks for, in our own form or as an Akash SDL `gpu` block or ZenML ResourceSettings.

All three forms become one `DeployRequest`; `DeployRequest.parse_any` decides which form it got
and raises pydantic's ValidationError (a ValueError) with the offending field when it is wrong.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from placement.inventory import parse_bytes
from placement.mig import normalise_profile

_VERSION = re.compile(r"^\d+(\.\d+)*$")
_ZENML_KEYS = frozenset({"cpu_count", "gpu_count", "memory"})
_WHOLE_OR_SLICES = "ask for whole GPUs (gpus) or for MIG devices (mig_devices, mig_profiles), not both"
_ZENML_MEMORY = re.compile(r"^[0-9]+(KB|KiB|MB|MiB|GB|GiB|TB|TiB|PB|PiB)$")


def _quantity(value: Any) -> int | None:
    return None if value is None else parse_bytes(value)


def _cpu_units(value: Any) -> float:
    """Akash/Kubernetes CPU units: 2, "2", "0.5" or "500m"."""
    if isinstance(value, dict):
        value = value.get("units")
    text = str(value).strip()
    if text.endswith("m"):
        return float(text[:-1]) / 1000
    return float(text)


class DeployRequest(BaseModel):
    """Resources a deploy needs. Every field is optional; None means "no constraint"."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus: int | None = Field(
        default=None,
        ge=0,
        description="whole GPUs to assign (never a GPU in MIG mode); a GPU image defaults to 1"
        " unless MIG devices are asked for",
    )
    mig_devices: int | None = Field(
        default=None,
        ge=0,
        description="MIG devices to assign instead of whole GPUs (1 when only `mig_profiles` is given)",
    )
    mig_profiles: list[str] = Field(
        default_factory=list,
        description="acceptable MIG profiles, e.g. 1g.10gb or 3g.40gb (any profile when empty);"
        " `min_gpu_memory` then applies to each MIG device",
    )
    gpu_models: list[str] = Field(
        default_factory=list, description="aliases or NVML names (of the parent GPU, for MIG devices)"
    )
    gpu_model_order: Literal["any", "ordered"] = Field(
        default="any", description="'ordered': earlier models are preferred; 'any': all equally good"
    )
    min_gpu_memory: int | None = Field(
        default=None,
        description="bytes per GPU, or per MIG device when MIG devices are asked for; accepts 40Gi, 80GB",
    )
    min_compute_capability: str | None = None
    min_driver: str | None = None
    cpus: float | None = Field(default=None, ge=0)
    memory: int | None = Field(default=None, description="bytes; accepts 16Gi")
    labels: dict[str, str] = Field(default_factory=dict)
    gpu_code_rule: Literal["dispatch", "strict"] | None = Field(
        default=None,
        description="how the image's GPU code is judged (placement.gpu_code): 'dispatch' as packages load it"
        " (a library runs where some of its kernels do), 'strict' every kernel everywhere; default: the"
        " service's GPUBADGE_GPU_CODE_RULE",
    )

    @field_validator("min_gpu_memory", "memory", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> int | None:
        return _quantity(value)

    @field_validator("min_compute_capability", "min_driver", mode="before")
    @classmethod
    def _version(cls, value: Any) -> str | None:
        if value is None:
            return None
        text = str(value).strip()
        if not _VERSION.match(text):
            raise ValueError(f"{text!r} is not a version such as 8.0 or 535.104.05")
        return text

    @field_validator("mig_devices")
    @classmethod
    def _devices(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and info.data.get("gpus"):
            raise ValueError(_WHOLE_OR_SLICES)
        return value

    @field_validator("mig_profiles", mode="before")
    @classmethod
    def _profiles(cls, value: Any, info: ValidationInfo) -> list[str]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple):
            raise ValueError("expected a list of MIG profiles such as [1g.10gb]")
        profiles = list(dict.fromkeys(normalise_profile(item) for item in value))
        if profiles and info.data.get("gpus"):
            raise ValueError(_WHOLE_OR_SLICES)
        if profiles and info.data.get("mig_devices") == 0:
            raise ValueError("MIG profiles given with mig_devices: 0")
        return profiles

    @property
    def slices_needed(self) -> int:
        """MIG devices asked for: `mig_devices`, else 1 when profiles are named, else 0."""
        if self.mig_devices is not None:
            return self.mig_devices
        return 1 if self.mig_profiles else 0

    @field_validator("gpu_models", mode="before")
    @classmethod
    def _models(cls, value: Any) -> list[str]:
        if isinstance(value, str):
            value = [value]
        models = [str(v).strip() for v in value or []]
        if any(not m for m in models):
            raise ValueError("gpu_models entries must not be empty")
        return models

    @classmethod
    def parse_any(cls, data: dict[str, Any]) -> DeployRequest:
        """Accept our form, an Akash SDL compute profile (`gpu: {units, attributes}`) or ZenML settings."""
        if not isinstance(data, dict):
            raise ValueError(f"a deploy request must be a mapping, got {type(data).__name__}")
        resources = data.get("resources")
        if isinstance(resources, dict) and set(data) <= {"resources"}:
            data = resources  # Akash `profiles.compute.<name>.resources` or ZenML `settings.resources`
        if isinstance(data.get("gpu"), dict):
            return AkashResources.model_validate(data).to_request()
        if set(data) <= _ZENML_KEYS and ({"cpu_count", "gpu_count"} & set(data)):
            return ZenMLResourceSettings.model_validate(data).to_request()
        return cls.model_validate(data)


class AkashGpuModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = "*"
    ram: str | None = None
    interface: Literal["pcie", "sxm"] | None = None


class AkashGpuAttributes(BaseModel):
    model_config = ConfigDict(extra="forbid")

    vendor: dict[str, list[AkashGpuModel] | None]

    @field_validator("vendor")
    @classmethod
    def _nvidia_only(
        cls, value: dict[str, list[AkashGpuModel] | None]
    ) -> dict[str, list[AkashGpuModel] | None]:
        others = sorted(set(value) - {"nvidia"})
        if others:
            raise ValueError(f"only vendor 'nvidia' is supported, got {', '.join(others)}")
        return value


class AkashGpu(BaseModel):
    model_config = ConfigDict(extra="forbid")

    units: int = Field(ge=0)
    attributes: AkashGpuAttributes | None = None

    @model_validator(mode="after")
    def _attributes_needed(self) -> AkashGpu:
        if self.units > 0 and self.attributes is None:
            raise ValueError("gpu.units > 0 requires gpu.attributes.vendor")
        return self


class AkashResources(BaseModel):
    """Akash SDL compute resources: `cpu.units`, `memory.size`, `gpu.{units, attributes}`."""

    model_config = ConfigDict(extra="ignore")

    cpu: Any = None
    memory: Any = None
    gpu: AkashGpu

    def to_request(self) -> DeployRequest:
        models: list[str] = []
        rams: set[str] = set()
        entries = (self.gpu.attributes.vendor.get("nvidia") if self.gpu.attributes else None) or []
        for entry in entries:
            if entry.ram:
                rams.add(entry.ram)
            if entry.model != "*":
                models.append(f"{entry.model}-{entry.interface}" if entry.interface else entry.model)
        min_memory: int | None = None
        if len(rams) == 1:
            min_memory = parse_bytes(next(iter(rams)))
        elif rams:
            # Different sizes per model: keep each pairing as a sized alias (a100 + 80Gi -> a100-80gb).
            models = [
                f"{e.model}-{round(parse_bytes(e.ram) / 1024**3)}gb" if e.ram else e.model
                for e in entries
                if e.model != "*"
            ]
        memory = self.memory.get("size") if isinstance(self.memory, dict) else self.memory
        try:
            return DeployRequest(
                gpus=self.gpu.units,
                gpu_models=models,
                min_gpu_memory=min_memory,
                cpus=_cpu_units(self.cpu) if self.cpu is not None else None,
                memory=memory,
            )
        except ValidationError as exc:
            raise ValueError(f"invalid Akash resources: {exc}") from exc


class ZenMLResourceSettings(BaseModel):
    """ZenML `ResourceSettings`: cpu_count, gpu_count, memory (e.g. "16GB")."""

    model_config = ConfigDict(extra="forbid")

    cpu_count: float | None = Field(default=None, gt=0)
    gpu_count: int | None = Field(default=None, ge=0)
    memory: str | None = None

    @field_validator("memory")
    @classmethod
    def _memory(cls, value: str | None) -> str | None:
        if value is not None and not _ZENML_MEMORY.match(value):
            raise ValueError(f"{value!r} must look like 16GB or 512MiB (ZenML's memory format)")
        return value

    def to_request(self) -> DeployRequest:
        return DeployRequest(gpus=self.gpu_count, cpus=self.cpu_count, memory=self.memory)
