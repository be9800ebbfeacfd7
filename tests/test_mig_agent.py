"""MIG devices as the agent reads them from NVML, through the pynvml STAND-IN (tests/fake_pynvml.py).

There is no GPU host for these tests, and none would be switched into MIG mode for them: enabling
MIG needs a GPU reset (and on some platforms a reboot). So the stand-in's MIG profiles are checked
here against NVIDIA's own documentation first: the profile names, memory shares and instance
counts of NVIDIA's MIG User Guide ("Supported MIG Profiles"), and the rule NVIDIA's go-nvlib uses
to name a profile from the device's memory. The agent is then run against layouts built from them.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest

from agent.nvml import read_nvml
from agent.runner import container_options
from placement.mig import memory_gb, profile_from_attributes, profile_from_name
from placement.protocol import AgentDeployment
from tests.fake_pynvml import (
    COMPUTE_SLICES,
    MIG_PROFILES,
    NVML_BRAND_NVIDIA,
    NVML_ERROR_NOT_SUPPORTED,
    FakeGpu,
    FakeMigDevice,
    FakeNvml,
    NVMLError,
    a100_40gb_mig,
    a100_80gb_mig,
    b200_mig,
    h100,
    h100_mig,
    h200_mig,
    mig_gpu,
)

# NVIDIA MIG User Guide, "Supported MIG Profiles": profile -> (share of memory in eighths, instances
# available). A100-SXM4-80GB and H100 80GB use the 80GB names with A100-40GB's shares and counts. (The
# guide's A100-40GB table prints 1/8 of memory for 1g.10gb, against its own name and the 9.75 GiB
# nvidia-smi shows for it: 2/8, as the H200 table has for the same profile, 1g.35gb.)
_A100_40 = {
    "1g.5gb": (1, 7),
    "1g.5gb+me": (1, 1),
    "1g.10gb": (2, 4),
    "2g.10gb": (2, 3),
    "3g.20gb": (4, 2),
    "4g.20gb": (4, 1),
    "7g.40gb": (8, 1),
}
_80GB = {
    "1g.10gb": (1, 7),
    "1g.10gb+me": (1, 1),
    "1g.20gb": (2, 4),
    "2g.20gb": (2, 3),
    "3g.40gb": (4, 2),
    "4g.40gb": (4, 1),
    "7g.80gb": (8, 1),
}
DOCUMENTED: dict[str, dict[str, tuple[int, int]]] = {
    "NVIDIA A100-SXM4-40GB": _A100_40,
    "NVIDIA A100-SXM4-80GB": _80GB,
    "NVIDIA H100 80GB HBM3": _80GB,
    "NVIDIA H200": {
        "1g.18gb": (1, 7),
        "1g.18gb+me": (1, 1),
        "1g.35gb": (2, 4),
        "2g.35gb": (2, 3),
        "3g.71gb": (4, 2),
        "4g.71gb": (4, 1),
        "7g.141gb": (8, 1),
    },
    "NVIDIA B200": {
        "1g.23gb": (1, 7),
        "1g.23gb+me": (1, 1),
        "1g.45gb": (2, 4),
        "2g.45gb": (2, 3),
        "3g.90gb": (4, 2),
        "4g.90gb": (4, 1),
        "7g.180gb": (8, 1),
    },
}
# NVML's total memory of each product's parent GPU (bytes), the base of go-nvlib's profile names.
PARENT_BYTES = {
    "NVIDIA A100-SXM4-40GB": 40960 * 1024**2,
    "NVIDIA A100-SXM4-80GB": 81920 * 1024**2,
    "NVIDIA H100 80GB HBM3": 81559 * 1024**2,
    "NVIDIA H200": 150_754_820_096,
    "NVIDIA B200": 183359 * 1024**2,
}
FULL_SMS = {"NVIDIA A100-SXM4-40GB": 108, "NVIDIA A100-SXM4-80GB": 108, "NVIDIA H100 80GB HBM3": 132}
FULL_SMS |= {"NVIDIA H200": 132, "NVIDIA B200": 148}


@pytest.mark.parametrize("product", sorted(MIG_PROFILES))
def test_stand_in_profiles_are_nvidias(product: str) -> None:
    """Names, memory shares and instance counts as NVIDIA documents them; memory and SMs consistent
    with the names by go-nvlib's rule. Every documented product is complete but B200 (one captured
    profile)."""
    rows = MIG_PROFILES[product]
    documented = DOCUMENTED[product]
    names = [row.profile for row in rows]
    if product == "NVIDIA B200":
        assert set(names) <= set(documented)
    else:
        assert sorted(names) == sorted(documented)
    parent = PARENT_BYTES[product]
    for row in rows:
        eighths, instances = documented[row.profile]
        gb = int(re.fullmatch(r"\dg\.(\d+)gb(\+me)?", row.profile).group(1))  # type: ignore[union-attr]
        assert (row.memory_slices, row.instances) == (eighths, instances), row
        assert row.slices == int(row.profile[0])
        share = row.memory_mib * 1024**2 / parent
        assert math.ceil(share * 8) == eighths, (row.profile, share)
        assert memory_gb(parent, row.memory_mib) == gb, row.profile
        assert 0 < row.multiprocessors <= FULL_SMS[product]
        assert row.multiprocessors >= row.slices * (FULL_SMS[product] // (COMPUTE_SLICES + 1)), row
    by_slices = sorted(rows, key=lambda row: (row.slices, row.memory_slices))
    assert [row.multiprocessors for row in by_slices] == sorted(row.multiprocessors for row in by_slices)


def test_go_nvlib_names_round_half_away_from_zero() -> None:
    """H200's 3g.71gb is half of 141 GiB (70.5): Go's math.Round makes it 71, Python's round() 70."""
    assert memory_gb(PARENT_BYTES["NVIDIA H200"], 66560) == 71
    assert memory_gb(PARENT_BYTES["NVIDIA B200"], 20992) == 23  # 22.5
    assert profile_from_attributes(3, 1, 40448, PARENT_BYTES["NVIDIA H100 80GB HBM3"]) == "1c.3g.40gb"
    assert profile_from_name("NVIDIA A100-SXM4-40GB MIG 1g.5gb") == "1g.5gb"
    assert profile_from_name("NVIDIA A100-SXM4-40GB") is None


