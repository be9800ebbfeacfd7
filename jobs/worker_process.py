"""`gpubadge worker`: scan workers with no HTTP side, for scaling scans apart from the API.

The same ScanWorkers as `gpubadge serve` runs in-process, on the same settings, but
in a process of its own: any number of them share one PostgreSQL (claims skip each
other's rows, leases bring a dead worker's jobs back, NOTIFY wakes them). SIGTERM or
SIGINT drains: no new claims, running scans get `drain_seconds`, the rest go back
to the queue at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from jobs.architectures import FleetArchitectures
from jobs.companions import companions
from jobs.workers import JobOutcome, ScanWorkers, WorkerEvents, WorkerSettings
from placement.inventory import parse_inventory
from scanner.publish import ReportAttacher
from scanner.registry.client import RegistryClient
from scanner.scan import Scanner
from store import LeaseExpiry
from web import health
from web.guards.connections import GuardedRunner, connection_limits
from web.metrics import ServiceMetrics
from web.settings import ServiceSettings
from web.state import SERVICES, Services, open_service_store

log = logging.getLogger(__name__)


def worker_settings(settings: ServiceSettings) -> WorkerSettings:
    """The one mapping from service settings to worker settings (serve and worker share it)."""
    return WorkerSettings(
        concurrency=settings.workers,
        per_registry=settings.per_registry_scans,
        preempt_after=settings.preempt_after,
        backoff_base=settings.retry_backoff,
        lease_seconds=settings.lease_seconds,
    )


def worker_events(metrics: ServiceMetrics, attacher: ReportAttacher | None = None) -> WorkerEvents:
    """What workers do with an outcome, in `serve` and in `worker` alike: count it for /metrics,
    and hand the report to the attacher (GPUBADGE_ATTACH_REPORTS) to push as a referrer."""

    def on_outcome(outcome: JobOutcome) -> None:
        report = outcome.report
        result = "cached" if report.cached else ("ok" if report.error is None else "error")
        metrics.scans.inc(result)
        metrics.scan_seconds.observe(outcome.seconds)
        if report.error and report.registry:
            metrics.registry_errors.inc(report.registry)
        if attacher is not None:
            attacher.submit(report)  # in the background, with its own retries; never fails the scan

    def on_lease_expiries(expired: list[LeaseExpiry]) -> None:
        for item in expired:
            metrics.lease_expiries.inc(item.state)

    return WorkerEvents(
        on_outcome=on_outcome,
        on_restart=lambda: metrics.worker_restarts.inc(),
        on_lease_expiries=on_lease_expiries,
        on_preempt=lambda job: metrics.preemptions.inc(job.registry),
    )


async def run_workers(
    settings: ServiceSettings, stop: asyncio.Event, metrics_port: int | None = None
) -> None:
    """Run until `stop` is set, then drain. With `metrics_port`, serve /metrics and /healthz there
    (the scan counters live in this process, not in the API replicas)."""
    store = open_service_store(settings, shared=True)  # wakes and is woken by the API processes
    metrics = ServiceMetrics()
    try:
        async with RegistryClient(settings, defer_retry_after=True) as client:
            metrics.count_registry_bytes(client.received_by_registry)
            metrics.count_transfer_cutoffs(client.cutoffs_by_registry)
            static = (
                parse_inventory(settings.inventory_file.read_text()).servers
                if settings.inventory_file
                else []
            )
            scanner = Scanner(
                client,
                store.scan_cache,
                settings,
                publish_facts=True,
                fleet_architectures=FleetArchitectures(store, static),
            )
            attacher = (
                ReportAttacher(
                    settings,
                    client,
                    on_result=lambda result: metrics.referrer_attach.inc(result),
                    companions=companions(settings),
                    on_companion=lambda _, result: metrics.nfd_attach.inc(result),
                )
                if settings.attach_reports
                else None
            )
            workers = ScanWorkers(store, scanner, worker_settings(settings), worker_events(metrics, attacher))
            services = Services(
                settings=settings, store=store, metrics=metrics, client=client, scanner=scanner
            )
            services.workers = workers
            services.attacher = attacher
            runner = await _serve_health(services, metrics_port) if metrics_port else None
            await workers.start()
            log.info("scan worker %s: %d at once", workers.owner, settings.workers)
            try:
                await stop.wait()
            finally:
                await workers.stop(drain_timeout=settings.drain_seconds)
                await scanner.close()
                if attacher is not None:
                    await attacher.stop()
                if runner is not None:
                    await runner.cleanup()
    finally:
        await store.close()


async def _serve_health(services: Services, port: int) -> web.AppRunner:
    app = web.Application()
    app[SERVICES] = services
    health.setup_routes(app)
    runner = GuardedRunner(app, connection_limits(services.settings), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, services.settings.host, port).start()
    return runner


def serve_workers(settings: ServiceSettings, metrics_port: int | None = None) -> None:
    """The process's main: run the workers, stop cleanly on SIGTERM or SIGINT."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await run_workers(settings, stop, metrics_port)

    asyncio.run(main())
