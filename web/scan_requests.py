"""Asking for a scan: the one path shared by the JSON API (POST /api/scans) and the UI form (POST /scans).

Both must parse the reference, apply the SSRF allowlist *before* anything is queued,
and coalesce into an existing job the same way, so the rule lives here once.
"""

from __future__ import annotations

from scanner.registry.reference import ReferenceError, parse_reference
from store import Job, queries
from web.intake import QueueFull
from web.security import token_matches
from web.state import Services

__all__ = ["ScanRefused", "request_scan", "token_matches"]


class ScanRefused(Exception):
    """A scan request that is not queued; `status` is the HTTP status that fits, the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def request_scan(services: Services, text: str, *, source: str, rescan: bool = False) -> Job:
    """Queue a scan of `text` (a tag or digest reference) and return its job (maybe an existing one).
    `rescan`: scan it again, reusing no stored report (rescans of one reference coalesce with each
    other, never with a plain scan).

    Raises ScanRefused(400) for a reference that does not parse and ScanRefused(403) for a
    registry outside the allowlist, which is then never contacted; ScanRefused(503) when the
    queue holds GPUBADGE_MAX_QUEUED_SCANS jobs.
    """
    try:
        reference = parse_reference(text.strip())
    except ReferenceError as exc:
        raise ScanRefused(400, str(exc)) from None
    if not services.settings.allows(reference.registry):
        raise ScanRefused(
            403, f"registry not on the allowlist: {reference.registry} (set GPUBADGE_REGISTRIES)"
        )
    if not await services.intake.has_room():
        raise ScanRefused(503, str(QueueFull(services.settings.max_queued_scans)))
    (job_id,) = await services.store.enqueue(
        [(str(reference), reference.registry)],
        source=source,
        max_attempts=services.settings.max_attempts,
        rescan=rescan,
    )
    services.wake_workers()
    job = await services.store.run(queries.job, job_id)
    if job is None:  # pragma: no cover - enqueue committed it in the same process
        raise ScanRefused(500, f"scan job {job_id} vanished after it was queued")
    return job
