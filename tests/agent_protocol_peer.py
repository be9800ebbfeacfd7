"""TEST PEER for the agent protocol (placement/protocol.py); NOT the gpubadge service.

A small aiohttp app that speaks the service's side of the protocol just well enough to
drive a real agent: it records registrations, heartbeats and status reports, holds
deployments, and answers the long poll at once when one needs action. Tests wait on
its `changed` condition (events), never on sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from placement.inventory import Server
from placement.protocol import (
    TERMINAL_STATES,
    AgentDeployment,
    DeploymentsResponse,
    DeploymentStatus,
    Heartbeat,
    RegisterResponse,
)


@dataclass
class ProtocolPeer:
    token: str
    heartbeat_seconds: float = 0.2
    registrations: list[Server] = field(default_factory=list)
    heartbeats: list[tuple[str, Heartbeat]] = field(default_factory=list)
    statuses: dict[str, list[DeploymentStatus]] = field(default_factory=dict)
    deployments: dict[str, AgentDeployment] = field(default_factory=dict)
    known: set[str] = field(default_factory=set)
    unauthorised: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    # ---- test controls -------------------------------------------------------------------
    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def add(self, deployment: AgentDeployment) -> None:
        self.deployments[deployment.id] = deployment
        await self._notify()

    async def request_stop(self, deployment_id: str) -> None:
        current = self.deployments[deployment_id]
        self.deployments[deployment_id] = current.model_copy(update={"desired": "stop"})
        await self._notify()

    async def forget(self, name: str) -> None:
        self.known.discard(name)

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 30.0) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(predicate), timeout)

    async def wait_state(self, deployment_id: str, state: str, timeout: float = 30.0) -> DeploymentStatus:
        def reached() -> bool:
            return any(s.state == state for s in self.statuses.get(deployment_id, []))

        await self.wait_for(reached, timeout)
        return next(s for s in self.statuses[deployment_id] if s.state == state)

    def states(self, deployment_id: str) -> list[str]:
        return [s.state for s in self.statuses.get(deployment_id, [])]

    # ---- protocol --------------------------------------------------------------------------
    def _authorised(self, request: web.Request) -> bool:
        ok = request.headers.get("Authorization") == f"Bearer {self.token}"
        self.unauthorised += 0 if ok else 1
        return ok

    def _needs_action(self, deployment: AgentDeployment) -> bool:
        if deployment.desired == "stop":
            return deployment.state not in TERMINAL_STATES
        return deployment.state == "pending"

    async def register(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"error": "unauthorised"}, status=401)
        server = Server.model_validate(await request.json())
        self.registrations.append(server)
        self.known.add(server.name)
        await self._notify()
        return web.json_response(
            RegisterResponse(name=server.name, heartbeat_seconds=self.heartbeat_seconds).model_dump()
        )

    async def heartbeat(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"error": "unauthorised"}, status=401)
        name = request.match_info["name"]
        if name not in self.known:
            return web.json_response({"error": "unknown server"}, status=404)
        self.heartbeats.append((name, Heartbeat.model_validate(await request.json())))
        await self._notify()
        return web.json_response({})

    async def poll(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"error": "unauthorised"}, status=401)
        wait = float(request.query.get("wait", "0"))

        def actionable() -> list[AgentDeployment]:
            return [d for d in self.deployments.values() if self._needs_action(d)]

        async with self.changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait_for(lambda: bool(actionable())), wait)
        return web.json_response(DeploymentsResponse(deployments=actionable()).model_dump(mode="json"))

    async def status(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"error": "unauthorised"}, status=401)
        deployment_id = request.match_info["id"]
        if deployment_id not in self.deployments:
            return web.json_response({"error": "unknown deployment"}, status=404)
        status = DeploymentStatus.model_validate(await request.json())
        self.statuses.setdefault(deployment_id, []).append(status)
        self.deployments[deployment_id] = self.deployments[deployment_id].model_copy(
            update={"state": status.state}
        )
        await self._notify()
        return web.json_response({})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/api/servers", self.register)
        app.router.add_post("/api/servers/{name}/heartbeat", self.heartbeat)
        app.router.add_get("/api/agents/{name}/deployments", self.poll)
        app.router.add_post("/api/deployments/{id}/status", self.status)
        return app
