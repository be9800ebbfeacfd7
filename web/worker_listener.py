"""The HTTP side of `gpubadge worker --metrics-port`: the worker process's /healthz and /metrics.

The job runtime serves nothing itself (jobs/ imports no web/); the worker command hands
`health_listener` to `jobs.worker_process.run_workers`, which starts it once the workers run and
stops it after they drained. The routes are web/health.py's, behind the same connection guard as
`serve`'s listeners and, with `public_reads=false`, the same private-reads middleware (/metrics
asks for the API token; /healthz stays open for probes), over the worker's own store, metrics and
workers.
"""

from __future__ import annotations

from aiohttp import web

from jobs.runtime import ScanRuntime
from jobs.worker_process import Listener, Stop
from store import AsyncStore
from web import health
from web.guards.connections import GuardedRunner, connection_limits
from web.guards.read_access import private_reads
from web.metrics import ServiceMetrics
from web.settings import ServiceSettings
from web.state import SERVICES, Services


def health_listener(settings: ServiceSettings, metrics: ServiceMetrics, port: int) -> Listener:
    """Serve /healthz and /metrics on `port` at GPUBADGE_HOST once the workers run."""

    async def start(store: AsyncStore, runtime: ScanRuntime) -> Stop:
        services = Services(
            settings=settings, store=store, metrics=metrics, client=runtime.client, scanner=runtime.scanner
        )
        services.workers = runtime.workers
        services.attacher = runtime.attacher
        # With private reads, /metrics needs the API token here as on `serve`'s port (/healthz stays open).
        middlewares = [] if settings.public_reads else [private_reads(settings)]
        app = web.Application(middlewares=middlewares)
        app[SERVICES] = services
        health.setup_routes(app)
        runner = GuardedRunner(app, connection_limits(settings), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, settings.host, port).start()
        return runner.cleanup

    return start
