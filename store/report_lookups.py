"""What a reference stands for, kept in memory between requests: `queries.reference_report`'s answer.

Every placement request (eligibility, constraints, deployments, admission) starts by looking up
its image's report. Under a busy fleet that store round trip, not the decision, was the slow part
of an answer (a thread hop, the database's own backend and the hop back, each waiting for a core).
`ReportLookups` keeps the answers it found, so a scheduler asking about the same images again and
again pays the round trip once.

An answer is reused only while nothing may have changed it:

- this process's own writes of tags or reports (`REPORT_WRITES`, run through the store facade)
  forget every answer when they commit;
- a settle event (a job finished, a report or tag written, a deleted tag or manifest: on
  PostgreSQL from any replica through NOTIFY, on a SQLite file shared by `serve --workers 0` and
  its workers through `store.sqlite_notify`) forgets every answer, and so does a resync (a lost
  listener connection);
- an answer older than `reuse_seconds` while another process's writes reach this one as events,
  or older than `LOCAL_REUSE_SECONDS` when they cannot (a SQLite file that a `gpubadge scan` of
  another process may write without telling), is read again.

A lookup that was in flight while something changed is answered but not kept (a generation
count), so a read that raced a write never outlives it. Only found answers are kept: an unknown
reference is asked again each time (it is about to be scanned, or never will be). At most
`entries` answers are kept, the least recently used going first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from scanner.models import ImageReport, PlatformReport

LOCAL_REUSE_SECONDS = 1.0  # without other processes' events: the same bound as a waiter's re-check

Key = tuple[str, str, str, str | None]  # registry, repository, tag ("" for none), digest
Found = tuple[str | None, ImageReport | None, PlatformReport | None]  # queries.reference_report


class _Kept(NamedTuple):
    found: Found
    at: float  # clock() when it was read


class ReportLookups:
    """Reference lookups reused until a write or an event may have changed them (see the module)."""

    def __init__(
        self,
        read: Callable[[str, str, str, str | None], Awaitable[Found]],
        *,
        entries: int = 512,
        reuse_seconds: float = 30.0,
        cross_process: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self.entries = entries
        self.reuse_seconds = reuse_seconds
        self._cross_process = cross_process
        self._clock = clock
        self._kept: OrderedDict[Key, _Kept] = OrderedDict()
        self._generation = 0
        self.reads = 0  # round trips made (tests, diagnostics)

    async def reference_report(self, registry: str, repository: str, tag: str, digest: str | None) -> Found:
        """`queries.reference_report(registry, repository, tag, digest)`, from memory when still valid."""
        key: Key = (registry, repository, tag, digest)
        kept = self._kept.get(key)
        now = self._clock()
        if kept is not None and now - kept.at < self._longest_reuse():
            self._kept.move_to_end(key)
            return kept.found
        generation = self._generation
        self.reads += 1
        found = await self._read(registry, repository, tag, digest)
        if found[0] is not None and generation == self._generation and self.entries > 0:
            self._kept[key] = _Kept(found, now)
            self._kept.move_to_end(key)
            while len(self._kept) > self.entries:
                self._kept.popitem(last=False)
        return found

    def forget(self) -> None:
        """Something may have changed any reference's answer: read each again, and keep no lookup
        that was in flight meanwhile."""
        self._generation += 1
        self._kept.clear()

    def _longest_reuse(self) -> float:
        return self.reuse_seconds if self._cross_process() else min(self.reuse_seconds, LOCAL_REUSE_SECONDS)
