"""`serve`'s scans in worker processes: started with the service, started again when one dies,
drained when it stops.

A scan is Python work (HTTP to the registry, JSON, the report's store writes) and the webhook
intake is too; in one process they share one interpreter lock and one process's CPU time, and a
registry waiting on each answer pays for every scan running beside the intake. So `serve` runs
its scans in `worker_processes` children (`gpubadge worker`, the image's worker role, as
`--supervised worker-N`), each with `workers` scans at once, below the API's CPU priority
(`worker_scheduling`: `worker_nice` steps nicer, or SCHED_IDLE): they share the store (and, on
SQLite, its events) as any `gpubadge worker` does.

Each child reads its settings from its stdin (`jobs.settings.settings_payload`: secrets in
clear, so they travel only over that pipe, never a file, the command line or the environment),
and keeps that pipe open: its end means `serve` is gone, and the child drains and exits. On
its stdout it reports what users must still see (`jobs.worker_reports`): its metrics, layer
progress and attachments reach this process's /metrics, image page and attacher. Its log lines
go to the same stream as `serve`'s, named `worker-N[pid]`.

A child that exits, or says nothing for HUNG_SECONDS (it reports every ALIVE_SECONDS), is logged,
counted (`gpubadge_worker_process_restarts_total`) and started again after a backoff that grows
while it keeps failing; its jobs' leases are released by the next child to start on this host
(`jobs.workers`: a dead local owner's jobs resume at once). Only the first child sweeps finished
jobs (`jobs.retention`), so N children do not take turns at the same deletes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from jobs.metrics import JobMetrics, LabelValues
from jobs.settings import JobSettings, settings_payload
from jobs.worker_reports import LINE_LIMIT, WorkerView
from scanner.publish import ReportAttacher

log = logging.getLogger(__name__)

# The image's worker role, as this interpreter runs it (the same code as `serve`).
WORKER_COMMAND = (sys.executable, "-m", "gpubadge.cli", "worker")
READY_SECONDS = 60.0  # a child not ready by then is killed and started again
HUNG_SECONDS = 30.0  # a child silent this long (it reports every jobs.worker_reports.ALIVE_SECONDS) is killed
STEADY_SECONDS = 60.0  # a child that ran this long before it died is restarted after the shortest backoff
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 30.0
STOP_GRACE = 10.0  # seconds past the drain before a child that has not exited is killed


@dataclass
class WorkerSlot:
    """One child's place: its number, its current process, and what it reported."""

    number: int
    view: WorkerView
    process: asyncio.subprocess.Process | None = None
    started: float = 0.0
    failures: int = 0
    task: asyncio.Task[None] | None = None
    retired: dict[str, dict[LabelValues, float]] = field(default_factory=dict)

    @property
    def role(self) -> str:
        return f"worker-{self.number}"


