"""The agent runs an image whose CUDA was inferred (no NVIDIA env) with explicit device requests."""

from __future__ import annotations

import pytest

from agent.runner import container_options
from placement.inventory import RuntimeMode
from placement.protocol import AgentDeployment

DIGEST = "sha256:" + "d" * 64
UUIDS = ["GPU-11111111-2222-3333-4444-555555555555"]


def deployment() -> AgentDeployment:
    return AgentDeployment(
        id="dep-inferred",
        image="registry.example:5000/team/torch:2",
        digest=DIGEST,
        gpu_required=True,
        gpus=UUIDS,
        inferred_cuda=True,
        env={"A": "1"},
    )


@pytest.mark.parametrize("mode", ["runtime", "device-requests"])
def test_inferred_image_gets_its_reserved_gpus_by_device_request(mode: RuntimeMode) -> None:
    options = container_options(deployment(), "srv", mode, default_runtime="nvidia")
    (request,) = options["device_requests"]
    assert request["Driver"] == "nvidia" and request["DeviceIDs"] == UUIDS
    assert request["Capabilities"] == [["utility", "compute"]]  # the runtime's env default lacks compute
    assert options["runtime"] == "runc"
    assert "NVIDIA_VISIBLE_DEVICES" not in options["environment"]
    assert options["environment"]["A"] == "1"


def test_inferred_image_on_a_cdi_server() -> None:
    (request,) = container_options(deployment(), "srv", "cdi")["device_requests"]
    assert request["Driver"] == "cdi" and request["DeviceIDs"] == [f"nvidia.com/gpu={UUIDS[0]}"]
