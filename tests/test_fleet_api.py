"""Placement through the service: servers, eligibility with reasons, atomic GPU reservations."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from fixtures import catalog
from fixtures.registry import LocalRegistry
from fixtures.service import RunningService, run_service_inprocess
from tests.conftest import Pusher
from web.settings import ServiceSettings

AGENT_TOKEN = "agent-secret"
API_TOKEN = "api-secret"


def gpu(index: int, server: str, name: str = "NVIDIA H100 80GB HBM3", memory: int = 81559) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": f"GPU-{server}-{index}",
        "name": name,
        "brand": "NVIDIA",
        "memory_mib": memory,
        "compute_capability": "9.0",
    }


FLEET = {
    "servers": [
        {
            "name": "h100-new",
            "arch": "amd64",
            "cpus": 64,
            "memory": "512Gi",
            "driver_version": "550.54.15",
            "cuda_driver_version": "12.4",
            "gpus": [gpu(0, "h100-new")],
        },
        {
            "name": "t4-old",
            "arch": "amd64",
            "cpus": 16,
            "memory": "64Gi",
            "driver_version": "515.65.01",
            "cuda_driver_version": "11.7",
            "gpus": [gpu(0, "t4-old", "Tesla T4", 15360) | {"brand": "Tesla", "compute_capability": "7.5"}],
        },
        {"name": "arm-cpu", "arch": "arm64", "cpus": 8, "memory": "16Gi"},
    ]
}


@pytest.fixture
async def service(tmp_path: Path, registry: LocalRegistry, push: Pusher) -> AsyncIterator[RunningService]:
    push(catalog.cuda_ubuntu(), "fleet/cuda:12.2")
    push(catalog.static_scratch(), "fleet/static:1")
    inventory = tmp_path / "fleet.yaml"
    inventory.write_text(yaml.safe_dump(FLEET))
    settings = ServiceSettings(
        db=tmp_path / "fleet.db",
        port=0,
        inventory_file=inventory,
        agent_token=AGENT_TOKEN,
        api_token=API_TOKEN,
        docker_config=None,
    )
    async with run_service_inprocess(settings, port=_port()) as running:
        yield running


def _port() -> int:
    from fixtures.registry import free_port

    return free_port()


async def _post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], token: str | None = None
) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with session.post(url, json=body, headers=headers) as response:
        return response.status, await response.json()


async def test_eligibility_scans_first_and_explains_every_rejection(
    service: RunningService, registry: LocalRegistry
) -> None:
    request = {"image": f"{registry.host}/fleet/cuda:12.2", "gpus": 1}
    async with aiohttp.ClientSession() as session:
        # Without the API token a never-scanned image is not scanned: 404, saying how to ask.
        status, body = await _post(session, f"{service.url}/api/eligibility", request)
        assert status == 404, body
        assert "has not been scanned" in body["error"] and "POST /api/scans" in body["error"]
        async with session.get(f"{service.url}/api/scans") as response:
            assert (await response.json())["jobs"] == []
        async with session.get(f"{service.url}/api/scans", params={"state": "queued,paused"}) as response:
            assert response.status == 400  # a state that is none names the option and the states there are
            assert (await response.json())["error"].startswith(
                "state: no job state 'paused' (states: queued,"
            )
        status, body = await _post(session, f"{service.url}/api/eligibility", request, API_TOKEN)
        assert status == 200, body
        # Stored now: the same read without the token answers from the store.
        status, again = await _post(session, f"{service.url}/api/eligibility", request)
    assert status == 200, again
    assert again["eligible"] == body["eligible"]
    assert [entry["server"] for entry in body["eligible"]] == ["h100-new"]
    assert body["eligible"][0]["gpus"] == ["GPU-h100-new-0"]
    assert (body["eligible_count"], body["ineligible_count"], body["next_cursor"]) == (1, 2, None)
    assert "ineligible" not in body  # summarised unless explain=all
    by_reason = {item["reason"]: item for item in body["ineligible_by_reason"]}
    assert any("12.2" in reason and item["examples"] == ["t4-old"] for reason, item in by_reason.items())
    async with aiohttp.ClientSession() as session:
        status, every = await _post(
            session,
            f"{service.url}/api/eligibility?explain=all",
            {"image": f"{registry.host}/fleet/cuda:12.2", "gpus": 1},
        )
    assert status == 200, every
    reasons = {entry["server"]: entry["reasons"] for entry in every["ineligible"]}
    assert any("12.2" in reason for reason in reasons["t4-old"])
    assert any("arch" in reason or "arm64" in reason for reason in reasons["arm-cpu"])
    # The summary counts each server once, under its decisive (first) reason.
    assert sorted({rs[0] for rs in reasons.values()}) == sorted(by_reason)
    assert sum(item["count"] for item in by_reason.values()) == every["ineligible_count"]


async def test_eligibility_pages_with_a_cursor(service: RunningService, registry: LocalRegistry) -> None:
    image = f"{registry.host}/fleet/static:1"
    async with aiohttp.ClientSession() as session:
        status, first = await _post(
            session, f"{service.url}/api/eligibility", {"image": image, "limit": 1}, API_TOKEN
        )
        assert status == 200, first
        status, second = await _post(
            session,
            f"{service.url}/api/eligibility",
            {"image": image, "limit": 1, "cursor": first["next_cursor"]},
        )
        assert status == 200, second
        for bad in ({"limit": 0}, {"limit": 100_000}, {"cursor": "nope"}, {"explain": "everything"}):
            status, body = await _post(session, f"{service.url}/api/eligibility", {"image": image, **bad})
            assert status == 400, (bad, body)
    assert first["eligible_count"] == 2 and first["next_cursor"]
    # t4-old first: best fit leaves fewer spare GPUs (1 of 1 vs 1 of 1 + more memory on h100-new).
    assert sorted(e["server"] for e in first["eligible"] + second["eligible"]) == ["h100-new", "t4-old"]
    assert second["next_cursor"] is None


async def test_cpu_image_fits_anywhere_matching(service: RunningService, registry: LocalRegistry) -> None:
    async with aiohttp.ClientSession() as session:
        status, body = await _post(
            session, f"{service.url}/api/eligibility", {"image": f"{registry.host}/fleet/static:1"}, API_TOKEN
        )
    assert status == 200
    assert {entry["server"] for entry in body["eligible"]} == {"h100-new", "t4-old"}


async def test_bad_requests_are_clear(service: RunningService, registry: LocalRegistry) -> None:
    async with aiohttp.ClientSession() as session:
        status, body = await _post(session, f"{service.url}/api/eligibility", {"gpus": 1})
        assert status == 400 and "image" in body["error"]
        status, body = await _post(session, f"{service.url}/api/eligibility", {"image": "Bad Ref", "gpus": 1})
        assert status == 400
        status, body = await _post(
            session,
            f"{service.url}/api/eligibility",
            {"image": f"{registry.host}/fleet/cuda:12.2", "min_gpu_memory": "lots"},
        )
        assert status == 400 and "min_gpu_memory" in body["error"]


async def test_two_concurrent_deploys_for_one_gpu(service: RunningService, registry: LocalRegistry) -> None:
    body = {"image": f"{registry.host}/fleet/cuda:12.2", "gpus": 1}
    async with aiohttp.ClientSession() as session:
        status, _ = await _post(session, f"{service.url}/api/deployments", body)
        assert status == 401  # the API token is required
        results = await asyncio.gather(
            *(_post(session, f"{service.url}/api/deployments", body, API_TOKEN) for _ in range(2))
        )
        statuses = sorted(status for status, _ in results)
        assert statuses == [201, 409], results
        created = next(payload for status, payload in results if status == 201)
        assert created["gpus"] == ["GPU-h100-new-0"] and created["state"] == "pending"
        async with session.get(f"{service.url}/api/servers") as response:
            servers = {s["name"]: s for s in (await response.json())["servers"]}
        assert servers["h100-new"]["gpus_in_use"] == ["GPU-h100-new-0"]
        async with session.delete(
            f"{service.url}/api/deployments/{created['id']}", headers={"Authorization": f"Bearer {API_TOKEN}"}
        ) as response:
            assert response.status == 202
            assert (await response.json())["state"] == "stopped"
        status, again = await _post(session, f"{service.url}/api/deployments", body, API_TOKEN)
        assert status == 201 and again["gpus"] == ["GPU-h100-new-0"]  # freed by the stop


async def test_agent_registration_needs_the_token(service: RunningService) -> None:
    server = {"name": "agent-1", "arch": "amd64", "cpus": 4, "memory": "8Gi", "gpus": [gpu(0, "agent-1")]}
    async with aiohttp.ClientSession() as session:
        status, body = await _post(session, f"{service.url}/api/servers", server, "wrong")
        assert status == 401 and "wrong" not in str(body)
        status, body = await _post(session, f"{service.url}/api/servers", server, AGENT_TOKEN)
        assert status == 200 and body["heartbeat_seconds"] > 0
        status, _ = await _post(session, f"{service.url}/api/servers/agent-1/heartbeat", {}, AGENT_TOKEN)
        assert status == 200
        status, _ = await _post(session, f"{service.url}/api/servers/ghost/heartbeat", {}, AGENT_TOKEN)
        assert status == 404
        async with session.get(f"{service.url}/api/servers") as response:
            names = {s["name"] for s in (await response.json())["servers"]}
        assert "agent-1" in names
        async with session.get(
            f"{service.url}/api/agents/agent-1/deployments?wait=0.2",
            headers={"Authorization": f"Bearer {AGENT_TOKEN}"},
        ) as response:
            assert response.status == 200 and (await response.json())["deployments"] == []
        async with session.get(
            f"{service.url}/api/agents/agent-1/deployments?wait=soon",
            headers={"Authorization": f"Bearer {AGENT_TOKEN}"},
        ) as response:
            assert response.status == 400
            assert (await response.json()) == {"error": "wait must be a number of seconds"}


async def test_constraints_in_every_format(service: RunningService, registry: LocalRegistry) -> None:
    image = f"{registry.host}/fleet/cuda:12.2"
    async with aiohttp.ClientSession() as session:
        answers = {}
        for format in ("kubernetes", "dra", "nomad", "akash"):
            status, body = await _post(
                session,
                f"{service.url}/api/constraints",
                {"image": image, "gpus": 1, "format": format},
                API_TOKEN,
            )
            assert status == 200, body
            assert body["format"] == format and body["satisfiable"] is True and body["image"]["digest"]
            answers[format] = body
        status, body = await _post(
            session, f"{service.url}/api/constraints", {"image": image, "format": "swarm"}
        )
        assert status == 400 and "format" in body["error"]
    terms = answers["kubernetes"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert terms["nodeSelectorTerms"] and answers["kubernetes"]["resources"]["limits"] == {
        "nvidia.com/gpu": 1
    }
    assert answers["dra"]["resourceClaimTemplate"]["apiVersion"] == "resource.k8s.io/v1"
    assert 'device "nvidia/gpu"' in answers["nomad"]["hcl"]
    # The fleet's products decide which Akash models are offered.
    models = answers["akash"]["sdl"]["profiles"]["compute"]["app"]["resources"]["gpu"]["attributes"]["vendor"]
    assert {entry["model"] for entry in models["nvidia"]} <= {"h100", "t4"}
