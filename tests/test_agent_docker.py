"""The agent against a real dockerd (stand-in `nvidia` runtime) and the protocol test peer.

One private dockerd per session (vfs is slow); images are a static busybox pushed to
the real test registry by skopeo. Every wait is on a reported event, bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import docker
import pytest
from aiohttp.test_utils import TestServer

from agent.host import build_server
from agent.loop import Agent, AgentSettings
from agent.main import make_discovery
from agent.nvml import read_nvml
from agent.runner import DEPLOYMENT_LABEL, GPUS_LABEL, SERVER_LABEL, DockerRunner, pull_reference
from agent.service_client import ServiceClient
from fixtures.busybox import busybox_image, gpu_busybox_image
from fixtures.dockerd import LocalDockerd
from fixtures.registry import LocalRegistry
from placement.inventory import Gpu, RuntimeMode, Server
from placement.protocol import AgentDeployment
from tests.agent_protocol_peer import ProtocolPeer
from tests.conftest import Pusher
from tests.fake_pynvml import FakeNvml, a100_40gb_mig

pytestmark = pytest.mark.docker
TOKEN = "agent-secret-token"
UUIDS = ["GPU-11111111-2222-3333-4444-555555555555", "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"]
# PID 1 ignores SIGTERM unless it traps it; this exits 143 at once when Docker stops it.
TERMINABLE_SLEEP = "trap 'exit 143' TERM; sleep 300 & wait"
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def images(registry: LocalRegistry, push: Pusher) -> dict[str, tuple[str, str]]:
    """name -> (reference, digest) for the CPU and GPU busybox images."""
    cpu = push(busybox_image(), "agent/busybox:1")
    gpu = push(gpu_busybox_image(), "agent/cuda-busybox:12.2")
    return {
        "cpu": (f"{registry.host}/agent/busybox:1", cpu),
        "gpu": (f"{registry.host}/agent/cuda-busybox:12.2", gpu),
    }


@pytest.fixture
async def peer() -> AsyncIterator[tuple[ProtocolPeer, str]]:
    protocol_peer = ProtocolPeer(TOKEN)
    server = TestServer(protocol_peer.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield protocol_peer, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def gpu_server(name: str, modes: list[RuntimeMode]) -> Server:
    gpus = [
        Gpu(index=i, uuid=u, name="NVIDIA H100", brand="Nvidia", compute_capability="9.0")
        for i, u in enumerate(UUIDS)
    ]
    return Server(
        name=name,
        cpus=2,
        driver_version="535.104.05",
        cuda_driver_version="12.2",
        runtime_modes=modes,
        gpus=gpus,
        source="agent",
    )


@contextlib.asynccontextmanager
async def running_agent(url: str, daemon: LocalDockerd, server: Server) -> AsyncIterator[Agent]:
    client = docker.DockerClient(base_url=daemon.host)
    async with aiohttp.ClientSession() as session:
        settings = AgentSettings(name=server.name, poll_timeout=5.0, heartbeat=None)
        agent = Agent(
            settings,
            ServiceClient(url, TOKEN, session),
            DockerRunner(client, server.name),
            lambda: (server, None),
        )
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        try:
            yield agent
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
            client.close()


def deployment(
    dep_id: str, image: tuple[str, str], gpus: list[str], command: list[str] | None = None
) -> AgentDeployment:
    return AgentDeployment(
        id=dep_id,
        image=image[0],
        digest=image[1],
        gpu_required=bool(gpus),
        gpus=gpus,
        driver_capabilities="compute,utility" if gpus else None,
        command=command,
    )


def env_of(spec: dict[str, object]) -> dict[str, str]:
    process = spec["process"]
    assert isinstance(process, dict)
    return dict(item.split("=", 1) for item in process["env"])


def own_containers(daemon: LocalDockerd, server_name: str) -> list[Any]:
    client = docker.DockerClient(base_url=daemon.host)
    try:
        found: list[Any] = client.containers.list(
            all=True, filters={"label": f"{SERVER_LABEL}={server_name}"}
        )
        return found
    finally:
        client.close()


async def test_gpu_image_goes_through_the_nvidia_runtime(
    dockerd: LocalDockerd, images: dict[str, tuple[str, str]], peer: tuple[ProtocolPeer, str]
) -> None:
    service, url = peer
    async with running_agent(url, dockerd, gpu_server("gpu-a", ["runtime", "device-requests"])):
        command = [
            "sh",
            "-c",
            "echo visible=$NVIDIA_VISIBLE_DEVICES; echo caps=$NVIDIA_DRIVER_CAPABILITIES; exit 3",
        ]
        await service.add(deployment("gpu-1", images["gpu"], [UUIDS[1]], command))
        final = await service.wait_state("gpu-1", "exited")
    assert service.states("gpu-1") == ["pulling", "running", "exited"]
    assert final.exit_code == 3 and final.reason == "exited with code 3"
    assert (
        final.logs is not None
        and f"visible={UUIDS[1]}" in final.logs
        and "caps=compute,utility" in final.logs
    )
    running = service.statuses["gpu-1"][1]
    assert running.container_id == final.container_id and final.container_id
    spec = dockerd.runtime_spec(final.container_id)
    assert spec is not None, "the GPU container did not go through the nvidia runtime"
    assert env_of(spec)["NVIDIA_VISIBLE_DEVICES"] == UUIDS[1]
    assert own_containers(dockerd, "gpu-a") == []  # removed once the final report was accepted
    assert service.registrations[0].name == "gpu-a" and service.unauthorised == 0


async def test_cpu_image_runs_without_the_nvidia_runtime(
    dockerd: LocalDockerd, images: dict[str, tuple[str, str]], peer: tuple[ProtocolPeer, str]
) -> None:
    service, url = peer
    async with running_agent(url, dockerd, gpu_server("cpu-a", ["runtime"])):
        await service.add(deployment("cpu-1", images["cpu"], []))
        final = await service.wait_state("cpu-1", "exited")
    assert final.exit_code == 0 and final.logs == "hello from busybox\n"
    assert final.container_id and dockerd.runtime_spec(final.container_id) is None


async def test_device_requests_mode_uses_docker_gpus(
    dockerd: LocalDockerd, images: dict[str, tuple[str, str]], peer: tuple[ProtocolPeer, str]
) -> None:
    service, url = peer
    async with running_agent(url, dockerd, gpu_server("dr-a", ["device-requests"])):
        await service.add(deployment("dr-1", images["gpu"], UUIDS, ["true"]))
        final = await service.wait_state("dr-1", "exited")
    assert final.exit_code == 0 and final.container_id
    assert dockerd.runtime_spec(final.container_id) is None
    hook = dockerd.hook_spec(final.container_id)
    assert hook is not None, "Docker's nvidia device driver did not add the prestart hook"
    env = env_of(hook)
    assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(UUIDS)
    assert set(env["NVIDIA_DRIVER_CAPABILITIES"].split(",")) == {"compute", "utility"}


async def test_stop_and_labels(
    dockerd: LocalDockerd, images: dict[str, tuple[str, str]], peer: tuple[ProtocolPeer, str]
) -> None:
    service, url = peer
    async with running_agent(url, dockerd, gpu_server("stop-a", ["runtime"])):
        await service.add(
            deployment("long-1", images["gpu"], [UUIDS[0]], ["sh", "-c", f"echo started; {TERMINABLE_SLEEP}"])
        )
        running = await service.wait_state("long-1", "running")
        (container,) = own_containers(dockerd, "stop-a")
        assert container.id == running.container_id
        assert container.labels[DEPLOYMENT_LABEL] == "long-1" and container.labels[GPUS_LABEL] == UUIDS[0]
        assert container.attrs["HostConfig"]["NetworkMode"] == "none"
        await service.request_stop("long-1")
        stopped = await service.wait_state("long-1", "stopped")
    # checked after the agent stopped: removal follows the accepted report, and shutdown lets it finish
    assert own_containers(dockerd, "stop-a") == []
    assert stopped.logs == "started\n" and stopped.exit_code == 143
    assert stopped.reason == "stopped on request (exit code 143)"
    assert "exited" not in service.states("long-1")


async def test_pull_failure_is_reported(
    dockerd: LocalDockerd, images: dict[str, tuple[str, str]], peer: tuple[ProtocolPeer, str]
) -> None:
    service, url = peer
    missing = (images["cpu"][0], "sha256:" + "0" * 64)
    async with running_agent(url, dockerd, gpu_server("fail-a", ["runtime"])):
        await service.add(deployment("missing-1", missing, []))
        failed = await service.wait_state("missing-1", "failed")
    assert failed.reason is not None and "pull" in failed.reason and "0" * 64 in failed.reason
    assert TOKEN not in failed.reason


async def test_reregisters_when_forgotten_or_gpus_change(
    dockerd: LocalDockerd, peer: tuple[ProtocolPeer, str], caplog: pytest.LogCaptureFixture
) -> None:
    service, url = peer
    service.heartbeat_seconds = 0.05
    current: dict[str, Any] = {
        "server": Server(name="hb-a", source="agent"),
        "reason": "NVML is not available: test",
    }
    client = docker.DockerClient(base_url=dockerd.host)
    caplog.set_level(logging.INFO, logger="agent.loop")
    async with aiohttp.ClientSession() as session:
        agent = Agent(
            AgentSettings(name="hb-a", poll_timeout=5.0),
            ServiceClient(url, TOKEN, session),
            DockerRunner(client, "hb-a"),
            lambda: (current["server"], current["reason"]),
        )
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        await service.wait_for(lambda: len(service.heartbeats) >= 3)
        await service.forget("hb-a")
        await service.wait_for(lambda: len(service.registrations) == 2)
        current["server"], current["reason"] = gpu_server("hb-a", ["runtime"]), None
        await service.wait_for(lambda: len(service.registrations) == 3)
        stop.set()
        await asyncio.wait_for(task, 10)
    client.close()
    assert [len(s.gpus) for s in service.registrations] == [0, 0, 2]
    cpu_lines = [r for r in caplog.records if "as a CPU server" in r.getMessage()]
    assert len(cpu_lines) == 1 and "NVML is not available: test" in cpu_lines[0].getMessage()


async def _agent_process(url: str, daemon: LocalDockerd, inventory: Path) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agent.main",
        "--service",
        url,
        "--inventory-file",
        str(inventory),
        "--docker-host",
        daemon.host,
        "--poll-timeout",
        "5",
        "--heartbeat",
        "0.2",
        cwd=REPO_ROOT,
        env={**os.environ, "GPUBADGE_AGENT_TOKEN": TOKEN},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_restart_finds_its_container_and_sigterm_is_clean(
    dockerd: LocalDockerd, images: dict[str, tuple[str, str]], peer: tuple[ProtocolPeer, str], tmp_path: Path
) -> None:
    service, url = peer
    inventory = tmp_path / "server.json"
    inventory.write_text(json.dumps(gpu_server("restart-a", ["runtime"]).model_dump(mode="json")))
    first = await _agent_process(url, dockerd, inventory)
    try:
        await service.add(deployment("keep-1", images["gpu"], [UUIDS[0]], ["sh", "-c", TERMINABLE_SLEEP]))
        running = await service.wait_state("keep-1", "running")
    finally:
        first.kill()  # no chance to clean up: the container must survive and be found again
        await asyncio.wait_for(first.wait(), 10)
    second = await _agent_process(url, dockerd, inventory)
    try:
        await service.wait_for(lambda: service.states("keep-1").count("running") == 2)
        assert service.statuses["keep-1"][-1].container_id == running.container_id
        assert [c.id for c in own_containers(dockerd, "restart-a")] == [running.container_id]
        await service.request_stop("keep-1")
        await service.wait_state("keep-1", "stopped")
        second.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(second.wait(), 10) == 0
        assert own_containers(dockerd, "restart-a") == []
    finally:
        if second.returncode is None:
            second.kill()
            await second.wait()
    assert len(service.registrations) == 2 and service.registrations[1].gpus[0].uuid == UUIDS[0]
    assert service.states("keep-1") == ["pulling", "running", "running", "stopped"]


async def test_containers_left_by_a_previous_agent_are_reported(
    dockerd: LocalDockerd, images: dict[str, tuple[str, str]], peer: tuple[ProtocolPeer, str]
) -> None:
    """One exited while no agent ran, one was created but never started: both are picked up by label."""
    service, url = peer
    client = docker.DockerClient(base_url=dockerd.host)
    reference = pull_reference(*images["cpu"])
    client.images.pull(reference)

    def leftover(dep_id: str, command: str) -> Any:
        labels = {DEPLOYMENT_LABEL: dep_id, SERVER_LABEL: "left-a"}
        return client.containers.create(reference, ["sh", "-c", command], labels=labels, network_mode="none")

    exited = leftover("gone-1", "echo bye; exit 7")
    exited.start()
    assert exited.wait(timeout=30)["StatusCode"] == 7
    created = leftover("late-1", f"echo late; {TERMINABLE_SLEEP}")
    for dep_id in ("gone-1", "late-1"):
        left = deployment(dep_id, images["cpu"], []).model_copy(update={"state": "running"})
        await service.add(left)
    async with running_agent(url, dockerd, gpu_server("left-a", ["runtime"])):
        final = await service.wait_state("gone-1", "exited")
        resumed = await service.wait_state("late-1", "running")
        assert client.containers.get(created.id).status == "running"
        await service.request_stop("late-1")
        await service.wait_state("late-1", "stopped")
    client.close()
    assert (final.exit_code, final.logs, final.container_id) == (7, "bye\n", exited.id)
    assert resumed.container_id == created.id
    assert own_containers(dockerd, "left-a") == []


def test_inventory_file_does_not_hide_the_engines_runtimes(dockerd: LocalDockerd, tmp_path: Path) -> None:
    """The file replaces NVML, not `docker info`: the engine's `nvidia` runtime is still offered."""
    inventory = tmp_path / "server.json"
    inventory.write_text(
        json.dumps(gpu_server("file-b", []).model_dump(mode="json", exclude={"runtime_modes"}))
    )
    client = docker.DockerClient(base_url=dockerd.host)
    try:
        server, reason = make_discovery("file-b", DockerRunner(client, "file-b"), inventory)()
        assert reason is None and server.runtime_modes[0] == "runtime"
        inventory.write_text(json.dumps(gpu_server("file-b", ["cdi"]).model_dump(mode="json")))
        declared, _ = make_discovery("file-b", DockerRunner(client, "file-b"), inventory)()
        assert declared.runtime_modes[0] == "runtime" and declared.runtime_modes[-1] == "cdi"
    finally:
        client.close()
    unreachable = DockerRunner(
        docker.DockerClient(base_url="unix:///nonexistent/docker.sock", version="1.41"), "file-b"
    )
    offline, _ = make_discovery("file-b", unreachable, inventory)()
    assert offline.runtime_modes == ["cdi"]  # the engine cannot be asked: the file is all there is


