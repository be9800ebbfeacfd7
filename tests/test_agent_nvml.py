"""NVML discovery and host assembly, against the pynvml stand-in (tests/fake_pynvml.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agent.host import build_server, detect_runtime_modes, load_server_file, merge_runtime_modes
from agent.main import make_discovery
from agent.nvml import brand_name, format_cuda_version, read_nvml
from placement.decide import decide
from placement.image_facts import ImageFacts
from placement.request import DeployRequest
from scanner.models import GpuFacts, ImageReport, PlatformReport
from tests.fake_pynvml import (
    NVML_BRAND_NVIDIA_NPU,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    FakeGpu,
    FakeNvml,
    a100_mig,
    h100,
    h200,
    rtx_4090,
    rtx_a6000,
    t4_old_driver,
)


def test_h100_and_a100_mig() -> None:
    nvml = FakeNvml(gpus=[h100(), a100_mig()], driver_version="535.104.05", cuda_version=12020)
    facts = read_nvml(nvml)
    assert facts.reason is None
    assert facts.driver_version == "535.104.05"
    assert facts.cuda_driver_version == "12.2"
    first, second = facts.gpus
    assert (first.index, first.uuid, first.name) == (0, h100().uuid, "NVIDIA H100 80GB HBM3")
    assert (first.brand, first.memory_mib, first.compute_capability, first.mig) == (
        "Nvidia",  # NVML_BRAND_NVIDIA: what an H100 reports on a current driver
        81559,
        "9.0",
        False,
    )
    assert (second.index, second.compute_capability, second.memory_mib, second.mig) == (1, "8.0", 40960, True)
    assert nvml.calls == ["init", "shutdown"]


def test_what_a_real_h200_reported() -> None:
    """agent/nvml.py on a real H200 (driver 580.159.04, CUDA 13.0) gave exactly this; the stand-in,
    fed the values NVML returned there, must give the same."""
    nvml = FakeNvml(gpus=[h200()], driver_version="580.159.04", cuda_version=13000)
    facts = read_nvml(nvml)
    assert (facts.driver_version, facts.cuda_driver_version, facts.reason) == ("580.159.04", "13.0", None)
    assert [gpu.model_dump() for gpu in facts.gpus] == [
        {
            "index": 0,
            "uuid": "GPU-0ce07f1d-9476-91fa-2833-b5669231b7a6",
            "name": "NVIDIA H200",
            "brand": "Nvidia",
            "memory_mib": 143771,
            "compute_capability": "9.0",
            "mig": False,
            "mig_devices": (),
        }
    ]


def test_names_as_older_nvidia_ml_py_gave_them() -> None:
    facts = read_nvml(FakeNvml(gpus=[h100()], names_as_bytes=True))
    assert facts.gpus[0].name == "NVIDIA H100 80GB HBM3"


def test_gpu_without_mig_support_and_a_lost_gpu() -> None:
    geforce = rtx_4090("GPU-g")
    lost = FakeGpu("GPU-lost", "gone", 2, 0, (8, 0), lost=True)
    facts = read_nvml(FakeNvml(gpus=[geforce, lost]))
    assert [(g.uuid, g.brand, g.mig) for g in facts.gpus] == [("GPU-g", "GeForce", False)]


def test_no_gpus_is_a_cpu_server_with_a_reason() -> None:
    facts = read_nvml(FakeNvml(gpus=[]))
    assert facts.gpus == []
    assert facts.reason is not None and "no usable GPU" in facts.reason
    server = build_server("cpu1", facts, ["runtime"], arch="x86_64", cpus=4, memory=1024)
    assert (server.arch, server.gpus, server.runtime_modes, server.driver_version) == ("amd64", [], [], None)


def test_nvml_library_missing() -> None:
    facts = read_nvml(FakeNvml(init_error=NVML_ERROR_LIBRARY_NOT_FOUND))
    assert facts.gpus == [] and facts.reason == "NVML is not available: NVML Shared Library Not Found"


def test_pynvml_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    facts = read_nvml()
    assert facts.gpus == [] and facts.reason is not None and "not installed" in facts.reason


@pytest.mark.parametrize(
    ("brand", "name"),
    [
        (1, "Quadro"),
        (2, "Tesla"),
        (5, "GeForce"),
        (11, "CloudGaming"),
        (13, "NvidiaRTX"),
        (14, "Nvidia"),
        (16, "TitanRTX"),
        (0, "Unknown"),
        (17, "Unknown"),  # DLA
        (18, "Unknown"),  # vGameDev
        (19, "Unknown"),  # NPU: NVML knows it, libnvidia-container does not
    ],
)
def test_brand_names_follow_the_runtime(brand: int, name: str) -> None:
    assert brand_name(brand) == name


@pytest.mark.parametrize(
    ("raw", "text"), [(12020, "12.2"), (11080, "11.8"), (13000, "13.0"), (12090, "12.9")]
)
def test_cuda_version_format(raw: int, text: str) -> None:
    assert format_cuda_version(raw) == text


def test_runtime_modes(tmp_path: Path) -> None:
    nothing = lambda _name: None  # noqa: E731
    assert detect_runtime_modes({"Runtimes": {"runc": {}}}, nothing, []) == []
    assert detect_runtime_modes({"Runtimes": {"runc": {}, "nvidia": {}}}, nothing, []) == [
        "runtime",
        "device-requests",
    ]
    hook = lambda name: "/usr/bin/x" if name == "nvidia-container-runtime-hook" else None  # noqa: E731
    assert detect_runtime_modes({"Runtimes": {}}, hook, []) == ["device-requests"]
    (tmp_path / "other.yaml").write_text("cdiVersion: 0.5.0\nkind: vendor.com/device\n")
    assert detect_runtime_modes({"CDISpecDirs": [str(tmp_path)]}, nothing) == []
    (tmp_path / "nvidia.json").write_text(
        json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": []})
    )
    assert detect_runtime_modes({"CDISpecDirs": [str(tmp_path)]}, nothing) == ["cdi"]


def test_inventory_file_overrides_discovery(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text(
        "name: from-file\narch: x86_64\nmemory: 64Gi\nruntime_modes: [runtime]\n"
        "gpus:\n  - {index: 0, uuid: GPU-1, name: NVIDIA L4, compute_capability: '8.9'}\n"
    )
    server = load_server_file(path)
    assert (server.name, server.arch, server.memory, server.source) == (
        "from-file",
        "amd64",
        64 * 1024**3,
        "agent",
    )
    assert load_server_file(path, name="override").name == "override"
    as_json = tmp_path / "server.json"
    as_json.write_text(json.dumps({"servers": [{"name": "j", "gpus": []}]}))
    assert load_server_file(as_json).name == "j"


def test_host_discovery_without_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real discovery wiring with NVML absent: a CPU server, and the reason to log."""
    monkeypatch.setitem(sys.modules, "pynvml", None)

    class NoDocker:
        def info(self) -> dict[str, object]:
            return {"Runtimes": {"runc": {}}}

    discover = make_discovery("box", NoDocker(), None)  # type: ignore[arg-type]
    server, reason = discover()
    assert server.gpus == [] and server.name == "box" and server.cpus > 0 and server.memory > 0
    assert reason is not None and "pynvml" in reason


