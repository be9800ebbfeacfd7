"""The API's request and response models that several modules name: scan jobs (`ScanBody`,
`JobView`) and deployments (`Deployment`, `RunSpec`)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from placement.protocol import (
    AgentDeployment,
    DeploymentState,
)
from scanner.redaction import REDACTED, redact_secrets
from store import Job
from web.security import mask_values


class ScanBody(BaseModel):
    ref: str = Field(description="image reference: a tag or a digest")
    rescan: bool = Field(
        default=False,
        description="scan again even when a report is stored: the manifest, configs and every layer"
        " verdict are read afresh (layers whose complete evidence is cached by digest are not fetched)",
    )


class JobView(BaseModel):
    id: str
    reference: str
    state: str
    attempts: int
    error: str | None
    digest: str | None
    source: str | None
    created_at: str
    updated_at: str
    rescan: bool = Field(default=False, description="a forced rescan: nothing stored is reused")

    @classmethod
    def of(cls, job: Job) -> JobView:
        return cls(
            id=job.id,
            reference=job.reference,
            state=job.state,
            attempts=job.attempts,
            error=redact_secrets(job.error) if job.error else job.error,
            digest=job.result_digest,
            source=job.source,
            created_at=job.created_at,
            updated_at=job.updated_at,
            rescan=job.rescan,
        )


class Deployment(BaseModel):
    """A deployment as the API shows it (`GET /api/deployments/{id}`)."""

    id: str
    image: str
    digest: str
    platform: str
    server: str
    gpus: list[str] = Field(default_factory=list)
    gpu_required: bool = False
    driver_capabilities: str | None = None
    inferred_cuda: bool = False
    command: list[str] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    state: DeploymentState = "pending"
    desired: str = "run"
    exit_code: int | None = None
    reason: str | None = None
    logs: str | None = None
    container_id: str | None = None
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    updated_at: datetime = Field(default_factory=lambda: datetime.now(UTC))

    def shown(self, token_holder: bool) -> dict[str, Any]:
        """The API's JSON. `env` values and the container's output only for API token holders:
        both may carry the workload's secrets (a program that prints its configuration)."""
        body = self.model_dump(mode="json")
        if not token_holder:
            body["env"] = mask_values(self.env)
            if self.logs:
                body["logs"] = REDACTED
        return body

    def for_agent(self) -> AgentDeployment:
        return AgentDeployment(
            id=self.id,
            image=self.image,
            digest=self.digest,
            gpu_required=self.gpu_required,
            gpus=self.gpus,
            driver_capabilities=self.driver_capabilities,
            inferred_cuda=self.inferred_cuda,
            command=self.command,
            env=self.env,
            desired="stop" if self.desired == "stop" else "run",
            state=self.state,
        )


class RunSpec(BaseModel):
    """What to run in the container, beside the image's own defaults (deployments only)."""

    model_config = ConfigDict(extra="forbid")

    command: list[str] | None = Field(default=None, description="replaces the image's CMD")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables")

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not _ENV_NAME.match(name):
                raise ValueError(f"invalid environment variable name {name!r}")
            if name == "NVIDIA_VISIBLE_DEVICES":
                raise ValueError(
                    "NVIDIA_VISIBLE_DEVICES is set to the reserved GPUs and cannot be overridden"
                )
        return env


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
