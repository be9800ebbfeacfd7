"""What every handler shares: the settings, the store, metrics, and the scan machinery.

It lives apart from web/app.py so that route modules depend on this small module,
and app.py only composes them: only entry points (web/commands.py) import app.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from jobs.intake import JobIntake
from store import AsyncStore
from web.metrics import ServiceMetrics
from web.settings import ServiceSettings

if TYPE_CHECKING:
    from jobs.worker_processes import WorkerProcesses
    from jobs.workers import ScanWorkers
    from scanner.publish import ReportAttacher
    from scanner.registry.client import RegistryClient
    from scanner.scan import Scanner


@dataclass
class Services:
    """What request handlers need, built once per application."""

    settings: ServiceSettings
    store: AsyncStore
    metrics: ServiceMetrics
    client: RegistryClient | None = None
    scanner: Scanner | None = None
    workers: ScanWorkers | None = None  # scans in this process (GPUBADGE_WORKER_PROCESSES=0)
    worker_processes: WorkerProcesses | None = None  # scans in this service's worker processes
    attacher: ReportAttacher | None = None  # GPUBADGE_ATTACH_REPORTS
    intake: JobIntake = field(init=False)

    def __post_init__(self) -> None:
        self.intake = JobIntake(self.store, max_queued=self.settings.max_queued_scans)

    @property
    def runs_scans(self) -> bool:
        """Whether this service scans what it queues (in this process or its worker processes), as
        opposed to an API replica whose scans run in `gpubadge worker`s elsewhere."""
        return self.workers is not None or self.worker_processes is not None

    def wake_workers(self) -> None:
        """Jobs were committed: this process's workers look now (worker processes hear the commit)."""
        if self.workers is not None:
            self.workers.wake()

    def layer_progress(self) -> dict[str, str]:
        """Layer reads in flight for this service, by reference: this process's and its worker processes'."""
        progress = self.scanner.layer_progress() if self.scanner is not None else {}
        if self.worker_processes is not None:
            progress = {**self.worker_processes.layer_progress(), **progress}
        return progress


SERVICES = web.AppKey("services", Services)


def services_of(request: web.Request) -> Services:
    return request.app[SERVICES]


def services_of_app(app: web.Application) -> Services:
    return app[SERVICES]
