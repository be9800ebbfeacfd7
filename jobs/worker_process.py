"""`gpubadge worker`: scan workers with no HTTP side, for scaling scans apart from the API.

The same `ScanRuntime` as `gpubadge serve` runs in-process, on the same settings, but in a
process of its own: any number of them share one PostgreSQL (claims skip each other's rows,
leases bring a dead worker's jobs back, NOTIFY wakes them) or one SQLite file (its datagram
events). SIGTERM or SIGINT drains: no new claims, running scans get `drain_seconds`, the rest go
back to the queue at once.

This module imports nothing of web/: a caller that wants /healthz and /metrics on a port (the
command's `--metrics-port`) hands in a `Listener`, started once the workers run and stopped
after they drained.

`serve_supervised` is the same process started by `serve` (`jobs.worker_processes`): its settings
come from its stdin, whose end means `serve` is gone (it then drains and exits, as on SIGTERM); its
stdout carries its reports to `serve` (`jobs.worker_reports`), and anything printed goes to its
log stream instead; it runs below `serve`'s CPU priority (`worker_scheduling`: `worker_nice` steps
nicer, or SCHED_IDLE).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable

from jobs.event_loop import new_event_loop
from jobs.metrics import JobMetrics
from jobs.runtime import ScanRuntime
from jobs.settings import JobSettings, open_job_store
from jobs.worker_reports import WorkerReporter
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
    sweep: bool = True,
) -> None:
    """Run until `stop` is set, then drain. `metrics` counts what the workers do (the scan
    counters live in this process, not in the API replicas); `listener` serves them. `sweep`:
    this process deletes finished jobs past retention (`jobs.retention`)."""
    store = open_job_store(settings, shared=True)  # wakes and is woken by the API processes
    metrics = metrics if metrics is not None else JobMetrics()
    try:
        static = (
            parse_inventory(settings.inventory_file.read_text()).servers if settings.inventory_file else []
        )
        runtime = await ScanRuntime.start(settings, store, metrics, static_fleet=static, sweep=sweep)
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

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main())


def yield_cpu_to_the_api(settings: JobSettings) -> None:
    """Lower this worker process's CPU priority below `serve`'s, as `worker_scheduling` says (its
    analysis processes inherit it): `worker_nice` steps of niceness, or SCHED_IDLE. Where SCHED_IDLE
    is refused (not Linux, a seccomp profile), niceness instead, and a warning says so."""
    if settings.worker_scheduling == "idle":
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
        except (AttributeError, OSError) as exc:
            log.warning(
                "GPUBADGE_WORKER_SCHEDULING=idle is not available here (%s); running %d steps nicer instead"
                " (GPUBADGE_WORKER_NICE)",
                exc,
                settings.worker_nice,
            )
    if settings.worker_nice:
        os.nice(settings.worker_nice)


def serve_supervised(sweep: bool) -> None:
    """The main of a worker process `serve` started: settings from stdin, reports on stdout."""
    channel = os.dup(1)
    os.dup2(2, 1)  # a stray print goes to the log stream, never into the reports
    settings = JobSettings.from_payload(sys.stdin.buffer.readline())
    yield_cpu_to_the_api(settings)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        transport, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(channel, "wb", buffering=0))
        reporter = WorkerReporter(transport)
        metrics = JobMetrics()
        commands = _Commands(stop)
        await loop.connect_read_pipe(lambda: commands, sys.stdin.buffer)

        async def listen(store: AsyncStore, runtime: ScanRuntime) -> Stop:
            owner = runtime.workers.owner if runtime.workers is not None else ""
            progress = runtime.scanner.layer_progress
            commands.on_sync = lambda number: reporter.synced(number, metrics, progress)
            task = asyncio.create_task(reporter.report(owner, metrics, runtime.attacher, progress))

            async def stop_reporting() -> None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

            return stop_reporting

        try:
            await run_workers(settings, stop, metrics=metrics, listener=listen, sweep=sweep)
        finally:
            reporter.flush()
            transport.close()

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main())


class _Commands(asyncio.Protocol):
    """This process's stdin after its settings: `sync <n>` lines from `serve` (answered by
    `on_sync`), and its end, which means `serve` is gone, so this worker stops too."""

    def __init__(self, stop: asyncio.Event) -> None:
        self._stop = stop
        self._pending = b""
        self.on_sync: Callable[[int], None] | None = None

    def data_received(self, data: bytes) -> None:
        *lines, self._pending = (self._pending + data).split(b"\n")
        for line in lines:
            command, _, number = line.partition(b" ")
            if command == b"sync" and number.isdigit() and self.on_sync is not None:
                self.on_sync(int(number))
        self._pending = self._pending[-64:]  # nothing longer is a command

    def eof_received(self) -> bool | None:
        self._stop.set()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop.set()
