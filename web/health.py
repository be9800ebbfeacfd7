"""Honest health and metrics: /healthz says 503 with the reason when the service cannot do its job.

It answers within the health timeout whatever the database does: the write check runs on
its own thread with a deadline, and the queue reads get a deadline of their own. A queue
whose ready jobs have waited longer than `stall_seconds` while no worker anywhere made
progress is a failure too, since webhooks would still get their 202 and nothing would scan;
on an API-only replica it is reported without failing, since that replica still does its job.
/healthz is open to anyone, so what it says of a failure names no place: the database file's path,
PostgreSQL's host and the workers' host and process id are for a holder of the API token (and the
log) only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from aiohttp import web

from store import QueueHealth, StoreUnavailable, queries
from web.api_description import (
    OBJECT,
    ApiRoutes,
    json_reply,
)
from web.security import holds_api_token
from web.state import Services, services_of

log = logging.getLogger(__name__)

ROUTES = ApiRoutes()
SYNC_SECONDS = 1.0  # longest /metrics waits for the worker processes' last counts


async def _queue_state(services: Services) -> tuple[dict[str, int], QueueHealth]:
    depth, queue = await asyncio.gather(
        services.store.run(queries.queue_depth), services.store.queue_health()
    )
    return depth, queue


def _workers(services: Services, operator: bool) -> str | list[str]:
    """Who scans for this service: this process's workers, its worker processes (running now), or
    none; their lease owners (host/pid) only to a request holding the API token."""
    if services.workers is not None:
        return services.workers.owner if operator else "running in this process"
    if services.worker_processes is not None:
        if operator:
            return services.worker_processes.owners()
        running = services.worker_processes.running()
        return f"running in {running} worker process{'' if running == 1 else 'es'}"
    return "none in this process"


def stall_reason(queue: QueueHealth, stall_seconds: float) -> str | None:
    """Why the queue looks stuck, or None: ready jobs wait too long and nobody makes progress."""
    if not queue.ready or queue.oldest_ready_seconds is None or queue.oldest_ready_seconds <= stall_seconds:
        return None
    if queue.last_progress_seconds is not None and queue.last_progress_seconds <= stall_seconds:
        return None  # a backlog, but workers are getting through it
    since = "ever" if queue.last_progress_seconds is None else f"{queue.last_progress_seconds:.0f} s"
    return (
        f"no worker has made progress for {since} while {queue.ready} ready job(s) wait, the oldest for "
        f"{queue.oldest_ready_seconds:.0f} s (limit {stall_seconds:.0f} s, GPUBADGE_STALL_SECONDS)"
    )


@ROUTES.get(
    "/healthz",
    "Liveness: the status and its reasons; file paths, host names and the worker's identity only for a"
    " holder of the API token",
    responses={"200": json_reply(OBJECT, "ok"), "503": json_reply(OBJECT, "unavailable, with the reasons")},
)
async def healthz(request: web.Request) -> web.Response:
    """The service's health. Anyone (a load balancer, kubelet) gets the status, the reasons in words
    and the queue's figures; the reasons say what failed, never where (no database path, PostgreSQL
    host, host name or process id). A holder of GPUBADGE_API_TOKEN also gets the reasons as the log
    has them and the workers' identity (`host/pid/nonce`). A change of reasons is logged once."""
    services = services_of(request)
    settings = services.settings
    reasons: list[tuple[str, str]] = []  # (for anyone, for operators)
    body: dict[str, Any] = {}
    write_check = asyncio.ensure_future(services.store.health(settings.health_timeout))
    try:
        depth, queue = await asyncio.wait_for(_queue_state(services), settings.health_timeout)
    except TimeoutError:
        slow = f"the database did not answer queue reads within {settings.health_timeout:.1f} s"
        reasons.append((slow, slow))
    except StoreUnavailable as exc:
        reasons.append((f"the database cannot be read: {exc.public}", f"the database cannot be read: {exc}"))
    except Exception as exc:
        reasons.append(("the database cannot be read", f"the database cannot be read: {exc}"))
    else:
        body["queue"] = depth
        body["ready"] = queue.ready
        body["oldest_ready_seconds"] = queue.oldest_ready_seconds
        body["last_progress_seconds"] = queue.last_progress_seconds
        stalled = stall_reason(queue, settings.stall_seconds)
        if stalled and not services.runs_scans:
            # An API-only replica (`serve --workers 0`) can still take webhooks and answer: the
            # stall is the workers' failure, reported here (and in /metrics) but not failing the
            # readiness that keeps this replica behind the load balancer.
            body["stalled"] = stalled
        elif stalled:
            reasons.append((stalled, stalled))
    written = await write_check
    if written is not None:
        reasons.insert(0, (written.public, str(written)))
    request.app[_HEALTH_LOG].saw([detail for _, detail in reasons])
    operator = holds_api_token(request, settings.api_token)
    body["workers"] = _workers(services, operator)
    if reasons:
        shown = [detail if operator else public for public, detail in reasons]
        return web.json_response({"status": "unavailable", "reasons": shown, **body}, status=503)
    return web.json_response({"status": "ok", **body})


class _HealthLog:
    """Logs /healthz's reasons (with paths and hosts: the log is the operators') when they change."""

    def __init__(self) -> None:
        self._last: list[str] = []

    def saw(self, reasons: list[str]) -> None:
        if reasons == self._last:
            return
        if reasons:
            log.warning("/healthz: unavailable: %s", "; ".join(reasons))
        elif self._last:
            log.info("/healthz: healthy again")
        self._last = reasons


_HEALTH_LOG = web.AppKey("health_log", _HealthLog)


@ROUTES.get(
    "/metrics",
    "Prometheus metrics",
    responses={
        "200": {"description": "text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
        "401": {"description": "API token required (reads are private)"},
    },
)
async def metrics(request: web.Request) -> web.Response:
    services = services_of(request)
    registry = services.metrics
    with contextlib.suppress(Exception):  # a slow or failing database leaves the last values shown
        depth, queue = await asyncio.wait_for(_queue_state(services), services.settings.health_timeout)
        for state, count in depth.items():
            registry.queue.set(float(count), state)
        registry.oldest_queued.set(queue.oldest_ready_seconds or 0.0)
    with contextlib.suppress(Exception):
        store = services.store
        loads = await asyncio.wait_for(store.registry_load(), services.settings.health_timeout)
        registry.set_registry_load(loads)
    if services.worker_processes is not None:  # what each worker process counted before this request
        await services.worker_processes.sync(SYNC_SECONDS)
    # In a thread: the process collector reads /proc (its fd count lists every open descriptor,
    # 4 ms at 10,000 long polls), file I/O that must not hold the loop's heartbeats and polls.
    text = await asyncio.to_thread(registry.render)
    return web.Response(text=text, content_type="text/plain", charset="utf-8", headers={"X-Format": "0.0.4"})


def setup_routes(app: web.Application) -> None:
    app[_HEALTH_LOG] = _HealthLog()
    ROUTES.setup(app)
