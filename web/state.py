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
    workers: ScanWorkers | None = None
    attacher: ReportAttacher | None = None  # GPUBADGE_ATTACH_REPORTS
    intake: JobIntake = field(init=False)

    def __post_init__(self) -> None:
        self.intake = JobIntake(self.store, max_queued=self.settings.max_queued_scans)

    def wake_workers(self) -> None:
        if self.workers is not None:
            self.workers.wake()


SERVICES = web.AppKey("services", Services)


def services_of(request: web.Request) -> Services:
    return request.app[SERVICES]


def services_of_app(app: web.Application) -> Services:
    return app[SERVICES]
