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

from scanner.registry import RegistryClient
from scanner.scan import Scanner
from store import open_store
from web.settings import ServiceSettings
from web.workers import JobOutcome, ScanWorkers, WorkerEvents, WorkerSettings

log = logging.getLogger(__name__)


def worker_settings(settings: ServiceSettings) -> WorkerSettings:
    """The one mapping from service settings to worker settings (serve and worker share it)."""
    return WorkerSettings(
        concurrency=settings.workers,
        per_registry=settings.per_registry_scans,
        backoff_base=settings.retry_backoff,
        lease_seconds=settings.lease_seconds,
    )


def _log_outcome(outcome: JobOutcome) -> None:
    report = outcome.report
    if report.error is None:
        log.info("scanned %s (%s) in %.2f s", outcome.job.reference, report.digest, outcome.seconds)


async def run_workers(settings: ServiceSettings, stop: asyncio.Event) -> None:
    """Run until `stop` is set, then drain."""
    store = open_store(
        settings.db,
        synchronous=settings.sqlite_synchronous,
        busy_timeout=settings.sqlite_busy_timeout,
        threads=settings.store_threads,
        database_url=settings.database_url.get_secret_value() if settings.database_url else None,
    )
    try:
        async with RegistryClient(settings) as client:
            scanner = Scanner(client, store, settings)
            workers = ScanWorkers(
                store, scanner, worker_settings(settings), WorkerEvents(on_outcome=_log_outcome)
            )
            await workers.start()
            log.info("scan worker %s: %d at once", workers.owner, settings.workers)
            try:
                await stop.wait()
            finally:
                await workers.stop(drain_timeout=settings.drain_seconds)
    finally:
        await store.close()


def serve_workers(settings: ServiceSettings) -> None:
    """The process's main: run the workers, stop cleanly on SIGTERM or SIGINT."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await run_workers(settings, stop)

    asyncio.run(main())