@pytest.mark.parametrize(
    ("layout", "problem"),
    [
        (["4g.40gb", "4g.40gb"], "at most 1"),
        (["1g.10gb"] * 8, "at most 7"),
        (["4g.40gb", "3g.40gb", "1g.10gb"], "compute slices"),
        (["3g.40gb", "1g.20gb", "1g.20gb", "1g.20gb"], "memory slices"),
    ],
)
def test_stand_in_refuses_a_layout_no_gpu_could_hold(layout: list[str], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        h100_mig(layout=layout)


@pytest.mark.parametrize(
    ("gpu", "profile", "memory_mib", "sms"),
    [
        (a100_40gb_mig(), "1g.5gb", 4864, 14),
        (a100_80gb_mig(), "1g.10gb", 9728, 14),
        (h100_mig(), "1g.10gb", 9984, 16),
        (h200_mig(), "1g.18gb", 16384, 16),
        (b200_mig(), "1g.23gb", 20992, 18),
    ],
)
def test_agent_reports_each_products_mig_devices(
    gpu: FakeGpu, profile: str, memory_mib: int, sms: int
) -> None:
    facts = read_nvml(FakeNvml(gpus=[h100(), gpu], driver_version="580.65.06", cuda_version=13000))
    whole, split = facts.gpus
    assert (whole.mig, whole.mig_devices) == (False, ())
    assert split.mig and split.name == gpu.name and split.memory_mib == gpu.memory_bytes // 1024**2
    assert [d.index for d in split.mig_devices] == list(range(7))
    assert {(d.profile, d.memory_mib, d.multiprocessors) for d in split.mig_devices} == {
        (profile, memory_mib, sms)
    }
    assert [(d.gpu_instance_id, d.compute_instance_id) for d in split.mig_devices] == [
        (i, 0) for i in range(1, 8)
    ]
    uuids = [d.uuid for d in split.mig_devices]
    assert len(set(uuids)) == 7 and all(re.fullmatch(r"MIG-[0-9a-f-]{36}", uuid) for uuid in uuids)
    assert uuids == [gpu.mig_slots[slot].uuid for slot in range(7)]


def test_a_mixed_layout_in_slot_order() -> None:
    gpu = h100_mig(layout=["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"])
    (read,) = read_nvml(FakeNvml(gpus=[gpu])).gpus
    assert [(d.index, d.profile, d.memory_mib, d.multiprocessors) for d in read.mig_devices] == [
        (0, "3g.40gb", 40448, 60),
        (1, "2g.20gb", 20096, 32),
        (2, "1g.10gb", 9984, 16),
        (3, "1g.10gb", 9984, 16),
    ]


class NamelessMigNvml(FakeNvml):
    """NVML that cannot name a MIG device: the agent derives the profile from its attributes."""

    def nvmlDeviceGetName(self, handle: Any) -> str | bytes:
        if isinstance(handle, FakeMigDevice):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return super().nvmlDeviceGetName(handle)


@pytest.mark.parametrize("product", sorted(MIG_PROFILES))
def test_profiles_from_attributes_when_nvml_gives_no_name(product: str) -> None:
    """go-nvlib's derivation gives every documented name (a `+me` variant reads as its base profile:
    the attributes alone do not tell it apart)."""
    for row in MIG_PROFILES[product]:
        gpu = mig_gpu(
            "GPU-00000000-0000-4000-8000-00000000000a", product, PARENT_BYTES[product], (9, 0), [row.profile]
        )
        (read,) = read_nvml(NamelessMigNvml(gpus=[gpu])).gpus
        assert [d.profile for d in read.mig_devices] == [row.profile.removesuffix("+me")]


def test_empty_slots_broken_devices_and_pending_modes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent.nvml")
    sparse = a100_80gb_mig(layout=["1g.10gb"] * 4)
    del sparse.mig_slots[1]  # a destroyed instance leaves its slot empty (NOT_FOUND)
    sparse.mig_slots[2].broken = True  # being torn down while read
    turning_off = h100_mig("GPU-22222222-0000-4000-8000-000000000000")
    turning_off.mig_mode = (1, 0)
    turning_on = FakeGpu(
        "GPU-33333333-0000-4000-8000-000000000000",
        "NVIDIA H100 80GB HBM3",
        NVML_BRAND_NVIDIA,
        81559 << 20,
        (9, 0),
        mig_mode=(0, 1),
    )
    unconfigured = FakeGpu(
        "GPU-44444444-0000-4000-8000-000000000000",
        "NVIDIA H200",
        NVML_BRAND_NVIDIA,
        150_754_820_096,
        (9, 0),
        mig_mode=(1, 1),
    )
    facts = read_nvml(FakeNvml(gpus=[sparse, turning_off, turning_on, unconfigured]))
    first, second, third, fourth = facts.gpus
    assert [d.index for d in first.mig_devices] == [0, 3]
    assert second.mig and len(second.mig_devices) == 7  # the current mode counts until the reset
    assert (third.mig, third.mig_devices) == (False, ())
    assert (fourth.mig, fourth.mig_devices) == (True, ())
    text = caplog.text
    assert "skipping MIG device 2 of GPU 0" in text
    assert "GPU 1: MIG mode off is pending" in text and "GPU 2: MIG mode on is pending" in text
    assert "GPU 3 is in MIG mode with no MIG device" in text


def test_the_agent_never_changes_a_gpus_mig_mode() -> None:
    """Reading only: no NVML call that sets a mode or creates or destroys an instance (a GPU host
    switched into MIG mode needs a reset, and this project never does it)."""
    writes = re.compile(r"nvml\w*(Set|Create|Destroy|Reset)\w*|SetMigMode|CreateGpuInstance")
    agent = Path(__file__).resolve().parent.parent / "agent"
    found = [
        (path.name, match.group(0))
        for path in agent.glob("*.py")
        for match in writes.finditer(path.read_text())
    ]
    assert found == []
    assert not any(name.startswith(("nvmlDeviceSet", "nvmlDeviceCreate")) for name in dir(FakeNvml))


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("runtime", {"runtime": "nvidia"}),
        ("cdi", {"device_ids": ["nvidia.com/gpu=MIG-1", "nvidia.com/gpu=MIG-2"]}),
    ],
)
def test_a_mig_deployment_names_its_devices_to_docker(mode: str, expected: dict[str, Any]) -> None:
    """By UUID: NVIDIA_VISIBLE_DEVICES=MIG-... for the runtime, the CDI name nvidia.com/gpu=MIG-...
    (nvidia-ctk's `uuid` device names) for CDI. The Debian Docker engine the tests run (20.10) has
    no CDI, so the CDI form is checked here, not run."""
    deployment = AgentDeployment(
        id="m1", image="r/app:1", digest="sha256:" + "1" * 64, gpu_required=True, gpus=["MIG-1", "MIG-2"]
    )
    options = container_options(deployment, "srv", mode)  # type: ignore[arg-type]
    assert options["environment"]["NVIDIA_VISIBLE_DEVICES"] == "MIG-1,MIG-2"
    if mode == "runtime":
        assert options["runtime"] == "nvidia"
    else:
        (request,) = options["device_requests"]
        assert request["Driver"] == "cdi" and request["DeviceIDs"] == expected["device_ids"]
