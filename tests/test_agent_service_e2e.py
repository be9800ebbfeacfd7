"""End to end: the real service, the real `gpubadge agent` process, a real dockerd and registry.

The user talks only to the service (POST/GET/DELETE /api/deployments); the agent, started
as the CLI would start it, registers a server with one fake GPU (no real GPU here: the
`nvidia` runtime is the recording stand-in), pulls what the service scanned, runs it and
reports back. The service passes no command to the agent, so each image bakes its own Cmd.
Waits follow the deployment's reported state through the API, each with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fixtures.busybox import busybox_image, gpu_busybox_image
from fixtures.dockerd import LocalDockerd
from fixtures.registry import LocalRegistry, free_port
from fixtures.service import RunningService, held_wait, run_service_inprocess
from placement.inventory import Gpu, Server
from placement.protocol import TERMINAL_STATES
from tests.conftest import Pusher
from web.settings import ServiceSettings

AGENT_TOKEN = "e2e-agent-token"
API_TOKEN = "e2e-api-token"
SERVER = "e2e-node"
GPU_UUID = "GPU-e2e00000-1111-2222-3333-444444444444"
# PID 1 ignores SIGTERM unless it traps it; this exits 143 at once when Docker stops it.
TERMINABLE_SLEEP = "echo serving; trap 'exit 143' TERM; sleep 300 & wait"
GPU_COMMAND = "echo visible=$NVIDIA_VISIBLE_DEVICES; echo caps=$NVIDIA_DRIVER_CAPABILITIES; exit 3"
REPO_ROOT = Path(__file__).resolve().parents[1]
WAIT_SECONDS = 20.0


@dataclass
class Stack:
    service: RunningService
    session: aiohttp.ClientSession
    dockerd: LocalDockerd
    images: dict[str, str]  # name -> reference the user deploys
    agent_log: Path

    async def get(self, path: str) -> Any:
        """As the user who deployed: with the API token, which shows env values and logs."""
        headers = {"Authorization": f"Bearer {API_TOKEN}"}
        async with self.session.get(f"{self.service.url}{path}", headers=headers) as response:
            assert response.status == 200, await response.text()
            return await response.json()

    async def deploy(self, image: str, **request: Any) -> tuple[int, Any]:
        async with self.session.post(
            f"{self.service.url}/api/deployments",
            json={"image": image, **request},
            headers={"Authorization": f"Bearer {API_TOKEN}"},
        ) as response:
            return response.status, await response.json()

    async def stop(self, deployment_id: str) -> tuple[int, Any]:
        async with self.session.delete(
            f"{self.service.url}/api/deployments/{deployment_id}",
            headers={"Authorization": f"Bearer {API_TOKEN}"},
        ) as response:
            return response.status, await response.json()

    async def server(self) -> dict[str, Any] | None:
        servers = (await self.get("/api/servers"))["servers"]
        return next((server for server in servers if server["name"] == SERVER), None)

    async def wait_state(self, deployment_id: str, state: str) -> Any:
        """Follow GET /api/deployments/{id} until `state` (bounded); a different terminal state fails."""
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            body = await self.get(f"/api/deployments/{deployment_id}")
            if body["state"] == state:
                return body
            if body["state"] in TERMINAL_STATES:
                pytest.fail(f"deployment ended {body['state']} instead of {state}: {body}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {state} within {WAIT_SECONDS}s: {body}\nagent log:\n{self.agent_log_text()}")
            await asyncio.sleep(0.05)

    async def wait_registered(self, agent: asyncio.subprocess.Process) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_SECONDS
        while (server := await self.server()) is None:
            if agent.returncode is not None or time.monotonic() > deadline:
                pytest.fail(f"the agent did not register:\n{self.agent_log_text()}")
            await asyncio.sleep(0.05)
        return server

    def agent_log_text(self) -> str:
        return self.agent_log.read_text(errors="replace")[-3000:]


def agent_server() -> Server:
    gpu = Gpu(
        index=0,
        uuid=GPU_UUID,
        name="NVIDIA H100 80GB HBM3",
        brand="NVIDIA",
        memory_mib=81559,
        compute_capability="9.0",
    )
    return Server(
        name=SERVER,
        cpus=2,
        memory="8Gi",
        driver_version="550.54.15",
        cuda_driver_version="12.4",
        runtime_modes=["runtime"],
        gpus=[gpu],
        source="agent",
    )


@pytest.fixture
async def stack(
    tmp_path: Path, registry: LocalRegistry, push: Pusher, dockerd: LocalDockerd
) -> AsyncIterator[Stack]:
    images = {
        "gpu": "e2e/cuda-busybox:exit3",
        "gpu-long": "e2e/cuda-busybox:serve",
        "cpu": "e2e/busybox:hello",
    }
    push(gpu_busybox_image(["/bin/sh", "-c", GPU_COMMAND]), images["gpu"])
    push(gpu_busybox_image(["/bin/sh", "-c", TERMINABLE_SLEEP]), images["gpu-long"])
    push(busybox_image(), images["cpu"])
    settings = ServiceSettings(
        db=tmp_path / "e2e.db",
        port=0,
        agent_token=AGENT_TOKEN,
        api_token=API_TOKEN,
        docker_config=None,
    )
    inventory = tmp_path / "node.json"
    inventory.write_text(json.dumps(agent_server().model_dump(mode="json")))
    agent_log = tmp_path / "agent.log"
    async with (
        run_service_inprocess(settings, port=free_port()) as service,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
    ):
        with agent_log.open("wb") as log:
            agent = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "gpubadge.cli",
                "agent",
                "--service",
                service.url,
                "--token",
                AGENT_TOKEN,
                "--inventory-file",
                str(inventory),
                "--docker-host",
                dockerd.host,
                "--poll-timeout",
                "5",
                cwd=REPO_ROOT,
                env={key: value for key, value in os.environ.items() if key != "DOCKER_HOST"},
                stdout=log,
                stderr=log,
            )
        stack = Stack(
            service, session, dockerd, {k: f"{registry.host}/{v}" for k, v in images.items()}, agent_log
        )
        code: int | None = None
        try:
            await stack.wait_registered(agent)
            yield stack
        finally:
            if agent.returncode is None:
                agent.send_signal(signal.SIGTERM)
                try:
                    code = await asyncio.wait_for(agent.wait(), 25)
                except TimeoutError:
                    agent.kill()
                    await agent.wait()
                    code = None
            else:
                code = agent.returncode
        assert code == 0, f"agent exit {code}:\n{stack.agent_log_text()}"


@pytest.mark.docker
async def test_deployments_run_through_the_service_and_the_agent(stack: Stack) -> None:
    server = await stack.server()
    assert server is not None and server["source"] == "agent"
    assert [gpu["uuid"] for gpu in server["gpus"]] == [GPU_UUID] and server["gpus_in_use"] == []

    # A GPU image: placed on the agent's server with its one GPU, run through the nvidia runtime.
    status, created = await stack.deploy(stack.images["gpu"], gpus=1)
    assert status == 201, created
    assert created["server"] == SERVER and created["gpus"] == [GPU_UUID] and created["gpu_required"]
    status, refused = await stack.deploy(stack.images["gpu"], gpus=1)
    assert status == 409, refused  # the only GPU is reserved
    finished = await stack.wait_state(created["id"], "exited")
    assert finished["exit_code"] == 3 and finished["reason"] == "exited with code 3"
    assert f"visible={GPU_UUID}" in finished["logs"] and "caps=compute,utility" in finished["logs"]
    spec = stack.dockerd.runtime_spec(finished["container_id"])
    assert spec is not None, "the GPU container did not go through the nvidia runtime"
    env = dict(item.split("=", 1) for item in spec["process"]["env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == GPU_UUID
    server = await stack.server()
    assert server is not None and server["gpus_in_use"] == []  # freed by the terminal report

    # A CPU image: no GPU reserved, no nvidia runtime.
    status, cpu = await stack.deploy(stack.images["cpu"])
    assert status == 201, cpu
    assert cpu["server"] == SERVER and cpu["gpus"] == [] and not cpu["gpu_required"]
    cpu_done = await stack.wait_state(cpu["id"], "exited")
    assert cpu_done["exit_code"] == 0 and cpu_done["logs"] == "hello from busybox\n"
    assert stack.dockerd.runtime_spec(cpu_done["container_id"]) is None

    # The deploy request may replace the command and add environment variables.
    command = ["sh", "-c", 'echo "$GREETING"; exit 5']
    status, custom = await stack.deploy(stack.images["cpu"], command=command, env={"GREETING": "hi there"})
    assert status == 201, custom
    custom_done = await stack.wait_state(custom["id"], "exited")
    assert custom_done["exit_code"] == 5 and custom_done["logs"] == "hi there\n"
    status, refused_env = await stack.deploy(stack.images["cpu"], env={"NVIDIA_VISIBLE_DEVICES": "all"})
    assert status == 400 and "NVIDIA_VISIBLE_DEVICES" in refused_env["error"]

    # A long-running GPU deployment, stopped by DELETE.
    status, long = await stack.deploy(stack.images["gpu-long"], gpus=1)
    assert status == 201 and long["gpus"] == [GPU_UUID], long  # the GPU is free again
    running = await stack.wait_state(long["id"], "running")
    assert running["container_id"]
    server = await stack.server()
    assert server is not None and server["gpus_in_use"] == [GPU_UUID]
    status, stopping = await stack.stop(long["id"])
    assert status == 202 and stopping["desired"] == "stop", stopping
    stopped = await stack.wait_state(long["id"], "stopped")
    assert stopped["exit_code"] == 143 and stopped["reason"] == "stopped on request (exit code 143)"
    assert stopped["logs"] == "serving\n"
    server = await stack.server()
    assert server is not None and server["gpus_in_use"] == []


async def test_service_shutdown_ends_open_long_polls(tmp_path: Path) -> None:
    """A graceful stop must not wait out the agents' long polls (aiohttp waits for handlers)."""
    settings = ServiceSettings(
        db=tmp_path / "poll.db", port=0, agent_token=AGENT_TOKEN, api_token=API_TOKEN, docker_config=None
    )
    headers = {"Authorization": f"Bearer {AGENT_TOKEN}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        service_context = run_service_inprocess(settings, port=free_port())
        service = await service_context.__aenter__()
        async with session.post(
            f"{service.url}/api/servers", json=agent_server().model_dump(mode="json"), headers=headers
        ) as response:
            assert response.status == 200
        registered_at = await _last_heartbeat(session, service.url)
        wait = held_wait(SERVER, at_least=20)  # held until the shutdown ends it
        poll = asyncio.create_task(
            session.get(f"{service.url}/api/agents/{SERVER}/deployments?wait={wait:g}", headers=headers)
        )
        deadline = time.monotonic() + 5
        while await _last_heartbeat(session, service.url) == registered_at:  # the poll stamps it
            assert time.monotonic() < deadline and not poll.done(), "the long poll never reached the service"
            await asyncio.sleep(0.01)
        # A long poll held 20 s more is open: shutdown must end it, so the bound is half of that.
        await asyncio.wait_for(service_context.__aexit__(None, None, None), 10)
        response = await asyncio.wait_for(poll, 10)
        async with response:
            assert response.status == 200 and (await response.json())["deployments"] == []


async def _last_heartbeat(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/api/servers") as response:
        servers = (await response.json())["servers"]
    return str(next(server for server in servers if server["name"] == SERVER)["last_heartbeat"])


async def test_a_deployment_stopped_as_the_agent_starts_it_is_stopped_on_the_node(
    tmp_path: Path, registry: LocalRegistry, push: Pusher
) -> None:
    """DELETE while pending frees the GPU at once; if the agent had already taken it, its
    `pulling`/`running` report must not leave a container running unasked: the next poll says stop."""
    push(gpu_busybox_image(["/bin/sh", "-c", TERMINABLE_SLEEP]), "e2e/race:1")
    settings = ServiceSettings(
        db=tmp_path / "race.db", port=0, agent_token=AGENT_TOKEN, api_token=API_TOKEN, docker_config=None
    )
    agent = {"Authorization": f"Bearer {AGENT_TOKEN}"}
    user = {"Authorization": f"Bearer {API_TOKEN}"}
    async with (
        run_service_inprocess(settings, port=free_port()) as service,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
    ):
        url = service.url

        async def call(method: str, path: str, headers: dict[str, str], body: Any = None) -> Any:
            async with session.request(method, f"{url}{path}", json=body, headers=headers) as response:
                assert response.status < 300, await response.text()
                return await response.json()

        await call("POST", "/api/servers", agent, agent_server().model_dump(mode="json"))
        created = await call(
            "POST", "/api/deployments", user, {"image": f"{registry.host}/e2e/race:1", "gpus": 1}
        )
        (taken,) = (await call("GET", f"/api/agents/{SERVER}/deployments?wait=0", agent))["deployments"]
        assert taken["id"] == created["id"] and taken["desired"] == "run"
        assert (await call("DELETE", f"/api/deployments/{created['id']}", user))["state"] == "stopped"
        # The agent's next long poll is already waiting when its `pulling` report arrives.
        polled_at = await _last_heartbeat(session, url)
        wait = held_wait(SERVER, at_least=10)  # held until the report wakes it
        poll = asyncio.create_task(call("GET", f"/api/agents/{SERVER}/deployments?wait={wait:g}", agent))
        deadline = time.monotonic() + 5
        while await _last_heartbeat(session, url) == polled_at:  # the poll stamps it
            assert time.monotonic() < deadline and not poll.done(), "the long poll never reached the service"
            await asyncio.sleep(0.01)
        await call("POST", f"/api/deployments/{created['id']}/status", agent, {"state": "pulling"})
        (again,) = (await asyncio.wait_for(poll, 5))["deployments"]  # woken, not waited out
        assert again["id"] == created["id"] and again["desired"] == "stop"
        await call("POST", f"/api/deployments/{created['id']}/status", agent, {"state": "running"})
        await call(
            "POST", f"/api/deployments/{created['id']}/status", agent, {"state": "stopped", "exit_code": 143}
        )
        final = await call("GET", f"/api/deployments/{created['id']}", user)
        assert final["state"] == "stopped" and final["desired"] == "stop"
        assert (await call("GET", f"/api/agents/{SERVER}/deployments?wait=0", agent))["deployments"] == []
        servers = (await call("GET", "/api/servers", user))["servers"]
        assert next(s for s in servers if s["name"] == SERVER)["gpus_in_use"] == []
