"""The agent <-> service HTTP protocol: the JSON bodies both sides validate.

The agent starts every exchange (it may sit behind NAT), authenticating each
request with `Authorization: Bearer <agent token>`:

* `POST /api/servers` — body `Server` (source="agent") -> 200 `RegisterResponse`.
  Registering again replaces the server's inventory (the agent does this when its GPUs change).
* `POST /api/servers/{name}/heartbeat` — body `Heartbeat` -> 200; 404 means "unknown server:
  register again".
* `GET /api/agents/{name}/deployments?wait=<seconds>` -> 200 `DeploymentsResponse`. A long poll:
  it answers at once when any deployment for this server needs action (a new one to run, or one
  whose desired state became `stop`), else after `wait` seconds with an empty list.
* `POST /api/deployments/{id}/status` — body `DeploymentStatus` -> 200. The service frees the
  GPU reservation when the state is terminal (`exited`, `failed`, `stopped`).

A GPU deployment names the reserved GPU UUIDs, or MIG device UUIDs (`MIG-...`) when it asked for
MIG devices; the agent exposes exactly those (NVIDIA_VISIBLE_DEVICES is never `all`). A server's
`gpus` carry their MIG devices (`Gpu.mig_devices`), so registering or a heartbeat with other
MIG devices replaces them like any other GPU change. `digest` is the platform manifest to pull,
as `repository@digest`, so the agent runs exactly what was scanned.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from placement.inventory import Gpu

DeploymentState = Literal["pending", "pulling", "running", "exited", "failed", "stopped"]
TERMINAL_STATES: frozenset[str] = frozenset({"exited", "failed", "stopped"})
DesiredState = Literal["run", "stop"]


class RegisterResponse(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    heartbeat_seconds: float = Field(gt=0)


class Heartbeat(BaseModel):
    """`gpus` is None when unchanged; a list replaces the server's GPUs."""

    model_config = ConfigDict(extra="ignore")

    gpus: list[Gpu] | None = None


class AgentDeployment(BaseModel):
    """One deployment as the agent sees it: what to pull, which GPUs, and what the service wants."""

    model_config = ConfigDict(extra="ignore")

    id: str
    image: str = Field(description="the reference the user asked for, e.g. registry/repo:tag")
    digest: str = Field(description="platform manifest digest; the agent pulls repository@digest")
    gpu_required: bool
    gpus: list[str] = Field(default_factory=list, description="reserved GPU or MIG device UUIDs")
    driver_capabilities: str | None = None
    inferred_cuda: bool = Field(
        default=False,
        description="the image declares no GPU (CUDA found in its layers): request the GPUs explicitly",
    )
    desired: DesiredState = "run"
    env: dict[str, str] = Field(default_factory=dict)
    command: list[str] | None = None
    state: DeploymentState = "pending"


class DeploymentsResponse(BaseModel):
    model_config = ConfigDict(extra="ignore")

    deployments: list[AgentDeployment] = Field(default_factory=list)


class DeploymentStatus(BaseModel):
    """A state change reported by the agent; `logs` holds the last ~50 lines of output."""

    model_config = ConfigDict(extra="ignore")

    state: DeploymentState
    exit_code: int | None = None
    reason: str | None = None
    logs: str | None = None
    container_id: str | None = None
