"""Docker Engine API side of the agent: pull by digest, run with the NVIDIA runtime, read outcomes.

`container_options` (pure) decides how a deployment becomes a container: which image
reference, env, labels and NVIDIA wiring (runtime, device request or CDI device).
`DockerRunner` does the blocking Docker calls; the agent calls it from threads.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import docker
import docker.errors
from docker.types import DeviceRequest

from placement.inventory import RuntimeMode
from placement.protocol import AgentDeployment, DeploymentStatus

DEPLOYMENT_LABEL = "io.gpubadge.deployment"
SERVER_LABEL = "io.gpubadge.server"
GPUS_LABEL = "io.gpubadge.gpus"
LOG_LINES = 50
# The service refuses JSON strings past GPUBADGE_JSON_MAX_STRING (64 Ki characters by default):
# fifty lines of progress bars must not make a status report bounce.
LOG_CHARS = 16 * 1024

GpuMode = Literal["auto", "runtime", "device-requests", "cdi"]
# What Docker's built-in `nvidia` device driver accepts as capabilities (moby daemon/nvidia_linux.go).
DOCKER_NVIDIA_CAPABILITIES = ("compute", "compat32", "graphics", "utility", "video", "display")
DEFAULT_CAPABILITIES = ("utility", "compute")
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]")


class DeploymentError(Exception):
    """A deployment that cannot be run as asked; the message is safe to report."""


def pull_reference(image: str, digest: str) -> str:
    """`registry/repo:tag` + digest -> `registry/repo@digest`, so exactly the scanned manifest runs."""
    name = image.split("@", 1)[0]
    if name.rfind(":") > name.rfind("/"):
        name = name[: name.rfind(":")]
    return f"{name}@{digest}"


def driver_capabilities(value: str | None) -> list[str]:
    """NVIDIA_DRIVER_CAPABILITIES text -> the capability list for a device request.

    Unset or empty means the toolkit default `utility,compute`; `all` means every capability
    Docker's nvidia driver knows. Capabilities Docker does not know (ngx) cannot be requested.
    """
    items = [item.strip().lower() for item in (value or "").split(",") if item.strip()]
    if not items:
        return list(DEFAULT_CAPABILITIES)
    if "all" in items:
        return list(DOCKER_NVIDIA_CAPABILITIES)
    unknown = [item for item in items if item not in DOCKER_NVIDIA_CAPABILITIES]
    if unknown:
        raise DeploymentError(f"driver capabilities not supported by Docker device requests: {unknown}")
    return items


def choose_gpu_mode(available: list[RuntimeMode], preferred: GpuMode = "auto") -> RuntimeMode:
    """The server's configured mode, or (auto) the first offered: runtime, then device-requests, then cdi."""
    if preferred != "auto":
        if preferred not in available:
            raise DeploymentError(
                f"GPU mode {preferred!r} is not offered by this Docker engine ({available})"
            )
        return preferred
    for mode in ("runtime", "device-requests", "cdi"):
        if mode in available:
            return mode
    raise DeploymentError("this Docker engine offers no NVIDIA runtime, device requests or CDI specs")


def container_name(deployment_id: str) -> str:
    """A deterministic name, so Docker itself refuses a second container for one deployment."""
    return "gpubadge-" + _NAME_UNSAFE.sub("_", deployment_id)


def container_options(
    deployment: AgentDeployment,
    server_name: str,
    gpu_mode: RuntimeMode | None,
    default_runtime: str = "runc",
) -> dict[str, Any]:
    """Keyword arguments for `containers.create`; raises DeploymentError for an impossible request."""
    env = dict(deployment.env)
    options: dict[str, Any] = {
        "image": pull_reference(deployment.image, deployment.digest),
        "name": container_name(deployment.id),
        "labels": {DEPLOYMENT_LABEL: deployment.id, SERVER_LABEL: server_name},
        "network_mode": "none",
        "detach": True,
    }
    if deployment.command is not None:
        options["command"] = deployment.command
    if not deployment.gpu_required:
        if default_runtime == "nvidia":
            options["runtime"] = "runc"  # a CPU image never goes through the NVIDIA runtime
        options["environment"] = env
        return options
    if not deployment.gpus:
        raise DeploymentError("GPU deployment without reserved GPUs")
    if gpu_mode is None:
        raise DeploymentError("GPU deployment on a server without an NVIDIA container runtime")
    options["labels"][GPUS_LABEL] = ",".join(deployment.gpus)
    if deployment.inferred_cuda and gpu_mode != "cdi":
        # The image sets no NVIDIA_VISIBLE_DEVICES or capabilities (its CUDA was found in its layers):
        # the runtime's env path would give it no compute capability, so ask Docker for the GPUs.
        options["device_requests"] = [
            DeviceRequest(
                driver="nvidia",
                device_ids=list(deployment.gpus),
                capabilities=[driver_capabilities(deployment.driver_capabilities)],
            )
        ]
        if default_runtime == "nvidia":
            options["runtime"] = "runc"  # the device request alone injects the GPUs, once
        options["environment"] = env
        return options
    env["NVIDIA_VISIBLE_DEVICES"] = ",".join(deployment.gpus)
    if gpu_mode == "runtime":
        options["runtime"] = "nvidia"
        if deployment.driver_capabilities is not None:
            env["NVIDIA_DRIVER_CAPABILITIES"] = deployment.driver_capabilities
    elif gpu_mode == "device-requests":
        options["device_requests"] = [
            DeviceRequest(
                driver="nvidia",
                device_ids=list(deployment.gpus),
                capabilities=[driver_capabilities(deployment.driver_capabilities)],
            )
        ]
    else:
        options["device_requests"] = [
            DeviceRequest(driver="cdi", device_ids=[f"nvidia.com/gpu={uuid}" for uuid in deployment.gpus])
        ]
    options["environment"] = env
    return options


