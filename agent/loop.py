"""The agent's event loop: register, heartbeat, long-poll deployments, run them, report.

Docker calls block, so they run in threads; container deaths arrive as Docker `die`
events from one reader thread. Per-deployment locks keep reports in order (`running`
before `exited`). Containers outlive the agent: after a restart it finds them by label
and carries on, so there are no orphans and no second copies. Terminal containers are
removed only after the service has accepted their final report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import docker.errors

from agent.runner import (
    ContainerView,
    DeploymentError,
    DockerRunner,
    GpuMode,
    choose_gpu_mode,
    container_options,
    event_container_ids,
    finished_status,
    pull_reference,
)
from agent.service_client import Backoff, ServiceClient, ServiceError, UnknownServer
from placement.inventory import Server
from placement.protocol import AgentDeployment, DeploymentStatus

log = logging.getLogger(__name__)
T = TypeVar("T")

# () -> (the server as discovered now, why it has no GPUs or None); blocking, run in a thread.
Discovery = Callable[[], tuple[Server, str | None]]


@dataclass(frozen=True)
class AgentSettings:
    name: str
    poll_timeout: float = 30.0
    heartbeat: float | None = None  # None: use the interval the service asks for
    gpu_mode: GpuMode = "auto"
    retry_max: float = 10.0  # longest back-off between attempts to reach the service
    shutdown_grace: float = 20.0  # how long in-flight deployment work may finish on shutdown
    stop_timeout: int = 10  # seconds between SIGTERM and SIGKILL when a deployment is stopped


class Agent:
    def __init__(
        self, settings: AgentSettings, client: ServiceClient, runner: DockerRunner, discover: Discovery
    ) -> None:
        self.settings = settings
        self.client = client
        self.runner = runner
        self.discover = discover
        self.server: Server | None = None
        self.heartbeat_seconds = settings.heartbeat or 15.0
        self._stop = asyncio.Event()
        self._locks: dict[str, asyncio.Lock] = {}
        self._stopping: set[str] = set()
        self._in_flight: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._last_reason: str | None = None
        self._registered = asyncio.Event()

    # ---- lifecycle -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Run until `stop` is set. Containers keep running after the agent exits."""
        self._stop = stop
        await self._refresh_inventory()
        if not await self._register_until_done():
            return
        events_task = asyncio.create_task(self._watch_docker_events())
        await self._adopt_existing_containers()
        loops = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._poll_loop())]
        await stop.wait()
        for task in [*loops, events_task]:
            task.cancel()
        await asyncio.gather(*loops, events_task, return_exceptions=True)
        await self._finish_in_flight()

    async def _finish_in_flight(self) -> None:
        """Let started pulls, starts, stops and reports finish (bounded), so the service hears of them."""
        if self._tasks:
            _done, pending = await asyncio.wait(set(self._tasks), timeout=self.settings.shutdown_grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("agent task failed: %r", task.exception())

    async def _sleep(self, seconds: float) -> None:
        """Sleep, but wake at once on shutdown."""
        with contextlib.suppress(TimeoutError):  # not wait_for: on 3.11 it may drop a cancel
            async with asyncio.timeout(seconds):
                await self._stop.wait()

    async def _retrying(self, what: str, call: Callable[[], Awaitable[T]]) -> T | None:
        """Call the service until it answers (bounded, jittered back-off; a Retry-After honoured).
        Tries at least once; None when shutdown came before an answer."""
        backoff = Backoff(most=self.settings.retry_max)
        while True:
            try:
                return await call()
            except UnknownServer:
                raise
            except ServiceError as exc:
                if self._stop.is_set():
                    log.warning("%s failed during shutdown: %s", what, exc)
                    return None
                delay = backoff.next(exc.retry_after)
                log.warning("%s failed, retrying in %.1fs: %s", what, delay, exc)
                await self._sleep(delay)

    # ---- inventory -------------------------------------------------------------------------

    async def _refresh_inventory(self) -> bool:
        """Rediscover this host; True when the GPUs differ from what was registered."""
        server, reason = await asyncio.to_thread(self.discover)
        if reason and reason != self._last_reason:
            log.warning("registering %s as a CPU server: %s", server.name, reason)
        self._last_reason = reason
        changed = self.server is None or [g.model_dump() for g in server.gpus] != [
            g.model_dump() for g in self.server.gpus
        ]
        if changed and self.server is not None:
            log.info("GPUs changed on %s: now %d GPU(s)", server.name, len(server.gpus))
        self.server = server
        return changed

    async def _register_until_done(self) -> bool:
        assert self.server is not None
        server = self.server
        response = await self._retrying("register", lambda: self.client.register(server))
        if response is None:
            return False
        if self.settings.heartbeat is None:
            self.heartbeat_seconds = response.heartbeat_seconds
        log.info("registered %s with %d GPU(s)", server.name, len(server.gpus))
        self._registered.set()
        return True

    async def _heartbeat_loop(self) -> None:
        """A heartbeat at most every `heartbeat_seconds`, at a random phase (agents started or
        restarted together do not beat in step) and a little early each time, never late."""
        first = True
        while not self._stop.is_set():
            share = random.uniform(0.5, 1.0) if first else random.uniform(0.9, 1.0)
            first = False
            await self._sleep(self.heartbeat_seconds * share)
            if self._stop.is_set():
                return
            try:
                if await self._refresh_inventory():
                    await self._register_until_done()
                else:
                    await self.client.heartbeat(self.settings.name)
            except UnknownServer:
                log.info("service forgot %s; registering again", self.settings.name)
                await self._register_until_done()
            except ServiceError as exc:
                log.warning("heartbeat failed: %s", exc)

    # ---- deployments -----------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        backoff = Backoff(most=self.settings.retry_max)
        while not self._stop.is_set():
            try:
                deployments = await self.client.poll_deployments(
                    self.settings.name, self.settings.poll_timeout
                )
                backoff.reset()
            except UnknownServer:
                await self._register_until_done()
                continue
            except ServiceError as exc:
                delay = backoff.next(exc.retry_after)
                log.warning("polling for deployments failed, retrying in %.1fs: %s", delay, exc)
                await self._sleep(delay)
                continue
            for deployment in deployments:
                if deployment.id not in self._in_flight:
                    self._in_flight.add(deployment.id)
                    self._spawn(self._act(deployment))

    def _lock(self, deployment_id: str) -> asyncio.Lock:
        return self._locks.setdefault(deployment_id, asyncio.Lock())

    async def _report(self, deployment_id: str, status: DeploymentStatus) -> bool:
        async def send() -> bool:
            await self.client.report(deployment_id, status)
            return True

        try:
            sent = await self._retrying(f"report {status.state} for {deployment_id}", send)
        except UnknownServer:
            log.warning("service does not know deployment %s; report %s dropped", deployment_id, status.state)
            return True
        return sent is True

    async def _act(self, deployment: AgentDeployment) -> None:
        try:
            async with self._lock(deployment.id):
                if deployment.desired == "stop":
                    await self._stop_deployment(deployment)
                else:
                    await self._start_deployment(deployment)
        finally:
            self._in_flight.discard(deployment.id)

    async def _own_container(self, deployment_id: str) -> ContainerView | None:
        views = await asyncio.to_thread(self.runner.list_own)
        return next((view for view in views if view.deployment_id == deployment_id), None)

    async def _start_deployment(self, deployment: AgentDeployment) -> None:
        existing = await self._own_container(deployment.id)
        if existing is not None:
            if existing.finished:
                await self._report_finished(existing, "exited")
            elif deployment.state != "running":
                await self._report(deployment.id, DeploymentStatus(state="running", container_id=existing.id))
            return
        assert self.server is not None
        try:
            gpu_mode = (
                choose_gpu_mode(self.server.runtime_modes, self.settings.gpu_mode)
                if deployment.gpu_required
                else None
            )
            info = await asyncio.to_thread(self.runner.info)
            options = container_options(
                deployment, self.settings.name, gpu_mode, str(info.get("DefaultRuntime") or "runc")
            )
        except DeploymentError as exc:
            await self._report(deployment.id, DeploymentStatus(state="failed", reason=str(exc)))
            return
        await self._report(deployment.id, DeploymentStatus(state="pulling"))
        reference = pull_reference(deployment.image, deployment.digest)
        try:
            await asyncio.to_thread(self.runner.pull, reference)
        except docker.errors.DockerException as exc:
            await self._report(
                deployment.id, DeploymentStatus(state="failed", reason=f"pull {reference} failed: {exc}")
            )
            return
        try:
            container_id = await asyncio.to_thread(self.runner.create_and_start, options)
        except docker.errors.DockerException as exc:
            await self._fail_start(deployment.id, options["name"], exc)
            return
        log.info("deployment %s running in container %s", deployment.id, container_id[:12])
        await self._report(deployment.id, DeploymentStatus(state="running", container_id=container_id))

    async def _fail_start(self, deployment_id: str, name: str, exc: Exception) -> None:
        logs = await asyncio.to_thread(self.runner.logs, name)
        await asyncio.to_thread(self.runner.remove, name)
        await self._report(
            deployment_id,
            DeploymentStatus(state="failed", reason=f"container did not start: {exc}", logs=logs or None),
        )

    async def _stop_deployment(self, deployment: AgentDeployment) -> None:
        self._stopping.add(deployment.id)
        try:
            existing = await self._own_container(deployment.id)
            if existing is None:
                await self._report(
                    deployment.id, DeploymentStatus(state="stopped", reason="no container was running")
                )
                return
            view = (
                existing
                if existing.finished
                else await asyncio.to_thread(self.runner.stop, existing.id, self.settings.stop_timeout)
            )
            await self._report_finished(view, "stopped")
        finally:
            self._stopping.discard(deployment.id)

    async def _report_finished(self, view: ContainerView, state: Literal["exited", "stopped"]) -> None:
        """Report a finished container; remove it once the service has the report."""
        logs = await asyncio.to_thread(self.runner.logs, view.id)
        status = finished_status(view, logs or None, state)
        if await self._report(view.deployment_id, status):
            await asyncio.to_thread(self.runner.remove, view.id)
            log.info("deployment %s %s: %s", view.deployment_id, state, status.reason)

    async def _container_died(self, container_id: str) -> None:
        try:
            view = await asyncio.to_thread(self.runner.inspect, container_id)
        except docker.errors.NotFound:
            return  # already reported and removed
        if not view.deployment_id or view.deployment_id in self._stopping:
            return
        async with self._lock(view.deployment_id):
            if view.deployment_id in self._stopping:
                return
            try:
                view = await asyncio.to_thread(self.runner.inspect, container_id)
            except docker.errors.NotFound:
                return
            if view.finished:
                await self._report_finished(view, "exited")

    # ---- Docker side -----------------------------------------------------------------------

    async def _adopt_existing_containers(self) -> None:
        """After a (re)start: carry on with this server's containers, found by label."""
        for view in await asyncio.to_thread(self.runner.list_own):
            if view.finished:
                self._spawn(self._container_died(view.id))
            else:
                log.info("found container %s for deployment %s", view.id[:12], view.deployment_id)
                self._spawn(self._resume(view))

    async def _resume(self, view: ContainerView) -> None:
        """A container from before the restart: start it if the agent died between create and
        start, then tell the service it runs (with its container id)."""
        async with self._lock(view.deployment_id):
            if view.status == "created":
                try:
                    await asyncio.to_thread(self.runner.start, view.id)
                except docker.errors.DockerException as exc:
                    await self._fail_start(view.deployment_id, view.id, exc)
                    return
            await self._report(view.deployment_id, DeploymentStatus(state="running", container_id=view.id))

    async def _watch_docker_events(self) -> None:
        """Feed Docker `die` events into the loop; resubscribe (and rescan) if the stream breaks."""
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            try:
                stream = await asyncio.to_thread(self.runner.die_events)
            except docker.errors.DockerException as exc:
                log.warning("cannot watch Docker events: %s", exc)
                await self._sleep(2.0)
                continue
            ended = asyncio.Event()

            def read(events: Any = stream, done: asyncio.Event = ended) -> None:
                try:
                    for container_id in event_container_ids(events):
                        loop.call_soon_threadsafe(self._spawn, self._container_died(container_id))
                except Exception:  # the stream was closed or broke; the loop decides what next
                    pass
                finally:
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(done.set)

            threading.Thread(target=read, name="docker-events", daemon=True).start()
            try:
                await ended.wait()
            finally:
                with contextlib.suppress(Exception):
                    stream.close()
            if not self._stop.is_set():
                log.warning("Docker event stream ended; resubscribing")
                await self._sleep(1.0)
                for view in await asyncio.to_thread(self.runner.list_own):
                    if view.finished:
                        self._spawn(self._container_died(view.id))