async def test_agent_with_an_inventory_file_without_modes_runs_gpu_deployments(
    dockerd: LocalDockerd, images: dict[str, tuple[str, str]], peer: tuple[ProtocolPeer, str], tmp_path: Path
) -> None:
    service, url = peer
    inventory = tmp_path / "server.json"
    inventory.write_text(
        json.dumps(gpu_server("file-a", []).model_dump(mode="json", exclude={"runtime_modes"}))
    )
    agent = await _agent_process(url, dockerd, inventory)
    try:
        await service.add(deployment("file-gpu-1", images["gpu"], [UUIDS[0]], ["sh", "-c", "exit 0"]))
        final = await service.wait_state("file-gpu-1", "exited")
    finally:
        agent.send_signal(signal.SIGTERM)
        await asyncio.wait_for(agent.wait(), 10)
    assert final.exit_code == 0, final.reason
    assert "runtime" in service.registrations[0].runtime_modes
    assert dockerd.runtime_spec(final.container_id or "") is not None  # through the nvidia runtime


def mig_server(name: str, modes: list[RuntimeMode]) -> Server:
    """An A100 split into seven 1g.5gb MIG devices, as the agent reads it through the NVML stand-in."""
    facts = read_nvml(FakeNvml(gpus=[a100_40gb_mig()], driver_version="535.104.05", cuda_version=12020))
    return build_server(name, facts, modes, arch="x86_64", cpus=2, memory=1 << 33)


