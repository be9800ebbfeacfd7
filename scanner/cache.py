"""What a scan needs from storage, as an async protocol the store satisfies.

The scanner reuses stored reports by digest, remembers tags (and skips the HEAD for a tag
never seen), and shares each layer's evidence across images. It asks for those through this
protocol, so scanner/ never imports the store (or any SQL), and every call is awaited off the
event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from scanner.models import ImageReport, PlatformReport


class ScanCache(Protocol):
    async def report(self, digest: str) -> ImageReport | None: ...

    async def platform_report(self, digest: str) -> PlatformReport | None: ...

    async def stored(self, digest: str) -> tuple[ImageReport | None, PlatformReport | None]:
        """`report(digest)` and `platform_report(digest)` in one read."""
        ...

    async def save_report(self, report: ImageReport, *, with_next_write: bool = False) -> None:
        """Store the report and, when it names a tag, remember that the tag points at its digest:
        one write, committed before this returns; with `with_next_write`, committed with the
        caller's next write instead (a scan job's end: the service's workers)."""
        ...

    async def record_tag(self, registry: str, repository: str, tag: str, digest: str) -> None: ...

    async def resolve_tag(self, registry: str, repository: str, tag: str) -> str | None: ...

    async def layer_evidence(self, digest: str) -> str | None: ...

    async def layer_evidences(self, digests: Sequence[str]) -> dict[str, str]:
        """`layer_evidence` of each of `digests`, in one read: those it holds, by digest."""
        ...

    async def scan_in_flight(self, job_id: str) -> bool:
        """Whether scan job `job_id` runs now under a lease that has not lapsed: only then is the
        pending report it wrote still being completed."""
        ...

    async def save_layer_evidence(self, digest: str, evidence_json: str) -> None:
        """Keep a layer's cache entry; `layer_evidence` answers with it from now on, in this
        process at least (the store may commit it with its next write)."""
        ...
