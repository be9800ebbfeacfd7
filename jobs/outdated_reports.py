"""Queueing a scan of every stored image an older analysis read (`gpubadge db rescan-outdated`).

A report an older gpubadge analysis wrote (`PlatformReport.outdated`) is never reused: its image is
read again at its next scan. An image that nobody pushes or asks about again keeps its old report
until then; after an upgrade, this queues those scans, by digest (the image that was judged,
whatever its tag points at now), the way any scan is queued, so the service's workers run them as
they run the rest.

One pass over the stored reports, a page at a time in digest order (`queries.report_page`, keyset
pages: a report saved meanwhile never shifts one). Bounded: at most `limit` scans are queued at once
and never past the queue's cap (`max_queued`); an image whose scan is already waiting is not queued
twice. Where that leaves outdated images unqueued, the pass either counts them as left for another
run or, given `wait_for_room`, waits there until the queue has drained to half of `limit` and goes
on from the same page, so that one pass converges a store of any size without reading it twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from store import StoreBackend, queries
from store.models import EnqueueBatch

SOURCE = "outdated"  # the jobs' `source`
PAGE = 500


@dataclass
class OutdatedScans:
    """What one pass found and did."""

    reports: int = 0  # stored image reports read
    outdated: int = 0  # of which an older analysis read
    queued: int = 0  # scans queued by this pass
    waiting: int = 0  # outdated, with a scan already waiting to run
    left: int = 0  # outdated and not queued: past `limit` or the queue's cap
    waits: int = 0  # times the pass waited for the queue to drain


def queue_outdated_scans(
    backend: StoreBackend,
    *,
    limit: int,
    max_queued: int,
    max_attempts: int,
    wait_for_room: Callable[[Callable[[], bool]], None] | None = None,
) -> OutdatedScans:
    """Queue a scan of each stored image an older analysis read, by digest; see the module's bounds.
    `wait_for_room(drained)` returns once `drained()` is true (it polls, or gives up by raising)."""
    found = OutdatedScans()

    def room() -> int:
        queued = backend.queued_for_intake(max_queued)
        return max(0, min(limit - queued, max_queued - queued))

    def drained() -> bool:
        return backend.queued_for_intake(max_queued) <= limit // 2

    def commit(wanted: list[tuple[str, str]]) -> None:
        if wanted:
            backend.enqueue_many([EnqueueBatch(list(wanted), source=SOURCE, max_attempts=max_attempts)])
            found.queued += len(wanted)
            wanted.clear()

    free = min(limit, room())
    after = ""
    while page := backend.run(queries.report_page, after=after, since=None, limit=PAGE):
        after = page[-1].digest or after
        found.reports += len(page)
        outdated = {
            f"{report.registry}/{report.repository}@{report.digest}": report.registry
            for report in page
            # nothing to name it by: an error report, which no scan reuses anyway
            if report.digest
            and report.registry
            and report.repository
            and any(platform.outdated for platform in report.platforms)
        }
        found.outdated += len(outdated)
        waiting = backend.run(queries.waiting_references, list(outdated)) if outdated else set()
        found.waiting += len(waiting)
        wanted: list[tuple[str, str]] = []
        for reference, registry in outdated.items():
            if reference in waiting:
                continue
            if free == 0 and wait_for_room is not None:
                commit(wanted)
                wait_for_room(drained)
                found.waits += 1
                free = room()
            if free > 0:
                wanted.append((reference, registry))
                free -= 1
            else:
                found.left += 1
        commit(wanted)
    return found
