"""One process's scan machinery, built alike by `gpubadge serve` and `gpubadge worker`.

`ScanRuntime.start` builds the registry client, the scanner (its fleet architectures read from
the store), the report attacher (GPUBADGE_ATTACH_REPORTS, with its companions) and, unless the
process only serves the API, the leased scan workers: in this process, or (`worker_processes`,
`serve`'s default) in supervised worker processes (`jobs.worker_processes`) whose reports reach
this process's metrics, progress and attacher; `stop` drains the workers (`drain_seconds`) and
closes the rest in order. The one mapping
from settings to worker settings (`worker_settings`) and from outcomes to metrics and attachments
(`worker_events`) live here, so the two roles cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from jobs.architectures import FleetArchitectures
from jobs.companions import companions
from jobs.metrics import JobMetrics
from jobs.retention import JobRetention, RetentionPolicy
from jobs.settings import JobSettings
from jobs.worker_processes import WorkerProcesses
from jobs.workers import JobOutcome, ScanWorkers, WorkerEvents, WorkerSettings
from placement.inventory import Server
from scanner.models import ImageReport
from scanner.publish import ReportAttacher
from scanner.registry.client import RegistryClient
from scanner.scan import Scanner
from store import AsyncStore, LeaseExpiry


def worker_settings(settings: JobSettings) -> WorkerSettings:
    """The one mapping from service settings to worker settings (serve and worker share it)."""
    return WorkerSettings(
        concurrency=settings.workers,
        per_registry=settings.per_registry_scans,
        preempt_after=settings.preempt_after,
        backoff_base=settings.retry_backoff,
        lease_seconds=settings.lease_seconds,
    )


def worker_events(metrics: JobMetrics, attacher: ReportAttacher | None = None) -> WorkerEvents:
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


@dataclass
class ScanRuntime:
    """The registry client, the scanner, the attacher and the workers of one process."""

    client: RegistryClient
    scanner: Scanner
    attacher: ReportAttacher | None
    workers: ScanWorkers | None
    drain_seconds: float
    retention: JobRetention | None = None
    processes: WorkerProcesses | None = None

    @classmethod
    async def start(
        cls,
        settings: JobSettings,
        store: AsyncStore,
        metrics: JobMetrics,
        *,
        static_fleet: Iterable[Server] = (),
        run_workers: bool = True,
        worker_processes: int = 0,
        sweep: bool = True,
    ) -> ScanRuntime:
        """Build the machinery over `store` and, with `run_workers`, start claiming jobs: here, or in
        `worker_processes` supervised processes. `sweep`: this process deletes finished jobs past
        retention (with workers here; of supervised processes, the first does)."""
        client = RegistryClient(settings, defer_retry_after=True)
        metrics.count_registry_bytes(client.received_by_registry)
        metrics.count_transfer_cutoffs(client.cutoffs_by_registry)

        def on_result(report: ImageReport) -> None:
            for host, remaining in client.rate_limits.items():
                metrics.rate_limit.set(float(remaining), host)

        scanner = Scanner(
            client,
            store.scan_cache,
            settings,
            on_result=on_result,
            publish_facts=True,
            fleet_architectures=FleetArchitectures(store, static_fleet),
        )
        metrics.count_inline_analyses(scanner.inline_analyses)
        attacher = None
        if settings.attach_reports:
            attacher = ReportAttacher(
                settings,
                client,
                on_result=lambda result: metrics.referrer_attach.inc(result),
                companions=companions(settings),
                on_companion=lambda _, result: metrics.nfd_attach.inc(result),
            )
            metrics.nfd_cache_source = attacher.companion_bytes
        runtime = cls(client, scanner, attacher, None, settings.drain_seconds)
        if run_workers and worker_processes > 0:
            runtime.processes = WorkerProcesses(settings, metrics, attacher, count=worker_processes)
            try:
                await runtime.processes.start()
            except BaseException:
                await runtime.stop()
                raise
        elif run_workers:
            workers = ScanWorkers(store, scanner, worker_settings(settings), worker_events(metrics, attacher))
            try:
                await scanner.start_analysis()  # before the first claim, not inside the first burst
                await workers.start()
            except BaseException:
                await runtime.stop()
                raise
            runtime.workers = workers
            if sweep:
                runtime.retention = JobRetention(
                    store,
                    RetentionPolicy(settings.job_retention_seconds, settings.job_retention_count),
                    deployments=RetentionPolicy(
                        settings.deployment_retention_seconds, settings.deployment_retention_count
                    ),
                    on_swept=lambda deleted: metrics.jobs_deleted.inc(amount=float(deleted)),
                    on_deployments_swept=lambda deleted: metrics.deployments_deleted.inc(
                        amount=float(deleted)
                    ),
                )
                runtime.retention.start()
        return runtime

    async def stop(self) -> None:
        """Stop claiming and drain running scans (what cannot finish goes back to the queue), then
        stop the analysis processes, the attacher's retries and the registry client."""
        if self.retention is not None:
            await self.retention.stop()
        if self.processes is not None:
            await self.processes.stop(self.drain_seconds)
        if self.workers is not None:
            await self.workers.stop(drain_timeout=self.drain_seconds)
        await self.scanner.close()
        if self.attacher is not None:
            await self.attacher.stop()
        await self.client.close()
