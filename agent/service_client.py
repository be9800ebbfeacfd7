"""The agent's side of the HTTP protocol in `placement.protocol` (aiohttp client).

Every request carries the agent token; error messages name the request and status,
never the token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from pydantic import BaseModel, ValidationError

from placement.inventory import Gpu, Server
from placement.protocol import (
    AgentDeployment,
    DeploymentsResponse,
    DeploymentStatus,
    Heartbeat,
    RegisterResponse,
)


class ServiceError(Exception):
    """The service answered with an error or an unreadable body, or could not be reached.

    `retry_after` is the service's `Retry-After` (seconds) when it sent one (a 503 or 429)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def _retry_after(value: str | None) -> float | None:
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds <= 3600 else None


@dataclass
class Backoff:
    """Delays between attempts to reach the service: doubling from `first` up to `most`, each
    drawn at random from its upper half ("equal jitter"), and never shorter than a `Retry-After`
    the service asked for (stretched by up to half again). After the service restarts, thousands
    of agents retry spread over the window instead of in lockstep.
    """

    first: float = 0.25
    most: float = 10.0
    rng: random.Random = field(default_factory=random.Random)
    _ceiling: float = 0.0

    def next(self, retry_after: float | None = None) -> float:
        self._ceiling = self.first if self._ceiling == 0.0 else min(self._ceiling * 2, self.most)
        delay = self.rng.uniform(self._ceiling / 2, self._ceiling)
        if retry_after is not None:
            delay = max(delay, retry_after * self.rng.uniform(1.0, 1.5))
        return delay

    def reset(self) -> None:
        self._ceiling = 0.0


class UnknownServer(ServiceError):
    """The service does not know this server (404 on heartbeat): register again."""


class ServiceClient:
    def __init__(self, base_url: str, token: str, session: aiohttp.ClientSession) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self.session = session

    async def _request(
        self,
        method: str,
        path: str,
        body: BaseModel | None = None,
        params: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> Any:
        url = f"{self.base_url}{path}"
        payload = body.model_dump(mode="json") if body is not None else None
        try:
            async with self.session.request(
                method,
                url,
                json=payload,
                params=params,
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:
                if response.status == 404:
                    raise UnknownServer(f"{method} {path}: 404 not found")
                if response.status >= 400:
                    text = (await response.text())[:300]
                    raise ServiceError(
                        f"{method} {path}: HTTP {response.status}: {text}",
                        _retry_after(response.headers.get("Retry-After")),
                    )
                if response.content_type == "application/json":
                    return await response.json()
                return None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ServiceError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc

    async def register(self, server: Server) -> RegisterResponse:
        data = await self._request("POST", "/api/servers", server)
        try:
            return RegisterResponse.model_validate(data)
        except ValidationError as exc:
            raise ServiceError(f"unexpected register response: {exc.errors()[:1]}") from exc

    async def heartbeat(self, name: str, gpus: list[Gpu] | None = None) -> None:
        """Raises UnknownServer when the service wants a fresh registration."""
        await self._request("POST", f"/api/servers/{name}/heartbeat", Heartbeat(gpus=gpus))

    async def poll_deployments(self, name: str, wait: float) -> list[AgentDeployment]:
        """The long poll: returns when something needs action, else within `wait` seconds (empty)."""
        data = await self._request(
            "GET", f"/api/agents/{name}/deployments", params={"wait": f"{wait:g}"}, timeout=wait + 30.0
        )
        try:
            return DeploymentsResponse.model_validate(data).deployments
        except ValidationError as exc:
            raise ServiceError(f"unexpected deployments response: {exc.errors()[:1]}") from exc

    async def report(self, deployment_id: str, status: DeploymentStatus) -> None:
        await self._request("POST", f"/api/deployments/{deployment_id}/status", status)
