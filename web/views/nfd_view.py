"""The image page's view of NFD image-compatibility artifacts: attached or not, and their rules.

For the index and each platform image that needs a GPU, what this process attached (or reused,
or left to another tool's artifact) is known from the attacher. Otherwise (another process
attached it, or a restart) the artifact is read back from the registry as NFD's client reads it
(newest by `org.opencontainers.image.created`, `layers[0]`), bounded by LOOKUP_SECONDS and
remembered for a minute, so a page view costs at most a few small registry reads. The document
is decoded once, in a thread, when it is read (`jobs.companions.parse_nfd`, within the `nfd_*`
settings' bounds); views use that decoded, bounded form, and the page renders them off the
event loop (`web.routes.pages.detail_context`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from jobs.companions import NFD_KIND, NfdDocument
from scanner.models import ImageReport
from scanner.publish import AttachStatus, ReportAttacher
from scanner.registry.errors import RegistryError

log = logging.getLogger(__name__)

LOOKUP_SECONDS = 3.0

STATE_WORDS = {
    "pending": "being attached",
    "attached": "attached by gpubadge",
    "reused": "attached (an earlier identical one, reused)",
    "deferred": "another tool's artifact is the one NFD reads; gpubadge left it",
    "retrying": "attach failed; retrying",
    "failed": "attach failed",
    "skipped": "not attached",
    "found": "found in the registry",
    "absent": "none in the registry",
}


@dataclass
class NfdView:
    subject: str
    label: str
    state: str
    words: str
    artifact: str | None = None
    created: str | None = None
    error: str | None = None
    sets: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _view(subject: str, label: str, status: AttachStatus | None, problem: str | None = None) -> NfdView:
    if status is None:
        return NfdView(subject, label, "unknown", "not known", error=problem)
    view = NfdView(
        subject, label, status.state, STATE_WORDS.get(status.state, status.state), status.artifact, status.created,
        status.error,
    )  # fmt: skip
    document = status.document.value if status.document is not None else None
    if isinstance(document, NfdDocument):  # decoded once, bounded, when it was read or built
        view.sets, view.warnings = document.sets, document.warnings
        view.error = document.error or view.error
    return view


async def nfd_views(attacher: ReportAttacher | None, report: ImageReport) -> list[NfdView]:
    """One view per manifest of `report` that needs a GPU (or has a known artifact); [] when NFD is off."""
    if attacher is None or not any(c.kind == NFD_KIND for c in attacher.companions):
        return []
    if report.pending or report.error or not report.digest or not report.registry or not report.repository:
        return []
    subjects = [(report.digest, "index" if len(report.platforms) > 1 else "image", report.gpu_required)]
    subjects += [
        (p.digest, p.platform, p.gpu.required) for p in report.platforms if p.digest != report.digest
    ]
    registry, repository = report.registry, report.repository

    async def one(digest: str, label: str) -> tuple[AttachStatus | None, str | None]:
        try:
            return await attacher.lookup_companion(registry, repository, digest, NFD_KIND), None
        except (RegistryError, OSError) as exc:
            return None, f"could not read the registry: {exc}"

    wanted = [(d, label) for d, label, needs in subjects if needs or attacher.companion_status(d, NFD_KIND)]
    tasks = [asyncio.ensure_future(one(digest, label)) for digest, label in wanted]
    if not tasks:
        return []
    done, late = await asyncio.wait(tasks, timeout=LOOKUP_SECONDS)
    for task in late:
        task.cancel()
    found: list[tuple[str, str, AttachStatus | None, str | None]] = []
    for (digest, label), task in zip(wanted, tasks, strict=True):
        if task not in done:
            found.append((digest, label, None, f"the registry did not answer within {LOOKUP_SECONDS:g} s"))
        elif (problem := task.exception()) is not None:
            log.warning("reading the NFD artifact of %s failed: %r", digest, problem)
            found.append((digest, label, None, f"could not read it: {type(problem).__name__}"))
        else:
            status, error = task.result()
            found.append((digest, label, status, error))
    return [_view(*item) for item in found]  # the documents were decoded when read, off the loop
