"""The aiohttp application: composition only; only entry points import this module
(`gpubadge serve` in web/commands.py; tests and benches build applications with it too).

`create_app` wires the store and the job runtime (`jobs.runtime.ScanRuntime`: the registry
client, the scanner, the attacher and the leased scan workers) into an `aiohttp.web.Application`,
puts the live fleet on it (web/fleet/live_fleet.py), and lets each module of `ROUTE_MODULES` add its routes. `openapi_document` is the API
description those modules declare. Shutdown (SIGTERM) stops claiming and drains running
scans; what cannot finish goes back to the queue.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from jobs.runtime import ScanRuntime
from jobs.settings import open_job_store
from web import health
from web.api_description import openapi_document as describe_api
from web.errors import error_middleware
from web.fleet import live_fleet
from web.fleet.live_fleet import STATIC_FLEET
from web.fleet.long_polls import PUBLIC_WAITS
from web.guards.connections import public_waits, reserve_middleware, service_reserved
from web.guards.read_access import private_reads
from web.metrics import ServiceMetrics
from web.routes import (
    admission,
    agents,
    deployments,
    eligibility,
    export,
    fleet_pages,
    images,
    openapi,
    pages,
    scans,
    webhooks,
)
from web.settings import ServiceSettings
from web.state import SERVICES, Services

log = logging.getLogger(__name__)

# Each adds its routes in turn; those declared with `ApiRoutes` are described in /api/openapi.json.
ROUTE_MODULES = (
    webhooks,
    images,
    scans,
    health,
    openapi,
    agents,
    eligibility,
    deployments,
    pages,
    fleet_pages,
    admission,
    export,
)


def openapi_document() -> dict[str, Any]:
    """The document `/api/openapi.json` serves, derived from the route modules' declarations
    without building an application (for tests and tools)."""
    declared = [getattr(module, "ROUTES", None) for module in ROUTE_MODULES]
    return describe_api(
        operation for routes in declared if routes is not None for operation in routes.operations
    )


def create_app(settings: ServiceSettings, *, start_workers: bool = True) -> web.Application:
    settings.check_consistent()
    # Scans in other processes (`serve --workers 0` beside `gpubadge worker`s, or this service's own
    # worker processes): on SQLite, each process's commits must wake the others.
    store = open_job_store(settings, shared=settings.workers == 0 or settings.worker_process_count() > 0)
    services = Services(settings=settings, store=store, metrics=ServiceMetrics())
    services.metrics.intake_unmoved_source = store.intake_unmoved
    # the reserve first: a request it refuses costs nothing more
    middlewares: list[Middleware] = [reserve_middleware(service_reserved(settings)), error_middleware]
    if not settings.public_reads:
        middlewares.append(private_reads(settings))
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=middlewares)
    app[SERVICES] = services
    app[PUBLIC_WAITS] = public_waits(settings)
    live_fleet.install(app)
    for routes in ROUTE_MODULES:
        routes.setup_routes(app)
    app.cleanup_ctx.append(_lifecycle(services, start_workers))
    app.cleanup_ctx.append(admission.tls_listener(services))
    app.on_shutdown.append(_end_waits)
    _log_webhook_doors(settings)
    if settings.api_token is None:
        log.warning(
            "GPUBADGE_API_TOKEN is unset: anyone who reaches the service may request scans and deploys"
        )
    if settings.agent_token is None and not settings.agent_tokens:
        if settings.allow_agents_without_token:
            log.warning(
                "GPUBADGE_AGENT_TOKEN is unset and GPUBADGE_ALLOW_AGENTS_WITHOUT_TOKEN is true: any client may"
                " register servers and move their GPUs"
            )
        else:
            log.warning(
                "GPUBADGE_AGENT_TOKEN is unset: agents are refused until it (or agent_tokens) is set"
                " (GPUBADGE_ALLOW_AGENTS_WITHOUT_TOKEN=true accepts them without one)"
            )
    if not settings.registries:
        log.warning("GPUBADGE_REGISTRIES is unset: only Docker Hub and loopback registries will be contacted")
    return app


def _log_webhook_doors(settings: ServiceSettings) -> None:
    """Say at start-up which webhook sources are open, which need a secret, and which are refused
    (every sender of `hooks.SENDERS`, ACR included: it is refused whenever it has no secret)."""
    refused = ", ".join(settings.refused_webhook_sources()) or "none"
    if settings.open_webhook_sources():
        log.warning(
            "GPUBADGE_WEBHOOK_SECRET is unset: webhooks are accepted without authentication"
            " (open sources: %s; refused, as they are never open without a secret: %s)",
            ", ".join(settings.open_webhook_sources()),
            refused,
        )
    elif settings.webhook_secret is None:
        log.info(
            "webhook sources open: none; accepted with their own secret: %s; refused (no secret"
            " configured, set GPUBADGE_WEBHOOK_SECRET or webhook_secrets): %s",
            ", ".join(sorted(settings.webhook_secrets)),
            refused,
        )
    else:
        log.info("webhook sources open: none; every source needs its secret")


async def _end_waits(app: web.Application) -> None:
    """Shutdown: held `?wait=` long polls (`by-ref`, a scan's status) answer now with what holds,
    so that SIGTERM is not held back by a caller's wait of up to a minute."""
    app[SERVICES].store.events.end_waits()


def _lifecycle(services: Services, start_workers: bool) -> Callable[[web.Application], AsyncIterator[None]]:
    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        settings, static_fleet = services.settings, app[STATIC_FLEET]
        try:
            await services.store.start_events()  # ?wait= hears of jobs finished by any worker process
            await services.store.start_intake()  # with a journal: what a previous run journaled moves now
            runtime = await ScanRuntime.start(
                settings,
                services.store,
                services.metrics,
                static_fleet=static_fleet,
                run_workers=start_workers and settings.workers > 0,  # `serve --workers 0`: the API only
                worker_processes=settings.worker_process_count(),
            )
        except BaseException:  # `serve` says why in one line; what opened meanwhile closes first
            await services.intake.close()
            await services.store.close()
            raise
        services.client, services.scanner = runtime.client, runtime.scanner
        services.attacher, services.workers = runtime.attacher, runtime.workers
        services.worker_processes = runtime.processes
        try:
            yield
        finally:
            await runtime.stop()
            await services.intake.close()
            await services.store.close()

    return lifecycle