@dataclass(frozen=True)
class ContainerView:
    """The parts of `docker inspect` the agent acts on."""

    id: str
    deployment_id: str
    status: str  # created, running, paused, restarting, removing, exited, dead
    exit_code: int | None
    oom_killed: bool = False
    error: str = ""

    @property
    def finished(self) -> bool:
        return self.status in {"exited", "dead"}

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> ContainerView:
        state = attrs.get("State") or {}
        labels = (attrs.get("Config") or {}).get("Labels") or {}
        status = str(state.get("Status", ""))
        finished = status in {"exited", "dead"}
        return cls(
            id=str(attrs["Id"]),
            deployment_id=str(labels.get(DEPLOYMENT_LABEL, "")),
            status=status,
            exit_code=int(state.get("ExitCode", 0)) if finished else None,
            oom_killed=bool(state.get("OOMKilled", False)),
            error=str(state.get("Error") or ""),
        )


def finished_status(
    view: ContainerView, logs: str | None, state: Literal["exited", "stopped"]
) -> DeploymentStatus:
    """A finished container -> the terminal status report."""
    if view.oom_killed:
        reason = f"killed: out of memory (exit code {view.exit_code})"
    elif view.error:
        reason = view.error
    elif state == "stopped":
        reason = f"stopped on request (exit code {view.exit_code})"
    else:
        reason = f"exited with code {view.exit_code}"
    return DeploymentStatus(
        state=state, exit_code=view.exit_code, reason=reason, logs=logs, container_id=view.id
    )


class DockerRunner:
    """Blocking Docker Engine API calls for one server's containers (call them from a thread)."""

    def __init__(self, client: docker.DockerClient, server_name: str) -> None:
        self.client = client
        self.server_name = server_name

    @classmethod
    def from_env(cls, server_name: str, docker_host: str | None = None) -> DockerRunner:
        """DOCKER_HOST (or `docker_host`), else the default socket: the usual way."""
        client = docker.DockerClient(base_url=docker_host) if docker_host else docker.from_env()
        return cls(client, server_name)

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = self.client.info()
        return info

    def pull(self, reference: str) -> None:
        self.client.images.pull(reference)

    def create_and_start(self, options: dict[str, Any]) -> str:
        """Create and start; if the deployment's container already exists, start that one instead."""
        create_options = {key: value for key, value in options.items() if key != "detach"}
        try:
            container = self.client.containers.create(**create_options)
        except docker.errors.APIError as exc:
            if exc.status_code != 409:
                raise
            container = self.client.containers.get(options["name"])
        if container.status != "running":
            container.start()
        return str(container.id)

    def start(self, container_id: str) -> None:
        self.client.api.start(container_id)

    def list_own(self) -> list[ContainerView]:
        """This server's deployment containers, running or not (found by label after a restart)."""
        containers = self.client.containers.list(
            all=True, filters={"label": [f"{SERVER_LABEL}={self.server_name}", DEPLOYMENT_LABEL]}
        )
        return [ContainerView.from_attrs(container.attrs) for container in containers]

    def inspect(self, container_id: str) -> ContainerView:
        return ContainerView.from_attrs(self.client.api.inspect_container(container_id))

    def logs(self, container_id: str, lines: int = LOG_LINES) -> str:
        try:
            data: bytes = self.client.api.logs(container_id, stdout=True, stderr=True, tail=lines)
        except docker.errors.APIError:
            return ""
        text = data.decode(errors="replace")
        return text if len(text) <= LOG_CHARS else "…" + text[-(LOG_CHARS - 1) :]

    def stop(self, container_id: str, timeout: int = 10) -> ContainerView:
        self.client.api.stop(container_id, timeout=timeout)
        return self.inspect(container_id)

    def remove(self, container_id: str) -> None:
        with contextlib.suppress(docker.errors.NotFound):
            self.client.api.remove_container(container_id, force=True)

    def die_events(self) -> Any:
        """A closeable stream of `die` events for this server's containers."""
        return self.client.events(
            decode=True,
            filters={"type": "container", "event": "die", "label": f"{SERVER_LABEL}={self.server_name}"},
        )


def event_container_ids(stream: Any) -> Iterator[str]:
    for event in stream:
        container_id = event.get("id") or (event.get("Actor") or {}).get("ID")
        if container_id:
            yield str(container_id)