def test_inventory_modes_add_to_the_engines() -> None:
    assert merge_runtime_modes(["runtime", "device-requests"], []) == ["runtime", "device-requests"]
    assert merge_runtime_modes(["runtime"], ["cdi", "runtime"]) == ["runtime", "cdi"]
    assert merge_runtime_modes([], ["cdi"]) == ["cdi"]
    assert merge_runtime_modes(None, ["runtime"]) == ["runtime"]


def test_a_gpu_whose_brand_nvml_cannot_tell_is_kept_with_an_unknown_brand() -> None:
    silent = FakeGpu("GPU-s", "NVIDIA L4", None, 23034 * 1024 * 1024, (8, 9))
    facts = read_nvml(FakeNvml(gpus=[silent]))
    assert [(gpu.uuid, gpu.brand) for gpu in facts.gpus] == [("GPU-s", "")]


def _brand_image(requirement: str) -> ImageFacts:
    env = {"NVIDIA_REQUIRE_BRAND": requirement, "NVIDIA_VISIBLE_DEVICES": "all"}
    platform = PlatformReport(
        platform="linux/amd64", digest="sha256:" + "4" * 64, gpu=GpuFacts(required=True, env=env)
    )
    return ImageFacts.from_report(ImageReport(reference="brand-test", platforms=[platform]))


@pytest.mark.parametrize(
    ("gpu", "requirement", "eligible"),
    [
        # NVIDIA's own images list both names: current libnvidia-container says Nvidia, pre-2022 Unknown.
        (h100(), "brand=nvidia brand=unknown", True),
        (h100(), "brand=NVIDIA brand=UNKNOWN", True),  # the runtime compares brands case-insensitively
        (h100(), "brand=tesla", False),  # a current driver no longer calls an H100 Tesla
        (h100(), "brand=tesla brand=nvidia brand=unknown", True),
        # Placement is conservative: brand=nvidia alone fails under a pre-2022 libnvidia-container.
        (h100(), "brand=nvidia", False),
        (a100_mig(), "brand=nvidia brand=unknown", True),
        (t4_old_driver(), "brand=tesla", True),
        (rtx_4090(), "brand=geforce", True),
        (rtx_4090(), "brand=geforcertx", False),
        (rtx_a6000(), "brand=nvidiartx brand=unknown", True),
        (FakeGpu("GPU-n", "NVIDIA NPU", NVML_BRAND_NVIDIA_NPU, 1 << 34, (9, 0)), "brand=unknown", True),
        (FakeGpu("GPU-q", "NVIDIA L4", None, 1 << 34, (8, 9)), "brand=tesla", True),  # NULL brand: true
    ],
)
def test_brand_clauses_match_what_the_runtime_sees(gpu: FakeGpu, requirement: str, eligible: bool) -> None:
    """From NVML (as real hardware reports today) through the agent's server to a placement verdict."""
    facts = read_nvml(FakeNvml(gpus=[gpu], driver_version="550.54.15", cuda_version=12040))
    server = build_server("node", facts, ["runtime"], arch="x86_64", cpus=8, memory=1 << 36)
    # A GPU in MIG mode is judged as the parent of the MIG device asked for (never handed out whole).
    request = DeployRequest(mig_devices=1) if gpu.mig_slots else DeployRequest()
    decision = decide(_brand_image(requirement), request, [server])
    assert [entry["server"] for entry in decision.eligible] == (["node"] if eligible else [])
