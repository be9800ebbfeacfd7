"""How a deployment becomes a container: pure decisions, no Docker needed."""

from __future__ import annotations

import pytest

from agent.runner import (
    DEPLOYMENT_LABEL,
    SERVER_LABEL,
    ContainerView,
    DeploymentError,
    choose_gpu_mode,
    container_name,
    container_options,
    driver_capabilities,
    finished_status,
    pull_reference,
)
from placement.protocol import AgentDeployment

DIGEST = "sha256:" + "a" * 64
UUIDS = ["GPU-11111111-2222-3333-4444-555555555555", "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"]


def deployment(**changes: object) -> AgentDeployment:
    fields: dict[str, object] = {
        "id": "dep-1",
        "image": "registry.example:5000/team/cuda:12.2",
        "digest": DIGEST,
        "gpu_required": True,
        "gpus": UUIDS,
        "driver_capabilities": "compute,utility",
        "env": {"A": "1", "NVIDIA_VISIBLE_DEVICES": "all"},
    }
    fields.update(changes)
    return AgentDeployment.model_validate(fields)


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("registry.example:5000/team/cuda:12.2", f"registry.example:5000/team/cuda@{DIGEST}"),
        ("registry.example:5000/team/cuda", f"registry.example:5000/team/cuda@{DIGEST}"),
        (f"busybox@sha256:{'b' * 64}", f"busybox@{DIGEST}"),
        ("localhost:5000/x:1@sha256:" + "c" * 64, f"localhost:5000/x@{DIGEST}"),
    ],
)
def test_pull_reference_is_by_digest(image: str, expected: str) -> None:
    assert pull_reference(image, DIGEST) == expected


def test_runtime_mode() -> None:
    options = container_options(deployment(), "srv", "runtime")
    assert options["runtime"] == "nvidia"
    assert options["image"] == f"registry.example:5000/team/cuda@{DIGEST}"
    assert options["environment"]["NVIDIA_VISIBLE_DEVICES"] == ",".join(UUIDS)  # never the image's `all`
    assert options["environment"]["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert options["environment"]["A"] == "1"
    assert options["labels"][DEPLOYMENT_LABEL] == "dep-1" and options["labels"][SERVER_LABEL] == "srv"
    assert options["network_mode"] == "none"
    assert "device_requests" not in options


def test_device_request_mode() -> None:
    options = container_options(deployment(driver_capabilities=None), "srv", "device-requests")
    assert "runtime" not in options
    (request,) = options["device_requests"]
    assert request["Driver"] == "nvidia"
    assert request["DeviceIDs"] == UUIDS
    assert request["Capabilities"] == [["utility", "compute"]]
    assert options["environment"]["NVIDIA_VISIBLE_DEVICES"] == ",".join(UUIDS)


def test_cdi_mode() -> None:
    (request,) = container_options(deployment(), "srv", "cdi")["device_requests"]
    assert request["Driver"] == "cdi"
    assert request["DeviceIDs"] == [f"nvidia.com/gpu={uuid}" for uuid in UUIDS]


def test_cpu_image_never_gets_the_nvidia_runtime() -> None:
    options = container_options(
        deployment(gpu_required=False, gpus=[]), "srv", None, default_runtime="nvidia"
    )
    assert options["runtime"] == "runc"
    assert "device_requests" not in options
    assert "runtime" not in container_options(deployment(gpu_required=False, gpus=[]), "srv", None)


def test_gpu_deployment_needs_gpus_and_a_mode() -> None:
    with pytest.raises(DeploymentError, match="without reserved GPUs"):
        container_options(deployment(gpus=[]), "srv", "runtime")
    with pytest.raises(DeploymentError, match="without an NVIDIA container runtime"):
        container_options(deployment(), "srv", None)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, ["utility", "compute"]),
        ("", ["utility", "compute"]),
        ("compute, video", ["compute", "video"]),
        ("all", ["compute", "compat32", "graphics", "utility", "video", "display"]),
    ],
)
def test_driver_capabilities(value: str | None, expected: list[str]) -> None:
    assert driver_capabilities(value) == expected


def test_unknown_capability_is_refused() -> None:
    with pytest.raises(DeploymentError, match="ngx"):
        driver_capabilities("compute,ngx")


def test_choose_gpu_mode() -> None:
    assert choose_gpu_mode(["runtime", "device-requests"]) == "runtime"
    assert choose_gpu_mode(["device-requests", "cdi"]) == "device-requests"
    assert choose_gpu_mode(["runtime", "cdi"], "cdi") == "cdi"
    with pytest.raises(DeploymentError, match="not offered"):
        choose_gpu_mode(["runtime"], "cdi")
    with pytest.raises(DeploymentError, match="offers no NVIDIA"):
        choose_gpu_mode([])


def test_container_name_is_safe_and_stable() -> None:
    assert container_name("a/b c:1") == "gpubadge-a_b_c_1"


def test_finished_status() -> None:
    attrs = {
        "Id": "c1",
        "State": {"Status": "exited", "ExitCode": 3, "OOMKilled": False, "Error": ""},
        "Config": {"Labels": {DEPLOYMENT_LABEL: "dep-1"}},
    }
    view = ContainerView.from_attrs(attrs)
    assert view.finished and view.deployment_id == "dep-1"
    status = finished_status(view, "tail", "exited")
    assert (status.state, status.exit_code, status.reason, status.logs) == (
        "exited",
        3,
        "exited with code 3",
        "tail",
    )
    oom = ContainerView.from_attrs(
        {**attrs, "State": {"Status": "exited", "ExitCode": 137, "OOMKilled": True}}
    )
    assert "out of memory" in (finished_status(oom, None, "exited").reason or "")
    running = ContainerView.from_attrs({**attrs, "State": {"Status": "running", "ExitCode": 0}})
    assert not running.finished and running.exit_code is None