class WorkerProcesses:
    """`count` supervised worker processes over the service's settings, metrics and attacher."""

    def __init__(
        self,
        settings: JobSettings,
        metrics: JobMetrics,
        attacher: ReportAttacher | None,
        *,
        count: int,
        command: Sequence[str] = WORKER_COMMAND,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.command = tuple(command)
        self._payload = settings_payload(settings) + b"\n"
        self._stopping = False
        self._sync_number = 0
        self.slots = [WorkerSlot(number, WorkerView(metrics, attacher)) for number in range(1, count + 1)]
        for name in metrics.process_counts():
            counter = metrics.by_name[name]
            add_source = getattr(counter, "add_source", None)
            if add_source is not None:
                add_source(lambda name=name: self._counts(name))
        metrics.worker_processes.set(0.0)

    async def start(self) -> None:
        """Start every child and wait, at most READY_SECONDS, until each says it runs (one that does
        not is started again in the background; the service does not wait for it)."""
        for slot in self.slots:
            slot.task = asyncio.create_task(self._supervise(slot), name=f"supervise-{slot.role}")
        waits = [asyncio.create_task(slot.view.ready.wait()) for slot in self.slots]
        _, pending = await asyncio.wait(waits, timeout=READY_SECONDS)
        for wait in pending:
            wait.cancel()

    async def stop(self, drain_seconds: float) -> None:
        """SIGTERM every child (each stops claiming, drains its scans for `drain_seconds`, hands back
        the rest); one still running STOP_GRACE after that is killed."""
        self._stopping = True
        for slot in self.slots:
            if slot.process is not None and slot.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.process.send_signal(signal.SIGTERM)
        tasks = [slot.task for slot in self.slots if slot.task is not None]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=drain_seconds + STOP_GRACE)
        for slot in self.slots:
            if slot.process is not None and slot.process.returncode is None:
                log.warning("%s (pid %d) did not stop in time; killing it", slot.role, slot.process.pid)
                with contextlib.suppress(ProcessLookupError):
                    slot.process.kill()
        if pending:
            await asyncio.wait(pending, timeout=STOP_GRACE)

    async def sync(self, timeout: float) -> None:
        """Wait, at most `timeout`, until every running child has reported all it did before this call
        (`jobs.worker_reports`: `sync` / `synced`), so what this process shows counts it."""
        waits = []
        for slot in self.slots:
            process = slot.process
            if process is None or process.returncode is not None or process.stdin is None:
                continue
            if not slot.view.ready.is_set():
                continue
            self._sync_number += 1
            waiter = asyncio.get_running_loop().create_future()
            slot.view.syncs[self._sync_number] = waiter
            try:
                process.stdin.write(f"sync {self._sync_number}\n".encode())
            except (BrokenPipeError, ConnectionResetError, RuntimeError):
                slot.view.syncs.pop(self._sync_number, None)
                continue
            waits.append(waiter)
        if waits:
            await asyncio.wait(waits, timeout=timeout)

    def layer_progress(self) -> dict[str, str]:
        """Layer reads in flight in every child, by reference (`Scanner.layer_progress`'s form)."""
        found: dict[str, str] = {}
        for slot in self.slots:
            found.update(slot.view.progress)
        return found

    def owners(self) -> list[str]:
        """The lease owners of the children running now."""
        return [slot.view.owner for slot in self.slots if slot.view.owner and slot.process is not None]

    def running(self) -> int:
        return sum(1 for slot in self.slots if slot.process is not None and slot.process.returncode is None)

    def _counts(self, name: str) -> dict[LabelValues, float]:
        """A child-kept count (`JobMetrics.process_counts`) over every child, those that died included."""
        totals: dict[LabelValues, float] = {}
        for slot in self.slots:
            for part in (slot.retired.get(name, {}), slot.view.counts.get(name, {})):
                for key, value in part.items():
                    totals[key] = totals.get(key, 0.0) + value
        return totals

    async def _supervise(self, slot: WorkerSlot) -> None:
        while not self._stopping:
            slot.started = time.monotonic()
            try:
                await self._run(slot)
            except Exception:
                log.exception("%s could not be run", slot.role)
            for name, values in slot.view.counts.items():  # what it counted stays counted
                retired = slot.retired.setdefault(name, {})
                for key, value in values.items():
                    retired[key] = retired.get(key, 0.0) + value
            slot.view.counts, slot.view.progress, slot.view.owner = {}, {}, None
            slot.view.ready.clear()
            self.metrics.worker_processes.set(float(self.running()))
            if self._stopping:
                return
            lived = time.monotonic() - slot.started
            slot.failures = 1 if lived >= STEADY_SECONDS else slot.failures + 1
            pause = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (slot.failures - 1)) * random.uniform(0.8, 1.0)
            self.metrics.worker_process_restarts.inc()
            log.error("%s stopped after %.1f s; starting it again in %.1f s", slot.role, lived, pause)
            await asyncio.sleep(pause)

    async def _run(self, slot: WorkerSlot) -> None:
        """One life of the slot's child: start it, hand it its settings, read its reports until it
        exits (killing it when it stops reporting)."""
        arguments = ["--supervised", slot.role, "--log-level", logging.getLevelName(log.getEffectiveLevel())]
        if slot.number > 1:
            arguments.append("--no-sweep")
        process = await asyncio.create_subprocess_exec(
            *self.command,
            *arguments,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=LINE_LIMIT,
        )
        slot.process = process
        self.metrics.worker_processes.set(float(self.running()))
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(self._payload)  # and the pipe stays open: its end tells the child we are gone
            await process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass
        slot.view.heard_at = time.monotonic()
        watchdog = asyncio.create_task(self._watch(slot, process), name=f"watch-{slot.role}")
        try:
            while line := await process.stdout.readline():
                slot.view.apply(line)
        except (ValueError, asyncio.LimitOverrunError):
            log.error("%s sent a report line over %d bytes; stopping it", slot.role, LINE_LIMIT)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        finally:
            code = await process.wait()
            watchdog.cancel()
            for waiter in slot.view.syncs.values():  # a dead child answers nobody
                if not waiter.done():
                    waiter.set_result(None)
            slot.view.syncs.clear()
            if process.stdin is not None:
                process.stdin.close()
        if not self._stopping:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            log.error("%s (pid %d) %s", slot.role, process.pid, how)

    async def _watch(self, slot: WorkerSlot, process: asyncio.subprocess.Process) -> None:
        """Kill the child when it is not ready within READY_SECONDS or then falls silent for HUNG_SECONDS."""
        while process.returncode is None:
            await asyncio.sleep(1.0)
            silent = time.monotonic() - slot.view.heard_at
            limit = HUNG_SECONDS if slot.view.ready.is_set() else READY_SECONDS
            if silent > limit and not self._stopping:
                log.error(
                    "%s (pid %d) has said nothing for %.0f s; killing it", slot.role, process.pid, silent
                )
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                return