@pytest.mark.parametrize("mode", ["runtime", "device-requests"])
async def test_a_placed_container_runs_on_its_mig_devices(
    mode: RuntimeMode,
    dockerd: LocalDockerd,
    images: dict[str, tuple[str, str]],
    peer: tuple[ProtocolPeer, str],
) -> None:
    """The MIG device UUIDs placement reserved reach the NVIDIA runtime (the recording stand-in) as
    NVIDIA_VISIBLE_DEVICES, exactly those and never the parent GPU."""
    service, url = peer
    server = mig_server(f"mig-{mode}", [mode])
    parent = server.gpus[0]
    reserved = [parent.mig_devices[2].uuid, parent.mig_devices[5].uuid]
    async with running_agent(url, dockerd, server):
        command = ["sh", "-c", "echo visible=$NVIDIA_VISIBLE_DEVICES"]
        await service.add(deployment(f"mig-{mode}-1", images["gpu"], reserved, command))
        final = await service.wait_state(f"mig-{mode}-1", "exited")
    assert final.exit_code == 0 and final.container_id, final.reason
    assert service.registrations[0].gpus[0].mig_devices == parent.mig_devices  # reported as read
    spec = (
        dockerd.runtime_spec(final.container_id)
        if mode == "runtime"
        else dockerd.hook_spec(final.container_id)
    )
    assert spec is not None, f"the container did not reach the NVIDIA runtime ({mode})"
    visible = env_of(spec)["NVIDIA_VISIBLE_DEVICES"]
    assert visible == ",".join(reserved) and parent.uuid not in visible
    if mode == "runtime":
        assert final.logs == f"visible={','.join(reserved)}\n"
