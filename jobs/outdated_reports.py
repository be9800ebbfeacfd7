"""Queueing a scan of every stored image an older analysis read (`gpubadge db rescan-outdated`).

A report an older gpubadge analysis wrote (`PlatformReport.outdated`) is never reused: its image is
read again at its next scan. An image that nobody pushes or asks about again keeps its old report
until then; after an upgrade, this queues those scans in one go, by digest (the image that was
judged, whatever its tag points at now), the way any scan is queued, so the service's workers run
them as they run the rest.

Bounded: the reports are read a page at a time (`queries.report_page`, keyset pages), at most
`limit` scans are queued per run and never past the queue's cap (`max_queued_scans`), so a store of
a million reports is converged by running it again as the queue drains; an image whose scan is
already waiting is not queued twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from store import StoreBackend, queries
from store.models import EnqueueBatch

SOURCE = "outdated"  # the jobs' `source`
PAGE = 500


@dataclass
class OutdatedScans:
    """What one run found and did."""

    reports: int = 0  # stored image reports read
    outdated: int = 0  # of which an older analysis read
    queued: int = 0  # scans queued by this run
    waiting: int = 0  # outdated, with a scan already waiting to run
    left: int = 0  # outdated and not queued: past `limit` or the queue's cap


def queue_outdated_scans(
    backend: StoreBackend, *, limit: int, max_queued: int, max_attempts: int
) -> OutdatedScans:
    """Queue a scan of each stored image an older analysis read, by digest; see the module's bounds."""
    found = OutdatedScans()
    room = min(limit, max(0, max_queued - backend.queued_for_intake(max_queued)))
    after = ""
    while page := backend.run(queries.report_page, after=after, since=None, limit=PAGE):
        after = page[-1].digest or after
        wanted: list[tuple[str, str]] = []
        for report in page:
            found.reports += 1
            if not any(platform.outdated for platform in report.platforms):
                continue
            if not (report.digest and report.registry and report.repository):
                continue  # nothing to name it by: an error report, which no scan reuses anyway
            found.outdated += 1
            reference = f"{report.registry}/{report.repository}@{report.digest}"
            if backend.run(queries.pending_job_for, reference) is not None:
                found.waiting += 1
            elif len(wanted) + found.queued < room:
                wanted.append((reference, report.registry))
            else:
                found.left += 1
        if wanted:
            backend.enqueue_many([EnqueueBatch(wanted, source=SOURCE, max_attempts=max_attempts)])
            found.queued += len(wanted)
    return found
