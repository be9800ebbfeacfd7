"""MIG profiles: how NVML names a MIG device, and how the schedulers spell that name.

A GPU in MIG mode is split into GPU instances, each with one or more compute instances; a MIG
device is one (GPU instance, compute instance) pair with its own UUID (`MIG-...`). Its profile
says how big it is: `1g.10gb` is one compute slice of seven with about a tenth of an 80 GB GPU's
memory; `1c.3g.40gb` is a one-slice compute instance inside a `3g.40gb` GPU instance; `+me`
marks the one profile per GPU that carries the media engines (`+gfx`, `-me` and `+me.all` are
the RTX PRO Blackwell variants).

* NVML names a MIG device `<parent name> MIG <profile>` (`NVIDIA A100-SXM4-40GB MIG 1g.5gb`,
  nvmlDeviceGetName on a MIG handle); `profile_from_name` reads the profile back.
* Without that name, the profile is derived from the device's attributes as NVIDIA's go-nvlib
  does (`profile_from_attributes`): the memory share of the parent rounded up to eighths, times
  the parent's memory in whole GiB (rounded up), rounded half away from zero.
* The Kubernetes device plugin writes `+` as `.` in resource names (`nvidia.com/mig-1g.10gb.me`);
  GPU Feature Discovery's product label is `<parent product>-MIG-<profile>`.

Pure: no I/O.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from functools import lru_cache

# "1g.10gb", "1c.3g.40gb", "1g.10gb+me", "1g.24gb-me", "1g.24gb+me.all", "1g.24gb+gfx"
PROFILE = re.compile(
    r"^(?:(?P<c>\d{1,2})c\.)?(?P<g>\d{1,2})g\.(?P<gb>\d{1,4})gb(?P<extra>[+-][a-z0-9.,+-]{1,16})?$"
)
_NAME_MIG = re.compile(r"\sMIG\s+(\S+)\s*$")
_MIB = 1024**2
_GIB = 1024**3
MAX_MIG_DEVICES_PER_GPU = (
    16  # NVML's largest layouts have 7 (A100, H100, H200, B200); files may not exceed this
)


def normalise_profile(text: str) -> str:
    """`MIG 1g.10gb`, ` 1G.10GB ` -> `1g.10gb`; raises ValueError for what is not a MIG profile."""
    value = str(text).strip()
    if value[:4].lower() == "mig ":
        value = value[4:].strip()
    value = value.lower()
    if not PROFILE.match(value):
        shown = str(text)[:40]
        raise ValueError(f"{shown!r} is not a MIG profile such as 1g.10gb, 1c.3g.40gb or 1g.10gb+me")
    return value


def profile_from_name(mig_device_name: str) -> str | None:
    """The profile in NVML's MIG device name (`NVIDIA H100 80GB HBM3 MIG 1g.10gb` -> `1g.10gb`)."""
    match = _NAME_MIG.search(mig_device_name)
    if match is None:
        return None
    try:
        return normalise_profile(match.group(1))
    except ValueError:
        return None


def memory_gb(parent_total_bytes: int, mig_memory_mib: int) -> int:
    """The `<N>gb` of a profile name, as go-nvlib derives it from the device's and parent's memory."""
    if parent_total_bytes <= 0:
        return 0
    share = mig_memory_mib * _MIB / parent_total_bytes
    share = math.ceil(share * 8) / 8
    parent_gib = -(-parent_total_bytes // _GIB)
    return math.floor(share * parent_gib + 0.5)  # Go's math.Round: half away from zero


def profile_from_attributes(
    gpu_instance_slices: int,
    compute_instance_slices: int,
    mig_memory_mib: int,
    parent_total_bytes: int,
    suffix: str = "",
) -> str:
    """`1g.10gb` (or `1c.3g.40gb` for a compute instance smaller than its GPU instance)."""
    gb = memory_gb(parent_total_bytes, mig_memory_mib)
    name = f"{gpu_instance_slices}g.{gb}gb{suffix}"
    if compute_instance_slices and compute_instance_slices != gpu_instance_slices:
        name = f"{compute_instance_slices}c.{name}"
    return name


def gpu_instance_slices(profile: str) -> int:
    """The `g` count of a profile (its GPU instance's compute slices); 0 for a malformed one."""
    match = PROFILE.match(profile)
    return int(match.group("g")) if match else 0


def kubernetes_name(profile: str) -> str:
    """The device plugin's spelling: `+` is not allowed in a resource name, so it becomes `.`."""
    return profile.replace("+", ".")


def resource_name(profile: str) -> str:
    """The mixed strategy's extended resource for a profile: `nvidia.com/mig-1g.10gb`."""
    return f"nvidia.com/mig-{kubernetes_name(profile)}"


def profile_from_resource(name: str) -> str | None:
    """`nvidia.com/mig-1g.10gb.me` -> `1g.10gb+me`: the profile a mixed-strategy resource names."""
    if not name.startswith("nvidia.com/mig-"):
        return None
    text = name.removeprefix("nvidia.com/mig-")
    base = re.match(r"^(?:\d{1,2}c\.)?\d{1,2}g\.\d{1,4}gb", text)
    if base is None:
        return None
    rest = text[base.end() :]
    try:
        return normalise_profile(base.group(0) + ("+" + rest[1:] if rest.startswith(".") else rest))
    except ValueError:
        return None


@lru_cache(maxsize=1024)
def sort_key(profile: str) -> tuple[int, int, int, str]:
    """Smaller first: by memory, then GPU-instance slices, then compute slices, then spelling."""
    match = PROFILE.match(profile)
    if match is None:
        return (1 << 30, 0, 0, profile)
    g = int(match.group("g"))
    c = int(match.group("c") or g)
    return (int(match.group("gb")), g, c, profile)


def count_profiles(profiles: Iterable[str] | Mapping[str, int]) -> str:
    """`7 × 1g.10gb, 1 × 3g.40gb` (smallest profile first) from profiles or counts per profile;
    `none` when empty."""
    counts = profiles if isinstance(profiles, Mapping) else Counter(profiles)
    if not counts:
        return "none"
    return ", ".join(f"{counts[p]} × {p}" for p in sorted(counts, key=sort_key))
