"""The aiohttp application: one process that takes webhooks, scans, stores and answers.

`create_app` wires the store, the registry client, the scanner and the durable
workers into an `aiohttp.web.Application`; routes live in web/api.py (JSON and
webhooks) and web/ui.py (HTML). Startup resumes unfinished jobs; shutdown
(SIGTERM) stops claiming and drains running scans.
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from scanner.models import ImageReport
from scanner.queue import JobOutcome, ScanWorkers, WorkerSettings
from scanner.referrers import ReportAttacher
from scanner.registry import RegistryClient
from scanner.scan import Scanner
from scanner.store import Store
from web.intake import JobIntake
from web.metrics import ServiceMetrics
from web.settings import ServiceSettings

log = logging.getLogger(__name__)


@dataclass
class Services:
    """What request handlers need, built once per application."""

    settings: ServiceSettings
    store: Store
    metrics: ServiceMetrics
    client: RegistryClient | None = None
    scanner: Scanner | None = None
    workers: ScanWorkers | None = None
    attacher: ReportAttacher | None = None  # GPUBADGE_ATTACH_REPORTS
    intake: JobIntake = field(init=False)

    def __post_init__(self) -> None:
        self.intake = JobIntake(self.store)

    def wake_workers(self) -> None:
        if self.workers is not None:
            self.workers.wake()


SERVICES = web.AppKey("services", Services)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_error(status: int, message: str, **extra: object) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


def json_http_error(
    kind: type[web.HTTPException], message: str, headers: dict[str, str] | None = None
) -> web.HTTPException:
    """An HTTP error to raise from deep in a handler, with the same `{"error": ...}` body as json_error."""
    return kind(text=json.dumps({"error": message}), content_type="application/json", headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes a JSON (or plain) error; the service stays up."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if (
            exc.status >= 400
            and exc.content_type != "application/json"
            and request.path.startswith(("/api", "/hooks", "/k8s"))
        ):
            return json_error(
                exc.status, exc.reason if exc.text is None else exc.text.removeprefix(f"{exc.status}: ")
            )
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_error(500, "internal error; see the service log")


def create_app(settings: ServiceSettings, *, start_workers: bool = True) -> web.Application:
    store = Store(settings.db, synchronous=settings.sqlite_synchronous)
    metrics = ServiceMetrics(store.queue_depth)
    services = Services(settings=settings, store=store, metrics=metrics)
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[error_middleware])
    app[SERVICES] = services

    from web import admission, api, fleet, ui, ui_fleet

    api.setup_routes(app)
    app.add_routes(admission.routes(services))
    fleet.setup_routes(app)
    ui.setup_routes(app)
    ui_fleet.setup_routes(app)
    app.cleanup_ctx.append(_lifecycle(services, start_workers))
    app.cleanup_ctx.append(admission.tls_listener(services))
    if settings.webhook_secret is None and not settings.webhook_secrets:
        log.warning("GPUBADGE_WEBHOOK_SECRET is unset: webhooks are accepted without authentication")
    if settings.api_token is None:
        log.warning(
            "GPUBADGE_API_TOKEN is unset: anyone who reaches the service may request scans and deploys"
        )
    if settings.agent_token is None and not settings.agent_tokens:
        log.warning("GPUBADGE_AGENT_TOKEN is unset: any client may register servers")
    if not settings.registries:
        log.warning("GPUBADGE_REGISTRIES is unset: only Docker Hub and loopback registries will be contacted")
    return app


def _lifecycle(services: Services, start_workers: bool) -> Callable[[web.Application], AsyncIterator[None]]:
    async def lifecycle(_: web.Application) -> AsyncIterator[None]:
        settings, metrics = services.settings, services.metrics
        client = RegistryClient(settings)
        services.client = client

        def on_result(report: ImageReport) -> None:
            for host, remaining in client.rate_limits.items():
                metrics.rate_limit.set(float(remaining), host)

        services.scanner = Scanner(client, services.store, settings, on_result=on_result)
        if settings.attach_reports:
            services.attacher = ReportAttacher(
                settings, client, on_result=lambda result: metrics.referrer_attach.inc(result)
            )
        attacher = services.attacher
        if start_workers:
            services.workers = ScanWorkers(
                services.store,
                services.scanner,
                WorkerSettings(
                    concurrency=settings.workers,
                    per_registry=settings.per_registry_scans,
                    backoff_base=settings.retry_backoff,
                ),
                on_outcome=lambda outcome: _on_outcome(metrics, attacher, outcome),
            )
            await services.workers.start()
        # Modules, schemas and settings live as long as the process: moving them out of the
        # collector's reach keeps full GC passes short, and with them the 202 tail latency.
        gc.freeze()
        try:
            yield
        finally:
            if services.workers is not None:
                await services.workers.stop(drain_timeout=settings.drain_seconds)
            if services.attacher is not None:
                await services.attacher.stop()
            await client.close()
            services.store.close()

    return lifecycle


def _on_outcome(metrics: ServiceMetrics, attacher: ReportAttacher | None, outcome: JobOutcome) -> None:
    _count_outcome(metrics, outcome)
    if attacher is not None:
        attacher.submit(outcome.report)  # background, own retries; never fails the scan


def _count_outcome(metrics: ServiceMetrics, outcome: JobOutcome) -> None:
    report = outcome.report
    result = "cached" if report.cached else ("ok" if report.error is None else "error")
    metrics.scans.inc(result)
    metrics.scan_seconds.observe(outcome.seconds)
    if report.error and report.registry:
        metrics.registry_errors.inc(report.registry)
