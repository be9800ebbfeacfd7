"""GPU facts from image configs (NVIDIA semantics, NVIDIA's own test tables) and badge names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from scanner.facts.badges import badges
from scanner.facts.gpu import cuda_major_minor, gpu_facts
from scanner.models import GpuFacts, LibcVerdict

CASES_FILE = Path(__file__).parent.parent / "fixtures" / "nvidia_toolkit_test_cases.json"
BRANDS_11_5_TO_12_4 = [
    "tesla",
    "unknown",
    "nvidia",
    "nvidiartx",
    "geforce",
    "geforcertx",
    "quadro",
    "quadrortx",
    "titan",
    "titanrtx",
]


def require_cuda(cuda: str, branches: list[int]) -> str:
    """NVIDIA_REQUIRE_CUDA as the CUDA base images write it (see nvidia_semantics.md section 5)."""
    terms = [f"brand={b},driver>={n},driver<{n + 1}" for n in branches for b in BRANDS_11_5_TO_12_4]
    return " ".join([f"cuda>={cuda}", *terms])


CUDA_12_2_2 = require_cuda("12.2", [470, 525])


def config(env: dict[str, str], labels: dict[str, str] | None = None) -> dict[str, Any]:
    section: dict[str, Any] = {"Env": [f"{k}={v}" for k, v in env.items()]}
    if labels is not None:
        section["Labels"] = labels
    return {"architecture": "amd64", "os": "linux", "config": section}


def toolkit_cases(group: str) -> list[dict[str, Any]]:
    if not CASES_FILE.exists():
        raise AssertionError(f"NVIDIA test tables missing: {CASES_FILE}")
    return [case for case in json.loads(CASES_FILE.read_text()) if case["group"] == group]


def test_cuda_on_ubuntu_config() -> None:
    facts = gpu_facts(
        config(
            {
                "PATH": "/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/bin",
                "NVARCH": "x86_64",
                "NVIDIA_REQUIRE_CUDA": CUDA_12_2_2,
                "NV_CUDA_CUDART_VERSION": "12.2.140-1",
                "CUDA_VERSION": "12.2.2",
                "LD_LIBRARY_PATH": "/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
                "NVIDIA_VISIBLE_DEVICES": "all",
                "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
            },
            {"maintainer": "NVIDIA CORPORATION <cudatools@nvidia.com>"},
        )
    )
    assert facts.required and facts.runtime_gpu_request and not facts.legacy
    assert facts.cuda_version == "12.2"
    assert facts.signals == ["NVIDIA_REQUIRE_CUDA", "CUDA_VERSION", "NVIDIA_VISIBLE_DEVICES"]
    assert facts.requirements == [CUDA_12_2_2] == facts.effective_requirements
    assert facts.requirement_errors == []
    assert facts.visible_devices == "all" and facts.driver_capabilities == "compute,utility"
    assert list(facts.env) == [
        "CUDA_VERSION",
        "NVIDIA_DRIVER_CAPABILITIES",
        "NVIDIA_REQUIRE_CUDA",
        "NVIDIA_VISIBLE_DEVICES",
    ]
    assert facts.labels == {}


def test_alpine_with_nvidia_gpu_only() -> None:
    facts = gpu_facts(config({"NVIDIA_GPU": "1", "PATH": "/bin"}))
    assert facts.required and facts.signals == ["NVIDIA_GPU"]
    assert not facts.runtime_gpu_request  # NVIDIA's toolkit does not read NVIDIA_GPU
    assert facts.cuda_version is None and facts.requirements == []
    assert not gpu_facts(config({"NVIDIA_GPU": "false"})).required


def test_legacy_cuda_version_only_image() -> None:
    facts = gpu_facts(config({"CUDA_VERSION": "9.0.176", "PATH": "/usr/bin"}))
    assert facts.required and facts.legacy and facts.runtime_gpu_request
    assert facts.signals == ["CUDA_VERSION"]
    assert facts.cuda_version == "9.0"
    assert facts.requirements == [] and facts.effective_requirements == ["cuda>=9.0"]


def test_plain_image_needs_no_gpu() -> None:
    facts = gpu_facts(config({"PATH": "/usr/bin", "LANG": "C.UTF-8"}))
    assert facts == GpuFacts(executable_path=["/usr/bin"])  # where Triton would look for a C compiler


def test_arm64_upper_case_key_still_gives_the_cuda_version() -> None:
    facts = gpu_facts(config({"NVIDIA_REQUIRE_CUDA": "CUDA>=12.3", "NVIDIA_VISIBLE_DEVICES": "all"}))
    assert facts.cuda_version == "12.3" and facts.requirement_errors == []


def test_nvidia_docker_v1_labels() -> None:
    facts = gpu_facts(
        config(
            {"PATH": "/bin"},
            {"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": "8.0.61"},
        )
    )
    assert facts.required and facts.signals == ["com.nvidia.volumes.needed"]
    assert facts.cuda_version == "8.0"
    assert facts.labels == {"com.nvidia.cuda.version": "8.0.61", "com.nvidia.volumes.needed": "nvidia_driver"}


def test_requirements_are_ordered_by_name_and_bad_ones_become_issues() -> None:
    facts = gpu_facts(
        config(
            {
                "NVIDIA_REQUIRE_CUDA": "cuda>=12.4",
                "NVIDIA_REQUIRE_ARCH": "arch>=8.0",
                "NVIDIA_REQUIRE_BRAND": "brand>=tesla",
                "NVIDIA_REQUIRE_JETPACK_HOST_MOUNTS": "base-only",
                "NVIDIA_VISIBLE_DEVICES": "all",
            }
        )
    )
    assert facts.requirements == ["arch>=8.0", "brand>=tesla", "cuda>=12.4"]
    assert facts.env["NVIDIA_REQUIRE_JETPACK_HOST_MOUNTS"] == "base-only"
    assert [issue.variable for issue in facts.requirement_errors] == ["NVIDIA_REQUIRE_BRAND"]
    assert "brand" in facts.requirement_errors[0].error
    assert facts.requirement_errors[0].value == "brand>=tesla"


def test_unparseable_legacy_cuda_version_is_an_issue_not_a_crash() -> None:
    facts = gpu_facts(config({"CUDA_VERSION": "7.foo"}))
    assert facts.required and facts.cuda_version is None
    assert [issue.variable for issue in facts.requirement_errors] == ["CUDA_VERSION"]
    assert facts.effective_requirements == []


@pytest.mark.parametrize(
    ("value", "disabled"),
    [("true", True), ("1", True), ("T", True), ("yes", False), ("", False), ("on", False)],
)
def test_disable_require_needs_a_go_parsebool_true(value: str, disabled: bool) -> None:
    facts = gpu_facts(config({"NVIDIA_REQUIRE_CUDA": "cuda>=11.8", "NVIDIA_DISABLE_REQUIRE": value}))
    assert facts.disable_require is disabled
    assert facts.effective_requirements == ([] if disabled else ["cuda>=11.8"])
    assert facts.requirements == ["cuda>=11.8"]


@pytest.mark.parametrize(
    ("value", "signal", "runtime"),
    [
        ("all", True, True),
        ("0,1", True, True),
        ("none", False, True),
        ("void", False, False),
        ("", False, False),
    ],
)
def test_visible_devices_semantics(value: str, signal: bool, runtime: bool) -> None:
    facts = gpu_facts(config({"NVIDIA_VISIBLE_DEVICES": value}))
    assert ("NVIDIA_VISIBLE_DEVICES" in facts.signals) is signal
    assert facts.runtime_gpu_request is runtime
    assert facts.visible_devices == value


@pytest.mark.parametrize(
    "garbage",
    [
        {},
        {"config": None},
        {"config": {"Env": None, "Labels": None}},
        {"config": {"Env": "NVIDIA_GPU=1", "Labels": ["x"]}},
        {"config": {"Env": [None, 3, "NOEQUALS", "=nokey", {"a": 1}], "Labels": {"com.nvidia.x": 5}}},
        [],
        "text",
    ],
)
def test_garbage_configs_never_raise(garbage: Any) -> None:
    facts = gpu_facts(garbage)
    assert not facts.required


def test_later_env_duplicates_win_like_docker() -> None:
    facts = gpu_facts({"config": {"Env": ["CUDA_VERSION=11.0", "CUDA_VERSION=12.1.0"]}})
    assert facts.cuda_version == "12.1"


# -- NVIDIA's own tables (nvidia-container-toolkit @d34b3046)


def test_legacy_cuda_version_parsing_matches_the_toolkit() -> None:
    cases = toolkit_cases("go:legacy-cuda-version-parse")
    assert cases
    for case in cases:
        expected = None if case["expect"] == "error" else case["expect"]
        assert cuda_major_minor(case["cuda_version"]) == expected, case


def test_requirements_checked_match_the_toolkit() -> None:
    cases = toolkit_cases("go:get-requirements")
    assert cases
    for case in cases:
        facts = gpu_facts(config(case["env"]))
        assert sorted(facts.effective_requirements) == sorted(case["expect_requirements"]), case


def test_gpu_container_detection_matches_the_toolkit() -> None:
    cases = [
        c for c in toolkit_cases("go:visible-devices-from-env") if not c["preferred_visible_device_envvars"]
    ]
    assert cases
    for case in cases:
        facts = gpu_facts(config(case["env"]))
        assert facts.runtime_gpu_request is (case["expect_devices"] is not None), case


# -- badges


def test_badges_for_typical_images() -> None:
    cuda = gpu_facts(config({"NVIDIA_REQUIRE_CUDA": CUDA_12_2_2, "CUDA_VERSION": "12.2.2"}))
    glibc = LibcVerdict(flavour="glibc", musl_also=True)
    assert badges(cuda, glibc) == ["nvidia-gpu", "cuda-12.2", "glibc", "musl-also"]
    assert badges(GpuFacts(), LibcVerdict(flavour="none")) == ["no-libc"]
    assert badges(GpuFacts(), LibcVerdict()) == ["libc-unknown"]
    broken = gpu_facts(
        config({"NVIDIA_GPU": "1", "NVIDIA_REQUIRE_CUDA": "cuda>=v12", "NVIDIA_DISABLE_REQUIRE": "1"})
    )
    assert badges(broken, LibcVerdict(flavour="musl")) == [
        "nvidia-gpu",
        "require-disabled",
        "requirement-error",
        "musl",
    ]


def _cuda_version_cases() -> list[dict[str, str]]:
    path = Path(__file__).resolve().parent.parent / "fixtures" / "cuda_version_cases.json"
    cases: list[dict[str, str]] = json.loads(path.read_text())["cases"]
    return cases


@pytest.mark.parametrize("case", _cuda_version_cases(), ids=lambda case: repr(case["cuda_version"]))
def test_cuda_version_parses_as_masterminds_semver_does(case: dict[str, str]) -> None:
    expected = None if case["expect"] == "error" else case["expect"]
    assert cuda_major_minor(case["cuda_version"]) == expected, case["why"]
    legacy = gpu_facts({"config": {"Env": [f"CUDA_VERSION={case['cuda_version']}"]}})
    if case["cuda_version"] and expected is None:
        assert [issue.variable for issue in legacy.requirement_errors] == ["CUDA_VERSION"]
        assert legacy.effective_requirements == []
    elif expected is not None:
        assert legacy.requirement_errors == [] and legacy.effective_requirements == [f"cuda>={expected}"]


def test_no_cuda_version_warning_when_requirements_are_disabled() -> None:
    """With NVIDIA_DISABLE_REQUIRE the hook checks nothing, so a bad CUDA_VERSION cannot stop the start."""
    env = ["CUDA_VERSION=8-.", "NVIDIA_DISABLE_REQUIRE=true"]
    facts = gpu_facts({"config": {"Env": env}})
    assert facts.requirement_errors == [] and facts.effective_requirements == []
    assert facts.required and facts.legacy  # still a GPU image, still legacy
    warned = gpu_facts({"config": {"Env": ["CUDA_VERSION=8-.", "NVIDIA_DISABLE_REQUIRE=yes"]}})
    assert [issue.variable for issue in warned.requirement_errors] == ["CUDA_VERSION"]  # ParseBool: not true
