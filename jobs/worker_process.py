"""`gpubadge worker`: scan workers with no HTTP side, for scaling scans apart from the API.

The same `ScanRuntime` as `gpubadge serve` runs in-process, on the same settings, but in a
process of its own: any number of them share one PostgreSQL (claims skip each other's rows,
leases bring a dead worker's jobs back, NOTIFY wakes them) or one SQLite file (its datagram
events). SIGTERM or SIGINT drains: no new claims, running scans get `drain_seconds`, the rest go
back to the queue at once.

This module imports nothing of web/: a caller that wants /healthz and /metrics on a port (the
command's `--metrics-port`) hands in a `Listener`, started once the workers run and stopped
after they drained.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from jobs.metrics import JobMetrics
from jobs.runtime import ScanRuntime
from jobs.settings import JobSettings, open_job_store
from placement.inventory import parse_inventory
from store import AsyncStore

log = logging.getLogger(__name__)

Stop = Callable[[], Awaitable[None]]
Listener = Callable[[AsyncStore, ScanRuntime], Awaitable[Stop]]
"""Starts serving what the process's store and runtime show (a health port); returns its stop."""


async def run_workers(
    settings: JobSettings,
    stop: asyncio.Event,
    *,
    metrics: JobMetrics | None = None,
    listener: Listener | None = None,
) -> None:
    """Run until `stop` is set, then drain. `metrics` counts what the workers do (the scan
    counters live in this process, not in the API replicas); `listener` serves them."""
    store = open_job_store(settings, shared=True)  # wakes and is woken by the API processes
    metrics = metrics if metrics is not None else JobMetrics()
    try:
        static = (
            parse_inventory(settings.inventory_file.read_text()).servers if settings.inventory_file else []
        )
        runtime = await ScanRuntime.start(settings, store, metrics, static_fleet=static)
        stop_listener: Stop | None = None
        try:
            if listener is not None:
                stop_listener = await listener(store, runtime)
            owner = runtime.workers.owner if runtime.workers is not None else "-"
            log.info("scan worker %s: %d at once", owner, settings.workers)
            await stop.wait()
        finally:
            await runtime.stop()
            if stop_listener is not None:
                await stop_listener()
    finally:
        await store.close()


def serve_workers(
    settings: JobSettings, *, metrics: JobMetrics | None = None, listener: Listener | None = None
) -> None:
    """The process's main: run the workers, stop cleanly on SIGTERM or SIGINT."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await run_workers(settings, stop, metrics=metrics, listener=listener)

    asyncio.run(main())
