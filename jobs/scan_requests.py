"""Asking for a scan: the one path shared by the JSON API (POST /api/scans) and the UI form (POST /scans).

Both must parse the reference, apply the SSRF allowlist *before* anything is queued,
and coalesce into an existing job the same way, so the rule lives here once.
"""

from __future__ import annotations

from collections.abc import Callable

from jobs.intake import JobIntake, QueueFull
from jobs.settings import JobSettings
from scanner.registry.reference import ReferenceError, parse_reference
from store import Job, queries


class ScanRefused(Exception):
    """A scan request that is not queued; `status` is the HTTP status that fits, the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def request_scan(
    intake: JobIntake,
    settings: JobSettings,
    text: str,
    *,
    source: str,
    wake: Callable[[], None],
    rescan: bool = False,
) -> Job:
    """Queue a scan of `text` (a tag or digest reference) and return its job (maybe an existing one);
    `wake` tells this process's workers, if any, that it is committed. `rescan`: scan it again,
    reusing no stored report (rescans of one reference coalesce with each other, never with a plain
    scan).

    Raises ScanRefused(400) for a reference that does not parse and ScanRefused(403) for a
    registry outside the allowlist, which is then never contacted; ScanRefused(503) when the
    queue holds GPUBADGE_MAX_QUEUED_SCANS jobs.
    """
    try:
        reference = parse_reference(text.strip())
    except ReferenceError as exc:
        raise ScanRefused(400, str(exc)) from None
    if not settings.allows(reference.registry):
        raise ScanRefused(
            403, f"registry not on the allowlist: {reference.registry} (set GPUBADGE_REGISTRIES)"
        )
    if not await intake.has_room():
        raise ScanRefused(503, str(QueueFull(settings.max_queued_scans)))
    (job_id,) = await intake.store.enqueue(
        [(str(reference), reference.registry)],
        source=source,
        max_attempts=settings.max_attempts,
        rescan=rescan,
    )
    wake()
    job = await intake.store.run(queries.job, job_id)
    if job is None:  # pragma: no cover - enqueue committed it in the same process
        raise ScanRefused(500, f"scan job {job_id} vanished after it was queued")
    return job
