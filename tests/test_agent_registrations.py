"""Registrations are bounded in size and in count per token, and refused without a token unless the
operator opts in (issue 43, point 9).

Against a running service (in-process for the API answers, a real `gpubadge serve` process for its
memory), with the `gpubadge fleet` command an operator would use. Before, a registration was any
size the body limit allowed (1 MiB: 5,000 fake GPUs), any number of them from one token, and open
to anyone when no agent token was set (the default): 150 took a service from 78 MB to 805 MB, and
the fake GPUs were offered for deployments.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import SecretStr

from fixtures.service import RunningService, run_service_inprocess, run_service_process
from tests.test_mig_service import agent_server as mig_server
from tests.test_service_e2e import call
from web.settings import ServiceSettings

FLEET_TOKEN = "fleet-token-5b0e"
TOKEN_A = "node-a-token-0c9d"


def server(name: str, gpus: int = 8) -> dict[str, Any]:
    """A registration as the agent sends it: an 8-GPU HGX node by default."""
    return {
        "name": name,
        "arch": "amd64",
        "cpus": 224,
        "memory": "2015Gi",
        "driver_version": "570.124.06",
        "cuda_driver_version": "12.8",
        "runtime_modes": ["runtime", "device-requests", "cdi"],
        "labels": {
            "topology.kubernetes.io/zone": "eu-west-1a",
            "node.kubernetes.io/instance-type": "p5.48xlarge",
        },
        "gpus": [
            {
                "index": index,
                "uuid": f"GPU-{name}-{index:05d}-8c2f-4d1e-9a7b-3f6e2d1c0b9a",
                "name": "NVIDIA H100 80GB HBM3",
                "brand": "NVIDIA",
                "memory_mib": 81559,
                "compute_capability": "9.0",
                "pci_bus_id": f"00000000:{index % 256:02X}:00.0",
            }
            for index in range(gpus)
        ],
    }


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def post(
    session: aiohttp.ClientSession, url: str, body: Any, token: str | None = None
) -> tuple[int, dict[str, Any]]:
    async with session.post(url, json=body, headers=bearer(token) if token else {}) as reply:
        return reply.status, await reply.json(content_type=None)


@pytest.fixture
async def fleet_service(tmp_path: Path) -> AsyncIterator[RunningService]:
    settings = ServiceSettings(
        db=tmp_path / "fleet.db",
        workers=0,
        agent_token=SecretStr(FLEET_TOKEN),
        agent_tokens={"node-a": SecretStr(TOKEN_A)},
        max_servers_per_agent_token=3,
        docker_config=None,
    )
    async with run_service_inprocess(settings) as running:
        yield running


async def test_agents_are_refused_without_a_token_unless_the_operator_opts_in(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    closed = ServiceSettings(db=tmp_path / "closed.db", workers=0, docker_config=None)
    assert closed.allow_agents_without_token is False  # the default
    with caplog.at_level(logging.WARNING):
        async with run_service_inprocess(closed) as running, aiohttp.ClientSession() as session:
            status, body = await post(session, f"{running.url}/api/servers", server("gpu-1"))
            assert status == 401 and "GPUBADGE_ALLOW_AGENTS_WITHOUT_TOKEN" in body["error"], body
            status, body = await post(session, f"{running.url}/api/servers/gpu-1/heartbeat", {})
            assert status == 401, body
            async with session.get(f"{running.url}/api/agents/gpu-1/deployments?wait=0") as reply:
                assert reply.status == 401
            async with session.get(f"{running.url}/api/servers") as reply:
                assert (await reply.json())["servers"] == []  # nothing was registered
    assert "agents are refused until it" in caplog.text
    opened = ServiceSettings(
        db=tmp_path / "open.db", workers=0, allow_agents_without_token=True, docker_config=None
    )
    async with run_service_inprocess(opened) as running, aiohttp.ClientSession() as session:
        status, body = await post(session, f"{running.url}/api/servers", server("gpu-1"))
        assert status == 200, body


async def test_a_registration_is_bounded_in_size_before_it_is_parsed(fleet_service: RunningService) -> None:
    url = fleet_service.url
    real = json.dumps(server("hgx-1")).encode()
    assert len(real) < 4096  # an 8-GPU server's registration, far below the bound
    async with aiohttp.ClientSession() as session:
        status, body = await post(session, f"{url}/api/servers", server("hgx-1"), FLEET_TOKEN)
        assert status == 200, body
        mig = mig_server("mig-1", "GPU-a1234567-0000-4000-8000-000000000000")  # a GPU with 7 MIG devices
        eight = mig.model_copy(
            update={
                "gpus": [mig.gpus[0].model_copy(update={"index": i, "uuid": f"GPU-m{i}"}) for i in range(8)]
            }
        ).model_dump(mode="json")
        for number, gpu in enumerate(eight["gpus"]):  # each MIG device its own UUID
            for device in gpu["mig_devices"]:
                device["uuid"] = f"MIG-{number}-{device['index']}"
        assert len(json.dumps(eight)) < 16 * 1024  # 8 GPUs in MIG mode: far below the bound too
        status, body = await post(session, f"{url}/api/servers", eight, FLEET_TOKEN)
        assert status == 200, body
        fake = server("fake-1", gpus=5000)  # 1 MB: under GPUBADGE_MAX_BODY_BYTES, 15 times this bound
        status, body = await post(session, f"{url}/api/servers", fake, FLEET_TOKEN)
        assert status == 413 and "GPUBADGE_MAX_SERVER_BYTES" in body["error"], body

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: refused once read
            data = json.dumps(fake).encode()
            for start in range(0, len(data), 65536):
                yield data[start : start + 65536]

        async with session.post(
            f"{url}/api/servers",
            data=chunked(),
            headers={**bearer(FLEET_TOKEN), "Content-Type": "application/json"},
        ) as reply:
            assert reply.status == 413 and "GPUBADGE_MAX_SERVER_BYTES" in await reply.text()
        status, body = await post(
            session, f"{url}/api/servers/hgx-1/heartbeat", {"gpus": fake["gpus"]}, FLEET_TOKEN
        )
        assert status == 413, body
        # A stranger's body is not read at all.
        status, body = await post(session, f"{url}/api/servers", server("x"), "not-a-token")
        assert status == 401, body
        async with session.get(f"{url}/api/servers") as reply:
            listed = {entry["name"]: entry for entry in (await reply.json())["servers"]}
    assert sorted(listed) == ["hgx-1", "mig-1"] and len(listed["hgx-1"]["gpus"]) == 8


def fleet_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", "fleet", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )


async def test_the_fleet_wide_token_registers_at_most_its_share_of_servers(
    fleet_service: RunningService,
) -> None:
    url = fleet_service.url
    async with aiohttp.ClientSession() as session:
        for name in ("n1", "n2", "n3"):
            status, body = await post(session, f"{url}/api/servers", server(name, 1), FLEET_TOKEN)
            assert status == 200, body
        status, body = await post(session, f"{url}/api/servers", server("n4", 1), FLEET_TOKEN)
        assert status == 403 and "GPUBADGE_MAX_SERVERS_PER_AGENT_TOKEN" in body["error"], body
        status, body = await post(session, f"{url}/api/servers", server("n2", 2), FLEET_TOKEN)
        assert status == 200, body  # registering again is no new server
        status, body = await post(session, f"{url}/api/servers", server("node-a", 1), TOKEN_A)
        assert status == 200, body  # a per-agent token's own server is not the fleet token's share
    # An operator removes a server that is gone: n1 was never heard from again, but is not stale yet.
    refused = await run_cli(url, "forget", "n1")
    assert refused.returncode == 1 and "is live" in refused.stderr, refused.stderr
    usage = await run_cli(url, "forget")
    assert usage.returncode == 2 and "SERVER" in usage.stderr


async def run_cli(url: str, *args: str, token: str = FLEET_TOKEN) -> subprocess.CompletedProcess[str]:
    """`gpubadge fleet ARGS --service URL --token TOKEN`, as an operator runs it."""
    return await asyncio.to_thread(fleet_cli, *args, "--service", url, "--token", token)


async def test_the_fleet_command_releases_and_forgets_as_the_api_does(tmp_path: Path) -> None:
    settings = ServiceSettings(
        db=tmp_path / "fleet.db",
        workers=0,
        agent_token=SecretStr(FLEET_TOKEN),
        agent_tokens={"node-a": SecretStr(TOKEN_A)},
        max_servers_per_agent_token=1,
        stale_after_seconds=0.5,
        docker_config=None,
    )
    async with run_service_inprocess(settings) as running, aiohttp.ClientSession() as session:
        url = running.url
        one = server("gone-1", 2)
        status, body = await post(session, f"{url}/api/servers", one, FLEET_TOKEN)
        assert status == 200, body
        status, body = await post(session, f"{url}/api/servers", server("gone-2", 1), FLEET_TOKEN)
        assert status == 403, body  # the token's one server is registered
        await asyncio.sleep(1.5)  # gone-1 silent past stale_after_seconds
        first_gpu = one["gpus"][0]["uuid"]
        released = await run_cli(url, "release", first_gpu, "GPU-nobody-owns")
        assert released.returncode == 1, released.stderr  # one of the two was not done
        assert f"released {first_gpu} (was gone-1's)" in released.stdout
        assert "no server owns GPU GPU-nobody-owns" in released.stderr
        wrong = await run_cli(url, "release", first_gpu, token=TOKEN_A)
        assert wrong.returncode == 1 and "fleet-wide agent token" in wrong.stderr
        forgotten = await run_cli(url, "forget", "gone-1")
        assert forgotten.returncode == 0, forgotten.stderr
        assert f"removed gone-1 (released {one['gpus'][1]['uuid']})" in forgotten.stdout
        status, body = await post(session, f"{url}/api/servers", server("gone-2", 1), FLEET_TOKEN)
        assert status == 200, body  # room for a new one now


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_oversized_registrations_leave_the_service_as_small_as_it_was(tmp_path: Path) -> None:
    """The issue's reproduction on a real `serve`: registrations of 5,000 fake GPUs, each under the
    body limit, from the fleet-wide token. Refused before they are parsed, they cost no memory."""
    env = {"GPUBADGE_AGENT_TOKEN": FLEET_TOKEN, "GPUBADGE_WORKERS": "0"}
    with run_service_process(tmp_path / "big.db", env=env) as service:
        assert service.process is not None
        status = call("POST", f"{service.url}/api/servers", server("real-1"), bearer(FLEET_TOKEN)).status
        assert status == 200
        before = _rss_kib(service.process.pid)
        answers = []
        for number in range(40):
            body = json.dumps(server(f"fake-{number}", gpus=5000)).encode()
            request = urllib.request.Request(
                f"{service.url}/api/servers",
                data=body,
                method="POST",
                headers={**bearer(FLEET_TOKEN), "Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as reply:
                    answers.append(reply.status)
            except urllib.error.HTTPError as exc:
                answers.append(exc.code)
        grown_mib = (_rss_kib(service.process.pid) - before) / 1024
        listed = call("GET", f"{service.url}/api/servers").body["servers"]
    assert set(answers) == {413}, answers
    assert [entry["name"] for entry in listed] == ["real-1"]
    assert grown_mib < 40, f"the service grew {grown_mib:.0f} MiB"
