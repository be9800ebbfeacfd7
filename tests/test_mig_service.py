"""MIG through the service: agents that report MIG devices (read through the NVML stand-in),
servers from an inventory file with MIG layouts, deployments that reserve MIG devices one by one,
release and re-use them, the answers' reasons, the constraints, and the servers page (HTML, and
headless Chromium)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent.host import build_server
from agent.nvml import read_nvml
from fixtures import catalog
from fixtures.registry import LocalRegistry, free_port
from fixtures.service import RunningService, run_service_inprocess, run_service_process
from placement.inventory import Server
from tests.conftest import Pusher
from tests.fake_pynvml import FakeNvml, a100_40gb_mig
from web.settings import ServiceSettings

AGENT_TOKEN = "agent-secret"
API_TOKEN = "api-secret"
FLEET_FILE = Path(__file__).resolve().parent.parent / "fixtures" / "fleet_mig.yaml"


def agent_server(name: str, parent_uuid: str) -> Server:
    facts = read_nvml(
        FakeNvml(gpus=[a100_40gb_mig(parent_uuid)], driver_version="535.104.05", cuda_version=12020)
    )
    return build_server(name, facts, ["runtime"], arch="x86_64", cpus=16, memory=1 << 36)


@pytest.fixture
async def service(tmp_path: Path, registry: LocalRegistry, push: Pusher) -> AsyncIterator[RunningService]:
    push(catalog.cuda_ubuntu(), "mig/cuda:12.2")
    settings = ServiceSettings(
        db=tmp_path / "mig.db",
        port=0,
        inventory_file=FLEET_FILE,
        agent_token=AGENT_TOKEN,
        api_token=API_TOKEN,
        docker_config=None,
    )
    async with run_service_inprocess(settings, port=free_port()) as running:
        yield running


async def _post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], token: str
) -> tuple[int, Any]:
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {token}"}) as response:
        return response.status, await response.json()


async def test_mig_devices_are_reserved_released_and_reused_through_the_api(
    service: RunningService, registry: LocalRegistry
) -> None:
    image = f"{registry.host}/mig/cuda:12.2"
    agent = agent_server("agent-a100", "GPU-a1234567-0000-4000-8000-000000000000")
    devices = [device.uuid for device in agent.gpus[0].mig_devices]
    async with aiohttp.ClientSession() as session:
        status, _ = await _post(
            session, f"{service.url}/api/servers", agent.model_dump(mode="json"), AGENT_TOKEN
        )
        assert status == 200
        # Whole GPUs: never a GPU in MIG mode, and the answer says which it was.
        status, body = await _post(
            session, f"{service.url}/api/eligibility?explain=all", {"image": image, "gpus": 1}, API_TOKEN
        )
        assert status == 200, body
        why = {entry["server"]: entry["reasons"] for entry in body["ineligible"]}
        assert why["agent-a100"] == [
            "GPU in MIG mode, none whole",
            "GPU in MIG mode: 7 × 1g.5gb free of 7 MIG device(s)",
        ]
        assert why["a100-80-mig"][0] == "2 GPUs in MIG mode, none whole"
        # Seven 1g.5gb deployments take the seven MIG devices, one each.
        created = []
        for _ in range(7):
            status, deployment = await _post(
                session,
                f"{service.url}/api/deployments",
                {"image": image, "mig_profiles": ["1g.5gb"]},
                API_TOKEN,
            )
            assert status == 201, deployment
            assert deployment["server"] == "agent-a100" and deployment["gpu_required"] is True
            created.append(deployment)
        taken = [uuid for deployment in created for uuid in deployment["gpus"]]
        assert sorted(taken) == sorted(devices)
        async with session.get(f"{service.url}/api/servers") as response:
            servers = {s["name"]: s for s in (await response.json())["servers"]}
        assert sorted(servers["agent-a100"]["gpus_in_use"]) == sorted(devices)
        status, refused = await _post(
            session, f"{service.url}/api/deployments", {"image": image, "mig_profiles": ["1g.5gb"]}, API_TOKEN
        )
        assert status == 409
        reasons = {item["reason"] for item in refused["ineligible_by_reason"]}
        assert "needs 1 free 1g.5gb MIG device(s), has 0" in reasons
        # Stopping one releases its MIG device; the next deployment re-uses exactly it.
        freed = created[4]
        async with session.delete(
            f"{service.url}/api/deployments/{freed['id']}", headers={"Authorization": f"Bearer {API_TOKEN}"}
        ) as response:
            assert response.status == 202
        status, again = await _post(
            session, f"{service.url}/api/deployments", {"image": image, "mig_profiles": ["1g.5gb"]}, API_TOKEN
        )
        assert status == 201 and again["gpus"] == freed["gpus"]
        # The file's servers' MIG devices are handed out too, by profile.
        status, big = await _post(
            session,
            f"{service.url}/api/deployments",
            {"image": image, "mig_profiles": ["4g.40gb"]},
            API_TOKEN,
        )
        assert status == 201 and big["server"] == "a100-80-mig"
        file_device = next(
            d for g in _file_server("a100-80-mig").gpus for d in g.mig_devices if d.profile == "4g.40gb"
        )
        assert big["gpus"] == [file_device.uuid]
        # Another server cannot claim a MIG device a live server reports.
        impostor = agent.model_copy(update={"name": "impostor"})
        status, conflict = await _post(
            session, f"{service.url}/api/servers", impostor.model_dump(mode="json"), AGENT_TOKEN
        )
        assert status == 409, conflict
        # The servers page shows the slices and their use.
        async with session.get(f"{service.url}/servers") as response:
            html = await response.text()
        assert "GPU 0 in MIG mode:" in html and 'data-profile="1g.5gb"' in html
        assert "7 × 1g.5gb" in html and "(7 in use)" in html and "7 of 7 MIG devices" in html


def _file_server(name: str) -> Server:
    from placement.inventory import parse_inventory

    return next(s for s in parse_inventory(FLEET_FILE.read_text()).servers if s.name == name)


async def test_constraints_for_mig_devices(service: RunningService, registry: LocalRegistry) -> None:
    image = f"{registry.host}/mig/cuda:12.2"
    async with aiohttp.ClientSession() as session:
        status, body = await _post(
            session,
            f"{service.url}/api/constraints",
            {"image": image, "mig_profiles": ["1g.10gb"], "format": "kubernetes"},
            API_TOKEN,
        )
        assert status == 200, body
        assert body["mig_strategy"] == "mixed" and body["resources"] == {
            "limits": {"nvidia.com/mig-1g.10gb": 1}
        }
        assert body["single_strategy"]["resources"] == {"limits": {"nvidia.com/gpu": 1}}
        status, dra = await _post(
            session,
            f"{service.url}/api/constraints",
            {"image": image, "mig_devices": 2, "format": "dra"},
            API_TOKEN,
        )
        assert status == 200
        exactly = dra["resourceClaimTemplate"]["spec"]["spec"]["devices"]["requests"][0]["exactly"]
        assert (exactly["deviceClassName"], exactly["count"]) == ("mig.nvidia.com", 2)
        status, bad = await _post(
            session,
            f"{service.url}/api/eligibility",
            {"image": image, "gpus": 1, "mig_devices": 1},
            API_TOKEN,
        )
        assert status == 400 and "not both" in bad["error"]


# ===================================================================== browser


@pytest.fixture(scope="module")
def mig_service(
    tmp_path_factory: pytest.TempPathFactory, registry: LocalRegistry, push: Pusher
) -> Iterator[tuple[RunningService, str]]:
    push(catalog.cuda_ubuntu(), "migui/cuda:12.2")
    root = tmp_path_factory.mktemp("mig-ui")
    env = {"GPUBADGE_INVENTORY_FILE": str(FLEET_FILE), "GPUBADGE_API_TOKEN": API_TOKEN}
    with run_service_process(root / "gpubadge.db", env=env) as running:
        yield running, f"{registry.host}/migui/cuda:12.2"


def _deploy(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url + "/api/deployments",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {API_TOKEN}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=120) as response:  # the first one scans the image
        assert response.status == 201
        answer: dict[str, Any] = json.loads(response.read())
        return answer


@pytest.mark.browser
def test_servers_page_shows_slices_and_their_use(
    mig_service: tuple[RunningService, str], browser: Any
) -> None:
    service, image = mig_service
    first = _deploy(service.url, {"image": image, "mig_profiles": ["3g.40gb"], "gpu_models": ["a100"]})
    second = _deploy(
        service.url, {"image": image, "mig_devices": 2, "gpu_models": ["a100-80gb"], "min_gpu_memory": "9Gi"}
    )
    assert first["server"] == second["server"] == "a100-80-mig"
    context = browser.new_context(viewport={"width": 1280, "height": 900}, java_script_enabled=False)
    context.set_default_timeout(10_000)
    try:
        page = context.new_page()
        page.goto(service.url + "/servers")
        a100 = page.locator("tr[data-server='a100-80-mig']")
        gpus = a100.locator(".gpus").inner_text()
        assert "2 × NVIDIA A100-SXM4-80GB" in gpus and "MIG" in gpus
        assert "GPU 0 in MIG mode: 7 × 1g.10gb (2 in use)" in gpus
        assert "GPU 1 in MIG mode: 1 × 3g.40gb (1 in use), 1 × 4g.40gb" in gpus
        in_use = a100.locator(".in-use").inner_text()
        assert "3 of 9 MIG devices" in in_use and "GPU 1 · 3g.40gb" in in_use and "GPU 0 · 1g.10gb" in in_use
        half = page.locator("tr[data-server='h100-half-mig']")
        assert (
            "0 of 1" in half.locator(".in-use").inner_text()
            and "0 of 4 MIG devices" in half.locator(".in-use").inner_text()
        )
        assert "no MIG device" in page.locator("tr[data-server='h100-mig-unconfigured'] .gpus").inner_text()
    finally:
        context.close()
